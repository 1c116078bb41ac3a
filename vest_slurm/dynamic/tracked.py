"""Stand-in values read from fake device tensors, and where they go (dynamic analysis only).

Enters: every read of a fake tensor's value the script makes (``.item()``, ``.tolist()``,
``int()``/``float()``/``bool()``, ``format()``, ``.numpy()``); each gets a stand-in (1, 1.0,
False, zeros), since a fake tensor has no data. Leaves: a ``Ledger`` of those reads (kind and the
script's file:line), and which tensors were shaped or indexed by a stand-in.

A stand-in from ``.item()`` / ``.tolist()`` is a ``StandInInt`` / ``StandInFloat``: a number that
stays marked through Python arithmetic. ``TaintMode`` marks every tensor a torch call makes from
a marked integer (a size, an index, a slice bound) or from a marked tensor. The model's inputs are
checked where it is called (standins.patched): an input marked so, or with a zero-size dimension,
is a shape the real run would not have, and the estimate is refused with the place it came from.
``int()``, ``float()`` and ``__index__`` go through C++, which returns a plain Python int: such
reads are listed, not followed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from ..estimate import frames
from ..estimate._shadow import script_frame


class StandInInt(int):
    """An int read from a fake tensor (its stand-in value); arithmetic keeps the mark."""
    where: str = ""


class StandInFloat(float):
    """A float read from a fake tensor (its stand-in value); arithmetic keeps the mark."""
    where: str = ""


def _marked(value, where: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    out = StandInInt(value) if isinstance(value, int) else StandInFloat(value)
    out.where = where
    return out


def _keep_mark(name: str, base: type):
    op = getattr(base, name)

    def method(self, *args):
        out = op(self, *args)
        if out is NotImplemented:
            return out
        return _marked(out, self.where) if not isinstance(out, tuple) else tuple(_marked(o, self.where) for o in out)

    method.__name__ = name
    return method


for _cls, _base in ((StandInInt, int), (StandInFloat, float)):
    for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__",
                  "__rfloordiv__", "__truediv__", "__rtruediv__", "__mod__", "__rmod__", "__pow__", "__rpow__",
                  "__neg__", "__pos__", "__abs__", "__divmod__"):
        if hasattr(_base, _name):
            setattr(_cls, _name, _keep_mark(_name, _base))


def code_line(tb=None) -> tuple[str, int] | None:
    """(file, line) of the innermost frame that is neither torch's nor vest's nor the standard
    library's (the script's, or a library's such as Lightning's): of the caller's stack, or of a
    traceback ``tb``."""
    import traceback

    seen = frames.stack() if tb is None else ((fr.filename, fr.lineno) for fr in reversed(traceback.extract_tb(tb)))
    fr = frames.innermost(seen, (frames.USER, frames.LIBRARY))
    return (fr[0], fr[1]) if fr else None


@dataclass
class Ledger:
    """What the script read from the device, and which tensors stand-ins shaped."""

    reads: list = field(default_factory=list)          # (kind, where), the first ones of each place
    _places: set = field(default_factory=set)
    tainted: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)   # tensor -> where
    marked_made: int = 0                               # StandIn numbers made (0: TaintMode does nothing)
    # the lines, in any file but torch's and vest's (a library's too), whose code read a value
    code_lines: set = field(default_factory=set)
    count: int = 0                                     # reads in all

    MAX_READS = 50
    MAX_CODE_LINES = 4096

    def read(self, kind: str, value):
        """Record a read of a fake tensor's value at the script's current line; the value marked."""
        self.count += 1
        where = script_frame()
        if (kind, where) not in self._places and len(self.reads) < self.MAX_READS:
            self._places.add((kind, where))
            self.reads.append((kind, where))
        if len(self.code_lines) < self.MAX_CODE_LINES:
            line = code_line()
            if line is not None:
                self.code_lines.add(line)
        if kind in ("item", "tolist"):
            self.marked_made += 1
            return pytree.tree_map(lambda v: _marked(v, where), value)
        return value

    def taint_of(self, leaves) -> str | None:
        for a in leaves:
            if isinstance(a, StandInInt):   # a size, an index, a slice bound (floats are values)
                return a.where
            if isinstance(a, torch.Tensor):
                w = self.tainted.get(a)
                if w is not None:
                    return w
        return None

    def summary(self) -> list[dict]:
        return [{"kind": k, "where": w} for k, w in self.reads]


class TaintMode(torch.overrides.TorchFunctionMode):
    """Marks the tensors a torch call makes from stand-in values or marked tensors."""

    def __init__(self, ledger: Ledger):
        super().__init__()
        self.ledger = ledger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ledger = self.ledger
        if not ledger.marked_made and not len(ledger.tainted):
            return func(*args, **kwargs)
        where = ledger.taint_of(pytree.tree_leaves((args, kwargs)))
        out = func(*args, **kwargs)
        if where is not None:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    ledger.tainted[t] = where
        return out


def input_problem(ledger: Ledger, args) -> str | None:
    """Why the model's inputs are not the real run's, or None: a tensor shaped by a stand-in value,
    or one with a zero-size dimension."""
    tensors = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
    for i, t in enumerate(tensors):
        where = ledger.tainted.get(t)
        if where is not None:
            return (f"the model's input {i} (shape {tuple(t.shape)}) was shaped by a value read from a device "
                    f"tensor at {where}; that value is a stand-in here (a fake tensor has no data)")
    first = tensors[0] if tensors else None
    if first is not None and first.dim() > 0 and 0 in first.shape:
        # the batch itself (a later input may be empty by design: no cached keys yet)
        return (f"the model's input has shape {tuple(first.shape)}, a dimension of size 0: a training step "
                "on an empty batch is not the real run's (its data came out empty)")
    return None
