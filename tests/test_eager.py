"""Eager module loading's bound (estimate/eager.py): the fat binaries of the installed torch's CUDA
libraries read as the driver would pick them, and the default floor that adds them under
CUDA_MODULE_LOADING=EAGER (a calibrated floor does not: the site measured its own loading mode)."""

from __future__ import annotations

import os

import pytest

from vest_slurm.estimate import eager
from vest_slurm.estimate.eager import KIND_ELF, KIND_PTX, Entry, loaded_bytes
from vest_slurm.estimate.estimator import estimate_from_trace, trace_for
from vest_slurm.estimate.profiles import calibrated, eager_loading_note, get_profile
from vest_slurm.estimate.workload import parse_workload_args

MiB = 1 << 20


def test_the_driver_s_choice_per_module():
    """Per module the cubin of the highest SM not above the device's, within its major; else PTX."""
    mods = [[Entry(KIND_ELF, 75, 10), Entry(KIND_ELF, 80, 20), Entry(KIND_ELF, 86, 30), Entry(KIND_ELF, 90, 40)],
            [Entry(KIND_PTX, 70, 5), Entry(KIND_ELF, 90, 7)],
            [Entry(KIND_ELF, 100, 9)]]
    assert loaded_bytes(mods, (8, 0)) == 20 + 5          # sm80 cubin; the second module JITs its PTX
    assert loaded_bytes(mods, (8, 9)) == 30 + 5          # sm86 code runs on sm89
    assert loaded_bytes(mods, (9, 0)) == 40 + 7
    assert loaded_bytes(mods, (7, 5)) == 10 + 5          # nothing for the third module: not loadable


def test_installed_libraries_parse_as_fat_binaries():
    libs = eager.job_libraries(convolves=True, multi_gpu=True)
    if not libs["torch"]:
        pytest.skip("a CPU build of torch: no CUDA libraries to read")
    mods = eager.modules(libs["torch"][0])
    kinds = {e.kind for m in mods for e in m}
    sms = {e.sm for m in mods for e in m}
    assert len(mods) > 100 and kinds <= {KIND_PTX, KIND_ELF} and KIND_ELF in kinds
    assert all(50 <= s <= 130 for s in sms), sorted(sms)
    total, per = eager.eager_code_bytes((8, 0), convolves=True, multi_gpu=True)
    assert set(per) == {"torch", "cublas", "cudnn", "nccl"} and total == sum(per.values())
    # without convolutions and one GPU, no cuDNN or NCCL code is counted
    small, per1 = eager.eager_code_bytes((8, 0), convolves=False, multi_gpu=False)
    assert set(per1) == {"torch", "cublas"} and small < total


def test_eager_loading_adds_the_bound_to_default_floors_only(monkeypatch):
    spec = parse_workload_args(["--model", "torchvision:resnet18", "--batch-size", "4", "--input", "3x32x32"])
    a100 = get_profile("a100-40gb")
    summary = trace_for(spec, a100)
    lazy = estimate_from_trace(summary, spec, a100)
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    bound, _ = eager.eager_code_bytes(a100.capability, summary.uses_cudnn, False)
    if not bound:
        pytest.skip("a CPU build of torch: no CUDA libraries to read")
    est = estimate_from_trace(summary, spec, a100)
    assert dict(est.breakdown)["eager_module_loading"] == bound
    assert est.required_bytes == lazy.required_bytes + bound and est.peak_bytes == lazy.peak_bytes + bound
    note = eager_loading_note(bounded_mib={"a100-40gb": round(bound / MiB)})
    assert f"+{round(bound / MiB)} MiB" in note and "upper bound" in note
    cal = estimate_from_trace(summary, spec, calibrated(a100, 600))
    assert "eager_module_loading" not in dict(cal.breakdown)
    monkeypatch.delenv("CUDA_MODULE_LOADING")
    assert eager_loading_note() == "" and os.environ.get("CUDA_MODULE_LOADING") is None
