"""``nvidia-smi`` as the job's GPU node answers it, for a training script that runs it.

Scripts log the GPU they got (``subprocess.run(["nvidia-smi"])``, modded-nanogpt's records) or size
themselves from it (``nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits``). The
machine vest runs on has no GPU and usually no nvidia-smi: the script failed there with
``FileNotFoundError`` (blamed on the script), or parsed an empty ``os.popen`` answer. The run's
PATH starts with a stand-in (``install``) that answers for the GPU type being estimated, one line
per GPU of the node, nothing in use yet (the script has not started its CUDA work when it asks,
mostly): the name, memory, UUID and compute capability vest's profile has; what no profile knows
(clocks, power, temperature, the driver) is ``[N/A]``, as nvidia-smi prints a field a board does not
report. In: the profile and the node's GPU count. Out: the stand-in's path (runner.py puts its folder
first on PATH; children.py lets it run).

The same holds for what host code asks the driver's libraries directly: NVML through pynvml
(``fake_nvml``) and the CUDA runtime through ctypes (``fake_cuda_runtime``).
"""

from __future__ import annotations

import json
import os
import re
import sys

ENV = "VEST_NVIDIA_SMI"   # the stand-in's path, for children.py

_SCRIPT = '''#!{python}
import json, sys
sys.path.insert(0, {root!r})
from vest_slurm.dynamic.nvidia_smi import answer
sys.stdout.write(answer(json.loads({facts!r}), sys.argv[1:]))
'''


def install(folder: str, name: str, total_mib: int, capability: tuple[int, int], count: int) -> str:
    """Write the stand-in into ``folder`` for ``count`` GPUs of this type; its path."""
    import uuid

    facts = {"name": name, "total_mib": int(total_mib), "cap": f"{capability[0]}.{capability[1]}",
             "uuids": [f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, f'vest-slurm fake GPU {name} {i}')}" for i in range(count)]}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "nvidia-smi")
    with open(path, "w") as f:
        f.write(_SCRIPT.format(python=sys.executable, root=root, facts=json.dumps(facts)))
    os.chmod(path, 0o755)
    return path


def _field(facts: dict, i: int, field: str, units: bool) -> str:
    total = facts["total_mib"]
    mib = (lambda v: f"{v} MiB") if units else str
    values = {
        "index": str(i), "count": str(len(facts["uuids"])), "name": facts["name"], "gpu_name": facts["name"],
        "uuid": facts["uuids"][i], "gpu_uuid": facts["uuids"][i], "compute_cap": facts["cap"],
        "memory.total": mib(total), "memory.used": mib(0), "memory.free": mib(total), "memory.reserved": mib(0),
        "utilization.gpu": "0 %" if units else "0", "utilization.memory": "0 %" if units else "0",
        "pci.bus_id": f"00000000:{i:02X}:00.0", "persistence_mode": "Enabled", "mig.mode.current": "Disabled",
    }
    return values.get(field, "[N/A]")


def answer(facts: dict, argv: list[str]) -> str:
    n = len(facts["uuids"])
    query = next((a.split("=", 1)[1] for a in argv if a.startswith("--query-gpu=")), None)
    if query is None and "--query-gpu" in argv[:-1]:
        query = argv[argv.index("--query-gpu") + 1]
    if query is not None:
        fmt = next((a.split("=", 1)[1] for a in argv if a.startswith("--format=")), "csv")
        fmt = argv[argv.index("--format") + 1] if "--format" in argv[:-1] else fmt
        opts = set(fmt.split(","))
        fields = [f.strip() for f in query.split(",") if f.strip()]
        ids = next((a.split("=", 1)[1] for a in argv if a.startswith(("--id=", "-i="))), None)
        rows = [int(x) for x in ids.split(",")] if ids else range(n)
        lines = [] if "noheader" in opts else [", ".join(f + ("" if "nounits" in opts else _unit(f)) for f in fields)]
        lines += [", ".join(_field(facts, i, f, "nounits" not in opts) for f in fields) for i in rows]
        return "\n".join(lines) + "\n"
    if "-L" in argv or "--list-gpus" in argv:
        return "".join(f"GPU {i}: {facts['name']} (UUID: {u})\n" for i, u in enumerate(facts["uuids"]))
    total = facts["total_mib"]
    rows = "".join(f"|   {i}  {facts['name'][:28]:<28} On  | {_field(facts, i, 'pci.bus_id', False)[4:]:>16} Off |"
                   f"                    0 |\n| N/A   N/A    P0   N/A /  N/A |  {0:>5}MiB / {total:>6}MiB |      0%      Default |\n"
                   for i in range(n))
    return ("+-----------------------------------------------------------------------------+\n"
            "| NVIDIA-SMI (vest-slurm stand-in: the GPU type estimated, no process on it yet)   |\n"
            "|-------------------------------+----------------------+----------------------+\n"
            f"{rows}"
            "+-----------------------------------------------------------------------------+\n")


def _unit(field: str) -> str:
    if field.startswith("memory."):
        return " [MiB]"
    if field.startswith("utilization."):
        return " [%]"
    return ""


def _facts_here() -> dict:
    """The facts of ``install`` from the fake GPU the run answers with (torch.cuda's stand-ins)."""
    import uuid

    import torch

    props = torch.cuda.get_device_properties(0)
    name = props.name
    return {"name": name, "total_mib": int(props.total_memory) >> 20, "cap": f"{props.major}.{props.minor}",
            "total": int(props.total_memory), "capability": (props.major, props.minor),
            "uuids": [f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, f'vest-slurm fake GPU {name} {i}')}"
                      for i in range(torch.cuda.device_count())]}


def fake_nvml(module) -> None:
    """pynvml (nvidia-ml-py) as the job's node answers it, for a script that asks NVML (NVIDIA's
    DeepLearningExamples set their CPU affinity from ``nvmlDeviceGetCpuAffinity``; loggers read the
    GPU's name and memory). There is no NVML here: ``nvmlInit`` failed ("NVML Shared Library Not
    Found"), the script blamed. Answered as the nvidia-smi stand-in answers, from the GPU type
    estimated, nothing in use yet: the count, handles, name, UUID, compute capability, memory,
    utilization, and a CPU affinity of every CPU of this machine (the node's own is not known
    here; where the script pins itself with it, the host side changes, not the GPU's memory).
    What else the script asks NVML is refused, named: vest's to answer, not the script's."""
    class _Handle:
        def __init__(self, index):
            self.index = index

    class _Memory:
        def __init__(self, total):
            self.total, self.free, self.used, self.reserved = total, total, 0, 0

    class _Utilization:
        gpu = memory = 0

    facts: dict = {}

    def the(key):
        if not facts:
            facts.update(_facts_here())
        return facts[key]

    def handle(index):
        if not 0 <= int(index) < len(the("uuids")):
            raise module.NVMLError(getattr(module, "NVML_ERROR_INVALID_ARGUMENT", 2))
        return _Handle(int(index))

    def affinity(h, words):
        cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        return [sum(1 << (c - 64 * w) for c in cpus if 64 * w <= c < 64 * (w + 1)) for w in range(int(words))]

    answers = {
        "nvmlInit": lambda *a, **k: None, "nvmlInitWithFlags": lambda *a, **k: None,
        "nvmlShutdown": lambda *a, **k: None,
        "nvmlDeviceGetCount": lambda: len(the("uuids")),
        "nvmlDeviceGetHandleByIndex": handle,
        "nvmlDeviceGetIndex": lambda h: h.index,
        "nvmlDeviceGetName": lambda h: the("name"),
        "nvmlDeviceGetUUID": lambda h: the("uuids")[h.index],
        "nvmlDeviceGetCudaComputeCapability": lambda h: the("capability"),
        "nvmlDeviceGetMemoryInfo": lambda h, *a, **k: _Memory(the("total")),
        "nvmlDeviceGetUtilizationRates": lambda h: _Utilization(),
        "nvmlDeviceGetCpuAffinity": affinity,
    }
    import types

    from ..errors import NotSupportedHere

    def unanswered(name):
        def call(*_args, **_kwargs):
            raise NotSupportedHere(f"pynvml.{name}", "there is no NVML on this machine; its stand-in answers "
                                   f"{', '.join(sorted(answers))}")
        return call

    for name, value in list(vars(module).items()):
        if name.startswith("nvml") and isinstance(value, types.FunctionType):
            setattr(module, name, answers.get(name) or unanswered(name))


# the CUDA runtime library by name, as ctypes loads it: libcudart.so, libcudart.so.12, a full path
_CUDART = re.compile(r"^(lib)?cudart(64)?([._-].*)?$")
# cudaLimit values whose defaults the CUDA runtime API documents (cudaDeviceSetLimit): the stack of
# each GPU thread (1 KiB), the printf FIFO (1 MiB) and the device malloc heap (8 MiB); raising one
# of these reserves device memory (per resident thread for the stack) that the estimate does not model
_LIMIT_DEFAULTS = {0: 1024, 1: 1 << 20, 2: 8 << 20}
# cudaLimitMaxL2FetchGranularity (5) and cudaLimitPersistingL2CacheSize (6): cache hints, no memory
_LIMIT_HINTS = (5, 6)


def fake_cuda_runtime() -> None:
    """The CUDA runtime as host code loads it through ctypes (``ctypes.CDLL("libcudart.so")``):
    NVIDIA's Transformer-XL sets the L2 fetch granularity with ``cudaDeviceSetLimit`` and asserts
    what ``cudaDeviceGetLimit`` reads back; scripts start the profiler range of Nsight Systems, ask
    the device count or the free memory. On a login node the library is missing or answers
    cudaErrorInsufficientDriver, and the script failed with its own assert, blamed on it. A library
    of that name is answered as the job's node would answer it (the GPU type estimated, nothing in
    use yet); a call the stand-in does not answer, or a limit that reserves device memory, stops
    the run naming the function: vest's to answer, not the script's."""
    import ctypes

    real_init = ctypes.CDLL.__init__
    if getattr(real_init, "_vest_cudart", False):
        return

    def init(self, name, *args, **kwargs):
        if name is not None and _CUDART.match(os.path.basename(str(name))):
            self._name, self._handle, self._FuncPtr = str(name), 0, None
            self.__class__ = _runtime_class(type(self))
            return None
        return real_init(self, name, *args, **kwargs)

    init._vest_cudart = True
    ctypes.CDLL.__init__ = init


_RUNTIME_CLASSES: dict = {}


def _runtime_class(cls):
    """``cls`` (CDLL or a subclass) with the runtime's functions as attributes."""
    if cls not in _RUNTIME_CLASSES:
        def function(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            f = _RuntimeFunction(self._name, name)
            setattr(self, name, f)
            return f

        _RUNTIME_CLASSES[cls] = type(cls.__name__, (cls,), {"__getattr__": function, "__getitem__": function})
    return _RUNTIME_CLASSES[cls]


class _RuntimeFunction:
    """One function of the stand-in runtime, with the attributes a ctypes function has."""

    def __init__(self, library, name):
        self.library, self.__name__ = library, name
        self.argtypes = self.restype = self.errcheck = None

    def __call__(self, *args):
        answer = _RUNTIME.get(self.__name__)
        if answer is None:
            self._unsupported(f"the stand-in answers {', '.join(sorted(_RUNTIME))}")
        return answer(self, *(_value(a) for a in args))

    def _unsupported(self, why):
        from ..errors import NotSupportedHere

        raise NotSupportedHere(f"{self.__name__} of the CUDA runtime loaded through ctypes ({self.library})",
                               f"there is no CUDA driver on this machine; {why}")


def _value(arg):
    """An argument as the function receives it: a number for a ctypes number, the object a pointer
    or ``byref`` points at otherwise (written through ``_store``)."""
    import ctypes

    if isinstance(arg, ctypes._SimpleCData):
        return arg.value
    return arg


def _store(pointer, value) -> None:
    target = getattr(pointer, "_obj", None)   # ctypes.byref(x)
    if target is None and hasattr(pointer, "contents"):   # a POINTER(x) instance
        target = pointer.contents
    if hasattr(target, "__setitem__") and not hasattr(target, "value"):
        target[0] = value
    else:
        target.value = value


_LIMITS: dict = {}


def _set_limit(f, limit, value):
    if limit in _LIMIT_HINTS:
        _LIMITS[limit] = value
    elif limit in _LIMIT_DEFAULTS and value <= _LIMIT_DEFAULTS[limit]:
        _LIMITS[limit] = value
    else:
        f._unsupported(f"cudaLimit {limit} = {value} reserves device memory (or is a limit) the estimate does not model")
    return 0


def _get_limit(f, pointer, limit):
    if limit not in _LIMITS and limit not in _LIMIT_DEFAULTS:
        f._unsupported(f"the value of cudaLimit {limit} before the script sets it is the driver's")
    _store(pointer, _LIMITS.get(limit, _LIMIT_DEFAULTS.get(limit)))
    return 0


def _version():
    import torch

    major, minor = (int(x) for x in (torch.version.cuda or "12.0").split(".")[:2])
    return 1000 * major + 10 * minor


def _writes(value):
    """An answer that writes ``value()`` through the call's one pointer and returns cudaSuccess."""
    def answer(f, pointer):
        _store(pointer, value())
        return 0
    return answer


def _device_count():
    import torch

    return torch.cuda.device_count()


def _mem_info(f, free, total):
    import torch

    have, of = torch.cuda.mem_get_info()
    _store(free, have)
    _store(total, of)
    return 0


def _free(f, pointer=None):
    if pointer not in (None, 0):   # cudaFree(0): the idiom that creates the context
        f._unsupported("it frees device memory that torch's allocator never gave out")
    return 0


_ok = lambda f, *args: 0   # noqa: E731  (synchronizes, selects or profiles: nothing to do on the fake device)
_RUNTIME = {
    "cudaDeviceSetLimit": _set_limit, "cudaDeviceGetLimit": _get_limit,
    "cudaGetDeviceCount": _writes(_device_count), "cudaMemGetInfo": _mem_info,
    "cudaGetDevice": _writes(lambda: 0),   # (the rank's device, as torch.cuda.current_device answers)
    "cudaRuntimeGetVersion": _writes(_version), "cudaDriverGetVersion": _writes(_version),
    "cudaGetErrorString": lambda f, code: b"no error" if code == 0 else f._unsupported(f"error code {code}"),
    "cudaFree": _free,
    "cudaSetDevice": _ok, "cudaDeviceSynchronize": _ok, "cudaProfilerStart": _ok, "cudaProfilerStop": _ok,
    "cudaGetLastError": _ok, "cudaPeekAtLastError": _ok,
}
