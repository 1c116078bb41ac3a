"""A script that asks a CUDA API vest-slurm has no stand-in for: it would run on a GPU."""
import torch
from torch import nn

model = nn.Linear(8, 8).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
handle = torch.cuda.current_blas_handle()
for step in range(10):
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    opt.step()
