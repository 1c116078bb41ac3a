#!/usr/bin/env python3
"""Time `vsbatch` from start to job id for a resnet50 workload, split into estimate and everything else.

Starts its own Slurm testbed (vest_slurm.slurm.testbed; needs root and the Debian Slurm packages), then runs
`vsbatch --json` as a fresh process N times on scripts/examples/resnet50-amp.sbatch (or --script) and
reads the phase timings vsbatch reports:

    wall        process start to the job id on stdout, measured here (exit follows: vsbatch skips
                the interpreter's teardown)
    estimate    tracing + allocator replay on every GPU type (torch's import included: it happens
                only to estimate)
    other       wall - estimate: interpreter start-up and imports, parsing (#SBATCH/#VEST, site
                config), the cluster query (sinfo --json + scontrol show partition), placement, the
                attached copy and sbatch
      startup     interpreter start-up and imports (wall - vsbatch's own in-process total)
      parse, cluster, place, sbatch   as vsbatch measured them (the cluster query runs in a
                  thread during the estimate: only starting it and any wait left count)

Target: other <= 0.3 s. Prints a table and writes the raw runs and the summary as JSON (--out).

    python scripts/bench_vsbatch.py --runs 5 --out bench-results/vsbatch.json
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
# The benchmarks time the work itself: no trace cache and no stored cuDNN answers (tracecache.py).
os.environ["VEST_CACHE_DIR"] = "off"

from vest_slurm.slurm.testbed import SlurmTestbed, missing_binaries  # noqa: E402

TARGET_OTHER_S = 0.3
PHASES = ("parse_s", "cluster_s", "place_s", "sbatch_s")


def checkout_relative(path: Path) -> str:
    """A path as a results file keeps it: relative to the checkout, never the machine's own path."""
    path = path.resolve()
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return path.name


def one_run(script: Path, site: Path, env: dict, cwd: Path) -> dict:
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "vest_slurm.vsbatch", "--json", "--site-config", str(site), script.name],
                         cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = p.stdout.readline()          # vsbatch prints (and flushes) its JSON once sbatch gave the job id
    to_output = time.perf_counter() - t0
    rest = p.stdout.read()               # stderr is a few lines: it cannot fill its pipe meanwhile
    err = p.stderr.read()
    p.wait(timeout=600)
    to_exit = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"vsbatch failed (exit {p.returncode}):\n{err}")
    d = json.loads(first + rest)
    if not d.get("job_id"):
        raise SystemExit(f"vsbatch printed no job id:\n{first + rest}\n{err}")
    t = d["timing"]
    row = {"job_id": d["job_id"], "partition": d["partition"], "gres": d["gres"], "estimate_mib": d["estimate_mib"],
           "wall_s": to_output, "exit_s": to_exit, "estimate_s": t.get("estimate_s", 0.0),
           "in_process_s": t["total_s_in_process"]}
    for ph in PHASES:
        row[ph] = t.get(ph, 0.0)
    row["cluster_overlapped_s"] = t.get("cluster_query_overlapped_s", 0.0)
    row["other_s"] = to_output - row["estimate_s"]
    row["startup_s"] = to_output - row["in_process_s"]
    row["other_in_process_s"] = row["in_process_s"] - row["estimate_s"]
    return row


def summarize(rows: list[dict]) -> dict:
    keys = ("wall_s", "exit_s", "estimate_s", "other_s", "startup_s", "other_in_process_s",
            "cluster_overlapped_s") + PHASES
    return {k: {"median": statistics.median(r[k] for r in rows), "min": min(r[k] for r in rows),
                "max": max(r[k] for r in rows)} for k in keys}


def table(summary: dict) -> str:
    labels = [("wall_s", "start to job id (wall)"), ("exit_s", "start to exit (wall)"), ("estimate_s", "estimate (torch import, trace, replay)"),
              ("other_s", "everything else (wall - estimate)"), ("startup_s", "  interpreter start-up, imports"),
              ("parse_s", "  parse script, #VEST, site config"), ("cluster_s", "  cluster query: start + wait"),
              ("cluster_overlapped_s", "    (sinfo+scontrol, run during the estimate)"),
              ("place_s", "  placement"), ("sbatch_s", "  attach copy + sbatch"),
              ("other_in_process_s", "  everything else inside vsbatch")]
    lines = [f"{'phase':42s} {'median s':>9s} {'min s':>7s} {'max s':>7s}", "-" * 68]
    for k, label in labels:
        s = summary[k]
        lines.append(f"{label:42s} {s['median']:9.3f} {s['min']:7.3f} {s['max']:7.3f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--script", type=Path, default=ROOT / "scripts" / "examples" / "resnet50-amp.sbatch")
    ap.add_argument("--site-config", type=Path, default=ROOT / "site-config" / "testbed.toml")
    ap.add_argument("--out", type=Path, default=Path("bench-results") / "vsbatch.json")
    a = ap.parse_args()
    missing = missing_binaries()
    if missing:
        print(f"bench_vsbatch: Slurm not installed (missing {', '.join(missing)})", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="vest-bench-") as tmp:
        tmp = Path(tmp)
        work = tmp / "jobs"
        work.mkdir()
        script = work / a.script.name
        script.write_text(a.script.read_text())
        tb = SlurmTestbed(tmp / "slurm")
        tb.start()
        try:
            env = dict(tb.env)
            env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            rows = [one_run(script, a.site_config, env, work) for _ in range(a.runs)]
        finally:
            tb.stop()
    summary = summarize(rows)
    print(f"vsbatch on {a.script.name}: {rows[0]['partition']} {rows[0]['gres']}, estimate {rows[0]['estimate_mib']} MiB; "
          f"{a.runs} runs, fresh process each\n")
    print(table(summary))
    other = summary["other_s"]["median"]
    verdict = "meets" if other <= TARGET_OTHER_S else "misses"
    print(f"\neverything else: {other:.3f} s median, {verdict} the {TARGET_OTHER_S} s target "
          f"(inside vsbatch: {summary['other_in_process_s']['median']:.3f} s; start-up: {summary['startup_s']['median']:.3f} s)")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "script": checkout_relative(a.script), "site_config": checkout_relative(a.site_config), "runs": rows, "summary": summary,
        "target_other_s": TARGET_OTHER_S, "python": sys.version.split()[0], "machine": platform.platform(),
        "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
    }, indent=2))
    print(f"results written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
