"""A CUDA kernel the script compiles at run time (NVRTC, torch.cuda._compile_kernel) to scale its
gradients: it runs on any GPU node; the login node has no CUDA driver to load it."""
import torch
import torch.nn as nn

scale = torch.cuda._compile_kernel(
    'extern "C" __global__ void scale(float* x, float a, int n) {'
    ' int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= a; }', "scale")
model = nn.Linear(256, 256).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    model(torch.randn(32, 256, device="cuda")).square().mean().backward()
    for p in model.parameters():
        scale(grid=((p.grad.numel() + 255) // 256, 1, 1), block=(256, 1, 1), args=[p.grad, 0.5, p.grad.numel()])
    opt.step()
    opt.zero_grad()
