"""A custom autograd.Function whose backward allocates its gradient on the device (as TRL's chunked
log-prob head does), fed by features normalised on the host with a sparse diagonal matrix (a graph
script's row normalisation)."""
import torch
from torch import nn


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        grad = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
        grad.add_(grad_out * 2)
        return grad


features = torch.rand(256, 64)
norm = torch.diag(1 / features.sum(1)).to_sparse()     # host sparse: never device memory
features = (norm @ features).cuda()
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8)).cuda()
opt = torch.optim.Adam(model.parameters())
for step in range(5):
    loss = Scale.apply(model(features)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
