"""Multi-scale training as detection trainers do it: each batch resized to a size drawn from a
list (YOLO's multi-scale, DETR's RandomResize); the job's peak follows the largest size it will
draw. --fixed: one size for every batch."""
import random
import sys

import torch
from torch import nn

random.seed(0)
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    size = 64 if "--fixed" in sys.argv else random.choice([64, 96, 128, 160])
    x = torch.nn.functional.interpolate(torch.randn(8, 3, 64, 64), size=(size, size)).cuda()
    loss = nn.functional.cross_entropy(model(x), torch.randint(0, 10, (8,)).cuda())
    opt.zero_grad()
    loss.backward()
    opt.step()
