"""A model built under `with torch.device("cuda"):` (as torchtune builds its models), trained with
Adam, its batches sent where its weights are; --moved: the same model built on the host and moved with .cuda()."""
import sys

import torch

if "--moved" in sys.argv:
    model = torch.nn.Linear(1024, 1024).cuda()
else:
    with torch.device("cuda"):
        model = torch.nn.Linear(1024, 1024)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
device = next(model.parameters()).device   # where the batches go
for step in range(5):
    model(torch.randn(8, 1024).to(device)).square().mean().backward()
    opt.step()
    opt.zero_grad()
