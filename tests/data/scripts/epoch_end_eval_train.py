"""Training over a DataLoader, then at each epoch's end an evaluation at a larger batch under
no_grad (the habit of the reference trainers: validate() after train_one_epoch()).
--eval-fails: the evaluation raises (what a library does at the epoch's end that fails here).
--prefetch: batches come through a wrapper that fetches the next one ahead (accelerate's
DataLoaderShard, Lightning's fetcher)."""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=4)
p.add_argument("--eval-batch-size", type=int, default=256)
p.add_argument("--train-samples", type=int, default=40)
p.add_argument("--eval-fails", action="store_true")
p.add_argument("--prefetch", action="store_true")
args = p.parse_args()


def ahead(loader):
    it = iter(loader)
    current = next(it)
    for following in it:
        yield current
        current = following
    yield current


model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 3, 3, padding=1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
train = DataLoader(TensorDataset(torch.randn(args.train_samples, 3, 32, 32)), batch_size=args.batch_size, shuffle=True)
val = DataLoader(TensorDataset(torch.randn(8 * args.eval_batch_size, 3, 32, 32)), batch_size=args.eval_batch_size)
for epoch in range(3):
    model.train()
    for (x,) in (ahead(train) if args.prefetch else train):
        x = x.cuda(non_blocking=True)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    total = 0.0
    with torch.no_grad():
        for (x,) in val:
            x = x.cuda()
            total += (model(x) - x).pow(2).mean().item()
            if args.eval_fails:
                raise RuntimeError("the evaluation's metric failed")
    print(f"epoch {epoch}: val {total / len(val):.4f}")
