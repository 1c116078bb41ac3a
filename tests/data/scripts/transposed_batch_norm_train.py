"""A post-norm encoder whose norms are BatchNorm1d over the features of a (batch, length, features)
sequence, through a transpose (PatchTST and the TST family); --copy makes the transposed input
contiguous first."""
import argparse

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--copy", action="store_true")
args = p.parse_args()


class Norm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        x = x.transpose(1, 2)
        return self.bn(x.contiguous() if args.copy else x).transpose(1, 2)


class Layer(nn.Module):
    def __init__(self, d, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.n1, self.n2 = Norm(d), Norm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = (f(x).view(B, L, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1) @ v
        x = self.n1(x + self.o(a.transpose(1, 2).reshape(B, L, D)))
        return self.n2(x + self.ff(x))


net = nn.Sequential(*[Layer(16) for _ in range(3)]).cuda()
opt = torch.optim.Adam(net.parameters())
for step in range(4):
    net(torch.randn(512, 42, 16, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
