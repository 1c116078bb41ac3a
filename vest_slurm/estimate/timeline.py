"""The memory of one estimate over the traced steps: as a picture and as a PyTorch memory snapshot.

In: the events the estimate replays on one GPU type (``estimator.replayed_events``: the trace with
that type's workspaces, DDP's buckets and the steps until the allocator settles) and the
allocator settings. Out:

- ``record(events, config)`` -> ``Recording``: the replay through the caching allocator
  (allocator.py) with, after every event, the bytes allocated and reserved and the live bytes of
  each category group (parameters, gradients, optimizer state, activations, temporaries,
  workspaces; each the size of the block it got, so the groups add up to "allocated"), the
  allocator's own trace entries (alloc, free_completed, segment_alloc, segment_free, ...) and its
  segments and blocks at the end.
- ``plot(recordings, path)``: a PNG (matplotlib), one panel per GPU type: the groups stacked, the
  allocated and reserved lines, the peak marked with the op and module that reached it.
- ``snapshot(recordings)``: the dict ``torch.cuda.memory._snapshot()`` returns (``segments`` with
  their ``blocks``, ``device_traces`` with alloc/free events whose ``frames`` name the op, the module
  and the phase), so PyTorch's memory viewer (pytorch.org/memory_viz, ``python -m
  torch.cuda._memory_viz``) shows the GPU run's allocation timeline without a GPU. ``time_us`` is
  the event's position in the trace (nothing was timed), addresses are the replay's fake ones.

No torch import (the snapshot is plain data, pickled); matplotlib only inside ``plot``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Sequence

from .allocator import CachingAllocator, OutOfMemory
from .allocator_config import AllocatorConfig
from .trace import AllocEvent
from ..units import MiB

# The stacked groups, bottom to top (what lives longest at the bottom), from AllocEvent.category.
GROUPS = ("parameters", "gradients", "optimizer state", "activations", "temporaries", "workspaces")
_GROUP_OF = {"parameter": "parameters", "gradient": "gradients", "optimizer_state": "optimizer state",
             "activation": "activations", "input": "activations", "temporary": "temporaries",
             "weight_copy": "temporaries", "other": "temporaries", "": "temporaries", "workspace": "workspaces"}
_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")
MAX_POINTS = 4000   # the picture samples this many events at most (the peak always among them)


@dataclass(frozen=True)
class Recording:
    gpu: str
    allocated: tuple[int, ...]                 # after each event
    reserved: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]        # GROUPS order, after each event
    peak_index: int                            # the event after which allocated is highest
    peak_event: AllocEvent | None
    step_ends: tuple[int, ...]
    trace_entries: tuple[tuple, ...]           # (action, addr, size, stream, event index)
    segments: tuple[dict, ...]                 # at the end, snapshot-shaped (without frames)
    frames: dict                               # block address of a live block -> its event
    events: tuple[AllocEvent, ...]
    oom_at: int | None = None                  # event index where the replay ran out (a capacity)


def record(events: Sequence[AllocEvent], config: AllocatorConfig = AllocatorConfig(), gpu: str = "",
           step_ends: Sequence[int] = (), capacity_bytes: int | None = None) -> Recording:
    a = CachingAllocator(config, capacity_bytes, record_events=True)
    live_group: dict[int, tuple[int, int]] = {}   # block -> (group index, rounded bytes)
    sums = [0] * len(GROUPS)
    allocated, reserved, groups = [], [], [[] for _ in GROUPS]
    entries: list[tuple] = []
    by_addr: dict[int, AllocEvent] = {}
    peak, peak_i, oom_at = -1, 0, None
    for i, e in enumerate(events):
        n = len(a.events)
        try:
            if e.action == "alloc":
                a.malloc(e.block, e.size_bytes, e.stream)
                g = GROUPS.index(_GROUP_OF.get(e.category, "temporaries"))
                b = a._live.get(e.block)
                size = b.size if b is not None else 0   # the block it got: rounded, or unsplit whole
                live_group[e.block] = (g, size)
                sums[g] += size
                if b is not None:
                    by_addr[b.addr] = e
            else:
                a.free(e.block)
                g, size = live_group.pop(e.block, (0, 0))
                sums[g] -= size
        except OutOfMemory:
            oom_at = i
            entries += [(t.action, t.addr, t.size_bytes, t.stream, i) for t in a.events[n:]]
            break
        entries += [(t.action, t.addr, t.size_bytes, t.stream, i) for t in a.events[n:]]
        allocated.append(a.allocated_bytes)
        reserved.append(a.reserved_bytes)
        for k in range(len(GROUPS)):
            groups[k].append(sums[k])
        if a.allocated_bytes > peak:
            peak, peak_i = a.allocated_bytes, i
    live_addrs = {b.addr for b in a._live.values()}
    return Recording(gpu, tuple(allocated), tuple(reserved), tuple(tuple(g) for g in groups), peak_i,
                     events[peak_i] if events else None, tuple(step_ends), tuple(entries), _segments(a),
                     {addr: ev for addr, ev in by_addr.items() if addr in live_addrs}, tuple(events), oom_at)


def _segments(a: CachingAllocator) -> tuple[dict, ...]:
    """The allocator's segments at the end, each with its blocks in address order (mapped ones:
    an expandable segment lists what is mapped), as torch.cuda.memory._snapshot()["segments"]."""
    blocks = [b for b in a._live.values()] + [t[3] for p in (a._small, a._large) for t in p.blocks]
    by_seg: dict[int, list] = {}
    segs = {}
    for b in blocks:
        by_seg.setdefault(id(b.segment), []).append(b)
        segs[id(b.segment)] = b.segment
    out = []
    for k, bs in by_seg.items():
        seg = segs[k]
        bs.sort(key=lambda b: b.addr)
        total = sum(b.size for b in bs)
        out.append({
            "device": 0, "address": seg.base, "total_size": total, "stream": seg.stream,
            "segment_type": "small" if seg.pool.is_small else "large", "segment_pool_id": (0, 0),
            "is_expandable": seg.expandable,
            "allocated_size": sum(b.size for b in bs if b.allocated),
            "active_size": sum(b.size for b in bs if b.allocated),
            "requested_size": sum(b.requested for b in bs if b.allocated),
            "blocks": [{"address": b.addr, "size": b.size, "requested_size": b.requested if b.allocated else 0,
                        "state": "active_allocated" if b.allocated else "inactive"} for b in bs],
        })
    out.sort(key=lambda s: s["address"])
    return tuple(out)


def _frames(e: AllocEvent | None) -> list[dict]:
    """Stack frames naming what made the allocation: the op (innermost), the module, the phase."""
    if e is None:
        return []
    return [{"filename": e.module or "(no module)", "line": 0, "name": e.op or e.category or "?"},
            {"filename": f"{e.phase} ({e.category})", "line": 0, "name": e.phase}]


def snapshot(recordings: Sequence[Recording]) -> dict:
    """torch.cuda.memory._snapshot()'s dict for the replays: GPU type k is device k (its segments at
    the end carry ``"device": k``, its trace is ``device_traces[k]``); ``vest_devices`` names them."""
    segments, traces = [], []
    for k, rec in enumerate(recordings):
        one = _snapshot_one(rec)
        segments += [dict(s, device=k) for s in one["segments"]]
        traces.append(one["device_traces"][0])
    return {"segments": segments, "device_traces": traces, "vest_devices": [r.gpu for r in recordings],
            "allocator_settings": {"note": "replayed by vest-slurm (vest_slurm/estimate/allocator.py) from a CPU "
                                           "trace; nothing was measured"}}


def _snapshot_one(rec: Recording) -> dict:
    events = rec.events
    trace, live = [], {}
    for action, addr, size, stream, i in rec.trace_entries:
        if action == "alloc":
            live[addr] = events[i]
            frames = _frames(events[i])
        elif action == "free_completed":
            frames = _frames(live.pop(addr, None))
        else:
            frames = []
        entry = {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": i,
                 "frames": frames}
        if action == "oom":
            entry["device_free"] = 0
        trace.append(entry)
    segments = []
    for s in rec.segments:
        blocks = [dict(b, frames=_frames(rec.frames.get(b["address"])) if b["state"] == "active_allocated" else [])
                  for b in s["blocks"]]
        segments.append(dict(s, blocks=blocks, frames=[]))
    return {"segments": segments, "device_traces": [trace]}


def recordings_for(spec, summary_of, targets) -> list[Recording]:
    """A Recording per GPU type of ``targets`` ({name: DeviceProfile}) whose trace is at hand
    (``summary_of(profile)``: a TraceSummary, or None / an error where the class did not trace)."""
    from .estimator import TraceSummary, replayed_events

    out = []
    for name, profile in targets.items():
        summary = summary_of(profile)
        if not isinstance(summary, TraceSummary):
            continue
        events, config = replayed_events(summary, spec, profile)
        out.append(record(events, config, name, summary.trace.step_ends))
    return out


def write(recordings: Sequence[Recording], timeline_png: str | None, snapshot_pickle: str | None,
          title: str = "") -> list[str]:
    """Write what was asked for; returns the lines to tell the user."""
    import pickle

    said = []
    if timeline_png:
        plot(recordings, timeline_png, title)
        said.append(f"memory timeline written to {timeline_png} ({len(recordings)} panel(s))")
    if snapshot_pickle:
        with open(snapshot_pickle, "wb") as f:
            pickle.dump(snapshot(recordings), f)
        said.append(f"memory snapshot written to {snapshot_pickle} (torch.cuda.memory._snapshot() format; "
                    f"device k = {', '.join(f'{k}: {r.gpu}' for k, r in enumerate(recordings))}); open it at "
                    "https://pytorch.org/memory_viz or `python -m torch.cuda._memory_viz trace_plot FILE -o out.html`")
    return said


def _sample(n: int, keep: int) -> list[int]:
    step = max(1, n // MAX_POINTS)
    idx = list(range(0, n, step))
    if keep not in idx:
        idx.append(keep)
        idx.sort()
    if n and idx[-1] != n - 1:
        idx.append(n - 1)
    return idx


def plot(recordings: Sequence[Recording], path: str, title: str = "") -> None:
    """One panel per GPU type: the category groups stacked (MiB), allocated and reserved as lines,
    the steps' ends as dotted lines, the peak marked with its op and module."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(recordings), 1, figsize=(11, 3.6 * len(recordings)), squeeze=False)
    for ax, rec in zip(axes[:, 0], recordings):
        idx = _sample(len(rec.allocated), rec.peak_index)
        ax.stackplot(idx, [[g[i] / MiB for i in idx] for g in rec.groups], labels=GROUPS, colors=_COLORS, alpha=0.85)
        ax.plot(idx, [rec.allocated[i] / MiB for i in idx], color="black", lw=0.8, label="allocated")
        ax.plot(idx, [rec.reserved[i] / MiB for i in idx], color="black", lw=1.2, ls="--", label="reserved")
        for s in rec.step_ends:
            ax.axvline(s, color="grey", lw=0.6, ls=":")
        if rec.step_ends and rec.step_ends[-1] < len(rec.allocated) - 1:
            ax.text(rec.step_ends[-1], 0.70, " the last step repeated until the allocator settles ->",
                    transform=ax.get_xaxis_transform(), fontsize=7, color="grey")
        e, p = rec.peak_event, rec.peak_index
        what = (f"{e.op or '?'} ({e.category}) in {e.module or '(no module)'}, {e.phase}" if e is not None else "")
        ax.annotate(f"peak {rec.allocated[p] / MiB:,.0f} MiB allocated: {what}", xy=(p, rec.allocated[p] / MiB),
                    xytext=(0.02, 0.80), textcoords="axes fraction", fontsize=8,
                    arrowprops=dict(arrowstyle="->", lw=0.8))
        ax.set_title(f"{rec.gpu}: peak reserved {max(rec.reserved, default=0) / MiB:,.0f} MiB"
                     + (f" (out of memory at event {rec.oom_at})" if rec.oom_at is not None else ""), fontsize=10)
        ax.set_ylabel("MiB")
        ax.set_xlabel("allocator event (dotted: end of a training step)")
        ax.margins(x=0)
        ax.set_ylim(0, max(rec.reserved, default=1) / MiB * 1.45)   # room for the legend and the note
    axes[0, 0].legend(loc="upper right", fontsize=7, ncol=4)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_picture_arguments(p) -> None:
    """--timeline / --snapshot (below), shared by `vest estimate` and `vest check`."""
    p.add_argument("--timeline", metavar="PNG", help="draw the memory over the traced steps, by category, "
                                                    "one panel per GPU type (matplotlib)")
    p.add_argument("--snapshot", metavar="PICKLE", help="write the replay as a torch.cuda.memory._snapshot() "
                                                       "pickle (PyTorch's memory_viz opens it); GPU type k is device k")


def write_pictures(ns, spec, summary_of, targets) -> None:
    if not (getattr(ns, "timeline", None) or getattr(ns, "snapshot", None)):
        return
    recs = recordings_for(spec, summary_of, targets)
    title = f"{spec.model}  batch {spec.batch_size} per GPU  {spec.optimizer}  {spec.precision}"
    for line in write(recs, ns.timeline, ns.snapshot, title):
        print(f"vest: {line}", file=sys.stderr)
