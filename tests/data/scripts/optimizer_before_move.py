"""The optimizer is built before the model moves to the GPU (on a GPU .to() keeps the parameter
objects, so this trains normally)."""
import argparse

import torch
import torchvision

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=16)
a = p.parse_args()

model = torchvision.models.resnet18()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
model.to("cuda")
for _ in range(10):
    x = torch.randn(a.batch_size, 3, 112, 112, device="cuda")
    y = torch.randint(0, 1000, (a.batch_size,), device="cuda")
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
