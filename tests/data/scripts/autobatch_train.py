"""A batch size from a memory probe, as ultralytics' AutoBatch (batch=-1) and YOLOv5's autobatch
choose it: a forward and backward at a few batch sizes, torch.cuda.memory_reserved() read after
each, a line fitted, 60% of the GPU filled."""
import torch
import torch.nn as nn

m = nn.Sequential(*[nn.Sequential(nn.Conv2d(c, 32, 3, padding=1), nn.ReLU()) for c in (3, 32, 32)],
                  nn.Conv2d(32, 1, 1)).cuda()
xs, ys = [], []
for b in (1, 2, 4, 8):
    torch.cuda.empty_cache()
    m(torch.randn(b, 3, 128, 128, device="cuda")).sum().backward()
    xs.append(b)
    ys.append(torch.cuda.memory_reserved())
    m.zero_grad(set_to_none=True)
slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
batch = max(1, min(int((0.6 * torch.cuda.get_device_properties(0).total_memory - ys[0]) / slope), 1 << 16))
print("batch", batch)
opt = torch.optim.SGD(m.parameters(), lr=0.01)
for _ in range(4):
    m(torch.randn(batch, 3, 128, 128, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
