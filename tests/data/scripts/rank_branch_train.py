"""Chooses its DDP branch by the launcher's RANK, in the style of nanoGPT's train.py: under torchrun
a process group and DDP, under a plain `python` one process and no DDP."""
import os

import torch
import torch.distributed as dist
from torch import nn

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    dist.init_process_group("nccl")
    local = int(os.environ["LOCAL_RANK"])
    device = f"cuda:{local}"
    torch.cuda.set_device(device)
else:
    device = "cuda"
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).to(device)
if ddp:
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(5):
    loss = model(torch.randn(32, 256, device=device)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
print("ddp" if ddp else "one process")
if ddp:
    dist.destroy_process_group()
