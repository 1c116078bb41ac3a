"""A model's stack of identical blocks traced at 4 and 5 blocks and scaled to all of them.

Enters: ``UnitTrace``s (sharding.py) of the same model with its stack of blocks cut to 4 and to 5
(sharded_trace.py cuts the ``nn.ModuleList``), the stack's unit-name prefix and the full block
count. Leaves: ``scale(ut4, prefix, n)``, the UnitTrace the full model would give, and ``same(a,
b)``, whether two UnitTraces make the same allocations and frees in the same order (block ids
compared by where they were allocated, unit marks by position). Pure data, no torch.

Why it is exact where it applies: a forward/backward of a stack of identical blocks repeats the same
allocations per block; what differs between blocks is only which earlier block's tensors a block
frees (the hidden state it received, the saved activations of the block its backward follows).
Each event is placed by (block, forward or backward, offset from that block's start); a free names
its tensor by the distance in blocks to the block that allocated it and that block's offset. In the
4-block trace, blocks 1 and 2 are both "middle" blocks (one before and one after), block 0 is the
first and block 3 the last; block 2's forward and backward are repeated for blocks 2 .. n-2, each
free resolved at the same distance. A sweep, a run of frees of every block's tensors block after
block outside the blocks' own forward and backward (autocast's weight casts dropped at the forward's
end under activation checkpointing), frees every copy's: block 2's part is repeated per copy.
Whether the model is periodic that way is not assumed: the
5-block trace is built from the 4-block one and must equal the traced 5-block trace event for
event (sizes, streams, phases, categories, which block each free frees, every unit mark), else the
caller traces the whole model (sharded_trace.py says so in the notes).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from .sharding import Unit, UnitTrace
from .trace import AllocEvent

TRACED_BLOCKS = (4, 5)   # the cut stacks: 4 has two middle blocks to repeat from, 5 checks it
MIN_BLOCKS = 6           # below this the two cut traces cost as much as the whole model
SCALED_NOTE = "identical blocks scaled"     # the trace's note (the estimate's output repeats it)
WHOLE_NOTE = "identical blocks traced whole"


class NotPeriodic(Exception):
    """The 4-block trace cannot be repeated (a free or mark that no block distance explains)."""


def _blocks(ut: UnitTrace, prefix: str) -> list[Unit]:
    by = {u.name: u for u in ut.units}
    out = []
    for i in range(len(ut.units)):
        u = by.get(f"{prefix}.{i}")
        if u is None:
            break
        out.append(u)
    return out


class _Layout:
    """Where each iteration event of the 4-block trace sits: (block, part, offset)."""

    def __init__(self, ut: UnitTrace, prefix: str):
        bl = _blocks(ut, prefix)
        if len(bl) != 4:
            raise NotPeriodic(f"expected 4 blocks named {prefix}.0-3, found {len(bl)}")
        f = [u.fwd_pre for u in bl]
        b = [u.bwd_pre for u in bl]
        n = len(ut.iteration)
        if not (f[0] < f[1] < f[2] < f[3] <= b[3] < b[2] < b[1] < b[0] <= n):
            raise NotPeriodic("the blocks' forward and backward do not run one after another")
        self.f, self.b, self.n = f, b, n
        self.windows = [(u.fwd_pre, u.fwd_post) for u in bl] + [(u.bwd_pre, u.bwd_post) for u in bl]
        # (start, end, block, repeated): A F1 F2 Q B2 B1 R
        self.segments = [(0, f[1], 0), (f[1], f[2], 1), (f[2], f[3], 2), (f[3], b[2], 3),
                         (b[2], b[1], 2), (b[1], b[0], 1), (b[0], n, 0)]

    def base(self, block: int, part: str) -> int:
        return self.f[block] if part == "f" else self.b[block]

    def where(self, i: int) -> tuple[int, str, int]:
        """(block, part, offset) of iteration index i (the end position belongs to the last segment)."""
        f, b = self.f, self.b
        if i < f[1]:
            blk, part = 0, "f"
        elif i < f[2]:
            blk, part = 1, "f"
        elif i < f[3]:
            blk, part = 2, "f"
        elif i < b[2]:
            blk, part = 3, ("f" if i < b[3] else "b")
        elif i < b[1]:
            blk, part = 2, "b"
        elif i < b[0]:
            blk, part = 1, "b"
        else:
            blk, part = 0, "b"
        return blk, part, i - self.base(blk, part)

    def own(self, i: int) -> int | None:
        """The block whose own forward or backward (its unit marks) holds iteration index i, else None."""
        return next((k % 4 for k, (a, b) in enumerate(self.windows) if a <= i < b), None)

    def seg_of(self, block: int, part: str) -> tuple[int, int]:
        """The span of the repeated block's segment of this part."""
        return (self.f[2], self.f[3]) if part == "f" else (self.b[2], self.b[1])


def scale(ut: UnitTrace, prefix: str, n: int) -> UnitTrace:
    """The UnitTrace of the same model with ``n`` (>= 4) blocks, from its 4-block trace ``ut``."""
    if n < 4:
        raise NotPeriodic("fewer than 4 blocks")
    lay = _Layout(ut, prefix)
    it = ut.iteration
    fixed = {0: 0, 1: 1, 3: n - 1}            # 4-block trace's fixed blocks -> blocks of the n-block model
    back = {0: 0, 1: 1, n - 1: 3}             # and back; every other block is a copy of block 2
    alloc_at = {e.block: i for i, e in enumerate(it) if e.action == "alloc"}
    setup_ids = {e.block for e in ut.setup if e.action == "alloc"}
    ids: dict[tuple[int, int], int] = {}
    nxt = [max([e.block for e in (*ut.setup, *it, *ut.tail)] + [g for u in ut.units for g in u.grad_blocks] + [0]) + 1]

    def new_id(orig: int, s: int) -> int:
        if s == fixed.get(lay.where(alloc_at[orig])[0]) and (orig, s) not in ids:
            ids[(orig, s)] = orig   # the fixed blocks keep their ids (reads of the trace stay familiar)
        elif (orig, s) not in ids:
            ids[(orig, s)] = nxt[0]
            nxt[0] += 1
        return ids[(orig, s)]

    def counterpart(a: int, st: int) -> int:
        """Iteration index, in the 4-block trace, of the event playing a's role in block st."""
        blk, part, off = lay.where(a)
        t2 = back.get(st, 2)
        c = lay.base(t2, part) + off
        if not 0 <= c < len(it) or lay.where(c)[:2] != (t2, part) or it[c].action != "alloc" \
                or it[c].size_bytes != it[a].size_bytes:
            raise NotPeriodic(f"event {a} has no counterpart in block {st}")
        return c

    def resolve(orig: int, s_from: int, blk_from: int | None) -> int:
        """The id, in the n-block trace, of what a free (or mark) in block s_from names."""
        if orig not in alloc_at:
            if blk_from == 2:   # each copy would free it again
                raise NotPeriodic(f"a repeated block frees what was allocated before the iteration "
                                  f"({'set-up' if orig in setup_ids else 'earlier'})")
            return orig
        a = alloc_at[orig]
        t = lay.where(a)[0]
        if t != 2 and blk_from != 2 and blk_from is not None:
            return new_id(orig, fixed[t])
        st = s_from + (t - blk_from)
        if not 0 <= st < n:
            raise NotPeriodic("a free reaches past the first or last block")
        c = counterpart(a, st)
        return new_id(it[c].block, st)

    out: list[AllocEvent] = []
    out_base: dict[tuple[int, str], int] = {}
    sweeps: list[tuple[int, int, tuple[AllocEvent, ...], bool]] = []   # (out start, out end, block 2's frees, ascending)
    order = []   # (segment index, n-block model's block)
    for k, (_s, _e, blk) in enumerate(lay.segments):
        if k == 2:
            order += [(k, s) for s in range(2, n - 1)]
        elif k == 4:
            order += [(k, s) for s in range(n - 2, 1, -1)]
        else:
            order.append((k, fixed[blk]))
    for k, s in order:
        start, end, blk = lay.segments[k]
        for part in ("f", "b"):
            base = lay.base(blk, part)
            if start <= base < end or (k == 6 and part == "b"):
                out_base[(s, part)] = len(out) + base - start
        if k == 3:   # the last block's segment also holds its backward's base
            out_base[(s, "b")] = len(out) + lay.b[3] - start
        runs = {} if k in (2, 4) else {p: (q, up) for p, q, up in _sweeps(it, start, end, lay, alloc_at)}
        for i in range(start, end):
            e = it[i]
            if i in runs:   # block 2's part of a sweep: placed for all its copies below
                q, up = runs[i]
                sweeps.append((len(out), len(out) + q - i, it[i:q], up))
            if e.action == "alloc":
                out.append(replace(e, block=new_id(e.block, s)))
            else:
                out.append(replace(e, block=resolve(e.block, s, blk)))
    out_base.setdefault((0, "f"), lay.f[0])

    def pos(m: int, t: int | None, s: int | None) -> int:
        """Position m (a unit mark of 4-block block t) in the n-block trace, for its block s."""
        blk, part, off = lay.where(min(m, lay.n))
        if m >= lay.n:
            blk, part, off = 0, "b", m - lay.b[0]
        if t is None and blk == 2:
            raise NotPeriodic(f"a mark of the root at {m} falls inside the repeated block")
        if t is None or (t != 2 and blk != 2):
            st = fixed[blk]
        else:
            st = s + (blk - t)
        if (st, part) not in out_base:
            raise NotPeriodic(f"a unit mark at {m} has no place in block {st}")
        if st not in back and not lay.seg_of(2, part)[0] <= lay.base(2, part) + off <= lay.seg_of(2, part)[1]:
            raise NotPeriodic(f"a unit mark at {m} falls outside the repeated block")
        return out_base[(st, part)] + off

    def _root_grad(g: int) -> int:
        """A gradient of a unit outside the stack (the root's): allocated outside the repeated block."""
        if g not in alloc_at:
            return g
        t = lay.where(alloc_at[g])[0]
        if t == 2:
            raise NotPeriodic("a gradient of a unit outside the stack is allocated inside the repeated block")
        return new_id(g, fixed[t])

    blocks = _blocks(ut, prefix)
    idx = {u.name: i for i, u in enumerate(blocks)}
    units: list[Unit] = []
    for u in ut.units:
        t = idx.get(u.name)
        copies = [(s, f"{prefix}.{s}") for s in range(2, n - 1)] if t == 2 else \
            [(fixed[t], f"{prefix}.{fixed[t]}")] if t is not None else [(None, u.name)]
        for s, name in copies:
            grads = tuple(resolve(g, s, t) if t is not None else _root_grad(g) for g in u.grad_blocks)
            units.append(replace(u, name=name, fwd_pre=pos(u.fwd_pre, t, s), fwd_post=pos(u.fwd_post, t, s),
                                 bwd_pre=pos(u.bwd_pre, t, s), bwd_post=pos(u.bwd_post, t, s), grad_blocks=grads))
    for p, q, run, up in reversed(sweeps):   # later ones first: the earlier positions stay
        copies = range(2, n - 1) if up else range(n - 2, 1, -1)
        out[p:q] = [replace(e, block=new_id(e.block, s)) for s in copies for e in run]
        grown = (n - 4) * (q - p)
        if any(p < m < q for u in units for m in (u.fwd_pre, u.fwd_post, u.bwd_pre, u.bwd_post)):
            raise NotPeriodic("a unit mark falls inside a sweep over the blocks")
        units = [replace(u, **{f: getattr(u, f) + grown for f in ("fwd_pre", "fwd_post", "bwd_pre", "bwd_post")
                               if getattr(u, f) >= q}) for u in units]
    return replace(ut, iteration=tuple(out), units=tuple(units), tail=_tail(ut, lay, n, new_id, alloc_at, fixed))


def _sweeps(it, start: int, end: int, lay: _Layout, alloc_at) -> list[tuple[int, int, bool]]:
    """Block 2's part (start, end, ascending) of each sweep in it[start:end]: a run of frees of the
    tensors of every block, block after block (first to last or last to first), as where autocast's
    cache of the weights' casts is emptied at the forward's end (with activation checkpointing
    nothing else holds them) or a list of per-block tensors is dropped at once. In the n-block
    model the run frees every block's, so block 2's part is repeated for each of its copies."""
    out = []
    i = start
    while i < end:
        j = i
        blocks = []
        while j < end and it[j].action == "free" and lay.own(alloc_at.get(it[j].block, -1)) is not None:
            blocks.append(lay.own(alloc_at[it[j].block]))
            j += 1
        if j == i:
            i += 1
            continue
        if set(blocks) == {0, 1, 2, 3} and blocks in (sorted(blocks), sorted(blocks, reverse=True)):
            p = i + blocks.index(2)
            out.append((p, p + blocks.count(2), blocks[0] == 0))
        i = j
    return out


def _tail(ut: UnitTrace, lay: _Layout, n: int, new_id, alloc_at, fixed) -> tuple[AllocEvent, ...]:
    """The frees after the step of what the loop kept: the run of block 2's tensors is repeated per
    copy, in the order the traced blocks' runs go (the loop drops per-block tensors block after
    block, first to last or last to first)."""
    blk = [lay.where(alloc_at[e.block])[0] if e.block in alloc_at else None for e in ut.tail]
    run = [i for i, b in enumerate(blk) if b == 2]
    if not run:
        return tuple(replace(e, block=new_id(e.block, fixed[b])) if b is not None else e
                     for e, b in zip(ut.tail, blk))
    if run != list(range(run[0], run[-1] + 1)):
        raise NotPeriodic("block 2's tensors are not freed together after the step")
    before = [b for b in blk[:run[0]] if b is not None]
    after = [b for b in blk[run[-1] + 1:] if b is not None]
    descending = (before and before[-1] == 3) or (after and after[0] == 1)
    copies = range(n - 2, 1, -1) if descending else range(2, n - 1)
    out: list[AllocEvent] = []
    for i, (e, b) in enumerate(zip(ut.tail, blk)):
        if i == run[0]:
            out += [replace(x, block=new_id(x.block, s)) for s in copies for x in ut.tail[run[0]:run[-1] + 1]]
        elif b == 2:
            continue
        else:
            out.append(replace(e, block=new_id(e.block, fixed[b])) if b is not None else e)
    return tuple(out)


def _canon(ut: UnitTrace) -> tuple:
    seen: dict[int, int] = {}

    def c(b: int) -> int:
        return seen.setdefault(b, len(seen))

    ev = tuple((e.action, c(e.block), e.size_bytes, e.stream, e.phase, e.category)
               for e in (*ut.setup, *ut.iteration, *ut.tail))
    units = tuple((u.name, u.shapes, u.fwd_pre, u.fwd_post, u.bwd_pre, u.bwd_post,
                   tuple(c(g) for g in u.grad_blocks), u.is_root) for u in ut.units)
    return ev, units, (len(ut.setup), len(ut.iteration), len(ut.tail))


def same(a: UnitTrace, b: UnitTrace) -> bool:
    """Whether two unit traces make the same allocations and frees in the same order (ids compared
    by first appearance) with the same units and marks."""
    return _canon(a) == _canon(b)


def first_difference(a: UnitTrace, b: UnitTrace) -> str:
    """Where two unit traces first differ, for the note that says why the model was traced whole."""
    ea, ua, la = _canon(a)
    eb, ub, lb = _canon(b)
    if la != lb:
        return f"event counts (setup, iteration, tail) {la} against {lb}"
    for i, (x, y) in enumerate(zip(ea, eb)):
        if x != y:
            return f"event {i}: {x} against {y}"
    for x, y in zip(ua, ub):
        if x != y:
            return f"unit {x[0]}: marks {x[2:6]} against {y[2:6]}"
    return "none"


def stack_of(names: Sequence[str]) -> tuple[str, int] | None:
    """(prefix, count) of the longest run of unit names ``prefix.0`` .. ``prefix.N-1``, one after
    another (the model's stack of blocks; other units, an embedding say, stay as they are), else None."""
    best = None
    for i, name in enumerate(names):
        prefix, _, last = name.rpartition(".")
        if last != "0":
            continue
        k = 0
        while i + k < len(names) and names[i + k] == f"{prefix}.{k}":
            k += 1
        if best is None or k > best[1]:
            best = (prefix, k)
    if best is None or any(n.startswith(best[0] + ".") and not n[len(best[0]) + 1:].isdigit() for n in names):
        return None
    return best
