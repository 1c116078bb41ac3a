"""A workload's trace at any batch size from its traces at two, checked against a third.

Enters: two ``AllocTrace``s of the same workload on the same GPU class at batch sizes b0 != b1.
Leaves: ``BatchLine.at(b)``, the trace at batch b, and ``same(a, b)``. Pure data, no torch.

Why it holds where it applies: fake CUDA runs the same Python and the same aten ops at every batch
size unless a size decides a branch, so two traces of one workload at two batches make the same
allocations and frees in the same order (the same blocks, streams, phases, categories, modules and
ops); what the batch changes is sizes. A tensor's bytes are a sum of products of its dimensions, one
of which is the batch for an activation, its gradient and a temporary, none for a parameter, a
gradient of one, optimizer state and the workspaces the tracer sizes per GPU type: so each size is
affine in the batch, and so is each number in a convolution's key (its input's N) and in a question
the run asked the fake GPU. ``BatchLine`` is that line through the two traces, per event and per
number: the two must agree in everything but numbers, and every number must lie on an integer line
(``(x1 - x0) * (b - b0)`` divisible by ``b1 - b0`` for every b, so ``x1 - x0`` a multiple of
``b1 - b0``), else ``NotAffine``.

What it does not prove: a branch on the batch between or beyond the two traced batches (a kernel
that splits a large batch, padding to a multiple, a path for batch 1). So a line is not trusted on
its own: the caller (advice.Prober) traces a third batch for real, and uses the line only once its
trace at that batch equals the real one event for event; otherwise every batch is traced.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from .trace import AllocEvent, AllocTrace

SCALED_NOTE = "scaled from the traces at two batch sizes"

_INT = re.compile(r"-?\d+")


def run_notes(notes) -> tuple[str, ...]:
    """A trace's notes about the run, without those about how this trace was had (how long it took,
    that it was read from the trace cache, that its blocks were scaled or why not): what two traces
    of the same run share."""
    from .block_scaling import SCALED_NOTE as BLOCKS_SCALED, WHOLE_NOTE
    from .estimator import CACHED_NOTE

    return tuple(n for n in notes if n != CACHED_NOTE and not (n.startswith("traced in ") and n.endswith(" s"))
                 and not n.startswith((BLOCKS_SCALED, WHOLE_NOTE)))


class NotAffine(Exception):
    """The two traces differ in more than numbers on a line in the batch."""


class _Num:
    """An integer on a line in the batch: x0 at b0, slope per batch (an integer)."""

    __slots__ = ("x0", "slope")

    def __init__(self, x0: int, slope: int):
        self.x0, self.slope = x0, slope


def _fit(a: Any, b: Any, db: int, where: str):
    """The pattern of ``a`` (at b0) and ``b`` (at b0 + db): equal parts kept, integers that differ
    as lines (_Num), strings as their text and integer pieces (a tuple tagged "s")."""
    if a == b and type(a) is type(b) and not isinstance(a, (tuple, list)):
        return a
    if type(a) is not type(b):
        raise NotAffine(f"{where}: {a!r} and {b!r}")
    if isinstance(a, bool) or a is None:
        raise NotAffine(f"{where}: {a!r} and {b!r}")
    if isinstance(a, int):
        if (b - a) % db:
            raise NotAffine(f"{where}: {a} and {b} are on no integer line in the batch")
        return _Num(a, (b - a) // db)
    if isinstance(a, str):
        ta, tb = _INT.split(a), _INT.split(b)
        na, nb = _INT.findall(a), _INT.findall(b)
        if ta != tb:
            raise NotAffine(f"{where}: {a!r} and {b!r}")
        return ("s", tuple(ta), tuple(_fit(int(x), int(y), db, where) for x, y in zip(na, nb)))
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            raise NotAffine(f"{where}: lengths {len(a)} and {len(b)}")
        return (type(a), tuple(_fit(x, y, db, where) for x, y in zip(a, b)))
    raise NotAffine(f"{where}: {a!r} and {b!r}")


def _at(p: Any, steps: int):
    """The value of pattern ``p`` ``steps`` batches from b0 (NotAffine where a number would be negative)."""
    if isinstance(p, _Num):
        v = p.x0 + p.slope * steps
        if v < 0:
            raise NotAffine("a size or number below zero at this batch")
        return v
    if isinstance(p, tuple) and len(p) == 3 and p[0] == "s":
        _, text, nums = p
        vals = [str(_at(n, steps)) if isinstance(n, _Num) else str(n) for n in nums]
        return "".join(t + (vals[i] if i < len(vals) else "") for i, t in enumerate(text))
    if isinstance(p, tuple) and len(p) == 2 and p[0] in (tuple, list):
        return p[0](_at(x, steps) for x in p[1])
    return p


_FIXED = ("action", "block", "stream", "phase", "category", "module", "op")


class BatchLine:
    """The trace as a function of the batch, through ``a`` at ``b0`` and ``b`` at ``b1`` (their notes
    about the run only: run_notes)."""

    def __init__(self, a: AllocTrace, b0: int, b: AllocTrace, b1: int):
        if b0 == b1:
            raise NotAffine("two traces at the same batch make no line")
        if b0 > b1:
            a, b0, b, b1 = b, b1, a, b0
        a, b = replace(a, notes=run_notes(a.notes)), replace(b, notes=run_notes(b.notes))
        self.b0, self.b1 = b0, b1
        db = b1 - b0
        if len(a.events) != len(b.events):
            raise NotAffine(f"{len(a.events)} events at batch {b0}, {len(b.events)} at batch {b1}")
        if a.step_ends != b.step_ends or a.iterations != b.iterations:
            raise NotAffine("the steps end at other events")
        if (a.gpu_asked is None) != (b.gpu_asked is None):
            raise NotAffine("the GPU questions were recorded in one trace only")
        sizes, details = [], {}
        for i, (x, y) in enumerate(zip(a.events, b.events)):
            for f in _FIXED:
                if getattr(x, f) != getattr(y, f):
                    raise NotAffine(f"event {i}: {f} {getattr(x, f)!r} at batch {b0}, {getattr(y, f)!r} at {b1}")
            s = _fit(x.size_bytes, y.size_bytes, db, f"event {i} size")
            sizes.append(s if isinstance(s, _Num) else _Num(s, 0))
            if x.detail != y.detail:
                details[i] = _fit(x.detail, y.detail, db, f"event {i} detail")
        self._a = a
        self._sizes = sizes
        self._details = details
        self._notes = _fit(tuple(a.notes), tuple(b.notes), db, "notes")
        self._asked = None if a.gpu_asked is None else _fit(tuple(a.gpu_asked), tuple(b.gpu_asked), db, "GPU questions")
        self.top = b1            # the largest batch the caller checks the line at, and uses it to
        self.confirmed = False   # set by the caller once a real trace at ``top`` equals the line's

    def at(self, batch: int) -> AllocTrace:
        """The trace at ``batch`` (NotAffine where a size would be negative)."""
        k = batch - self.b0   # the slopes are per batch: (x1 - x0) // (b1 - b0)
        events = []
        for i, (e, s) in enumerate(zip(self._a.events, self._sizes)):
            size = s.x0 + s.slope * k
            if size < 0:
                raise NotAffine(f"event {i}: size below zero at batch {batch}")
            d = _at(self._details[i], k) if i in self._details else e.detail
            if size != e.size_bytes or d != e.detail:
                e = AllocEvent(e.action, e.block, size, e.stream, e.phase, e.category, e.module, d, e.op)
            events.append(e)
        return replace(self._a, events=tuple(events), notes=_at(self._notes, k),
                       gpu_asked=None if self._asked is None else _at(self._asked, k))


def same(a: AllocTrace, b: AllocTrace) -> bool:
    """Whether two traces are the same run: every event, the step ends, the notes about the run
    (run_notes), the GPU questions."""
    return (a.events == b.events and a.step_ends == b.step_ends and a.iterations == b.iterations
            and run_notes(a.notes) == run_notes(b.notes) and a.gpu_asked == b.gpu_asked)


def first_difference(a: AllocTrace, b: AllocTrace) -> str:
    """Where two traces first differ (for the note when a line is not confirmed)."""
    if len(a.events) != len(b.events):
        return f"{len(a.events)} events against {len(b.events)}"
    for i, (x, y) in enumerate(zip(a.events, b.events)):
        if x != y:
            return f"event {i}: {x} against {y}"
    return "the steps, notes or GPU questions"
