"""The optimizer's trace over a run of repeated shard shapes, traced at 4 and 5 copies and scaled.

Enters: the shapes the optimizer steps on one rank (sharding.RankLayout.optimizer_tensors: the
root's shards, then each block's, in unit order) and the event lists of the optimizer traced on
that list with its run of identical blocks cut to 4 and to 5 copies. Leaves: ``repeated_run``
(where the run is) and ``scale`` (the events the whole list would give), pure data, no torch.

Why: torch's optimizers step a list of tensors in passes over it (the foreach kernels, one output
per input in list order, a temporary list dropped last element first; the for-loop and fused
implementations, one tensor after another; the state made per parameter in ``_init_group``). On
fake tensors every pass costs per tensor, so stepping the 291 shards of an 8B model twice was the
largest single part of its estimate. Identical blocks' shards make identical per-tensor events, so
a pass over 4 copies is one per-copy stretch repeated 4 times (a "region"); the rest of the trace
(the root's shards, what the optimizer does once) is fixed. A free in a region frees what the
same copy allocated (a pass over the list in order), the copy d before (a for-loop step freeing
the previous tensor's temporary when it makes the next one; the first copy frees what the fixed
part before it allocated) or the mirrored copy (a list freed from its end); a fixed part frees
the first or the last copy's. Anything else (a region freeing what a fixed part allocated, in
every copy; a fixed part freeing a middle copy's tensor) is not periodic, and the caller traces
the whole list.

Whether it holds is not assumed: the 4-copy trace scaled to 5 must equal the traced 5-copy trace
event for event (every field of every event, which allocation each free frees, the step cuts),
else the whole list is traced (sharded_trace.optimizer_trace).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from .trace import AllocEvent

TRACED_COPIES = (4, 5)   # 4: the template; 5: the check
MIN_COPIES = 6           # below this the two cut traces cost about what the whole list does


class NotPeriodic(Exception):
    """The 4-copy trace is not a fixed part and per-copy regions as described above."""


@dataclass(frozen=True)
class Run:
    """shapes[start : start + period * count] is shapes[start : start + period] repeated count times."""

    start: int
    period: int
    count: int

    def cut(self, shapes: Sequence, copies: int) -> tuple:
        """The list with the run cut to ``copies`` copies."""
        s, p = self.start, self.period
        return tuple(shapes[:s + p * copies]) + tuple(shapes[s + p * self.count:])


def repeated_run(shapes: Sequence, min_count: int = MIN_COPIES) -> Run | None:
    """The run of a repeated period covering the most of ``shapes`` (ties: the shorter period),
    at least ``min_count`` copies, else None."""
    n = len(shapes)
    best = None
    for p in range(1, n // min_count + 1):
        i = 0
        while i + p < n:
            if shapes[i] != shapes[i + p]:
                i += 1
                continue
            j = i
            while j + p < n and shapes[j] == shapes[j + p]:
                j += 1
            count = (j - i) // p + 1   # shapes[i:j+p] has period p
            if count >= min_count and (best is None or p * count > best.period * best.count):
                best = Run(i, p, count)
            i = j + 1
    return best


def _sig(e: AllocEvent) -> tuple:
    return (e.action, e.size_bytes, e.stream, e.phase, e.category, e.module, e.detail, e.op)


def _shape_sig(e: AllocEvent) -> tuple:
    """What makes copies of a stretch alike: a free's size is that of what it frees, which may be
    another copy's or a fixed part's (a for-loop step's first copy frees the root's last temporary),
    so it is left to the rule the free follows."""
    return _sig(e) if e.action == "alloc" else (e.action, e.stream, e.phase, e.category, e.module, e.detail, e.op)


def _regions(sig: list, copies: int) -> list[tuple[int, int]]:
    """(start, period) of each maximal run of exactly ``copies`` copies of a stretch, left to right
    (the shortest period that gives exactly that many; a stretch that allocates begins with an
    allocation, so that its frees of the copy before are the same rule in every copy)."""
    out = []
    n = len(sig)
    i = 0
    while i < n:
        found = None
        for p in range(1, (n - i) // copies + 1):
            t = sig[i:i + p]
            if any(sig[i + c * p:i + (c + 1) * p] != t for c in range(1, copies)):
                continue
            if sig[i + copies * p:i + (copies + 1) * p] == t or (i >= p and sig[i - p:i] == t):
                continue   # more copies than that: not this period
            found = p
            break
        if found is not None and sig[i][0] == "free" and any(x[0] == "alloc" for x in sig[i:i + found]):
            found = None   # a copy's stretch begins with what it makes: this is a rotation of it
        if found is None:
            i += 1
        else:
            out.append((i, found))
            i += copies * found
    return out


def scale(four: tuple[Sequence[AllocEvent], Sequence[int]], five: tuple[Sequence[AllocEvent], Sequence[int]],
          n: int) -> tuple[list[AllocEvent], list[int]]:
    """(events, cuts) of the list with ``n`` copies, from its traces with 4 and 5 copies (events,
    and the indices between the optimizer's construction and its steps): the 4-copy trace cut
    into fixed parts and regions, the copies told apart by every field of their events, else (a
    for-loop step) by all but a free's size; the first cut whose 4-copy trace scaled to 5 is the
    5-copy trace exactly is scaled to n. NotPeriodic where none is."""
    why = "no stretch repeats"
    for sig in (_sig, _shape_sig):
        try:
            if canonical(*_scale(*four, 4, 5, sig)) == canonical(*five):
                return _scale(*four, 4, n, sig)
            why = "the 4-copy trace scaled is not the 5-copy trace"
        except NotPeriodic as e:
            why = str(e)
    raise NotPeriodic(why)


def _scale(events: Sequence[AllocEvent], cuts: Sequence[int], copies: int, n: int,
           sig_of) -> tuple[list[AllocEvent], list[int]]:
    """(events, cuts) of the list with ``n`` copies, from its trace with ``copies`` copies."""
    sig = [sig_of(e) for e in events]
    regions = _regions(sig, copies)   # none: the events do not depend on the copies (checked at 5)
    # where each event sits: (region index or None, copy, offset in the region's stretch)
    where: list[tuple[int | None, int, int]] = [(None, 0, 0)] * len(events)
    for r, (s, p) in enumerate(regions):
        for c in range(copies):
            for o in range(p):
                where[s + c * p + o] = (r, c, o)
    alloc_at = {e.block: i for i, e in enumerate(events) if e.action == "alloc"}
    # What each free frees, as a rule that holds for every copy. A free in a region, at offset o of
    # its stretch: ("back", region, offset, d): what copy c - d allocated there (d = 0: its own copy;
    # a for-loop optimizer frees the previous tensor's temporary when it makes the next one: d = 1),
    # or ("mirror", region, offset, d): what copy copies-1-c-d allocated (a list dropped from its
    # end; d = +-1 where the two passes' stretches begin one tensor apart, which they may where the
    # tensor before the run is like the run's last). A copy whose rule points before the first or
    # past the last copy frees what the fixed part there allocated, kept as it is ("edge"). A free
    # in a fixed part of what a region allocated: its first or its last copy.
    ref: dict[tuple[int, int], tuple] = {}
    edge: dict[tuple[int, int], dict[int, int]] = {}   # (region, offset) -> {copy: the fixed block it frees}
    fixed_ref: dict[int, tuple[int, int, str]] = {}    # event index -> (region, offset, "first"/"last")
    seen: dict[tuple[int, int], list] = {}             # (region, offset) -> [(copy, region, copy, offset) freed]
    for i, e in enumerate(events):
        if e.action != "free":
            continue
        r, c, o = where[i]
        a = alloc_at.get(e.block)
        ar, ac, ao = where[a] if a is not None else (None, 0, 0)
        if r is None:
            if ar is not None:
                if ac not in (0, copies - 1):
                    raise NotPeriodic(f"event {i}, outside the per-copy stretches, frees a middle copy's tensor")
                fixed_ref[i] = (ar, ao, "first" if ac == 0 else "last")
            continue
        if ar is None:
            edge.setdefault((r, o), {})[c] = e.block
            continue
        seen.setdefault((r, o), []).append((c, ar, ac, ao))
    for key, frees in seen.items():
        places = {(ar, ao) for _c, ar, _ac, ao in frees}
        if len(places) != 1:
            raise NotPeriodic(f"region {key[0]}'s copies free at different places")
        (ar, ao), = places
        at_edge = sorted(edge.get(key, {}))
        back = {c - ac for c, _ar, ac, _ao in frees}
        mirror = {copies - 1 - c - ac for c, _ar, ac, _ao in frees}
        if len(back) == 1 and min(back) >= 0 and at_edge == list(range(min(back))):
            ref[key] = ("back", ar, ao, back.pop())
        elif ar != key[0] and len(mirror) == 1 and at_edge == {-1: [0], 0: [], 1: [copies - 1]}.get(min(mirror)):
            ref[key] = ("mirror", ar, ao, mirror.pop())
        else:
            raise NotPeriodic(f"region {key[0]}'s copies free neither their own, an earlier nor the mirrored copy's")
    if set(edge) - set(ref):
        raise NotPeriodic(f"region {min(set(edge) - set(ref))[0]} frees, in each copy, what a fixed part allocated")
    inside = [x for x in cuts if any(s < x < s + copies * p for s, p in regions)]
    if inside:
        raise NotPeriodic(f"a step cut at {inside[0]} falls inside a per-copy stretch")
    nxt = [max((e.block for e in events), default=0) + 1]
    ids: dict[tuple[int, int], int] = {}   # (template index, copy) -> id

    def new_id(i: int, c: int) -> int:
        ids[(i, c)] = nxt[0]
        nxt[0] += 1
        return ids[(i, c)]

    out: list[AllocEvent] = []
    out_cuts: list[int] = []
    size = {e.block: e.size_bytes for e in events if e.action == "alloc"}
    cut_set = sorted(cuts)
    reg_at = {s: (r, p) for r, (s, p) in enumerate(regions)}
    i = 0
    while i <= len(events):
        while cut_set and cut_set[0] == i:
            out_cuts.append(len(out))
            cut_set.pop(0)
        if i == len(events):
            break
        if i in reg_at:
            r, p = reg_at[i]
            for c in range(n):
                for o in range(p):
                    e = events[i + o]
                    if e.action == "alloc":
                        out.append(replace(e, block=new_id(i + o, c)))
                        size[out[-1].block] = e.size_bytes
                        continue
                    kind, ar, ao, d = ref[(r, o)]
                    cc = c - d if kind == "back" else n - 1 - c - d
                    if 0 <= cc < n:
                        block = ids[(regions[ar][0] + ao, cc)]
                    else:   # the fixed block at that edge (the traced copy at the same edge freed it)
                        block = edge[(r, o)][c if c < copies // 2 else copies - (n - c)]
                    out.append(replace(e, block=block, size_bytes=size[block]))   # a free's size is its block's
            i += copies * p
        else:
            e = events[i]
            if i in fixed_ref:
                ar, ao, which = fixed_ref[i]
                e = replace(e, block=ids[(regions[ar][0] + ao, 0 if which == "first" else n - 1)])
            out.append(e)
            i += 1
    return out, out_cuts


def canonical(events: Sequence[AllocEvent], cuts: Sequence[int]) -> tuple:
    """Every field of every event, block ids by first appearance, and the cuts: what ``scale`` must
    reproduce of a traced list."""
    seen: dict[int, int] = {}
    return tuple((e.action, seen.setdefault(e.block, len(seen)), *_sig(e)) for e in events), tuple(cuts)
