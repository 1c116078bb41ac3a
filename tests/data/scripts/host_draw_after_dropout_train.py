"""Each step's sequence length drawn on the host (torch.randint) after the previous step's dropout
on the device, and a layer initialised on the device: on a GPU those draw from CUDA's generator,
so the host's sequence of lengths is the one the script's seed gives."""
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(1000, 128), nn.Dropout(0.1), nn.Linear(128, 512), nn.GELU(),
                      nn.Dropout(0.1)).cuda()
head = nn.Linear(512, 1000, device="cuda")   # initialised on the device
opt = torch.optim.AdamW([*model.parameters(), *head.parameters()])
for step in range(4):
    length = int(torch.randint(16, 512, ()).item())
    ids = torch.randint(0, 1000, (8, length)).cuda()
    loss = nn.functional.cross_entropy(head(model(ids)).flatten(0, 1), ids.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
