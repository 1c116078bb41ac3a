"""A minimal training loop used by the dynamic-analysis tests; writes a log and a checkpoint in cwd."""
import sys

import torch
from torch import nn

model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
opt = torch.optim.Adam(model.parameters())
log = open("train.log", "w")
for step in range(100):
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    log.write(f"{step} {loss.item()}\n")
    torch.save(model.state_dict(), "ckpt.pt")
print("done", file=sys.stderr)
