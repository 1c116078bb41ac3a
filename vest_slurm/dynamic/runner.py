"""Dynamic analysis, parent side: run a training command's script in a bounded child process with
fake CUDA (vest_slurm/dynamic/bootstrap.py) and turn what it recorded into an AllocTrace.

Limits that keep a shared login node safe, per child: wall time and resident memory (defaults
120 s and 4 GiB; a site sets its own in site config), its own process session (killed whole at
the end, so nothing is left behind), a fresh temp dir that is the only place it may write, no
network, no subprocesses (the child's audit hook refuses them), and, where it can run, bubblewrap
around the child (bwrap.py: read-only mounts but the temp dir, no network, its own PID namespace),
which also holds against code outside Python.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from ..errors import EstimateError
from .bwrap import sandbox_argv, tree_rss_bytes
from .launch import TrainCommand
from ..estimate.profiles import DeviceProfile
from ..estimate.trace import AllocEvent, AllocTrace
from ..units import GiB, MiB

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_MEMORY_BYTES = 4 * GiB
DEFAULT_STEPS = 3
_POLL_S = 0.05


@dataclass(frozen=True)
class Limits:
    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    steps: int = DEFAULT_STEPS

    @classmethod
    def for_site(cls, site) -> "Limits":
        """The site config's ``[dynamic]`` limits."""
        d = site.dynamic
        return cls(timeout_s=d.timeout_s, memory_bytes=d.memory_mib * MiB, steps=d.steps)


@dataclass(frozen=True)
class DynamicRun:
    trace: AllocTrace
    steps: int
    batch_hint: int | None
    seconds: float
    peak_rss_bytes: int
    redirected_writes: tuple[str, ...]
    spec: object = None   # an FSDP2 script's per-rank WorkloadSpec (fake_dist.per_rank)


def _child_env(cmd: TrainCommand, tmpdir: str, world_size: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "NCCL_", "TORCHELASTIC_"))}
    env.update(dict(cmd.env))
    cache = os.path.join(tmpdir, "cache")
    env.update({
        "TMPDIR": tmpdir, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": os.path.join(cache, "hf"), "XDG_CACHE_HOME": cache, "TORCH_HOME": os.path.join(cache, "torch"),
        "MPLCONFIGDIR": os.path.join(cache, "mpl"), "WANDB_MODE": "disabled", "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
        # what torchrun / srun would give rank 0
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
    })
    if cmd.mixed_precision:
        env["ACCELERATE_MIXED_PRECISION"] = cmd.mixed_precision
    # the vest_slurm package must import in the child even when run from a source checkout
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def run_dynamic(cmd: TrainCommand, profile: DeviceProfile, num_gpus: int, limits: Limits = Limits(),
                cwd: str | None = None) -> DynamicRun:
    """Run ``cmd`` with fake CUDA for ``limits.steps`` optimizer steps; raise EstimateError on failure."""
    where = cwd or os.getcwd()
    if cmd.script and not os.path.isfile(os.path.join(where, cmd.script)):
        raise EstimateError(f"training script {cmd.script!r} not found (looked in {where})",
                            "run from the directory the job runs in, or give the script's path")
    tmpdir = tempfile.mkdtemp(prefix="vest-dyn-")
    out = os.path.join(tmpdir, "result.json")
    world = max(num_gpus, cmd.nproc if cmd.nproc > 0 else num_gpus)
    argv = [sys.executable, "-m", "vest_slurm.dynamic.bootstrap", "--out", out, "--steps", str(limits.steps),
            "--tmpdir", tmpdir, "--gpu-name", profile.name, "--total-memory", str(profile.total_bytes),
            "--capability", str(profile.capability[0]), str(profile.capability[1]),
            "--device-count", str(max(1, world)), "--world-size", str(max(1, world))]
    if cmd.module:
        argv += ["--module", cmd.module, "--", *cmd.args]
    else:
        argv += ["--", cmd.script, *cmd.args]
    # bubblewrap where it can run (bwrap.py), else the audit hook alone, said once
    argv, _confined = sandbox_argv(argv, tmpdir, where)
    t0 = time.perf_counter()
    log_path = os.path.join(tmpdir, "output.log")
    peak_rss = 0
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, cwd=where, env=_child_env(cmd, tmpdir, world), stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            limit_hit = None
            while proc.poll() is None:
                rss = tree_rss_bytes(proc.pid)      # under bubblewrap the child is a grandchild
                peak_rss = max(peak_rss, rss)
                if rss > limits.memory_bytes:
                    limit_hit = f"memory limit: the estimate used {rss / GiB:.1f} GiB of host memory (limit {limits.memory_bytes / GiB:.1f} GiB)"
                elif time.perf_counter() - t0 > limits.timeout_s:
                    limit_hit = f"time limit: the estimate ran past {limits.timeout_s:.0f} s"
                if limit_hit:
                    break
                time.sleep(_POLL_S)
            _kill_group(proc)   # the child's session: anything it left running goes too
        seconds = time.perf_counter() - t0
        if limit_hit:
            raise EstimateError(f"{cmd.display}: {limit_hit}",
                                "make the script reach its optimizer step sooner (smaller data set, fewer setup steps), "
                                "or ask the site for a higher limit ([dynamic] in the site config)")
        if not os.path.exists(out):
            tail = _tail(log_path)
            raise EstimateError(f"{cmd.display}: the estimate's child process died (exit {proc.returncode})\n{tail}",
                                "run the script directly to see whether it starts at all")
        with open(out) as f:
            result = json.load(f)
        _raise_for_status(cmd, result, log_path)
        events = tuple(AllocEvent("alloc" if a == "a" else "free", b, size, 0, phase, cat, mod, detail)
                       for a, b, size, phase, cat, mod, detail in result["events"])
        trace = AllocTrace(events, result["steps"], (f"dynamic: {cmd.display}", *result.get("notes", ())),
                           tuple(result.get("step_ends", ())))
        spec = None
        if result.get("fsdp"):   # fully_shard in the script: the per-rank trace of its run
            from .fake_dist import per_rank

            base = script_spec(cmd, DynamicRun(trace, result["steps"], result.get("batch_hint"), 0, 0, ()), world, "")
            trace, spec = per_rank(result["fsdp"], trace.events, trace.step_ends, base, profile)
            trace = AllocTrace(trace.events, trace.iterations, (f"dynamic: {cmd.display}",) + trace.notes, trace.step_ends)
        return DynamicRun(trace, result["steps"], result.get("batch_hint"), seconds, peak_rss,
                          tuple(result.get("redirected_writes", ())), spec)
    finally:
        if not os.environ.get("VEST_KEEP_TMP"):
            shutil.rmtree(tmpdir, ignore_errors=True)


def _tail(path: str, lines: int = 8) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read().splitlines()[-lines:]
    except OSError:
        return ""
    return "\n".join("  | " + t for t in text)


def _raise_for_status(cmd: TrainCommand, result: dict, log_path: str) -> None:
    status = result.get("status")
    if status == "ok":
        return
    where = f" at {result['where']}" if result.get("where") else ""
    line = f"\n  {result['where']}: {result['line']}" if result.get("where") and result.get("line") else ""
    msg = result.get("message", "")
    if status == "no-step":
        raise EstimateError(f"{cmd.display} ended without an optimizer step ({result.get('steps', 0)} steps traced)",
                            "the dynamic estimate needs the script to train: check that its arguments start training "
                            "(not only evaluation) and that the loop calls optimizer.step()")
    if status == "data-dependent":
        raise EstimateError(f"{cmd.display}: data-dependent work that fake tensors cannot answer{where}: {msg}{line}",
                            "shapes that depend on tensor values (nonzero, boolean masks, unique) cannot be traced without "
                            "the data; describe the workload with #VEST --model ... instead")
    if status == "refused":
        raise EstimateError(f"{cmd.display}: {msg}{line}",
                            "estimates run offline and in one process: make network access and subprocesses optional "
                            "(e.g. behind a flag), or describe the workload with #VEST --model ...")
    if status == "memory":
        raise EstimateError(f"{cmd.display}: ran out of host memory{where}: {msg}", "the site's memory limit for estimates was hit")
    if status == "script-exit":
        raise EstimateError(f"{msg} before its first optimizer step\n{_tail(log_path)}",
                            "run the script directly: it fails by itself (arguments, missing files)")
    if status == "internal":
        raise EstimateError(f"{cmd.display}: the estimator failed: {msg}", "this is a bug in vest-slurm; report it with the script")
    raise EstimateError(f"{cmd.display} failed by itself{where}: {msg}{line}",
                        "fix the script (run it directly to see the error); the estimate runs it unchanged")


def script_spec(cmd: TrainCommand, run: "DynamicRun", num_gpus: int, alloc_conf: str):
    """The WorkloadSpec that stands for a script in reports and placement (its trace is the script's)."""
    from ..estimate.workload import WorkloadSpec

    if run.spec is not None:
        return run.spec.with_(alloc_conf=alloc_conf)
    return WorkloadSpec(model=f"script: {cmd.display}", batch_size=run.batch_hint or 1, num_gpus=num_gpus,
                        parallelism="ddp", alloc_conf=alloc_conf, steps=run.steps)


def trace_command(cmd: TrainCommand, profiles, num_gpus: int | None = None, limits: Limits = Limits(),
                  cwd: str | None = None, alloc_conf: str | None = None):
    """Run the script once per capability class of ``profiles``: (spec, {class: TraceSummary or
    EstimateError}, run). A script can fail on one class only (one that checks for native bf16 or a GPU of sm80+); it is an
    error only when it fails on every class."""
    from ..estimate.estimator import gpu_class, summarize

    gpus = num_gpus or (cmd.nproc if cmd.nproc > 0 else 1)
    conf = alloc_conf if alloc_conf is not None else dict(cmd.env).get(
        "PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    summaries, first = {}, None
    # newest GPU class first: a script that needs sm80+ is traced where it runs
    for p in sorted(profiles, key=lambda p: p.capability, reverse=True):
        cls = gpu_class(p)
        if cls in summaries:
            continue
        try:
            run = run_dynamic(cmd, p, gpus, limits, cwd)
        except EstimateError as e:
            summaries[cls] = e
            continue
        summaries[cls] = summarize(run.trace, run.seconds)
        first = first or run
    if first is None:
        raise next(iter(summaries.values()))
    return script_spec(cmd, first, gpus, conf), summaries, first


def estimate_command(cmd: TrainCommand, profiles, num_gpus: int | None = None, limits: Limits = Limits(),
                     cwd: str | None = None, alloc_conf: str | None = None):
    """MemoryEstimates of a training command for the profiles it runs on, and the run behind them.
    Raises EstimateError when it runs on none of them."""
    from ..estimate.estimator import estimates_for

    spec, summaries, run = trace_command(cmd, profiles, num_gpus, limits, cwd, alloc_conf)
    return estimates_for(spec, summaries, {p.key: p for p in profiles})[0], run
