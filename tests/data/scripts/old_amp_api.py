"""Mixed precision with the older torch.cuda.amp API, .item() logging and torch.compile."""
import torch
from torch import nn

model = torch.compile(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scaler = torch.cuda.amp.GradScaler(2.0**10)      # init_scale positional, as the old API allows
for step in range(10):
    x = torch.randn(8, 32).cuda()
    with torch.cuda.amp.autocast():
        loss = model(x).float().pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    if not torch.isfinite(loss):                  # a value read from the device: a stand-in answers
        break
    print(step, loss.item(), torch.cuda.max_memory_allocated())
