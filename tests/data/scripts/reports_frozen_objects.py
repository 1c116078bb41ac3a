"""Trains one step, then fails saying how many objects the collector had frozen at that point
(tests/test_oneshot.py: the script's run is a one-shot process)."""
import gc

import torch

model = torch.nn.Linear(8, 8).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(4, 8, device="cuda")).sum().backward()
opt.step()
opt.zero_grad()
raise SystemExit(f"frozen {gc.get_freeze_count()}")
