"""A trainer's housekeeping, in the style of ultralytics' and others': an EMA copy (deepcopy) of a
model that keeps a plain host tensor as an attribute; a run folder made, removed with
shutil.rmtree and made again; a partial download's file removed with unlink(missing_ok=True),
though it never existed. --real DIR: shutil.rmtree of a directory the run did not make."""
import copy
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
model.stride = torch.tensor([8.0, 16.0, 32.0])   # an attribute, not a buffer: stays on the host
model = model.cuda()
ema = copy.deepcopy(model).eval()
assert ema.stride.tolist() == [8.0, 16.0, 32.0] and not ema.stride.is_cuda
run = Path("housekeeping_out") / "exp"
run.mkdir(parents=True, exist_ok=True)
(run / "args.yaml").write_text("lr: 0.1\n")
shutil.rmtree(run)
assert not run.exists()
run.mkdir(parents=True)
(Path("weights") / ".model.pt.part").unlink(missing_ok=True)
if "--real" in sys.argv:
    shutil.rmtree(sys.argv[sys.argv.index("--real") + 1])
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for _ in range(3):
    loss = model(torch.randn(16, 32, device="cuda")).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
torch.save(model.state_dict(), run / "last.pt")
assert sorted(p.name for p in run.iterdir()) == ["last.pt"]
