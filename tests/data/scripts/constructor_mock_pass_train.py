"""A learner that draws on the host in its constructor, before it is moved to the GPU: the width of
a layer from the host's (seeded) generator, and a mock batch sent through itself with a random crop
(BYOL and DINO learners do, to build their lazy parts). Both are the job's own host draws; the
crop is resized back, so the network's input never changes shape. ``--print-width``: the width the
job draws, on the host, no GPU needed."""

import sys

import torch
import torch.nn as nn
from torchvision import transforms as T

torch.manual_seed(0)


class Learner(nn.Module):
    def __init__(self):
        super().__init__()
        self.crop = T.RandomResizedCrop((32, 32), scale=(0.2, 1.0))
        self.width = int(torch.empty(1).uniform_(8, 64).item())
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(8 * 32 * 32, self.width), nn.ReLU(), nn.Linear(self.width, 10))
        self.forward(torch.randn(2, 3, 32, 32), torch.zeros(2, dtype=torch.long))   # the mock pass

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.net(self.crop(x)), y)


model = Learner()
if "--print-width" in sys.argv:
    print(model.width)
    sys.exit(0)
model = model.cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x, y = torch.rand(16, 3, 32, 32).cuda(), torch.randint(0, 10, (16,)).cuda()
    loss = model(x, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("done")
