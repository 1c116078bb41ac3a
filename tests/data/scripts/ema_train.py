"""A training loop with an exponential moving average of the weights: a deep copy of the model."""
import argparse
import copy

import torch
import torchvision

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--no-ema", action="store_true")
a = p.parse_args()

model = torchvision.models.resnet18().cuda()
ema = None if a.no_ema else copy.deepcopy(model).requires_grad_(False)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for _ in range(10):
    x = torch.randn(a.batch_size, 3, 112, 112, device="cuda")
    y = torch.randint(0, 1000, (a.batch_size,), device="cuda")
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if ema is None:
        continue
    with torch.no_grad():
        for e, w in zip(ema.parameters(), model.parameters()):
            e.mul_(0.999).add_(w, alpha=0.001)
