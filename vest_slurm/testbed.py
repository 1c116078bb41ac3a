"""``python -m vest_slurm.testbed start|stop|status DIR [--bridge] [--accounting]``: a real Slurm on loopback,
detached, for trying vest out by hand (``scripts/slurm-testbed.sh`` wraps it).

``start`` leaves a supervisor process (pid in DIR/testbed.pid) that owns the daemons of
``slurm.testbed.SlurmTestbed`` (or, with ``--bridge``, ``bridge.testbed.BridgeTestbed``: the same
cluster with job_submit.lua and the decision server; ``--accounting`` adds slurmdbd and MariaDB so
that sacct and `vest audit` answer); ``stop`` ends it and them.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .errors import SlurmError
from .slurm.testbed import POLL_INTERVAL_S, START_TIMEOUT_S, SlurmTestbed, log_tail

# --- the detached supervisor behind scripts/slurm-testbed.sh ----------------------------------

PIDFILE = "testbed.pid"
READYFILE = "testbed.ready"
SUPERVISOR_LOG = "supervisor.log"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read_pid(workdir: Path) -> int | None:
    try:
        return int((workdir / PIDFILE).read_text().strip())
    except (OSError, ValueError):
        return None


def _supervise(workdir: Path, bridge: bool, accounting: bool = False) -> int:
    stop_requested = False

    def on_signal(signum, frame):
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    if bridge:
        from .bridge.testbed import BridgeTestbed
        tb = BridgeTestbed(workdir, accounting=accounting)
    else:
        tb = SlurmTestbed(workdir, accounting=accounting)
    try:
        tb.start()
    except SlurmError as e:
        print(f"testbed failed to start: {e}", flush=True)
        return 1
    (workdir / READYFILE).write_text(f"{tb.conf_path}\n")
    print(f"testbed up in {tb.start_seconds:.2f} s; SLURM_CONF={tb.conf_path}", flush=True)
    try:
        while not stop_requested:
            dead = [k for k, p in tb.procs.items() if p.poll() is not None]
            if dead:
                print(f"testbed: {', '.join(dead)} exited; stopping the rest", flush=True)
                break
            time.sleep(0.2)
    finally:
        (workdir / READYFILE).unlink(missing_ok=True)
        tb.stop()
        print(f"testbed stopped in {tb.stop_seconds:.2f} s", flush=True)
        (workdir / PIDFILE).unlink(missing_ok=True)
    return 0


def cmd_start(workdir: Path, bridge: bool, timeout_s: float = START_TIMEOUT_S + 5, accounting: bool = False) -> int:
    workdir.mkdir(parents=True, exist_ok=True)
    pid = _read_pid(workdir)
    if pid and _pid_alive(pid):
        print(f"slurm-testbed: already running in {workdir} (supervisor pid {pid})", file=sys.stderr)
        print(f"export SLURM_CONF={workdir.resolve() / 'etc' / 'slurm.conf'}")
        return 0
    (workdir / READYFILE).unlink(missing_ok=True)
    log = open(workdir / SUPERVISOR_LOG, "ab")
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.Popen(
        [sys.executable, "-m", "vest_slurm.testbed", "_supervise", str(workdir)] + (["--bridge"] if bridge else [])
        + (["--accounting"] if accounting else []),
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=env, cwd=workdir,
    )
    log.close()
    (workdir / PIDFILE).write_text(f"{p.pid}\n")
    t0 = time.monotonic()
    while not (workdir / READYFILE).exists():
        if p.poll() is not None:
            print(f"slurm-testbed: failed to start; {workdir / SUPERVISOR_LOG}:\n"
                  f"{log_tail(workdir / SUPERVISOR_LOG)}", file=sys.stderr)
            (workdir / PIDFILE).unlink(missing_ok=True)
            return 1
        if time.monotonic() - t0 > timeout_s:
            p.terminate()
            print(f"slurm-testbed: not ready after {timeout_s:.0f} s; see {workdir / 'log'}",
                  file=sys.stderr)
            return 1
        time.sleep(POLL_INTERVAL_S)
    conf = (workdir / READYFILE).read_text().strip()
    print(f"slurm-testbed: up in {time.monotonic() - t0:.2f} s (supervisor pid {p.pid}, logs in "
          f"{workdir / 'log'})", file=sys.stderr)
    print(f"export SLURM_CONF={conf}")
    return 0


def cmd_stop(workdir: Path, timeout_s: float = 15.0) -> int:
    pid = _read_pid(workdir)
    if not pid or not _pid_alive(pid):
        print(f"slurm-testbed: not running in {workdir}", file=sys.stderr)
        (workdir / PIDFILE).unlink(missing_ok=True)
        return 0
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    while _pid_alive(pid):
        if time.monotonic() - t0 > timeout_s:
            os.kill(pid, signal.SIGKILL)
            print(f"slurm-testbed: supervisor {pid} did not stop in {timeout_s:.0f} s; killed it. "
                  f"Daemons it started may remain: see {workdir / 'run'} for their pid files",
                  file=sys.stderr)
            return 1
        time.sleep(POLL_INTERVAL_S)
    print(f"slurm-testbed: stopped in {time.monotonic() - t0:.2f} s", file=sys.stderr)
    return 0


def cmd_status(workdir: Path) -> int:
    pid = _read_pid(workdir)
    if not pid or not _pid_alive(pid) or not (workdir / READYFILE).exists():
        print(f"slurm-testbed: not running in {workdir}")
        return 3
    conf = (workdir / READYFILE).read_text().strip()
    print(f"slurm-testbed: running (supervisor pid {pid})")
    print(f"export SLURM_CONF={conf}")
    try:
        r = subprocess.run(["sinfo", "-N", "-o", "%N %P %G %t"], capture_output=True, text=True,
                           env=dict(os.environ, SLURM_CONF=conf), timeout=5)
        sys.stdout.write(r.stdout + r.stderr)
    except subprocess.TimeoutExpired:
        print("sinfo did not answer within 5 s")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="slurm-testbed", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="start a detached testbed in DIR")
    s.add_argument("dir")
    s.add_argument("--bridge", action="store_true", help="also run the job_submit.lua bridge")
    s.add_argument("--accounting", action="store_true", help="also run slurmdbd with MariaDB (sacct, vest audit)")
    sub.add_parser("stop", help="stop the testbed in DIR").add_argument("dir")
    sub.add_parser("status", help="is the testbed in DIR running").add_argument("dir")
    sv = sub.add_parser("_supervise", help=argparse.SUPPRESS)
    sv.add_argument("dir")
    sv.add_argument("--bridge", action="store_true")
    sv.add_argument("--accounting", action="store_true")
    a = ap.parse_args(argv)
    workdir = Path(a.dir).resolve()
    if a.cmd == "start":
        return cmd_start(workdir, a.bridge, START_TIMEOUT_S + 60 if a.accounting else START_TIMEOUT_S + 5,
                         accounting=a.accounting)
    if a.cmd == "stop":
        return cmd_stop(workdir)
    if a.cmd == "status":
        return cmd_status(workdir)
    return _supervise(workdir, a.bridge, a.accounting)


if __name__ == "__main__":
    sys.exit(main())
