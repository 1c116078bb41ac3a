"""Values known without data: what every element of a fake tensor can be, where the step's own
code decides it (masks built from ``torch.ones``, padding, ``arange``), so that a check the model
makes on them (``mask.any().item()``) is answered as on the GPU instead of failing.

A tensor's knowledge is a ``frozenset`` of the values its elements take (each element is one of
them; not every value need occur) or a ``Span`` (every element lies in [lo, hi]: an ``arange``,
or a set grown too large to keep). Every rule over-approximates: it may answer "one of {False,
True}" where the data would decide, never a set that misses a value the GPU could hold. A check
whose answer is not one value stays data-dependent and the tracer says so.

Longformer and LED pad their attention mask to the attention window and ask
``is_index_global_attn.flatten().any().item()``: the mask is ``ones`` padded with 0, clamped, cast,
gathered with ``arange`` indices, turned into 0 / min by ``where``, and compared with 0. Each of
those steps has a rule below; the answer, no global attention, is the one the run reads.
"""

from __future__ import annotations

import math
import operator
import struct
from typing import Callable, NamedTuple, Union

import torch

aten = torch.ops.aten

MAX_SET = 16   # larger sets are kept as their span


class Span(NamedTuple):
    """Every element lies in [lo, hi]."""
    lo: float
    hi: float


Known = Union[frozenset, Span]


def _set(values) -> Known | None:
    s = frozenset(values)
    if len(s) <= MAX_SET:
        return s
    if any(v != v for v in s):   # NaN: no order to span
        return None
    return Span(min(s), max(s))


def _to_float(dtype: torch.dtype) -> Callable | None:
    """Python float -> the nearest value of ``dtype``, as a conversion on the GPU rounds it (a
    compare on the rounded value then answers as the kernel does)."""
    if dtype == torch.float64:
        return float
    fmt = {torch.float32: "f", torch.float16: "e"}.get(dtype)
    if fmt is not None:
        def rnd(v):
            try:
                return struct.unpack(fmt, struct.pack(fmt, v))[0]
            except OverflowError:   # beyond the type's range: infinity, as the conversion gives
                return math.copysign(math.inf, v)
        return rnd
    if dtype == torch.bfloat16:
        f32 = _to_float(torch.float32)

        def rnd(v):
            v = f32(v)
            if v != v or math.isinf(v):
                return v
            bits = struct.unpack("<I", struct.pack("<f", v))[0]
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16   # round to nearest even
            return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]
        return rnd
    return None   # float8 and others: not followed


def _to_int(dtype: torch.dtype) -> Callable:
    info = torch.iinfo(dtype)

    def conv(v):
        i = int(v)   # toward zero, as the conversion
        if not info.min <= i <= info.max:
            raise OverflowError   # would wrap: not followed
        return i
    return conv


def cast(k: Known | None, dtype: torch.dtype) -> Known | None:
    """The values after conversion to ``dtype`` (as ``.to(dtype)`` converts them)."""
    if k is None:
        return None
    if dtype == torch.bool:
        if isinstance(k, Span):
            if k.lo == k.hi:
                return frozenset({bool(k.lo)})
            return frozenset({False, True}) if k.lo <= 0 <= k.hi else frozenset({True})
        return frozenset(bool(v) for v in k)
    conv = _to_float(dtype) if dtype.is_floating_point else None if dtype.is_complex else _to_int(dtype)
    if conv is None:
        return None
    try:
        if isinstance(k, Span):
            return Span(conv(k.lo), conv(k.hi))   # both conversions keep the order
        return _set(conv(v) for v in k)
    except (OverflowError, ValueError):   # inf or NaN into an integer type, or out of its range
        return None


def of_real(t: torch.Tensor) -> Known | None:
    """What a real host tensor's elements are (dynamic analysis keeps host tensors real): the set
    of its values when it is small, else the span of its values (one pass over the data, as a
    mask the data pipeline built meets the device's checks). None for an empty tensor, complex
    values or a NaN, which have no order to span."""
    if t.numel() == 0 or t.is_complex() or t.dtype.itemsize == 1 and t.dtype not in (torch.bool, torch.uint8, torch.int8):
        return None
    with torch.no_grad():
        if t.numel() <= MAX_SET:
            return cast(_set(t.detach().flatten().tolist()), t.dtype)
        x = t.detach()
        if x.dtype == torch.bool:
            x = x.to(torch.uint8)
        elif x.dtype in (torch.uint16, torch.uint32):
            x = x.to(torch.int64)   # (no CPU kernel of aminmax for them: llm.c's and modded-nanogpt's uint16 tokens)
        elif x.dtype == torch.uint64:
            return None
        lo, hi = (v.item() for v in torch.aminmax(x))
    if lo != lo or hi != hi:
        return None
    if t.dtype == torch.bool:
        return frozenset({bool(lo), bool(hi)})
    return frozenset({lo}) if lo == hi else Span(lo, hi)


def single(k: Known | None):
    """The one value of ``k``, or None."""
    if isinstance(k, frozenset) and len(k) == 1:
        return next(iter(k))
    if isinstance(k, Span) and k.lo == k.hi:
        return k.lo
    return None


def monotone(k: Known | None, f: Callable) -> Known | None:
    """``f`` applied to every value, for an ``f`` that keeps or reverses order."""
    if k is None:
        return None
    if isinstance(k, Span):
        a, b = f(k.lo), f(k.hi)
        return Span(min(a, b), max(a, b))
    return _set(f(v) for v in k)


def union(a: Known | None, b: Known | None) -> Known | None:
    if a is None or b is None:
        return None
    if isinstance(a, frozenset) and isinstance(b, frozenset):
        return _set(a | b)
    los, his = [], []
    for k in (a, b):
        if isinstance(k, Span):
            los.append(k.lo), his.append(k.hi)
        elif k:
            if any(v != v for v in k):
                return None
            los.append(min(k)), his.append(max(k))
    return Span(min(los), max(his)) if los else frozenset()


def product(a: Known | None, b: Known | None, f: Callable) -> Known | None:
    """``f(x, y)`` over every pair: binary ops on two small sets."""
    if not (isinstance(a, frozenset) and isinstance(b, frozenset)):
        return None
    return _set(f(x, y) for x in a for y in b)


def exact(k: Known | None, dtype: torch.dtype) -> Known | None:
    """Results of arithmetic done here in Python (double, or exact integers) on operands of
    ``dtype``: kept where the GPU's kernel gives the same, i.e. where each result is a value of
    ``dtype`` (a representable exact result is what every rounding returns). A span stays sound
    through rounding, which keeps order."""
    if k is None:
        return None
    rounded = cast(k, dtype)
    if isinstance(k, Span) or rounded is None:
        return rounded
    return rounded if rounded == k else None


_ORDERED = {operator.lt, operator.le, operator.gt, operator.ge}


def compare(k: Known | None, op: Callable, c) -> Known | None:
    if k is None:
        return None
    if isinstance(k, frozenset):
        return frozenset(op(v, c) for v in k)
    if op in _ORDERED:   # monotone in the value: the ends decide
        return frozenset({op(k.lo, c), op(k.hi, c)})
    if k.lo == k.hi or not (k.lo <= c <= k.hi):
        return frozenset({op(k.lo, c)})
    return frozenset({False, True})


def reduce(k: Known | None, fn: Callable, numel: int) -> Known | None:
    """all / any, over the whole tensor or along dimensions."""
    if numel == 0:
        return frozenset({fn([])})
    truth = cast(k, torch.bool)
    if truth is None:
        return None
    return frozenset(fn([t]) for t in truth)


def where_truthy(k: Known | None, value) -> Known | None:
    """``x.masked_fill(x.to(bool), value)``: the nonzero elements become ``value``, the zeros stay
    (the inverted attention mask of transformers' ``_prepare_4d_attention_mask_inverted``)."""
    falsy = cast(k, torch.bool)
    if falsy is None:
        return None
    zeros = frozenset({0}) if False in falsy else frozenset()
    if isinstance(k, frozenset):
        zeros = frozenset(v for v in k if not v)
    return _set(zeros | ({value} if True in falsy else set()))


def arange(args, kwargs) -> Known | None:
    """aten.arange.default(end) / .start(start, end) / .start_step(start, end, step)."""
    if len(args) == 1:
        start, end, step = 0, args[0], 1
    else:
        start, end = args[0], args[1]
        step = args[2] if len(args) > 2 else kwargs.get("step", 1)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (start, end, step)) or step == 0:
        return None
    n = max(0, math.ceil((end - start) / step))   # the length torch computes
    if n == 0:
        return frozenset()
    last = start + (n - 1) * step
    return Span(min(start, last), max(start, last))


def clamp(k: Known | None, lo, hi) -> Known | None:
    if not all(v is None or (isinstance(v, (int, float)) and v == v) for v in (lo, hi)):
        return None

    def f(v):
        if lo is not None:
            v = max(v, lo)
        return min(v, hi) if hi is not None else v

    return monotone(k, f)


# the sources: factories of one value (_FULL: at which argument it is)
_FILLED = {aten.ones.default: 1, aten.zeros.default: 0, aten.ones_like.default: 1, aten.zeros_like.default: 0,
           aten.new_ones.default: 1, aten.new_zeros.default: 0}
_FULL = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2, aten.scalar_tensor.default: 0}
_COMPARE = {getattr(getattr(aten, name), overload): getattr(operator, name)
            for name in ("eq", "ne", "lt", "le", "gt", "ge") for overload in ("Scalar", "Tensor")}
_REDUCE = {getattr(packet, name): fn for packet, fn in ((aten.all, all), (aten.any, any))
           for name in ("default", "dim", "dims") if hasattr(packet, name)}
_COPIES = {aten._to_copy.default, aten.clone.default, aten.index.Tensor, aten.index_select.default,
           aten.gather.default, aten.repeat.default}   # values only move (or convert)
_NOT = {aten.logical_not.default, aten.bitwise_not.default}
_BITWISE = {aten.bitwise_and.Tensor: operator.and_, aten.bitwise_or.Tensor: operator.or_}   # also on integers
_BOOL_BINARY = {**_BITWISE, aten.logical_and.default: operator.and_, aten.logical_or.default: operator.or_,
                aten.mul.Tensor: operator.and_}
_EXTREMUM = {aten.max.default, aten.min.default, aten.amax.default, aten.amin.default}   # one of the elements
_ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_SCALAR_ARITH = {aten.add.Tensor, aten.sub.Tensor, aten.rsub.Scalar}   # with a Python number
MASKED_FILL = {aten.masked_fill.Scalar, aten.masked_fill_.Scalar}
_INDEX_PUT = {aten.index_put.default, aten.index_put_.default}


def after_op(func, args, kwargs, out, known_of: Callable) -> Known | None:
    """What ``out``'s elements can be, from what the inputs' can (``known_of`` answers for a
    tensor or a Python scalar); None where no rule applies. Called with the inputs' knowledge as
    it was before the op ran (an in-place op's own target included)."""
    if not isinstance(out, torch.Tensor):
        return None
    dt = out.dtype
    if func in _FILLED:
        return cast(frozenset({_FILLED[func]}), dt)
    if func in _FULL:
        i = _FULL[func]
        value = args[i] if len(args) > i else None
        return cast(frozenset({value}), dt) if isinstance(value, (bool, int, float)) else None
    if func in _ARANGE:
        return cast(arange(args, kwargs), dt)
    if not args:
        return None
    x = args[0]
    if func in _COMPARE:
        other = args[1]
        if not isinstance(other, (torch.Tensor, bool, int, float)):
            return None
        ct = torch.result_type(x, other)   # both sides are converted to it, as the kernel does
        c = single(cast(known_of(other), ct))
        if c is None:
            return None
        return compare(cast(known_of(x), ct), _COMPARE[func], c)
    if func in _REDUCE:
        return reduce(known_of(x), _REDUCE[func], x.numel())
    if func in (aten.cat.default, aten.stack.default):   # each element is one of an input's
        parts = [known_of(t) for t in x]
        k = parts[0] if parts else None
        for p in parts[1:]:
            k = union(k, p)
        return cast(k, dt)
    if func in _COPIES:
        return cast(known_of(x), dt)
    if func in _NOT and x.dtype == torch.bool:
        return monotone(known_of(x), operator.not_)
    if func in _BOOL_BINARY and x.dtype == torch.bool and dt == torch.bool:
        return product(_truths(x, known_of), _truths(args[1], known_of), _BOOL_BINARY[func])
    if func in _BITWISE and not dt.is_floating_point and not dt.is_complex:
        # transformers' generate: unfinished (long ones) & ~(stopping criteria, one of them the
        # max length's known fill): the length's True ends every sequence whatever the EOS check
        return cast(product(_truths(x, known_of), _truths(args[1], known_of), _BITWISE[func]), dt)
    if func in _EXTREMUM and x.numel() > 0:
        return cast(known_of(x), dt)
    if func is aten.mul.Tensor and dt.is_floating_point:
        return exact(product(cast(known_of(x), dt), cast(known_of(args[1]), dt), operator.mul), dt)
    if func is aten.constant_pad_nd.default:
        value = args[2] if len(args) > 2 else kwargs.get("value", 0)
        return cast(union(known_of(x), frozenset({value})), dt)
    if func is aten.clamp.default:
        lo = args[1] if len(args) > 1 else kwargs.get("min")
        hi = args[2] if len(args) > 2 else kwargs.get("max")
        return cast(clamp(known_of(x), lo, hi), dt)
    if func in _SCALAR_ARITH and not isinstance(args[1], torch.Tensor):
        other, alpha = args[1], kwargs.get("alpha", 1)
        if alpha != 1 or not isinstance(other, (int, float)):
            return None
        other = single(cast(frozenset({other}), dt))
        if other is None:
            return None
        f = {aten.add.Tensor: lambda v: v + other, aten.sub.Tensor: lambda v: v - other,
             aten.rsub.Scalar: lambda v: other - v}[func]
        return exact(monotone(cast(known_of(x), dt), f), dt)
    if func is aten.where.self:
        cond = known_of(x)
        a, b = known_of(args[1]), known_of(args[2])
        if cond == frozenset({True}):
            return cast(a, dt)
        if cond == frozenset({False}):
            return cast(b, dt)
        return cast(union(a, b), dt)
    if func in MASKED_FILL:
        mask = known_of(args[1])
        if mask == frozenset({False}):
            return known_of(x)
        return cast(union(known_of(x), frozenset({args[2]})), dt)
    if func in _INDEX_PUT:
        indices = args[1]
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and known_of(i) == frozenset({False})
               for i in indices):
            return known_of(x)   # a mask that selects nothing writes nothing
        if accumulate:
            return None
        return cast(union(known_of(x), known_of(args[2])), dt)
    return None


def _truths(t, known_of: Callable) -> Known | None:
    """What ``t``'s elements can be; for a boolean tensor with no rule, one of False and True (sound:
    so ``x | True`` is known to be True and ``x & False`` False, whatever ``x``)."""
    k = known_of(t)
    if k is None and isinstance(t, torch.Tensor) and t.dtype == torch.bool:
        return frozenset({False, True})
    return k


HANDLED = frozenset(set(_FILLED) | set(_FULL) | set(_COMPARE) | set(_REDUCE) | _COPIES | _NOT | set(_BOOL_BINARY)
                    | _EXTREMUM
                    | _ARANGE | _SCALAR_ARITH | MASKED_FILL | _INDEX_PUT
                    | {aten.cat.default, aten.stack.default, aten.constant_pad_nd.default, aten.clamp.default,
                       aten.where.self})
