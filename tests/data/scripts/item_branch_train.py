"""Loops that go on only with the samples the model gets right, as PyTorch's FGSM tutorial
attacks only correctly classified ones: `if pred.item() != target.item(): continue` before the
backward; the prediction read is a stand-in here (vest has no data). --train: an optimizer steps
after the backward; --attack (FGSM): no optimizer, the input's gradient taken; --no-read: every
sample goes on."""
import sys

import torch
from torch import nn

model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01) if "--train" in sys.argv else None
for step in range(50):
    x = torch.randn(1, 784, device="cuda", requires_grad=True)
    target = torch.tensor([3]).cuda()
    out = model(x)
    if "--no-read" not in sys.argv and out.argmax(1).item() != target.item():
        continue
    loss = nn.functional.cross_entropy(out, target)
    model.zero_grad()
    loss.backward()
    if opt is not None:
        opt.step()
    else:
        perturbed = (x + 0.1 * x.grad.sign()).detach()
