"""Attention through FlexAttention (a causal block mask): a higher-order operator. --compile: flex_attention under torch.compile (the fused kernel), else
eager (torch's unfused implementation, which builds the score matrix)."""
import argparse

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

ap = argparse.ArgumentParser()
ap.add_argument("--compile", action="store_true")
ap.add_argument("--seq", type=int, default=256)
args = ap.parse_args()
B, H, S, D = 2, 4, args.seq, 32
attend = torch.compile(flex_attention) if args.compile else flex_attention
qkv = nn.Linear(H * D, 3 * H * D).cuda()
opt = torch.optim.AdamW(qkv.parameters(), lr=1e-3)
mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S, device="cuda")
for step in range(4):
    x = torch.randn(B, S, H * D, device="cuda")
    q, k, v = qkv(x).view(B, S, 3, H, D).permute(2, 0, 3, 1, 4)
    y = attend(q, k, v, block_mask=mask)
    loss = y.float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"{loss:.4f}")
