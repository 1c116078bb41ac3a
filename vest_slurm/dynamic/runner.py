"""Dynamic analysis, parent side: run a training command's script in a bounded child process with
fake CUDA (vest_slurm/dynamic/bootstrap.py) and turn what it recorded into an AllocTrace.

Limits that keep a shared login node safe, per child: time and resident memory (defaults 120 s
and 4 GiB; a site sets its own in site config). The time is the child's own: wall time less what
the kernel kept the script waiting for a CPU that other work held (its run-queue delay,
/proc/PID/schedstat), so an estimate is not refused because other users load the node, and a
script that sleeps or blocks is still stopped. Its own process session (killed whole at the end,
so nothing is left behind), a fresh temp dir that is the only place it may write, no network, no
processes but host tools (children.py), and, where it can run, bubblewrap around the child
(bwrap.py: read-only mounts but the temp dir, no network, its own PID namespace), which also holds
against code outside Python.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

from ..errors import EstimateError
from .bwrap import rss_bytes, sandbox_argv, tree_cpu_wait_s, tree_pids
from .children import CONFINED_ENV
from . import accelerate_env
from . import nvidia_smi
from .launch import TORCHRUN_LIKE, TrainCommand
from ..estimate.profiles import DeviceProfile
from ..estimate.trace import (CUDNN_RNN_NOTE, HUB_KERNELS_NOTE, JOB_PYTHON_NOTE, JOB_SETUP_NOTE, AllocEvent, AllocTrace,
                              growth_note)
from ..units import GiB, MiB

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_MEMORY_BYTES = 4 * GiB
DEFAULT_STEPS = 3
_POLL_S = 0.05
# The process tree is scanned again at this interval (a scan reads every /proc/PID/stat, ~3 ms of
# CPU: at each 50 ms poll that took 5% of a core from the child on a busy login node); between
# scans only the known processes' RSS is read. The tree forms as bubblewrap starts the child, in
# its first second, when it is scanned at every poll.
_RESCAN_S = 1.0


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
    observed: tuple[tuple[str, object], ...] = ()   # what the script did: precision, cudnn_benchmark, zero_grad
    flags: tuple[str, ...] = ()                     # why the estimate may not be the real run's (shown with it)
    reads: tuple[str, ...] = ()                     # "kind at file:line" of values read from device tensors
    stopped_by: str = "optimizer steps"
    repeats_replayed: int = 0   # identical no-grad calls of the model replayed from their trace (repeats.py)
    sized_to_gpu: bool = False  # the script caught CUDA out-of-memory and went on: its run is this GPU's


def _torch_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "unknown"


# The oldest torch and Python vest's fake CUDA runs a script with (pyproject's requirements).
MIN_JOB_TORCH = (2, 4)
MIN_JOB_PYTHON = (3, 10)


def script_python(cmd: TrainCommand, cwd: str | None) -> tuple[str, str | None, str]:
    """(the Python that runs the script with fake CUDA, the job's own where it is another than vest's
    (else None), why the job's own does not run it: "" where it does or there is none). The job's own
    where its command runs another Python than vest's (a venv, a conda env, a module's) that has a
    torch vest can drive: the script imports what the job imports, at the versions the job has
    (transformers, timm, torch itself: their memory is the job's). Else vest's, and the reason,
    which the estimate flags."""
    from ..estimate import cudnn_ws

    theirs = cudnn_ws.other_python(cmd.program, cmd.path, cwd)
    if theirs is None:
        shell = cudnn_ws.shell_launcher(cmd.program, cmd.path, cwd) if cmd.program else None
        if shell:   # a wrapper script: the Python it runs is not known here (said, not assumed to be vest's)
            return sys.executable, shell, "is not known: the command's launcher is a shell script vest cannot follow to the Python it runs"
        return sys.executable, None, ""
    torch_v, _, _, py = cudnn_ws.probe(theirs)
    m = re.match(r"(\d+)\.(\d+)", torch_v or "")
    if m is None:
        return sys.executable, theirs, "has no torch that imports"
    if (int(m.group(1)), int(m.group(2))) < MIN_JOB_TORCH or (py and tuple(py) < MIN_JOB_PYTHON):
        return sys.executable, theirs, (
            f"has torch {torch_v} on Python {'.'.join(map(str, py or ()))}; vest runs scripts with torch "
            f">= {'.'.join(map(str, MIN_JOB_TORCH))} on Python >= {'.'.join(map(str, MIN_JOB_PYTHON))}")
    return theirs, theirs, ""


def _vest_only_path(tmpdir: str) -> str:
    """A folder that holds vest_slurm alone (a link to this package), for the job's Python's
    PYTHONPATH: the folder this package is installed in would also put vest's other packages (its
    torch, transformers) before the job's."""
    d = os.path.join(tmpdir, "vest-path")
    os.makedirs(d, exist_ok=True)
    os.symlink(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.join(d, "vest_slurm"))
    return d


# The host work of a run (data loading, transforms, metrics: real tensors) on one thread. What it
# computes decides no device memory, and on a login node shared by many users (or by an estimate's
# own cuDNN workers) OpenMP's pool of one thread per core spins against the other processes: a
# normalisation of one 224x224 image took 24 ms with torch's 2 threads on this 2-core machine at
# load 3, 0.13 ms with one. torchrun sets the same for each process it starts.
HOST_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _checkpoints_read(tmpdir: str) -> list[tuple[int, str]]:
    """The checkpoint files the run read (bootstrap.Sandbox.checkpoint_read), each once, largest first."""
    from .bootstrap import CHECKPOINTS_READ

    found: dict[str, int] = {}
    try:
        with open(os.path.join(tmpdir, CHECKPOINTS_READ)) as f:
            for line in f:
                size, _, path = line.rstrip("\n").partition(" ")
                if size.isdigit() and path:
                    found[path] = int(size)
    except OSError:
        return []
    return sorted(((s, p) for p, s in found.items()), reverse=True)


# the device selection of the machine vest runs on, which Slurm sets anew on the job's node
_NOT_THE_JOBS = frozenset({"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ROCR_VISIBLE_DEVICES"})


def _child_env(cmd: TrainCommand, tmpdir: str, world_size: int, accelerate_config: str | None = None,
               user_env: dict | None = None, vest_path: str | None = None, host_threads: bool = True) -> dict:
    """The child's environment: the user's (``user_env``, default this process's) less the GPU's and
    the launchers' own variables, with the caches, offline switches and temp dir of the run.
    ``vest_path``: where the child (the job's own Python) finds vest_slurm, else this package's root.
    ``host_threads``: the host's compute on one thread (HOST_THREADS); the live oracle, which
    computes the model on the CPU, keeps the user's."""
    base = os.environ if user_env is None else user_env
    # the user's settings carry over as sbatch carries them (CUDA_DEVICE_MAX_CONNECTIONS, which
    # Megatron's tensor parallelism checks; CUDA_LAUNCH_BLOCKING; NCCL_*): only which GPUs this
    # machine shows and an enclosing launcher's own variables are not the job's
    env = {k: v for k, v in base.items() if k not in _NOT_THE_JOBS and not k.startswith("TORCHELASTIC_")}
    env.update(dict(cmd.env))
    cache = os.path.join(tmpdir, "cache")
    env.update(_model_caches(env))
    env.update({
        "TMPDIR": tmpdir, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": os.path.join(cache, "hf"), "XDG_CACHE_HOME": cache,
        "MPLCONFIGDIR": os.path.join(cache, "mpl"), "WANDB_MODE": "disabled", "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
    })
    env.update(_rank_env(cmd, world_size, accelerate_config))
    if host_threads:
        env.update(HOST_THREADS)
    if cmd.launcher == "fabric":   # sizes the job decides ($SLURM_NNODES): the world estimated, as Fabric() parses them
        per_node = _per_node(cmd, world_size)
        for var, value in (("LT_DEVICES", per_node), ("LT_NUM_NODES", max(1, -(-world_size // per_node)))):
            if "$" in env.get(var, ""):
                env[var] = str(value)
    if "USE_HUB_KERNELS" not in env:
        # transformers >= 5 swaps layers for kernels it fetches from the Hub, which an offline run
        # cannot; PyTorch's own layers are traced instead and the estimate says so (bootstrap's
        # HUB_KERNELS_NOTE). A job that sets USE_HUB_KERNELS keeps its choice.
        env.update(USE_HUB_KERNELS="0", VEST_HUB_KERNELS="off")
    if cmd.mixed_precision:
        env["ACCELERATE_MIXED_PRECISION"] = cmd.mixed_precision
    # the vest_slurm package must import in the child even when run from a source checkout
    # (the folder that holds vest_slurm/: this file is vest_slurm/dynamic/runner.py), also when the
    # command sets its own PYTHONPATH (minGPT's projects: PYTHONPATH=../.. python chargpt.py)
    pkg_root = vest_path or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _font_lists(user_env: dict) -> list[str]:
    """Where matplotlib's font list may already be: the user's matplotlib cache (MPLCONFIGDIR, else
    $XDG_CACHE_HOME/matplotlib, else ~/.cache/matplotlib: matplotlib's get_cachedir), then vest's."""
    from ..estimate.tracecache import cache_dir

    xdg = user_env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    mine = cache_dir()
    return [user_env.get("MPLCONFIGDIR") or os.path.join(xdg, "matplotlib")] + ([str(mine / "matplotlib")] if mine else [])


def _font_list_names(folder: str) -> list[str]:
    """matplotlib's font lists in ``folder`` (fontlist-vNNN.json); none where it cannot be read."""
    try:
        return [n for n in os.listdir(folder) if n.startswith("fontlist-") and n.endswith(".json")]
    except OSError:
        return []


def _seed_font_list(user_env: dict, mpl_dir: str) -> None:
    """The child's matplotlib starts with a font list. On its first import in an empty MPLCONFIGDIR
    matplotlib scans and parses every font file of the machine and writes fontlist-vNNN.json (about
    1 s, every run: the child's MPLCONFIGDIR is new each time); the list depends only on the fonts
    installed and matplotlib's version (in the name), so the user's, or one an earlier run left in
    vest's cache, is the one the child would build."""
    for src in _font_lists(user_env):
        names = _font_list_names(src)
        if names:
            os.makedirs(mpl_dir, exist_ok=True)
            for n in names:
                shutil.copyfile(os.path.join(src, n), os.path.join(mpl_dir, n))
            return


def _keep_font_list(user_env: dict, mpl_dir: str) -> None:
    """A font list the child built (none was there to seed it): kept in vest's cache for the next run."""
    dest = _font_lists(user_env)[1:]
    names = _font_list_names(mpl_dir)
    if not dest or not names:
        return
    try:
        os.makedirs(dest[0], exist_ok=True)
        for n in names:
            if not os.path.exists(os.path.join(dest[0], n)):
                tmp = os.path.join(dest[0], f".{n}.{os.getpid()}")
                shutil.copyfile(os.path.join(mpl_dir, n), tmp)
                os.replace(tmp, os.path.join(dest[0], n))
    except OSError:
        pass   # a cache only


def _rank_env(cmd: TrainCommand, world: int, accelerate_config: str | None = None) -> dict:
    """The process-placement variables the job's launcher gives rank 0, and only those: torchrun
    (torch/distributed/elastic/agent/server/api.py: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), and accelerate launch where it starts the script through torchrun
    (multi_gpu_launcher: more than one process, or FSDP / Megatron-LM); srun starting Python itself,
    its first task's SLURM_PROCID, SLURM_NTASKS, ... (_srun_task_env). A plain ``python train.py``
    and accelerate's simple launcher of one process set none: the script sees the user's own
    environment, as in the job. A script that reads RANK to choose its DDP branch (nanoGPT's
    ``int(os.environ.get('RANK', -1)) != -1``) then takes the branch it takes on the GPU node."""
    if cmd.srun is not None and cmd.launcher == "python":
        return _srun_task_env(cmd, world)
    if cmd.launcher == "accelerate":
        if world <= 1 and not _accelerate_uses_torchrun(cmd, accelerate_config):
            return {}
    elif cmd.launcher not in TORCHRUN_LIKE:
        return {}
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(_per_node(cmd, world)),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _srun_task_env(cmd: TrainCommand, world: int) -> dict:
    """What srun gives its first task (Slurm's srun(1), "OUTPUT ENVIRONMENT VARIABLES"), where srun
    starts Python itself, one task per rank: the scripts written for Slurm read their rank and world
    from these (``int(os.environ["SLURM_PROCID"])``, Lightning's SLURMEnvironment, submitit). Tasks:
    srun's -n/--ntasks, else --ntasks-per-node x -N/--nodes, else one per GPU of the job (the usual
    ``#SBATCH --ntasks-per-node=<GPUs per node>``); the node list is this host."""
    import socket

    opts = dict(cmd.srun or ())

    def num(*names):
        for n in names:
            try:
                return max(1, int(str(opts[n]).split("-")[0]))
            except (KeyError, ValueError):
                continue
        return None

    per_node_opt = num("--ntasks-per-node")
    nodes = num("-N", "--nodes")
    tasks = num("-n", "--ntasks") or (per_node_opt * nodes if per_node_opt and nodes else None) or max(1, world)
    nodes = nodes or (-(-tasks // per_node_opt) if per_node_opt else -(-tasks // _per_node(cmd, world)))
    per_node = per_node_opt or -(-tasks // nodes)
    host = socket.gethostname() or "localhost"
    return {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": str(tasks),
            "SLURM_NPROCS": str(tasks), "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_NTASKS_PER_NODE": str(per_node),
            "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_STEP_ID": "0", "SLURM_NODELIST": host, "SLURM_JOB_NODELIST": host, "SLURM_STEP_NODELIST": host,
            "SLURMD_NODENAME": host}


# accelerate launch's switches, and a config file's distributed_type values, for which
# accelerate.commands.launch.launch_command takes multi_gpu_launcher (torch.distributed.run) even
# for one process; the rest of one process take simple_launcher. (DeepSpeed is not traced, plan()).
_ACCELERATE_TORCHRUN_FLAGS = ("--use_fsdp", "--use-fsdp", "--use_megatron_lm", "--use-megatron-lm", "--multi_gpu", "--multi-gpu")
_ACCELERATE_TORCHRUN_TYPES = ("FSDP", "MEGATRON_LM", "MULTI_GPU")


def _accelerate_uses_torchrun(cmd: TrainCommand, config: str | None) -> bool:
    """Whether accelerate launch starts the script through torchrun: its switches, else the
    distributed_type of its config file ``config`` (absolute, _accelerate_config)."""
    if any(a.split("=", 1)[0] in _ACCELERATE_TORCHRUN_FLAGS for a in cmd.launcher_args):
        return True
    if not config:
        return False
    try:   # as accelerate's load_config_from_file reads it: JSON by its suffix, else YAML
        with open(config) as f:
            if config.endswith(".json"):
                doc = json.load(f)
            else:
                import yaml

                doc = yaml.safe_load(f)
    except Exception:   # unreadable: accelerate's own parser says so in the child
        return False
    return isinstance(doc, dict) and str(doc.get("distributed_type", "")).upper() in _ACCELERATE_TORCHRUN_TYPES


def _known_launcher_args(args, world: int) -> list[str]:
    """accelerate launch's options for the child's own parser, where the job script left a value to
    the running job (``--num_processes $((SLURM_NNODES * GPUS_PER_NODE))``, ``--main_process_ip
    $head_node_ip``: launch.JOB_DECIDES): the process count is the world the estimate runs for;
    another such option is left out (accelerate's default: one machine, this host)."""
    out, i, args = [], 0, list(args)
    while i < len(args):
        a = args[i]
        key, eq, val = a.partition("=")
        takes = not eq and i + 1 < len(args) and not args[i + 1].startswith("-")
        value = val if eq else (args[i + 1] if takes else "")
        step = 1 if eq or not takes else 2
        if "$" in value:
            if key in ("--num_processes", "--num-processes"):
                out += [key, str(max(1, world))]
        else:
            out += args[i:i + step]
        i += step
    return out


def _per_node(cmd: TrainCommand, world: int) -> int:
    """GPUs on rank 0's node: torchrun's --nproc_per_node (its processes per node, over --nnodes
    nodes), else the whole world (a python process that uses every GPU of the job; accelerate's
    --num_processes counts all machines). What torch.cuda.device_count() and LOCAL_WORLD_SIZE answer
    there (FSDP1's HYBRID_SHARD makes its shard group of them)."""
    if cmd.launcher in TORCHRUN_LIKE and cmd.nproc > 0:
        return max(1, min(cmd.nproc, world))
    if cmd.launcher in TORCHRUN_LIKE and cmd.nnodes > 0:   # --nproc_per_node gpu over M nodes
        return max(1, -(-world // cmd.nnodes))
    return max(1, world)


def _model_caches(env: dict) -> dict:
    """The user's caches of downloaded weights, where the job finds them on the GPU node: the
    Hugging Face hub's (huggingface_hub's own order: HF_HUB_CACHE, else HF_HOME/hub, else
    XDG_CACHE_HOME or ~/.cache, then huggingface/hub) and torch.hub's (TORCH_HOME, else
    XDG_CACHE_HOME or ~/.cache, then torch: torchvision's and timm's legacy weights). The other
    caches stay in the temp dir (datasets writes its arrow files from C++, past the overlay), so
    these two are named before HF_HOME and XDG_CACHE_HOME move: ``from_pretrained`` and
    ``weights=`` of a model the user already has then load offline as in the job, instead of
    reaching for the network. The script reads them; a write (a lock file) goes to the overlay.
    The Hub's cached modules (HF_MODULES_CACHE: evaluate's metrics) likewise."""
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = env.get("HF_HOME") or os.path.join(xdg, "huggingface")
    hub = env.get("HF_HUB_CACHE") or os.path.join(home, "hub")
    # (and the modules Hugging Face libraries import from the Hub, cached: evaluate's metrics,
    # evaluate.load("accuracy") in every example's evaluation)
    return {"HF_HUB_CACHE": hub, "HF_MODULES_CACHE": env.get("HF_MODULES_CACHE") or os.path.join(home, "modules"),
            "TORCH_HOME": env.get("TORCH_HOME") or os.path.join(xdg, "torch")}


def _accelerate_config(cmd: TrainCommand, where: str) -> str | None:
    """The accelerate config file the launch reads, absolute: --config_file, else the user's default
    one (accelerate's default_config_file: $HF_HOME/accelerate/default_config.yaml, HF_HOME defaulting
    to ~/.cache/huggingface), which the child, whose HF_HOME is its temp dir, would not find."""
    if cmd.config_file:
        path = os.path.join(where, cmd.config_file)
        if not os.path.isfile(path):
            raise EstimateError(f"accelerate config file {cmd.config_file!r} not found (looked in {where})",
                                "run from the directory the job runs in, or give the config file's path")
        return os.path.abspath(path)
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                     os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    for name in ("default_config.yaml", "default_config.json"):
        path = os.path.join(home, "accelerate", name)
        if os.path.isfile(path):
            return path
    return None


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
                cwd: str | None = None, room: int = 0) -> DynamicRun:
    """Run ``cmd`` with fake CUDA for ``limits.steps`` optimizer steps; raise EstimateError on failure.
    In the job's own Python where it can (script_python); where vest's machinery does not run
    there (a failure of kind vest-unsupported), once more in vest's, flagged. ``room``: the fake
    GPU's room for tensors, past which it raises CUDA out-of-memory (0: none; _run_dynamic)."""
    python, theirs, why_not = script_python(cmd, cwd)
    if python == sys.executable:
        return _run_dynamic(cmd, profile, num_gpus, limits, cwd, python, theirs, why_not, room)
    try:
        return _run_dynamic(cmd, profile, num_gpus, limits, cwd, python, theirs, "", room)
    except EstimateError as e:
        if e.kind != "vest-unsupported":
            raise
        first = e.what.splitlines()[0].removeprefix(f"{cmd.display}: ")
        return _run_dynamic(cmd, profile, num_gpus, limits, cwd, sys.executable, theirs,
                            f"did not run vest's fake CUDA ({first})", room)


# what a script that sizes itself to the GPU's memory says: it catches CUDA out-of-memory (its own
# loop, accelerate's find_executable_batch_size, Lightning's batch-size finder, HF Trainer's
# --auto_find_batch_size)
_CATCHES_OOM = re.compile(r"OutOfMemoryError|out of memory|find_executable_batch_size|scale_batch_size|"
                          r"BatchSizeFinder|auto_find_batch_size|auto_scale_batch_size", re.IGNORECASE)


def catches_oom(cmd: TrainCommand, cwd: str | None) -> bool:
    """Whether the command or its script names CUDA out-of-memory or a batch-size finder: then the
    fake GPU raises out-of-memory where the GPU would (a run per room for tensors where it is caught)."""
    if any(_CATCHES_OOM.search(a) for a in cmd.args):
        return True
    path = os.path.join(cwd or os.getcwd(), cmd.script) if cmd.script else None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return bool(_CATCHES_OOM.search(f.read()))
    except (OSError, TypeError):
        return False


def _run_dynamic(cmd: TrainCommand, profile: DeviceProfile, num_gpus: int, limits: Limits, cwd: str | None,
                 python: str, theirs: str | None, why_not: str, room: int = 0) -> DynamicRun:
    """One run in ``python``; ``theirs``, ``why_not``: script_python's (the job's own Python, why it
    does not run the script), said in the flags and in a missing import's fix.

    ``room``: where non-zero, the fake GPU has this room for tensors (a GPU type's usable memory less
    its CUDA context) and an allocation past it raises CUDA out-of-memory, as on the GPU: a script
    that catches it (a batch-size finder) goes on as it would on that GPU type (flagged). One that
    does not catch it is run again unbounded, for the estimate of what it would need."""
    where = cwd or os.getcwd()
    if cmd.script and not os.path.isfile(os.path.join(where, cmd.script)):
        raise EstimateError(f"training script {cmd.script!r} not found (looked in {where})",
                            "run from the directory the job runs in, or give the script's path")
    world = max(num_gpus, cmd.world if cmd.world > 0 else cmd.nproc)
    launcher_args = _known_launcher_args(cmd.launcher_args, world)
    config = _accelerate_config(cmd, where) if cmd.launcher == "accelerate" else None
    from .deepspeed_plan import plan

    ds = plan(cmd, where, config)
    if ds is not None:   # not traced (deepspeed_plan.py): the declarative ZeRO model answers it
        gpus = world if not config or any(a.startswith(("--num_processes", "--num-processes")) for a in launcher_args) \
            else max(world, accelerate_env.config_processes(config))
        raise EstimateError(f"{cmd.display}: {ds.what} (from {ds.source}) is not traced by the dynamic estimate",
                            f"describe the workload declaratively: {ds.line(gpus if gpus > 1 else None, stated_batch(cmd.args))}",
                            kind="vest-unsupported")
    tmpdir = tempfile.mkdtemp(prefix="vest-dyn-")
    out = os.path.join(tmpdir, "result.json")
    if cmd.launcher == "accelerate":   # its config file says how many processes; the child reads the rest
        if config:
            if not any(a.startswith(("--num_processes", "--num-processes")) for a in launcher_args):
                world = max(world, accelerate_env.config_processes(config))
            if not cmd.config_file:
                launcher_args = ["--config_file", config] + launcher_args
            else:
                launcher_args = [config if a == cmd.config_file else a for a in launcher_args]
    argv = [python, "-m", "vest_slurm.dynamic.bootstrap", "--out", out, "--steps", str(limits.steps),
            "--tmpdir", tmpdir, "--gpu-name", profile.name, "--total-memory", str(profile.total_bytes),
            "--capability", str(profile.capability[0]), str(profile.capability[1]),
            "--sm-count", str(profile.sm_count), "--l2-cache", str(profile.l2_cache_bytes),
            "--device-count", str(_per_node(cmd, world)), "--world-size", str(max(1, world)),
            "--oom-at", str(room)]
    if cmd.module:
        argv += ["--module", cmd.module, "--", *cmd.args]
    else:
        argv += ["--", cmd.script, *cmd.args]
    # bubblewrap where it can run (bwrap.py), else the audit hook alone, said once
    # the job's Python: its environment and, for a venv, the installation its python links to
    from ..estimate.cudnn_ws import environment_of

    job_env = (environment_of(python), environment_of(os.path.realpath(python))) if python != sys.executable else ()
    reads = tuple(_model_caches(os.environ).values()) + tuple(dict.fromkeys(job_env))
    argv, _confined = sandbox_argv(argv, tmpdir, where, reads)
    t0 = time.perf_counter()
    log_path = os.path.join(tmpdir, "output.log")
    peak_rss = 0
    try:
        with open(log_path, "wb") as log:
            env = _child_env(cmd, tmpdir, world, config, vest_path=_vest_only_path(tmpdir) if python != sys.executable
                             else None)
            env[CONFINED_ENV] = _confined   # "bubblewrap": what the script starts is confined too (children.py)
            smi = nvidia_smi.install(os.path.join(tmpdir, "bin"), profile.name, profile.total_mib, profile.capability,
                                     _per_node(cmd, world))
            env["PATH"] = os.path.dirname(smi) + os.pathsep + env.get("PATH", "")
            env[nvidia_smi.ENV] = smi
            _seed_font_list(os.environ, env["MPLCONFIGDIR"])
            if cmd.launcher == "accelerate":
                env[accelerate_env.ENV] = json.dumps(launcher_args)
            proc = subprocess.Popen(argv, cwd=where, env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            limit_hit = None   # (the limits' failures have kind "limit")
            pids, scanned = [], float("-inf")
            told = None   # when the run was told its time was up (it ends with the steps traced, if any)
            while proc.poll() is None:
                now = time.perf_counter()
                if now - scanned >= _RESCAN_S or now - t0 < 1.0:
                    pids, scanned = tree_pids(proc.pid), now   # under bubblewrap the child is a grandchild
                rss = rss_bytes(pids)
                peak_rss = max(peak_rss, rss)
                if rss > limits.memory_bytes:
                    limit_hit = f"memory limit: the estimate used {rss / GiB:.1f} GiB of host memory (limit {limits.memory_bytes / GiB:.1f} GiB)"
                elif told is None and (time.perf_counter() - t0 > limits.timeout_s
                                       and time.perf_counter() - t0 - (waited := tree_cpu_wait_s(proc.pid)) > limits.timeout_s):
                    time_up = (f"time limit: the estimate ran past {limits.timeout_s:.0f} s of its own time"
                               + (f" (besides {waited:.0f} s waiting for a CPU the machine's other work held)"
                                  if waited >= 1 else ""))
                    if _tell_time_is_up(pids):   # with a step traced, the run ends there and writes it
                        told = time.perf_counter()
                    else:
                        limit_hit = time_up
                elif told is not None and time.perf_counter() - told > _TIME_UP_GRACE_S:
                    limit_hit = time_up   # no step traced, or no result written in the grace
                if limit_hit:
                    break
                time.sleep(_POLL_S)
            _kill_group(proc)   # the child's session: anything it left running goes too
        seconds = time.perf_counter() - t0
        _keep_font_list(os.environ, env["MPLCONFIGDIR"])
        if limit_hit:
            read = _checkpoints_read(tmpdir) if limit_hit.startswith("memory") else []
            if sum(size for size, _ in read) >= limits.memory_bytes / 4:
                # the host memory went to a checkpoint's values, which the run reads for real
                files = ", ".join(f"{os.path.basename(p)} ({size / GiB:.1f} GiB)" for size, p in read[:3])
                raise EstimateError(f"{cmd.display}: {limit_hit}, while it read checkpoint files of "
                                    f"{sum(s for s, _ in read) / GiB:.1f} GiB ({files}{', ...' if len(read) > 3 else ''}): "
                                    "the dynamic estimate holds a checkpoint's values on the host",
                                    "describe the model declaratively instead, which reads no weights (e.g. #VEST --model "
                                    "hf:./DIR for a transformers checkpoint's folder, with the job's batch and optimizer), or "
                                    "ask the site for a higher limit ([dynamic] memory in the site config)", kind="limit")
            raise EstimateError(f"{cmd.display}: {limit_hit}",
                                "make the script reach its optimizer step sooner (smaller data set, fewer setup steps), "
                                "or ask the site for a higher limit ([dynamic] in the site config)", kind="limit")
        if not os.path.exists(out):
            tail = _tail(log_path)
            kept = _keep_log(log_path)
            raise EstimateError(f"{cmd.display}: the estimate's child process died (exit {proc.returncode})\n{tail}"
                                + (f"\n  the run's output is kept in {kept}" if kept else ""),
                                "run the script directly to see whether it starts at all", kind="vest-unsupported")
        with open(out) as f:
            result = json.load(f)
        if result.get("status") != "ok" and result.get("oom") and room:
            # out of this GPU's memory, not caught: the run again without the bound says how much it needs
            return _run_dynamic(cmd, profile, num_gpus, limits, cwd, python, theirs, why_not, 0)
        if result.get("status") == "relaunch":
            raise Relaunched(cmd, result["relaunch"])
        if result.get("status") != "ok":
            if os.environ.get("VEST_TRACEBACK") and result.get("traceback"):
                print(result["traceback"], file=sys.stderr, end="")
            _raise_for_status(cmd, result, _keep_log(log_path), where, python, theirs, why_not, _per_node(cmd, world))
        events = tuple(AllocEvent("alloc" if a == "a" else "free", b, size, 0, phase, cat, mod, detail)
                       for a, b, size, phase, cat, mod, detail in result["events"])
        allocates = any(e.action == "alloc" for e in events)
        on_host = _host_training(result, allocates)
        if on_host and not allocates:
            raise _no_gpu(cmd, on_host)
        trace = AllocTrace(events, result["steps"], (f"dynamic: {cmd.display}", *result.get("notes", ())),
                           tuple(result.get("step_ends", ())), _tuples(result.get("gpu_asked")))
        batch, flags = batch_and_flags(cmd, result, world)
        if on_host:   # the GPU holds something (a metric, a buffer), but the model trains on the host
            flags += (f"the model trains on the host, not the GPU: {on_host}; the estimate is only what the "
                      "script put on the GPU besides",)
        if result.get("sampled"):
            flags += (sampled_note(result["sampled"]),)
        for opt, where in (result.get("step_branches") or {}).items():
            flags += (f"the {opt} optimizer's step branched on values of GPU tensors (at {where}): stand-ins decided "
                      "those branches here (convergence tests, a line search, whether to keep an update, as in "
                      "LBFGS), so the iterations it runs and the state it keeps may differ from the real run's "
                      + ("(LBFGS keeps up to history_size pairs of flat parameter-sized vectors)" if opt == "LBFGS"
                         else ""),)
        transient = int(result.get("compiled_transient") or 0)
        if transient > 0.10 * trace.live_peak_bytes():   # more than the estimate's own accuracy (10%)
            flags += (f"the script's torch.compile'd code ran eagerly here, and its calls allocated up to {transient / MiB:,.0f} "
                      "MiB of intermediates they freed before returning: compiled, fused kernels may never write them "
                      f"(a dense mask or score matrix): the job may need up to that much less than estimated",)
        if (growth := growth_note(trace, result.get("step_owners"))) is not None:
            flags += (growth,)
        if (varied := forwards_note(result) or steered_loop_note(result)) is not None:
            flags += (varied,)
        if (forward_only := forward_only_note(result)) is not None:
            flags += (forward_only,)
        if result.get("memory_fraction") and result["memory_fraction"][0] < 1:
            fraction, where = result["memory_fraction"]
            flags += (f"the script caps its GPU memory at {fraction:g} of the GPU's "
                      f"(torch.cuda.set_per_process_memory_fraction at {where}): the caching allocator refuses to reserve "
                      f"past that share, so the job runs out of memory where its need passes {fraction:g} x the GPU's "
                      "memory, not the GPU's memory: place it on a GPU at least need / "
                      f"{fraction:g} large",)
        if result.get("oom"):
            live, asked, module = result["oom"]
            flags += (f"the script caught CUDA out-of-memory ({asked / MiB:,.0f} MiB asked with {live / MiB:,.0f} MiB "
                      f"allocated{' in ' + module if module else ''}, {room / MiB:,.0f} MiB for tensors) and went on, as "
                      "a batch-size finder does: it sizes itself to each GPU, so each type's estimate is a run with that "
                      "type's room (the batch shown is this run's); the fake GPU ran out where the caching allocator, run "
                      "along, found no room (its segments, their splits, the cache it releases first)",)
        # cuDNN's RNN: not sized here; transformers' Hub kernels: PyTorch's layers traced instead
        flags += tuple(n for n in trace.notes if n in (CUDNN_RNN_NOTE, HUB_KERNELS_NOTE))
        flags += tuple(result.get("standin_flags") or ())
        if result.get("cut_at_time_limit"):
            flags += (f"the run reached the time limit ({limits.timeout_s:.0f} s) after {result.get('steps', 0)} training "
                      f"step(s) of the {limits.steps} asked for: the estimate is the steps traced; what the script did "
                      "next (sampling, an evaluation, a long setup) was cut short; to trace more, give the command a "
                      "shorter sampling or evaluation where it has such options (a generation length, an evaluation "
                      "interval), or a site can raise [dynamic] timeout_s",)
        if why_not:   # the job runs other packages than those the script ran with here
            flags += (f"the job's Python ({theirs}) {why_not}: the script ran in vest's Python ({sys.executable}, torch {_torch_version()}) "
                      "with its packages, not the job's, whose versions may take other memory; install vest-slurm "
                      "in the job's environment and run vest from there",)
        elif cmd.unresolved and python == sys.executable:
            trace = replace(trace, notes=trace.notes + (
                f"{JOB_SETUP_NOTE} ({'; '.join(cmd.unresolved)}): the script ran in {sys.executable} (torch "
                f"{_torch_version()}) with its packages; load the same before running vest, or name the job's "
                "Python in the command, for the job's versions",))
        elif python != sys.executable:
            from ..estimate.cudnn_ws import probe

            trace = replace(trace, notes=trace.notes + (f"{JOB_PYTHON_NOTE} ({python}, torch {probe(python)[0]}) "
                                                        "with its packages",))
        observed = dict(result.get("observed") or {})
        observed["batch_seen"] = batch
        mine = dict(observed=tuple(sorted(observed.items())), flags=flags,
                    reads=tuple(f"{r['kind']} at {r['where']}" for r in result.get("reads", ())),
                    stopped_by=result.get("stopped_by", "optimizer steps"), sized_to_gpu=bool(result.get("oom")),
                    repeats_replayed=int(result.get("repeats_replayed", 0)))
        spec = None
        if result.get("fsdp"):   # fully_shard in the script: the per-rank trace of its run
            from .fake_dist import per_rank

            # (the micro-batches a step accumulates: the per-rank trace keeps what the earlier ones leave)
            base = script_spec(cmd, DynamicRun(trace, result["steps"], result.get("batch_hint"), 0, 0, (),
                                               observed=(("grad_accum", observed.get("grad_accum") or 1),)), world, "")
            trace, spec = per_rank(result["fsdp"], trace.events, trace.step_ends, base, profile)
            # what of the script's sharding the per-rank model does not follow (a prefetch setting)
            mine["flags"] += tuple(result["fsdp"].get("notes", ()))
            # (made for this profile: no gpu_asked, so it holds on its own class only)
            trace = AllocTrace(trace.events, trace.iterations, (f"dynamic: {cmd.display}",) + trace.notes, trace.step_ends)
        run = DynamicRun(trace, result["steps"], batch, seconds, peak_rss,
                         tuple(result.get("redirected_writes", ())), spec, **mine)
        tp = (result.get("tp") or {}).get("tp", 1)
        if spec is None and tp > 1:   # tensor parallelism alone: the trace is one rank's, over its group
            run = replace(run, spec=script_spec(cmd, run, world, "").with_(tensor_parallel=tp))
        return run
    finally:
        if not os.environ.get("VEST_KEEP_TMP"):
            shutil.rmtree(tmpdir, ignore_errors=True)


# how training scripts name their per-step batch on the command line (argparse habits of the
# reference trainers: torchvision's -b/--batch-size, HF's --per_device_train_batch_size, ...)
_BATCH_FLAGS = ("--batch-size", "--batch_size", "--bs", "-b", "--per_device_train_batch_size",
                "--per-device-train-batch-size", "--train-batch-size", "--train_batch_size",
                "--micro-batch-size", "--micro_batch_size")


def stated_batch(args) -> int | None:
    """The batch a training command states (``--batch-size 64``, ``--batch_size=64``); None if none."""
    args = list(args)
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if flag in _BATCH_FLAGS:
            if not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
            try:
                return int(value)
            except ValueError:
                return None
    return None


def sampled_note(sampled: list) -> str:
    """The flag of a run in which draws of the GPU's random generator decided shapes or values the
    script used (estimate/_shadow.py: sampled shadows); ``sampled``: [use, origin] pairs."""
    origins = list(dict.fromkeys(o for _, o in sampled))
    uses = list(dict.fromkeys(u for u, _ in sampled))
    more = f" and {len(uses) - 4} more" if len(uses) > 4 else ""
    return (f"the script read values made of the GPU's random draws ({'; '.join(origins)}) at {', '.join(uses[:4])}{more}: "
            "sampled on the host here, so the estimate is one draw; where such a value decides a shape (tokens kept by "
            "a random mask, a random crop's size), the real run's shapes vary by chance from step to step, and where it "
            "only scales a loss or a metric, nothing the GPU holds depends on it")


def batch_and_flags(cmd: TrainCommand, result: dict, world: int = 1) -> tuple[int | None, tuple[str, ...]]:
    """The batch the model saw and what to flag about it. The first dimension of the model's first
    input, unless the command states a batch that is its second dimension and not its first (a
    sequence-first model: nn.LSTM, nn.Transformer without batch_first). A stated batch that is
    neither is flagged: the estimate is for the batch the model saw (gradient accumulation splits
    it, some scripts divide a global batch by the GPUs)."""
    batch = result.get("batch_hint")
    shape = result.get("first_input_shape") or []
    stated = stated_batch(cmd.args)
    flags = []
    if stated is not None and batch is not None and batch != stated:
        if len(shape) > 1 and shape[1] == stated:
            batch = stated   # sequence-first input: (sequence, batch, ...)
        elif len(shape) > 1 and world > 1 and shape[1] * world == stated and shape[0] * world != stated:
            # sequence-first, and the stated batch the global one the script divides (Transformer-XL,
            # GNMT, word_language_model under DDP)
            batch = shape[1]
            flags.append(f"the model saw a batch of {batch} (sequence-first input of shape {tuple(shape)}): the "
                         f"command's {stated} over the job's {world} GPUs, as a script that takes the global batch "
                         "divides it; the estimate is per GPU, at that batch")
        elif world > 1 and batch * world == stated:   # a global batch the script divides (mp.spawn trainers)
            flags.append(f"the model saw a batch of {batch} (input shape {tuple(shape)}): the command's {stated} over "
                         f"the job's {world} GPUs, as a script that takes the global batch divides it; the estimate "
                         "is per GPU, at that batch")
        elif batch > stated and batch % stated == 0:   # DPO's chosen and rejected, SimCLR's two views
            flags.append(f"the model saw a batch of {batch} (input shape {tuple(shape)}), {batch // stated} x the "
                         f"command's {stated}: a script that puts {batch // stated} inputs per sample through the "
                         "model in one call (paired preferences, augmented views, siamese pairs) does so; the "
                         "estimate is for the batch the model saw")
        else:
            flags.append(f"the model saw a batch of {batch} (input shape {tuple(shape)}) but the command states "
                         f"a batch of {stated}: the estimate is for the batch the model saw")
    return batch, tuple(flags)


def _keep_log(path: str) -> str | None:
    """A copy of a failed run's output that outlives the temp dir (its path is printed)."""
    try:
        fd, kept = tempfile.mkstemp(prefix="vest-dynamic-", suffix=".log")
        with os.fdopen(fd, "wb") as out, open(path, "rb") as f:
            shutil.copyfileobj(f, out)
        return kept
    except OSError:
        return None


def _tail(path: str, lines: int = 8) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read().splitlines()[-lines:]
    except OSError:
        return ""
    return "\n".join("  | " + t for t in text)


_WORKAROUND = ("describe the workload with a #VEST line instead (e.g. #VEST --model torchvision:resnet50 "
               "--batch-size 64 --input 3x224x224 --optimizer sgd-momentum), which needs no run of the script")


def requirement_pin(package: str, cmd: TrainCommand, cwd: str | None) -> tuple[str, str] | None:
    """(file, requirement) where a requirements file beside the script or in the directory the
    command runs in names ``package`` (e.g. ("requirements.txt", "timm==0.3.2")), else None."""
    want = re.sub(r"[-_.]+", "-", package).lower()
    where = cwd or os.getcwd()
    dirs = [where] + ([os.path.dirname(os.path.join(where, cmd.script))] if cmd.script else [])
    for d in dict.fromkeys(os.path.normpath(x) for x in dirs):
        for name in ("requirements.txt", "requirements-train.txt", "requirements_train.txt"):
            try:
                with open(os.path.join(d, name), errors="replace") as f:
                    lines = f.read().splitlines()
            except OSError:
                continue
            for text in lines:
                req = text.split("#", 1)[0].strip()
                m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)", req)
                if m and re.sub(r"[-_.]+", "-", m.group(1)).lower() == want:
                    return os.path.relpath(os.path.join(d, name), where), req
    return None


def _host_training(result: dict, allocates: bool) -> str:
    """What says the run trained a model kept on the host: "" where a model ran on the device, or
    where none was seen on the host and the GPU was used (``result``'s device_models / host_models,
    bootstrap.py; ``allocates``: anything was allocated on the GPU)."""
    if result.get("device_models") or (not result.get("host_models") and allocates):
        return ""
    name = f"the model ({', '.join(result['host_models'])})" if result.get("host_models") else "the model"
    steps = result.get("steps") or result.get("host_steps") or 0
    return (f"{name} ran {steps} training steps ({result.get('stopped_by', 'optimizer steps')}) "
            "with its weights on the host")


def _no_gpu(cmd: TrainCommand, what: str, log: str = "") -> EstimateError:
    """The refusal of a script that trains on the host and puts nothing on the GPU (``what`` says so)."""
    return EstimateError(f"{cmd.display}: the script does not use the GPU: {what}, and nothing was allocated on the "
                         f"GPU; a GPU given to this job would sit idle{log}",
                         "if it should train on the GPU, move the model and each batch there (model.to('cuda'), "
                         "x.to('cuda')); else submit it without --gres/--gpus, to a CPU partition", kind="no-gpu")


# What a library or torch says when a script asks for more GPUs than the node has: Lightning's
# device parser ("You requested gpu: [0, 1] / But your machine only has: [0]"), CUDA's
# cudaErrorInvalidDevice ("invalid device ordinal"), torch's device guard ("Invalid device id")
_TOO_FEW_GPUS = re.compile(r"requested gpu|machine only has|invalid device ordinal|invalid device id", re.IGNORECASE)


def _raise_for_status(cmd: TrainCommand, result: dict, log_path: str | None, cwd: str | None = None,
                      python: str = sys.executable, theirs: str | None = None, why_not: str = "",
                      gpus: int = 1) -> None:
    status = result.get("status")
    if status == "ok":
        return
    where = result.get("where")
    at = f" at {where}" if where else ""
    line = f"\n  {where}: {result['line']}" if where and result.get("line") else ""
    log = f"\n  the run's output is kept in {log_path}" if log_path else ""
    msg = result.get("message", "")
    api = result.get("api")
    tail = _tail(log_path) if log_path else ""
    if status == "no-step" and result.get("func_transform"):
        raise EstimateError(f"{cmd.display}: vest cannot yet run this script with fake CUDA: its model ran under "
                            f"torch.func transforms (grad, vjp, vmap) and its weights were updated functionally, which "
                            f"vest does not count as training steps ({result.get('steps', 0)} steps traced){log}",
                            "this is vest-slurm's limit, not the script's; meanwhile " + _WORKAROUND,
                            kind="vest-unsupported", where=where)
    if status == "no-step" and result.get("host_models") and not result.get("device_models") and \
            not any(e[0] == "a" for e in result.get("events") or ()):
        # a model kept on the host ran (and maybe a backward) but nothing reached the GPU; where it
        # trained, vest followed it for a later move to the GPU (standins.HOST_STEPS)
        what = (_host_training(result, False) + " and did not move to the GPU in them" if result.get("host_steps")
                else f"the model ({', '.join(result['host_models'])}) ran with its weights on the host")
        raise _no_gpu(cmd, what, log)
    if status == "no-step" and result.get("processes_started"):
        started = ", ".join(dict.fromkeys(result["processes_started"]))
        raise EstimateError(f"{cmd.display}: vest cannot yet run this script with fake CUDA: it started processes of "
                            f"its own with multiprocessing ({started}) and trained no step in its own process: where "
                            "those processes train (one per GPU, as I-JEPA's launcher does), they run without vest's "
                            f"fake GPU, and the dynamic estimate traces the script's process only{log}",
                            "this is vest-slurm's limit, not the script's; where the script has a way to train in its "
                            "own process (one device, no launcher), estimate that; else " + _WORKAROUND,
                            kind="vest-unsupported", where=where)
    branches = [r["where"] for r in result.get("reads", ()) if r.get("kind") == "bool" and r.get("where")]
    if status == "no-step" and branches and any(e[3] == "backward" for e in result.get("events") or ()):
        # backward passes, then a branch on a GPU value before any update: a skip-if-not-finite
        # check (Keras' loss scaling on torch, a hand-written one) its stand-in did not pass
        raise EstimateError(f"{cmd.display}: its backward passes ran, but no optimizer step or parameter update "
                            f"followed: a value of a GPU tensor decided a branch at {branches[-1]}, and the value "
                            f"here is a stand-in (vest has no data), which took the way without the update "
                            f"({result.get('steps', 0)} steps traced){log}",
                            "this is vest-slurm's limit, not the script's; meanwhile " + _WORKAROUND,
                            kind="data-dependent", where=branches[-1])
    read = [r["where"] for r in result.get("reads", ()) if r.get("where")]
    if status == "no-step" and read and result.get("device_models") and result.get("forwards_under_grad"):
        # the model ran on the GPU under grad, values of its tensors were read, and no training
        # followed: a branch on a stand-in may have skipped it (FGSM's loop trains on the samples
        # it predicts right); an evaluation under no_grad reading its accuracy is not said so
        raise EstimateError(f"{cmd.display}: the model ran on the GPU but no training step followed, and the script "
                            f"read values of GPU tensors ({', '.join(dict.fromkeys(read[-3:]))}), stand-ins here (vest has "
                            f"no data): a branch on one may have skipped the training (a sample skipped when the "
                            f"prediction is wrong), which a GPU run, with real values, takes{log}",
                            "this is vest-slurm's limit where the script trains on a GPU; meanwhile " + _WORKAROUND,
                            kind="data-dependent", where=read[-1])
    if status == "no-step":
        raise EstimateError(f"{cmd.display} ended without a training step ({result.get('steps', 0)} steps traced): no "
                            f"optimizer.step(), no backward pass followed by parameter updates, no forward pass under grad{log}",
                            "check that the script's arguments start training (not only evaluation)",
                            kind="script-error", where=where)
    if status == "data-dependent" and result.get("loop_never_ended"):
        raise EstimateError(f"{cmd.display}: data-dependent: {msg}{line}{log}",
                            "a loop whose length the GPU's values decide (an adaptive ODE solver, a convergence test) "
                            "cannot run on stand-ins: give it a fixed count for the estimate if the script takes one "
                            "(a fixed-step solver, an iteration cap), or request the GPU yourself (sbatch --gres) and "
                            "let `vest monitor` measure the job's peak; else " + _WORKAROUND,
                            kind="data-dependent", where=where)
    if status == "data-dependent":
        raise EstimateError(f"{cmd.display}: data-dependent: the estimate depends on values a fake tensor does not "
                            f"have{at}: {msg}{line}{log}",
                            "shapes that follow tensor values (nonzero, boolean masks, lengths read with .item()) "
                            "cannot be traced without the data. Where the model itself makes such shapes (a "
                            "detector's proposals, NMS and matches), no #VEST line describes it either: request the "
                            "GPU yourself (sbatch --gres) and let `vest monitor` measure the job's peak; else "
                            + _WORKAROUND,
                            kind="data-dependent", where=where)
    if status == "refused" and result.get("hub"):
        repo = result.get("hub_repo")
        # (transformers' attn_implementation="flash_attention_2" without flash-attn installed: it
        # falls back to the Hub's kernel, whose failure is chained under the ImportError shown)
        package = "ImportError" in msg and "install" in msg.lower()
        raise EstimateError(f"{cmd.display}: the script needs a file from the Hugging Face Hub that is not in your "
                            f"cache{f' ({repo})' if repo else ''}{at}, and the estimate runs offline: {msg}{line}{log}",
                            f"fetch it once where the network is (e.g. `hf download {repo or 'REPO'}` on the login node, "
                            "into the cache the job uses: HF_HUB_CACHE or HF_HOME), then estimate again; "
                            + ("or install the package the error names into the job's Python; " if package else "")
                            + "or " + _WORKAROUND, kind="limit", where=where)
    cache = os.path.join(_model_caches(dict(os.environ))["TORCH_HOME"], "hub")
    download = result.get("hub_download")
    if status == "refused" and download and not os.path.abspath(download[1]).startswith(cache + os.sep):
        url, dst = download
        raise EstimateError(f"{cmd.display}: the script downloads {url} to {dst}{at}, and the estimate runs offline: "
                            f"{msg}{line}{log}",
                            f"fetch it once where the network is, to where the script looks for it (e.g. `python -c "
                            f"\"import torch.hub; torch.hub.download_url_to_file('{url}', '{dst}')\"` on the login "
                            "node), then estimate again; or " + _WORKAROUND, kind="limit", where=where)
    if status == "refused" and result.get("torch_hub"):
        raise EstimateError(f"{cmd.display}: the script fetches weights or code through torch.hub that are not in "
                            f"your cache ({cache}){at}, and the estimate runs offline: {msg}{line}{log}",
                            "fetch them once where the network is (run that line once on the login node, e.g. "
                            "`python -c \"import torchvision; torchvision.models.resnet50(weights='DEFAULT')\"`, with "
                            "the TORCH_HOME the job uses), then estimate again; or " + _WORKAROUND,
                            kind="limit", where=where)
    if status == "refused":
        raise EstimateError(f"{cmd.display}: {msg}{line}{log}",
                            "estimates run offline and in one process: make network access and subprocesses optional "
                            "(e.g. behind a flag), or " + _WORKAROUND, kind="limit", where=where)
    if status == "memory":
        raise EstimateError(f"{cmd.display}: ran out of host memory{at}: {msg}{log}",
                            "the site's memory limit for estimates was hit", kind="limit", where=where)
    if status == "script-exit":
        raise EstimateError(f"{msg} before its first training step\n{tail}{log}",
                            "run the script directly: it fails by itself (arguments, missing files)",
                            kind="script-error", where=where)
    if status == "missing-import":
        miss = result.get("missing") or {}
        ran_theirs = python != sys.executable   # the job's own Python: the job fails the same way
        who = f"the job's Python ({python})" if ran_theirs else f"the Python that ran it ({python})"
        other = theirs if not ran_theirs else None   # the job's own, which did not run the script
        if other:
            env_fix = (f"the command runs another Python ({other}{', which ' + why_not if why_not else ''}): "
                       "install vest-slurm there and run vest from it, so that the estimate imports what the job imports")
        else:
            env_fix = ("install vest-slurm into the environment the job activates (venv, conda, module) and run vest "
                       "from there, so that the estimate imports what the job imports")
        if miss.get("pinned"):
            pkg, version = miss["package"], miss.get("version")
            what = (f"the script checks the version of {pkg}{at} (`{miss['pinned']}`), and {pkg} "
                    f"{version or '(version unknown)'} in {who} is not the one it asks for")
            fix = ((f"install the {pkg} it was written for into the job's environment" if ran_theirs
                    else f"run the estimate with the {pkg} the job uses ({env_fix})") +
                   "; the job fails the same way in an environment like this one")
        elif miss.get("condition"):
            pkg, version, needs = miss["package"], miss.get("version"), miss.get("needs")
            what = (f"the script imports {miss['symbol']!r} from {miss['module']}{at}, which {pkg} "
                    f"{version or '(version unknown)'} in {who} exports only under a condition "
                    f"(`{miss['condition']}`, {miss['where']}): " +
                    (f"{needs}, which it needs for that, is not installed there" if needs else
                     "an optional dependency it needs for that is missing there"))
            need = needs or "the package that condition needs"
            fix = ((f"install {need} into the job's environment" if ran_theirs
                    else f"install {need} beside {pkg} ({env_fix})") +
                   "; the job fails the same way in an environment without it")
        elif miss.get("package"):
            pkg, version = miss["package"], miss.get("version")
            pin = requirement_pin(pkg, cmd, cwd)
            imported = f"{miss['symbol']!r} from {miss['module']}" if miss.get("symbol") else miss["module"]
            what = (f"the script imports {imported}{at}, which {pkg} {version or '(version unknown)'} in {who} does "
                    "not have" + (f"; {pin[0]} asks for {pin[1]}" if pin else ""))
            fix = (f"make the script work with {pkg} {version}, or " +
                   (f"install the {pkg} it was written for into the job's environment" if ran_theirs
                    else f"run the estimate with the {pkg} the job uses ({env_fix})") +
                   "; the job fails the same way in an environment like this one")
        else:
            what = f"the script imports {miss.get('module')!r}{at}, which {who} does not have"
            fix = ("install the package that provides it into the job's environment; the job fails the same way "
                   "without it" if ran_theirs else
                   f"{env_fix}, or install the package that provides it into {python}" if other else
                   f"install the package that provides it into that Python (pip install ...), or {env_fix}; the job "
                   "fails the same way in an environment without it")
        raise EstimateError(f"{cmd.display}: {what}{line}{log}", fix, kind="script-error", where=where)
    if status == "vest-unsupported" and result.get("custom_kernel"):
        raise EstimateError(f"{cmd.display}: vest cannot run custom CUDA kernels (at {api}){at}: {msg}{line}{log}",
                            "a limit of estimating on a CPU, not a fault of the script: describe the workload with a "
                            "#VEST line where the model can be built without its own kernels (e.g. #VEST --model "
                            "train.py:Generator --batch-size 16 ...), or request the GPU yourself (sbatch --gres) and "
                            "let `vest monitor` measure the job's peak", kind="vest-unsupported", where=where)
    if status == "vest-unsupported":
        named = f" (at {api})" if api else ""
        raise EstimateError(f"{cmd.display}: vest cannot yet run this script with fake CUDA{named}{at}: {msg}{line}{log}",
                            "this is a gap in vest-slurm, not in the script (it would run on a GPU): report it with "
                            "the kept log; meanwhile " + _WORKAROUND, kind="vest-unsupported", where=where)
    if status == "internal":
        raise EstimateError(f"{cmd.display}: the estimator failed: {msg}{log}",
                            "this is a bug in vest-slurm; report it with the script; meanwhile " + _WORKAROUND,
                            kind="vest-unsupported", where=where)
    if status == "script-error" and _TOO_FEW_GPUS.search(msg):
        raise EstimateError(f"{cmd.display}: the script asks for more GPUs than the {gpus} it ran with here "
                            f"(torch.cuda.device_count() answered {gpus}, the estimate's GPUs per node){at}: {msg}{line}{log}",
                            "give the estimate the job's GPU count (vest estimate --num-gpus N; in a job script, "
                            "#SBATCH --gres=gpu:N or --gpus-per-node); a job given fewer GPUs than the script asks "
                            "for fails the same way", kind="script-error", where=where)
    if result.get("on_a_gpu"):
        raise EstimateError(f"{cmd.display}: the script fails on a GPU too{at}: {msg}{line}{log}",
                            "fix the script: this is torch's own check, which fails the same way on the job's GPU "
                            "(vest's stand-in makes it here, where the script cannot run without a GPU); the estimate "
                            "runs the script unchanged", kind="script-error", where=where)
    raise EstimateError(f"{cmd.display}: the script failed{at}: {msg}{line}{log}",
                        "fix the script (run it directly to see the error); the estimate runs it unchanged",
                        kind="script-error", where=where)


def script_spec(cmd: TrainCommand, run: "DynamicRun", num_gpus: int, alloc_conf: str):
    """The WorkloadSpec that stands for a script in reports and placement (its trace is the script's)."""
    from ..estimate.workload import WorkloadSpec

    if run.spec is not None:   # the run's flags with the sharded or TP spec's own
        return run.spec.with_(alloc_conf=alloc_conf, flags=tuple(dict.fromkeys(run.spec.flags + run.flags)))
    seen = dict(run.observed)
    optimizer, impl, weight_decay = _script_optimizer(seen.get("optimizer"), run.stopped_by)
    return WorkloadSpec(model=f"script: {cmd.display}", batch_size=run.batch_hint or 1, num_gpus=num_gpus,
                        optimizer=optimizer, optimizer_impl=impl, weight_decay=weight_decay,
                        parallelism="ddp", alloc_conf=alloc_conf, steps=run.steps,
                        precision=seen.get("precision") or "fp32", channels_last=bool(seen.get("channels_last")),
                        cudnn_benchmark="on" if seen.get("cudnn_benchmark") else "off",
                        zero_grad=seen.get("zero_grad") or "after-step", grad_accum=int(seen.get("grad_accum") or 1),
                        gradient_checkpointing=seen.get("gradient_checkpointing") or "off", flags=run.flags)


def _script_optimizer(opt: dict | None, stopped_by: str) -> tuple[str, str, float | None]:
    """(optimizer, optimizer_impl, weight_decay) of the workload block: the script's first optimizer
    stepped, by vest's name where it has one (--optimizer's), else its class; without one, how the
    run's steps were made."""
    from ..estimate.workload import optimizer_name

    if not opt:
        return f"none ({stopped_by})" if stopped_by != "optimizer steps" else "none", "auto", None
    impl = "fused" if opt.get("fused") else ("for-loop" if opt.get("foreach") is False else "auto")
    return optimizer_name(opt) or f"{opt['module']}.{opt['class']}", impl, opt.get("weight_decay")


_TIME_UP_GRACE_S = 20.0   # how long a run told its time is up has to write what it traced


def _tell_time_is_up(pids) -> bool:
    """Send the run (the bootstrap's Python, under bubblewrap a grandchild) the time-limit signal:
    with a training step traced it ends there and writes its result (bootstrap.at_the_time_limit);
    without one it goes on until killed. Whether it was found."""
    from .bootstrap import TIME_LIMIT_SIGNAL

    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"vest_slurm.dynamic.bootstrap" in argv and not argv[0].endswith(b"bwrap"):
            try:
                os.kill(pid, TIME_LIMIT_SIGNAL)
                return True
            except OSError:
                return False
    return False


def _tuples(x):
    """JSON's lists back into the tuples the trace records (None stays None)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


class Relaunched(Exception):
    """The script started a training launcher itself (errors.Relaunch in its run): ``cmd`` is that
    launch, as the job would run it (its arguments, the script's working directory and the variables
    it set), and ``note`` says so."""

    def __init__(self, parent: TrainCommand, launch: dict):
        from .launch import parse_train_command

        env = tuple((k, v) for k, v in parent.env) + tuple((k, v) for k, v in launch["env"])
        cmd = parse_train_command(launch["argv"])
        self.cmd = replace(cmd, env=tuple(dict(env + cmd.env).items()), chdir=launch["cwd"])
        self.note = (f"{parent.display} started its training as {' '.join(launch['argv'])} (in {launch['cwd']}): "
                     "this estimate is that launch's")
        super().__init__(self.note)


# launches one command may start in turn (a CLI that runs a launcher that runs torchrun)
MAX_RELAUNCHES = 3


def trace_command(cmd: TrainCommand, profiles, num_gpus: int | None = None, limits: Limits = Limits(),
                  cwd: str | None = None, alloc_conf: str | None = None):
    """trace_command of the command, or of the training launch it starts itself (Relaunched: ``tune
    run --nproc_per_node 2 recipe``, a CLI that runs torchrun in a child process), with a flag that
    says so."""
    said: tuple[str, ...] = ()
    for _ in range(MAX_RELAUNCHES + 1):
        try:
            spec, summaries, run = _trace_command(cmd, profiles, num_gpus, limits, cwd, alloc_conf)
        except Relaunched as r:
            cmd, said = r.cmd, said + (r.note,)
            continue
        if said:
            run = replace(run, flags=said + run.flags)
            spec = spec.with_(flags=tuple(dict.fromkeys(said + spec.flags)))
        return spec, summaries, run
    raise EstimateError(f"{cmd.display}: the command started a training launcher {MAX_RELAUNCHES + 1} times in turn ("
                        f"{'; '.join(said)})", "give the job's training command itself (its torchrun or python line)",
                        kind="vest-unsupported")


def _trace_command(cmd: TrainCommand, profiles, num_gpus: int | None = None, limits: Limits = Limits(),
                   cwd: str | None = None, alloc_conf: str | None = None):
    """Run the script once per capability class of ``profiles``: (spec, {class: TraceSummary or
    EstimateError}, run). A script can fail on one class only (one that checks for native bf16 or a GPU of sm80+); it is an
    error only when it fails on every class. A class whose GPUs answer every GPU-dependent question
    the run asked alike (trace.holds_on: the capability, bf16 support, cuDNN's bf16 convolutions;
    never where it read the device's name or properties, or took an attention kernel) takes that
    run's trace: the script, given the same answers, makes the same run."""
    from ..estimate.estimator import gpu_class, summarize
    from ..estimate.trace import holds_on

    from ..estimate import cudnn_ws

    cwd = cmd.workdir(cwd)   # where the job script's `cd` lines took it
    gpus = num_gpus or (cmd.world if cmd.world > 0 else max(cmd.nproc, 1))
    # the cuDNN of the Python the job runs (a venv's, another torch), not this process's (item 2 of
    # issue 25): the trace runs here, the job's convolutions run on that cuDNN's engines
    cudnn_ws.use_job_python(cmd.program, cmd.path, cwd)
    from ..estimate.sharding import use_job_torch   # and its torch, for the FSDP schedule it runs

    use_job_torch(cmd.program, cmd.path, cwd)
    conf = alloc_conf if alloc_conf is not None else dict(cmd.env).get(
        "PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    summaries, first, gpu_class_of_first = {}, None, None
    later: list[tuple[list, DynamicRun]] = []   # the other classes' runs: their flags are said too
    # a script that sizes itself to the GPU meets the smallest room of each class first: if it never
    # runs out there, it does not on the others either, and one run holds for the class
    sizes_itself = catches_oom(cmd, cwd)
    # newest GPU class first: a script that needs sm80+ is traced where it runs
    for p in sorted(profiles, key=lambda p: p.capability, reverse=True):
        cls = gpu_class(p)
        if cls in summaries:
            continue
        same_class = [q for q in profiles if gpu_class(q) == cls]
        # (a script that catches out-of-memory runs per class: on a smaller GPU it may run out where
        # the first class's run did not, and settle on another batch)
        if first is not None and holds_on(first.trace, p.capability) and not first.sized_to_gpu and not sizes_itself:
            summaries[cls] = summaries[gpu_class_of_first]
            continue
        room = min(q.tensor_room_bytes for q in same_class) if sizes_itself else 0
        try:
            run = run_dynamic(cmd, p, gpus, limits, cwd, room)
        except EstimateError as e:
            summaries[cls] = e
            continue
        summaries[cls] = summarize(run.trace, run.seconds)
        if run.sized_to_gpu:   # its run depends on the GPU's memory: one per room for tensors in this class
            summaries[cls] = _sized_to_gpu(summaries[cls], room, same_class,
                                           lambda q: run_dynamic(cmd, q, gpus, limits, cwd, q.tensor_room_bytes))
        if first is None:
            first, gpu_class_of_first = run, cls
        else:
            later.append((same_class, run))
    if first is None:
        raise next(iter(summaries.values()))
    # what only another class's run met (a batch-size finder that ran out of memory on the smaller
    # GPU), said with the GPU types it holds for
    extra = tuple(f"on {', '.join(q.key for q in types)}: {f}" for types, r in later for f in r.flags
                  if f not in first.flags)
    if extra:
        first = replace(first, flags=first.flags + extra)
    if not num_gpus and cmd.world < 0:   # the launch's size is the job's ($SLURM_NNODES), not known here
        note = (f"{cmd.launcher}'s processes are the job's (--nnodes {'?' if cmd.nnodes < 0 else cmd.nnodes}, "
                f"--nproc_per_node {'?' if cmd.nproc < 0 else cmd.nproc}): estimated as {gpus} GPU(s); give --num-gpus "
                "with the job's total (vsbatch and vest check take it from the job's #SBATCH request)")
        first = replace(first, flags=first.flags + (note,))
        first = replace(first, spec=script_spec(cmd, first, gpus, conf) if first.spec is not None else None)
    return script_spec(cmd, first, gpus, conf), summaries, first


def _sized_to_gpu(first, room: int, same_class, run):
    """SizedToGpu of a script that caught CUDA out-of-memory with ``room`` for tensors: ``first``
    (its summary) and a run on each other room of the GPU types of ``same_class``."""
    from ..estimate.estimator import SizedToGpu, summarize

    by_room = {room: first}
    for q in same_class:
        if q.tensor_room_bytes not in by_room:
            try:
                r = run(q)
            except EstimateError:   # that type's estimate is the smallest room's run, which errs high there
                continue
            by_room[q.tensor_room_bytes] = summarize(r.trace, r.seconds)
    fields = {f: getattr(first, f) for f in first.__dataclass_fields__}
    return SizedToGpu(**fields, by_room=tuple(by_room.items()))


def estimate_command(cmd: TrainCommand, profiles, num_gpus: int | None = None, limits: Limits = Limits(),
                     cwd: str | None = None, alloc_conf: str | None = None):
    """MemoryEstimates of a training command for the profiles it runs on, and the run behind them.
    Raises EstimateError when it runs on none of them."""
    from ..estimate.estimator import estimates_for

    spec, summaries, run = trace_command(cmd, profiles, num_gpus, limits, cwd, alloc_conf)
    return estimates_for(spec, summaries, {p.key: p for p in profiles})[0], run


def forward_only_note(result: dict) -> str | None:
    """The flag for a run traced on forward passes alone (no backward, no optimizer step) in which
    the script read values of GPU tensors (stand-ins here), or None: a branch on one may be what
    skipped the backward (FGSM's loop skips a sample whose prediction is wrong), which a GPU run,
    with real values, takes; the estimate then lacks the gradients and the backward's peak."""
    if not str(result.get("stopped_by", "")).startswith("forward passes"):
        return None
    reads = list(dict.fromkeys(f"{r['kind']} at {r['where']}" for r in result.get("reads", ()) if r.get("where")))
    if not reads:
        return None
    more = f" and {len(reads) - 3} more" if len(reads) > 3 else ""
    return (f"the steps traced are forward passes without a backward, and the script read values of GPU tensors "
            f"({', '.join(reads[:3])}{more}), stand-ins here (vest has no data): if a branch on one skipped the "
            "backward (a sample skipped when the prediction is wrong, a loss over a threshold), a GPU run with real "
            "values trains, and needs the gradients and the backward's memory this estimate lacks")


def steered_loop_note(result: dict) -> str | None:
    """The flag for a loop of training forwards whose test read a stand-in (standins.note_read):
    the same number of forwards in every traced step, but a number the stand-ins chose (a
    fixed-point iteration run once or to its cap, not the 15 times it converges in on a GPU)."""
    where = result.get("steered_loop")
    if not where:
        return None
    counts = result.get("forwards_per_step") or []
    ran = f" ({counts[-1]} forward pass{'es' if counts[-1] != 1 else ''} in the last traced step)" if counts else ""
    return (f"a loop of the model's forward passes is tested on values of GPU tensors at {where}, "
            f"stand-ins here (vest has no data), so they decided how many times it ran{ran}: the job's loop runs as many "
            "times as its values take (a convergence test, an adaptive solver's accepted steps, a sampler's "
            "accept/reject), and each forward kept until the backward adds its activations; the estimate is for "
            "the iterations traced, not the job's (give the loop a fixed count for the estimate, if the script "
            "takes one)")


def forwards_note(result: dict) -> str | None:
    """The flag for training steps that ran different numbers of forward passes while the script
    read values of GPU tensors (stand-ins here), or None: an episode run until it ends, a sequence
    sampled until a stop token, keep one forward's activations each until the step's backward, and
    what ends them is a value the GPU decides. Compared between the steps of one optimizer (a GAN's
    two steps run different forwards)."""
    counts, owners, reads = result.get("forwards_per_step") or [], result.get("step_owners") or [], result.get("reads") or []
    steered = result.get("steered_steps") or []
    if len(owners) == len(counts) and owners:
        counts = [c for c, o in zip(counts, owners) if o == owners[-1]]
    # a loop steered by what it reads: forward, read, forward, read, forward before the step's
    # backward (not one sample drawn and saved every N steps, nor a read for the log after a backward)
    if len(set(counts)) < 2 or not reads or not any(n >= 2 for n in steered):
        return None
    return (f"the traced training steps ran different numbers of forward passes ({', '.join(map(str, counts))}) "
            f"after the script read values of GPU tensors (stand-ins here, first at {reads[0]['where']}): where such "
            "values decide how many forwards a step keeps until its backward (an episode run until it ends, a "
            "sequence sampled until a stop token), the job's steps may run many more and need more memory than "
            "estimated here: allow for the longest step the job runs (each forward kept adds its activations)")
