"""An optimizer that is no torch.optim one (fastai's Optimizer, a research repository's own class),
made from the model's parameters before the model is moved to the GPU, as fastai's Learner does
(create_opt, then model.to(device)); --after: made after the move. With a list of the parameters,
taken before the move, for clip_grad_norm_. On a GPU the move keeps the parameter objects."""
import sys

import torch
from torch import nn


class MomentumSGD:
    def __init__(self, params, lr=0.01, momentum=0.9):
        self.params, self.lr, self.momentum, self.state = list(params), lr, momentum, {}

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is None:
                continue
            buf = self.state.setdefault(p, torch.zeros_like(p))
            buf.mul_(self.momentum).add_(p.grad)
            p.add_(buf, alpha=-self.lr)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
if "--after" in sys.argv:
    model.to("cuda")
opt = MomentumSGD(model.parameters())
clipped = list(model.parameters())
model.to("cuda")
for step in range(10):
    loss = nn.functional.cross_entropy(model(torch.randn(64, 1024, device="cuda")),
                                       torch.randint(0, 10, (64,), device="cuda"))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(clipped, 1.0)
    opt.step()
    opt.zero_grad()
