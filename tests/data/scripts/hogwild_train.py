"""Hogwild training as pytorch/examples' mnist_hogwild writes it: one model in shared memory
(model.share_memory(), a no-op for CUDA tensors), trained by N processes at once."""
import sys

import torch
import torch.multiprocessing as mp
from torch import nn


def train(rank, model, device):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        x = torch.randn(8, 16, device=device)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    device = torch.device("cuda" if "--cuda" in sys.argv else "cpu")
    mp.set_start_method("spawn", force=True)
    model = nn.Linear(16, 4).to(device)
    model.share_memory()
    workers = [mp.Process(target=train, args=(rank, model, device)) for rank in range(2)]
    for p in workers:
        p.start()
    for p in workers:
        p.join()
