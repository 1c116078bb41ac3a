"""Loss scaling done by hand, as Keras 3's LossScaleOptimizer does it on the torch backend: the
update is skipped where a gradient is not finite. --check stack: every gradient's isfinite().all()
stacked, then .all() (a check a healthy run passes); --check norm: the step taken only where the
gradient norm is under a bound (a value only the data decides)."""
import argparse

import torch
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--check", choices=("stack", "norm"), default="stack")
args = ap.parse_args()
model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 10)).cuda()
opt = torch.optim.Adam(model.parameters())
for step in range(20):
    loss = model(torch.randn(64, 512, device="cuda")).pow(2).mean()
    loss.backward()
    if args.check == "stack":
        ok = torch.stack([torch.all(torch.isfinite(p.grad)) for p in model.parameters()]).all()
    else:
        ok = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) < 1.0
    if ok:
        opt.step()
    opt.zero_grad()
