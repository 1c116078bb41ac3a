"""Checkpoints written through io.FileIO, as blobfile's writer (a FileIO subclass) saves them for a
local path (OpenAI's improved- and guided-diffusion), then read back the same way."""
import io
import os

import torch
import torch.nn as nn


class ProxyFile(io.FileIO):
    pass


os.makedirs("fileio_ckpt", exist_ok=True)
model = nn.Linear(256, 256).cuda()
opt = torch.optim.Adam(model.parameters())
for step in range(5):
    model(torch.randn(64, 256, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
    path = os.path.join("fileio_ckpt", f"model{step:06d}.pt")
    with ProxyFile(path, "wb") as f:
        torch.save(model.state_dict(), f)
    with io.FileIO(path, "rb") as f:
        assert set(torch.load(f)) == {"weight", "bias"}
    assert isinstance(open(path, "rb", buffering=0), io.FileIO)
