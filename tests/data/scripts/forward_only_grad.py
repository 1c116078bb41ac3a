"""Forward passes under grad and nothing else (no backward, no optimizer): the estimate stops
after N of them, as it would after N optimizer steps."""
import torch
from torch import nn

model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
outs = []
for step in range(100000):
    out = model(torch.randn(8, 32, device="cuda"))
    outs = [out]   # keeps the last step's graph alive, as a probe of activations would
