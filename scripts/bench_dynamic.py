#!/usr/bin/env python3
"""Dynamic vs declarative estimate: wall time, peak host memory (RSS) and agreement, per example.

    python scripts/bench_dynamic.py [--out results/bench_dynamic.csv] [--repeat 1]

Each estimate runs as its own `vest estimate` process, cold (torch imported each time), as a user
would run it; peak RSS is the largest resident set of that process and its children (the dynamic
analysis runs the script in a child). Targets (issue 6): dynamic at most 2x the declarative time,
at most 2 GiB RSS.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time

from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The benchmarks time the work itself: no trace cache and no stored cuDNN answers (tracecache.py).
os.environ["VEST_CACHE_DIR"] = "off"
EXAMPLES = os.path.join(ROOT, "scripts", "examples")

CASES = [
    ("imagenet resnet50 sgd bf16 b64",
     ["python", "train_imagenet.py", "--arch", "resnet50", "--batch-size", "64", "--optimizer", "sgd", "--amp", "bf16"],
     # as the script runs it: cudnn.benchmark on, zero_grad at the step's start (the workload block says so)
     ["--model", "torchvision:resnet50", "--batch-size", "64", "--optimizer", "sgd-momentum", "--precision", "amp-bf16",
      "--cudnn-benchmark", "on", "--zero-grad", "before-backward"]),
    ("gpt2-small lm bf16 b8 s1024",
     ["python", "train_lm.py", "--n-layer", "12", "--n-embd", "768", "--n-head", "12", "--seq-len", "1024",
      "--batch-size", "8", "--amp", "bf16"],
     ["--model", "hf:GPT2LMHeadModel", "--model-args", '{"n_layer":12,"n_embd":768,"n_head":12,"n_positions":1024}',
      "--input", "seq1024", "--batch-size", "8", "--precision", "amp-bf16", "--optimizer", "adamw"]),
    ("own autoencoder b32 128px",
     ["python", "train_own_model.py", "--width", "64", "--image-size", "128", "--batch-size", "32"],
     ["--model", "train_own_model.py:build_model", "--input", "3x128x128", "--batch-size", "32",
      "--optimizer", "sgd-momentum", "--loss", "mse"]),
]

def measure(argv: list[str]) -> dict:
    """One `vest estimate` (bench_scripts.measure: the process tree's peak resident set, sampled,
    so that the script's child counts; the getrusage of children it replaced saw only the estimating
    process, as bubblewrap's pid-namespace init reaps the script's)."""
    from bench_scripts import measure as measure_tree   # scripts/ is this script's sys.path[0]

    doc = measure_tree(argv, EXAMPLES)
    if doc["rc"] != 0:
        raise SystemExit(f"failed: {' '.join(argv)}\n{doc['stderr']}")
    doc["estimate"] = doc["json"]["estimates"][0]
    return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "results", "bench_dynamic.csv"))
    p.add_argument("--gpu", default="a100-80gb")
    args = p.parse_args()
    vest = [sys.executable, "-m", "vest_slurm.cli", "estimate", "--gpu", args.gpu, "--json"]
    rows = []
    t_all = time.perf_counter()
    for name, command, declared in CASES:
        dec = measure(vest + declared)
        dyn = measure(vest + ["--", *command])
        pe, pd = dyn["estimate"]["peak_mib"], dec["estimate"]["peak_mib"]
        rows.append({
            "example": name,
            "declarative_s": round(dec["seconds"], 2), "dynamic_s": round(dyn["seconds"], 2),
            "time_ratio": round(dyn["seconds"] / dec["seconds"], 2),
            "declarative_rss_mib": round(dec["maxrss_kib"] / 1024), "dynamic_rss_mib": round(dyn["maxrss_kib"] / 1024),
            "declarative_peak_mib": pd, "dynamic_peak_mib": pe, "peak_diff_pct": round(100 * (pe - pd) / pd, 2),
            "params_equal": dyn["estimate"]["breakdown"]["parameters"] == dec["estimate"]["breakdown"]["parameters"],
            "grads_equal": dyn["estimate"]["breakdown"]["gradients"] == dec["estimate"]["breakdown"]["gradients"],
            "state_equal": dyn["estimate"]["breakdown"]["optimizer_state"] == dec["estimate"]["breakdown"]["optimizer_state"],
        })
    print(tabulate(rows, headers="keys", tablefmt="github"))
    print(f"\ntotal {time.perf_counter() - t_all:.1f} s on {os.cpu_count()} CPUs; GPU profile {args.gpu}; "
          f"targets: time_ratio <= 2, dynamic_rss_mib <= 2048, |peak_diff_pct| <= 2")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
