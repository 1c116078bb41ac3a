"""Real values of device tensors copied from the host (dynamic analysis only).

A fake CUDA tensor has no data. But a device tensor the script made by copying host data
(``labels.to("cuda")``, ``torch.tensor(ids, device="cuda")``, a DataLoader batch moved over, a
pinned copy) holds values the real run knows exactly: the host's. Such a tensor keeps a *shadow*,
a real CPU tensor of the same shape and dtype holding those values. An op whose tensor inputs all
have shadows (real host tensors count as their own) computes its output's shadow with the CPU
kernel, so an index, a mask, a label, a length or a count that the script derives on the device
from host data stays known. A data-dependent op (``nonzero``, boolean indexing, ``masked_select``,
``unique``, ``bincount``, ``repeat_interleave`` with tensor repeats) on shadowed inputs takes its
output shape from the shadows, and ``.item()`` / ``.tolist()`` / ``bool()`` / ``.cpu()`` read the
real value: neither is a stand-in. Where a data-dependent op meets a tensor without a shadow (a
value computed from the model's outputs, a draw of the device's random generator), nothing
changes: the stand-in, marked and tracked (dynamic/tracked.py), or the refusal.

What is shadowed, and why (the bound): a shadow costs host memory and a CPU kernel per op, never
device memory (the fake tensor is traced as it is). Integer and bool tensors are shadowed up to
``MAX_TENSOR_BYTES`` each: those are what shapes and indices are made of, and a batch of token ids,
labels or masks, or a graph's edge list of Cora's size, is kilobytes to megabytes. Floating-point
tensors only up to ``MAX_FLOAT_NUMEL`` elements (scalars, a per-class weight vector): a float
tensor of that size is no batch of images or features, whose values steer no shape; mirroring
those would run the input side of the model on the CPU. A float tensor of whole numbers only (a
0/1 mask or a label matrix made with ``.float()``, as SimCLR's: ``_counts``) is shadowed as an
integer one is, at any size up to ``MAX_TENSOR_BYTES``. The model's parameters (built fake) and
everything computed from them (activations, logits, losses) never have a shadow, since one input
of each such op has none. All live shadows together stay under ``MAX_TOTAL_BYTES``: the estimate's
process must stay within the issue's 2 GiB of RSS, of which the traced scripts use 0.7 to 1.4 GiB.

Values the device's random generator draws (``torch.randint(..., device="cuda")``, ``rand``,
``randperm``, ``bernoulli`` of probabilities) are no host data, but they are a draw from a known
distribution: a random factory's result of at most ``MAX_TENSOR_BYTES`` (offsets, crop shifts, the
source of a random mask) gets a *sampled* shadow, drawn with the same op on the host from this
module's own seeds (the script's host random stream is left as it was); so does an in-place
fill that draws a whole tensor of integers or a short float vector, not a weight
(``torch.empty(B, dtype=torch.long, device="cuda").random_(lo, hi)``). A weight's initialisation
(``nn.init``) gets none.
The shapes and values that follow from a sampled shadow are a draw as the real run's are, not the
real run's own: every shape a data-dependent op takes from one, and every value read from one, is
listed (``sampled_reads``: where the draw was made) and the estimate is flagged with it. Before,
such a mask's boolean indexing refused the whole estimate.

What keeps a shadow exact (never a silent wrong value, sampled ones flagged):
- ops whose result the device's random generator decides (``nondeterministic_seeded``: dropout,
  ``randint``/``randn`` on the device, ``bernoulli``) and uninitialised memory (``empty``) make
  no exact shadow (a random factory's draw a sampled one, above); nor do ops whose result on the GPU may differ from the CPU kernel's beyond rounding:
  the order of ties (``topk``, ``sort`` unless stable, ``kthvalue``, ``mode``, ``median`` with
  indices) and writes where duplicate indices race (``scatter``/``index_copy``/``put`` of several
  values without accumulation; ``index_put`` only where its integer indices repeat, checked on
  their shadows). An op that reads only its template's layout (``new_full``, ``zeros_like``) is
  mirrored though the template has no shadow. ``unique`` is sorted on CUDA whatever
  ``sorted`` says (ATen's CUDA kernel sorts), so its shadow is computed sorted;
- a write to a device tensor's storage by an op that is not mirrored (an input without a shadow)
  forgets every shadow of that storage (a token per storage); a mirrored in-place op writes the
  shadow in place, and views of one storage have views of one shadow, so they stay in step;
  a shadow whose fake view does not alias as the real one does is dropped;
- float shadows are the CPU kernel's values: equal to the GPU's up to the last bits of rounding
  (a sum's order), which steers no shape of the scripts this serves.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils import _pytree as pytree

from . import frames

aten = torch.ops.aten

MAX_TENSOR_BYTES = 64 * 2**20    # one int/bool shadow: 8 M int64 (a batch of ids, labels, an edge list)
MAX_FLOAT_NUMEL = 4096           # one float shadow: scalars and short vectors, no batch of features
MAX_TOTAL_BYTES = 256 * 2**20    # all live shadows (host memory only)

# ops that make no shadow: uninitialised memory, or storage swapped under the tensor
_NO_VALUES = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
                        "resize_", "resize_as_", "set_", "_resize_output_"})
# results the GPU orders differently from the CPU where values tie
_TIE_ORDER = frozenset({"topk", "kthvalue", "mode"})
_TIE_ORDER_WITH_DIM = frozenset({"median", "nanmedian"})   # their .default overloads return no index
# writes where duplicate indices race on the GPU (the last writer is not defined)
_RACY_WRITES = frozenset({"scatter", "scatter_", "index_put", "index_put_", "_index_put_impl_", "index_copy",
                          "index_copy_", "put", "put_"})
# ops that take only the layout (shape, strides, dtype) of their first argument, not its values: the
# result is known wherever the other arguments are (``feats.new_full((n, 1), stride)``)
_LAYOUT_ONLY = frozenset({"new_full", "new_zeros", "new_ones", "zeros_like", "ones_like", "full_like"})


# random draws that may get a sampled shadow: factories (the device's generator decides every
# value, floats included: ``torch.rand(B, T, device="cuda") < 0.15`` is a mask) and draws from
# shadowed inputs
_SAMPLED_FACTORIES = frozenset({"randint", "rand", "randn", "randperm", "randint_like", "rand_like", "randn_like"})
_SAMPLED_DRAWS = frozenset({"bernoulli", "multinomial", "normal", "poisson", "binomial"})
# in-place fills that draw every element of their target
_SAMPLED_FILLS = frozenset({"random_", "uniform_", "normal_", "bernoulli_", "exponential_", "geometric_",
                            "cauchy_", "log_normal_"})
MAX_SAMPLED_READS = 20


def script_frame() -> str:
    """file:line of the innermost frame of the user's code (not torch, not vest, not the stdlib, not
    an installed library)."""
    fr = frames.innermost(frames.stack())
    return f"{fr[0]}:{fr[1]}" if fr else "?"


def _script_place() -> str:
    """script_frame with the file's name only."""
    import os

    where = script_frame()
    if where == "?":
        return "?"
    path, line = where.rsplit(":", 1)
    return f"{os.path.basename(path)}:{line}"


def _host_values(t: torch.Tensor) -> bool:
    """Whether a tensor that is not fake holds real values here (a host tensor, not a meta one)."""
    return t.device.type == "cpu" and t.layout == torch.strided


def _counts(real: torch.Tensor) -> bool:
    """Whether a float tensor of real values holds whole numbers only (a 0/1 mask or a label matrix
    made with ``.float()``, as SimCLR's), within MAX_TENSOR_BYTES: values that index and select,
    shadowed as integers are, whatever their count (a batch of features is not whole numbers)."""
    if not real.dtype.is_floating_point or real.numel() * real.element_size() > MAX_TENSOR_BYTES or real.numel() == 0:
        return False
    with unset_fake_temporarily(), torch.no_grad():
        head = real.reshape(-1)[:1024]   # a quick no for features, then the whole
        return bool(torch.equal(head, head.round())) and bool(torch.equal(real, real.round()))


def worthy(t: torch.Tensor, sampled: bool = False) -> bool:
    """Whether a tensor of this kind and size gets a shadow (the bound in the module docstring);
    ``sampled``: a random factory's draw, whose floats are as worthy as integers (a mask's source)."""
    if t.layout != torch.strided:
        return False
    if (t.dtype.is_floating_point or t.dtype.is_complex) and not sampled:
        return t.numel() <= MAX_FLOAT_NUMEL
    return t.numel() * t.element_size() <= MAX_TENSOR_BYTES


def _distinct_places(self_shape, indices) -> bool:
    """Whether integer ``indices`` (``aten.index_put``'s list: None for a whole dimension, else a
    host tensor of positions along that dimension) name each element of the target at most once:
    then no two writes race and the CPU's result is the GPU's."""
    dims = [(d, i) for d, i in enumerate(indices) if i is not None]
    if not dims or any(i.dtype == torch.bool or i.dtype.is_floating_point for _, i in dims):
        return False
    try:
        idx = torch.broadcast_tensors(*(i for _, i in dims))
    except RuntimeError:
        return False
    flat = torch.stack([(t.reshape(-1) % self_shape[d]) for (d, _), t in zip(dims, idx)])   # -1 is size-1
    return flat.shape[1] == 0 or torch.unique(flat, dim=1).shape[1] == flat.shape[1]


def _exact_on_the_gpu(func, args, kwargs, reals=None) -> bool:
    """Whether the CPU kernel gives the values the GPU's would (see the module docstring);
    ``reals``: the op's arguments with shadows for fake tensors, where known, so that a write whose
    indices turn out distinct is exact."""
    if torch.Tag.nondeterministic_seeded in func.tags:
        return False
    name = func.overloadpacket.__name__
    if name in _NO_VALUES or name in _TIE_ORDER or (name in _TIE_ORDER_WITH_DIM and func._overloadname != "default"):
        return False
    if name in ("sort", "argsort"):
        return bool(kwargs.get("stable", False))   # sort.stable / argsort.stable with stable=True
    if name in _RACY_WRITES:
        if name.startswith("index_put") or name == "_index_put_impl_":
            accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
            values = args[2] if len(args) > 2 else kwargs.get("values")
            one_value = isinstance(values, torch.Tensor) and values.numel() == 1
            masks = all(i is None or i.dtype == torch.bool for i in args[1])   # a mask selects each place once
            if accumulate or one_value or masks:
                return True
            return reals is not None and _distinct_places(args[0].shape, reals[0][1])
        if name.startswith("scatter"):
            return func._overloadname.startswith("value") or "reduce" in func._overloadname
        return False
    return True


class Shadows:
    """The shadows of one fake mode: fake tensor -> (real values, its storage, the storage's token)."""

    def __init__(self):
        # id(fake tensor) -> (weakref to it, real values, weakref to its storage, the storage's token);
        # an entry leaves with its tensor (a weakref callback), and no strong reference to a fake
        # tensor is held (its frees are the traced run's)
        self._of: dict[int, tuple] = {}
        self._tokens: dict[int, tuple] = {}    # id(fake storage) -> (weakref, token): a write renews it
        self._counted: dict[int, int] = {}     # id(real storage) -> its bytes, while it lives
        self.bytes = 0
        self._next = itertools.count(1)
        # sampled shadows: data_ptr of the real storage -> where the draw was made ("randint at
        # train.py:100"), while it lives; and the shapes and values taken from them
        self._origins: dict[int, str] = {}
        self.sampled_reads: list[list[str]] = []   # [use, origin]
        self._seeds = itertools.count(20261205)

    def __len__(self) -> int:
        return len(self._of)

    # ---- the map ----

    def get(self, t) -> torch.Tensor | None:
        """The real values of fake tensor ``t``, or None."""
        hit = self._of.get(id(t))
        if hit is None or hit[0]() is not t:
            return None
        _, real, sref, token = hit
        s = t.untyped_storage()
        cur = self._tokens.get(id(s))
        if sref() is not s or cur is None or cur[0]() is not s or cur[1] != token \
                or real.shape != t.shape or real.dtype != t.dtype:
            return None
        return real

    def set(self, t: FakeTensor, real: torch.Tensor, sampled: bool = False) -> bool:
        """Give ``t`` the shadow ``real`` (a CPU tensor of its shape and dtype), within the bound."""
        if not (isinstance(real, torch.Tensor) and not isinstance(real, FakeTensor) and _host_values(real)
                and real.shape == t.shape and real.dtype == t.dtype
                and (worthy(t, sampled) or _counts(real))):
            return False
        real = real.detach()
        rs = real.untyped_storage()
        if id(rs) not in self._counted:
            n = rs.nbytes()
            if self.bytes + n > MAX_TOTAL_BYTES:
                return False
            self._counted[id(rs)] = n
            self.bytes += n
            weakref.finalize(rs, self._uncount, id(rs), n)
        s = t.untyped_storage()
        cur = self._tokens.get(id(s))
        if cur is None or cur[0]() is not s:
            cur = self._renew(s)
        key = id(t)
        old = self._of.get(key)
        ref = old[0] if old is not None and old[0]() is t else weakref.ref(t, lambda r, key=key: self._gone(key, r))
        self._of[key] = (ref, real, weakref.ref(s), cur[1])
        return True

    def copy_from_host(self, t: FakeTensor, host) -> bool:
        """Fake tensor ``t`` was just made on the device from real host tensor ``host`` (a move, a
        ``torch.tensor(..., device="cuda")``): it gets a copy of ``host``'s values, within the bound."""
        if isinstance(host, FakeTensor) or not isinstance(host, torch.Tensor) or not _host_values(host) \
                or not (worthy(host) or _counts(host)):
            return False
        with unset_fake_temporarily():
            return self.set(t, host.detach().clone())

    def _gone(self, key: int, ref) -> None:
        hit = self._of.get(key)
        if hit is not None and hit[0] is ref:
            del self._of[key]

    def _uncount(self, key: int, n: int) -> None:
        if self._counted.pop(key, None) is not None:
            self.bytes -= n

    def _renew(self, s) -> tuple:
        cur = (weakref.ref(s), next(self._next))
        self._tokens[id(s)] = cur
        if len(self._tokens) % 4096 == 0:   # drop the entries of storages that are gone
            for key in [k for k, v in self._tokens.items() if v[0]() is None]:
                del self._tokens[key]
        return cur

    def forget(self, t: FakeTensor) -> None:
        """A write to ``t``'s storage that was not mirrored: no shadow of that storage holds."""
        if not self._tokens:
            return
        s = t.untyped_storage()
        cur = self._tokens.get(id(s))
        if cur is not None and cur[0]() is s:
            self._renew(s)

    # ---- ops ----

    def _reals(self, args, kwargs):
        """(args, kwargs) with each fake tensor replaced by its shadow and CUDA devices by the CPU,
        or None where a fake tensor has none."""
        missing = []

        def real(a):
            if isinstance(a, FakeTensor):
                r = self.get(a)
                if r is None:
                    missing.append(a)
                return r
            if isinstance(a, torch.Tensor) and not _host_values(a):
                missing.append(a)
            if isinstance(a, torch.device) and a.type == "cuda":
                return torch.device("cpu")
            return a

        out = pytree.tree_map(real, (args, kwargs))
        if missing:
            return None
        rargs, rkwargs = out
        if "non_blocking" in rkwargs:
            rkwargs = dict(rkwargs, non_blocking=False)
        rkwargs.pop("pin_memory", None)
        return rargs, rkwargs

    def after_op(self, func, args, kwargs, out, written, host_draw: torch.Tensor | None = None) -> None:
        """Mirror one op on the shadows (the fake mode calls it after the op, outermost only):
        ``written`` are the fake tensors the op wrote to; ``host_draw``: the values a random fill
        of a fake host tensor drew from the script's own generator (_fakecuda._advance_host_generator)."""
        first = args[0] if args else None
        if host_draw is not None and self._host_fill(first, host_draw):
            return
        if torch.Tag.nondeterministic_seeded in func.tags and self._sample(func, args, kwargs, out, written):
            return
        if func.overloadpacket.__name__ in _LAYOUT_ONLY and isinstance(first, FakeTensor) and self.get(first) is None:
            with unset_fake_temporarily():   # its values are not read: any tensor of its layout will do
                first = torch.empty_strided(first.shape, first.stride(), dtype=first.dtype)
            args = (first,) + tuple(args[1:])
        if isinstance(first, FakeTensor) and func is not aten.copy_.default and self.get(first) is None:
            for w in written:   # the common case, an op on the model's tensors: one look-up
                self.forget(w)
            return
        leaves = pytree.tree_leaves((args, kwargs))
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, FakeTensor)]
        for a in leaves:
            if isinstance(a, torch.Tensor) and (self.get(a) is None if isinstance(a, FakeTensor) else not _host_values(a)):
                if func is aten.copy_.default and a is args[0]:
                    continue   # the target: its values are all overwritten (below)
                for w in written:
                    self.forget(w)
                return
        if not written and not any(worthy(o) for o in outs) and not any(
                isinstance(a, torch.Tensor) and not worthy(a) and (isinstance(a, FakeTensor) or _counts(a)) for a in leaves):
            return   # (a large input mirrored only where it holds whole numbers: a shadowed one does, _counts)
        if func is aten.copy_.default and self.get(args[0]) is None:
            self._copy_into(args[0], args[1])
            return
        reals = self._reals(args, kwargs)
        if not _exact_on_the_gpu(func, args, kwargs, reals):
            for w in written:
                self.forget(w)
            return
        try:
            with unset_fake_temporarily(), torch.no_grad():
                real_out = func(*reals[0], **reals[1])
        except Exception:   # the CPU has no kernel for it (a dtype, a layout): no shadow
            for w in written:
                self.forget(w)
            return
        self._pair(args, kwargs, out, real_out)
        if self._origins:
            self._carry_origin(args, kwargs, out)

    def _copy_into(self, dst: FakeTensor, src) -> None:
        """``dst.copy_(src)`` overwrites every element of ``dst`` with ``src``'s (broadcast, cast)."""
        self.forget(dst)
        real_src = src if not isinstance(src, FakeTensor) else self.get(src)
        if real_src is None or not worthy(dst) or not isinstance(real_src, torch.Tensor):
            return
        try:
            with unset_fake_temporarily(), torch.no_grad():
                real = torch.empty_strided(dst.shape, dst.stride(), dtype=dst.dtype).copy_(real_src)
        except Exception:   # no CPU kernel for this copy: no shadow
            return
        if self.set(dst, real) and self._origins:
            origin = self.origin(src) if isinstance(src, FakeTensor) else None
            if origin is not None:
                self._mark(real, origin)

    def _pair(self, args, kwargs, out, real_out) -> None:
        fakes, reals = pytree.tree_leaves(out), pytree.tree_leaves(real_out)
        if len(fakes) != len(reals):
            return
        inputs = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, FakeTensor)]
        for f, r in zip(fakes, reals):
            if not isinstance(f, FakeTensor) or not isinstance(r, torch.Tensor):
                continue
            base = next((a for a in inputs if a.untyped_storage() is f.untyped_storage()), None)
            if base is not None:
                # a view or an in-place result: its shadow must view the base's shadow
                b = self.get(base)
                if b is None or r.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
                    self.forget(f)
                    continue
            elif any(r.untyped_storage().data_ptr() == self.get(a).untyped_storage().data_ptr()
                     for a in inputs if self.get(a) is not None):
                r = r.clone()   # a new tensor on the GPU, a view on the CPU
            self.set(f, r)

    def run_for_real(self, func, args, kwargs, fake_like):
        """A data-dependent op (its output shape, or a Python value, follows the data) on inputs
        that all have shadows: computed on the shadows; each output tensor a fake one of the real
        shape (``fake_like``) with its shadow. None where an input has no shadow."""
        device = next((a.fake_device for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, FakeTensor)), None)
        if device is None:
            return None
        reals = self._reals(args, kwargs)
        if reals is None:
            return self._shape_only(func, args, kwargs, fake_like, device)
        rargs, rkwargs = reals
        origin = self._origin_among(args, kwargs) if self._origins else None
        if origin is not None:
            self.note(f"{func.overloadpacket.__name__} at {_script_place()}", origin)
        if func is aten._unique2.default:
            rargs = (rargs[0], True) + tuple(rargs[2:])   # CUDA's unique always sorts
            rkwargs = {k: v for k, v in rkwargs.items() if k != "sorted"}
        with unset_fake_temporarily(), torch.no_grad():
            real_out = func(*rargs, **rkwargs)

        def make(r):
            if isinstance(r, torch.Tensor) and not isinstance(r, FakeTensor):
                f = fake_like(r, device)
                if self.set(f, r) and origin is not None:
                    self._mark(r, origin)
                return f
            return r

        return pytree.tree_map(make, real_out)

    def _shape_only(self, func, args, kwargs, fake_like, device):
        """A selection whose output shape follows its mask alone (``masked_select(x, mask)``,
        ``x[mask]``), where the mask has a shadow and the data has none (a batch of images): the
        output of the real shape, without values (no shadow). hlb-CIFAR10 crops its batch with
        masked_select and random square masks. None for other ops, or a mask without a shadow."""
        if func is aten.masked_select.default:
            x, mask = args[0], args[1]
            real_mask = self.get(mask) if isinstance(mask, FakeTensor) else mask if _host_values(mask) else None
            if real_mask is None:
                return None
            shape = torch.broadcast_shapes(x.shape, mask.shape)
            with unset_fake_temporarily():
                n = int(real_mask.broadcast_to(shape).count_nonzero())
            out = torch.empty((n,), dtype=x.dtype, device="meta")
            used = (mask,)
        elif func is aten.index.Tensor:
            x, indices = args[0], args[1]
            meta = []
            for i in indices:
                if i is None:
                    meta.append(None)
                elif i.dtype in (torch.bool, torch.uint8):
                    real = self.get(i) if isinstance(i, FakeTensor) else i if _host_values(i) else None
                    if real is None:
                        return None
                    with unset_fake_temporarily():
                        k = int(real.count_nonzero())
                    # a boolean index is its nonzero positions, one long index per dimension it covers
                    meta.extend(torch.empty((k,), dtype=torch.long, device="meta") for _ in range(i.dim()))
                else:
                    meta.append(torch.empty(i.shape, dtype=i.dtype, device="meta"))
            out = aten.index.Tensor(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta"), meta)
            used = tuple(i for i in indices if i is not None)
        else:
            return None
        origin = self._origin_among(used, {}) if self._origins else None
        if origin is not None:
            self.note(f"{func.overloadpacket.__name__} at {_script_place()}", origin)
        return fake_like(out, device)

    def host_copy(self, t, call):
        """``t.cpu()`` / ``t.to("cpu", ...)`` of a shadowed tensor: a new real host tensor of its
        values (``call(shadow)`` does the conversion); None without a shadow, or where autograd
        would follow the copy (a real tensor cannot join the fake graph)."""
        real = self.get(t)
        if real is None or (t.requires_grad and torch.is_grad_enabled()):
            return None
        self.read(t)
        try:
            with unset_fake_temporarily():
                out = call(real)
        except Exception:   # an argument the real call cannot take (a fake ``other`` of type_as)
            return None
        if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() == real.untyped_storage().data_ptr():
            out = out.clone()   # the GPU's .cpu() is always a copy
        return out

    # ---- sampled shadows: draws of the device's random generator ----

    def _sample(self, func, args, kwargs, out, written) -> bool:
        """A draw of the device's generator (``nondeterministic_seeded``): a sampled shadow for its
        result where it is a factory's (``randint``, ``rand``, ``randperm``, ``*_like``: every value
        drawn) of at most MAX_TENSOR_BYTES, or a draw from inputs that all have shadows (``bernoulli``
        of probabilities, ``multinomial``) worthy of one; drawn on the host from this module's own
        seeds. In-place fills (``uniform_``, ``normal_``: the initialisation of weights, dropout's
        masks) get none. True where a shadow was made."""
        name = func.overloadpacket.__name__
        if name in _SAMPLED_FILLS:
            return self._sample_fill(func, args, kwargs, name)
        factory = name in _SAMPLED_FACTORIES
        if written or not (factory or name in _SAMPLED_DRAWS):
            return False
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, FakeTensor)]
        if len(outs) != 1 or not worthy(outs[0], sampled=factory):
            return False
        if name.endswith("_like"):   # only the template's layout is used: any tensor of that layout
            with unset_fake_temporarily():
                args = (torch.empty_strided(args[0].shape, args[0].stride(), dtype=args[0].dtype),) + tuple(args[1:])
        real_out = self._draw(func, args, kwargs)
        if real_out is None or not self.set(outs[0], real_out, sampled=factory):
            return False
        self._mark(real_out, f"{name} at {_script_place()}")
        return True

    def _draw(self, func, args, kwargs, target=None):
        """``func`` on the shadows of its inputs (``target()``'s new host tensor first, for an
        in-place fill) with the host's default generator reseeded from this module's seeds and
        restored after it: the script's own host draws stay what they would be. None where an input
        has no shadow or the CPU has no kernel for it."""
        if kwargs.get("generator") is not None:   # (keyword-only in ATen's schemas)
            kwargs = dict(kwargs, generator=None)   # the device's: the draw is made from this module's seeds
        reals = self._reals(args, kwargs)
        if reals is None:
            return None
        rargs, rkwargs = reals
        try:
            with unset_fake_temporarily(), torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(next(self._seeds))
                return func(*((target(),) if target else ()), *rargs, **rkwargs)
        except Exception:   # no CPU kernel for it: no shadow
            return None

    def _host_fill(self, t, drawn: torch.Tensor) -> bool:
        """A random fill of a fake host tensor (one made in a module's constructor, as a mock
        forward pass there makes its inputs and a random crop's ``torch.empty(1).uniform_()``): the
        host's draw, made from the script's own generator as the job makes it, so its values are the
        job's: an exact shadow, not a sampled one (no GPU draw decides what it decides). Not for
        weights (``requires_grad``) nor for what is too large to shadow."""
        if not isinstance(t, FakeTensor) or t.requires_grad or not worthy(t):
            return False
        if t.storage_offset() != 0 or not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            return False
        self.forget(t)
        return self.set(t, drawn)

    def _sample_fill(self, func, args, kwargs, name: str) -> bool:
        """An in-place fill that draws every element of a tensor that is not a weight (hlb-CIFAR10's
        crop centres: ``torch.empty(B, dtype=torch.long, device="cuda").random_(lo, hi)``;
        ``empty(B).uniform_() < p``): a sampled shadow as a factory's draw gets, where the target
        is a whole storage (no view of a tensor with other values) of integers up to
        MAX_TENSOR_BYTES or of at most MAX_FLOAT_NUMEL floats. A weight's initialisation
        (``nn.init`` on a parameter, or on a float tensor of a weight's size) gets none, nor does a
        fill inside another op's decomposition (after_op sees the outermost op only)."""
        t = args[0] if args else None
        if not isinstance(t, FakeTensor) or t.requires_grad or not worthy(t, sampled=not t.is_floating_point()):
            return False   # floats: short vectors only (per-sample draws), no tensor of a weight's size
        if t.storage_offset() != 0 or not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            return False
        real = self._draw(func, tuple(args[1:]), kwargs, lambda: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype))
        if real is None:
            return False
        self.forget(t)
        if not self.set(t, real, sampled=True):
            return False
        self._mark(real, f"{name} at {_script_place()}")
        return True

    def _mark(self, real: torch.Tensor, origin: str) -> None:
        s = real.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in self._origins:
            weakref.finalize(s, self._origins.pop, ptr, None)
        self._origins[ptr] = origin

    def origin(self, t) -> str | None:
        """Where the draw was made that ``t``'s shadow follows from; None for host data."""
        if not self._origins:
            return None
        real = self.get(t)
        return self._origins.get(real.untyped_storage().data_ptr()) if real is not None else None

    def _origin_among(self, args, kwargs) -> str | None:
        return next((o for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, FakeTensor)
                     and (o := self.origin(a)) is not None), None)

    def _carry_origin(self, args, kwargs, out) -> None:
        origin = self._origin_among(args, kwargs)
        if origin is None:
            return
        for o in pytree.tree_leaves(out):
            if isinstance(o, FakeTensor) and (r := self.get(o)) is not None:
                self._mark(r, origin)

    def note(self, use: str, origin: str) -> None:
        """A shape or value taken (``use``, "nonzero at train.py:21") from a draw (``origin``)."""
        if len(self.sampled_reads) < MAX_SAMPLED_READS and [use, origin] not in self.sampled_reads:
            self.sampled_reads.append([use, origin])

    def read(self, t) -> torch.Tensor | None:
        """The shadow of ``t`` for a value the script reads (``.item()``, ``bool()``, ``.tolist()``,
        ``.cpu()``): listed where it is a draw of the device's generator."""
        real = self.get(t)
        if real is not None and self._origins:
            origin = self.origin(t)
            if origin is not None:
                self.note(f"a value read at {_script_place()}", origin)
        return real


def of(t) -> torch.Tensor | None:
    """The shadow of ``t`` under its fake mode, or None."""
    shadows = getattr(getattr(t, "fake_mode", None), "shadows", None)
    return shadows.get(t) if shadows is not None else None


def read_of(t) -> torch.Tensor | None:
    """``of(t)`` for a value the script reads (Shadows.read: a sampled one is listed)."""
    shadows = getattr(getattr(t, "fake_mode", None), "shadows", None)
    return shadows.read(t) if shadows is not None else None
