"""FSDP2 units with settings of their own, as accelerate and the Trainer wrap a model: each block
resharded after forward, the tail unit (final norm and head) kept unsharded (--uniform: resharded
too), the root with the default; --prefetch: explicit forward prefetching."""
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
blocks = nn.ModuleList([nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(8)])
model = nn.ModuleDict({"blocks": blocks, "norm": nn.LayerNorm(512), "head": nn.Linear(512, 16)}).cuda()
for block in blocks:
    fully_shard(block, reshard_after_forward=True)
fully_shard([model["norm"], model["head"]], reshard_after_forward="--uniform" in sys.argv)
fully_shard(model)
if "--prefetch" in sys.argv:
    for block, after in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([after])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(5):
    x = torch.randn(4, 512, device="cuda")
    for block in model["blocks"]:
        x = block(x)
    model["head"](model["norm"](x)).square().mean().backward()
    opt.step()
    opt.zero_grad()
