"""A script that asks nvidia-smi for its GPU (logs the table, lists the GPUs) and sizes its batch from
the memory it reports, as research scripts do."""
import os
import subprocess

import torch

print(subprocess.run(["nvidia-smi"], stdout=subprocess.PIPE, text=True, check=True).stdout)
out = subprocess.check_output(["nvidia-smi", "--query-gpu=memory.total,name", "--format=csv,noheader,nounits"])
total = int(out.decode().split(",")[0])
print("total", total, os.popen("nvidia-smi -L").read())
model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batch = 8 if total < 50000 else 64
for step in range(4):
    model(torch.randn(batch, 64, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
