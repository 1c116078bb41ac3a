"""Label files checked with a fork Pool made through its class, and image sizes read with a
ProcessPoolExecutor (and subclasses of both, as fastcore's executor and the "nestable" pools of
research code), before training: host work, as a data set's cache scan does it."""
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.pool import Pool

import torch
import torch.nn as nn


def check(i):
    return i * i


with Pool(2) as pool:
    labels = list(pool.imap(check, range(16)))
with ProcessPoolExecutor(2) as ex:
    sizes = list(ex.map(check, range(8)))
assert labels[3] == 9 and sizes[2] == 4


class Parallel(ProcessPoolExecutor):
    """A library's subclass (fastcore's, under fastai's tokenization): its own map, over submit."""

    def __init__(self, max_workers=2, progress=False, **kwargs):
        self.progress = progress
        super().__init__(max_workers, **kwargs)

    def map(self, f, items, chunksize=1):
        return list(super().map(f, items, chunksize=chunksize))


class LabelPool(Pool):
    """A subclass of the Pool class with a method of its own (and its own Process, as the
    "NoDaemonPool" recipe for nested pools overrides it)."""

    def __init__(self, processes=2):
        self.scans = 0
        super().__init__(processes)

    def scan(self, items):
        self.scans += 1
        return list(self.imap(check, items))


with LabelPool(2) as pool:
    assert pool.scan(range(4)) == [0, 1, 4, 9] and isinstance(pool, LabelPool)
with Parallel(2) as ex:
    assert ex.map(check, range(4)) == [0, 1, 4, 9] and ex.submit(check, 5).result() == 25
model = nn.Linear(128, 10).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    loss = model(torch.randn(32, 128, device="cuda")).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
