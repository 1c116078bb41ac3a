"""A minimal training loop used by the dynamic-analysis tests; writes a log and a checkpoint in cwd.
``--steps N``: N steps (default 100), then it ends by itself."""
import sys

import torch
from torch import nn

model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
opt = torch.optim.Adam(model.parameters())
log = open("train.log", "w")
steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 100
for step in range(steps):
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    log.write(f"{step} {loss.item()}\n")
    torch.save(model.state_dict(), "ckpt.pt")
print("done", file=sys.stderr)
