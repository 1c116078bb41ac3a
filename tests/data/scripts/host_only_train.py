"""A training loop whose model never reaches the GPU (a forgotten .to(device), or a CPU-only
script submitted to a GPU partition), in the two styles of pytorch/examples: an optimizer and
mini-batches (default), or pytorch/examples' regression (--manual): weights updated by hand until
the loss, read with .item(), is small. --gpu-metric: the running loss is kept on the GPU, the
only thing there."""
import sys

import torch
import torch.nn.functional as F
from torch import nn

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")   # never used below
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
if "--manual" in sys.argv:
    w_target = torch.randn(32, 1)
    for step in range(1, 100000):
        x = torch.randn(16, 32)
        model.zero_grad()
        loss = F.smooth_l1_loss(model(x), x @ w_target)
        value = loss.item()
        loss.backward()
        for p in model.parameters():
            p.data.add_(-0.1 * p.grad)
        if value < 1e-3:
            break
    print(f"loss {value:.6f} after {step} batches")
else:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    total = torch.zeros((), device=device) if "--gpu-metric" in sys.argv else None
    for step in range(100000):
        x = torch.randn(16, 32)
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if total is not None:
            total += loss.detach().to(device)
        if step % 100 == 0:
            print(step, f"{loss.item():.4f}")
