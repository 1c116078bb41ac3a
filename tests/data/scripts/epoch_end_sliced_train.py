"""An evaluation at each epoch's end, at a batch larger than the training one, where the training
batches do not come from a DataLoader vest can end early: sliced from tensors held in memory
(--sliced), or read one ahead by a generator that has drained its DataLoader by the epoch's last
step (--prefetch, as timm's PrefetchLoader does)."""
import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["sliced", "prefetch"], default="sliced")
args = p.parse_args()

model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
images, labels = torch.randn(48, 3, 64, 64), torch.randint(0, 10, (48,))
held_out = torch.randn(64, 3, 64, 64)


def prefetched(loader):
    ahead = None
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        if ahead is not None:
            yield ahead
        ahead = (x, y)
    yield ahead


def batches():
    if args.mode == "prefetch":
        yield from prefetched(DataLoader(TensorDataset(images[:24], labels[:24]), batch_size=8))
        return
    order = torch.randperm(len(images))
    for i in range(0, len(images), 8):
        idx = order[i:i + 8]
        yield images[idx].cuda(), labels[idx].cuda()


for epoch in range(2):
    for x, y in batches():
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        print("eval", model(held_out.cuda()).argmax(1).float().mean().item())
