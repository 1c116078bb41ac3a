"""A sequence cut to a length computed on the device: with a stand-in for the value the cut is
empty, and the model would train on shape (B, 0)."""
import torch
from torch import nn

model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 100)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with torch.no_grad():   # tokens the model itself proposes (no host data, no draw behind them)
    tokens = model(torch.arange(64, device="cuda").repeat(12, 1)).argmax(-1)
for step in range(10):
    keep = int((tokens > 0).sum(dim=1).min())   # a plain int from C++: the value is a stand-in
    batch = tokens[:, :keep - 1]
    loss = model(batch).float().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
