"""Weights loaded with Lightning's lazy loader (lightning.fabric.utilities.load._lazy_load: litgpt's
finetuning scripts, Fabric's and Lightning's FSDP full-checkpoint loads): each tensor is read from
the file inside load_state_dict's param.copy_, past torch.load. pretrained.pth: a checkpoint on disk
(torch.save of the same model's state_dict), as a download or an earlier job leaves it."""
import torch
from lightning.fabric.utilities.load import _lazy_load
from torch import nn

model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8)).cuda()
model.load_state_dict(_lazy_load("pretrained.pth"))
opt = torch.optim.AdamW(model.parameters())
for step in range(4):
    model(torch.randn(32, 256, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
