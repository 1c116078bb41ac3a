"""Padding to lengths that live on the device and follow from the model's own predictions (how
many of a prompt's tokens it keeps): the padded length is read with .item(), which a fake tensor
cannot answer (no host data, no draw behind it); the model's input takes its shape."""
import torch
from torch import nn

model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 100)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
prompt = torch.arange(40, device="cuda").view(8, 5)
for step in range(10):
    with torch.no_grad():
        lengths = 5 + 9 * (model(prompt).argmax(-1) != 0).sum(-1)
    longest = lengths.max().item()
    tokens = torch.zeros(8, longest, dtype=torch.long, device="cuda")
    loss = model(tokens).float().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
