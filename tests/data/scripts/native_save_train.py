"""Metrics written with Arrow (pyarrow.parquet.write_table: C++ opens the path itself) into a folder
the script made, at every step."""
import os

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

model = nn.Linear(64, 64).cuda()
opt = torch.optim.AdamW(model.parameters())
for step in range(1, 4):
    model(torch.randn(8, 64).cuda()).sum().backward()
    opt.step()
    opt.zero_grad()
    folder = os.path.join("out_native", f"metrics-{step}")
    os.makedirs(folder, exist_ok=True)
    pq.write_table(pa.table({"step": [step]}), os.path.join(folder, "metrics.parquet"))
