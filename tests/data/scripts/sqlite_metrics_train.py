"""Metrics kept in an SQLite database beside the script (as optuna's and MLflow's local stores keep
theirs), written each step and read back."""
import sqlite3

import torch
import torch.nn as nn

db = sqlite3.connect("metrics.db")
db.execute("CREATE TABLE IF NOT EXISTS loss (step INTEGER, value REAL)")
model = nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    loss = model(torch.randn(32, 64, device="cuda")).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    db.execute("INSERT INTO loss VALUES (?, ?)", (step, float(loss.item())))
    db.commit()
    assert db.execute("SELECT COUNT(*) FROM loss").fetchone()[0] >= step + 1
