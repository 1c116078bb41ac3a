"""The reference trainers' AverageMeter: top-1 accuracy kept as a 0-d device tensor, then gathered
into one tensor with torch.tensor([sum, count], device=...) to be all-reduced."""
import torch
from torch import nn


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n

    def reduced(self):
        total = torch.tensor([self.sum, self.count], dtype=torch.float32, device=torch.accelerator.current_accelerator())
        return total.tolist()


model = nn.Linear(32, 10).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
top1 = AverageMeter()
for _ in range(4):
    x, y = torch.randn(16, 32).cuda(), torch.randint(0, 10, (16,)).cuda()
    out = model(x)
    top1.update((out.argmax(1) == y).float().mean() * 100, x.size(0))
    nn.functional.cross_entropy(out, y).backward()
    opt.step()
    opt.zero_grad()
    total, count = top1.reduced()
