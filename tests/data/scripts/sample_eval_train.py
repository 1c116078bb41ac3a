"""A small language model trained with an evaluation loop and token sampling between its steps,
in the style of the minimal GPT trainers: the loss estimated over several batches under no_grad
before each step, and a few tokens sampled one forward pass at a time after it, the context
cropped to the block size. --cache: the model writes each call's keys into a buffer it owns (a
KV cache), --counter: its forward counts its calls in an attribute and branches on the count,
--amp: each call under its own autocast region, as nanoGPT's ``with ctx:``; --switch: a flag of the
model's config object (transformers' ``model.config.use_cache`` habit) turned on after step 1."""
import argparse
import contextlib

import torch
from torch import nn
from torch.nn import functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=4)
p.add_argument("--block-size", type=int, default=16)
p.add_argument("--eval-iters", type=int, default=6)
p.add_argument("--sample", type=int, default=24)
p.add_argument("--cache", action="store_true")
p.add_argument("--counter", action="store_true")
p.add_argument("--switch", action="store_true", help="a flag of the model's config object turned on after the first step")
p.add_argument("--amp", action="store_true", help="each call of the model under its own autocast region (bf16)")
args = p.parse_args()
V, D = 80, 32
ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if args.amp else contextlib.nullcontext


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        if args.cache:
            self.register_buffer("keys", torch.zeros(args.batch_size, args.block_size, D))

    def forward(self, x):
        q, k, v = self.qkv(self.ln(x)).split(D, dim=2)
        if args.cache and not self.training and x.shape[0] <= self.keys.shape[0]:
            self.keys[:x.shape[0], :x.shape[1]] = k
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.mlp(x)


class Config:
    twice = False


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Embedding(args.block_size, D)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(D, V)
        self.calls = 0
        self.config = Config()

    def forward(self, idx, targets=None):
        if args.counter:
            self.calls += 1
            if self.calls % 2:
                idx = idx[:, -4:]
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        logits = self.head(self.blocks(x))
        if self.config.twice:
            logits = logits + self.head(x)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets[:, -t:].flatten())
        return logits, loss


@torch.no_grad()
def estimate_loss(model):
    model.eval()
    losses = torch.zeros(args.eval_iters)
    for k in range(args.eval_iters):
        x, y = batch()
        with ctx():
            _, loss = model(x, y)
        losses[k] = loss.item()
    model.train()
    return losses.mean()


@torch.no_grad()
def sample(model, idx, n):
    model.eval()
    for _ in range(n):
        with ctx():
            logits, _ = model(idx[:, -args.block_size:])
        probs = F.softmax(logits[:, -1, :], dim=-1)
        idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
    model.train()
    return idx


data = torch.randint(0, V, (4096,))


def batch():
    ix = torch.randint(len(data) - args.block_size - 1, (args.batch_size,))
    x = torch.stack([data[i:i + args.block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + args.block_size] for i in ix])
    return x.cuda(), y.cuda()


model = TinyLM().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    print(f"step {step}: eval loss {estimate_loss(model):.4f}")
    x, y = batch()
    with ctx():
        _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if args.switch and step == 1:
        model.config.twice = True
    out = sample(model, torch.zeros((1, 1), dtype=torch.long, device="cuda"), args.sample)
    print("sampled", "".join(chr(32 + int(i)) for i in out[0].tolist()))
