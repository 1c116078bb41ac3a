"""A multiprocessing Manager started with spawn before training (lingua's setup: a forkserver start
method, then `with mp.Manager(): ...`): its registry holds multiprocessing.pool.Pool, pickled to
the manager's process."""
import multiprocessing as mp

import torch
import torch.nn as nn

if __name__ == "__main__":
    mp.set_start_method("spawn")
    with mp.Manager() as manager:
        shared = manager.dict(step=0)
    model = nn.Linear(64, 64).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        model(torch.randn(8, 64, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
