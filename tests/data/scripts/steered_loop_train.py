"""Loops of forward passes that a GPU value ends, in one training step: --while: a fixed-point
iteration until the residual is small (an implicit layer's solve); --break: the same as a for loop
with a convergence break; --known: the loop's test on values copied from the host (the job's own);
--adaptive: an adaptive integrator that advances only on accepted steps (dopri5's pattern), which
stand-ins never accept; --equal: GPyTorch's checks, torch.equal(r, r) against NaN and allclose."""
import sys

import torch
import torch.nn as nn

f = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 256)).cuda()
opt = torch.optim.Adam(f.parameters(), lr=1e-5)
for step in range(5):
    x = torch.randn(64, 256, device="cuda")
    z, k = torch.zeros_like(x), 0
    if "--while" in sys.argv:
        res = torch.ones((), device="cuda") * 1e9
        while res > 1e-5 and k < 40:
            z_new = 0.5 * f(z) + x
            res = (z_new - z).norm() / z_new.norm()
            z, k = z_new, k + 1
    elif "--break" in sys.argv:
        for k in range(1, 41):
            z_new = 0.5 * f(z) + x
            done = (z_new - z).norm() < 1e-5 * z_new.norm()
            z = z_new
            if done:
                break
    elif "--known" in sys.argv:
        budget = torch.tensor([4.0]).cuda()   # copied from the host: its value is known
        while budget > 0:
            z = 0.5 * f(z) + x
            budget = budget - 1
    elif "--adaptive" in sys.argv:
        t, dt = torch.zeros((), device="cuda"), torch.full((), 0.1, device="cuda")
        while t < 1.0:
            k1 = f(z)
            k2 = f(z + dt * k1)
            if (dt * (k2 - k1)).abs().mean() <= 1.0:   # accept the step
                z, t = z + dt / 2 * (k1 + k2), t + dt
    else:
        z = f(x)
        if not torch.equal(z, z):
            raise RuntimeError("NaNs encountered")
        assert torch.allclose(z, f(x)), "the model is not deterministic"
    z.square().mean().backward()
    opt.step()
    opt.zero_grad()
