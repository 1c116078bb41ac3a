"""Parameters listed before model.cuda() (weight-decay groups, a list for clipping), the optimizer
built from that list afterwards; gradient hooks registered before the move, as the
optimizer-in-backward recipe may. On a GPU .cuda() keeps the Parameter objects."""
import argparse

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--list", choices=["before", "after"], default="before")
args = p.parse_args()

model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
seen = []
for q in model.parameters():
    q.register_post_accumulate_grad_hook(lambda t: seen.append(t.shape))
if args.list == "before":
    params = [q for q in model.parameters() if q.requires_grad]
    model.cuda()
else:
    model.cuda()
    params = [q for q in model.parameters() if q.requires_grad]
decay = [q for q in params if q.dim() > 1]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                         {"params": [q for q in params if q.dim() <= 1], "weight_decay": 0.0}], lr=1e-3)
for step in range(4):
    opt.zero_grad()
    model(torch.randn(64, 256, device="cuda")).sum().backward()
    assert len(seen) == 8 * (step + 1), "the gradient hooks did not run"
    opt.step()
