"""Dynamic padding: each batch padded to its longest sequence, the model called with keywords as
transformers' and TRL's loops call it (`model(input_ids=..., labels=...)`). --fixed: one length."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fixed", action="store_true")
args = p.parse_args()


class LM(nn.Module):
    def __init__(self, vocab=1000, dim=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.block = nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.block(self.emb(input_ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


model = LM().cuda()
opt = torch.optim.AdamW(model.parameters())
for step, longest in enumerate([48, 96, 64, 512, 48]):
    ids = torch.randint(0, 1000, (4, 48 if args.fixed else longest)).cuda()
    loss = model(input_ids=ids, labels=ids)
    loss.backward()
    opt.step()
    opt.zero_grad()
