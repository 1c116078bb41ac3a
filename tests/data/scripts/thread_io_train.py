"""A logger's background thread inside a file call (a TensorBoard writer flushing its event file;
here it waits on a pipe) while the training thread makes its output folder and saves into it."""
import os
import tempfile
import threading

import torch
from torch import nn

fifo = os.path.join(tempfile.gettempdir(), "logger.fifo")
os.mkfifo(fifo)
reader = threading.Thread(target=lambda: open(fifo).read())
reader.start()   # blocks in open() until a writer comes
model = nn.Linear(32, 32).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    model(torch.randn(8, 32).cuda()).sum().backward()
    opt.step()
    opt.zero_grad()
    os.makedirs("run_out", exist_ok=True)
    with open(os.path.join("run_out", f"step{step}.txt"), "w") as f:
        f.write("saved\n")
with open(fifo, "w") as w:
    w.write("done\n")
reader.join()
