"""A checkpoint saver in the style of timm's CheckpointSaver and many trainers: save last.pth,
then keep copies of it (a hard link, else shutil.copy2), a shutil.copy with its mode, a relative
'latest' symlink, a chmod; every copy is loaded back and checked."""
import os
import shutil

import torch

model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
os.makedirs("ckpt_out", exist_ok=True)
for step in range(3):
    x = torch.randn(16, 32, device="cuda")
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    last = os.path.join("ckpt_out", "last.pth")
    torch.save({"step": step, "model": model.state_dict()}, last)
    try:
        os.link(last, os.path.join("ckpt_out", f"checkpoint-{step}.pth"))
    except (OSError, NotImplementedError):
        shutil.copy2(last, os.path.join("ckpt_out", f"checkpoint-{step}.pth"))
    shutil.copy2(last, os.path.join("ckpt_out", "best.pth"))
    shutil.copy(last, os.path.join("ckpt_out", "copy.pth"))
    if os.path.lexists(os.path.join("ckpt_out", "latest")):
        os.remove(os.path.join("ckpt_out", "latest"))
    os.symlink("last.pth", os.path.join("ckpt_out", "latest"))
    assert os.readlink(os.path.join("ckpt_out", "latest")) == "last.pth"
    os.chmod(os.path.join("ckpt_out", "best.pth"), 0o640)
    for name in (f"checkpoint-{step}.pth", "best.pth", "copy.pth", "latest"):
        back = torch.load(os.path.join("ckpt_out", name), map_location="cpu")
        assert back["step"] == step and set(back["model"]) == set(model.state_dict()), name
    assert sorted(os.listdir("ckpt_out"))[:2] == ["best.pth", "checkpoint-0.pth"]
print("ok")
