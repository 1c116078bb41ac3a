"""A README's usage snippet: a model never moved to the GPU, one forward and backward, no optimizer."""
import torch
from torch import nn

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
loss = model(torch.rand(8, 64)).pow(2).mean()
loss.backward()
print("loss", loss.item())
