"""Tensor parallelism in the Megatron style with torch's ParallelStyles over a 1-D mesh of the
launch's ranks: a row-parallel embedding, column- then row-parallel MLPs, a column-parallel head
gathered for the loss; --sp adds sequence parallelism (norms on the rank's tokens, reduce-scatter
and all-gather around the MLPs). --by-hand builds the same rank's shards as plain modules of the
local sizes, with each collective's new output tensor made by hand: what one rank holds."""
import argparse
import os

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

p = argparse.ArgumentParser()
p.add_argument("--dim", type=int, default=256)
p.add_argument("--hidden", type=int, default=1032)
p.add_argument("--vocab", type=int, default=2001)     # not a multiple of 4: uneven shards
p.add_argument("--seq", type=int, default=64)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--blocks", type=int, default=2)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--sp", action="store_true")
p.add_argument("--heads", type=int, default=0, help="an attention per block whose q/k/v stay DTensors "
               "(use_local_output=False) and are viewed to the model's whole head count, as the TP tutorial's")
p.add_argument("--by-hand", action="store_true")
p.add_argument("--dp", type=int, default=1, help="FSDP2 (fully_shard per block) over this many of the ranks, "
               "tensor parallelism over the rest: a 2-D mesh")
args = p.parse_args()
tp = int(os.environ.get("WORLD_SIZE", "1")) // args.dp


def cdiv(a, b):
    return -(-a // b)


class Collective(torch.autograd.Function):
    """By hand: a collective's output is a new tensor of the given local shape; its backward too."""

    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape = x.shape
        return x.new_empty(shape)

    @staticmethod
    def backward(ctx, g):
        return g.new_empty(ctx.shape), None


class AllReduce(torch.autograd.Function):
    """By hand: a partial sum all-reduced into a new tensor; its gradient passes as it is."""

    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        return g


class GradAllReduce(torch.autograd.Function):
    """By hand: a replicated input of a column-parallel layer; its partial gradient all-reduced."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch.empty_like(g)


def resized(x, dim, size):
    shape = list(x.shape)
    shape[dim] = size
    return Collective.apply(x, shape)


class Attention(nn.Module):
    def __init__(self, d, by_hand):
        super().__init__()
        self.heads = args.heads // tp if by_hand else args.heads   # by hand: this rank's heads
        self.wq, self.wk, self.wv = (nn.Linear(d, d // tp if by_hand else d, bias=False) for _ in range(3))
        self.wo = nn.Linear(d // tp if by_hand else d, d, bias=False)
        self.by_hand = by_hand

    def forward(self, x):
        b, s, d = x.shape
        # by hand: each column-parallel projection's input gradient is all-reduced on its own
        q, k, v = (w(GradAllReduce.apply(x) if self.by_hand else x).view(b, s, self.heads, d // args.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.wo(y.transpose(1, 2).reshape(b, s, -1))
        return AllReduce.apply(y) if self.by_hand else y


class Block(nn.Module):
    def __init__(self, d, h, by_hand):
        super().__init__()
        self.attn = Attention(d, by_hand) if args.heads else None
        self.norm = nn.LayerNorm(d)
        self.w1 = nn.Linear(d, cdiv(h, tp) if by_hand else h)
        self.w2 = nn.Linear(cdiv(h, tp) if by_hand else h, d)
        self.by_hand = by_hand

    def forward(self, x):
        if self.attn is not None:
            x = x + self.attn(x)
        y = self.norm(x)
        if self.by_hand and args.sp:
            y = resized(y, 1, y.shape[1] * tp)                    # all-gather the tokens
        elif self.by_hand:
            y = GradAllReduce.apply(y)
        y = self.w2(nn.functional.gelu(self.w1(y)))
        if self.by_hand:
            y = resized(y, 1, cdiv(y.shape[1], tp)) if args.sp else AllReduce.apply(y)
        return x + y


class Net(nn.Module):
    def __init__(self, by_hand=False):
        super().__init__()
        v = cdiv(args.vocab, tp) if by_hand else args.vocab
        self.emb = nn.Embedding(v, args.dim)
        self.blocks = nn.ModuleList(Block(args.dim, args.hidden, by_hand) for _ in range(args.blocks))
        self.norm = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, v, bias=False)
        self.by_hand = by_hand

    def forward(self, ids):
        if self.by_hand:
            mask = ids >= self.emb.num_embeddings
            h = self.emb(ids.clamp(max=self.emb.num_embeddings - 1)).masked_fill(mask.unsqueeze(-1), 0)
            h = resized(h, 1, cdiv(h.shape[1], tp)) if args.sp else AllReduce.apply(h)
        else:
            h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        h = self.norm(h)
        if self.by_hand:
            if args.sp:
                h = resized(h, 1, h.shape[1] * tp)
            else:
                h = GradAllReduce.apply(h)
            out = self.head(h)
            return resized(out, -1, args.vocab)   # the gathered logits: every token's whole vocabulary
        return self.head(h)


model = Net(args.by_hand).cuda()
if not args.by_hand:
    mesh2d = init_device_mesh("cuda", (args.dp, tp), mesh_dim_names=("dp", "tp"))
    mesh = mesh2d["tp"]
    if args.sp:
        plan = {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "blocks.*.norm": SequenceParallel(),
                "blocks.*.w1": ColwiseParallel(input_layouts=Shard(1)),
                "blocks.*.w2": RowwiseParallel(output_layouts=Shard(1)),
                "norm": SequenceParallel(),
                "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    else:
        plan = {"emb": RowwiseParallel(input_layouts=Replicate()),
                "blocks.*.w1": ColwiseParallel(), "blocks.*.w2": RowwiseParallel(),
                "head": ColwiseParallel(output_layouts=Replicate())}
        if args.heads:
            plan.update({f"blocks.*.attn.{w}": ColwiseParallel(use_local_output=False) for w in ("wq", "wk", "wv")})
            plan["blocks.*.attn.wo"] = RowwiseParallel()
    model = parallelize_module(model, mesh, plan)
if args.dp > 1:
    from torch.distributed.fsdp import fully_shard

    for b in model.blocks:
        fully_shard(b, mesh=mesh2d["dp"] if not args.by_hand else None)
    fully_shard(model, mesh=mesh2d["dp"] if not args.by_hand else None)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(args.steps):
    ids = torch.randint(0, args.vocab, (args.batch_size, args.seq), device="cuda")
    logits = model(ids)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
