"""Data-parallel training as torchrun launches it (one process per GPU, NCCL, DDP)."""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("nccl")
rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
model = DDP(nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10)).cuda(), device_ids=[local])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data))
for epoch in range(2):
    for x, y in loader:
        x, y = x.cuda(local), y.cuda(local)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        dist.all_reduce(loss.detach())
        if rank == 0:
            print(loss.item())
dist.destroy_process_group()
