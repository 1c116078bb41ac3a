"""Checkpointing as CycleGAN/pix2pix's save_networks does it: the network moved to the host for
torch.save of its state dict, then back to the GPU, between steps while the last step's loss (and
so its graph's leaves, the parameters) is still held. --save N: every N steps (0: never)."""
import argparse
import os

import torch
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--save", type=int, default=0)
args = ap.parse_args()
net = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)).cuda()
opt = torch.optim.Adam(net.parameters(), lr=1e-4)
for step in range(100):
    loss = net(torch.randn(64, 1024, device="cuda")).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if args.save and step % args.save == args.save - 1:
        torch.save(net.cpu().state_dict(), os.path.join("checkpoints", f"net_{step}.pth")
                   if os.path.isdir("checkpoints") else f"net_{step}.pth")
        net.cuda()
