"""Which allocations a real GPU run makes that the CPU trace does not (and the reverse).

On a GPU, ``torch.cuda.memory._record_memory_history`` logs every caching-allocator call with its
size and the Python frames that made it. The same training loop traced on the CPU
(vest_slurm/estimate/tracing.py) gives the allocations the estimator replays. Both runs execute the same
loop for the same number of steps, so their allocation sizes should pair up one to one; what a GPU
run allocates beyond the trace is memory the estimator does not model (cuDNN convolution
workspaces, kernel scratch, library buffers), and the Python frame says at which call it happened.
This is how a GPU session finds the next mechanism to model instead of guessing a factor.

Sizes are compared after the allocator's own rounding (multiples of 512 bytes), because that is
the granularity at which the replay and the GPU can differ at all.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

_ROUND = 512


def _rounded(n: int) -> int:
    return max(_ROUND, -(-int(n) // _ROUND) * _ROUND)


@dataclass(frozen=True)
class RealAlloc:
    size: int
    where: str    # innermost Python frame outside torch's own files, "" when the call came from C++


def allocations_from_snapshot(snapshot: dict, device: int = 0) -> list[RealAlloc]:
    """The ``alloc`` entries of a ``torch.cuda.memory._snapshot()`` device trace, in order.

    Each trace entry is a dict with ``action`` ('alloc', 'free_requested', 'free_completed',
    'segment_alloc', ...), ``size`` and ``frames`` (dicts with ``filename``, ``line``, ``name``)."""
    traces = snapshot.get("device_traces") or []
    if device >= len(traces):
        return []
    out = []
    for entry in traces[device]:
        if entry.get("action") != "alloc":
            continue
        out.append(RealAlloc(int(entry.get("size", 0)), _where(entry.get("frames") or [])))
    return out


def _where(frames: list[dict]) -> str:
    """The first frame (innermost first, as torch records them) in user or model code; else the
    innermost frame of torch.nn, which names the layer type."""
    def label(f):
        return f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '')}".strip()

    py = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    for f in py:
        name = str(f.get("filename", ""))
        if "/torch/" not in name and "/vest_slurm/" not in name:
            return label(f)
    for f in py:
        if "/torch/nn/" in str(f.get("filename", "")):
            return label(f)
    return label(py[0]) if py else ""


def aggregate(allocs: list[RealAlloc]) -> list[list]:
    """[rounded size, where, count] rows: the compact form a measuring process hands back."""
    c = Counter((_rounded(a.size), a.where) for a in allocs if a.size > 0)
    return [[size, where, n] for (size, where), n in sorted(c.items())]


def expand(rows: list[list]) -> list[RealAlloc]:
    return [RealAlloc(int(size), str(where)) for size, where, n in rows for _ in range(int(n))]


@dataclass(frozen=True)
class AllocDiff:
    real_count: int
    traced_count: int
    unmatched_real: tuple[tuple[int, int, str], ...]     # (size, count, where), largest total first
    unmatched_traced: tuple[tuple[int, int], ...]        # (size, count), largest total first

    @property
    def unmatched_real_bytes(self) -> int:
        return sum(s * c for s, c, _ in self.unmatched_real)

    @property
    def unmatched_traced_bytes(self) -> int:
        return sum(s * c for s, c in self.unmatched_traced)

    def to_dict(self, top: int = 25) -> dict:
        return {
            "real_allocations": self.real_count, "traced_allocations": self.traced_count,
            "unmatched_real_mib": round(self.unmatched_real_bytes / 2**20, 2),
            "unmatched_traced_mib": round(self.unmatched_traced_bytes / 2**20, 2),
            "unmatched_real": [{"size": s, "count": c, "where": w} for s, c, w in self.unmatched_real[:top]],
            "unmatched_traced": [{"size": s, "count": c} for s, c in self.unmatched_traced[:top]],
        }


def diff_allocations(real: list[RealAlloc], traced_sizes: list[int]) -> AllocDiff:
    """Pair allocations by rounded size; list what is left on each side with where it was made."""
    real_counts = Counter(_rounded(a.size) for a in real if a.size > 0)
    traced_counts = Counter(_rounded(s) for s in traced_sizes if s > 0)
    extra_real = real_counts - traced_counts
    extra_traced = traced_counts - real_counts
    where_of: dict[int, Counter] = defaultdict(Counter)
    for a in real:
        r = _rounded(a.size)
        if r in extra_real:
            where_of[r][a.where] += 1
    rows = []
    for size, count in extra_real.items():
        # attribute the unmatched ones to the call sites that made most allocations of this size
        left = count
        for where, n in where_of[size].most_common():
            take = min(n, left)
            rows.append((size, take, where))
            left -= take
            if not left:
                break
    rows.sort(key=lambda r: (-r[0] * r[1], r[2]))
    traced_rows = sorted(extra_traced.items(), key=lambda r: -r[0] * r[1])
    return AllocDiff(sum(real_counts.values()), sum(traced_counts.values()), tuple(rows), tuple(traced_rows))
