"""`vest calibrate`: measure a GPU type's floor on this node, for the site config's ``context_mib``.

The floor is what the estimate adds to the caching allocator's replay (profiles.py): the CUDA
context and what the job's libraries load into it, memory the device shows as used that the
allocator does not hold. With lazy module loading (CUDA >= 11.7, PyTorch's default) it grows with
the kernels a job runs: a GEMM-only job loads less than one that also runs cuDNN convolutions,
mixed precision or attention, so one tiny job would measure the floor of jobs like it and too little
for the others. So the floor is measured as the built-in floors were taken from measured runs
(benchmarks/README.md: the median over models): a few small training jobs of the common kinds, each
in a fresh process (a job starts with a new context), and for each, after its steps, the device's
used memory (NVML, the process's baseline subtracted) minus what the allocator holds
(``torch.cuda.memory_reserved()``). The site's floor is their median; the lines it prints show
each job's.

``--dry-run`` runs the same jobs on this machine's CPU (the training loops, no numbers): a check,
e.g. on a login node, that they build here before GPU time is spent.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from ..errors import VestError

# (name, workload options). Small enough to run in seconds on any GPU the profiles list; between
# them they run what training jobs load: cuBLAS GEMMs and the foreach optimizers, cuDNN
# convolutions and batch norm in fp32 and fp16, and embeddings, layer norm, GELU and the fused
# attention kernels under autocast.
_ATTENTION = ["--model", "hf:BertForMaskedLM", "--model-arg", "hidden_size=256", "--model-arg", "num_hidden_layers=2",
              "--model-arg", "num_attention_heads=4", "--model-arg", "intermediate_size=1024", "--input", "seq128",
              "--batch-size", "8", "--optimizer", "adamw"]
_RESNET18 = ["--model", "torchvision:resnet18", "--input", "3x64x64", "--batch-size", "16", "--optimizer", "sgd-momentum"]
JOBS: tuple[tuple[str, list[str]], ...] = (
    ("gemm fp32", ["--model", 'mlp:[["Linear",1024,1024],["ReLU"],["Linear",1024,1024],["ReLU"],["Linear",1024,10]]',
                   "--input", "1024", "--batch-size", "64", "--optimizer", "adam"]),
    ("conv fp32", _RESNET18),
    ("conv amp-fp16", _RESNET18 + ["--precision", "amp-fp16"]),
    ("attention amp", _ATTENTION),   # amp-bf16 from sm80, amp-fp16 before (_argv)
)
STEPS = 3
# The dry run checks that each job builds and trains here; one step shows that, and the CPU's
# fp16 convolutions (no tensor cores, a reference kernel) make each further step cost a minute.
DRY_RUN_STEPS = 1
JOB_TIMEOUT_S = 600


@dataclass(frozen=True)
class JobResult:
    name: str
    outside_allocator_mib: float | None   # None: no GPU, or NVML unreadable
    device_name: str
    total_mib: float | None
    torch_version: str
    cuda_version: str | None
    seconds: float


def _argv(index: int, device: str) -> list[str]:
    name, options = JOBS[index]
    argv = list(options)
    if name == "attention amp":
        import torch

        before_sm80 = device.startswith("cuda") and torch.cuda.get_device_capability() < (8, 0)
        argv += ["--precision", "amp-fp16" if before_sm80 else "amp-bf16"]
    return argv


def calibrate_job(index: int, device: str = "cuda") -> JobResult:
    """Run calibration job ``index`` in this process (a fresh one: `vest calibrate` starts one per job)."""
    from .measure import measure
    from ..estimate.workload import parse_workload_args

    steps = DRY_RUN_STEPS if device == "cpu" else STEPS
    m = measure(parse_workload_args(_argv(index, device)), device=device, steps=steps)
    return JobResult(JOBS[index][0], m.outside_allocator_mib, m.device_name, m.total_mib, m.torch_version,
                     m.cuda_version, m.seconds)


def run_jobs(device: str = "cuda") -> list[JobResult]:
    """Every job, each in its own Python process; raises VestError naming a job that fails."""
    out = []
    for i, (name, _) in enumerate(JOBS):
        cmd = [sys.executable, "-m", "vest_slurm.gpu.calibrate", "--job", str(i), "--device", device]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise VestError(f"calibration job {name!r} ran longer than {JOB_TIMEOUT_S} s",
                            "check that the GPU is not busy with another job (nvidia-smi)") from None
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise VestError(f"calibration job {name!r} failed: {last}",
                            f"run it alone to see why: {' '.join(cmd)}")
        out.append(JobResult(**json.loads(r.stdout.strip().splitlines()[-1])))
    return out


def floor_mib(results: list[JobResult]) -> int:
    """The site floor: the median of the jobs' memory outside the allocator."""
    values = [r.outside_allocator_mib for r in results if r.outside_allocator_mib is not None]
    if len(values) < len(results):
        raise VestError("the device's used memory could not be read (NVML)",
                        "install nvidia-ml-py (pynvml) or put nvidia-smi on PATH, and run vest calibrate again")
    return round(statistics.median(values))


def site_lines(results: list[JobResult], gres_type: str, profile_key: str) -> str:
    """The [gpu.<type>] lines for the site config, with each job's measurement as a comment."""
    first = results[0]
    per_job = ", ".join(f"{r.name} {r.outside_allocator_mib:.0f}" for r in results)
    return (f"[gpu.{gres_type}]\n"
            f'profile = "{profile_key}"\n'
            f"context_mib = {floor_mib(results)}    # median of {len(results)} jobs (MiB: {per_job}); "
            f"measured {time.strftime('%Y-%m-%d')} on {first.device_name}, torch {first.torch_version}, "
            f"CUDA {first.cuda_version}\n")


def main(argv: list[str] | None = None) -> None:
    import argparse
    from dataclasses import asdict

    p = argparse.ArgumentParser(prog="python -m vest_slurm.gpu.calibrate", description="run one calibration job")
    p.add_argument("--job", type=int, required=True, choices=range(len(JOBS)))
    p.add_argument("--device", default="cuda")
    ns = p.parse_args(argv)
    try:
        result = calibrate_job(ns.job, ns.device)
    except VestError as e:
        print(f"{e.what} ({e.fix})" if e.fix else e.what, file=sys.stderr)
        sys.exit(2)
    print(json.dumps(asdict(result)))


if __name__ == "__main__":
    main()


# ---------------------------------------------------------------- vest calibrate

def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this GPU type's floor for the site config (run on a GPU node)",
                       description="Measure what PyTorch training processes hold on this node's GPU outside the "
                                   "caching allocator (CUDA context and loaded kernels): a few small jobs, each in "
                                   "a fresh process, and their median. Prints the [gpu.<type>] lines for the site "
                                   "config. Run it on each GPU type, e.g. "
                                   "`srun -p a100 --gres=gpu:1 vest calibrate --gres-type a100`.")
    p.add_argument("--gres-type", required=True, help="the GPU's gres type name in Slurm (e.g. a100)")
    p.add_argument("--profile", default=None, help="device profile (default: from the device name)")
    p.add_argument("--dry-run", action="store_true",
                   help="run the calibration jobs on this machine's CPU instead (checks they build here; measures nothing)")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(ns) -> int:
    from ..estimate.profiles import get_profile, profile_for_device_name

    if ns.dry_run:
        results = run_jobs(device="cpu")
        print(f"dry run: the {len(results)} calibration jobs ran on the CPU "
              f"({', '.join(f'{r.name} {r.seconds:.1f} s' for r in results)}); nothing was measured. "
              f"On a GPU node: vest calibrate --gres-type {ns.gres_type}")
        return 0
    import torch

    if not torch.cuda.is_available():
        raise VestError("no CUDA GPU is visible to this process",
                        "run vest calibrate on a GPU node, e.g. srun --gres=gpu:1 vest calibrate --gres-type a100 "
                        "(or --dry-run here to check that its jobs build)")
    print(f"vest calibrate: {len(JOBS)} jobs on {torch.cuda.get_device_name(0)}, one process each ...", file=sys.stderr)
    results = run_jobs(device="cuda")
    first = results[0]
    profile = get_profile(ns.profile) if ns.profile else profile_for_device_name(first.device_name, int(first.total_mib or 0))
    if profile is None:
        raise VestError(f"no built-in profile matches {first.device_name!r}", "give --profile with the closest built-in type")
    print(site_lines(results, ns.gres_type, profile.key), end="")
    return 0
