"""A trainer that counts iterations, not epochs (Megatron-LM's train loop): it calls next() on its
data iterator itself, outside any for loop, for --train-iters iterations."""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ap = argparse.ArgumentParser()
ap.add_argument("--train-iters", type=int, default=50)
args = ap.parse_args()
data = DataLoader(TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,))), batch_size=32, shuffle=True)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
opt = torch.optim.AdamW(model.parameters())
iterator = iter(data)
for iteration in range(args.train_iters):
    x, y = next(iterator)
    loss = nn.functional.cross_entropy(model(x.cuda()), y.cuda())
    loss.backward()
    opt.step()
    opt.zero_grad()
