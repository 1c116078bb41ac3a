#!/usr/bin/env python3
"""Start-up cost of the bridge's per-call decision program (what job_submit.lua runs when no
server answers): wall time, modules loaded and peak RSS of
``python -m vest_slurm.bridge.decide --site-config site-config/testbed.toml < request``,
for a request carrying an estimate vsbatch attached. Median of N runs, paired in the same run
against ``python -c pass`` (the interpreter alone).

    python scripts/bench_decide_startup.py [--runs 20] [--tree DIR] [--out benchmarks/decide-startup.json]

``--tree`` times another checkout's package (e.g. a git worktree of an older commit) the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def request(tree: Path) -> bytes:
    code = ("import json; from vest_slurm.slurm.attach import attach, make_payload; "
            "from vest_slurm.estimate.record import MemoryEstimate\n"
            "est = {'a100': MemoryEstimate('a100-40gb', 0, 30 << 30, 30 << 30)}\n"
            "s = attach('#!/bin/bash\\n#SBATCH --gres=gpu:v100:1\\ntrue\\n', make_payload(est))\n"
            "print(json.dumps({'v': 1, 'uid': 1001, 'partition': 'v100', 'tres_per_node': 'gres:gpu:v100:1', 'script': s}))")
    if not (tree / "vest_slurm" / "slurm").is_dir():   # the layout before the stage packages
        code = code.replace("vest_slurm.slurm.attach", "vest_slurm.attach").replace("vest_slurm.estimate.record", "vest_slurm.estimate")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, cwd=tree,
                          env=dict(os.environ, PYTHONPATH=str(tree))).stdout


def timed(argv, data: bytes, tree: Path) -> tuple[float, int]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    r = subprocess.run(argv, input=data, capture_output=True, cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)))
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{argv} failed: {r.stderr.decode()[-500:]}")
    return dt, max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--tree", type=Path, default=ROOT)
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args()
    tree = ns.tree.resolve()
    data = request(tree)
    site = str(tree / "site-config" / "testbed.toml")
    decide = [sys.executable, "-m", "vest_slurm.bridge.decide", "--site-config", site]
    modules = subprocess.run([sys.executable, "-X", "importtime", "-m", "vest_slurm.bridge.decide", "--site-config", site],
                             input=data, capture_output=True, cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)))
    n_modules = sum(1 for line in modules.stderr.decode().splitlines() if line.startswith("import time:")) - 1
    answer = json.loads(subprocess.run(decide, input=data, capture_output=True, cwd=tree,
                                       env=dict(os.environ, PYTHONPATH=str(tree))).stdout)
    bare, prog = [], []
    for _ in range(ns.runs):   # interleaved: both see the same machine load
        bare.append(timed([sys.executable, "-c", "pass"], b"", tree)[0])
        prog.append(timed(decide, data, tree)[0])
    rss_kib = timed(decide, data, tree)[1]
    res = {"tree": os.path.relpath(tree, ROOT) if tree.is_relative_to(ROOT) else tree.name, "runs": ns.runs,
           "decision": f"{answer['action']} ({answer['reason']})",
           "python_median_s": round(statistics.median(bare), 4), "decide_median_s": round(statistics.median(prog), 4),
           "decide_beyond_python_s": round(statistics.median(prog) - statistics.median(bare), 4),
           "modules_imported": n_modules, "peak_rss_mib": round(rss_kib / 1024, 1)}
    print(json.dumps(res, indent=1))
    if ns.out:
        ns.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
