"""Padding to the longest sequence of a batch, where the lengths live on the device: the padded
length is read with .item(), which a fake tensor cannot answer; the model's input takes its shape."""
import torch
from torch import nn

model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 100)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    lengths = torch.randint(5, 50, (8,), device="cuda")
    longest = lengths.max().item()
    tokens = torch.zeros(8, longest, dtype=torch.long, device="cuda")
    loss = model(tokens).float().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
