"""A torchrun FSDP2 script with its own model class (a vest-slurm example): a small decoder-only
transformer, ``fully_shard`` on each block and the root, MixedPrecisionPolicy bf16 / fp32, AdamW.

    torchrun --nproc_per_node 4 train_fsdp2.py --dim 512 --layers 4 --seq 256 --batch-size 4
``build_model`` is also the factory a declarative estimate names:
    vest estimate --model scripts/examples/train_fsdp2.py:build_model --input seq256 --batch-size 4 \
        --optimizer adamw --parallelism fsdp2 --num-gpus 4 --param-dtype bf16 --reduce-dtype fp32
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32000, dim: int = 512, layers: int = 4, heads: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model(vocab: int = 32000, dim: int = 512, layers: int = 4, heads: int = 8) -> nn.Module:
    return TinyLM(vocab, dim, layers, heads)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    model = build_model(dim=args.dim, layers=args.layers).cuda()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.head.out_features
    for step in range(args.steps):
        ids = torch.randint(0, vocab, (args.batch_size, args.seq + 1), device="cuda")
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 and dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f} peak {torch.cuda.max_memory_allocated() >> 20} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
