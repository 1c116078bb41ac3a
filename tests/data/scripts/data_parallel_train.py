"""The reference ImageNet trainer's habit: the model wrapped in nn.DataParallel on every GPU the
job has (one here), inputs left on the host for DataParallel to scatter."""
import torch
from torch import nn

model = nn.DataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for step in range(100):
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss = nn.functional.cross_entropy(model(x), y.cuda(non_blocking=True))
    opt.zero_grad()
    loss.backward()
    opt.step()
