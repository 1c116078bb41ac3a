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
  (driver context, the per-thread local-memory reservation, cuBLAS/cuDNN handles and kernels). It
  depends on the GPU and the whole stack (driver, CUDA, torch), so a site measures it (`vest
  calibrate`, `vest audit --apply`; ``floor = "calibrated"``); until then it is a default that errs
  high, built term by term from how CUDA loads code (``floor = "default"``; see below).
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


def capability_class(capability: tuple[int, int]) -> bool:
    """What a trace can depend on: flash attention, cuDNN's bf16 convolutions and native bf16 need
    sm80+. GPU types of one class share a trace (estimator.gpu_class)."""
    return tuple(capability) >= (8, 0)


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
    floor: str = "default"   # where context_mib comes from: "default" (the bound above) or "calibrated"
    nvswitch: bool = False   # the type's nodes join their GPUs through NVSwitch (NCCL's NVLS: estimator.nvls_bytes)
    l2_cache_bytes: int = 0  # the board's L2 cache (cudaDeviceProp.l2CacheSize; 0: not known)

    @property
    def total_bytes(self) -> int:
        return self.total_mib * MiB

    @property
    def usable_bytes(self) -> int:
        """What a process can have in total (context included) before CUDA OOM."""
        return (self.total_mib - self.reserved_mib) * MiB

    @property
    def tensor_room_bytes(self) -> int:
        """What is left for PyTorch's tensors: the usable memory less the CUDA context (dynamic
        analysis raises CUDA out-of-memory past it, for scripts that size themselves to the GPU)."""
        return max(0, self.usable_bytes - self.context_mib * MiB)

    def with_overrides(self, **kw) -> "DeviceProfile":
        """Site-config overrides; a measured ``context_mib`` makes the floor a calibrated one."""
        kw = {k: v for k, v in kw.items() if v is not None}
        if "context_mib" in kw:
            kw["floor"] = "calibrated"
        return replace(self, **kw)


def _p(key, name, total, cap, sms, context, cudnn, reserved=None):
    ws = _WS_HOPPER if cap == (9, 0) else _WS_PRE_HOPPER
    return DeviceProfile(key, name, total, cap, sms, reserved if reserved is not None else round(total * 0.01),
                         context, cudnn, ws)


# ---------------------------------------------------------------- the floor of a GPU type no site calibrated
# What a PyTorch process holds outside the caching allocator, term by term (CUDA C Programming Guide,
# "Lazy Loading"; CUDA runtime API, cudaLimitStackSize):
# 1. Local memory the driver reserves at context creation so that every thread that can be resident
#    has its stack: SMs x max resident threads per SM x cudaLimitStackSize (default 1 KiB). It grows
#    with the board (A100 108 x 2048 x 1 KiB = 216 MiB, H100 132 x 2048 = 264 MiB, L40S 142 x 1536 =
#    213 MiB) and is computed per GPU type (local_memory_mib).
# 2. Device code: with lazy module loading (CUDA runtime >= 11.7 and driver >= 515; PyTorch sets
#    CUDA_MODULE_LOADING=LAZY when the job has not set it, since 1.13; CUDA makes it the default from
#    12.2) only the kernels a job calls are loaded: torch's own, cuBLAS/cuBLASLt's GEMMs, cuDNN's
#    engines for a job that convolves or runs cuDNN attention, plus the driver's context itself. Its
#    size follows the stack (torch, CUDA, cuDNN versions), not the job's size, and no model of it is
#    exact: the default bounds it by the largest such remainder (measured floor minus term 1) of the
#    stacks measured so far (LAZY_CODE_BOUND_MIB). scripts/bench_floors.py checks the bound on each
#    measured stack with that stack left out.
# 3. Eager module loading (CUDA_MODULE_LOADING=EAGER, or a torch built with CUDA < 11.7, i.e. torch <
#    1.13) loads every kernel of every library at initialisation; no measured stack here loads
#    eagerly. The default floor then adds the device code of the libraries the job loads, read from
#    the installed torch's files (eager.py: per module the cubin the driver picks for the board,
#    uncompressed; e.g. A100 with torch 2.14 + CUDA 13: torch 702, cuBLAS 241, cuDNN 373, NCCL
#    49 MiB), on top of term 2 (which already holds the lazily loaded part: errs high); the
#    estimate says so (eager_loading_note), and where the files cannot be read, that it is not bounded.
# 4. NCCL (multi-GPU jobs): its buffers and proxy state, estimator.NCCL_BYTES, added per job.
# A site that calibrates a type (`vest calibrate`, or `vest audit --apply` from its finished jobs)
# replaces 1-3 with its measured floor; estimates say which one they used (DeviceProfile.floor).
#
# The stacks measured so far (shared/groundtruth/; `vest calibrate`'s rule, the median over models of
# the smallest-batch run's device peak minus the rest of the estimate; scripts/bench_accuracy.py prints
# that table, "Context floors"):
#   a100-40gb: 524 (11, CARMA, torch 2.x with lazy module loading; 6 of them within 468-528)
#   h100-80gb: 1369 (15, milabench, torch 2.6 + CUDA 12.6; 10 of them within 1225-1371)
#   h200-141gb: 1382 (15, milabench; 10 of them within 1360-1492)
#   l40s-48gb: 919 (15, milabench; 9 of them within 807-1005)
# These are calibrations of those stacks, not of a site's: MEASURED_FLOORS keeps them for the benchmark
# (the "calibrated" figures) and as what `vest calibrate` on such a stack would write.
MEASURED_FLOORS: dict[str, int] = {"a100-40gb": 524, "h100-80gb": 1369, "h200-141gb": 1382, "l40s-48gb": 919}

# Max resident threads per SM by compute capability (CUDA C Programming Guide, "Compute
# Capabilities", technical specifications table).
_THREADS_PER_SM = {(7, 0): 2048, (7, 5): 1024, (8, 0): 2048, (8, 6): 1536, (8, 7): 1536, (8, 9): 1536,
                   (9, 0): 2048, (10, 0): 2048, (12, 0): 1536}
STACK_BYTES_PER_THREAD = 1024    # cudaLimitStackSize default


def local_memory_mib(capability: tuple[int, int], sm_count: int) -> int:
    """Term 1: the driver's local-memory reservation for every resident thread's stack."""
    threads = _THREADS_PER_SM.get(capability, 2048)   # unknown architecture: the largest of any
    return -(-sm_count * threads * STACK_BYTES_PER_THREAD // MiB)


def lazy_code_bound_mib(floors: dict[str, int]) -> int:
    """Term 2 bounded by measured stacks: the largest (floor - local memory) among ``floors``
    ({built-in profile key: measured floor MiB})."""
    return max(f - local_memory_mib(_SPEC[k][1], _SPEC[k][2]) for k, f in floors.items())


def default_floor_mib(capability: tuple[int, int], sm_count: int, floors: dict[str, int] | None = None) -> int:
    """The floor of a GPU type no site calibrated: term 1 for this board + term 2's bound."""
    return local_memory_mib(capability, sm_count) + lazy_code_bound_mib(MEASURED_FLOORS if floors is None else floors)


def eager_loading(environ=None) -> bool:
    """Whether the job loads modules eagerly: CUDA_MODULE_LOADING=EAGER in the environment vsbatch
    and vest run in (sbatch's default --export=ALL hands it to the job)."""
    import os

    env = os.environ if environ is None else environ
    return env.get("CUDA_MODULE_LOADING", "").strip().upper() == "EAGER"


def eager_loading_note(environ=None, bounded_mib: dict[str, int] | None = None) -> str:
    """What term 3 did to the default floor ("" when lazy loading applies): ``bounded_mib`` is the
    per-type bound added (estimator.py), empty where the libraries could not be read."""
    if not eager_loading(environ):
        return ""
    if bounded_mib:
        each = ", ".join(f"{k} +{v} MiB" for k, v in sorted(bounded_mib.items()))
        return ("CUDA_MODULE_LOADING=EAGER: every kernel of torch, cuBLAS, cuDNN and NCCL is loaded at start; the "
                f"default floor adds their device code read from the installed libraries ({each}), an upper bound; "
                "calibrate this GPU type for a tight floor (vest calibrate / vest audit)")
    return ("CUDA_MODULE_LOADING=EAGER: every kernel of torch, cuBLAS and cuDNN is loaded at start, which the "
            "default floor (lazy loading) does not bound here (torch's CUDA libraries not readable); calibrate this "
            "GPU type (vest calibrate / vest audit)")


# key: (nvidia-smi name, capability, SMs, memory.total MiB). total_mib and SM counts: nvidia-smi's
# memory.total and deviceQuery's multiprocessor count as NVIDIA's boards report them (ECC on by
# default on the data-centre boards A40 / L40, off on the workstation and consumer ones).
_SPEC: dict[str, tuple[str, tuple[int, int], int, int]] = {
    "v100-16gb": ("Tesla V100-SXM2-16GB", (7, 0), 80, 16384),
    "v100-32gb": ("Tesla V100-SXM2-32GB", (7, 0), 80, 32768),
    "t4-16gb": ("Tesla T4", (7, 5), 40, 15360),
    "a100-40gb": ("NVIDIA A100-SXM4-40GB", (8, 0), 108, 40960),
    "a100-80gb": ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 81920),
    "a30-24gb": ("NVIDIA A30", (8, 0), 56, 24576),
    "h100-80gb": ("NVIDIA H100 80GB HBM3", (9, 0), 132, 81559),
    "h100-pcie-80gb": ("NVIDIA H100 PCIe", (9, 0), 114, 81559),
    "h100-nvl-94gb": ("NVIDIA H100 NVL", (9, 0), 132, 95830),
    "h200-141gb": ("NVIDIA H200", (9, 0), 132, 143771),
    "gh200-96gb": ("NVIDIA GH200 480GB", (9, 0), 132, 97871),
    "gh200-144gb": ("NVIDIA GH200 144G HBM3e", (9, 0), 132, 146831),
    "b200-180gb": ("NVIDIA B200", (10, 0), 148, 183359),
    "l40s-48gb": ("NVIDIA L40S", (8, 9), 142, 46068),
    "l40-48gb": ("NVIDIA L40", (8, 9), 142, 46068),
    "rtx-6000ada-48gb": ("NVIDIA RTX 6000 Ada Generation", (8, 9), 142, 49140),
    "rtx-4090-24gb": ("NVIDIA GeForce RTX 4090", (8, 9), 128, 24564),
    "l4-24gb": ("NVIDIA L4", (8, 9), 58, 23034),
    "a40-48gb": ("NVIDIA A40", (8, 6), 84, 46068),
    "rtx-a6000-48gb": ("NVIDIA RTX A6000", (8, 6), 84, 49140),
    "rtx-3090-24gb": ("NVIDIA GeForce RTX 3090", (8, 6), 82, 24576),
    "a10-24gb": ("NVIDIA A10", (8, 6), 72, 23028),
}
# L2 cache per board, MiB, as cudaDeviceProp.l2CacheSize reports it (NVIDIA's architecture
# whitepapers: Volta 6, Turing TU104 4, GA100 40 (A30 24), GA102 6, AD102 96 (RTX 4090 72), AD104 48,
# GH100 50, Blackwell B200 126). Scripts read it through torch.cuda.get_device_properties (timm sizes
# its foreach optimizer chunks by it, and so the step's temporaries).
_L2_MIB: dict[str, int] = {
    "v100-16gb": 6, "v100-32gb": 6, "t4-16gb": 4, "a100-40gb": 40, "a100-80gb": 40, "a30-24gb": 24,
    "h100-80gb": 50, "h100-pcie-80gb": 50, "h100-nvl-94gb": 50, "h200-141gb": 50, "gh200-96gb": 50,
    "gh200-144gb": 50, "b200-180gb": 126, "l40s-48gb": 96, "l40-48gb": 96, "rtx-6000ada-48gb": 96,
    "rtx-4090-24gb": 72, "l4-24gb": 48, "a40-48gb": 6, "rtx-a6000-48gb": 6, "rtx-3090-24gb": 6, "a10-24gb": 6,
}
# Boards sold on NVSwitch baseboards (HGX H100 / H200 / B200: 8 SXM GPUs, each NVLink port on the
# switches), where NCCL can set up NVLink SHARP. The PCIe and NVL boards (NVLink bridges between
# pairs) and GH200 (one GPU per node; its multi-node NVLink is a site's fabric) have none; a site
# says otherwise with [gpu.X] nvswitch.
_NVSWITCH = ("h100-80gb", "h200-141gb", "b200-180gb")
PROFILES: dict[str, DeviceProfile] = {
    k: replace(_p(k, name, total, cap, sms, default_floor_mib(cap, sms), 0), nvswitch=k in _NVSWITCH,
               l2_cache_bytes=_L2_MIB[k] * MiB)
    for k, (name, cap, sms, total) in _SPEC.items()}


def calibrated(profile: DeviceProfile, context_mib: int, cudnn_mib: int | None = None) -> DeviceProfile:
    """``profile`` with a measured floor (site config, `vest calibrate`, `vest audit --apply`)."""
    return replace(profile, context_mib=context_mib, cudnn_mib=profile.cudnn_mib if cudnn_mib is None else cudnn_mib,
                   floor="calibrated")


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
