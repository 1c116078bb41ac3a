#!/usr/bin/env python3
"""sbatch latency with and without the job_submit.lua bridge, on the real test cluster, in one run;
and (--burst) the bridge under bursts and faults.

Three modes, three testbeds (vest_slurm.slurm.testbed) running at once, submissions round-robin across
them, N each (default 500), as a non-root user (root is exempt and would skip the bridge), script on stdin, ``--hold`` so no job runs:

  plain     no JobSubmitPlugins
  server    JobSubmitPlugins=lua + job_submit.lua + the resident decision server
  program   the same, server stopped: the per-call decision program (io.popen) every time

The job carries a valid vsbatch estimate that fits, so the bridge does the whole decision (hash,
placement) and answers "allow". Prints mean and p99 per mode and as ratios to plain.

    python scripts/bench_bridge.py [-n 500] [--json out.json]

--burst CLIENTSxJOBS: CLIENTS threads each submit JOBS plain sbatch one after another, all at once,
every job carrying an estimate that must be rerouted (it asks for v100, needs 20 GiB: a100), under
--fault (several may be given; default all) with the shipped [bridge] defaults (timeout_s,
fallback_ms_per_s, fallback_burst_ms) and --fail open|closed (default both):

  none   the server up; a plain testbed (no plugin) gets the same burst in the same run, in turns
         with the bridge's, for the p99 ratio
  kill   a third of the way in the server is stopped (SIGSTOP) until a request waits on its socket
         (at most 0.1 s), then killed (SIGKILL): a request is in flight when it dies; a supervisor
         restarts it at once (the unit's Restart=always, RestartSec=0)
  hang   a third of the way in the server is stopped (SIGSTOP) for the rest of the burst
  down   no server for the whole burst

and counts: submissions per second, latency median/p99/max, `sinfo` worst (a loop beside the burst),
ghost jobs (sbatch failed, the job exists), wrong admissions (a job that exists outside a100), split
into those the site's fail-open policy let through (the Lua's fail-mode line names the job) and any
other, jobs reported submitted that do not exist, and the requests in flight when the server died
and how they were decided. A fresh bridge testbed per case (a fresh Lua state).

    python scripts/bench_bridge.py --burst 32x25 [--fault none --fault kill ...] [--fail closed]
        [--json benchmarks/bench_bridge_burst.json]

Needs root (the testbed does) and the Slurm packages; creates and removes user vestbr-bench.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vest_slurm.slurm.attach import attach, make_payload  # noqa: E402
from vest_slurm.bridge.testbed import BridgeTestbed  # noqa: E402
from vest_slurm.estimate.record import MemoryEstimate  # noqa: E402
from vest_slurm.slurm.testbed import SlurmTestbed  # noqa: E402
from vest_slurm.site.config import Bridge  # noqa: E402

USER = "vestbr-bench"
GiB = 1 << 30


def job_script(need_gib: float = 4) -> bytes:
    """Fits v100 at the default 4 GiB (the serial mode: "allow"); 20 GiB must go to a100 (--burst)."""
    need = int(need_gib * GiB)
    est = {"v100": MemoryEstimate("v100-16gb", 16 * GiB, need, need),
           "a100": MemoryEstimate("a100-40gb", 40 * GiB, need, need),
           "h100": MemoryEstimate("h100-80gb", 80 * GiB, need, need)}
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
    ap.add_argument("--burst", default=None, metavar="CLIENTSxJOBS")
    ap.add_argument("--fault", action="append", choices=FAULTS, default=None)
    ap.add_argument("--fail", choices=("open", "closed", "both"), default="both")
    ap.add_argument("--fallback-burst-ms", type=int, default=None, help="instead of the shipped [bridge] default")
    ap.add_argument("--fallback-ms-per-s", type=int, default=None, help="instead of the shipped [bridge] default")
    ap.add_argument("--rounds", type=int, default=2, help="--fault none: plain and bridge bursts in turns, each this often")
    a = ap.parse_args()
    made = False
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/bin/sh", USER], check=True)
        made = True
    try:
        if a.burst:
            return burst_main(a)
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


# ---------------------------------------------------------------- --burst

FAULTS = ("none", "kill", "hang", "down")


def _sbatch(env: dict, script: bytes, name: str) -> tuple[int, float, str]:
    argv = ["runuser", "-u", USER, "--", "env", f"SLURM_CONF={env['SLURM_CONF']}", "sbatch", "--hold",
            "--parsable", f"--job-name={name}"]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, input=script, capture_output=True, env=env, cwd="/tmp", timeout=120)
        rc, err = p.returncode, p.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired:
        rc, err = 124, "sbatch did not return within 120 s"
    return rc, time.perf_counter() - t0, err


class Burst:
    """CLIENTS threads x JOBS sbatch each, all at once, with a sinfo loop beside them."""

    def __init__(self, env: dict, clients: int, jobs: int, script: bytes, prefix: str):
        self.env, self.clients, self.jobs, self.script, self.prefix = env, clients, jobs, script, prefix
        self.results: list[tuple[str, int, float, str]] = []
        self.sinfo: list[float] = []
        self.done = 0
        self._lock = threading.Lock()
        self.progress = threading.Condition(self._lock)

    def _client(self, i: int) -> None:
        for j in range(self.jobs):
            name = f"{self.prefix}-{i}-{j}"
            rc, dt, err = _sbatch(self.env, self.script, name)
            with self._lock:
                self.results.append((name, rc, dt, err))
                self.done += 1
                self.progress.notify_all()

    def _sinfo_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                subprocess.run(["sinfo", "-h"], capture_output=True, env=self.env, timeout=60)
            except subprocess.TimeoutExpired:
                pass
            self.sinfo.append(time.perf_counter() - t0)
            stop.wait(0.1)

    def wait_done(self, n: int) -> None:
        with self._lock:
            while self.done < n:
                self.progress.wait(1)

    def run(self, fault=None) -> float:
        stop = threading.Event()
        side = threading.Thread(target=self._sinfo_loop, args=(stop,), daemon=True)
        threads = [threading.Thread(target=self._client, args=(i,)) for i in range(self.clients)]
        t0 = time.perf_counter()
        side.start()
        for t in threads:
            t.start()
        if fault is not None:
            fault(self)
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        stop.set()
        side.join()
        return wall


def _jobs(env: dict) -> dict[str, tuple[str, str]]:
    r = subprocess.run(["squeue", "-h", "-a", "-t", "all", "-o", "%j|%P|%T"], capture_output=True, text=True,
                       env=env, timeout=120)
    out = {}
    for line in r.stdout.splitlines():
        name, part, state = line.rsplit("|", 2)
        out[name] = (part, state)
    return out


def _pending_connections(sock: str) -> int:
    r = subprocess.run(["ss", "-xlH", "src", sock], capture_output=True, text=True, timeout=10)
    fields = r.stdout.split()
    return int(fields[2]) if len(fields) > 2 and fields[2].isdigit() else 0


def _kill_in_flight(tb: BridgeTestbed, box: dict):
    def fault(b: Burst) -> None:
        b.wait_done(b.clients * b.jobs // 3)
        pid = tb.server.pid
        os.kill(pid, signal.SIGSTOP)
        # A request is in flight once one waits on the socket, or within 0.1 s anyway (the one the
        # stopped server had accepted: the Lua waits for it up to its limit, 0.8 s by default).
        deadline = time.monotonic() + 0.1
        while _pending_connections(str(tb.socket_path)) == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        box["in_flight_seen"] = _pending_connections(str(tb.socket_path))
        os.kill(pid, signal.SIGKILL)
    return fault


def _hang(tb: BridgeTestbed, box: dict):
    def fault(b: Burst) -> None:
        b.wait_done(b.clients * b.jobs // 3)
        box["hung_pid"] = tb.server.pid
        os.kill(tb.server.pid, signal.SIGSTOP)
    return fault


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


def _count(b: Burst, env: dict, log: str, wall: float) -> dict:
    jobs = _jobs(env)
    lines = {}
    for ln in log.splitlines():
        m = re.search(r"vest-bridge: action=\S+ .* job=(\S+)", ln)
        if m and m.group(1).startswith(b.prefix):
            lines[m.group(1)] = ln
    ghost = wrong = wrong_fail_open = missing = refused = undecided_logline = 0
    for name, rc, _dt, _err in b.results:
        rec = jobs.get(name)
        exists = rec is not None and rec[1] != "FAILED"
        if rc != 0:
            refused += 1
            ghost += exists
        elif not exists:
            missing += 1
        if exists and rec[0] != "a100":
            wrong += 1
            ln = lines.get(name, "")
            if "fail=open" in ln and "reason=bridge-" in ln:
                wrong_fail_open += 1
            elif not ln:
                undecided_logline += 1
    lat = [dt for _n, _rc, dt, _e in b.results]
    via = {k: sum(1 for ln in lines.values() if f"via={k}" in ln) for k in ("server", "program", "lua")}
    in_flight = [ln for ln in lines.values() if "after=server-io" in ln]
    # decided by job_submit.lua itself (not its fail mode): what each took inside the controller's lock
    by_lua = [float(m.group(1)) for ln in lines.values() if " via=lua" in ln and "reason=bridge-" not in ln
              for m in [re.search(r" lua_ms=([0-9.]+)", ln)] if m]
    return {
        "jobs": len(b.results), "wall_s": wall, "submissions_per_s": len(b.results) / wall,
        "median_ms": statistics.median(lat) * 1000, "p99_ms": pct(lat, 0.99) * 1000, "max_ms": max(lat) * 1000,
        "sinfo_max_ms": max(b.sinfo) * 1000 if b.sinfo else None, "sinfo_n": len(b.sinfo),
        "ghost_jobs": ghost, "wrong_admissions": wrong, "wrong_by_fail_open": wrong_fail_open,
        "wrong_other": wrong - wrong_fail_open, "wrong_without_log_line": undecided_logline,
        "submitted_but_missing": missing, "sbatch_failed": refused,
        "rerouted": sum(1 for n, rc, _d, _e in b.results if rc == 0 and jobs.get(n, ("", ""))[0] == "a100"),
        "via": via, "budget_fail_mode": sum(1 for ln in lines.values() if "reason=bridge-budget" in ln),
        "breaker_opened": log.count("breaker=open"), "breaker_closed": log.count("breaker=closed"),
        "in_flight_retried": len(in_flight),
        "in_flight_decided": sum(1 for ln in in_flight if "reason=rerouted" in ln),
        "socket_timeouts": sum(1 for *_x, e in b.results if "timed out" in e),
        "decided_by_lua": len(by_lua), "lua_call_ms_median": statistics.median(by_lua) if by_lua else None,
        "lua_call_ms_max": max(by_lua) if by_lua else None,
    }


BUDGET: dict = {}        # --fallback-burst-ms / --fallback-ms-per-s: other than the shipped defaults


def _bridge_bed(fail: str) -> tuple[BridgeTestbed, str]:
    d = tempfile.mkdtemp(prefix="vest-bench-br-")
    os.chmod(d, 0o755)
    shipped = Bridge(**BUDGET)
    tb = BridgeTestbed(d, directives=False, fail=fail, timeout_s=shipped.timeout_s,
                       fallback_ms_per_s=shipped.fallback_ms_per_s, fallback_burst_ms=shipped.fallback_burst_ms)
    tb.start()
    return tb, d


def burst_case(fault: str, fail: str, clients: int, jobs: int, rounds: int) -> dict:
    script = job_script(20)
    tb, d = _bridge_bed(fail)
    plain = pd = None
    box: dict = {}
    try:
        if fault == "none":
            pd = tempfile.mkdtemp(prefix="vest-bench-plain-")
            os.chmod(pd, 0o755)
            plain = SlurmTestbed(pd).start()
        if fault == "kill":
            tb.supervise()
        if fault == "down":
            tb.stop_server()
        fault_fn = {"kill": _kill_in_flight, "hang": _hang}.get(fault)
        row: dict = {"fault": fault, "fail": fail, "clients": clients, "jobs_per_client": jobs}
        bridge_bursts, plain_bursts = [], []
        for r in range(rounds if fault == "none" else 1):
            if plain is not None:
                pb = Burst(plain.env, clients, jobs, script, f"p{r}")
                plain_bursts.append((pb, pb.run()))
            log_start = len((tb.workdir / "log" / "slurmctld.log").read_text(errors="replace"))
            bb = Burst(tb.env, clients, jobs, script, f"b{r}")
            wall = bb.run(fault_fn(tb, box) if fault_fn else None)
            log = (tb.workdir / "log" / "slurmctld.log").read_text(errors="replace")[log_start:]
            bridge_bursts.append(_count(bb, tb.env, log, wall))
        if "hung_pid" in box:
            os.kill(box["hung_pid"], signal.SIGCONT)
        # pool the rounds
        row.update(_pool(bridge_bursts))
        row["restarts"] = tb.restarts
        if "in_flight_seen" in box:
            row["in_flight_seen_on_socket"] = box["in_flight_seen"]
        if plain_bursts:
            lat = [dt for b, _w in plain_bursts for _n, _rc, dt, _e in b.results]
            row["plain"] = {"p99_ms": pct(lat, 0.99) * 1000, "median_ms": statistics.median(lat) * 1000,
                            "max_ms": max(lat) * 1000,
                            "submissions_per_s": len(lat) / sum(w for _b, w in plain_bursts),
                            "sinfo_max_ms": max(x for b, _w in plain_bursts for x in b.sinfo) * 1000,
                            "failed": sum(1 for b, _w in plain_bursts for _n, rc, _d, _e in b.results if rc)}
            row["p99_ratio"] = row["p99_ms"] / row["plain"]["p99_ms"]
        return row
    finally:
        tb.stop()
        if plain is not None:
            plain.stop()
        for x in (d, pd):
            if x:
                shutil.rmtree(x, ignore_errors=True)


def _pool(rows: list[dict]) -> dict:
    if len(rows) == 1:
        return rows[0]
    out = {}
    for k, v in rows[0].items():
        if v is None:
            out[k] = None
        elif k in ("median_ms", "p99_ms", "submissions_per_s", "lua_call_ms_median"):
            out[k] = statistics.median(r[k] for r in rows)      # per round, the median of the rounds
        elif k in ("max_ms", "sinfo_max_ms", "lua_call_ms_max"):
            out[k] = max(r[k] for r in rows)
        elif isinstance(v, dict):
            out[k] = {kk: sum(r[k][kk] for r in rows) for kk in v}
        elif isinstance(v, (int, float)):
            out[k] = sum(r[k] for r in rows)
    out["rounds"] = len(rows)
    return out


def _ms_pair(r: dict) -> str:
    if r.get("lua_call_ms_median") is None:
        return "-"
    return f"{r['lua_call_ms_median']:.1f}/{r['lua_call_ms_max']:.1f}"


def burst_main(a) -> int:
    clients, jobs = (int(x) for x in a.burst.lower().split("x"))
    if a.fallback_burst_ms is not None:
        BUDGET["fallback_burst_ms"] = a.fallback_burst_ms
    if a.fallback_ms_per_s is not None:
        BUDGET["fallback_ms_per_s"] = a.fallback_ms_per_s
    faults = a.fault or list(FAULTS)
    fails = ("open", "closed") if a.fail == "both" else (a.fail,)
    rows = []
    for fault in faults:
        for fail in (("open",) if fault == "none" else fails):
            row = burst_case(fault, fail, clients, jobs, a.rounds)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    b = Bridge(**BUDGET)
    print(f"the bridge under a burst of {clients} clients x {jobs} plain sbatch ([bridge] "
          f"timeout {b.timeout_s:g} s, fallback {b.fallback_ms_per_s} ms/s, burst {b.fallback_burst_ms} ms)")
    hdr = (f"{'fault':<6} {'fail':<6} {'subm/s':>7} {'med ms':>7} {'p99 ms':>7} {'max ms':>7} {'sinfo max':>9} "
           f"{'ghost':>5} {'wrong':>5} {'by open':>7} {'rerouted':>8} {'refused':>7} {'in flight':>9} {'by lua':>6} "
           f"{'lua ms med/max':>14}")
    print(hdr)
    for r in rows:
        inf = f"{r['in_flight_decided']}/{r['in_flight_retried']}" if r["fault"] == "kill" else "-"
        print(f"{r['fault']:<6} {r['fail']:<6} {r['submissions_per_s']:7.1f} {r['median_ms']:7.0f} {r['p99_ms']:7.0f} "
              f"{r['max_ms']:7.0f} {r['sinfo_max_ms']:9.0f} {r['ghost_jobs']:5d} {r['wrong_admissions']:5d} "
              f"{r['wrong_by_fail_open']:7d} {r['rerouted']:8d} {r['sbatch_failed']:7d} {inf:>9} "
              f"{r['decided_by_lua']:6d} {_ms_pair(r):>14}")
        if "plain" in r:
            pl = r["plain"]
            print(f"{'plain':<6} {'-':<6} {pl['submissions_per_s']:7.1f} {pl['median_ms']:7.0f} {pl['p99_ms']:7.0f} "
                  f"{pl['max_ms']:7.0f} {pl['sinfo_max_ms']:9.0f}   (p99 with the bridge / plain: {r['p99_ratio']:.2f})")
    if a.json:
        Path(a.json).write_text(json.dumps({"burst": a.burst, "bridge_defaults": {
            "timeout_s": b.timeout_s, "fallback_ms_per_s": b.fallback_ms_per_s,
            "fallback_burst_ms": b.fallback_burst_ms}, "shipped_defaults": not BUDGET, "cases": rows},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
