"""A model moved with the keyword form, `model.to(device=device)`, and gradients accumulated over
4 micro-batches before each optimizer step: the live oracle counted neither the model (its
`device=` was read in Module.to's own argument parsing) nor the steps (it stopped at the fourth
backward pass, as for a loop without torch.optim)."""
import torch
from torch import nn

device = torch.device("cuda")
model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512)).to(device=device)
opt = torch.optim.AdamW(model.parameters())
for step in range(5):
    for micro in range(4):
        model(torch.randn(64, 512, device=device)).pow(2).mean().div(4).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
