"""Python objects gathered, broadcast and scattered over the process group before training, as
torch.distributed.checkpoint's coordinator does with the ranks' save plans and as scripts share a
configuration."""
import os

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
rank, world = dist.get_rank(), dist.get_world_size()
plans = [None] * world if rank == 0 else None
dist.gather_object({"rank": rank, "width": 64}, plans, dst=0)
config = [plans[0]["width"] if rank == 0 else None]
dist.broadcast_object_list(config, src=0)
mine = [None]
dist.scatter_object_list(mine, [{"shard": r} for r in range(world)] if rank == 0 else None, src=0)
assert mine[0]["shard"] == rank and config[0] == 64
model = torch.nn.Linear(config[0], config[0]).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    model(torch.randn(8, config[0], device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
