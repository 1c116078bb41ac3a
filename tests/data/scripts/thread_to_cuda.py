"""Weights moved to the GPU in worker threads (transformers loads checkpoints in a ThreadPoolExecutor)."""
import concurrent.futures

import torch
from torch import nn

with concurrent.futures.ThreadPoolExecutor(2) as pool:
    weight, bias = pool.map(lambda t: t.to("cuda"), [torch.randn(256, 1024), torch.randn(256)])
model = nn.Linear(1024, 256)
model.weight, model.bias = nn.Parameter(weight), nn.Parameter(bias)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    model(torch.randn(4, 1024).cuda()).sum().backward()
    opt.step()
