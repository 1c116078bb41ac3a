"""Gradients synchronised by hand with collectives batched in dist._coalescing_manager, as
Megatron-LM's DDP buffers and distributed optimizer and DeepSpeed's ZeRO do: an all-reduce of each
gradient, then a reduce-scatter of a flat gradient buffer and an all-gather of the updated shards."""
import os

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("nccl")
world = dist.get_world_size()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 16)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
numel = sum(p.numel() for p in model.parameters())
flat = torch.zeros(numel + (-numel) % world, device="cuda")
shard = torch.zeros(flat.numel() // world, device="cuda")
for step in range(10):
    loss = model(torch.randn(32, 512, device="cuda")).logsumexp(1).mean()
    loss.backward()
    with dist._coalescing_manager(async_ops=True) as cm:
        for p in model.parameters():
            dist.all_reduce(p.grad, async_op=True)
    cm.wait()
    with dist._coalescing_manager():
        dist.reduce_scatter_tensor(shard, flat)
    with dist._coalescing_manager():
        dist.all_gather_into_tensor(flat, shard)
    opt.step()
    opt.zero_grad()
