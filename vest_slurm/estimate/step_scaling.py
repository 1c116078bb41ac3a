"""A job's training trace on one GPU, for a model whose stack of identical blocks is traced cut to 4
and to 5 blocks and scaled to all of them.

Enters: the AllocTraces of the whole training run (set-up, every step's forwards and backwards,
optimizer steps, zero_grad) of the model with its stack cut to 4 and to 5 blocks, each with the
``Pass`` marks of its forwards and backwards (where each block's forward and backward begin, read
from hooks that allocate nothing). Leaves: ``scale(four, five, n)``, the AllocTrace of the model
with ``n`` blocks; NotPeriodic where the 4-block trace scaled to 5 is not the traced 5-block trace.
``scale`` is pure data; ``trace_scaled`` makes the traces.

Why it holds where it applies (block_scaling.py does the same for a sharded job's one iteration):
a forward and backward of a stack of identical blocks repeats the same events per block; what
differs between blocks is which earlier block's tensors they free. Beside the passes, the run goes
over every block's tensors in the optimizer's steps (torch's foreach kernels: one output per tensor,
in the parameters' order), zero_grad and, under autocast with checkpointing, the forward's end
(every block's weight casts dropped at once): stretches that repeat once per block ("regions"),
found where the 5-block trace has one more copy than the 4-block one. Each event is placed by
(group: a pass or a region, block, offset from the block's start in that group); a free names its
tensor by the distance in blocks to the block that allocated it. Blocks 0, 1 and 3 of the 4-block
trace are the model's first, second and last; block 2 is repeated for blocks 2 .. n-2. Nothing of
this is assumed: the 5-block trace built from the 4-block one must equal the traced 5-block trace
event for event (sizes, streams, phases, categories, modules, ops, which allocation each free
frees, the step ends), else the caller traces the whole model and says why.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, replace
from functools import partial
from typing import Sequence

import torch

# torch and the tracer come with this module, so estimator.trace_for imports them before it takes
# what is alive out of the collector's scans (oneshot.settle): imported later, a CNN's trace paid
# 0.2 s of full collections over torch's objects
from . import _fakecuda as fc
from . import block_scaling as bs
from . import optimizer_scaling as os_
from .block_scaling import SCALED_NOTE, TRACED_BLOCKS, WHOLE_NOTE
from .sharded_trace import _cut_stack, wrap_units
from .trace import AllocEvent, AllocTrace
from . import tracing   # trace_training looked up at each call (tests count and stand in for it)

# Below this the cut runs (4 + 5 blocks, two steps each) save little over the whole one, and a
# model that does not scale pays both: BERT-base's and GPT-2's 12 blocks are traced whole, models
# of 24 blocks and more (GPT-2 medium, BERT-large, Llama, Mistral, ViT-L) scaled.
MIN_BLOCKS = 16


class NotPeriodic(Exception):
    """The 4-block trace is not passes and regions repeated per block as described above."""


@dataclass(frozen=True)
class Pass:
    """One forward and backward of the 4 blocks: where each block's forward begins (``f``) and its
    output's gradient is ready (``b``: its backward begins), where block 3's forward ends
    (``f_end``) and block 0's backward ends (``b_end``: all its parameters have their gradients)."""

    f: tuple[int, ...]
    b: tuple[int, ...]
    f_end: int
    b_end: int

    def spans(self):
        """(block, part, start, end) of each block's forward and backward."""
        f, b = self.f, self.b
        if not (f[0] < f[1] < f[2] < f[3] < self.f_end <= b[3] < b[2] < b[1] < b[0] < self.b_end):
            raise NotPeriodic("the blocks' forward and backward do not run one after another")
        return [(0, "f", f[0], f[1]), (1, "f", f[1], f[2]), (2, "f", f[2], f[3]), (3, "f", f[3], self.f_end),
                (3, "b", b[3], b[2]), (2, "b", b[2], b[1]), (1, "b", b[1], b[0]), (0, "b", b[0], self.b_end)]


_LAYER = re.compile(r"\.(\d+)(?=\.|$)")


def _sig(e: AllocEvent, prefix: str) -> tuple:
    """What makes two blocks' events alike: every field but the block id, with the block's index
    left out of its module's name."""
    module = e.module[:len(prefix)] + _LAYER.sub(".#", e.module[len(prefix):], count=1) \
        if e.module.startswith(prefix + ".") else e.module
    return (e.action, e.size_bytes, e.stream, e.phase, e.category, module, e.detail, e.op)


class _Layout:
    """Where each event of the 4-block trace sits: ``home[i]`` = (group, block, part) or None (the
    root's and the loop's own events), each group's block bases, and the spans block 2 repeats."""

    def __init__(self, events: Sequence[AllocEvent], passes: Sequence[Pass], five: Sequence[AllocEvent], prefix: str):
        n = len(events)
        self.home: list[tuple[int, int, str] | None] = [None] * n
        self._prefix: list[int] | None = None
        self.base: dict[tuple[int, int, str], int] = {}
        self.span: dict[tuple[int, int, str], tuple[int, int]] = {}
        self.repeated: dict[int, tuple[int, int, str, bool]] = {}   # start -> (end, group, part, ascending)
        lengths = set()
        for g, p in enumerate(passes):
            for blk, part, s, e in p.spans():
                self._place(g, blk, part, s, e)
                lengths.add(e - s)
            self.repeated[p.f[2]] = (p.f[3], g, "f", True)
            self.repeated[p.b[2]] = (p.b[1], g, "b", False)
        sig4 = [_sig(e, prefix) for e in events]
        sig5 = [_sig(e, prefix) for e in five]
        # copies of a region compared without a free's size: a for-loop optimizer's first copy frees
        # the root's last temporary, the others the copy before's (the rule is checked when resolved)
        def loosen(sig):
            return [x if x[0] == "alloc" else x[:1] + x[2:] for x in sig]

        self.groups = len(passes)
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, sig4, sig5, autojunk=False).get_opcodes():
            if tag == "equal":
                continue
            if tag != "insert":
                raise NotPeriodic(f"the 5-block trace is not the 4-block one with events added ({tag} at {i1})")
            per = j2 - j1
            tries = ((sig4, sig5[j1:j2]), (loosen(sig4), loosen(sig5[j1:j2])))
            found = next(([(start, per)] for sig, added in tries
                          if (start := self._region_at(sig, i1, added)) is not None), None)
            if found is None and any(p.f[0] - per <= i1 <= p.b_end + per for p in passes) and per in lengths:
                continue   # a block's forward or backward (placed by the diff anywhere among its copies): its pass repeats it
            for sig, added in tries if found is None else ():
                # where two regions meet, one copy of each (a list made, then dropped from its end:
                # the diff adds both copies at the meeting point)
                for cut in range(1, per):
                    a, b = self._region_at(sig, i1, added[:cut]), self._region_at(sig, i1, added[cut:])
                    if a is not None and b is not None and (a + 4 * cut <= b or b + 4 * (per - cut) <= a):
                        found = [(a, cut), (b, per - cut)]
                        break
                if found:
                    break
            if not found:
                raise NotPeriodic(f"no 4 copies of the {per} events the 5-block trace adds at {i1}")
            for start, period in found:
                self._add_region(events, start, period)

    def _add_region(self, events, start: int, per: int) -> None:
        g = self.groups
        up = self._direction(events, start, per)
        for c in range(4):
            self._place(g, c if up else 3 - c, "r", start + c * per, start + (c + 1) * per)
        s2 = self.base[(g, 2, "r")]
        self.repeated[s2] = (s2 + per, g, "r", up)
        self.groups += 1

    def _homed(self) -> list[int]:
        """How many of the events before each index belong to a block already (prefix counts)."""
        if self._prefix is None:
            out = [0]
            for h in self.home:
                out.append(out[-1] + (h is not None))
            self._prefix = out
        return self._prefix

    def _place(self, g: int, blk: int, part: str, s: int, e: int) -> None:
        self._prefix = None
        if any(self.home[i] is not None for i in range(s, e)):
            raise NotPeriodic(f"events {s}-{e} belong to two blocks")
        for i in range(s, e):
            self.home[i] = (g, blk, part)
        self.base[(g, blk, part)] = s
        self.span[(g, blk, part)] = (s, e)

    def _region_at(self, sig: list, i: int, added: list) -> int | None:
        """The start of exactly 4 copies of a stretch, outside every block's span and every region
        found, that ``added`` (one more copy, maybe rotated) inserted at ``i`` extends (the first
        that begins with what it makes)."""
        per = len(added)
        homed = self._homed()
        for s in range(max(0, i - 4 * per), min(i, len(sig) - 4 * per) + 1):
            st = sig[s:s + per]
            if homed[s + 4 * per] != homed[s]:
                continue
            if any(sig[s + c * per:s + (c + 1) * per] != st for c in range(1, 4)):
                continue
            if sig[s + 4 * per:s + 5 * per] == st or (s >= per and sig[s - per:s] == st):
                continue
            if st[0][0] != "alloc" and any(x[0] == "alloc" for x in st):
                continue   # a rotation of a stretch that allocates
            if not any(st[k:] + st[:k] == added for k in range(per)):
                continue
            return s
        return None

    def _direction(self, events: Sequence[AllocEvent], start: int, per: int) -> bool:
        """Whether the region's copies go first block to last: those that free, as the blocks whose
        tensors they free go; those that only allocate, in the parameters' order (first to last)."""
        alloc_at = self.alloc_at(events)
        for i in range(start, start + per):
            if events[i].action == "free":
                a = alloc_at.get(events[i].block)
                h = self.home[a] if a is not None else None
                if h is not None:
                    return h[1] != 3   # copy 0 frees block 0's (or 1's, a block before) tensor
        return True

    @staticmethod
    def alloc_at(events: Sequence[AllocEvent]) -> dict[int, int]:
        return {e.block: i for i, e in enumerate(events) if e.action == "alloc"}


def _rename(module: str, prefix: str, blk: int, s: int) -> str:
    """A module name of block ``blk``'s events as block ``s`` has it: a block k's name becomes the
    block at the same distance from s (a backward's first op may be labelled with the next block)."""
    if not module.startswith(prefix + "."):
        return module
    head, _, rest = module[len(prefix) + 1:].partition(".")
    if not head.isdigit():
        return module
    return f"{prefix}.{s + int(head) - blk}" + (f".{rest}" if rest else "")


def _scale(four: AllocTrace, lay: _Layout, prefix: str, n: int) -> AllocTrace:
    events = four.events
    home = lay.home
    alloc_at = lay.alloc_at(events)
    fixed = {0: 0, 1: 1, 3: n - 1}
    back = {0: 0, 1: 1, n - 1: 3}
    ids: dict[tuple[int, int], int] = {}
    nxt = [max((e.block for e in events), default=0) + 1]

    def id_in(orig: int, s: int) -> int:
        """The id, in the n-block trace, of what the 4-block trace's ``orig`` is in block s."""
        a = alloc_at[orig]
        if home[a] is None or home[a][1] == back.get(s, 2) != 2:
            return orig
        if (orig, s) not in ids:
            ids[(orig, s)] = nxt[0]
            nxt[0] += 1
        return ids[(orig, s)]

    def counterpart(a: int, st: int) -> int:
        """Index, in the 4-block trace, of the event playing a's role in block st."""
        g, blk, part = home[a]
        tb = back.get(st, 2)
        c = lay.base[(g, tb, part)] + a - lay.base[(g, blk, part)]
        s, e = lay.span[(g, tb, part)]
        if not s <= c < e or events[c].action != "alloc" or events[c].size_bytes != events[a].size_bytes:
            raise NotPeriodic(f"event {a} has no counterpart in block {st}")
        return c

    def resolve(orig: int, s_from: int | None, h_from: int | None) -> int:
        a = alloc_at.get(orig)
        if a is None:
            return orig
        ha = home[a][1] if home[a] is not None else None
        if ha is None or (ha != 2 and h_from != 2):
            if h_from == 2:
                raise NotPeriodic("a repeated block frees what the root or the loop allocated")
            return orig   # a fixed block's (0, 1, the last) or the root's: the same tensor at any n
        if h_from is None:
            raise NotPeriodic(f"event freeing {a} outside the blocks frees a middle block's tensor")
        st = s_from + (ha - h_from)
        if not 0 <= st < n:
            raise NotPeriodic("a free reaches past the first or last block")
        return id_in(events[counterpart(a, st)].block, st)

    out: list[AllocEvent] = []
    cuts = set(four.step_ends)
    out_cuts: list[int] = []

    def emit(i: int, s: int | None) -> None:
        e = events[i]
        h = home[i]
        blk = h[1] if h is not None else None
        if e.action == "alloc":
            e = replace(e, block=id_in(e.block, s) if s is not None else e.block)
        else:
            e = replace(e, block=resolve(e.block, s, blk))
        if blk is not None and h[2] != "r" and e.module:   # (a region's ops run outside the modules)
            e = replace(e, module=_rename(e.module, prefix, blk, s))
        out.append(e)

    i = 0
    while i <= len(events):
        if i in cuts:
            out_cuts.append(len(out))
        if i == len(events):
            break
        if i in lay.repeated:
            end, _g, _part, up = lay.repeated[i]
            if any(i < c < end for c in cuts):
                raise NotPeriodic("a step ends inside a repeated block")
            for s in (range(2, n - 1) if up else range(n - 2, 1, -1)):
                for k in range(i, end):
                    emit(k, s)
            i = end
            continue
        h = home[i]
        emit(i, fixed[h[1]] if h is not None else None)
        i += 1
    return replace(four, events=tuple(out), step_ends=tuple(out_cuts))


def canonical(t: AllocTrace) -> tuple:
    """Every field of every event, block ids by first appearance, the step ends and the count of
    iterations (optimizer_scaling's canonical form, the run's iterations added)."""
    return (*os_.canonical(t.events, t.step_ends), t.iterations)


def first_difference(a: AllocTrace, b: AllocTrace) -> str:
    ca, cb = canonical(a), canonical(b)
    if len(ca[0]) != len(cb[0]):
        return f"{len(ca[0])} events against {len(cb[0])}"
    for i, (x, y) in enumerate(zip(ca[0], cb[0])):
        if x != y:
            return f"event {i}: {x} against {y}"
    return "the step ends" if ca[1] != cb[1] else "none"


def scale(four: tuple[AllocTrace, Sequence[Pass]], five: tuple[AllocTrace, Sequence[Pass]], prefix: str,
          n: int) -> AllocTrace:
    """The AllocTrace of the model with ``n`` blocks, from its traces with 4 and 5 (each with its
    passes); NotPeriodic (saying why) where the 4-block trace scaled to 5 is not the 5-block one."""
    t4, p4 = four
    t5, p5 = five
    if len(p4) != len(p5) or not p4:
        raise NotPeriodic(f"{len(p4)} forward and backward passes marked with 4 blocks, {len(p5)} with 5")
    if t4.gpu_asked != t5.gpu_asked:
        raise NotPeriodic("the 4- and 5-block runs asked the GPU different questions")
    lay = _Layout(t4.events, p4, t5.events, prefix)
    made5 = _scale(t4, lay, prefix, 5)
    if canonical(made5) != canonical(t5):
        raise NotPeriodic(f"the 4-block trace scaled is not the 5-block trace ({first_difference(made5, t5)})")
    return _scale(t4, lay, prefix, n)


class _PassMarks:
    """Hooks on the blocks of the stack (none allocates) recording each pass's Pass marks: a
    forward that starts at block 0 starts a pass; a block's forward inside a backward (activation
    checkpointing's recompute) is part of its backward."""

    def __init__(self, tracer, model, prefix: str):
        self.t = tracer
        self.passes: list[dict] = []
        stack = model.get_submodule(prefix)
        self.blocks = list(stack)
        self.handles = []
        self.params = [[p for p in b.parameters() if p.requires_grad] for b in self.blocks]
        for k, b in enumerate(self.blocks):
            self.handles.append(b.register_forward_pre_hook(partial(self._pre, k)))
            self.handles.append(b.register_forward_hook(partial(self._post, k)))
            for p in self.params[k]:
                self.handles.append(p.register_post_accumulate_grad_hook(partial(self._grad, k)))

    def _now(self) -> int:
        return len(self.t.s.events)

    def _in_backward(self) -> bool:
        return fc.current_autograd_node() is not None or self.t.s.phase == "backward"

    def _pre(self, k, _mod, _inp):
        if self._in_backward():
            return
        if k == 0:
            self.passes.append({"f": {}, "b": {}, "f_end": None, "b_end": None,
                                "left": {id(p) for p in self.params[0]}})
        if self.passes:
            self.passes[-1]["f"].setdefault(k, self._now())

    def _post(self, k, _mod, _inp, out):
        if self._in_backward() or not self.passes:
            return

        if k == len(self.blocks) - 1:
            self.passes[-1]["f_end"] = self._now()
        t = out if isinstance(out, torch.Tensor) else next(
            (o for o in (out if isinstance(out, (tuple, list)) else ()) if isinstance(o, torch.Tensor)), None)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            self.handles.append(t.register_hook(partial(self._grad_ready, self.passes[-1], k)))

    def _grad_ready(self, rec, k, _g):
        rec["b"].setdefault(k, self._now())

    def _grad(self, k, p):
        if k != 0 or not self.passes:
            return
        rec = self.passes[-1]
        rec["left"].discard(id(p))
        if not rec["left"] and rec["b_end"] is None:
            rec["b_end"] = self._now()

    def result(self) -> list[Pass]:
        out = []
        for rec in self.passes:
            f, b = rec["f"], rec["b"]
            m = len(self.blocks)
            if len(f) != m or len(b) != m or rec["f_end"] is None or rec["b_end"] is None:
                raise NotPeriodic("a forward without its backward, or a block without a gradient")
            out.append(Pass(tuple(f[k] for k in range(m)), tuple(b[k] for k in range(m)), rec["f_end"], rec["b_end"]))
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def trace_scaled(spec, capability: tuple[int, int], total_memory_bytes: int) -> AllocTrace:
    """``tracing.trace_training(spec)``, made from the model cut to 4 and 5 blocks where it has a
    stack of at least MIN_BLOCKS identical ones (sharded_trace.wrap_units: transformers' blocks,
    else an nn.ModuleList's) and the 4-block trace scaled gives the 5-block one exactly; else the
    whole model traced, with a note that says why. A model without such a stack is built and
    traced once, as before: the first run finds the stack in the model it builds."""
    import time

    t0 = time.perf_counter()
    stack: list = []    # (prefix, count) of the model the first run built, where it has a stack
    why: list = []      # why it cannot be cut

    def prepare(built, keep):
        if keep == 4:
            found = bs.stack_of([n for n, _m in wrap_units(built.module)])
            if found is None or found[1] < MIN_BLOCKS:
                return built   # traced whole, as it is
            stack.append(found)
        got = _cut_stack(built, *stack[0], keep)
        if isinstance(got, str):
            why.append(got)
            return built
        return got

    made = {}
    for keep in TRACED_BLOCKS:
        marks: list[_PassMarks] = []

        def mark(tracer, model):
            marks.append(_PassMarks(tracer, model, stack[0][0]) if stack and not why else _NoMarks())
            return marks[-1]
        try:
            trace = tracing.trace_training(spec, capability, total_memory_bytes, lambda b, keep=keep: prepare(b, keep), mark)
        except Exception as e:   # the cut model fails where the whole one may not: the whole one says
            if keep == 4 and not stack:
                raise   # it was the whole model
            why.append(f"the {keep}-block model did not trace ({type(e).__name__})")
            break
        if not stack:
            return trace   # no stack of blocks: the whole model's run
        if why:
            if keep == 4:
                return _whole_note(trace, stack[0], why[0])   # not cut: this was the whole model
            break
        try:
            made[keep] = (trace, marks[0].result())
        except NotPeriodic as e:
            why.append(str(e))
            break
    prefix, count = stack[0]
    if not why:
        try:
            scaled = scale(made[4], made[5], prefix, count)
            note = (f"{SCALED_NOTE}: {prefix} has {count} blocks of the same shapes; the training run traced with 4 "
                    f"and 5 of them ({time.perf_counter() - t0:.1f} s), block 2 repeated for blocks 2-{count - 2} "
                    "(the 4-block run repeated gives the 5-block run exactly)")
            notes = tuple(n for n in scaled.notes if not n.startswith("traced in "))   # the 4-block run's
            return replace(scaled, notes=(f"traced in {time.perf_counter() - t0:.2f} s", *notes, note))
        except NotPeriodic as e:
            why.append(str(e))
    return _whole_note(tracing.trace_training(spec, capability, total_memory_bytes), stack[0], why[0])


class _NoMarks:
    def remove(self):
        pass


def _whole_note(trace: AllocTrace, stack: tuple[str, int], why: str) -> AllocTrace:
    return replace(trace, notes=trace.notes + (f"{WHOLE_NOTE}: {stack[0]} ({stack[1]} blocks) traced whole: {why}",))
