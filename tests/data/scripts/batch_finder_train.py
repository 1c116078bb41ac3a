"""A training loop that sizes itself to the GPU, in the style of accelerate's find_executable_batch_size
(HF examples, Trainer's --auto_find_batch_size): the whole loop is retried with half the batch when
CUDA runs out of memory. --no-finder: the same loop at the starting batch, nothing caught."""
import argparse
import gc

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=196608)
p.add_argument("--no-finder", action="store_true")
args = p.parse_args()


def find_executable_batch_size(function, starting_batch_size):
    batch_size = starting_batch_size
    while True:
        try:
            return function(batch_size)
        except torch.cuda.OutOfMemoryError:
            gc.collect()
            torch.cuda.empty_cache()
            batch_size //= 2


def train(batch_size):
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8192, 8192), nn.ReLU())]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        x = torch.randn(batch_size, 8192, device="cuda")
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    print("trained at batch", batch_size)


if args.no_finder:
    train(args.batch_size)
else:
    find_executable_batch_size(train, args.batch_size)
