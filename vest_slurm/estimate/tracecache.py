"""A disk cache of CPU traces: asking again about the same workload reads a file instead of tracing.

A user runs `vest check job.sh`, then `vsbatch job.sh`, then resubmits the job: each of them traces
the same workload (and a refused job's advice traces a dozen variants), seconds to minutes of the
login node's CPU. The trace is a pure function of what goes into it, so it is stored and read back
when all of that is the same:

- the workload as traced (the WorkloadSpec; the GPU count, parallelism and allocator settings only
  change the replay, see advice._trace_key, but the whole spec is in the key all the same), and the
  GPU's compute capability and memory the fake device reports;
- the code that traces: a digest of vest_slurm's own source files, and the versions of Python and of
  the libraries that build and run the model (torch, torchvision, timm, transformers, bitsandbytes).

Only workloads whose model is built from a library by name (torchvision, timm, transformers, an MLP
list) are cached. A user factory (``FILE.py:FACTORY``) can import files the key cannot see, and a
training script (dynamic analysis) reads data and arguments; both are traced every time.

What is stored is the trace alone (its allocation events, gzip'd JSON, about 50 KB for a 1B-parameter
LLM), or the error tracing raised (a variant the model refuses, an input that does not match the model); GPU-type workspaces, the allocator replay and the context are applied after reading it, so a
site's calibration or a new cuDNN takes effect at once. The place: ``$VEST_CACHE_DIR``, else
``$XDG_CACHE_HOME/vest-slurm``, else ``~/.cache/vest-slurm``; ``VEST_CACHE_DIR=off`` turns it off. The 2,000 most recently used traces
are kept (about 100 MB); older ones are deleted as new ones are stored.
Entries are written atomically (a temporary file renamed) and a damaged one is ignored and replaced.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from ..errors import EstimateError, VestError, WorkloadError
from .presets import hf_local_path
from .trace import AllocEvent, AllocTrace
from .workload import WorkloadSpec

_FORMAT = 1
MAX_TRACES = 2000   # the most recently used traces kept (about 100 MB at ~50 KB each)
_LIBRARIES = ("torch", "torchvision", "timm", "transformers", "bitsandbytes")
_CACHED_FAMILIES = ("torchvision:", "timm:", "hf:", "mlp:")


def cache_dir() -> Path | None:
    """Where traces are kept; None when the cache is off."""
    env = os.environ.get("VEST_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "no", "none") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vest-slurm"


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """vest_slurm's source and the versions of what traces with it."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    for name in _LIBRARIES:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = "-"
        h.update(f"{name}={version};".encode())
    h.update(sys.version.encode())
    return h.hexdigest()


def key(spec: WorkloadSpec, capability: tuple[int, int], total_memory_bytes: int) -> str | None:
    """The cache key of a trace, or None where the workload is not cached (user code, scripts) or
    the cache is off."""
    if not spec.model.startswith(_CACHED_FAMILIES) or cache_dir() is None:
        return None
    if spec.model.startswith("hf:") and hf_local_path(spec.model[3:]):
        return None   # a local config folder: the user's file, which the key cannot see change
    what = json.dumps({"format": _FORMAT, "spec": asdict(spec), "capability": list(capability),
                       "total_memory_bytes": total_memory_bytes, "code": _code_digest()},
                      sort_keys=True, default=str)
    return hashlib.sha256(what.encode()).hexdigest()


def _path(k: str) -> Path | None:
    d = cache_dir()
    return None if d is None else d / "traces" / k[:2] / f"{k}.json.gz"


def stored(k: str | None) -> bool:
    """Whether a trace (or a tracing error) is stored under ``k``, without reading it."""
    path = _path(k) if k else None
    return path is not None and path.is_file()


_ERRORS = {"EstimateError": EstimateError, "WorkloadError": WorkloadError}


def load(k: str | None) -> tuple[AllocTrace, float] | None:
    """The trace stored under ``k`` and the seconds it took to make; None if there is none (or it
    cannot be read: a damaged entry is a miss, and the next store replaces it). A workload whose
    tracing failed raises the same error again (a variant the model refuses, an input that does not match the model)."""
    if not stored(k):
        return None
    path = _path(k)
    try:
        doc = json.loads(gzip.decompress(path.read_bytes()))
        os.utime(path)   # used now: the pruning keeps the most recently used
        if "error" in doc:
            err = _ERRORS[doc["error"]["class"]](doc["error"]["what"], doc["error"]["fix"])
        else:
            asked = doc.get("gpu_asked")
            trace = AllocTrace(events=tuple(AllocEvent(*e) for e in doc["events"]), iterations=doc["iterations"],
                               notes=tuple(doc["notes"]), step_ends=tuple(doc["step_ends"]),
                               gpu_asked=None if asked is None else tuple(tuple(q) for q in asked))
            return trace, float(doc["seconds"])
    except (OSError, EOFError, ValueError, KeyError, TypeError):
        return None
    raise err


def store(k: str | None, trace: AllocTrace | VestError, seconds: float) -> None:
    """Keep the trace (or the error tracing raised: EstimateError, WorkloadError) under ``k``. Best
    effort: a cache that cannot be written (read-only home, full disk) costs the next run a trace,
    never this one its answer."""
    path = _path(k) if k else None
    if path is None:
        return
    if isinstance(trace, VestError):
        if type(trace).__name__ not in _ERRORS:
            return
        doc = {"error": {"class": type(trace).__name__, "what": trace.what, "fix": trace.fix}, "seconds": seconds}
    else:
        doc = {"events": [[e.action, e.block, e.size_bytes, e.stream, e.phase, e.category, e.module, e.detail, e.op]
                          for e in trace.events],
               "iterations": trace.iterations, "notes": list(trace.notes), "step_ends": list(trace.step_ends),
               "gpu_asked": None if trace.gpu_asked is None else [list(q) for q in trace.gpu_asked],
               "seconds": seconds}
    try:
        write_atomic(path, gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), 3))
        _prune(path.parent.parent)
    except OSError:
        pass


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed over it: a reader sees the old
    file or the new one, never a part (raises OSError where it cannot be written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _prune(traces: Path, keep: int | None = None) -> None:
    """Delete the least recently used traces beyond ``keep`` (MAX_TRACES)."""
    keep = MAX_TRACES if keep is None else keep
    entries = []
    for sub in os.scandir(traces):
        if sub.is_dir():
            entries += [(e.stat().st_mtime, e.path) for e in os.scandir(sub.path) if e.name.endswith(".json.gz")]
    if len(entries) > keep:
        for _, path in sorted(entries)[:len(entries) - keep]:
            try:
                os.unlink(path)
            except OSError:
                pass
