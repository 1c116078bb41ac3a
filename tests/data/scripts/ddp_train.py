"""Data-parallel training as torchrun launches it (one process per GPU, NCCL, DDP).

--bucket-view: DDP(gradient_as_bucket_view=True), the gradients views into DDP's buckets;
--hidden N, --batch-size N: the layer's width and the batch (512, 16);
--accumulate K: K backward passes per optimizer step, the first K-1 under DDP's no_sync();
--comm-hook fp16|powersgd: a communication hook on the buckets (default_hooks' fp16 compression,
PowerSGD), as accelerate's DistributedDataParallelKwargs(comm_hook=...) registers them."""
import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ap = argparse.ArgumentParser()
ap.add_argument("--bucket-view", action="store_true")
ap.add_argument("--hidden", type=int, default=512)
ap.add_argument("--batch-size", type=int, default=16)
ap.add_argument("--accumulate", type=int, default=1)
ap.add_argument("--comm-hook", choices=["fp16", "powersgd"])
args = ap.parse_args()
dist.init_process_group("nccl")
rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
net = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10)).cuda()
model = DDP(net, device_ids=[local], gradient_as_bucket_view=args.bucket_view)
if args.comm_hook == "fp16":
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
elif args.comm_hook == "powersgd":
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    model.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1),
                             powerSGD_hook.powerSGD_hook)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
n = max(256, 4 * args.batch_size)
data = TensorDataset(torch.randn(n, 64), torch.randint(0, 10, (n,)))
loader = DataLoader(data, batch_size=args.batch_size, sampler=DistributedSampler(data))
for epoch in range(2):
    for i, (x, y) in enumerate(loader):
        x, y = x.cuda(local), y.cuda(local)
        last = (i + 1) % args.accumulate == 0
        if args.accumulate == 1:
            opt.zero_grad()
        with contextlib.nullcontext() if last else model.no_sync():
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
        if last:
            opt.step()
            if args.accumulate > 1:
                opt.zero_grad()
        dist.all_reduce(loss.detach())
        if rank == 0:
            print(loss.item())
dist.destroy_process_group()
