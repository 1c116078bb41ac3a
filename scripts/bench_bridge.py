#!/usr/bin/env python3
"""sbatch latency with and without the job_submit.lua bridge, on the real test cluster, in one run.

Three modes, three testbeds (vest_slurm.slurm.testbed) running at once, submissions round-robin across
them, N each (default 500), as a non-root user (root is exempt and would skip the bridge), script on stdin, ``--hold`` so no job runs:

  plain     no JobSubmitPlugins
  server    JobSubmitPlugins=lua + job_submit.lua + the resident decision server
  program   the same, server stopped: the per-call decision program (io.popen) every time

The job carries a valid vsbatch estimate that fits, so the bridge does the whole decision (hash,
placement) and answers "allow". Prints mean and p99 per mode and as ratios to plain.

    python scripts/bench_bridge.py [-n 500] [--json out.json]

Needs root (the testbed does) and the Slurm packages; creates and removes user vestbr-bench.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vest_slurm.slurm.attach import attach, make_payload  # noqa: E402
from vest_slurm.bridge.testbed import BridgeTestbed  # noqa: E402
from vest_slurm.estimate.record import MemoryEstimate  # noqa: E402
from vest_slurm.slurm.testbed import SlurmTestbed  # noqa: E402

USER = "vestbr-bench"
GiB = 1 << 30


def job_script() -> bytes:
    est = {"v100": MemoryEstimate("v100-16gb", 16 * GiB, 4 * GiB, 4 * GiB),
           "a100": MemoryEstimate("a100-40gb", 40 * GiB, 4 * GiB, 4 * GiB),
           "h100": MemoryEstimate("h100-80gb", 80 * GiB, 4 * GiB, 4 * GiB)}
    text = "#!/bin/bash\n#SBATCH --partition=v100\n#SBATCH --gres=gpu:v100:1\n#SBATCH --output=/dev/null\ntrue\n"
    return attach(text, make_payload(est)).encode()


def submit_one(env: dict, script: bytes) -> float:
    argv = ["runuser", "-u", USER, "--", "env", f"SLURM_CONF={env['SLURM_CONF']}", "sbatch", "--hold",
            "--parsable", "--job-name=bench"]
    t0 = time.perf_counter()
    p = subprocess.run(argv, input=script, capture_output=True, env=env, cwd="/tmp", timeout=60)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"sbatch failed: {p.stderr.decode(errors='replace')}")
    return dt


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def run_all(n: int, warmup: int = 20) -> dict[str, list[float]]:
    """The three clusters run at once and the submissions go round-robin (plain, server, program,
    plain, ...), so a busy machine slows every mode alike instead of whichever ran during the load."""
    dirs = {m: tempfile.mkdtemp(prefix=f"vest-bench-{m}-") for m in MODES}
    for d in dirs.values():
        os.chmod(d, 0o755)
    beds: dict = {}
    try:
        beds["plain"] = SlurmTestbed(dirs["plain"]).start()
        for m in ("server", "program"):
            beds[m] = BridgeTestbed(dirs[m], directives=False).start()
        beds["program"].stop_server()
        script = job_script()
        out: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(warmup + n):
            for m in MODES:
                dt = submit_one(beds[m].env, script)
                if i >= warmup:
                    out[m].append(dt)
        for m in ("server", "program"):
            log = (Path(dirs[m]) / "log" / "slurmctld.log").read_text(errors="replace")
            want = f"via={m}"
            decided = sum(1 for ln in log.splitlines() if "action=allow reason=fits" in ln and want in ln)
            if decided < n + warmup:
                raise SystemExit(f"{m}: the bridge did not decide every job ({decided} of {n + warmup})")
        return out
    finally:
        for tb in beds.values():
            tb.stop()
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)


MODES = ("plain", "server", "program")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=500)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    made = False
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/bin/sh", USER], check=True)
        made = True
    try:
        results = run_all(a.n)
    finally:
        if made:
            subprocess.run(["userdel", USER], check=False)
    base_mean = statistics.mean(results["plain"])
    base_p99 = p99(results["plain"])
    rows = []
    print(f"sbatch latency, {a.n} submissions per mode (wall time of runuser+sbatch)")
    print(f"{'mode':<9} {'mean ms':>9} {'p99 ms':>9} {'mean/plain':>11} {'p99/plain':>10}")
    for m, xs in results.items():
        mean, q = statistics.mean(xs), p99(xs)
        rows.append({"mode": m, "n": len(xs), "mean_ms": mean * 1000, "p99_ms": q * 1000,
                     "mean_ratio": mean / base_mean, "p99_ratio": q / base_p99})
        print(f"{m:<9} {mean * 1000:9.1f} {q * 1000:9.1f} {mean / base_mean:11.2f} {q / base_p99:10.2f}")
    target = rows[1]["p99_ratio"] <= 1.5
    print(f"target (server p99 within 1.5x of plain): {'met' if target else 'NOT met'}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if target else 1


if __name__ == "__main__":
    sys.exit(main())
