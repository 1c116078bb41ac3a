"""Gradient accumulation written twice, in each arm of an AMP switch (as engine.py of ConvNeXt and
DeiT do): with AMP on, the else arm never runs, and its periodic step is not a missed period."""
import argparse

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--amp", action="store_true")
p.add_argument("--accum", type=int, default=2)
args = p.parse_args()
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler()
for it in range(100):
    x, y = torch.randn(64, 256, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    if args.amp:
        with torch.autocast("cuda"):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss / args.accum).backward()
        if (it + 1) % args.accum == 0:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    else:
        loss = nn.functional.cross_entropy(model(x), y)
        (loss / args.accum).backward()
        if (it + 1) % args.accum == 0:
            opt.step()
            opt.zero_grad()
