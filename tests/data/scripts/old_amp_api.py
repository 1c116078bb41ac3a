"""Mixed precision with the older torch.cuda.amp API, .item() logging and torch.compile (of the
model, with options, unwrapped by ``_orig_mod`` as scripts do to save the plain weights; and as a
function decorator)."""
import torch
from torch import nn

net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).cuda()
model = torch.compile(net, mode="max-autotune")
assert model._orig_mod is net and list(model.state_dict())[0].startswith("_orig_mod.")


@torch.compile
def objective(out):
    return out.float().pow(2).mean()


opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scaler = torch.cuda.amp.GradScaler(2.0**10)      # init_scale positional, as the old API allows
for step in range(10):
    x = torch.randn(8, 32).cuda()
    with torch.cuda.amp.autocast():
        loss = objective(model(x))
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    if not torch.isfinite(loss):                  # a value read from the device: a stand-in answers
        break
    print(step, loss.item(), torch.cuda.max_memory_allocated())
