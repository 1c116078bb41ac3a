"""The allocator's answers for one sequence of events, computed once: per process across GPU types,
and on disk beside the trace cache for the next process.

Enters: the events estimator._events_for makes for one GPU type (the trace with that type's
workspace sizes and DDP's buckets), the trace's step ends and the allocator settings. Leaves a
``Replayed``: the uncapped replay of the run (with the steps steady.py adds), the smallest capacity
at which it runs (allocator.min_capacity_bytes after flush-and-retry, cuDNN's workspaces at zero;
searched when first asked for: estimator.estimate_from_trace asks only where it decides the peak),
and the events of the whole run, made on demand where the answers were read from disk.

Both answers are pure functions of what the replay reads of each event (action, block, size,
stream; whether it is a cuDNN workspace, which the capacity search zeroes, or DDP's buckets, which
steady.py moves the step ends past), of the step ends and of the settings, and of the code: the key
is a digest of all of it with tracecache's digest of vest_slurm's source. So:

- GPU types whose events differ only in cuDNN workspace sizes (the capacity search zeroes them)
  share one capacity search in a process (the 22 built-in types make 8 event sequences of a CNN,
  ~3 of them without the workspaces);
- ``vest check`` of a job whose trace is in the trace cache reads the replays too (the allocator is
  most of what is left once the trace is read). Off with the trace cache (``VEST_CACHE_DIR=off``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from array import array
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from .allocator import OomPoint, ReplayResult, min_capacity_bytes
from .allocator_config import AllocatorConfig
from .trace import EMPTY_CACHE, AllocEvent, with_size

_FORMAT = 1
MAX_ENTRIES = 4000   # the most recently used answers kept on disk (~300 bytes each)
_CUDNN_MODULES = ("cudnn", "cudnn_find")   # estimator._CUDNN_WORKSPACES: zeroed for the capacity search
_NEEDS: dict[str, int] = {}                # digest of the zeroed run -> min capacity, this process
_NEEDS_KEPT = 256


@dataclass
class Replayed:
    """``result``: the uncapped replay of the whole run. ``need_bytes``: the smallest capacity at
    which it runs, searched on first use (a capacity search replays the run ~15 times; placement
    needs it only where the uncapped peak is above a GPU the live tensors fit in) and then kept,
    on disk too where the trace cache is on."""

    result: ReplayResult
    _need: int | None = None
    _full: list[AllocEvent] | None = None
    _make_full: Callable[[], list[AllocEvent]] | None = field(default=None, repr=False)
    _config: AllocatorConfig | None = field(default=None, repr=False)
    _path: object = field(default=None, repr=False)

    def full(self) -> list[AllocEvent]:
        """The events of the whole run (the trace and the steps steady.py adds)."""
        if self._full is None:
            self._full = self._make_full()
        return self._full

    @property
    def need_bytes(self) -> int:
        if self._need is None:
            # The job runs where its replay reached its reserved peak (every allocation found room
            # there, the workspaces included): the need is never above it. The search over the
            # workspace-free events can land above it, as the allocator's splits of other sizes
            # need not fit the same way.
            self._need = min(need_bytes(self.full(), self._config), self.result.peak_reserved_bytes)
            if self._path is not None:
                _store(self._path, self)
        return self._need


def _digest(events: Sequence[AllocEvent], *extra) -> str:
    """What the replay, steady.py and the capacity search read of each event, and ``extra``."""
    flat = array("q")
    for e in events:
        flag = ((1 if e.module in _CUDNN_MODULES else 0) | (2 if e.module == "ddp_buckets" else 0)
                | (4 if e.module == EMPTY_CACHE else 0))   # (the replay releases the cache there)
        flat.extend((e.action == "alloc", e.block, e.size_bytes, e.stream, flag))
    h = hashlib.sha256(flat.tobytes())
    h.update(json.dumps([_FORMAT, *extra], default=str).encode())
    return h.hexdigest()


def zero_cudnn(events: Sequence[AllocEvent]) -> list[AllocEvent]:
    """The events at capacity: PyTorch falls back to cuDNN plans that fit when a workspace
    allocation fails (Conv_v8.cpp try_plans), down to ones that need none, and benchmark mode
    halves its timing workspace until it fits; the need counts none."""
    return [with_size(e, 0) if e.module in _CUDNN_MODULES and e.action == "alloc" else e for e in events]


def need_bytes(full: list[AllocEvent], config: AllocatorConfig) -> int:
    """The capacity search over ``full`` with no cuDNN workspace (zero_cudnn), kept by digest."""
    zeroed = zero_cudnn(full)
    k = _digest(zeroed, repr(config))
    if k not in _NEEDS:
        while len(_NEEDS) >= _NEEDS_KEPT:
            _NEEDS.pop(next(iter(_NEEDS)))
        _NEEDS[k] = min_capacity_bytes(zeroed, config)
    return _NEEDS[k]


def replayed(events: Sequence[AllocEvent], step_ends: Sequence[int], config: AllocatorConfig,
             with_rest_of_run: Callable[[], tuple[list[AllocEvent], ReplayResult]]) -> Replayed:
    """The answers for ``events`` (``with_rest_of_run()`` makes the whole run from them and its
    uncapped replay: steady.extend_and_replay), read from disk where an earlier process stored them."""
    from . import tracecache

    path = None
    if tracecache.cache_dir() is not None:
        k = _digest(events, list(step_ends), repr(config), tracecache._code_digest())
        path = tracecache.cache_dir() / "replays" / k[:2] / f"{k}.json.gz"
        hit = _load(path)
        if hit is not None:
            return Replayed(hit[0], hit[1], None, lambda: with_rest_of_run()[0], config, path)
    full, result = with_rest_of_run()
    out = Replayed(result, None, full, None, config, path)
    if path is not None:
        _store(path, out)
    return out


def _load(path) -> tuple[ReplayResult, int | None] | None:
    import os

    try:
        doc = json.loads(gzip.decompress(path.read_bytes()))
        os.utime(path)   # used now: the pruning keeps the most recently used
        r = dict(doc["result"])
        r["oom"] = OomPoint(**r["oom"]) if r["oom"] is not None else None
        need = doc["need_bytes"]
        return ReplayResult(**r), None if need is None else int(need)
    except (OSError, EOFError, ValueError, KeyError, TypeError):
        return None   # none, or damaged: a miss, and the store replaces it


def _store(path, out: Replayed) -> None:
    from .tracecache import _prune, write_atomic

    doc = {"result": asdict(out.result), "need_bytes": out._need}   # None: not searched yet
    try:
        write_atomic(path, gzip.compress(json.dumps(doc).encode(), 3))
        _prune(path.parent.parent, MAX_ENTRIES)
    except OSError:
        pass   # a cache that cannot be written costs the next run the replays, nothing else
