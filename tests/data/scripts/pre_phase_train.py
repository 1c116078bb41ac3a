"""Gradients estimated before training (LoRA-GA's initialisation, Fisher or importance scores):
backward passes at a small batch with no optimizer yet, then training at --batch-size."""
import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--estimate-batch-size", type=int, default=2)
args = p.parse_args()

model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).cuda()
for _ in range(4):
    model(torch.randn(args.estimate_batch_size, 256).cuda()).pow(2).mean().backward()
scores = [prm.grad.abs().mean() for prm in model.parameters()]
model.zero_grad(set_to_none=True)
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    for _ in range(2):   # two micro-batches per step
        model(torch.randn(args.batch_size, 256).cuda()).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
