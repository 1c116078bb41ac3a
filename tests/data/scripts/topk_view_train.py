"""Top-k accuracy as the ImageNet examples of torch < 1.7 wrote it: `correct[:k].view(-1)` of a
transposed (non-contiguous) tensor, which raises on any device since (view of a non-contiguous
tensor); the fake tensors raise their own error (torch._refs) for it. --reshape: the fixed
form, which runs."""
import sys

import torch
from torch import nn

model = nn.Linear(8, 10).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x, y = torch.randn(16, 8, device="cuda"), torch.randint(0, 10, (16,), device="cuda")
    out = model(x)
    _, pred = out.topk(5, 1, True, True)
    correct = pred.t().eq(y.view(1, -1).expand_as(pred.t()))
    flat = correct[:5].reshape(-1) if "--reshape" in sys.argv else correct[:5].view(-1)
    loss = nn.functional.cross_entropy(out, y) + 0 * flat.float().sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
