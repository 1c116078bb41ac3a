"""A free port for MASTER_PORT found by binding port 0 (the DDP helpers' idiom), then one-process DDP."""
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn


def find_free_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return port


os.environ.setdefault("MASTER_ADDR", "localhost")
os.environ.setdefault("MASTER_PORT", str(find_free_port()))
dist.init_process_group("nccl", rank=0, world_size=1)
model = nn.parallel.DistributedDataParallel(nn.Linear(512, 512).cuda(), device_ids=[0])
opt = torch.optim.Adam(model.parameters())
for step in range(5):
    model(torch.randn(256, 512, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
