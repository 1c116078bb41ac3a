"""`vest monitor` (gpu/monitor.py). This machine has no NVIDIA driver: the commands say so and exit
cleanly, `run` still runs the job; the sampling loop and the line `vest audit --measured` reads are
tested with a reader of given values (NVML's figure on a GPU machine)."""

from __future__ import annotations

import subprocess
import sys

from vest_slurm.gpu.monitor import NoNvml, Peak, job_gpus, open_nvml, sample, write_line
from vest_slurm.slurm.accounting import parse_measured_csv

MiB = 1 << 20


def nvml_here() -> bool:
    try:
        open_nvml()
        return True
    except NoNvml:
        return False


def vest(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "vest_slurm.cli", *argv], capture_output=True, text=True,
                          timeout=120, env=env)


def test_run_passes_the_exit_code_and_says_what_it_measured(tmp_path):
    """Without NVML (this machine) it says so, runs the job anyway; with it, the peak it saw."""
    out = tmp_path / "peaks.csv"
    r = vest("monitor", "run", "--out", str(out), "--", sys.executable, "-c", "import sys; print('ran'); sys.exit(3)")
    assert r.returncode == 3 and "ran" in r.stdout and not out.exists()   # no SLURM_JOB_ID: nothing written
    if nvml_here():
        assert "peak" in r.stderr and "samples" in r.stderr
        return
    assert "no GPU memory is sampled" in r.stderr
    import os

    env = dict(os.environ, SLURM_JOB_ID="77", SLURM_JOB_GPUS="0,1")
    for mode in ("prolog", "epilog"):
        r = vest("monitor", mode, "--out", str(out), "--state-dir", str(tmp_path / "state"), env=env)
        assert r.returncode == 0, r.stderr
    assert not out.exists()


def test_sampling_keeps_the_peak_and_samples_once_more_at_the_end():
    values = iter([100, 900, 300, 1200])
    left = iter([True, True, True, False])
    peak, n = sample(lambda: next(values), lambda: next(left), interval_s=0, sleep=lambda s: None)
    assert (peak, n) == (1200, 4)


def test_the_line_is_what_vest_audit_reads(tmp_path):
    out = tmp_path / "sub" / "peaks.csv"
    write_line(str(out), Peak("101", 13824 * MiB + 123, "a100-40gb", 10))
    write_line(str(out), Peak("102", 700 * MiB, "", 3))
    assert parse_measured_csv(out.read_text()) == {"101": (13824 * MiB, "a100-40gb"), "102": (700 * MiB, "")}


def test_the_jobs_gpus_from_slurms_variables():
    assert job_gpus({"SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0,1"}) == [2, 3]
    assert job_gpus({"CUDA_VISIBLE_DEVICES": "1"}) == [1]
    assert job_gpus({}) == []
