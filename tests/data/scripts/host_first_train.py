"""A script that trains on the host before it uses the GPU, as a tutorial exported from a notebook
does (pytorch/tutorials' nn_tutorial: CPU sections, then "Using your GPU"), or a check on a few
batches on the CPU before the real run: --host-steps N on the CPU, then an MLP on the GPU."""
import argparse

import torch
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--host-steps", type=int, default=20)
args = ap.parse_args()
small = nn.Linear(64, 10)
opt = torch.optim.SGD(small.parameters(), lr=0.1)
for step in range(args.host_steps):
    loss = nn.functional.cross_entropy(small(torch.randn(32, 64)), torch.randint(0, 10, (32,)))
    loss.backward()
    opt.step()
    opt.zero_grad()
model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 10)).cuda()
opt = torch.optim.Adam(model.parameters())
for step in range(100):
    loss = nn.functional.cross_entropy(model(torch.randn(32, 64, device="cuda")), torch.randint(0, 10, (32,), device="cuda"))
    loss.backward()
    opt.step()
    opt.zero_grad()
