"""cuDNN convolution workspaces, asked of cuDNN itself on a machine without a GPU.

What PyTorch does (aten/src/ATen/native/cudnn/Conv_v8.cpp, torch.backends.cudnn.benchmark off,
the default): for each convolution it builds cuDNN's operation graph, takes the engine
configurations of heuristics mode INSTANT (= mode A) in order, drops those with the numerical
note DOWN_CONVERT_INPUTS and, for fp32 while ``torch.backends.cudnn.allow_tf32`` is off (it is on
by default), those with TENSOR_CORE (``filterEngineConfigs``), and runs the first plan that builds. Its
workspace (``plan.getWorkspaceSize()``) is allocated through the caching allocator just before the
kernel and freed after it. On a large GPU that workspace is taken whatever its size (fp32 NCHW
convolutions on tensor cores transpose input and output: twice the activation); when the
allocation fails, PyTorch tries the next plan, down to engines that need little or none.

With ``torch.backends.cudnn.benchmark`` on (get_plans_from_find), the first run of each
convolution shape builds every plan of that list and of cuDNN's fallback list, allocates one
workspace as large as the largest of them, times every plan in it, frees it, and runs the
fastest plan. The tracer marks that timing workspace (``cudnn_find``); its size here is the
largest over those plans. Which plan wins the timing is not knowable without the GPU: the
workspace of the runs that follow stays that of the heuristics' first plan.

Since cuDNN 9.8 a plan can be built without a device from a device-properties descriptor
(cuDNN's "deviceless ahead-of-time compilation"). This module builds that descriptor for each GPU
profile from the board's published properties, asks cuDNN's heuristics for the same convolution
graph (forward, backward-data, backward-filter) with the shapes, strides, dtype and layout the
trace recorded, builds the first plan after PyTorch's filter and reads its workspace size. It
needs the cuDNN that the installed torch ships (nvidia-cudnn-cu*) and its Python frontend
(nvidia-cudnn-frontend); without them the workspaces stay unmodelled (size 0) and the estimate
says so.

Heuristics are those of the installed cuDNN. Where that is not the job's cuDNN (the job's torch
ships another, one before 9.8 that cannot answer without a GPU, or a CPU build of torch, where it
is unknown; $VEST_JOB_CUDNN names it where the job runs another torch than this one, and a job
whose command runs another Python than this one has that Python's torch asked: use_job_python), placement
takes the largest workspace over the engines cuDNN may pick for each convolution
(heuristics_are_the_jobs, estimator._engines_bound) and the estimate says so; the peak stays the
first plan's.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import re

from .ahead import at_child_end, free_cores as _cores
from .profiles import DeviceProfile

# cudaDeviceProp fields of each board (CUDA deviceQuery / NVIDIA's specifications): what cuDNN's
# heuristics read. Clocks in kHz, sizes in bytes.
_COMMON = {"maxGridSize": [2147483647, 65535, 65535], "maxBlockSize": [1024, 1024, 64], "regsPerBlock": 65536,
           "warpSize": 32, "maxSharedMemoryPerBlock": 49152, "reservedSharedMemoryPerBlock": 1024,
           "maxRegistersPerSM": 65536, "pciDeviceId": 0, "maxThreadsPerBlock": 1024, "isTccDriver": 0,
           "supportCoopLaunch": 1, "driverVer": 13000, "cudaDeviceId": 0}
_BOARDS = {
    # key: the profile key without its memory size; (SM clock, memory clock, L2, shared memory per
    # block (opt-in), threads/SM, blocks/SM); compute capability and SM count come from the profile
    "v100": (1530000, 877000, 6291456, 98304, 2048, 32),
    "t4": (1590000, 5001000, 4194304, 65536, 1024, 16),
    "a100": (1410000, 1215000, 41943040, 166912, 2048, 32),
    "a30": (1440000, 1215000, 25165824, 166912, 2048, 32),
    "h100": (1980000, 2619000, 52428800, 232448, 2048, 32),
    "h100-pcie": (1755000, 1593000, 52428800, 232448, 2048, 32),
    "h100-nvl": (1785000, 2619000, 52428800, 232448, 2048, 32),
    "h200": (1980000, 3201000, 52428800, 232448, 2048, 32),
    "gh200": (1980000, 2619000, 62914560, 232448, 2048, 32),   # 60 MiB L2; HBM3 clock (the 144 GB board's HBM3e is faster)
    "b200": (1965000, 3996000, 132120576, 232448, 2048, 32),
    "l40s": (2520000, 9001000, 100663296, 101376, 1536, 24),
    "l40": (2490000, 9001000, 100663296, 101376, 1536, 24),
    "rtx-6000ada": (2505000, 10001000, 100663296, 101376, 1536, 24),
    "rtx-4090": (2520000, 10501000, 75497472, 101376, 1536, 24),
    "l4": (2040000, 6251000, 50331648, 101376, 1536, 24),
    "a40": (1740000, 7251000, 6291456, 101376, 1536, 16),
    "rtx-a6000": (1800000, 8001000, 6291456, 101376, 1536, 16),
    "rtx-3090": (1695000, 9751000, 6291456, 101376, 1536, 16),
    "a10": (1695000, 6251000, 6291456, 101376, 1536, 16),
}


def _board(profile: DeviceProfile) -> str | None:
    key = profile.key.rsplit("-", 1)[0]
    return key if key in _BOARDS else None


@functools.lru_cache(maxsize=256)   # asked per convolution of a trace, per GPU type
def device_properties_json(profile: DeviceProfile) -> str | None:
    board = _board(profile)
    if board is None:
        return None
    clk, mem, l2, smem, threads, ctas = _BOARDS[board]
    ver = 100 * profile.capability[0] + 10 * profile.capability[1]
    props = dict(_COMMON, deviceVer=ver, multiProcessorCount=profile.sm_count, smClockRateKHz=clk, memClockRateKHz=mem,
                 l2CacheSize=l2, maxSharedMemoryPerBlockOptin=smem, maxThreadsPerSM=threads, maxCtasPerSM=ctas,
                 totalGlobalMem=profile.total_bytes, deviceName=profile.name)
    if ver < 800:
        props["reservedSharedMemoryPerBlock"] = 0
    return json.dumps(props, sort_keys=True)


@functools.lru_cache(maxsize=None)
def _preload_torch_cudnn() -> bool:
    """Load the libcudnn of the nvidia-cudnn wheel that torch ships, by path and RTLD_GLOBAL.

    The frontend finds libcudnn by its own search, relative to the environment it runs in; from a
    venv that sees the system's packages (``--system-site-packages``) that search misses the wheel
    and ``backend_version()`` fails ("Unable to find symbol cudnnGetVersion"), although the library
    is importable. Once loaded, the frontend's dlopen finds it by its soname (the same library torch
    loads; where it is already loaded this is a no-op). No torch import."""
    import ctypes
    import glob

    try:
        import nvidia.cudnn
    except ImportError:
        return False
    for d in nvidia.cudnn.__path__:
        for lib in sorted(glob.glob(os.path.join(d, "lib", "libcudnn.so.*"))):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                return True
            except OSError:
                continue
    return False


def _frontend():
    """The cuDNN Python frontend and the library version, or None where either is missing."""
    os.environ.setdefault("CUDNN_LOGERR_DBG", "0")
    _preload_torch_cudnn()   # before the frontend's first lookup: it keeps a failed one
    try:
        import cudnn
        if cudnn.backend_version() < 90800:
            return None
        return cudnn
    except Exception:   # not installed, or no libcudnn found
        return None


def available() -> bool:
    return _frontend() is not None


def version_text(v: int) -> str:
    """cuDNN's version number as text: 9.x encodes major*10000 + minor*100 + patch (92400 ->
    9.24.0), 8.x major*1000 + minor*100 + patch (8902 -> 8.9.2) (cudnn.h CUDNN_VERSION)."""
    if v >= 90000:
        return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
    return f"{v // 1000}.{v % 1000 // 100}.{v % 100}"


def job_cudnn_version() -> int | None:
    """The cuDNN of the torch this process runs (the user's), None for a CPU build of torch.

    Read without importing torch where the installed files say it unambiguously
    (_cudnn_version_of_installed_torch), so that an estimate read from the trace cache stays
    torch-free; else (and where torch is already imported) torch's own answer."""
    import sys

    if "torch" not in sys.modules:
        known, version = _cudnn_version_of_installed_torch()
        if known:
            return version
    import torch

    if torch.version.cuda is None:
        return None
    try:
        return torch.backends.cudnn.version()
    except Exception:
        return None


def _torch_dir():
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return locations[0] if len(locations) == 1 else None


def _cudnn_version_of_installed_torch() -> tuple[bool, int | None]:
    """(known, version): what ``torch.version.cuda`` and ``torch.backends.cudnn.version()`` answer,
    from the installed files. torch/version.py holds ``cuda`` as a literal (None in a CPU build:
    no cuDNN). A CUDA wheel's libtorch_cuda.so carries an RPATH ``$ORIGIN/../../nvidia/cudnn/lib``
    (searched before LD_LIBRARY_PATH), so the libcudnn it loads is the nvidia-cudnn wheel's beside
    torch, and torch.backends.cudnn.version() is that library's cudnnGetVersion(), asked here by
    ctypes. Not known (torch decides) where the file cannot be read, where LD_PRELOAD names a
    libcudnn (loaded first whatever the RPATH), or where no such wheel sits beside torch (a
    source build or a system cuDNN)."""
    import ast
    import ctypes
    import glob

    d = _torch_dir()
    if d is None:
        return False, None
    try:
        tree = ast.parse(open(os.path.join(d, "version.py"), encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError):
        return False, None
    cuda = "missing"
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else \
            (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "cuda" and node.value is not None:
            try:
                cuda = ast.literal_eval(node.value)
            except ValueError:
                return False, None
    if cuda == "missing":
        return False, None
    if cuda is None:
        return True, None
    if "libcudnn" in os.environ.get("LD_PRELOAD", ""):
        return False, None
    libs = sorted(glob.glob(os.path.join(d, os.pardir, "nvidia", "cudnn", "lib", "libcudnn.so.*")))
    for lib in libs:
        try:
            get = ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL).cudnnGetVersion
        except (OSError, AttributeError):
            continue
        get.restype = ctypes.c_size_t
        return True, int(get())
    return False, None


JOB_CUDNN_ENV = "VEST_JOB_CUDNN"   # the job's cuDNN where the login node's torch is not the job's: 9.1.0, 90100 or "unknown"


def _parse_version(text: str) -> int | None:
    t = text.strip().lower()
    if not t or t == "unknown":
        return None
    if t.isdigit():
        return int(t)
    parts = [int(x) for x in t.split(".")[:3] if x.isdigit()] + [0, 0]
    return parts[0] * 10000 + parts[1] * 100 + parts[2] if parts[0] >= 9 else parts[0] * 1000 + parts[1] * 100 + parts[2]


_JOB_SOURCE: dict[str, str] = {}    # {the $VEST_JOB_CUDNN value use_job_python set: where it comes from}


class JobSetting:
    """An environment variable set for one job's estimate from the job's own Python ($VEST_JOB_CUDNN
    here, $VEST_JOB_TORCH in sharding.py): the site's or the user's own value is kept; the value an
    earlier job of this process set is dropped before the next job's is asked."""

    def __init__(self, name: str):
        self.name, self.mine = name, None

    def clear(self) -> bool:
        """False where the site or the user set it (it stays); else drop this process's earlier value."""
        now = os.environ.get(self.name)
        if now is not None and now != self.mine:
            return False
        if now is not None:
            del os.environ[self.name]
            self.mine = None
        return True

    def set(self, value: str) -> None:
        os.environ[self.name] = self.mine = value


_JOB_CUDNN = JobSetting(JOB_CUDNN_ENV)


def jobs_cudnn() -> tuple[int | None, str]:
    """(the job's cuDNN version or None, where that comes from)."""
    env = os.environ.get(JOB_CUDNN_ENV)
    if env is not None:
        return _parse_version(env), _JOB_SOURCE.get(env, f"${JOB_CUDNN_ENV}")
    return job_cudnn_version(), "this torch"


# ---------------------------------------------------------------- the job's own python

# What the job's interpreter is asked (no GPU needed: cudnnGetVersion only loads the library).
_PROBE = ("import json, sys, torch; c = torch.version.cuda; print(json.dumps([torch.__version__, c, "
          "torch.backends.cudnn.version() if c else None, list(sys.version_info[:2])]))")
PROBE_TIMEOUT_S = 120     # importing a CUDA build of torch reads ~2 GB of libraries; a cold disk is slow


def _interpreter(program: str, path: str | None, cwd: str | None) -> str | None:
    """The Python that runs ``program`` (a python, or a launcher / script whose #! line names one)."""
    import shutil

    exe = program if "/" in program else shutil.which(program, path=path)
    if exe and "/" in program and not os.path.isabs(exe):
        exe = os.path.join(cwd or os.getcwd(), exe)
    if not exe or not os.path.isfile(exe):
        return None
    if re.fullmatch(r"python(\d(\.\d+)?)?", os.path.basename(exe)):
        return exe
    words = _shebang(exe)
    if words and os.path.basename(words[0]) in _SHELLS:
        target = _shim_target(exe, path, cwd)
        return _interpreter(target, path, cwd) if target else None
    if words and os.path.basename(words[0]) == words[0]:   # (#!/usr/bin/env python3)
        return _interpreter(words[0], path, cwd)
    return words[0] if words and os.path.isfile(words[0]) else None


def _shebang(exe: str) -> list[str]:
    """The words of a file's #! line, ``env`` and its options left out (``#!/usr/bin/env python3``:
    ["python3"]); [] where there is none."""
    try:
        with open(exe, "rb") as f:
            first = f.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return []
    if not first.startswith("#!"):
        return []
    words = first[2:].split()
    if words and os.path.basename(words[0]) == "env":
        words = [w for w in words[1:] if not w.startswith("-")]
    return words


_SHELLS = {"sh", "bash", "dash", "zsh", "ksh"}
# a version manager's shim (pyenv's, asdf's): a shell script ending in ``exec "<tool>" exec "$program" "$@"``
_SHIM_EXEC = re.compile(r'^\s*exec\s+"?([^"\s]+)"?\s+exec\s+"?\$\{?program', re.M)
SHIM_TIMEOUT_S = 20.0


def _shim_target(exe: str, path: str | None, cwd: str | None) -> str | None:
    """The program a version manager's shim runs (``torchrun`` on PATH as pyenv's shim, a bash
    script), as the manager resolves it in the job's directory (``pyenv which torchrun``: its
    .python-version, $PYENV_VERSION); None for another shell script, whose Python is not known."""
    import subprocess

    try:
        with open(exe, "rb") as f:
            text = f.read(8192).decode("utf-8", "replace")
    except OSError:
        return None
    m = _SHIM_EXEC.search(text)
    if m is None:
        return None
    env = dict(os.environ, **({"PATH": path} if path else {}))
    try:
        out = subprocess.run([m.group(1), "which", os.path.basename(exe)], cwd=cwd or None, env=env,
                             capture_output=True, text=True, timeout=SHIM_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    target = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""
    return target if os.path.isabs(target) and os.path.isfile(target) and target != exe else None


def shell_launcher(program: str, path: str | None = None, cwd: str | None = None) -> str | None:
    """The launcher's path where the command's program is a shell script whose Python vest cannot
    follow (a wrapper, not a shim it resolves): the job's Python is then not known here."""
    import shutil

    exe = program if "/" in program else shutil.which(program, path=path)
    if not exe or not os.path.isfile(exe) or _interpreter(program, path, cwd) is not None:
        return None
    words = _shebang(exe)
    return exe if words and os.path.basename(words[0]) in _SHELLS else None


def other_python(program: str, env_path: str | None = None, cwd: str | None = None) -> str | None:
    """The Python that runs a job's command where it is not this process's (a venv's, a module's),
    else None."""
    import sys

    interp = _interpreter(program, env_path, cwd) if program else None
    if interp is None or environment_of(interp) == environment_of(sys.executable):
        return None
    return interp


def environment_of(exe: str) -> str:
    """The environment a Python runs in (its sys.prefix): a venv's folder where a pyvenv.cfg sits
    beside its bin/ (a venv's python is a link to the base interpreter, yet imports the venv's
    packages), else the installation the link resolves to (pyenv's shims, python -> python3.11)."""
    venv = os.path.dirname(os.path.dirname(os.path.abspath(exe)))
    if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
        return venv
    return os.path.dirname(os.path.dirname(os.path.realpath(exe)))


_PROBED: dict[str, tuple] = {}


def probe(interp: str) -> tuple:
    """(torch version, CUDA version, cuDNN version, (Python major, minor)) of another Python, each
    None where it does not answer (no torch: all None); asked once per process."""
    import json
    import subprocess

    if interp not in _PROBED:
        try:
            r = subprocess.run([interp, "-c", _PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                               env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, stdin=subprocess.DEVNULL)
            torch_v, cuda_v, cudnn_v, py = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 \
                else (None,) * 4
            _PROBED[interp] = (torch_v, cuda_v, cudnn_v, tuple(py) if py else None)
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError, TypeError):
            _PROBED[interp] = (None,) * 4
    return _PROBED[interp]


def use_job_python(program: str, env_path: str | None = None, cwd: str | None = None) -> str:
    """Where a job's command runs another Python than this process (a venv's, a module's), ask its
    torch for its cuDNN and set $VEST_JOB_CUDNN to it for this estimate ("unknown" for a CPU build,
    no torch, or no answer), so that placement bounds the engines where it is not the cuDNN asked
    (heuristics_are_the_jobs). Nothing where $VEST_JOB_CUDNN is set already (the site's or the
    user's word) or the job's Python is this one. Returns the note ("" where nothing changed)."""
    if not _JOB_CUDNN.clear():
        return ""                  # the site's or the user's
    interp = other_python(program, env_path, cwd)
    if interp is None:
        return ""
    torch_v, cuda_v, cudnn_v, _ = probe(interp)
    if cudnn_v:
        value, what = version_text(int(cudnn_v)), f"the job's python {interp} (torch {torch_v}, CUDA {cuda_v})"
    else:
        value = "unknown"
        what = (f"the job's python {interp} (torch {torch_v}, a CPU build)" if torch_v else
                f"the job's python {interp} (no torch answered)")
    _JOB_CUDNN.set(value)
    _JOB_SOURCE[value] = what
    return f"cuDNN: {what}"


def heuristics_are_the_jobs() -> tuple[bool, str]:
    """(the workspaces asked here are those the job's cuDNN picks, why not). cuDNN answers without
    a GPU from 9.8 on; an older or unknown cuDNN, or another version than the one asked, may pick
    other engines: placement then takes the largest workspace over the engines (estimator.py)."""
    fe = _frontend()
    if fe is None:
        return True, ""            # nothing is asked: the estimate says the workspaces are not modelled
    here = fe.backend_version()
    job, src = jobs_cudnn()
    if job is None:
        why = f"{src}: a CPU build of torch" if src == "this torch" else src
        return False, (f"the job's cuDNN is unknown ({why}); cuDNN {version_text(here)} "
                       "was asked")
    if job < 90800:
        return False, f"the job's cuDNN {version_text(job)} ({src}) cannot be asked without a GPU (9.8 and newer can)"
    if job != here:
        return False, f"the job's cuDNN {version_text(job)} ({src}) is not the one asked ({version_text(here)})"
    return True, ""


def assumed_note() -> str:
    """What the cuDNN workspaces rest on, where they may not be the job's ("" where they are)."""
    ok, why = heuristics_are_the_jobs()
    if ok:
        return ""
    return (f"cuDNN workspaces: {why}; peak is that cuDNN's first plan, placement takes the largest workspace "
            "over the engines cuDNN may pick for each convolution")


@functools.lru_cache(maxsize=16)
def _device_property(props_json: str):
    return _frontend().create_device_properties(props_json)


def conv_key(kind: str, x_shape, w_shape, stride, padding, dilation, dtype: str, channels_last: bool,
             allow_tf32: bool = True) -> str:
    """A convolution as the trace records it: 2-D shapes (N,C,H,W), (K,C/groups,R,S), and whether
    fp32 may run on TF32 tensor cores (torch.backends.cudnn.allow_tf32)."""
    return json.dumps([kind, list(x_shape), list(w_shape), list(stride), list(padding), list(dilation), dtype,
                       bool(channels_last), bool(allow_tf32)], separators=(",", ":"))


_DTYPES = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BFLOAT16"}


def _graph_class(cudnn):
    """The frontend's C++ graph (cudnn_frontend::graph::Graph), asked directly.

    Frontends from 1.2x wrap it in a Python IR (``cudnn.pygraph``) that ranks the backend's plans
    together with the frontend's own Python engines, which PyTorch never runs (Conv_v8.cpp takes
    cuDNN's heuristics list as it comes); for a convolution graph that layer answers the same plans in
    the same order (the first that builds, and the largest, checked on every convolution of resnet50,
    mobilenet_v2 and resnet18 in fp32, TF32 off, AMP fp16/bf16, NHWC, and benchmark mode on all 22
    built-in boards: 6,490 questions, none differs; test_cudnn_ws.py keeps a sample) and costs as much
    Python per question as cuDNN's heuristics cost themselves (1.7x the time per question). Older
    frontends have no such layer: their ``cudnn.pygraph`` is the C++ graph."""
    return getattr(getattr(cudnn, "_pybind_module", None), "backend_graph", None) or cudnn.pygraph


def _plan_workspaces(profile_props: str, key: str, fallback: bool = False):
    """Workspace sizes of the plans cuDNN offers for this convolution, in cuDNN's order, after
    PyTorch's numerical-note filter (None for an engine that does not build): those of heuristics
    mode INSTANT (= A), then, with ``fallback``, those of cuDNN's fallback list (benchmark mode
    times both). Yields nothing when cuDNN cannot be asked (no frontend, unsupported dtype or
    shape)."""
    cudnn = _frontend()
    if cudnn is None:
        return
    kind, x, w, stride, pad, dil, dtype, nhwc, allow_tf32 = json.loads(key)
    if dtype not in _DTYPES or len(x) != 4 or len(w) != 4:
        return
    dt = getattr(cudnn.data_type, _DTYPES[dtype])
    n, c, h, wd = x
    k, cg, r, s = w
    ho = (h + 2 * pad[0] - dil[0] * (r - 1) - 1) // stride[0] + 1
    wo = (wd + 2 * pad[1] - dil[1] * (s - 1) - 1) // stride[1] + 1

    def strides(a, b, hh, ww):
        return [b * hh * ww, 1, ww * b, b] if nhwc else [b * hh * ww, hh * ww, ww, 1]

    try:
        g = _graph_class(cudnn)(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                                               compute_data_type=cudnn.data_type.FLOAT,
                                               device_property=_device_property(profile_props))
        X = g.tensor(name="X", dim=[n, c, h, wd], stride=strides(n, c, h, wd), data_type=dt)
        W = g.tensor(name="W", dim=[k, cg, r, s], stride=strides(k, cg, r, s), data_type=dt)
        DY = g.tensor(name="DY", dim=[n, k, ho, wo], stride=strides(n, k, ho, wo), data_type=dt)
        args = dict(padding=list(pad), stride=list(stride), dilation=list(dil))
        if kind == "fprop":
            Y = g.conv_fprop(image=X, weight=W, **args)
        elif kind == "dgrad":
            Y = g.conv_dgrad(loss=DY, filter=W, **args)
            Y.set_dim([n, c, h, wd]).set_stride(strides(n, c, h, wd))
        else:
            Y = g.conv_wgrad(image=X, loss=DY, **args)
            Y.set_dim([k, cg, r, s]).set_stride(strides(k, cg, r, s))
        Y.set_output(True).set_data_type(dt)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A] + ([cudnn.heur_mode.FALLBACK] if fallback else []))
        notes = [cudnn.numerical_note.DOWN_CONVERT_INPUTS]
        if dtype == "float32" and not allow_tf32:
            notes.append(cudnn.numerical_note.TENSOR_CORE)   # Conv_v8.cpp filterEngineConfigs
        g.deselect_numeric_notes(notes)
        count = g.get_execution_plan_count()
    except Exception:
        return
    for i in range(count):
        try:
            g.build_plan_at_index(i)
            size = int(g.get_workspace_size_plan_at_index(i))
        except Exception:   # deselected, or the engine does not build for this graph
            size = None
        yield size


class _Answers:
    """cuDNN's answers kept on disk beside the trace cache (tracecache.cache_dir()/cudnn), one file
    per cuDNN library and frontend version: a plan's workspace is a pure function of the library,
    the board's properties and the convolution, and asking costs milliseconds each, seconds for a
    CNN's hundreds of convolutions on a site's GPU types. Read once per process, written back (the
    file's entries merged with the new ones, atomically) when the process ends, keeping the
    ``MAX_ANSWERS`` last written (about 150 bytes each). Off with the cache (``VEST_CACHE_DIR=off``)."""

    MAX_ANSWERS = 100_000

    def __init__(self):
        self._path = None
        self._data: dict[str, int | None] | None = None
        self._new: dict[str, int | None] = {}

    def _load(self) -> dict:
        if self._data is None:
            from .tracecache import cache_dir

            self._data = {}
            d, cudnn = cache_dir(), _frontend()
            if d is not None and cudnn is not None:
                version = f"{cudnn.backend_version()}-{getattr(cudnn, '__version__', '?')}"
                self._path = d / "cudnn" / f"workspaces-{version}.json"
                self._data = self._read()
                atexit.register(self.save)
                at_child_end(self.save)   # a forked child's answers too (ahead.py)
        return self._data

    def _read(self) -> dict:
        try:
            data = json.loads(self._path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, k: str, compute):
        data = self._load()
        if k not in data:
            data[k] = self._new[k] = compute()
        return data[k]

    def has(self, k: str) -> bool:
        return k in self._load()

    def put(self, k: str, value: int | None) -> None:
        self._load()[k] = self._new[k] = value

    def save(self) -> None:
        if self._path is None or not self._new:
            return
        from .tracecache import write_atomic

        try:
            merged = {**self._read(), **self._new}
            if len(merged) > self.MAX_ANSWERS:   # the oldest go first (the file keeps insertion order)
                merged = dict(list(merged.items())[-self.MAX_ANSWERS:])
            write_atomic(self._path, json.dumps(merged, separators=(",", ":")).encode())
            self._new = {}
        except OSError:
            pass   # a cache that cannot be written costs the next run the questions, nothing else


_ANSWERS = _Answers()


def _answer_key(mode: str, profile_props: str, key: str) -> str:
    return f"{mode}|{hashlib.sha256(profile_props.encode()).hexdigest()[:16]}|{key}"


def _answer(mode: str, profile_props: str, key: str) -> int | None:
    """cuDNN's answer to one question: "run", the workspace of the plan PyTorch runs (the first
    that builds of heuristics mode A); "find", the largest over the plans benchmark mode times."""
    if mode == "run":
        return next((ws for ws in _plan_workspaces(profile_props, key) if ws is not None), None)
    sizes = [ws for ws in _plan_workspaces(profile_props, key, fallback=True) if ws is not None]
    return max(sizes) if sizes else None


@functools.lru_cache(maxsize=65536)
def workspace_bytes(profile_props: str, key: str) -> int | None:
    """Workspace of the plan PyTorch would run for this convolution on this board (the first
    that builds of heuristics mode A); None when cuDNN cannot be asked."""
    return _ANSWERS.get(_answer_key("run", profile_props, key), lambda: _answer("run", profile_props, key))


@functools.lru_cache(maxsize=65536)
def find_workspace_bytes(profile_props: str, key: str) -> int | None:
    """Workspace that benchmark mode allocates to time the engines of this convolution
    (Conv_v8.cpp generate_and_filter_plans): the largest of all plans of heuristics mode
    INSTANT and the fallback list that build (on a GPU with room for it; at capacity PyTorch
    halves it until it fits and drops the plans that do not). None when cuDNN cannot be asked."""
    return _ANSWERS.get(_answer_key("find", profile_props, key), lambda: _answer("find", profile_props, key))


# Asking ahead, in parallel. One question costs cuDNN's heuristics about 5 ms of one core (mode A
# ranks the engines with its own model; building the graph and the first plan adds about 1 ms), and
# a CNN asks one per convolution, direction and GPU type: resnet50 on the 22 built-in types is about
# 1,500 questions, 5-8 s on one core. The answers are independent, so the questions an estimate is
# about to ask are answered first by forked workers, one per core free now (ahead.free_cores: on two
# cores beside a check's other search group, none) up to ASK_WORKERS_MAX (a login
# node is shared: a few seconds on eight cores is a burst, not a job). A fork costs tens of
# milliseconds, so a worker gets at least ASK_PER_WORKER questions; fewer are asked in-process as
# before. The workers only ask cuDNN (no torch op, no allocation through torch) and exit through
# multiprocessing's os._exit, so nothing of the parent's (atexit, the answers file) runs twice.
ASK_PER_WORKER = 16
ASK_WORKERS_MAX = 8


def _answer_of(question: tuple[str, str, str]) -> int | None:
    return _answer(*question)


def ask_ahead(questions) -> int:
    """Answer ``questions`` ((DeviceProfile, conv_key, benchmark), as workspace_for asks them) in
    parallel where there are enough not yet answered to pay for the workers; the answers go where
    workspace_for reads them (and, with the cache on, to disk). Returns how many were answered here
    (0: left to be asked as they come)."""
    if _frontend() is None:
        return 0
    todo: dict[str, tuple[str, str, str]] = {}
    for profile, key, benchmark in questions:
        props = device_properties_json(profile)
        if props is not None:
            mode = "find" if benchmark else "run"
            k = _answer_key(mode, props, key)
            if not _ANSWERS.has(k):
                todo.setdefault(k, (mode, props, key))
    workers = min(_cores(), ASK_WORKERS_MAX, len(todo) // ASK_PER_WORKER)
    if workers < 2:
        return 0
    import multiprocessing

    from . import progress

    asked = list(todo.values())
    try:
        # forked as ahead.start forks: not in the middle of a progress line's draw
        with progress.held_for_fork():
            pool = multiprocessing.get_context("fork").Pool(workers, initializer=progress.after_fork_in_child)
        with pool:
            answers = pool.map(_answer_of, asked, chunksize=max(1, len(asked) // (4 * workers)))
    except (OSError, ValueError):   # no fork here (a process limit): ask them as they come
        return 0
    for k, v in zip(todo, answers):
        _ANSWERS.put(k, v)
    return len(asked)


def workspace_for(profile: DeviceProfile, key: str, benchmark: bool = False) -> int:
    """Bytes (0 where cuDNN cannot be asked): the workspace of the plan that runs, or with
    ``benchmark`` the one benchmark mode times all plans in."""
    props = device_properties_json(profile)
    if props is None:
        return 0
    return (find_workspace_bytes if benchmark else workspace_bytes)(props, key) or 0
