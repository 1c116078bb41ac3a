"""A torchrun FSDP1 script with its own model class: FullyShardedDataParallel with
transformer_auto_wrap_policy on each residual block, MixedPrecision (param bf16, reduce fp32, buffers
bf16), a sharding strategy from the command line, device_id placement of a CPU-built model, AdamW,
FSDP's clip_grad_norm_.

    torchrun --nproc_per_node 4 fsdp1_train.py --strategy FULL_SHARD --width 256 --blocks 3 --batch-size 8
``build_model`` is the factory a declarative estimate names (--model fsdp1_train.py:build_model).
"""

import argparse
import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy


class Residual(nn.Module):
    """A pre-norm residual block: attention over the sequence, then a gated MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm_a = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True, bias=False)
        self.norm_m = nn.LayerNorm(width)
        self.gate = nn.Linear(width, 2 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        h = self.norm_a(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        a, b = self.gate(self.norm_m(x)).chunk(2, dim=-1)
        return x + self.out(a * F.silu(b))


class Classifier(nn.Module):
    """Patch sequences in, a class out: a linear stem, residual blocks, a pooled head."""

    def __init__(self, features: int = 48, width: int = 256, blocks: int = 3, heads: int = 4, classes: int = 100):
        super().__init__()
        self.stem = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Residual(width, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.stem(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x).mean(dim=1))


def build_model(features: int = 48, width: int = 256, blocks: int = 3, heads: int = 4, classes: int = 100) -> nn.Module:
    return Classifier(features, width, blocks, heads, classes)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="FULL_SHARD", choices=[s.name for s in ShardingStrategy])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()

    dist.init_process_group("nccl")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    model = build_model(width=args.width, blocks=args.blocks)   # on the CPU: FSDP moves it (device_id)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Residual})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=policy, mixed_precision=mp, device_id=torch.cuda.current_device(),
                 sharding_strategy=ShardingStrategy[args.strategy])
    assert isinstance(model, FSDP)
    # the wrapper's own state, as FSDP1 sets it (DINOv2 reads the strategy)
    assert model.sharding_strategy == ShardingStrategy[args.strategy] and model.mixed_precision is mp
    assert args.strategy.startswith("HYBRID") or (model.rank, model.world_size) == (dist.get_rank(), dist.get_world_size())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    for step in range(args.steps):
        x = torch.randn(args.batch_size, args.seq, 48, device="cuda")
        y = torch.randint(0, 100, (args.batch_size,), device="cuda")
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 and dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
