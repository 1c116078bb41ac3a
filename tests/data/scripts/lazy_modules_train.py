"""Lazy modules (nn.LazyConv2d, nn.LazyLinear, nn.LazyBatchNorm2d): moved to the GPU before
their shapes are known, made by a first forward on a dummy batch, then trained with AdamW."""
import torch
from torch import nn

model = nn.Sequential(nn.LazyConv2d(16, 3), nn.LazyBatchNorm2d(), nn.ReLU(), nn.Flatten(), nn.LazyLinear(10)).cuda()
with torch.no_grad():
    model(torch.zeros(1, 3, 32, 32, device="cuda"))
assert not any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters())
assert all(p.is_cuda for p in model.parameters()) and model[4].weight.shape == (10, 16 * 30 * 30)
opt = torch.optim.AdamW(model.parameters())
for step in range(3):
    x = torch.randn(8, 3, 32, 32, device="cuda")
    loss = nn.functional.cross_entropy(model(x), torch.randint(0, 10, (8,), device="cuda"))
    loss.backward()
    opt.step()
    opt.zero_grad()
