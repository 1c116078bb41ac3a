"""An ImageNet-style loop on a synthetic data set: the per-sample augmentations are torchvision v2
transforms (nn.Modules, called on host tensors of one image, C x H x W), the DataLoader batches
them, and the model sees N x C x H x W."""
import argparse

import torch
from torch import nn
from torchvision.transforms import v2 as T

p = argparse.ArgumentParser()
p.add_argument("-b", "--batch-size", type=int, default=8)
args = p.parse_args()


class Synthetic(torch.utils.data.Dataset):
    def __init__(self, n, transform):
        self.n, self.transform = n, transform

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        img = torch.randint(0, 256, (3, 40, 40), dtype=torch.uint8)
        return self.transform(img), i % 10


train_tf = T.Compose([T.RandomResizedCrop(32, antialias=True), T.RandomHorizontalFlip(),
                      T.ToDtype(torch.float32, scale=True), T.Normalize([0.5] * 3, [0.25] * 3)])
loader = torch.utils.data.DataLoader(Synthetic(256, train_tf), batch_size=args.batch_size, shuffle=True,
                                     num_workers=2, pin_memory=True, drop_last=True)
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(16, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for epoch in range(10):
    for images, target in loader:
        images, target = images.cuda(non_blocking=True), target.cuda(non_blocking=True)
        loss = nn.functional.cross_entropy(model(images), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
