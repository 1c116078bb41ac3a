"""A loader that keeps its workers across epochs by reading one endless iterator with next() inside
its own __iter__ generator (YOLOv5's InfiniteDataLoader), and an evaluation at each epoch's end."""
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Forever:
    def __init__(self, sampler):
        self.sampler = sampler

    def __iter__(self):
        while True:
            yield from iter(self.sampler)


class InfiniteLoader(DataLoader):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        object.__setattr__(self, "batch_sampler", Forever(self.batch_sampler))
        self.iterator = super().__iter__()

    def __len__(self):
        return len(self.batch_sampler.sampler)

    def __iter__(self):
        for _ in range(len(self)):
            yield next(self.iterator)


data = TensorDataset(torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))
train = InfiniteLoader(data, batch_size=8, shuffle=True)
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                      nn.Linear(16, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(3):
    model.train()
    for x, y in train:
        nn.functional.cross_entropy(model(x.cuda()), y.cuda()).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        for x, _ in DataLoader(data, batch_size=64):
            model(x.cuda()).argmax(1)
