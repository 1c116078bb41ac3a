"""A loop that keeps each step's outputs for a metric at the epoch's end, as AUC and retrieval
evaluations do: --keep gpu appends the detached outputs (on the GPU, growing a step at a time:
the job needs more with each step than its first steps show), --keep host their .cpu() copies
(nothing grows on the GPU)."""
import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--keep", choices=("gpu", "host"), default="gpu")
args = p.parse_args()

model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
kept = []
for step in range(100):
    out = model(torch.randn(512, 256, device="cuda"))
    kept.append(out.detach() if args.keep == "gpu" else out.detach().cpu())
    out.square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
print(torch.cat(kept).mean().item())
