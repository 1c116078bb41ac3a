"""Activation checkpointing written by hand: each block through torch.utils.checkpoint."""
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)) for _ in range(4)).cuda()
opt = torch.optim.AdamW(blocks.parameters())
for step in range(3):
    h = torch.randn(16, 128, device="cuda")
    for b in blocks:
        h = h + checkpoint(b, h, use_reentrant=False)
    h.square().mean().backward()
    opt.step()
    opt.zero_grad()
