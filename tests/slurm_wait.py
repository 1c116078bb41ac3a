"""Waiting with deadlines in the Slurm tests: for a job's state, for an event, for a call that must
not hang. A deadline here bounds a hang (generous, far above a normal run on a loaded machine); it
measures no speed (the benchmarks do: scripts/bench_vsbatch.py, scripts/bench_bridge.py)."""

import threading
import time

import pytest

from vest_slurm.slurm.cluster import SlurmCLI

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


def wait_for_state(cli: SlurmCLI, job_id: int, states: set[str], timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        rec = cli.job(job_id)
        if rec is not None and rec.state in states:
            return rec
        if time.monotonic() > deadline:
            pytest.fail(f"job {job_id} not in {states} after {timeout_s} s: {rec!r}")
        time.sleep(0.1)


def wait_done(cli: SlurmCLI, job_id: int, timeout_s: float = 60.0):
    return wait_for_state(cli, job_id, TERMINAL, timeout_s)


def wait_until(predicate, timeout_s: float, what, poll_s: float = 0.05):
    """The first true value of ``predicate()``; fails the test naming ``what`` past ``timeout_s``
    (a string, or a function giving one: called only then, e.g. to read the daemons' logs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what() if callable(what) else what}: not after {timeout_s:g} s")
        time.sleep(poll_s)


def bounded(fn, limit_s: float, what: str):
    """``fn()``'s result or exception, from a thread; fails the test if it is still running after
    ``limit_s`` (a hang: the thread is left behind as a daemon)."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:   # handed to the caller as raised
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit_s)
    if t.is_alive():
        pytest.fail(f"{what} still running after {limit_s:g} s: it hangs")
    if "error" in box:
        raise box["error"]
    return box.get("value")
