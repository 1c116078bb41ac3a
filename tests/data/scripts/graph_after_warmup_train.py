"""PyTorch's documented whole-step CUDA graph: warm-up steps on a side stream, then forward,
backward and optimizer step captured once (torch.cuda.CUDAGraph, torch.cuda.graph) and replayed
for the job's steps."""
import torch
from torch import nn

model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).cuda()
opt = torch.optim.AdamW(model.parameters(), capturable=True)
x = torch.randn(64, 128, 512, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
opt.zero_grad(set_to_none=True)
with torch.cuda.graph(graph):
    model(x).square().mean().backward()
    opt.step()
for step in range(100):
    x.copy_(torch.randn(64, 128, 512, device="cuda"))
    graph.replay()
