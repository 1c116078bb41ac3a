#!/usr/bin/env python3
"""Host ops under dynamic analysis: what one small torch op on the host costs in a script that vest
runs (its torch function modes, the fake mode's checks), against the same script run plainly.

    python scripts/bench_host_ops.py [--n 20000] [--out benchmarks/bench_host_ops.csv]

A data pipeline's per-sample torch calls run in the traced process (vest sets DataLoader workers to
0): DINOv2's sampler draws one ``torch.randint(..., generator=g).item()`` per sample of its data
set (1.28 M for ImageNet) before the first step. Each op kind runs N times in a script that then
trains 3 steps and times its own loop, run as ``python script.py`` and as ``vest estimate --
python script.py`` (each a fresh process, as a user runs it; vest's run writes the timing into its
overlay, kept with VEST_KEEP_TMP).
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import subprocess
import sys
import tempfile
import time

from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """import sys, time, torch
n, kind, device = int(sys.argv[1]), sys.argv[2], sys.argv[3]
g = torch.Generator().manual_seed(0)
x = torch.arange(1000)
ops = {{"randint(generator)": lambda i: torch.randint(0, i + 1, (1,), generator=g).item(),
        "index + item": lambda i: x[i % 1000].item(),
        "add": lambda i: x[:4] + 1,
        "zeros": lambda i: torch.zeros(3)}}
op = ops[kind]
t = time.perf_counter()
for i in range(n):
    op(i)
with open("timing.txt", "w") as f:   # (under vest this write lands in the run's overlay)
    f.write(str((time.perf_counter() - t) / n * 1e6))
model = torch.nn.Linear(64, 64).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    model(torch.randn(8, 64, device=device)).sum().backward()
    opt.step()
    opt.zero_grad()
"""
KINDS = ("randint(generator)", "index + item", "add", "zeros")


def _per_op_us(argv: list[str], cwd: str, env: dict) -> float:
    """Run the script; the microseconds per op it measured around its loop."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(argv, cwd=cwd, env=dict(env, TMPDIR=tmp, VEST_KEEP_TMP="1"), check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        found = glob.glob(os.path.join(tmp, "vest-dyn*", "redirected", "**", "timing.txt"), recursive=True)
        with open(found[0] if found else os.path.join(cwd, "timing.txt")) as f:
            return float(f.read())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20000, help="ops per run")
    p.add_argument("--out", default=os.path.join("benchmarks", "bench_host_ops.csv"))
    args = p.parse_args()
    env = dict(os.environ, VEST_CACHE_DIR="off", VEST_QUIET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    rows = []
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "host_ops.py"), "w") as f:
            f.write(SCRIPT.format())
        plain = [sys.executable, "host_ops.py"]
        vest = [sys.executable, "-m", "vest_slurm.cli", "estimate", "--gpu", "a100-40gb", "--", "python", "host_ops.py"]
        for kind in KINDS:
            per = {}
            for name, cmd, device in (("plain", plain, "cpu"), ("vest", vest, "cuda")):   # (no GPU here)
                per[name] = _per_op_us(cmd + [str(args.n), kind, device], d, env)
            rows.append({"op": kind, "n": args.n, "plain_us": round(per["plain"], 1), "vest_us": round(per["vest"], 1),
                         "ratio": round(per["vest"] / per["plain"], 1) if per["plain"] > 0 else None})
            print(f"{kind}: plain {per['plain']:.1f} us, vest {per['vest']:.1f} us", flush=True)
    print(tabulate(rows, headers="keys"))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
