"""What GRPO/RLOO trainers (trl) do with sampled completions: find each row's first EOS by boolean
indexing on tokens the model itself sampled (trl's ``eos_idx[is_eos.any(dim=1)] = ...``), mask the
completion after it and train on the masked log-probs. ``--where``: the same with torch.where (no
data-dependent shape)."""
import sys

import torch
import torch.nn as nn

V, D, T, B, EOS = 512, 128, 64, 16, 2
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, D), nn.GELU(), nn.Linear(D, V)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(4):
    prompt = torch.randint(3, V, (B, T), device="cuda")
    with torch.no_grad():
        completion = model(prompt).argmax(-1)   # the model's own tokens: no host values
    is_eos = completion == EOS
    eos_idx = torch.full((B,), T, dtype=torch.long, device="cuda")
    if "--where" in sys.argv:
        eos_idx = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), eos_idx)
    else:
        eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    mask = (torch.arange(T, device="cuda").expand(B, -1) <= eos_idx.unsqueeze(1)).float()
    logp = model(completion).log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    loss = -(logp * mask).sum() / mask.sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
