"""A script that caps its process's share of the GPU's memory, as jobs sharing a GPU (or leaving
room for another process) do: the caching allocator then refuses to reserve past that share, so
the job runs out there, not at the GPU's size."""
import torch
from torch import nn

torch.cuda.set_per_process_memory_fraction(0.5)
assert torch.cuda.get_per_process_memory_fraction() == 0.5
model = nn.Linear(256, 256).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    model(torch.randn(32, 256, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
