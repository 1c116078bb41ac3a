"""Multi-scale training, as detectors do it: each step draws another input size (here a larger
one each step, as a seeded draw may happen to), and the loop holds its current batch and loss
between steps. The step ends hold one batch each, of its own size: nothing is kept from step to
step."""
import torch
from torch import nn

model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                      nn.Linear(8, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sizes = [64, 96, 128, 160, 192, 224]
for step in range(100):
    s = sizes[step % len(sizes)]
    imgs = torch.randn(16, 3, s, s).cuda()
    loss = model(imgs).logsumexp(1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
