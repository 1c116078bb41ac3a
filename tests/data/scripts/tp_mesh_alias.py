"""Tensor parallelism in the style of the reference examples: the mesh from an older import path
(torch.distributed._tensor.device_mesh re-exports init_device_mesh), whose DeviceMesh set-up calls
init_process_group through torch's own module; then parallelize_module over the mesh."""
import torch
from torch import nn
from torch.distributed._tensor.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

mesh = init_device_mesh("cuda", (2,))
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5)).cuda()
model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
opt = torch.optim.AdamW(model.parameters())
for _ in range(10):
    model(torch.rand(20, 10, device="cuda")).sum().backward()
    opt.step()
