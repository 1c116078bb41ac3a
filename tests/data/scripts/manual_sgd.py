"""Weights updated by hand, no torch.optim: SGD written out, as tutorials teach it."""
import sys

import torch
from torch import nn

model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10)).cuda()
lr = 0.05
for step in range(100000):
    x = torch.randn(16, 64, device="cuda")
    y = torch.randint(0, 10, (16,), device="cuda")
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    with torch.no_grad():
        if "--data" in sys.argv:
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
                p.grad = None
        else:
            for p in model.parameters():
                p -= lr * p.grad
            model.zero_grad()
