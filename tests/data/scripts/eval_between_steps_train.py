"""A detector-style loop whose epoch is one optimizer step long (YOLOv8 accumulates 64 images a
step, so a small data set's epoch is one step), validated at each epoch's end: the validation
keeps the candidates over a threshold (a shape the data decides, too many for vest's bound).
--in-step: the second epoch's training batch is the large one, masked in the training forward (a
detector's matcher over more boxes): a stop within a step, not between two."""
import sys

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU())
        self.head = nn.Linear(64, 5)

    def forward(self, x, masked=False):
        h = self.body(x)
        return self.head(h[h[:, 0] > 0] if masked else h)


model = Net().cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
in_step = "--in-step" in sys.argv
for epoch in range(3):
    for micro in range(4):
        n = 1 << 17 if in_step and epoch > 0 else 32
        model(torch.randn(n, 16, device="cuda"), masked=in_step).square().mean().backward()
    opt.step()
    opt.zero_grad()
    if in_step:
        continue   # (no validation)
    model.eval()
    with torch.no_grad():
        pred = model(torch.randn(1 << 17, 16, device="cuda"))
        kept = pred[pred[:, 4].sigmoid() > 0.25]
    model.train()
