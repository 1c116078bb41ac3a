"""Fused optimizer steps, each one CUDA kernel over all parameters: SGD with momentum and Adagrad
with ``fused=True``, and Adam with a tensor learning rate (a scheduler-friendly capturable form),
three models trained side by side."""
import torch
from torch import nn

models = [nn.Linear(256, 256).cuda() for _ in range(3)]
opts = [torch.optim.SGD(models[0].parameters(), lr=0.1, momentum=0.9, fused=True),
        torch.optim.Adagrad(models[1].parameters(), lr=0.1, fused=True),
        torch.optim.Adam(models[2].parameters(), lr=torch.tensor(1e-3, device="cuda"), fused=True)]
for step in range(5):
    x = torch.randn(32, 256, device="cuda")
    loss = sum(m(x).square().mean() for m in models)
    loss.backward()
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)
