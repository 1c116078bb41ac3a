"""A step-based trainer that evaluates from inside its training loop every --eval-every steps
(`if step % eval_every == 0`, the step counted from 1), at a batch far larger than the training
one: with the period past the traced steps, the evaluation's tensors are not in the trace, and
the estimate must say so. Its logging on a period (a loss read to the host: nothing kept on the
GPU) and a sampling branch behind a switch of the job's configuration that is off (--sample not
given) are not said. The loop lives in periodic_loop.py beside this script (a project's own
module); --here runs the same loop written in this file."""
import argparse

import torch
from torch import nn
from torch.nn import functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--eval-batch", type=int, default=4096)
p.add_argument("--eval-every", type=int, default=1000)
p.add_argument("--log-every", type=int, default=50)
p.add_argument("--sample", action="store_true")
p.add_argument("--here", action="store_true", help="the loop written in this file, not in periodic_loop.py")
args = p.parse_args()

model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

if not args.here:
    import periodic_loop

    periodic_loop.train(model, opt, args)
else:
    @torch.no_grad()
    def evaluate(batch):
        model.eval()
        out = model(torch.randn(batch, 256, device="cuda"))
        model.train()
        return out.float().mean()

    it = 0
    while True:
        x = torch.randn(args.batch_size, 256, device="cuda")
        F.cross_entropy(model(x), torch.zeros(args.batch_size, dtype=torch.long, device="cuda")).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        it += 1
        if it % args.eval_every == 0:
            evaluate(args.eval_batch)
