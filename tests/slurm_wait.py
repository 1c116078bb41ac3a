"""Waiting for a job of the test cluster to reach a state (shared by the Slurm tests)."""

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
