"""Parameters rebuilt with their own class, as libraries do: accelerate's init_empty_weights and
set_module_tensor_to_device (every diffusers from_pretrained loads a model so), and
type(p)(data, requires_grad=...) in a script."""
import torch
import torch.nn as nn
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device

with init_empty_weights():
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
for name, p in list(model.named_parameters()):
    set_module_tensor_to_device(model, name, "cpu", value=torch.randn(p.shape))
model = model.cuda()
w = model[0].weight
model[0].weight = type(w)(w.data.half().float(), requires_grad=w.requires_grad)
del w
opt = torch.optim.AdamW(model.parameters())
for step in range(3):
    loss = model(torch.randn(64, 256, device="cuda")).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
