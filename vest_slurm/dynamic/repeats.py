"""Identical no-grad calls of a model are replayed from their trace, not run again (dynamic analysis).

Training scripts evaluate and sample between their training steps: nanoGPT's ``estimate_loss``
calls the model ``eval_iters`` times (200 by default) on batches of one shape before the first
step; minGPT's chargpt samples 500 tokens after its first step, one forward pass per token, the
last 372 of them on a context cropped to the same ``block_size``. On fake CUDA each such call costs
as much as a training forward (FakeTensor's dispatch is most of it), so a run whose training steps
take seconds spent minutes there and hit the site's time limit.

What a call allocates and frees on the GPU is decided by what goes in and by the state it reads.
A call that reads nothing else and changes nothing can be replayed: its events appended to the
trace again (each block new, in the same order, with the same sizes, phases, categories and
modules), its outputs made anew as fake tensors of the recorded layout. A call is replayed only
where all of this holds; otherwise it runs, as before:
- it is an outermost module call under no_grad (or inference mode), on the main thread, with no
  manual training step pending (standins.py closes one at the next forward);
- its inputs are fake CUDA tensors and plain values (None, bool, int, float, str, dtypes, devices);
  the key is their layout and values with autocast's state, cudnn.benchmark and a fingerprint of
  every submodule's attributes (so a model switched to train mode, a changed flag or a replaced
  parameter is another key);
- no module of the model has a forward hook of its own, and the global hooks are the ones there
  were when the run started;
- while it ran twice with the same key, it made the same events both times (the first call of a
  key can include one-time work: the cuBLAS handle's workspace, cuDNN's benchmark), and in each:
  it wrote no tensor that existed before it (a KV cache in a buffer, BatchNorm's running stats in
  train mode), freed none, kept no block beyond its outputs (a tensor stored in a module or a
  global) and autocast's casts of the weights (kept in its cache until the outermost autocast
  region exits: a replay puts its casts there, and which weights the cache holds is in the key), read no value from the device (.item(), data-dependent shapes: nonzero, boolean
  indexing), and returned only fake CUDA tensors allocated in the call and plain values, none with
  known or shadowed values (_fakecuda.known_of, _shadow.py).
So a replay's events are those the call would make. What cannot be seen from here is Python state
outside the model's modules that the forward changes or branches on (a global counter, the host's
random numbers); bootstrap.py's docstring says so with the run's other limits.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..estimate import _fakecuda as fc

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
_VALUE_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_CONFIRMED, _SEEN_ONCE, _NEVER = "confirmed", "seen-once", "never"
# calls of one key watched before it is given up: the first can hold one-time work (a thread's
# cuBLAS workspace, cuDNN's benchmark of a new shape), the next two then make the same events
_TRIES = 3
_MAX_KEYS = 256   # keys remembered; past that, new keys run every time (a bound on host memory)


class Repeats:
    """Owns the recorded calls; ``patch()`` gives the nn.Module.__call__ that consults them."""

    def __init__(self, state, mode: "fc.FakeCudaMode"):
        self.state = state
        self.tracer = state.tracer
        self.mode = mode
        self.records: dict = {}
        self.replayed = 0     # calls replayed (the result JSON's ``repeats_replayed``)
        self._depth = 0
        self._global_hooks = None
        # VEST_REPEATS=run: every call runs (developers: the trace a replay must equal)
        self.enabled = os.environ.get("VEST_REPEATS", "replay") != "run"

    # -- the patch
    def patch(self, orig_call):
        repeats = self

        def __call__(mod, *args, **kwargs):
            if repeats._depth or torch.is_grad_enabled():
                return repeats._run(orig_call, mod, args, kwargs)
            return repeats._call(orig_call, mod, args, kwargs)

        return __call__

    @contextlib.contextmanager
    def installed(self):
        """nn.Module.__call__ consults the records while the script runs; the global module hooks
        present now (vest's own) are the ones a replayed call may run under."""
        orig = nn.Module.__call__
        self._global_hooks = _hook_ids()
        nn.Module.__call__ = self.patch(orig)
        try:
            yield self
        finally:
            nn.Module.__call__ = orig

    def _run(self, orig_call, mod, args, kwargs):
        self._depth += 1
        try:
            return orig_call(mod, *args, **kwargs)
        finally:
            self._depth -= 1

    def _call(self, orig_call, mod, args, kwargs):
        key = self._key(mod, args, kwargs) if self.enabled else None
        rec = self.records.get(key) if key is not None else None
        if rec is not None and rec[0] == _CONFIRMED and all(ref() is not None for ref, _l in rec[1][2].cached.values()):
            return self._replay(rec)
        if key is None or (rec is not None and rec[0] == _NEVER) or (rec is None and len(self.records) >= _MAX_KEYS):
            return self._run(orig_call, mod, args, kwargs)
        watch = _Watch(self)
        self.mode.watch = watch.see
        try:
            out = self._run(orig_call, mod, args, kwargs)
        finally:
            self.mode.watch = None
        got = watch.result(out)
        tries = 1 + (rec[2] if rec is not None else 0)
        if got is not None and rec is not None and got == rec[1]:
            self.records[key] = (_CONFIRMED, got)
        elif tries >= _TRIES:
            self.records[key] = (_NEVER,)
        else:
            self.records[key] = (_SEEN_ONCE, got, tries)   # the next call of the key is compared with this one
        return out

    # -- the key
    def _key(self, mod, args, kwargs):
        st, tr = self.state, self.tracer
        if tr.frozen or st.manual_step_pending or threading.current_thread() is not threading.main_thread():
            return None
        if _hook_ids() != self._global_hooks:
            return None
        leaves, spec = pytree.tree_flatten((args, kwargs))
        parts = []
        storages: dict = {}
        any_fake = False
        for a in leaves:
            if isinstance(a, fc.FakeTensor):
                if not fc._is_fake_cuda(a) or a.requires_grad:
                    return None
                any_fake = True
                group = storages.setdefault(id(a.untyped_storage()), len(storages))
                parts.append((tuple(a.shape), _layout(a), a.dtype, group))
            elif type(a) in _PLAIN:
                parts.append((type(a), a))
            else:
                return None   # a real host tensor (its values), a tensor subclass, an object
        if not any_fake:
            return None
        modules, seen = [], {}
        for m in mod.modules():
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
                return None
            modules.append(_fingerprint(m, seen))
        cached = tuple(sorted(k for k, (ref, _c) in fc.CAST_CACHE.entries.items() if ref() is not None))
        return (id(mod), str(spec), tuple(parts), tuple(modules), torch.is_inference_mode_enabled(),
                torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"), torch.is_autocast_cache_enabled(),
                cached, bool(torch.backends.cudnn.benchmark), bool(torch.backends.cudnn.enabled))

    # -- the replay
    def _replay(self, rec):
        _, (events, ops, outputs, spec) = rec
        tr, st = self.tracer, self.state
        made: dict = {}     # call-local block -> the fake tensor made over its new storage
        local: dict = {}    # call-local block -> the trace's new block id
        for action, b, size, phase, category, module, detail, workspace in events:
            if action == "free":
                tr.append_free(local.pop(b))
            elif b in outputs or b in outputs.cached:
                made[b] = self._new_storage(size, outputs.exact.get(b), phase, category, module, ops[b])
                local[b] = tr.block_of(made[b])
            else:
                block = None if workspace else tr.recorder.new_block()
                local[b] = tr.append_alloc(block, size, phase, category, module, detail, ops[b])
        leaves = [_view(made, leaf) if isinstance(leaf, tuple) else leaf for leaf in outputs.leaves]
        for block, (ref, layout) in outputs.cached.items():
            # autocast's weight casts stay in its cache until the outermost autocast region exits
            fc.CAST_CACHE.entries[id(ref())] = (ref, _view(made, (block,) + layout))
        st.forward_since_backward = st.forward_since_backward or torch.is_grad_enabled()
        st.cudnn_benchmark = st.cudnn_benchmark or bool(torch.backends.cudnn.benchmark)
        tr.s.phase = "other"
        self.replayed += 1
        return pytree.tree_unflatten(leaves, spec)

    def _new_storage(self, size, exact, phase, category, module, op):
        """A new fake CUDA storage of ``size`` bytes, recorded in the call's phase, category and
        module: as the one tensor ``exact`` (dtype, shape, stride) that covers it, else as bytes."""
        s = self.tracer.s
        saved = s.phase, s.category
        s.phase, s.category = phase, category or None
        s.module_stack.append(module)
        try:
            dtype, shape, stride = exact or (torch.uint8, (size,), (1,))
            with torch._C.DisableTorchFunction():   # straight to the fake mode, which records it
                t = torch.empty_strided(shape, stride, dtype=dtype, device=fc.DEVICE)
        finally:
            s.module_stack.pop()
            s.phase, s.category = saved
        s.ops[self.tracer.block_of(t)] = op
        return t


class _Outputs(dict):
    """Call-local block -> nbytes of the outputs' storages; ``leaves`` the flattened outputs, each
    a tensor's layout (block, dtype, shape, stride, offset) or a plain value."""

    def __init__(self, blocks: dict, leaves: list, cached: dict, cached_nbytes: dict):
        super().__init__(blocks)
        self.leaves = leaves
        self.cached = cached   # call-local block -> (weakref to the weight, its cast's layout)
        layouts: dict = {}
        for leaf in leaves:
            if isinstance(leaf, tuple):
                layouts.setdefault(leaf[0], []).append(leaf[1:])
        for b, (_ref, layout) in cached.items():
            layouts.setdefault(b, []).append(layout)
        sizes = dict(blocks) | cached_nbytes
        self.exact = {b: e for b, ls in layouts.items() if (e := _exact(ls, sizes[b])) is not None}

    def __eq__(self, other):
        # the cached casts' weights by identity (a tensor's == would compare values on the device)
        return isinstance(other, _Outputs) and dict.__eq__(self, other) and self.leaves == other.leaves \
            and _casts(self.cached) == _casts(other.cached)

    __hash__ = None


def _casts(cached: dict) -> dict:
    return {b: (id(ref()), layout) for b, (ref, layout) in cached.items()}


class _Watch:
    """Watches one recorded call: its events, and whether it did anything a replay would not."""

    def __init__(self, repeats: Repeats):
        self.tracer = repeats.tracer
        self.state = repeats.state
        self.mode = repeats.mode
        self.first_event = len(self.tracer.s.events)
        self.first_block = self.tracer.recorder.next_block
        self.reads = (len(self.state.ledger.reads), self.state.ledger.marked_made)
        self.spoiled = False

    def see(self, func, args, kwargs) -> None:
        """From FakeCudaMode, before each outermost op of the call."""
        if self.spoiled:
            return
        if any(tag in func.tags for tag in _VALUE_TAGS):
            self.spoiled = True   # a value read from the device, or a shape that depends on one
            return
        for i, name in fc._written_args(func):
            t = args[i] if i < len(args) else kwargs.get(name)
            for x in t if isinstance(t, (list, tuple)) else (t,):
                if isinstance(x, torch.Tensor) and not self._made_here(x):
                    self.spoiled = True   # state that existed before the call is written
                    return

    def _made_here(self, t) -> bool:
        if not isinstance(t, fc.FakeTensor):
            return False
        b = self.tracer.recorder.live_block(t)
        return b is not None and b >= self.first_block

    def result(self, out):
        """The call as a replay needs it, or None where it cannot be replayed."""
        if self.spoiled or (len(self.state.ledger.reads), self.state.ledger.marked_made) != self.reads:
            return None
        s = self.tracer.s
        if s.pending is not None:
            return None
        leaves, spec = pytree.tree_flatten(out)
        out_blocks: dict = {}
        described = []
        for leaf in leaves:
            if isinstance(leaf, fc.FakeTensor):
                if not fc._is_fake_cuda(leaf) or leaf.requires_grad or not self._made_here(leaf) \
                        or self.mode.known_of(leaf) is not None \
                        or (self.mode.shadows is not None and self.mode.shadows.get(leaf) is not None):
                    return None
                b = self.tracer.recorder.live_block(leaf)
                out_blocks[b] = leaf.untyped_storage().nbytes()
                described.append((b, leaf.dtype, tuple(leaf.shape), leaf.stride(), leaf.storage_offset()))
            elif type(leaf) in _PLAIN:
                described.append(leaf)
            else:
                return None
        events, ops, local = [], {}, {}
        alive = set()
        for e in s.events[self.first_event:]:
            action, b, size, phase, category, module, *detail = e
            if action == "alloc":
                local[b] = len(local)
                alive.add(b)
                ops[local[b]] = s.ops.get(b, "")
            elif b not in local:
                return None   # freed what existed before the call
            else:
                alive.discard(b)
            events.append((action, local[b], size, phase, category, module, detail[0] if detail else "", b < 0))
        cached, cached_nbytes = {}, {}   # autocast's casts of the weights the call made, kept in its cache (fc._CastCache)
        for ref, cast in list(fc.CAST_CACHE.entries.values()):
            b = self.tracer.recorder.live_block(cast) if ref() is not None else None
            if b in alive and b not in out_blocks:
                cached[local[b]] = (ref, (cast.dtype, tuple(cast.shape), cast.stride(), cast.storage_offset()))
                cached_nbytes[local[b]] = cast.untyped_storage().nbytes()
                alive.discard(b)
        if alive != set(out_blocks) or any(b < 0 for b in alive):
            return None   # kept a block that is not an output's (a workspace: cuBLAS's, once per thread)
        outputs = _Outputs({local[b]: n for b, n in out_blocks.items()},
                           [(local[d[0]],) + d[1:] if isinstance(d, tuple) else d for d in described], cached,
                           cached_nbytes)
        return (tuple(events), ops, outputs, spec)


def _layout(t: torch.Tensor) -> tuple:
    """The strides that can decide what a call allocates: a dimension of size 1 has none (contiguity
    and memory-format checks skip it, and it adds nothing to a storage's extent); the storage
    offset is not looked at by any meta kernel the trace runs either. (minGPT's sampling crops a
    growing context, ``idx[:, -block_size:]``: size (1, T), stride (L, 1), L one larger each call.)"""
    return tuple(st if n != 1 else 0 for n, st in zip(t.shape, t.stride()))


def _view(made: dict, leaf: tuple) -> torch.Tensor:
    block, dtype, shape, stride, offset = leaf
    base = made[block]
    if base.dtype == dtype and tuple(base.shape) == shape and base.stride() == stride and offset == 0:
        return base   # the storage was made as this tensor (_Outputs.exact)
    return base.view(torch.uint8).view(-1).view(dtype).as_strided(shape, stride, offset)


def _exact(layouts: list, nbytes: int):
    """The (dtype, shape, stride) of a tensor at offset 0 that spans a storage of ``nbytes``
    exactly, among the layouts of its views (a call's fresh outputs and casts: nearly always)."""
    for dtype, shape, stride, offset in layouts:
        extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
        if offset == 0 and extent * dtype.itemsize == nbytes:
            return dtype, shape, stride
    return None


def _fingerprint(m: nn.Module, seen: dict) -> tuple:
    """What a module's forward may read besides its inputs, by identity: its attributes (a flag
    set to another value, a replaced tensor), the contents of its parameter, buffer and submodule
    tables, and one level into a plain object it holds (transformers' ``self.config``: a
    ``config.use_cache`` switched between calls). ``seen``: objects already looked into in this key."""
    d = m.__dict__
    out = [(k, id(v), _contents(v, seen)) for k, v in d.items() if k not in ("_parameters", "_buffers", "_modules")]
    for table in ("_parameters", "_buffers", "_modules"):
        out.extend((table, k, id(v)) for k, v in d[table].items())
    return tuple(out)


def _contents(v, seen: dict):
    if isinstance(v, (list, dict, set)):
        return len(v)
    if isinstance(v, (nn.Module, torch.Tensor, type)) or callable(v) or not hasattr(v, "__dict__"):
        return None
    key = id(v)
    if key not in seen:
        seen[key] = tuple((k, id(x), len(x) if isinstance(x, (list, dict, set)) else -1)
                          for k, x in vars(v).items())
    return seen[key]


def _hook_ids() -> tuple:
    mm = torch.nn.modules.module
    return tuple(tuple(d) for d in (mm._global_forward_hooks, mm._global_forward_pre_hooks,
                                    mm._global_backward_hooks, mm._global_backward_pre_hooks))
