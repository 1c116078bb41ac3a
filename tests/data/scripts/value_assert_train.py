"""A sanity check on values computed on the GPU, as detection code asserts its boxes are well
formed (`assert (boxes[:, 2:] >= boxes[:, :2]).all()`): true on any GPU; the value read here is a
stand-in, answered as the check passes. --host: the same check on host boxes (real values), which
fails as the script's own."""
import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--host", action="store_true")
args = p.parse_args()
model = nn.Linear(16, 4).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    b = model(torch.randn(8, 16, device="cuda")).sigmoid()
    boxes = torch.cat([b[:, :2] - b[:, 2:] / 2, b[:, :2] + b[:, 2:] / 2], 1)
    if args.host:
        boxes = torch.tensor([[0.0, 0.0, -1.0, 1.0]])
    assert (boxes[:, 2:] >= boxes[:, :2]).all(), "malformed boxes"
    b.sum().backward()
    opt.step()
    opt.zero_grad()
