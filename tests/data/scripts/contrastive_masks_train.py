"""A contrastive loss as SimCLR's info_nce_loss writes it: 0/1 label and identity masks built on
the host with `.float()` (whole numbers, no data), moved to the GPU, and used to select the
positives and negatives of the similarity matrix by boolean indexing; at batch 64 over 2 views the
masks have 16,384 elements."""
import argparse

import torch
from torch import nn
from torch.nn import functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=64)
args = p.parse_args()
B, V = args.batch_size, 2
dev = torch.device("cuda")
model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 64)).to(dev)
opt = torch.optim.Adam(model.parameters(), lr=3e-4)
for step in range(5):
    feats = F.normalize(model(torch.randn(B * V, 128, device=dev)), dim=1)
    labels = torch.cat([torch.arange(B) for _ in range(V)])
    labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float().to(dev)
    mask = torch.eye(B * V, dtype=torch.bool).to(dev)
    sim = feats @ feats.T
    labels = labels[~mask].view(B * V, -1)
    sim = sim[~mask].view(B * V, -1)
    positives = sim[labels.bool()].view(B * V, -1)
    negatives = sim[~labels.bool()].view(B * V, -1)
    logits = torch.cat([positives, negatives], dim=1) / 0.07
    loss = F.cross_entropy(logits, torch.zeros(B * V, dtype=torch.long, device=dev))
    opt.zero_grad()
    loss.backward()
    opt.step()
