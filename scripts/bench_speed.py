#!/usr/bin/env python3
"""How long the interactive commands take, each as a ratio to `python -c "import torch, torchvision"`.

Every figure is a fresh process, timed from its start to its exit, and paired with the import of
the same round: the rounds run one after another, each round runs the import and then every
command once, so a busy machine slows both sides of a pair alike. A figure is reported as the
median over the rounds of (command - import) ("beyond the import") and of command / import, with
the peak resident memory of the command's process (wait4's ru_maxrss).

    import      python -c "import torch, torchvision"              (the yardstick)
    help        vest --help                                         (nothing heavy may load)
    pre-trace   the imports `vest estimate` of a torchvision model makes before its first trace
    bad-input   vest estimate with a malformed --input               (refused before any import of torch)
    estimate    vest estimate resnet50 b128 Adam, cold             (trace cache off)
    check       vest check scripts/examples/resnet50-amp.sbatch on site-config/testbed.toml, cold
    check-llama vest check scripts/examples/llama3-8b-finetune.sbatch, cold
    check-warm  vest check of the example with the trace cache filled by a first run
    vsbatch     vsbatch --dry-run of the example, cold (Slurm's answer is not waited for where it
                is not installed: --dry-run goes on without it; the cluster query runs alongside
                the estimate in any case)

Targets (issue 27): estimate <= 1 s beyond the import and <= 1 GiB RSS; check <= 3 s; check-llama
<= 8 s; check-warm <= 0.5 s; vsbatch <= 1.5 s.

    python scripts/bench_speed.py --runs 5 --out benchmarks/bench_speed.json
    python scripts/bench_speed.py --runs 5 --only import,estimate,check   # a subset
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vest_slurm.estimate import progress  # noqa: E402  (a line on a terminal's stderr, nothing otherwise)
EXAMPLE = "scripts/examples/resnet50-amp.sbatch"
LLAMA = "scripts/examples/llama3-8b-finetune.sbatch"
SITE = "site-config/testbed.toml"
VEST = [sys.executable, "-m", "vest_slurm.cli"]

# (name, argv, cache: "off" | "warm", target seconds beyond the import or None, RSS target bytes or None)
FIGURES = [
    ("import", [sys.executable, "-c", "import torch, torchvision"], "off", None, None),
    ("help", VEST + ["--help"], "off", None, None),
    # what `vest estimate` of a torchvision model imports before its first trace starts
    ("pre-trace", [sys.executable, "-c", "import vest_slurm.cli, vest_slurm.estimate.estimator, "
                   "vest_slurm.estimate.tracing, vest_slurm.estimate.models, vest_slurm.estimate.cudnn_ws, "
                   "vest_slurm.site.targets, torchvision.models"], "off", None, None),
    ("bad-input", VEST + ["estimate", "--model", "torchvision:resnet50", "--batch-size", "8", "--input", "3xAx224"],
     "off", None, None),
    ("estimate", VEST + ["estimate", "--model", "torchvision:resnet50", "--batch-size", "128",
                         "--input", "3x224x224", "--optimizer", "adam"], "off", 1.0, 1 << 30),
    ("check", VEST + ["check", EXAMPLE, "--site-config", SITE], "off", 3.0, None),
    ("check-llama", VEST + ["check", LLAMA, "--site-config", SITE], "off", 8.0, None),
    ("check-warm", VEST + ["check", EXAMPLE, "--site-config", SITE], "warm", 0.5, None),
    ("vsbatch", [sys.executable, "-m", "vest_slurm.vsbatch", "--dry-run", "--site-config", SITE, EXAMPLE],
     "off", 1.5, None),
]


def run_once(argv: list[str], env: dict) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit status) of one fresh process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_maxrss * 1024, p.returncode   # ru_maxrss is in KiB on Linux


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--only", default="", help="comma-separated figure names (import is always run)")
    ap.add_argument("--out", type=Path, default=Path("bench-results") / "bench_speed.json")
    a = ap.parse_args()
    names = {n.strip() for n in a.only.split(",") if n.strip()} | {"import"} if a.only else None
    figures = [f for f in FIGURES if names is None or f[0] in names]
    with tempfile.TemporaryDirectory(prefix="vest-speed-") as warm_dir:
        base = dict(os.environ)
        base["PYTHONPATH"] = str(ROOT) + (os.pathsep + base["PYTHONPATH"] if base.get("PYTHONPATH") else "")
        base.pop("VEST_SITE_CONFIG", None)
        base["VEST_QUIET"] = "1"
        envs = {"off": dict(base, VEST_CACHE_DIR="off"), "warm": dict(base, VEST_CACHE_DIR=warm_dir)}
        if any(f[2] == "warm" for f in figures):   # fill the cache once, not timed
            run_once(next(f for f in FIGURES if f[0] == "check-warm")[1], envs["warm"])
        rows: list[dict] = []
        for r in range(a.runs):
            for name, argv, cache, _, _ in figures:
                wall, rss, rc = run_once(argv, envs[cache])
                rows.append({"round": r, "figure": name, "wall_s": round(wall, 3), "rss_bytes": rss, "exit": rc})
                progress.step(f"round {r + 1}/{a.runs} {name}: {wall:.1f} s")
    progress.done()
    imports = {row["round"]: row["wall_s"] for row in rows if row["figure"] == "import"}
    summary = {}
    lines = [f"{'figure':12s} {'median s':>9s} {'beyond import s':>16s} {'x import':>9s} {'RSS MiB':>8s} "
             f"{'target':>8s} {'verdict':>8s} exit", "-" * 86]
    for name, _, _, target, rss_target in figures:
        mine = [row for row in rows if row["figure"] == name]
        beyond = statistics.median(row["wall_s"] - imports[row["round"]] for row in mine)
        ratio = statistics.median(row["wall_s"] / imports[row["round"]] for row in mine)
        rss = statistics.median(row["rss_bytes"] for row in mine)
        ok = (target is None or beyond <= target) and (rss_target is None or rss <= rss_target)
        summary[name] = {"median_s": statistics.median(row["wall_s"] for row in mine), "beyond_import_s": beyond,
                         "ratio_to_import": ratio, "rss_mib": rss / (1 << 20), "target_beyond_s": target,
                         "exit": sorted({row["exit"] for row in mine}),
                         "meets": None if target is None else ok}
        s = summary[name]
        tgt = "-" if target is None else f"<={target:g}"
        verdict = "-" if target is None else ("meets" if ok else "misses")
        lines.append(f"{name:12s} {s['median_s']:9.2f} {beyond:16.2f} {ratio:9.2f} {s['rss_mib']:8.0f} {tgt:>8s} "
                     f"{verdict:>8s} {','.join(map(str, s['exit']))}")
    print("\n".join(lines))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "runs": a.runs, "summary": summary, "rows": rows, "python": sys.version.split()[0],
        "machine": platform.platform(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
        "commands": {name: [w if not w.startswith(str(ROOT)) and w != sys.executable else
                            ("python" if w == sys.executable else os.path.relpath(w, ROOT)) for w in argv]
                     for name, argv, *_ in figures},
    }, indent=2) + "\n")
    print(f"results written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
