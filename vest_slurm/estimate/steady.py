"""The rest of the run: the last traced training step, repeated until the allocator settles.

A job runs thousands of steps; the trace holds a few (``--steps``, default 2). After the first step
(which creates the gradients and the optimizer state) every step makes the same allocations and
frees in the same order, but the caching allocator does not start each step in the same state: the
blocks a step leaves cached, and where they sit in their segments, decide whether the next step's
requests fit in them or need a new segment. So reserved memory can still grow at step 3, 4 or
later, after which the layout repeats. The device peak that nvidia-smi reports is the peak over the
whole run.

``extend`` appends copies of the last traced step (the template) to the trace, with fresh block
ids, and stops when reserved memory has not grown for ``patience`` copies in a row (or after
``max_copies``). Blocks that cross a step boundary are carried over: in a steady loop, what step k
leaves alive for step k+1 (the batch, the previous outputs the loop still references) is what step
k+1 frees; the template's frees of blocks from the step before are mapped to the previous copy's
blocks of the same size, in allocation order. When the template cannot be read this way (fewer
than two steps, or what it leaves alive does not match what it takes over, e.g. a script that
accumulates tensors across steps) the trace is left as it is.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from .allocator import CachingAllocator, ReplayResult, _compile, _run, replay, result_of
from .allocator_config import AllocatorConfig
from .trace import AllocEvent, with_block

PATIENCE = 3       # copies in a row without growth before the layout is taken as settled
MAX_COPIES = 16    # at most this many steps are added


def _carried(events: Sequence[AllocEvent], start: int, end: int):
    """(carried_in, carried_out, sizes): blocks the template frees but did not allocate, in the
    order they were allocated; blocks it allocates and leaves alive, in allocation order."""
    alloc_at: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for i, e in enumerate(events[:end]):
        if e.action == "alloc":
            alloc_at[e.block] = i
            sizes[e.block] = e.size_bytes
    in_template = {e.block for e in events[start:end] if e.action == "alloc"}
    freed = {e.block for e in events[start:end] if e.action == "free"}
    carried_in = sorted((b for b in freed if b not in in_template), key=lambda b: alloc_at.get(b, -1))
    carried_out = [e.block for e in events[start:end] if e.action == "alloc" and e.block not in freed]
    return carried_in, carried_out, sizes


def _pairing(carried_in, carried_out, sizes) -> dict[int, int] | None:
    """carried-in block -> the template's carried-out block that takes its place in the next step."""
    by_size_in: dict[int, list[int]] = defaultdict(list)
    by_size_out: dict[int, list[int]] = defaultdict(list)
    for b in carried_in:
        by_size_in[sizes.get(b, -1)].append(b)
    for b in carried_out:
        by_size_out[sizes[b]].append(b)
    if {k: len(v) for k, v in by_size_in.items()} != {k: len(v) for k, v in by_size_out.items()}:
        return None
    return {i: o for size, ins in by_size_in.items() for i, o in zip(ins, by_size_out[size])}


def extend(events: Sequence[AllocEvent], step_ends: Sequence[int], config: AllocatorConfig = AllocatorConfig(),
           patience: int = PATIENCE, max_copies: int = MAX_COPIES) -> tuple[list[AllocEvent], int]:
    """The events with the last traced step repeated until the allocator settles (see the module
    docstring), and the number of steps added (0 when the trace is left as it is)."""
    full, copies, _ = extend_and_replay(events, step_ends, config, patience, max_copies)
    return full, copies


def extend_and_replay(events: Sequence[AllocEvent], step_ends: Sequence[int],
                      config: AllocatorConfig = AllocatorConfig(), patience: int = PATIENCE,
                      max_copies: int = MAX_COPIES) -> tuple[list[AllocEvent], int, ReplayResult]:
    """``extend``, and ``allocator.replay`` of the events it returns (uncapped), from the one
    allocator run that decides when the layout has settled: the uncapped replay of the whole run is
    that run carried on through the loop's clean-up, so it is not made twice."""
    events = list(events)
    if len(step_ends) < 2 or not (0 < step_ends[-2] < step_ends[-1] <= len(events)):
        return events, 0, replay(events, config)
    start, end = step_ends[-2], step_ends[-1]
    carried_in, carried_out, sizes = _carried(events, start, end)
    pair = _pairing(carried_in, carried_out, sizes)
    if pair is None:
        return events, 0, replay(events, config)
    template = events[start:end]

    a = CachingAllocator(config)   # uncapped: the run as replay() makes it, to see when it settles
    peak = [-1, 0, False]          # reserved at its first peak, reserved - allocated then (as replay()), an OOM

    def run(ops) -> None:
        oom, best, frag = _run(a, ops, 0, False)
        if best > peak[0]:
            peak[:2] = best, frag
        peak[2] = peak[2] or oom is not None

    run(_compile(events[:end]))
    next_id = max((abs(e.block) for e in events), default=0) + 1
    prev = {b: b for b in carried_out}   # the blocks the step before left alive, by template block
    added: list[AllocEvent] = []
    copies = still = 0
    while copies < max_copies and still < patience:
        before = a.peak_reserved_bytes
        cur: dict[int, int] = {}
        step: list[AllocEvent] = []
        for e in template:
            if e.action == "alloc":
                cur[e.block] = next_id
                next_id += 1
                step.append(with_block(e, cur[e.block]))
            else:
                step.append(with_block(e, cur[e.block] if e.block in cur else prev[pair[e.block]]))
        run(_compile(step))
        added += step
        prev = {b: cur[b] for b in carried_out}
        copies += 1
        still = still + 1 if a.peak_reserved_bytes == before else 0

    # what follows the last step (the loop's clean-up) frees the last copy's blocks
    tail = [with_block(e, prev[e.block]) if e.action == "free" and e.block in prev else e for e in events[end:]]
    run(_compile(tail))
    full = events[:end] + added + tail
    if peak[2]:   # uncapped, the allocator cannot fail; were it to, replay() stops there
        return full, copies, replay(full, config)
    return full, copies, result_of(a, None, peak[1])
