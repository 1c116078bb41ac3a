"""Random choices drawn on the GPU that decide shapes: a masked-token objective that picks the
positions to predict with ``torch.rand(..., device="cuda") < ratio`` and scores only those
(``hidden[mask]``), and a random crop offset per sample from ``torch.randint`` on the device,
applied with boolean masks. The real run draws its own values each step; so do these shapes."""
import torch
from torch import nn

torch.manual_seed(0)
V, D, B, T = 500, 64, 8, 128
emb, enc, head = nn.Embedding(V, D).cuda(), nn.Linear(D, D).cuda(), nn.Linear(D, V).cuda()
opt = torch.optim.AdamW([*emb.parameters(), *enc.parameters(), *head.parameters()], lr=1e-3)
host_before = torch.rand(3)
for step in range(10):
    ids = torch.randint(0, V, (B, T), device="cuda")
    mask = torch.rand(B, T, device="cuda") < 0.15            # the positions to predict: random
    n = int(mask.sum())
    assert 0.05 * B * T < n < 0.3 * B * T, n                 # a draw of the right distribution
    shifts = torch.randint(-2, 3, (B,), device="cuda")       # a crop offset per sample
    keep = shifts == 0
    hidden = torch.relu(enc(emb(ids)))
    logits = head(hidden[mask])                               # (n, V): n follows the draw
    loss = nn.functional.cross_entropy(logits, ids[mask]) + hidden[keep].mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
torch.manual_seed(0)
assert torch.equal(torch.rand(3), host_before)               # the host's own random stream untouched
