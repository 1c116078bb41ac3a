"""Weights made on the GPU where they live: one layer with device="cuda", one under a
torch.device("cuda") context, one after torch.set_default_device("cuda"); nothing moved with
.to() / .cuda()."""
import torch
from torch import nn

with torch.device("cuda"):
    head = nn.Linear(512, 10)
torch.set_default_device("cuda")
out = nn.Linear(10, 10)
torch.set_default_device("cpu")
model = nn.Sequential(nn.Linear(256, 512, device="cuda"), nn.ReLU(), head, out)
opt = torch.optim.Adam(model.parameters())
for step in range(100):
    loss = model(torch.randn(32, 256, device="cuda")).logsumexp(1).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
