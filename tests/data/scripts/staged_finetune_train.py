"""Transfer learning in stages, as tutorials teach it: the backbone frozen for the first epochs
(only the head learns), then unfrozen; one optimizer over every parameter from the start.
--head-only-optimizer builds the optimizer over the head alone (a permanent freeze). --momentum:
the frozen backbone is never unfrozen but moved towards the head's scale after each step, as a
momentum encoder (MoCo's key encoder, a teacher's EMA) is kept by the script itself."""
import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--unfreeze-at", type=int, default=2)
p.add_argument("--head-only-optimizer", action="store_true")
p.add_argument("--momentum", action="store_true")
p.add_argument("--bf16", action="store_true")
args = p.parse_args()
dtype = torch.bfloat16 if args.bf16 else torch.float32

backbone = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU()).cuda().to(dtype)
head = nn.Linear(1024, 10).cuda().to(dtype)
for prm in backbone.parameters():
    prm.requires_grad = False
params = head.parameters() if args.head_only_optimizer else list(backbone.parameters()) + list(head.parameters())
opt = torch.optim.Adam(params, lr=1e-3)
for epoch in range(args.epochs):
    if epoch == args.unfreeze_at:
        for prm in backbone.parameters():
            prm.requires_grad = True
    for _ in range(5):
        x, y = torch.randn(32, 256).cuda().to(dtype), torch.randint(0, 10, (32,)).cuda()
        loss = nn.functional.cross_entropy(head(backbone(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.momentum:
            with torch.no_grad():
                for prm in backbone.parameters():
                    prm.mul_(0.999).add_(prm.mean(), alpha=0.001)
