"""Activation checkpointing written by hand: each block through torch.utils.checkpoint (the
reentrant form runs a backward of its own inside the training's, per block), micro-batches
accumulated before each step."""
import argparse

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

p = argparse.ArgumentParser()
p.add_argument("--reentrant", action="store_true")
p.add_argument("--accumulate", type=int, default=1)
args = p.parse_args()

blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)) for _ in range(4)).cuda()
opt = torch.optim.AdamW(blocks.parameters())
for step in range(3):
    for micro in range(args.accumulate):
        h = torch.randn(16, 128, device="cuda", requires_grad=args.reentrant)
        for b in blocks:
            h = h + checkpoint(b, h, use_reentrant=args.reentrant)
        h.square().mean().backward()
    opt.step()
    opt.zero_grad()
