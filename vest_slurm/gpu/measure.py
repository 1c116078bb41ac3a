"""Measure a workload on a real GPU: what the estimator predicts, measured the same way.

Runs the training loop of vest_slurm/estimate/tracing.py (the same code, on real tensors) and records
- torch.cuda.max_memory_allocated / max_memory_reserved (what the allocator replay models),
- the device's used memory from NVML, polled by a thread (what nvidia-smi shows: context,
  libraries and the allocator's reserve), and its value before the model was built (the baseline).
Used by scripts/measure_gpu.py and `vest calibrate` (calibrate.py). Also runs on the CPU (``device="cpu"``) so the
loop itself is tested where there is no GPU; the CUDA numbers are then absent.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import asdict, dataclass

from ..units import MiB
from ..estimate.workload import WorkloadSpec


class DevicePoller:
    """Polls the device's used memory (NVML via pynvml, else nvidia-smi) and keeps the maximum."""

    def __init__(self, index: int = 0, interval_s: float = 0.02):
        self.index, self.interval_s = index, interval_s
        self.max_used_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read = self._reader()

    def _reader(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            return lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception:   # no pynvml or no driver: fall back to nvidia-smi
            pass

        def smi():
            out = subprocess.run(["nvidia-smi", f"--id={self.index}", "--query-gpu=memory.used",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
            return int(float(out.stdout.strip().splitlines()[0])) * MiB

        try:
            smi()
            return smi
        except Exception:
            return None

    @property
    def available(self) -> bool:
        return self._read is not None

    def read(self) -> int:
        return self._read() if self._read else 0

    def __enter__(self):
        if self._read:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self):
        while not self._stop.is_set():
            try:
                self.max_used_bytes = max(self.max_used_bytes, self._read())
                self.samples += 1
            except Exception:
                pass
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join()
        return False


@dataclass(frozen=True)
class Measurement:
    workload: dict
    device: str
    device_name: str
    total_mib: float | None
    baseline_used_mib: float | None        # device used memory before this process touched CUDA
    context_used_mib: float | None         # after CUDA init + first cuBLAS call, before the model
    max_allocated_mib: float | None
    max_reserved_mib: float | None
    device_peak_used_mib: float | None     # NVML max over the run, baseline subtracted
    # after the run: the device's used memory (baseline subtracted) minus the caching allocator's
    # reserved memory: the CUDA context and the kernels the run loaded (`vest calibrate`)
    outside_allocator_mib: float | None
    nvml_samples: int
    seconds: float
    torch_version: str
    cuda_version: str | None
    # with alloc_history: [rounded size, where, count] of every caching-allocator allocation of the
    # run (allocdiff.py pairs them with the CPU trace's)
    allocations: list | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def measure(spec: WorkloadSpec, device: str = "cuda", steps: int | None = None,
            alloc_history: bool = False) -> Measurement:
    import torch

    from ..estimate.tracing import build_real_model, cudnn_flags, run_training_loop

    on_gpu = device.startswith("cuda")
    poller = DevicePoller() if on_gpu else None
    baseline = poller.read() if poller and poller.available else None
    t0 = time.perf_counter()
    context = None
    if on_gpu:
        torch.cuda.init()
        a = torch.ones(64, 64, device=device)
        (a @ a).sum().item()   # CUDA context, cuBLAS handle and workspace exist now
        del a
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if poller and poller.available:
            context = poller.read()
    history = on_gpu and alloc_history
    if history:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="alloc", stacks="python")
    with (poller if poller else _Null()), cudnn_flags(spec):
        model, built = build_real_model(spec, device)
        run_training_loop(model, built, spec.with_(steps=steps or spec.steps), torch.device(device))
        outside = None
        if on_gpu:
            torch.cuda.synchronize()
            if poller and poller.available and baseline is not None:
                outside = poller.read() - baseline - torch.cuda.memory_reserved()
    allocations = None
    if history:
        from .allocdiff import aggregate, allocations_from_snapshot

        allocations = aggregate(allocations_from_snapshot(torch.cuda.memory._snapshot()))
        torch.cuda.memory._record_memory_history(enabled=None)
    seconds = time.perf_counter() - t0
    props = torch.cuda.get_device_properties(0) if on_gpu else None
    mib = lambda b: None if b is None else round(b / MiB, 1)  # noqa: E731
    return Measurement(
        workload=spec.to_dict(), device=device, device_name=props.name if props else "cpu",
        total_mib=mib(props.total_memory) if props else None,
        baseline_used_mib=mib(baseline),
        context_used_mib=mib(context - baseline) if context is not None and baseline is not None else None,
        max_allocated_mib=mib(torch.cuda.max_memory_allocated()) if on_gpu else None,
        max_reserved_mib=mib(torch.cuda.max_memory_reserved()) if on_gpu else None,
        device_peak_used_mib=mib(poller.max_used_bytes - (baseline or 0)) if poller and poller.available else None,
        outside_allocator_mib=mib(outside),
        nvml_samples=poller.samples if poller else 0, seconds=round(seconds, 3),
        torch_version=torch.__version__, cuda_version=torch.version.cuda, allocations=allocations,
    )


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def env_summary() -> dict:
    return {k: os.environ.get(k) for k in ("CUDA_MODULE_LOADING", "PYTORCH_CUDA_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG")}
