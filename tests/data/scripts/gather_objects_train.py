"""Values sent through collectives, as DETR's util.misc.all_gather sends any picklable object:
the sizes gathered first, then the pickled bytes padded to the longest, unpickled on each rank;
here the gathered lengths size the batch (padding to the longest sequence across ranks).
--object: the same through dist.all_gather_object."""
import os
import pickle
import sys

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = nn.parallel.DistributedDataParallel(nn.Linear(16, 4).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    mine = {"len": 100}
    if "--object" in sys.argv:
        lens = [None] * dist.get_world_size()
        dist.all_gather_object(lens, mine)
        lens = [o["len"] for o in lens]
    else:
        buf = torch.ByteTensor(list(pickle.dumps(mine))).cuda()
        size = torch.tensor([buf.numel()], device="cuda")
        sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
        dist.all_gather(sizes, size)
        longest = max(int(s.item()) for s in sizes)
        bufs = [torch.empty(longest, dtype=torch.uint8, device="cuda") for _ in sizes]
        dist.all_gather(bufs, torch.cat([buf, buf.new_zeros(longest - buf.numel())]))
        lens = [pickle.loads(b.cpu().numpy().tobytes()[:int(s.item())])["len"] for b, s in zip(bufs, sizes)]
    loss = model(torch.randn(max(lens), 16, device="cuda")).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
