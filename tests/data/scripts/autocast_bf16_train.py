"""A language model's step under torch.autocast("cuda", bfloat16), written by hand: a softmax over
attention scores, LayerNorm (or RMSNorm), a log-softmax loss. Under CUDA's autocast those run in
float32 (their outputs and saved tensors are float32); under the CPU's they would stay bfloat16.
On a GPU, RMSNorm is one fused kernel (_fused_rms_norm) that saves the input and one rstd per row."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--seq", type=int, default=256)
p.add_argument("--dim", type=int, default=64)
p.add_argument("--vocab", type=int, default=256)
p.add_argument("--norm", choices=["layer", "rms"], default="layer")
p.add_argument("--fp32", action="store_true", help="no autocast")
args = p.parse_args()


Norm = nn.LayerNorm if args.norm == "layer" else nn.RMSNorm


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.ln2 = Norm(d), Norm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.proj(att @ v)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(args.vocab, args.dim)
        self.blocks = nn.Sequential(Block(args.dim), Block(args.dim))
        self.ln = Norm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab, bias=False)

    def forward(self, idx):
        return self.head(self.ln(self.blocks(self.emb(idx))))


model = LM().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(5):
    idx = torch.randint(0, args.vocab, (args.batch_size, args.seq + 1))
    x, y = idx[:, :-1].cuda(), idx[:, 1:].cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not args.fp32):
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step} loss {loss.item():.4f}")
