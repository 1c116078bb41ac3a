"""A fine-tuning loop in the style of TRL's SFT trainer: a collator pads token ids on the host and
marks the padding of the labels with -100; the batch is moved to the GPU; the model scores only the
labelled positions (``hidden[mask]``, the labels' ``mask.nonzero()``) and divides by the token count
read with ``.sum().item()``. The script asserts the counts the real run reads."""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM = 128, 32


def collate(seqs):
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    labels = torch.full((len(seqs), longest), -100, dtype=torch.long)
    attention = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        labels[i, :len(s)] = torch.tensor(s)
        attention[i, :len(s)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": attention}


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, labels, attention_mask):
        hidden = self.block(self.embed(input_ids)) * attention_mask.unsqueeze(-1)
        mask = labels[:, 1:] != -100                        # the labelled positions
        scored = self.head(hidden[:, :-1][mask])           # only those are scored (TRL's fused head)
        return F.cross_entropy(scored, labels[:, 1:][mask], reduction="sum") / mask.sum().clamp(min=1)


lengths = [5, 9, 3, 12]
batches = [collate([[(7 * i + j) % VOCAB + 1 for j in range(n)] for i, n in enumerate(lengths)]) for _ in range(4)]
model = TinyLM().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for batch in batches:
    batch = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}
    tokens = (batch["labels"][:, 1:] != -100).sum().item()
    assert tokens == sum(n - 1 for n in lengths), tokens
    loss = model(**batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
