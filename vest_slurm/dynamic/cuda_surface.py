"""torch's public CUDA surface, walked from the installed torch, and what the fake-CUDA run does with each API.

In: the installed torch (its namespaces ``torch.cuda``, ``torch.cuda.amp``, ``torch.cuda.profiler``,
``torch.accelerator``, the classes ``torch.Stream``/``torch.Event``/``torch.cuda.Stream``/
``torch.cuda.Event``/``torch.Generator``/the two ``GradScaler``s, pinned memory: ``Tensor.pin_memory``/``is_pinned`` and the
``pin_memory=`` argument of torch's factories).
Also ``Tensor.record_stream``. Out: ``surface()``, every public callable and class there with its real signature; ``DECISIONS``,
one decision per API; ``patches(answers)``, the (object, attribute, replacement) list that
``standins.patched`` installs for the run.

A decision is one of
- FAKE: a stand-in built here with the real API's signature (``inspect.signature``, or the first
  line of the docstring for a builtin): the call's arguments are bound against it, so a call the real
  API would reject is rejected the same way; the stand-in answers as a GPU run would (memory queries
  from the trace, streams and events that order nothing, a generator that reports ``cuda``);
- ANSWERED: answered by ``estimate._fakecuda.cuda_answers`` (the device's identity and properties);
- REAL: the real object runs unchanged under fake CUDA (exception types, decorators, pure-Python code
  over the faked pieces, compile-time facts);
- UNSUPPORTED: a stand-in that raises ``NotSupportedHere`` naming the API and saying why (CUDA graphs,
  custom allocators, IPC, raw handles): the run stops with a message that vest must act, never a
  silent answer;
- NAMESPACE: a submodule whose public functions are re-exported by ``torch.cuda`` and decided there,
  or walked on its own.
``tests/test_cuda_surface.py`` fails when the installed torch has a public API here with no decision.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import re
import struct
import types
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import FailsOnAGpu, NotSupportedHere  # noqa: F401  (re-exported: the stand-ins raise them)

FAKE, ANSWERED, REAL, UNSUPPORTED, NAMESPACE = "fake", "answered", "real", "unsupported", "namespace"


@dataclass(frozen=True)
class Decision:
    kind: str
    why: str


# ---- the surface -------------------------------------------------------------------------------------

NAMESPACES = ("torch.cuda", "torch.cuda.amp", "torch.cuda.profiler", "torch.accelerator")
CLASSES = ("torch.Stream", "torch.Event", "torch.cuda.Stream", "torch.cuda.Event", "torch.Generator",
           "torch.amp.GradScaler", "torch.cuda.amp.GradScaler")


def _resolve(dotted: str):
    obj = torch
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def _public_names(mod) -> list[str]:
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n in dir(mod) if not n.startswith("_")
                 and str(getattr(getattr(mod, n), "__module__", mod.__name__)).startswith(mod.__name__)]
    return sorted(set(names))


def pin_memory_factories() -> list[str]:
    """Public ``torch.X`` functions whose aten schema has a ``pin_memory`` argument."""
    out = []
    for name in dir(torch):
        if name.startswith("_") or not callable(getattr(torch, name, None)):
            continue
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        try:
            if any(a.name == "pin_memory" for o in packet.overloads() for a in getattr(packet, o)._schema.arguments):
                out.append(f"torch.{name}")
        except (AttributeError, RuntimeError):
            continue
    return sorted(out)


def surface() -> dict[str, object]:
    """Qualified name -> object, for every public API this module decides."""
    out: dict[str, object] = {}
    for ns in NAMESPACES:
        mod = _resolve(ns)
        for n in _public_names(mod):
            if hasattr(mod, n):
                out[f"{ns}.{n}"] = getattr(mod, n)
    for cls in CLASSES:
        c = _resolve(cls)
        out[cls] = c
        for n in dir(c):
            if not n.startswith("_"):
                out[f"{cls}.{n}"] = getattr(c, n)
    out["torch.Tensor.pin_memory"] = torch.Tensor.pin_memory
    out["torch.Tensor.is_pinned"] = torch.Tensor.is_pinned
    out["torch.Tensor.record_stream"] = torch.Tensor.record_stream
    for f in pin_memory_factories():
        out[f"{f}(pin_memory=)"] = _resolve(f)
    return out


_DOC_SIG = re.compile(r"^\s*\w+(\(.*\))")


def real_signature(obj) -> inspect.Signature | None:
    """The API's signature: ``inspect.signature``, else the docstring's first line (torch's builtins
    state theirs there, e.g. ``Event(device=None, *, enable_timing=False, ...)``), else None."""
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        pass
    doc = (getattr(obj, "__doc__", None) or "").strip().splitlines()
    m = _DOC_SIG.match(doc[0]) if doc else None
    if not m:
        return None
    params = re.sub(r"\s*->.*$", "", m.group(1))[1:-1]
    if isinstance(obj, (types.MethodDescriptorType, types.WrapperDescriptorType)):
        params = "self" + (", " + params if params.strip() else "")   # a Tensor method: its docstring omits self
    # "Stream(device, *, priority)": a builtin's optional arguments are written without defaults
    params = ", ".join(p if ("=" in p or p.strip() in ("*", "/") or p.strip().startswith("*")) else f"{p.strip()}=None"
                       for p in params.split(",") if p.strip())
    try:
        ns: dict = {}
        exec(f"def _f({params}): pass", {}, ns)   # noqa: S102 - parses torch's own docstring
        return inspect.signature(ns["_f"])
    except SyntaxError:
        return None


def standin(api: str, real, impl: Callable[[dict], object]):
    """A function with ``real``'s signature that binds its arguments and returns ``impl(arguments)``."""
    sig = real_signature(real)

    def call(*args, **kwargs):
        if sig is None:
            return impl({"args": args, "kwargs": kwargs})
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{api}(): {e}") from None
        bound.apply_defaults()
        return impl(dict(bound.arguments))

    call.__signature__ = sig
    call.__name__ = getattr(real, "__name__", api.rsplit(".", 1)[-1])
    call.__qualname__ = call.__name__
    call.__doc__ = getattr(real, "__doc__", None)
    call.__module__ = getattr(real, "__module__", None)
    if hasattr(real, "__wrapped__"):   # code that unwraps torch's decorated APIs (Dynamo's trace
        call.__wrapped__ = real.__wrapped__   # rules read torch.cuda.use_mem_pool.__wrapped__) finds it
    call.__vest_standin__ = api
    return call


class _Refusing(type):
    """The metaclass of an unsupported class's stand-in: still a class (scripts and libraries write
    ``torch.cuda.CUDAGraph | None`` in annotations, subclass it, or test isinstance at import), but
    making one raises NotSupportedHere."""

    def __call__(cls, *args, **kwargs):
        raise NotSupportedHere(cls.__vest_standin__, cls.__vest_why__)

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.__vest_real__)

    def __subclasscheck__(cls, sub):
        return isinstance(sub, type) and issubclass(sub, cls.__vest_real__)


def unsupported(api: str, real, why: str):
    if isinstance(real, type):
        return _Refusing(real.__name__, (), {"__vest_standin__": api, "__vest_why__": why, "__vest_real__": real,
                                             "__doc__": real.__doc__, "__module__": real.__module__,
                                             "__qualname__": real.__qualname__,
                                             "__signature__": real_signature(real)})

    def refuse(_args):
        raise NotSupportedHere(api, why)

    return standin(api, real, refuse)


# ---- what the run answers from ---------------------------------------------------------------------

@dataclass
class Answers:
    """What the stand-ins read: the live and peak device bytes so far (the trace's), the total memory."""

    live_bytes: Callable[[], int]
    peak_bytes: Callable[[], int]
    empty_cache: Callable[[], None] = lambda: None   # torch.cuda.empty_cache(): the trace marks it
    # what the caching allocator holds (memory_reserved): at least the live bytes' peak since the
    # last empty_cache, the blocks freed since staying cached (a probe's forward and backward: an
    # AutoBatch that fits a line to reserved memory read live bytes alone and chose a huge batch)
    held_bytes: Callable[[], int] | None = None

    def reserved_bytes(self) -> int:
        return max(self.held_bytes(), self.live_bytes()) if self.held_bytes is not None else self.live_bytes()


def _device_index(device) -> int:
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return d.index or 0


def _total() -> int:
    return torch.cuda.get_device_properties(0).total_memory   # answered by cuda_answers


def _memory_stats(ans: Answers) -> dict:
    """torch.cuda.memory_stats' keys that scripts read (allocated, reserved, active: current and peak),
    as the allocator's counters would read before vest replays the trace: reserved is not known here, so
    it is the allocated figures' peak since the last empty_cache (what the cache holds at least)."""
    live, peak, held = ans.live_bytes(), ans.peak_bytes(), ans.reserved_bytes()
    out = {"num_alloc_retries": 0, "num_ooms": 0}
    for key in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes"):
        for pool in ("all", "large_pool", "small_pool"):
            cur = (held if key == "reserved_bytes" else live) if pool == "all" else 0
            top = peak if pool == "all" else 0
            out.update({f"{key}.{pool}.current": cur, f"{key}.{pool}.peak": top,
                        f"{key}.{pool}.allocated": top, f"{key}.{pool}.freed": max(0, top - cur)})
    return dict(sorted(out.items()))


def _nested(flat: dict) -> dict:
    out: dict = {}
    for k, v in flat.items():
        node = out
        parts = k.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return out


# ---- streams, events, generators -------------------------------------------------------------------

_stream_ids = itertools.count(1)   # 0 is the default stream, as in CUDA
# the real classes, held here: while the run is patched, torch.Stream and torch.cuda.Event are the stand-ins
_REAL_STREAM, _REAL_EVENT, _REAL_CUDA_EVENT = torch.Stream, torch.Event, torch.cuda.Event


class _StandsFor(type):
    """Metaclass of the stand-in classes: an object of the real class still passes isinstance against
    the stand-in that replaced it (torch.default_generator against torch.Generator, for one)."""

    def __instancecheck__(cls, obj):
        return type.__instancecheck__(cls, obj) or isinstance(obj, cls.__dict__.get("_vest_real", ()))

    def __subclasscheck__(cls, sub):
        return type.__subclasscheck__(cls, sub) or issubclass(sub, cls.__dict__.get("_vest_real", ()))


class FakeStream(torch.Stream, metaclass=_StandsFor):
    """torch.Stream on the fake device: built from ids (torch.Stream's own constructor form, which
    touches no driver); work on it orders nothing, as every fake op completes at once."""

    _vest_real = _REAL_STREAM

    def __new__(cls, device=None, *, priority=0, _stream_id=None):
        sid = next(_stream_ids) if _stream_id is None else _stream_id
        # device_type 1 is c10::DeviceType::CUDA
        obj = _REAL_STREAM.__new__(cls, stream_id=sid, device_index=_device_index(device), device_type=1)
        return obj

    def __init__(self, *args, **kwargs):
        self._vest_priority = kwargs.get("priority", 0)

    def query(self):
        return True

    def synchronize(self):
        return None

    def wait_event(self, event):
        return None

    def wait_stream(self, stream):
        return None

    def record_event(self, event=None):
        event = event if event is not None else FakeCudaEvent()
        event.record(self)
        return event

    def is_capturing(self):
        return False

    def native_handle(self):
        return self.stream_id

    def __enter__(self):
        self._vest_prev = torch.accelerator.current_stream()
        torch.accelerator.set_stream(self)
        return self

    def __exit__(self, *exc):
        torch.accelerator.set_stream(self._vest_prev)
        return False


class FakeCudaStream(FakeStream):
    """torch.cuda.Stream(device=None, priority=0, **kwargs) on the fake device."""

    def __new__(cls, device=None, priority=0, **kwargs):
        return FakeStream.__new__(cls, device, priority=priority, _stream_id=kwargs.get("stream_id"))

    def __init__(self, device=None, priority=0, **kwargs):
        self._vest_priority = priority

    @property
    def priority(self):
        return self._vest_priority

    @staticmethod
    def priority_range():
        # cudaDeviceGetStreamPriorityRange on every GPU since Kepler: (least, greatest) = (0, -5)
        return (0, -5)

    @property
    def cuda_stream(self):
        return self.stream_id

    def __eq__(self, other):
        return isinstance(other, _REAL_STREAM) and other.stream_id == self.stream_id

    __hash__ = FakeStream.__hash__


class FakeCudaEvent(torch.cuda.Event, metaclass=_StandsFor):
    """torch.cuda.Event: creating one touches no driver (CUDA creates it lazily on record); recording,
    waiting and querying complete at once. elapsed_time has no real time to give: a stand-in value."""

    _vest_real = _REAL_CUDA_EVENT

    def __init__(self, *args, **kwargs):
        self._vest_recorded = False

    def record(self, stream=None):
        self._vest_recorded = True

    def wait(self, stream=None):
        return None

    def query(self):
        return True

    def synchronize(self):
        return None

    def elapsed_time(self, end_event):
        return 1.0   # milliseconds; a stand-in value, only for the script's own logging

    def ipc_handle(self):
        raise NotSupportedHere("torch.cuda.Event.ipc_handle", "events shared between processes need a real driver")

    @classmethod
    def from_ipc_handle(cls, device, handle):
        raise NotSupportedHere("torch.cuda.Event.from_ipc_handle", "events shared between processes need a real driver")

    @property
    def cuda_event(self):
        return 0


class FakeEvent(FakeCudaEvent):
    """torch.Event(device=None, *, enable_timing=False, blocking=False, interprocess=False): torch's
    device-generic event; on CUDA it is a CUDA event."""

    _vest_real = _REAL_EVENT

    def __new__(cls, device=None, *, enable_timing=False, blocking=False, interprocess=False):
        return _REAL_CUDA_EVENT.__new__(cls, enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


_REAL_GENERATOR = torch.Generator


class _GeneratorStandsFor(_StandsFor, type(_REAL_GENERATOR)):
    pass


class FakeGenerator(_REAL_GENERATOR, metaclass=_GeneratorStandsFor):
    """torch.Generator(device='cpu'): a CPU generator is real; a CUDA one is a real CPU generator that
    reports its device as cuda (seeding and state calls work on it; the fake device's random ops draw
    no numbers, so which generator is used changes no shape)."""

    _vest_real = _REAL_GENERATOR

    def __new__(cls, device="cpu"):
        d = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        obj = _REAL_GENERATOR.__new__(cls)
        obj._vest_device = torch.device("cuda", d.index or 0) if d.type == "cuda" else None
        return obj

    def __init__(self, device="cpu"):
        pass

    @property
    def device(self):
        return self._vest_device if self._vest_device is not None else _REAL_GENERATOR.device.__get__(self)

    # A CUDA generator's state is its Philox seed and offset, 8 bytes each (CUDAGeneratorImpl::get_state,
    # what torch.cuda.get_rng_state returns): RNG trackers that save it and restore it through the
    # default generator (Megatron's CudaRNGStatesTracker, DeepSpeed's and fairscale's copies) met the
    # CPU generator's 5056-byte format here and failed.
    _PHILOX = struct.Struct("<QQ")

    def get_state(self):
        if self._vest_device is None:
            return _REAL_GENERATOR.get_state(self)
        seed = _REAL_GENERATOR.initial_seed(self) & 0xFFFFFFFFFFFFFFFF
        return torch.frombuffer(bytearray(self._PHILOX.pack(seed, getattr(self, "_vest_offset", 0))), dtype=torch.uint8)

    def set_state(self, new_state):
        if self._vest_device is None:
            return _REAL_GENERATOR.set_state(self, new_state)
        if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8 or new_state.numel() != self._PHILOX.size:
            raise FailsOnAGpu(f"RNG state is wrong size: a CUDA generator's state is a torch.ByteTensor of "
                              f"{self._PHILOX.size} bytes (seed and offset), got "
                              f"{getattr(new_state, 'numel', lambda: '?')()} elements of {getattr(new_state, 'dtype', type(new_state))}")
        seed, offset = self._PHILOX.unpack(bytes(new_state.cpu().tolist()))
        _REAL_GENERATOR.manual_seed(self, seed)
        self._vest_offset = offset
        return self

    def __reduce__(self):
        return (FakeGenerator, (str(self.device),))


# which methods of a real class the fake class gives itself (the rest are inherited and touch no driver)
CLASS_STANDINS = {
    "torch.Stream": FakeStream, "torch.cuda.Stream": FakeCudaStream,
    "torch.Event": FakeEvent, "torch.cuda.Event": FakeCudaEvent, "torch.Generator": FakeGenerator,
}
_INHERITED_OK = {
    # fields of the object, set at construction: no driver call
    "device", "device_index", "device_type", "stream_id", "event_id",
    # torch.Generator's methods run on the real CPU generator underneath
    "clone_state", "get_offset", "get_state", "graphsafe_get_state", "graphsafe_set_state", "initial_seed",
    "manual_seed", "philox_state", "seed", "set_offset", "set_state",
}


# ---- the decisions ---------------------------------------------------------------------------------

def _d(kind, why):
    return Decision(kind, why)


_GRAPHS = "CUDA graphs replay captured kernels from a private memory pool that vest does not model"
_ALLOC = "a custom or external allocator replaces the caching allocator that vest replays"
_HANDLE = "it hands out a raw driver or library handle"
_NVML = "it reads the GPU through NVML"
_NOOP = "no-op: the fake device has nothing to reset, seed or flush"

DECISIONS: dict[str, Decision] = {
    # torch.cuda: identity and properties
    "torch.cuda.is_available": _d(ANSWERED, "true"),
    "torch.cuda.device_count": _d(ANSWERED, "the job's GPUs per node"),
    "torch.cuda.current_device": _d(ANSWERED, "0, the rank's device"),
    "torch.cuda.get_device_properties": _d(ANSWERED, "the target GPU's name, memory and capability"),
    "torch.cuda.get_device_name": _d(ANSWERED, "the target GPU's"),
    "torch.cuda.get_device_capability": _d(ANSWERED, "the target GPU's"),
    "torch.cuda.is_bf16_supported": _d(ANSWERED, "by the target's capability"),
    "torch.cuda.synchronize": _d(ANSWERED, "returns at once"),
    "torch.cuda.is_tf32_supported": _d(FAKE, "capability >= 8.0 (Ampere), as torch's own check"),
    "torch.cuda.is_initialized": _d(FAKE, "true: a GPU process that has used CUDA"),
    "torch.cuda.init": _d(FAKE, _NOOP),
    "torch.cuda.set_device": _d(FAKE, _NOOP),
    "torch.cuda.device": _d(FAKE, "a context manager that selects nothing (one fake device per rank)"),
    "torch.cuda.device_of": _d(FAKE, "as torch.cuda.device"),
    "torch.cuda.get_arch_list": _d(REAL, "compile-time list of the installed torch"),
    "torch.cuda.get_gencode_flags": _d(REAL, "compile-time flags of the installed torch"),
    "torch.cuda.has_half": _d(REAL, "a constant"),
    "torch.cuda.has_magma": _d(REAL, "a compile-time constant"),
    "torch.cuda.can_device_access_peer": _d(FAKE, "true: the GPUs of one node reach each other (NVLink or PCIe P2P)"),
    "torch.cuda.check_error": _d(UNSUPPORTED, "it interprets a raw CUDA error code"),
    "torch.cuda.cudart": _d(FAKE, "the runtime's binding: the profiler's start and stop, error strings, memory "
                            "info and host registration answered; its raw streams named as unsupported"),
    "torch.cuda.current_blas_handle": _d(UNSUPPORTED, _HANDLE),
    "torch.cuda.current_solver_handle": _d(UNSUPPORTED, _HANDLE),
    "torch.cuda.cudaStatus": _d(REAL, "an enum of status codes"),
    "torch.cuda.CudaError": _d(REAL, "an exception type"),
    "torch.cuda.DeferredCudaCallError": _d(REAL, "an exception type"),
    # torch.cuda: memory
    "torch.cuda.memory_allocated": _d(FAKE, "the trace's live device bytes so far"),
    "torch.cuda.max_memory_allocated": _d(FAKE, "the trace's peak device bytes so far"),
    "torch.cuda.memory_reserved": _d(FAKE, "the live bytes' peak since the last empty_cache (what the cache holds at least; the replay knows the rest)"),
    "torch.cuda.max_memory_reserved": _d(FAKE, "the peak bytes (as memory_reserved)"),
    "torch.cuda.memory_cached": _d(FAKE, "deprecated alias of memory_reserved"),
    "torch.cuda.max_memory_cached": _d(FAKE, "deprecated alias of max_memory_reserved"),
    "torch.cuda.mem_get_info": _d(FAKE, "(total - reserved, total) of the target GPU"),
    "torch.cuda.device_memory_used": _d(FAKE, "as memory_reserved"),
    "torch.cuda.memory_usage": _d(FAKE, "percent of the target's memory in use by live bytes"),
    "torch.cuda.memory_stats": _d(FAKE, "allocated/reserved/active counters from the trace"),
    "torch.cuda.memory_stats_as_nested_dict": _d(FAKE, "as memory_stats, nested"),
    "torch.cuda.memory_summary": _d(FAKE, "a one-line summary of the trace's figures"),
    "torch.cuda.memory_snapshot": _d(UNSUPPORTED, "the allocator's segments exist only after vest's replay"),
    "torch.cuda.empty_cache": _d(FAKE, _NOOP),
    "torch.cuda.reset_peak_memory_stats": _d(FAKE, _NOOP),
    "torch.cuda.reset_max_memory_allocated": _d(FAKE, _NOOP),
    "torch.cuda.reset_max_memory_cached": _d(FAKE, _NOOP),
    "torch.cuda.reset_accumulated_memory_stats": _d(FAKE, _NOOP),
    "torch.cuda.set_per_process_memory_fraction": _d(FAKE, "recorded (MEMORY_FRACTION): the estimate says the job "
                                                          "runs out past that share of the GPU"),
    "torch.cuda.get_per_process_memory_fraction": _d(FAKE, "what the script set, else 1.0, the default"),
    "torch.cuda.get_allocator_backend": _d(FAKE, "native, or cudaMallocAsync when PYTORCH_CUDA_ALLOC_CONF says backend:cudaMallocAsync"),
    "torch.cuda.host_memory_stats": _d(FAKE, "empty: pinned host memory is not device memory"),
    "torch.cuda.host_memory_stats_as_nested_dict": _d(FAKE, "empty, as host_memory_stats"),
    "torch.cuda.reset_peak_host_memory_stats": _d(FAKE, _NOOP),
    "torch.cuda.reset_accumulated_host_memory_stats": _d(FAKE, _NOOP),
    "torch.cuda.ipc_collect": _d(FAKE, _NOOP),
    "torch.cuda.list_gpu_processes": _d(FAKE, "a line saying no process is listed (there is no GPU to ask)"),
    "torch.cuda.caching_allocator_alloc": _d(UNSUPPORTED, "raw allocations outside tensors are not traced"),
    "torch.cuda.caching_allocator_delete": _d(UNSUPPORTED, "raw allocations outside tensors are not traced"),
    "torch.cuda.caching_allocator_enable": _d(UNSUPPORTED, _ALLOC),
    "torch.cuda.caching_allocator_disabled": _d(UNSUPPORTED, _ALLOC),
    "torch.cuda.CUDAPluggableAllocator": _d(UNSUPPORTED, _ALLOC),
    "torch.cuda.change_current_allocator": _d(UNSUPPORTED, _ALLOC),
    "torch.cuda.MemPool": _d(UNSUPPORTED, _ALLOC),
    "torch.cuda.use_mem_pool": _d(UNSUPPORTED, _ALLOC),
    # torch.cuda: NVML readings
    "torch.cuda.utilization": _d(FAKE, "0 (percent): a stand-in reading for the script's logging"),
    "torch.cuda.temperature": _d(FAKE, "0 (degrees C): a stand-in reading"),
    "torch.cuda.power_draw": _d(FAKE, "0 (mW): a stand-in reading"),
    "torch.cuda.clock_rate": _d(FAKE, "0 (MHz): a stand-in reading"),
    # torch.cuda: random numbers
    "torch.cuda.manual_seed": _d(FAKE, _NOOP),
    "torch.cuda.manual_seed_all": _d(FAKE, _NOOP),
    "torch.cuda.seed": _d(FAKE, _NOOP),
    "torch.cuda.seed_all": _d(FAKE, _NOOP),
    "torch.cuda.initial_seed": _d(FAKE, "torch's default seed (67280421310721)"),
    "torch.cuda.get_rng_state": _d(FAKE, "a 16-byte uint8 state (seed and offset of CUDA's Philox generator)"),
    "torch.cuda.get_rng_state_all": _d(FAKE, "one state per device"),
    "torch.cuda.set_rng_state": _d(FAKE, _NOOP),
    "torch.cuda.set_rng_state_all": _d(FAKE, _NOOP),
    "torch.cuda.default_generators": _d(FAKE, "one cuda generator per device"),
    # torch.cuda: streams and events
    "torch.cuda.Stream": _d(FAKE, "FakeCudaStream"),
    "torch.cuda.Event": _d(FAKE, "FakeCudaEvent"),
    "torch.cuda.ExternalStream": _d(UNSUPPORTED, _HANDLE + " (a stream made elsewhere)"),
    "torch.cuda.get_stream_from_external": _d(UNSUPPORTED, _HANDLE + " (a stream made elsewhere)"),
    "torch.cuda.current_stream": _d(FAKE, "the stream set last, else the default stream"),
    "torch.cuda.default_stream": _d(FAKE, "the default stream (id 0)"),
    "torch.cuda.set_stream": _d(FAKE, "sets the current stream"),
    "torch.cuda.stream": _d(FAKE, "torch's StreamContext over the faked current_stream/set_stream"),
    "torch.cuda.StreamContext": _d(REAL, "pure Python over current_stream/set_stream, which are faked"),
    "torch.cuda.is_current_stream_capturing": _d(FAKE, "false: nothing is captured"),
    "torch.cuda.set_sync_debug_mode": _d(FAKE, _NOOP),
    "torch.cuda.get_sync_debug_mode": _d(FAKE, "0, the default"),
    # torch.cuda: graphs and other executors
    "torch.cuda.CUDAGraph": _d(UNSUPPORTED, _GRAPHS),
    "torch.cuda.graph": _d(UNSUPPORTED, _GRAPHS),
    "torch.cuda.graph_pool_handle": _d(UNSUPPORTED, _GRAPHS),
    "torch.cuda.make_graphed_callables": _d(UNSUPPORTED, _GRAPHS),
    "torch.cuda.export_dot": _d(UNSUPPORTED, _GRAPHS),
    "torch.cuda.export_graph_data": _d(UNSUPPORTED, _GRAPHS),
    "torch.cuda.GreenContext": _d(UNSUPPORTED, "green contexts partition a real GPU's SMs"),
    # torch.cuda: submodules
    "torch.cuda.amp": _d(NAMESPACE, "walked (torch.cuda.amp.*)"),
    "torch.cuda.profiler": _d(NAMESPACE, "walked (torch.cuda.profiler.*)"),
    "torch.cuda.memory": _d(NAMESPACE, "its public functions are re-exported by torch.cuda and decided there"),
    "torch.cuda.random": _d(NAMESPACE, "re-exported by torch.cuda and decided there"),
    "torch.cuda.streams": _d(NAMESPACE, "re-exported by torch.cuda and decided there"),
    "torch.cuda.graphs": _d(NAMESPACE, "re-exported by torch.cuda (CUDA graphs: unsupported)"),
    "torch.cuda.graph_annotations": _d(NAMESPACE, "annotations for CUDA graphs (unsupported with them)"),
    "torch.cuda.nvtx": _d(NAMESPACE, "real: NVTX markers are host calls, no-ops with no profiler attached"),
    "torch.cuda.nccl": _d(NAMESPACE, "not faked: direct NCCL calls need devices; torch.distributed is faked instead"),
    "torch.cuda.jiterator": _d(NAMESPACE, "not faked: a jiterator kernel's outputs have no meta function"),
    "torch.cuda.sparse": _d(NAMESPACE, "legacy sparse tensor types (real)"),
    "torch.cuda.tunable": _d(NAMESPACE, "TunableOp settings: real, they pick kernels, not memory"),
    # legacy tensor and storage types: type objects, real
    **{f"torch.cuda.{n}": _d(REAL, "a legacy type object (isinstance and dtype names)")
       for n in ("BFloat16Storage", "BFloat16Tensor", "BoolStorage", "BoolTensor", "ByteStorage", "ByteTensor",
                 "CharStorage", "CharTensor", "ComplexDoubleStorage", "ComplexFloatStorage", "DoubleStorage",
                 "DoubleTensor", "FloatStorage", "FloatTensor", "HalfStorage", "HalfTensor", "IntStorage", "IntTensor",
                 "LongStorage", "LongTensor", "ShortStorage", "ShortTensor")},
    # torch.cuda.amp
    "torch.cuda.amp.GradScaler": _d(FAKE, "grad_scaler.FakeCudaGradScaler (installed by standins.patched)"),
    "torch.cuda.amp.autocast": _d(REAL, "torch.amp.autocast, whose CUDA op lists _fakecuda emulates"),
    "torch.cuda.amp.custom_fwd": _d(REAL, "a decorator"),
    "torch.cuda.amp.custom_bwd": _d(REAL, "a decorator"),
    "torch.cuda.amp.amp_definitely_not_available": _d(ANSWERED, "false"),
    # torch.cuda.profiler
    "torch.cuda.profiler.start": _d(FAKE, _NOOP + " (cudaProfilerStart)"),
    "torch.cuda.profiler.stop": _d(FAKE, _NOOP + " (cudaProfilerStop)"),
    "torch.cuda.profiler.profile": _d(REAL, "a context manager over the faked start/stop"),
    # torch.accelerator
    "torch.accelerator.is_available": _d(REAL, "true through the answered torch.cuda.is_available"),
    "torch.accelerator.current_accelerator": _d(REAL, "cuda: the build's accelerator, checked by the answered is_available"),
    "torch.accelerator.device_count": _d(REAL, "through the answered torch.cuda.device_count"),
    "torch.accelerator.get_device_capability": _d(FAKE, "the target's capability as torch.accelerator's dict"),
    "torch.accelerator.current_device_idx": _d(FAKE, "0"),
    "torch.accelerator.current_device_index": _d(FAKE, "0"),
    "torch.accelerator.set_device_idx": _d(FAKE, _NOOP),
    "torch.accelerator.set_device_index": _d(FAKE, _NOOP),
    "torch.accelerator.device_index": _d(FAKE, "a context manager that selects nothing, as torch.cuda.device"),
    "torch.accelerator.current_stream": _d(FAKE, "as torch.cuda.current_stream"),
    "torch.accelerator.set_stream": _d(FAKE, "as torch.cuda.set_stream"),
    "torch.accelerator.synchronize": _d(FAKE, "returns at once"),
    "torch.accelerator.empty_cache": _d(FAKE, _NOOP),
    "torch.accelerator.empty_host_cache": _d(FAKE, _NOOP),
    "torch.accelerator.get_memory_info": _d(FAKE, "as torch.cuda.mem_get_info"),
    "torch.accelerator.memory_allocated": _d(FAKE, "as torch.cuda.memory_allocated"),
    "torch.accelerator.max_memory_allocated": _d(FAKE, "as torch.cuda.max_memory_allocated"),
    "torch.accelerator.memory_reserved": _d(FAKE, "as torch.cuda.memory_reserved"),
    "torch.accelerator.max_memory_reserved": _d(FAKE, "as torch.cuda.max_memory_reserved"),
    "torch.accelerator.memory_stats": _d(FAKE, "as torch.cuda.memory_stats"),
    "torch.accelerator.reset_peak_memory_stats": _d(FAKE, _NOOP),
    "torch.accelerator.reset_accumulated_memory_stats": _d(FAKE, _NOOP),
    "torch.accelerator.Graph": _d(UNSUPPORTED, _GRAPHS),
    # classes
    "torch.Stream": _d(FAKE, "FakeStream"), "torch.Event": _d(FAKE, "FakeEvent"),
    "torch.Generator": _d(FAKE, "FakeGenerator"),
    "torch.amp.GradScaler": _d(FAKE, "grad_scaler.FakeGradScaler (installed by standins.patched)"),
    # pinned memory
    "torch.Tensor.pin_memory": _d(FAKE, "the tensor itself: pinned memory is host memory, and pinning needs a driver"),
    "torch.Tensor.is_pinned": _d(FAKE, "true for a tensor pinned through the stand-in"),
    # the caching allocator holds a block used on a second stream until that stream's work is done;
    # the fake run's work is done at once, so the block is free when the tensor is (no extra bytes)
    "torch.Tensor.record_stream": _d(FAKE, _NOOP + " (every fake stream's work completes at once)"),
}


def decision(api: str) -> Decision | None:
    """The decision for one API of surface(): the table's, or the rule for its family."""
    if api in DECISIONS:
        return DECISIONS[api]
    if api.endswith("(pin_memory=)"):
        return Decision(FAKE, "pin_memory=True is dropped: the host tensor is made unpinned (no device bytes either way)")
    cls, _, method = api.rpartition(".")
    if cls in ("torch.amp.GradScaler", "torch.cuda.amp.GradScaler") and method:
        from . import grad_scaler   # torch-heavy: imported when a scaler method is asked about

        fake = grad_scaler.FakeCudaGradScaler if cls.startswith("torch.cuda") else grad_scaler.FakeGradScaler
        if hasattr(fake, method):
            return Decision(FAKE, f"grad_scaler.{fake.__name__}.{method}")
        return None
    if cls in CLASS_STANDINS:
        fake = CLASS_STANDINS[cls]
        if any(method in k.__dict__ for k in fake.__mro__ if k.__module__.startswith("vest_slurm.")):
            return Decision(FAKE, f"{fake.__name__}.{method}")
        if method in _INHERITED_OK:
            return Decision(REAL, "inherited: a field or a CPU-generator method, no driver call")
    return None


def undecided() -> list[str]:
    """Public APIs of the installed torch that have no decision (a new torch added them)."""
    return sorted(api for api in surface() if decision(api) is None)


# ---- the patches -----------------------------------------------------------------------------------

# torch.cuda.set_per_process_memory_fraction(f) as the script called it: (f, its file:line), or None.
# The caching allocator then refuses to reserve past f of the GPU's memory (the job's OOM comes
# there), so the estimate says what share the job gave itself (runner's flag).
MEMORY_FRACTION: list = [None]


def _shadow_place() -> str:
    from ..estimate._shadow import script_frame

    return script_frame()


def patches(ans: Answers) -> list[tuple[object, str, object]]:
    """(object, attribute, replacement) for every FAKE and UNSUPPORTED API that is installed here."""
    cur = {"stream": FakeCudaStream(_stream_id=0)}
    default = cur["stream"]
    pinned: dict[int, weakref.ref] = {}   # by id: a WeakSet would compare tensors with ==

    def current_stream(a):
        return cur["stream"]

    def set_stream(a):
        cur["stream"] = a["stream"] if a["stream"] is not None else default

    def stream_ctx(a):
        return torch.cuda.StreamContext(a["stream"])

    def mem_info(a):
        return (_total() - ans.reserved_bytes(), _total())

    class FakeCudartBinding:
        """torch.cuda.cudart(): torch's binding of the CUDA runtime (torch.cuda.profiler's start and
        stop, Nsight ranges around steps), answered as the node's runtime would."""
        from torch._C import _cudart as _real
        success = _real.cudaError.success

        def cudaProfilerStart(self):
            return self.success

        cudaProfilerStop = cudaProfilerStart

        def cudaGetErrorString(self, error):
            return "no error" if error == self.success else self._raw(f"cudaGetErrorString({error})")

        def cudaMemGetInfo(self, device):
            return mem_info(None)

        def cudaHostRegister(self, ptr, size, flags):   # pins host memory: nothing on the device
            return self.success

        def cudaHostUnregister(self, ptr):
            return self.success

        def _raw(self, api):
            raise NotSupportedHere(f"torch.cuda.cudart().{api}", _HANDLE)

        def __getattr__(self, name):
            if name.startswith("cuda"):
                self._raw(name)
            raise AttributeError(name)

    def set_fraction(a):
        fraction = float(a["fraction"])
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")   # torch's own check
        MEMORY_FRACTION[0] = (fraction, _shadow_place())

    def summary(a):
        return (f"vest-slurm fake CUDA: {ans.live_bytes()} bytes allocated now, {ans.peak_bytes()} at peak "
                "(the caching allocator's figures come after vest replays the trace)")

    def alloc_backend(a):
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
        return "cudaMallocAsync" if "backend:cudaMallocAsync" in conf.replace(" ", "") else "native"

    def tf32(a):
        return tuple(torch.cuda.get_device_capability()) >= (8, 0)

    def capability(a):
        major, minor = torch.cuda.get_device_capability()
        return {"major": major, "minor": minor}

    @contextlib.contextmanager
    def _select_nothing():
        yield

    class FakeDevice:
        """torch.cuda.device(device) / device_of(obj): one fake device per rank, nothing to select."""

        def __init__(self, device):
            self.idx = _device_index(device) if not isinstance(device, torch.Tensor) else 0
            self.prev_idx = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class FakeDeviceOf(FakeDevice):
        def __init__(self, obj):
            super().__init__(0)

    class FakeDeviceIndex(FakeDevice):
        def __init__(self, device, /):
            super().__init__(device if device is not None else 0)

    def pin_memory(a):
        t = a.get("self") if "self" in a else a["args"][0]
        pinned[id(t)] = weakref.ref(t, lambda _r, key=id(t): pinned.pop(key, None))
        return t

    def is_pinned(a):
        t = a.get("self") if "self" in a else a["args"][0]
        ref = pinned.get(id(t))
        return ref is not None and ref() is t

    none = lambda a: None   # noqa: E731
    const = lambda v: (lambda a: v)   # noqa: E731
    impl = {
        "torch.cuda.is_tf32_supported": tf32,
        "torch.cuda.is_initialized": const(True),
        "torch.cuda.init": none, "torch.cuda.set_device": none,
        "torch.cuda.can_device_access_peer": const(True),
        "torch.cuda.memory_allocated": lambda a: ans.live_bytes(),
        "torch.cuda.max_memory_allocated": lambda a: ans.peak_bytes(),
        "torch.cuda.memory_reserved": lambda a: ans.reserved_bytes(),
        "torch.cuda.max_memory_reserved": lambda a: ans.peak_bytes(),
        "torch.cuda.memory_cached": lambda a: ans.reserved_bytes(),
        "torch.cuda.max_memory_cached": lambda a: ans.peak_bytes(),
        "torch.cuda.mem_get_info": mem_info,
        "torch.cuda.device_memory_used": lambda a: ans.reserved_bytes(),
        "torch.cuda.memory_usage": lambda a: int(100 * ans.live_bytes() / _total()),
        "torch.cuda.memory_stats": lambda a: _memory_stats(ans),
        "torch.cuda.memory_stats_as_nested_dict": lambda a: _nested(_memory_stats(ans)),
        "torch.cuda.memory_summary": summary,
        "torch.cuda.get_per_process_memory_fraction": lambda a: (MEMORY_FRACTION[0] or (1.0,))[0],
        "torch.cuda.set_per_process_memory_fraction": set_fraction,
        "torch.cuda.empty_cache": lambda a: ans.empty_cache(),
        "torch.accelerator.empty_cache": lambda a: ans.empty_cache(),
        "torch.cuda.get_allocator_backend": alloc_backend,
        "torch.cuda.host_memory_stats": lambda a: {},
        "torch.cuda.host_memory_stats_as_nested_dict": lambda a: {},
        "torch.cuda.list_gpu_processes": const("GPU:0\nno processes are listed (vest-slurm fake CUDA)"),
        "torch.cuda.utilization": const(0), "torch.cuda.temperature": const(0),
        "torch.cuda.power_draw": const(0), "torch.cuda.clock_rate": const(0),
        "torch.cuda.initial_seed": const(67280421310721),
        "torch.cuda.get_rng_state": lambda a: torch.zeros(16, dtype=torch.uint8, device="cpu"),
        "torch.cuda.get_rng_state_all": lambda a: [torch.zeros(16, dtype=torch.uint8, device="cpu")
                                                   for _ in range(torch.cuda.device_count())],
        "torch.cuda.current_stream": current_stream, "torch.cuda.default_stream": lambda a: default,
        "torch.cuda.set_stream": set_stream, "torch.cuda.stream": stream_ctx,
        "torch.cuda.is_current_stream_capturing": const(False),
        "torch.cuda.get_sync_debug_mode": const(0),
        "torch.cuda.profiler.start": none, "torch.cuda.profiler.stop": none,
        "torch.cuda.cudart": lambda a: FakeCudartBinding(),
        "torch.accelerator.get_device_capability": capability,
        "torch.accelerator.current_device_idx": const(0), "torch.accelerator.current_device_index": const(0),
        "torch.accelerator.current_stream": current_stream, "torch.accelerator.set_stream": set_stream,
        "torch.accelerator.synchronize": none,
        "torch.accelerator.get_memory_info": mem_info,
        "torch.accelerator.memory_allocated": lambda a: ans.live_bytes(),
        "torch.accelerator.max_memory_allocated": lambda a: ans.peak_bytes(),
        "torch.accelerator.memory_reserved": lambda a: ans.reserved_bytes(),
        "torch.accelerator.max_memory_reserved": lambda a: ans.peak_bytes(),
        "torch.accelerator.memory_stats": lambda a: _memory_stats(ans),
        "torch.Tensor.pin_memory": pin_memory, "torch.Tensor.is_pinned": is_pinned,
    }
    classes = {
        "torch.cuda.device": FakeDevice, "torch.cuda.device_of": FakeDeviceOf,
        "torch.accelerator.device_index": FakeDeviceIndex,
        **CLASS_STANDINS,
    }
    out: list[tuple[object, str, object]] = []
    for api, obj in surface().items():
        dec = decision(api)
        if dec is None or dec.kind not in (FAKE, UNSUPPORTED) or "(" in api:
            continue
        owner_name, _, attr = api.rpartition(".")
        if owner_name in CLASS_STANDINS or owner_name.endswith("GradScaler"):
            continue   # methods live on the fake class
        owner = _resolve(owner_name) if owner_name != "torch.Tensor" else torch.Tensor
        if dec.kind == UNSUPPORTED:
            out.append((owner, attr, unsupported(api, obj, dec.why)))
        elif api in classes:
            out.append((owner, attr, classes[api]))
        elif api in impl:
            out.append((owner, attr, standin(api, obj, impl[api])))
        elif dec.why == _NOOP or dec.why.startswith(_NOOP):
            out.append((owner, attr, standin(api, obj, none)))
        elif api == "torch.cuda.default_generators":
            out.append((owner, attr, tuple(FakeGenerator(f"cuda:{i}") for i in range(torch.cuda.device_count()))))
        # else: installed elsewhere (the GradScalers by standins.patched)
    # PyTorch's memory-visualizer recipe ("Understanding CUDA Memory Usage"): recording the allocation
    # history is the allocator's host-side bookkeeping (no device memory), so it changes nothing to
    # estimate; the snapshot it dumps needs the allocator's segments, which exist only after vest's
    # replay (vest estimate --snapshot writes one). Runs stop at their third step, before most dumps.
    import torch.cuda.memory as cuda_memory

    for name, obj in (("_record_memory_history", none), ("_dump_snapshot", None), ("_snapshot", None)):
        real = getattr(cuda_memory, name, None)
        if real is None:
            continue
        api = f"torch.cuda.memory.{name}"
        out.append((cuda_memory, name, standin(api, real, obj) if obj is not None else
                    unsupported(api, real, "the allocator's segments exist only after vest's replay (vest estimate "
                                "--snapshot writes the estimate's, in this format)")))
    # torch.Stream / torch.Event / torch.Generator are also reached as torch.cuda.streams.*, torch._C.*
    import torch.cuda.streams as streams

    out += [(streams, "Stream", FakeCudaStream), (streams, "Event", FakeCudaEvent)]
    for name in pin_memory_factories():
        real = _resolve(name)
        out.append((torch, name.split(".", 1)[1], _drop_pin_memory(real)))
    out += _legacy_default_type()
    return out


_HALF_TYPES = {"FloatTensor": torch.float32, "DoubleTensor": torch.float64, "HalfTensor": torch.float16,
               "BFloat16Tensor": torch.bfloat16}


def _legacy_default_type() -> list[tuple[object, str, object]]:
    """``torch.set_default_tensor_type('torch.cuda.FloatTensor')`` (nerf-pytorch and other research
    code of its time): every factory without a device, and the legacy constructor
    ``torch.Tensor(data)``, then makes CUDA tensors. Set here as the default device "cuda" (which
    the fake GPU's factories take) and the type's dtype, and ``torch.Tensor(...)`` made on it; a
    host type is set for real (and ends the CUDA default)."""
    real_set = torch.set_default_tensor_type
    real_new = torch.Tensor.__new__
    on = [False]

    @functools.wraps(real_set)
    def set_default_tensor_type(t, /):
        name = t if isinstance(t, str) else f"{getattr(t, '__module__', '')}.{getattr(t, '__name__', '')}"
        module, _, kind = name.rpartition(".")
        if module == "torch.cuda" and kind in _HALF_TYPES:
            torch.set_default_dtype(_HALF_TYPES[kind])
            torch.set_default_device("cuda")
            on[0] = True
            return None
        if on[0]:
            torch.set_default_device(None)
            on[0] = False
        return real_set(t)

    def legacy_new(cls, *args, **kwargs):
        if on[0] and cls is torch.Tensor and "device" not in kwargs:
            return real_new(cls, *args, **kwargs).to("cuda")
        if cls is not torch.Tensor and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            # a tagging subclass made of a tensor (``Tagged(x)``, MONAI's MetaTensor): an alias of
            # it as ``cls``, as torch makes it, through as_subclass (which the fake mode answers)
            return args[0].as_subclass(cls)
        return real_new(cls, *args, **kwargs)

    set_default_tensor_type.__vest_standin__ = "torch.set_default_tensor_type"
    return [(torch, "set_default_tensor_type", set_default_tensor_type),
            (torch.Tensor, "__new__", staticmethod(legacy_new))]


class TorchScriptNames:
    """TorchScript compiles a call of a torch function by the function's identity (its table of
    builtins, id -> aten op: ``@torch.jit.script`` code calling ``torch.ones_like``, as timm < 1.0's
    activations do at import): a stand-in put in the place of one is given the op of the function
    it stands in for, else scripting fails (the stand-in is no builtin, and its source is a
    wrapper's). ``pairs``: (function, its stand-in); ``undo()`` takes the names back."""

    def __init__(self, pairs):
        from torch.jit import _builtins

        self.named = []
        for old, new in pairs:
            op = _builtins._find_builtin(old) if old is not None and new is not old else None
            if op is not None and _builtins._find_builtin(new) is None:
                _builtins._register_builtin(new, op)
                self.named.append(new)

    def undo(self) -> None:
        from torch.jit import _builtins

        for new in self.named:
            _builtins._get_builtin_table().pop(id(new), None)


def _drop_pin_memory(real):
    @functools.wraps(real)
    def factory(*args, pin_memory=False, **kwargs):
        return real(*args, **kwargs)

    factory.__vest_standin__ = f"torch.{real.__name__}(pin_memory=)"
    return factory
