"""A training loop with bitsandbytes' 8-bit AdamW, as LLM fine-tuning scripts use it."""
import bitsandbytes as bnb
import torch
from torch import nn

model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)).cuda()
opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
for step in range(100):
    x = torch.randn(16, 128, device="cuda")
    loss = nn.functional.cross_entropy(model(x), torch.randint(0, 10, (16,), device="cuda"))
    loss.backward()
    opt.step()
    opt.zero_grad()
