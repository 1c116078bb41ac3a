"""The CUDA runtime through ctypes before training, as NVIDIA's Transformer-XL sets the L2 fetch
granularity (`l2_promote`) and scripts ask the device count and free memory; --reset: a runtime
call vest does not answer; --stack: a thread stack limit that reserves device memory."""
import ctypes
import sys

import torch

cudart = ctypes.CDLL("libcudart.so")
value = ctypes.cast((ctypes.c_int * 1)(), ctypes.POINTER(ctypes.c_int))
cudart.cudaDeviceSetLimit(ctypes.c_int(0x05), ctypes.c_int(128))
cudart.cudaDeviceGetLimit(value, ctypes.c_int(0x05))
assert value.contents.value == 128, "cudaDeviceGetLimit"
count, free, total = ctypes.c_int(), ctypes.c_size_t(), ctypes.c_size_t()
assert cudart.cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value >= 1, "cudaGetDeviceCount"
assert cudart.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == 0, "cudaMemGetInfo"
if "--reset" in sys.argv:
    cudart.cudaDeviceReset()
if "--stack" in sys.argv:
    cudart.cudaDeviceSetLimit(ctypes.c_int(0), ctypes.c_size_t(64 << 10))
# torch's own binding of the runtime (torch.cuda.profiler's start/stop around an Nsight range)
torch.cuda.cudart().cudaProfilerStart()
torch.cuda.profiler.stop()
width = 1024 if total.value > 60 * 2**30 else 512   # sized to the GPU's memory
model = torch.nn.Linear(width, width).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    model(torch.randn(128, width, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
