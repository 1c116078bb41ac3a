"""A plain loop: the model built on the host with its random initialisation, then a DataLoader
with shuffle=True (its sampler seeds itself from the host's generator, after the initialisation's
draws), each batch padded to its longest sequence. --print-lengths: the padded lengths of the
first batches, on the host, and exit (no GPU needed)."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

p = argparse.ArgumentParser()
p.add_argument("--print-lengths", action="store_true")
args = p.parse_args()

torch.manual_seed(0)
LENGTHS = [8 + 5 * i for i in range(40)]


class LM(nn.Module):
    def __init__(self, vocab=500, dim=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, 256, dim) * 0.02)
        self.block = nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)
        nn.init.trunc_normal_(self.head.weight, std=0.02)

    def forward(self, ids):
        x = self.emb(ids) + self.pos[:, :ids.shape[1]]
        return F.cross_entropy(self.head(self.block(x)).flatten(0, 1), ids.flatten())


def pad(rows):
    return torch.randint(0, 500, (len(rows), max(LENGTHS[i] for i in rows)))


model = LM()
loader = DataLoader(range(len(LENGTHS)), batch_size=4, shuffle=True, collate_fn=pad)
if args.print_lengths:
    print(" ".join(str(b.shape[1]) for b in loader))
    raise SystemExit(0)
model.cuda()
opt = torch.optim.AdamW(model.parameters())
for ids in loader:
    loss = model(ids.cuda())
    loss.backward()
    opt.step()
    opt.zero_grad()
