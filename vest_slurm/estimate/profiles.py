"""Device profiles: what a GPU type and its software stack add to the caching allocator's memory.

Memory a training process holds on a GPU, as nvidia-smi reports it, is
    CUDA context  +  library kernels loaded into it  +  caching-allocator reserved memory
where the allocator's memory holds the tensors, cuBLAS workspaces and cuDNN workspaces (PyTorch
allocates both through the caching allocator). The first two live outside the allocator and depend on
the GPU (SM count, architecture) and the stack (driver, CUDA, lazy module loading, cuDNN version),
and, with lazy loading, on which kernels a job runs: more for one that convolves, computes in mixed
precision and runs attention than for one that only multiplies matrices. A site measures them once per
GPU type with `vest calibrate` (the median over small jobs of those kinds) and overrides the defaults
here in its site config.

Where the defaults come from (MiB; see benchmarks/README.md for the measurement):
- ``total_mib``: nvidia-smi's memory.total for the board (the ground-truth README lists A100-40GB
  40960, H100 80GB HBM3 81559, H200 143771, L40S 46068; the others from NVIDIA's spec sheets as
  nvidia-smi prints them).
- ``reserved_mib``: memory the driver keeps that no process can allocate even on an idle GPU
  (ECC and driver reservations: about 0.5-1.5 % of the board; cudaMemGetInfo's free on an idle
  GPU falls short of the total by this much).
- ``context_mib``: the CUDA context of a PyTorch process and what its libraries load into it
  (driver context, the per-thread local-memory reservation of SMs x max resident threads x the
  default 1 KiB stack, cuBLAS/cuDNN handles and kernels; with lazy module loading, CUDA >= 11.7,
  only the kernels used). It depends on the GPU and the whole stack (driver, CUDA, torch), so it is
  a measured floor (`vest calibrate`; the defaults below and benchmarks/README.md).
- ``cudnn_mib``: what loading cuDNN adds for jobs that convolve, where a calibration separates it.
- ``cublas_workspace_bytes``: PyTorch's default cuBLAS workspace per handle and stream
  (CublasHandlePool.cpp parseChosenWorkspaceSize): ``:4096:2:16:8`` = 2 x 4 MiB + 8 x 16 KiB =
  8.125 MiB, except on Hopper, ``:4096:8`` = 32 MiB (the test is ``major == 9 && minor == 0``, so
  Blackwell gets 8.125 MiB). It is allocated through the caching allocator at the first matmul and
  kept for the life of the handle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..errors import WorkloadError
from ..units import KiB, MiB

_WS_PRE_HOPPER = 2 * 4096 * KiB + 8 * 16 * KiB   # CUBLAS_WORKSPACE_CONFIG default :4096:2:16:8
_WS_HOPPER = 8 * 4096 * KiB                        # default on sm90: :4096:8


@dataclass(frozen=True)
class DeviceProfile:
    key: str                 # e.g. "a100-40gb"
    name: str                # nvidia-smi name
    total_mib: int
    capability: tuple[int, int]
    sm_count: int
    reserved_mib: int
    context_mib: int
    cudnn_mib: int
    cublas_workspace_bytes: int
    vendor: str = "nvidia"

    @property
    def total_bytes(self) -> int:
        return self.total_mib * MiB

    @property
    def usable_bytes(self) -> int:
        """What a process can have in total (context included) before CUDA OOM."""
        return (self.total_mib - self.reserved_mib) * MiB

    def with_overrides(self, **kw) -> "DeviceProfile":
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


def _p(key, name, total, cap, sms, context, cudnn, reserved=None):
    ws = _WS_HOPPER if cap == (9, 0) else _WS_PRE_HOPPER
    return DeviceProfile(key, name, total, cap, sms, reserved if reserved is not None else round(total * 0.01),
                         context, cudnn, ws)


# context_mib: the floor of each GPU type's software stack, outside the allocator. Where measured
# runs exist (shared/groundtruth/, see benchmarks/README.md), it is what `vest calibrate` does with its
# small jobs (calibrate.py: the median over jobs of what each holds outside the allocator), done on
# those runs: for each model and precision, the smallest-batch run's measured device peak minus the
# rest of the estimate (the allocator's replayed peak reserved, cuDNN and cuBLAS workspaces
# included); the median over them. scripts/bench_accuracy.py prints that table
# ("Context floors"). Those stacks load cuDNN for conv nets and transformers alike (conv and
# non-conv floors agree within their spread), so cudnn_mib is 0 there. Types without measured runs
# keep a conservative floor (that of the older measured stack) until the site calibrates them.
#   a100-40gb: 524 (11, CARMA, torch 2.x with lazy module loading; 6 of them within 468-528)
#                                                                 a100-80gb: same chip and stack
#   h100-80gb: 1369 (15, milabench, torch 2.6 + CUDA 12.6; 10 of them within 1225-1371)
#   h200-141gb: 1382 (15, milabench; 10 of them within 1360-1492)
#   l40s-48gb: 919 (15, milabench; 9 of them within 807-1005)
# A board with the same chip as a calibrated one and no more SMs takes that board's floor (as the
# A100-80GB takes the 40GB's): the per-SM part of the context (each SM's local-memory reservation,
# max resident threads x 1 KiB of stack) is no larger, the kernels and libraries are the same.
# A30 (GA100, 56 SMs) -> A100; H100 PCIe (114) and NVL (132) and the GH200's GPU (GH100, 132; 96 GB
# HBM3 or 144 GB HBM3e) -> H100 SXM; L40, RTX 6000 Ada (142) and RTX 4090 (128; AD102) -> L40S.
# total_mib and SM counts of the types without measured runs: nvidia-smi's memory.total and
# deviceQuery's multiprocessor count as NVIDIA's boards report them (ECC on by default on the
# data-centre boards A40 / L40, off on the workstation and consumer ones).
UNCALIBRATED_CONTEXT_MIB = 1100
_U = UNCALIBRATED_CONTEXT_MIB
PROFILES: dict[str, DeviceProfile] = {p.key: p for p in (
    _p("v100-16gb", "Tesla V100-SXM2-16GB", 16384, (7, 0), 80, _U, 0),
    _p("v100-32gb", "Tesla V100-SXM2-32GB", 32768, (7, 0), 80, _U, 0),
    _p("t4-16gb", "Tesla T4", 15360, (7, 5), 40, _U, 0),
    _p("a100-40gb", "NVIDIA A100-SXM4-40GB", 40960, (8, 0), 108, 524, 0),
    _p("a100-80gb", "NVIDIA A100-SXM4-80GB", 81920, (8, 0), 108, 524, 0),
    _p("a30-24gb", "NVIDIA A30", 24576, (8, 0), 56, 524, 0),
    _p("h100-80gb", "NVIDIA H100 80GB HBM3", 81559, (9, 0), 132, 1369, 0),
    _p("h100-pcie-80gb", "NVIDIA H100 PCIe", 81559, (9, 0), 114, 1369, 0),
    _p("h100-nvl-94gb", "NVIDIA H100 NVL", 95830, (9, 0), 132, 1369, 0),
    _p("h200-141gb", "NVIDIA H200", 143771, (9, 0), 132, 1382, 0),
    _p("gh200-96gb", "NVIDIA GH200 480GB", 97871, (9, 0), 132, 1369, 0),
    _p("gh200-144gb", "NVIDIA GH200 144G HBM3e", 146831, (9, 0), 132, 1369, 0),
    _p("b200-180gb", "NVIDIA B200", 183359, (10, 0), 148, _U, 0),
    _p("l40s-48gb", "NVIDIA L40S", 46068, (8, 9), 142, 919, 0),
    _p("l40-48gb", "NVIDIA L40", 46068, (8, 9), 142, 919, 0),
    _p("rtx-6000ada-48gb", "NVIDIA RTX 6000 Ada Generation", 49140, (8, 9), 142, 919, 0),
    _p("rtx-4090-24gb", "NVIDIA GeForce RTX 4090", 24564, (8, 9), 128, 919, 0),
    _p("l4-24gb", "NVIDIA L4", 23034, (8, 9), 58, _U, 0),
    _p("a40-48gb", "NVIDIA A40", 46068, (8, 6), 84, _U, 0),
    _p("rtx-a6000-48gb", "NVIDIA RTX A6000", 49140, (8, 6), 84, _U, 0),
    _p("rtx-3090-24gb", "NVIDIA GeForce RTX 3090", 24576, (8, 6), 82, _U, 0),
    _p("a10-24gb", "NVIDIA A10", 23028, (8, 6), 72, _U, 0),
)}

ALIASES = {
    "v100": "v100-32gb", "a100": "a100-80gb", "h100": "h100-80gb", "h200": "h200-141gb",
    "l40s": "l40s-48gb", "a10": "a10-24gb", "l4": "l4-24gb", "a100-40": "a100-40gb",
    "a100-80": "a100-80gb", "h100-80": "h100-80gb", "t4": "t4-16gb", "a30": "a30-24gb",
    "a40": "a40-48gb", "l40": "l40-48gb", "b200": "b200-180gb", "h100-pcie": "h100-pcie-80gb",
    "h100-nvl": "h100-nvl-94gb", "rtx-a6000": "rtx-a6000-48gb", "a6000": "rtx-a6000-48gb",
    "rtx-6000ada": "rtx-6000ada-48gb", "rtx-4090": "rtx-4090-24gb", "4090": "rtx-4090-24gb",
    "rtx-3090": "rtx-3090-24gb", "3090": "rtx-3090-24gb", "gh200": "gh200-96gb", "gh200-96": "gh200-96gb",
    "gh200-144": "gh200-144gb",
}


def get_profile(key: str) -> DeviceProfile:
    k = key.strip().lower()
    k = ALIASES.get(k, k)
    if k not in PROFILES:
        raise WorkloadError(f"unknown GPU type {key!r}", f"use one of: {', '.join(PROFILES)}")
    return PROFILES[k]


def profile_for_device_name(name: str, total_mib: int | None = None) -> DeviceProfile | None:
    """The built-in profile for an nvidia-smi device name (ground-truth rows, calibration), matched
    on whole words of the name: "NVIDIA L40" is an L40, not an L4; "NVIDIA H100 NVL" and
    "NVIDIA H100 PCIe" are not the SXM board. None for a board without a profile."""
    words = set(re.findall(r"[a-z0-9]+", name.lower()))
    big = (total_mib or 0) > 50000 or "80gb" in words
    if "a100" in words:
        return PROFILES["a100-80gb" if big else "a100-40gb"]
    if words & {"v100", "v100s"}:
        return PROFILES["v100-32gb" if (total_mib or 0) > 20000 or "32gb" in words else "v100-16gb"]
    if "gh200" in words:
        # "GH200 480GB" / "GH200 120GB" name the superchip's CPU+GPU memory; the GPU has 96 GB of
        # HBM3, or 144 GB of HBM3e ("GH200 144G HBM3e")
        return PROFILES["gh200-144gb" if (total_mib or 0) > 120000 or "hbm3e" in words else "gh200-96gb"]
    if "h100" in words:
        return PROFILES["h100-nvl-94gb" if "nvl" in words else "h100-pcie-80gb" if "pcie" in words else "h100-80gb"]
    if "6000" in words and "ada" in words:
        return PROFILES["rtx-6000ada-48gb"]
    by_word = {"h200": "h200-141gb", "b200": "b200-180gb", "l40s": "l40s-48gb", "l40": "l40-48gb", "l4": "l4-24gb",
               "a10": "a10-24gb", "a10g": "a10-24gb", "a30": "a30-24gb", "a40": "a40-48gb", "a6000": "rtx-a6000-48gb",
               "4090": "rtx-4090-24gb", "3090": "rtx-3090-24gb", "t4": "t4-16gb"}
    for word, key in by_word.items():
        if word in words:
            return PROFILES[key]
    return None
