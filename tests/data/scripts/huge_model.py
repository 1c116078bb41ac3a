"""Builds a model of 8.6 billion parameters (34 GB in fp32) on the host, then trains it on the GPU:
under the estimate it must cost no host memory."""
import torch
from torch import nn

model = nn.Sequential(nn.Linear(65536, 65536, bias=False), nn.Linear(65536, 65536, bias=False))
model = model.cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    opt.zero_grad()
    model(torch.randn(2, 65536, device="cuda")).sum().backward()
    opt.step()
