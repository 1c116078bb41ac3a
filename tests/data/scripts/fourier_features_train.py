"""Random Fourier features kept as a frozen nn.Parameter (requires_grad=False: fixed by design, as
denoising-diffusion-pytorch's random sinusoidal embedding keeps them), with the optimizer built
over model.parameters(): 32 floats that no stage ever unfreezes."""
import math

import torch
import torch.nn as nn


class FourierEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weights = nn.Parameter(torch.randn(dim // 2), requires_grad=False)

    def forward(self, t):
        f = t[:, None] * self.weights[None] * 2 * math.pi
        return torch.cat((f.sin(), f.cos()), dim=-1)


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = FourierEmb(64)
        self.net = nn.Sequential(nn.Linear(256 + 64, 1024), nn.SiLU(), nn.Linear(1024, 256))

    def forward(self, x, t):
        return self.net(torch.cat((x, self.emb(t)), dim=-1))


model = Denoiser().cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
for step in range(5):
    x, t = torch.randn(64, 256).cuda(), torch.rand(64).cuda()
    noise = torch.randn_like(x)
    loss = nn.functional.mse_loss(model(x + noise * t[:, None], t), noise)
    opt.zero_grad()
    loss.backward()
    opt.step()
