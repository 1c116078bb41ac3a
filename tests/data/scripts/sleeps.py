"""A run that stops making progress: before its first step (waiting for a data set to download),
or, with --after-a-step, after one (a long sampling or evaluation between steps)."""
import sys
import time

import torch

model = torch.nn.Linear(4, 4).cuda()
if "--after-a-step" in sys.argv:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 4, device="cuda")).sum().backward()
    opt.step()
time.sleep(600)
