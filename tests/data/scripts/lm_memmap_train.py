"""A minimal LM trainer in the style of the small GPT trainers: a token file written by the script
and memory-mapped back, random offsets drawn with torch.randint on the host, pinned batches moved
with non_blocking, an AverageMeter and f-string logging of 0-d device tensors, an atomic checkpoint
(temp file, os.replace, os.utime, shutil.move), a marker touched with pathlib and a directory walked,
that the script then checks for."""
import argparse
import os
import pathlib
import shutil

import numpy as np
import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=6)
p.add_argument("--block-size", type=int, default=32)
p.add_argument("--out-dir", default="out-lm")
args = p.parse_args()
B, T, V = args.batch_size, args.block_size, 96

os.makedirs("data", exist_ok=True)
tokens = np.memmap(os.path.join("data", "train.bin"), dtype=np.uint16, mode="w+", shape=(5000,))
tokens[:] = np.arange(5000) % V
tokens.flush()
del tokens
data = np.memmap(os.path.join("data", "train.bin"), dtype=np.uint16, mode="r")
assert "train.bin" in os.listdir("data") and os.path.getsize(os.path.join("data", "train.bin")) == 10000


def get_batch():
    ix = torch.randint(len(data) - T - 1, (B,))
    x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
    # host values are real: consecutive tokens, and a sequence of T of them
    assert x.shape == (B, T) and int(((x[:, 1:] - x[:, :-1]) % V).max()) == 1, x
    return x.pin_memory().to("cuda", non_blocking=True), y.pin_memory().to("cuda", non_blocking=True)


class AverageMeter:
    def __init__(self):
        self.val = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n

    def __str__(self):
        return "{:6.3f} ({:6.3f})".format(self.val, self.sum / self.count)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, 64)
        self.wpe = nn.Embedding(T, 64)
        self.block = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
        self.head = nn.Linear(64, V, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.block(self.wte(idx) + self.wpe(pos)))


model = TinyLM().to("cuda")
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
meter = AverageMeter()
os.makedirs(args.out_dir, exist_ok=True)
# the run's settings saved beside the checkpoints (host objects only: torch's own writer) and read back
torch.save({"args": vars(args), "seed": torch.tensor([1234])}, os.path.join(args.out_dir, "args.pt"))
assert torch.load(os.path.join(args.out_dir, "args.pt"), weights_only=False)["seed"].tolist() == [1234]
for it in range(1000):
    x, y = get_batch()
    logits = model(x)
    loss = nn.functional.cross_entropy(logits.view(-1, V), y.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    meter.update(loss, B)
    print(f"iter {it}: loss {loss:.4f} avg {meter}")
    tmp = os.path.join(args.out_dir, "ckpt.pt.tmp")
    torch.save({"model": model.state_dict(), "iter": it}, tmp)
    os.replace(tmp, os.path.join(args.out_dir, "ckpt.pt"))
    os.utime(os.path.join(args.out_dir, "ckpt.pt"))
    shutil.move(os.path.join(args.out_dir, "ckpt.pt"), os.path.join(args.out_dir, "last.pt"))
    assert os.path.exists(os.path.join(args.out_dir, "last.pt")) and "last.pt" in os.listdir(args.out_dir)
    with open(os.path.join(args.out_dir, "log.txt"), "a") as f:
        f.write(f"{it} {loss.item():.4f}\n")
    with open(os.path.join(args.out_dir, "log.txt")) as f:
        assert f.read().count("\n") >= 1
    marker = pathlib.Path(args.out_dir, "trusted_list")   # pathlib's touch: os.utime first, os.open if none
    marker.touch()
    assert marker.read_text() == ""
    _, _, files = next(os.walk(args.out_dir))             # os.walk calls next() on os.scandir's iterator
    assert "last.pt" in files and "trusted_list" in files, files
