"""DDP with a gloo group beside NCCL's for host work, as detectron2's comm.py and Lightning's
rank_zero_first make one: barriers and object gathers (file lists, metrics) on the host, training
on the GPU. --subgroups: per-node gloo subgroups (new_subgroups) instead of one."""
import functools
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


@functools.lru_cache()
def _global_gloo_group():
    if dist.get_backend() == "nccl":
        return dist.new_group(backend="gloo")
    return dist.group.WORLD


def all_gather(obj, group):
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


dist.init_process_group("nccl")
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
if "--subgroups" in sys.argv:
    group, _ = dist.new_subgroups(backend="gloo")
else:
    group = _global_gloo_group()
assert dist.get_backend(group) == "gloo", dist.get_backend(group)
dist.barrier(group=group)
files = all_gather([f"shard-{dist.get_rank()}.tar"], group)
seen = torch.tensor([len(files)], dtype=torch.int64)   # a host tensor, reduced on the gloo group
dist.all_reduce(seen, group=group)

model = DDP(nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10)).cuda(), device_ids=[local])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(20):
    x, y = torch.randn(16, 64).cuda(), torch.randint(0, 10, (16,)).cuda()
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    dist.barrier(group=group)
dist.destroy_process_group()
