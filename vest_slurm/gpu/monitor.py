"""`vest monitor`: a job's peak GPU memory for sites without gres/gpumem accounting, written where
`vest audit --measured FILE` reads it (one CSV line ``job_id,peak_mib,gpu_type`` per job).

In: the job's id and GPUs (Slurm's SLURM_JOB_ID and SLURM_JOB_GPUS in prolog/epilog, or
CUDA_VISIBLE_DEVICES / SLURM_STEP_GPUS in a task), NVML through pynvml. Out: the line appended to
``--out`` (default $VEST_MONITOR_FILE, else /var/lib/vest/peaks.csv), exit codes below.

Three ways to run it:
- ``vest monitor run -- python train.py ...`` (a task wrapper, e.g. ``srun vest monitor run -- ...``):
  runs the command, samples while it runs, writes the line at its end; exits with its exit code.
- ``vest monitor prolog`` / ``vest monitor epilog`` (slurm.conf ``Prolog=`` / ``Epilog=`` scripts
  that call them; they run as root on the node with the job's SLURM_JOB_ID and SLURM_JOB_GPUS):
  prolog starts a detached sampler for the job, epilog stops it and it writes the line.
- ``vest monitor sample --job-id ID --gpus 0,1 --until-file F``: the sampler itself.

What it measures: NVML's ``used`` memory of each of the job's GPUs (nvmlDeviceGetMemoryInfo), the
device-level figure nvidia-smi shows (CUDA context, libraries, the caching allocator's reserve) and
the one vest's ``peak`` estimates; the job's peak is the largest over its GPUs and samples. GPUs
must be the job's alone (Slurm's gres binding): on a shared GPU another job's memory counts too.
Sampling every ``--interval`` seconds (default 0.5) can miss a spike shorter than that, as every
polling monitor can (nvidia-smi, Jobstats' exporter).

Without NVML (pynvml not installed, or no NVIDIA driver): it says so on stderr and exits 0; `run`
still runs the command (and returns its exit code), nothing is written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

MiB = 1 << 20
DEFAULT_OUT = "/var/lib/vest/peaks.csv"
DEFAULT_STATE_DIR = "/run/vest-monitor"
INTERVAL_S = 0.5


@dataclass(frozen=True)
class Peak:
    job_id: str
    peak_bytes: int
    gpu_type: str
    samples: int


class NoNvml(Exception):
    """NVML cannot be used here; the message says why."""


def open_nvml():
    """The pynvml module, initialised; NoNvml when it cannot be."""
    try:
        import pynvml
    except ImportError:
        raise NoNvml("pynvml is not installed (pip install nvidia-ml-py)") from None
    try:
        pynvml.nvmlInit()
    except Exception as e:   # pynvml.NVMLError_LibraryNotFound / DriverNotLoaded / ...
        raise NoNvml(f"NVML does not start here ({type(e).__name__}: {e}): no NVIDIA driver on this machine?") from None
    return pynvml


def job_gpus(env) -> list[int]:
    """The job's GPU indices as NVML numbers them: SLURM_JOB_GPUS (prolog/epilog: physical
    indices), else SLURM_STEP_GPUS, else CUDA_VISIBLE_DEVICES (a task: the indices Slurm bound)."""
    for key in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"):
        v = env.get(key, "").strip()
        if v:
            return [int(x) for x in v.split(",") if x.strip().isdigit()]
    return []


def nvml_reader(nvml, gpus: Sequence[int]) -> tuple[Callable[[], int], str]:
    """(a function giving the largest used memory over ``gpus`` now, the GPUs' name)."""
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in gpus]
    name = nvml.nvmlDeviceGetName(handles[0]) if handles else ""
    name = name.decode() if isinstance(name, bytes) else name
    return (lambda: max(nvml.nvmlDeviceGetMemoryInfo(h).used for h in handles)), name


def gpu_type_of(device_name: str) -> str:
    """The built-in profile's key for an NVML device name ("" when none), for the CSV's gpu_type."""
    from ..estimate.profiles import profile_for_device_name

    p = profile_for_device_name(device_name)
    return p.key if p is not None else ""


def sample(read: Callable[[], int], running: Callable[[], bool], interval_s: float = INTERVAL_S,
           sleep=time.sleep) -> tuple[int, int]:
    """(peak bytes, samples): ``read()`` every ``interval_s`` while ``running()``, once more at the end."""
    peak, n = 0, 0
    while True:
        alive = running()
        peak, n = max(peak, read()), n + 1
        if not alive:
            return peak, n
        sleep(interval_s)


def write_line(path: str, p: Peak) -> None:
    """Append ``job_id,peak_mib,gpu_type`` (one write: lines of concurrent jobs do not interleave)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    line = f"{p.job_id},{p.peak_bytes / MiB:.0f},{p.gpu_type}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- commands

def add_monitor_parser(sub) -> None:
    p = sub.add_parser("monitor", help="sample a job's GPU memory with NVML for vest audit (sites without gpumem accounting)",
                       description=__doc__.split("\n\n")[0])
    msub = p.add_subparsers(dest="monitor_cmd", metavar="MODE", required=True)
    common = dict(out=os.environ.get("VEST_MONITOR_FILE", DEFAULT_OUT))
    r = msub.add_parser("run", help="run a command and record its GPUs' peak memory")
    r.add_argument("argv", nargs="+", metavar="-- COMMAND")
    for q in (r,):
        q.add_argument("--out", default=common["out"], help=f"CSV to append to (default $VEST_MONITOR_FILE, else {DEFAULT_OUT})")
        q.add_argument("--interval", type=float, default=INTERVAL_S, help="seconds between samples")
    r.set_defaults(func=cmd_run)
    for mode, helptext in (("prolog", "start a sampler for $SLURM_JOB_ID on $SLURM_JOB_GPUS (slurm.conf Prolog)"),
                           ("epilog", "stop the job's sampler; it writes the job's line (slurm.conf Epilog)")):
        q = msub.add_parser(mode, help=helptext)
        q.add_argument("--out", default=common["out"])
        q.add_argument("--interval", type=float, default=INTERVAL_S)
        q.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help=f"where samplers keep their pid (default {DEFAULT_STATE_DIR})")
        q.set_defaults(func=cmd_prolog if mode == "prolog" else cmd_epilog)
    s = msub.add_parser("sample", help="the sampler (started by prolog)")
    s.add_argument("--job-id", required=True)
    s.add_argument("--gpus", required=True)
    s.add_argument("--out", default=common["out"])
    s.add_argument("--interval", type=float, default=INTERVAL_S)
    s.add_argument("--until-file", required=True, help="sample until this file exists")
    s.set_defaults(func=cmd_sample)


def _no_nvml(e: NoNvml) -> None:
    print(f"vest monitor: {e}; no GPU memory is sampled", file=sys.stderr)


def cmd_run(ns) -> int:
    argv = ns.argv[1:] if ns.argv and ns.argv[0] == "--" else ns.argv
    job_id = os.environ.get("SLURM_JOB_ID", "")
    try:
        nvml = open_nvml()
    except NoNvml as e:
        _no_nvml(e)
        return subprocess.call(argv)
    gpus = job_gpus(os.environ) or list(range(nvml.nvmlDeviceGetCount()))
    read, name = nvml_reader(nvml, gpus)
    proc = subprocess.Popen(argv)
    try:
        peak, n = sample(read, lambda: proc.poll() is None, ns.interval)
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        peak, n = sample(read, lambda: proc.poll() is None, ns.interval)
    if job_id:
        write_line(ns.out, Peak(job_id, peak, gpu_type_of(name), n))
    else:
        print(f"vest monitor: peak {peak / MiB:.0f} MiB over {n} samples (no SLURM_JOB_ID: nothing written)",
              file=sys.stderr)
    return proc.returncode


def cmd_sample(ns) -> int:
    try:
        nvml = open_nvml()
    except NoNvml as e:
        _no_nvml(e)
        return 0
    gpus = [int(x) for x in ns.gpus.split(",") if x.strip().isdigit()]
    if not gpus:
        return 0
    read, name = nvml_reader(nvml, gpus)
    peak, n = sample(read, lambda: not os.path.exists(ns.until_file), ns.interval)
    write_line(ns.out, Peak(ns.job_id, peak, gpu_type_of(name), n))
    try:
        os.unlink(ns.until_file)
    except OSError:
        pass
    return 0


def _state(ns, job_id: str) -> tuple[str, str]:
    return os.path.join(ns.state_dir, f"{job_id}.pid"), os.path.join(ns.state_dir, f"{job_id}.stop")


def cmd_prolog(ns) -> int:
    job_id, gpus = os.environ.get("SLURM_JOB_ID", ""), job_gpus(os.environ)
    if not job_id or not gpus:
        return 0      # not a GPU job: nothing to watch
    try:
        open_nvml()
    except NoNvml as e:
        _no_nvml(e)
        return 0      # a prolog that fails drains the node; a missing monitor must not
    os.makedirs(ns.state_dir, exist_ok=True)
    pidfile, stop = _state(ns, job_id)
    p = subprocess.Popen([sys.executable, "-m", "vest_slurm.cli", "monitor", "sample", "--job-id", job_id,
                          "--gpus", ",".join(map(str, gpus)), "--out", ns.out, "--interval", str(ns.interval),
                          "--until-file", stop],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    with open(pidfile, "w") as f:
        f.write(f"{p.pid}\n")
    return 0


def cmd_epilog(ns, wait_s: float = 10.0) -> int:
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not job_id:
        return 0
    pidfile, stop = _state(ns, job_id)
    if not os.path.exists(pidfile):
        return 0
    open(stop, "w").close()          # the sampler takes a last sample, writes its line, removes this
    deadline = time.monotonic() + wait_s
    while os.path.exists(stop) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.unlink(pidfile)
    return 0
