"""A torchrun FSDP2 script that builds its model on the meta device, shards it, checks what
fully_shard made of it (FSDPModule, Shard(0) placements), then materializes it on the GPU
(to_empty + its own init), as large-model FSDP2 scripts do; Adam, gradient clipping.

    torchrun --nproc_per_node 2 fsdp2_meta_train.py --layers 4 --dim 192
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Shard


class Mixer(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 3 * dim)
        self.fc2 = nn.Linear(3 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 192, layers: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Mixer(dim) for _ in range(layers))
        self.out = nn.Linear(dim, vocab)

    def init_weights(self):
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding, nn.LayerNorm)):
                m.reset_parameters()

    def forward(self, ids):
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def build_model(vocab: int = 512, dim: int = 192, layers: int = 4) -> nn.Module:
    return Net(vocab, dim, layers)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    with torch.device("meta"):
        model = build_model(dim=args.dim, layers=args.layers)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert isinstance(model, FSDPModule) and isinstance(model, Net)
    assert all(p.placements == (Shard(0),) for p in model.parameters())
    model.to_empty(device=device)
    model.init_weights()
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(20):
        ids = torch.randint(0, 512, (args.batch_size, args.seq), device=device)
        loss = model(ids).float().logsumexp(-1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
