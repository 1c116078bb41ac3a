"""A run that updates files an earlier run left: a lock file opened read-write (filelock, as
datasets and the Hub's caches take it), a log appended to and read back whole, a record updated in
place ("r+"); it makes a directory, asks its file system's limits (os.statvfs, as datasets does
before writing a cache) and works from inside it (os.chdir)."""
import os

import torch
from filelock import FileLock

here = os.getcwd()
with FileLock(os.path.join("data", "cache.lock")):
    with open(os.path.join("data", "previous.log"), "a") as f:
        f.write("step 0 loss 2.1 (this run)\n")
with open(os.path.join("data", "previous.log")) as f:
    lines = f.read().splitlines()
assert lines[0].endswith("(an earlier run)") and lines[-1].endswith("(this run)"), lines
with open(os.path.join("data", "previous.log"), "r+") as f:
    f.write("STEP")
with open(os.path.join("data", "previous.log")) as f:
    assert f.read().startswith("STEP 0 loss 2.3026")
os.makedirs(os.path.join("update_out", "run1"), exist_ok=True)
assert os.statvfs(os.path.join("update_out", "run1")).f_namemax > 0
os.chdir(os.path.join("update_out", "run1"))
model = torch.nn.Linear(32, 8).cuda()
opt = torch.optim.AdamW(model.parameters())
for step in range(3):
    model(torch.randn(4, 32, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
    torch.save(model.state_dict(), "last.pt")
    assert os.path.exists("last.pt") and "last.pt" in os.listdir(".")
os.chdir(here)
print("ok")
