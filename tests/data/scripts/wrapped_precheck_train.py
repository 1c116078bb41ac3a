"""A pre-flight inference at batch 1 through a wrapper that turns grad off inside its forward (as
YOLOv5's AMP check calls AutoShape), then training at --batch-size."""
import argparse
import copy

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=16)
args = p.parse_args()
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                      nn.Linear(16, 10)).cuda()


class Inference(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.model = m

    def forward(self, im):
        with torch.no_grad():
            return self.model(im)


Inference(copy.deepcopy(model))(torch.zeros(1, 3, 96, 64, device="cuda"))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    x = torch.randn(args.batch_size, 3, 32, 32, device="cuda")
    nn.functional.cross_entropy(model(x), torch.randint(0, 10, (args.batch_size,), device="cuda")).backward()
    opt.step()
    opt.zero_grad()
