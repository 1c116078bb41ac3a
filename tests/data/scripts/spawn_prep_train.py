"""Data preparation in a worker started with multiprocessing's spawn method (litdata's optimize, a
spawn Pool tokenising files): it writes the prepared files into the job's directory, the parent
reads them back and trains. --child-uses-gpu: the worker puts a tensor on the GPU."""
import argparse
import multiprocessing as mp
import os
import sys

import torch
from torch import nn


def prepare(out_dir, use_gpu):
    os.makedirs(out_dir, exist_ok=True)
    data = torch.randn(64, 128)
    if use_gpu:
        data = data.cuda()
    torch.save(data.cpu(), os.path.join(out_dir, "features.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--child-uses-gpu", action="store_true")
    args = p.parse_args()
    worker = mp.get_context("spawn").Process(target=prepare, args=("prepared", args.child_uses_gpu))
    worker.start()
    worker.join()
    if worker.exitcode != 0:
        sys.exit(f"the preparation worker failed (exit {worker.exitcode})")
    data = torch.load(os.path.join("prepared", "features.pt"))
    model = nn.Linear(128, 128).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for i in range(4):
        model(data[i * 16:(i + 1) * 16].cuda()).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
