"""GPU facts and CPU affinity read through NVML (pynvml), as NVIDIA's DeepLearningExamples set their
affinity before training and loggers record the GPU; --other: an NVML call vest does not answer."""
import os
import sys

import pynvml
import torch

pynvml.nvmlInit()
count = pynvml.nvmlDeviceGetCount()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
words = -(-(os.cpu_count() or 1) // 64)
mask = "".join(f"{w:064b}" for w in reversed(pynvml.nvmlDeviceGetCpuAffinity(handle, words)))
cpus = [i for i, bit in enumerate(reversed(mask)) if bit == "1"]
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, cpus)
if "--other" in sys.argv:
    pynvml.nvmlDeviceGetPowerUsage(handle)
width = 1024 if total > 60 * 2**30 else 512   # sized to the GPU's memory
model = torch.nn.Linear(width, width).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    model(torch.randn(128, width, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
print(count, pynvml.nvmlDeviceGetName(handle), pynvml.nvmlDeviceGetCudaComputeCapability(handle))
