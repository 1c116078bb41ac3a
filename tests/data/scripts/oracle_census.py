"""Device and host tensors of known sizes, then three optimizer steps of a small model: the live
oracle must count the device storages only (views once, a .cpu() copy not at all)."""
import torch
from torch import nn

MiB = 1 << 20
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
host = torch.empty(4 * MiB, dtype=torch.uint8)               # host only: not counted
a = torch.empty(MiB // 4, device=dev)                         # 1 MiB on the device
b = host[:MiB].cuda()                                         # 1 MiB: a host-to-device copy
view = a.view(512, 512)[:256]                                 # a view: no new storage
c = (view * 2).to("cpu")                                      # 0.5 MiB made on the device, copied back
assert a.is_cuda and b.device.type == "cuda" and not c.is_cuda and not host.is_cuda
del a, b, view                                                # freed: 1.5 MiB stays the peak
model = nn.Linear(256, 4).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    x = torch.randn(8, 256).to(dev, non_blocking=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.4f}")
