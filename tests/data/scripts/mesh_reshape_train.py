"""FSDP2 over a mesh built as torchtitan's ParallelDims builds it: a 1-D world mesh unflattened
into named dimensions (DeviceMesh._unflatten), a sub-mesh flattened again under a name
(_flatten), then fully_shard over the "fsdp" dimension. --plain: the same mesh from
init_device_mesh directly."""
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
ws = dist.get_world_size()
if "--plain" in sys.argv:
    mesh = init_device_mesh("cuda", (1, ws), mesh_dim_names=("dp_replicate", "fsdp"))
else:
    world = init_device_mesh("cuda", (ws,), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (1, ws), ("dp_replicate", "fsdp"))
    loss_mesh = mesh["dp_replicate", "fsdp"]._flatten("loss_mesh")
    assert world["loss_mesh"].size() == ws and mesh["fsdp"].size() == ws
model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(4)]).cuda()
for block in model:
    fully_shard(block, mesh=mesh["fsdp"])
fully_shard(model, mesh=mesh["fsdp"])
opt = torch.optim.AdamW(model.parameters())
for _ in range(4):
    model(torch.randn(32, 128, 256, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
