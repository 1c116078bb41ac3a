"""Trace what sharding.py needs: one forward/backward of the unsharded model with its wrapping units
marked, and the optimizer on one rank's shards.

Enters: a WorkloadSpec with a sharded ``parallelism``. Leaves: ``trace_sharded(spec)``, the per-rank
AllocTrace (sharding.rank_trace). The model is traced once per (model, batch, dtype) and kept in
memory: the per-rank trace for another GPU count or strategy is a pure function of it, so placement
can search GPU counts without tracing again.

Units (the wrapping policy): for transformers models each module whose class is in the model's
``_no_split_modules`` (its transformer blocks; what accelerate's and transformers' FSDP auto-wrap
use), else each block of a top-level nn.ModuleList, else each top-level child; the root holds the parameters left over (embeddings, final norm,
head). Where the unit's forward and backward begin and end is read from hooks that allocate
nothing: forward pre/post hooks, a gradient hook on the unit's output (the unit's backward begins
when its output's gradient is ready: FSDP's pre-backward hook) and post-accumulate-grad hooks on its
parameters (its backward is over when all its parameters have their gradient: FSDP's post-backward).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import replace

import torch
from torch import nn

from . import _fakecuda as fc
from . import block_scaling as bs
from . import optimizer_scaling as os_
from .models import build_model
from .profiles import capability_class
from .sharding import (OptimizerTrace, Unit, UnitTrace, rank_trace, shard_layout, unit_spec)
from .trace import AllocEvent, AllocTrace, with_size
from .tracing import _DTYPES, Tracer, _TracerHooks, _module_hooks, _transformers_quiet, cudnn_flags, \
    make_optimizer, run_training_loop
from .workload import WorkloadSpec
from ..errors import EstimateError

def wrap_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The wrapping units in forward (module) order, outermost matches only; the root is not listed."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    out: list[tuple[str, nn.Module]] = []
    if classes:
        taken: list[str] = []
        for name, m in model.named_modules():
            if name and type(m).__name__ in classes and not any(name.startswith(t + ".") for t in taken):
                out.append((name, m))
                taken.append(name)
    if not out:
        # a model's stack of blocks (an nn.ModuleList child: GPT-style ``layers``/``blocks``, what a
        # script wraps with ``for layer in model.layers: fully_shard(layer)``): each block, the root
        # keeping the rest; else each top-level child
        lists = [(n, m) for n, m in model.named_children() if isinstance(m, nn.ModuleList)]
        out = [(f"{n}.{i}", b) for n, m in lists for i, b in m.named_children() if any(True for _ in b.parameters())]
    if not out:
        out = [(n, m) for n, m in model.named_children() if any(True for _ in m.parameters())]
    return out


class _Marks:
    """Event indices where each unit's forward and backward begin and end."""

    def __init__(self, tracer: Tracer, model: nn.Module, units: list[tuple[str, nn.Module]]):
        self.t = tracer
        self.fwd_pre: dict[str, int] = {}
        self.fwd_post: dict[str, int] = {}
        self.bwd_pre: dict[str, int] = {}
        self.bwd_post: dict[str, int] = {}
        self.recomputed: set[str] = set()
        self.grad_blocks: dict[str, list[int]] = {}
        self.handles = []
        seen: set[int] = set()
        self.params: dict[str, list[nn.Parameter]] = {}
        for name, m in units + [("", model)]:
            ps = [p for p in m.parameters() if id(p) not in seen]
            seen.update(id(p) for p in ps)
            self.params[name] = ps
        for name, m in units:
            self.handles.append(m.register_forward_pre_hook(functools.partial(self._pre, name)))
            self.handles.append(m.register_forward_hook(functools.partial(self._post, name)))
        for name, ps in self.params.items():
            left = {id(p) for p in ps if p.requires_grad}
            for p in ps:
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(
                        functools.partial(self._grad, name, left)))

    def now(self) -> int:
        return len(self.t.s.events)

    def _in_backward(self) -> bool:
        return fc.current_autograd_node() is not None or self.t.s.phase == "backward"

    def _pre(self, name, _mod, _inp):
        if not self._in_backward():   # a recompute (activation checkpointing) is not a forward
            self.fwd_pre.setdefault(name, self.now())
        else:
            self.recomputed.add(name)

    def _post(self, name, _mod, _inp, out):
        if self._in_backward():
            return
        self.fwd_post.setdefault(name, self.now())
        t = out if isinstance(out, torch.Tensor) else next(
            (o for o in (out if isinstance(out, (tuple, list)) else getattr(out, "values", lambda: ())())
             if isinstance(o, torch.Tensor) and o.requires_grad), None)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            self.handles.append(t.register_hook(functools.partial(self._grad_ready, name)))

    def _grad_ready(self, name, _g):
        self.bwd_pre.setdefault(name, self.now())

    def _grad(self, name, left: set, p):
        b = self.t.block_of(p.grad) if p.grad is not None else None
        if b is not None:
            self.grad_blocks.setdefault(name, []).append(b)
        left.discard(id(p))
        if not left:
            self.bwd_post.setdefault(name, self.now())

    def remove(self):
        for h in self.handles:
            h.remove()


_UNIT_TRACES: dict[tuple[WorkloadSpec, bool], UnitTrace] = {}
_UNIT_TRACES_KEPT = 8


def unit_trace(cspec: WorkloadSpec, capability: tuple[int, int], total_memory_bytes: int) -> UnitTrace:
    """The unsharded model's one traced iteration with its units marked, kept in memory per GPU
    class (profiles.capability_class): GPU types of one class share it, as they share the trace of
    a job on one GPU (estimator.trace_classes), so every GPU count of a sharding alternative on the
    A100 and the H100 is built from one trace, the first one asked for."""
    k = (cspec, capability_class(capability))
    if k not in _UNIT_TRACES:
        while len(_UNIT_TRACES) >= _UNIT_TRACES_KEPT:
            _UNIT_TRACES.pop(next(iter(_UNIT_TRACES)))
        _UNIT_TRACES[k] = _traced_units(cspec, capability, total_memory_bytes)
    return _UNIT_TRACES[k]


def forget_unit_traces() -> None:
    _UNIT_TRACES.clear()


def _traced_units(cspec: WorkloadSpec, capability: tuple[int, int], total_memory_bytes: int) -> UnitTrace:
    """unit_trace, made. A stack of at least block_scaling.MIN_BLOCKS identical blocks is traced cut
    to 4 and 5 blocks and scaled (block_scaling.py), where the 4-block trace repeated gives the
    5-block one exactly; else whole."""
    # the model is built seeing the GPU it is traced on (tracing._trace_training)
    with _transformers_quiet(cspec), fc.cuda_answers(total_memory_bytes=total_memory_bytes, capability=capability,
                                                     scalar_draws_at_the_top=True):
        built = build_model(cspec)
        names = [n for n, _m in wrap_units(built.module)]
        stack = bs.stack_of(names)
        why = None
        if stack is None or stack[1] < bs.MIN_BLOCKS:
            return _unit_trace(cspec, built, capability, total_memory_bytes)
        prefix, count = stack
        t0 = time.perf_counter()
        cut5 = _cut_stack(built, prefix, count, 5)
        if isinstance(cut5, str):
            why = cut5
        else:
            ut5 = _unit_trace(cspec, cut5, capability, total_memory_bytes)
            cut4 = _cut_stack(build_model(cspec), prefix, count, 4)
            ut4 = _unit_trace(cspec, cut4, capability, total_memory_bytes)
            try:
                if bs.same(bs.scale(ut4, prefix, 5), ut5):
                    ut = bs.scale(ut4, prefix, count)
                    note = (f"{bs.SCALED_NOTE}: {prefix} has {count} blocks of the same shapes; traced with 4 and "
                            f"5 of them ({time.perf_counter() - t0:.1f} s), block 2 repeated for blocks 2-{count - 2} "
                            "(the 4-block trace repeated gives the 5-block trace exactly)")
                    return replace(ut, notes=ut4.notes + (note,))
                why = f"the 4-block trace repeated is not the 5-block trace ({bs.first_difference(bs.scale(ut4, prefix, 5), ut5)})"
            except bs.NotPeriodic as e:
                why = str(e)
        ut = _unit_trace(cspec, build_model(cspec), capability, total_memory_bytes)
        return replace(ut, notes=ut.notes + (f"{bs.WHOLE_NOTE}: {prefix} ({count} blocks) traced whole: {why}",))


def _cut_stack(built, prefix: str, count: int, keep: int):
    """``built`` with the nn.ModuleList at ``prefix`` cut to its first ``keep`` blocks (and a
    transformers config's layer count with it: its forward loops over layers[:num_hidden_layers]),
    or why it cannot be cut."""
    model = built.module
    parent_name, _, attr = prefix.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    stack = getattr(parent, attr, None)
    if not isinstance(stack, nn.ModuleList) or len(stack) != count:
        return f"{prefix} is not one nn.ModuleList of {count} blocks"
    first = list(stack[0].named_parameters())
    for b in stack:
        if type(b) is not type(stack[0]) or [(n, p.shape) for n, p in b.named_parameters()] != \
                [(n, p.shape) for n, p in first]:
            return f"the blocks of {prefix} differ in class or parameter shapes"
    setattr(parent, attr, nn.ModuleList(list(stack)[:keep]))
    config = getattr(model, "config", None)
    for key in ("num_hidden_layers",):
        if config is not None and getattr(config, key, None) == count:
            setattr(config, key, keep)
        if config is not None and isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:keep]
    return built


def _unit_trace(spec: WorkloadSpec, built, capability, total_memory_bytes) -> UnitTrace:
    t0 = time.perf_counter()
    tracer = Tracer(capability)
    mode = fc.FakeCudaMode(tracer.recorder)
    model = built.module
    units = wrap_units(model)
    try:
        with (cudnn_flags(spec), fc.cuda_answers(total_memory_bytes=total_memory_bytes, capability=capability,
                                                    scalar_draws_at_the_top=True), tracer, mode, fc.CudaFactoryMode()):
            tracer.s.category = "parameter"
            fc.materialize(model, _DTYPES[spec.weight_dtype], spec.channels_last)
            tracer.s.category = None
            hooks = _module_hooks(tracer, model)
            marks = _Marks(tracer, model, units)
            try:
                opt = run_training_loop(model, built, spec, fc.DEVICE, _TracerHooks(tracer, mode))
                tracer.freeze()
                del opt
            finally:
                marks.remove()
                for h in hooks:
                    h.remove()
    except EstimateError:
        raise
    except (RuntimeError, ValueError, TypeError, AttributeError, IndexError, NotImplementedError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise EstimateError(f"tracing {spec.model} for the sharded model failed: {type(e).__name__}: {msg}",
                            "check that --input matches the model") from None
    trace = tracer.finish(1, (f"traced in {time.perf_counter() - t0:.2f} s",))
    ev = trace.events
    start = next((i for i, e in enumerate(ev) if e.action == "alloc" and e.category == "input"), None)
    end = trace.step_ends[0] if trace.step_ends else len(ev)
    if start is None:
        raise EstimateError(f"{spec.model}: the traced loop made no input batch", "this is a bug in vest-slurm; report it")
    stop = next((i for i in range(start, end) if ev[i].phase in ("optimizer", "zero_grad")), end)
    first_bwd = next((i for i in range(start, stop) if ev[i].phase == "backward"), stop)
    setup = tuple(e for e in ev[:start] if e.category != "parameter" and e.phase != "optimizer")
    iteration = tuple(ev[start:stop])
    tail = tuple(e for e in ev[end:] if e.action == "free")

    def rel(i: int | None, default: int) -> int:
        return default if i is None else min(max(i - start, 0), len(iteration))

    out: list[Unit] = []
    params = marks.params
    root_shapes = tuple(tuple(p.shape) for p in params[""])
    out.append(Unit("<root>", root_shapes, 0, rel(first_bwd, first_bwd - start), rel(first_bwd, first_bwd - start),
                    rel(marks.bwd_post.get(""), len(iteration)), tuple(marks.grad_blocks.get("", ())), True))
    for name, _m in units:
        if not params[name]:
            continue
        fpre = rel(marks.fwd_pre.get(name), 0)
        out.append(Unit(name, tuple(tuple(p.shape) for p in params[name]), fpre,
                        rel(marks.fwd_post.get(name), first_bwd - start),
                        rel(marks.bwd_pre.get(name), first_bwd - start),
                        rel(marks.bwd_post.get(name), len(iteration)), tuple(marks.grad_blocks.get(name, ())),
                        recomputed=name in marks.recomputed))
    return UnitTrace(setup, iteration, tail, tuple(out), spec.weight_dtype, spec.weight_dtype, trace.notes)


@functools.lru_cache(maxsize=64)
def optimizer_trace(spec: WorkloadSpec, shapes: tuple[tuple[int, ...], ...], dtype: str,
                    keep_grads: bool) -> OptimizerTrace:
    """The optimizer of ``spec`` stepping tensors of ``shapes`` (this rank's shards) twice on fake
    CUDA: its states and temporaries, exactly as torch's implementation makes them. The shards and
    their gradients are left out (sharding.py places them), unless ``keep_grads`` (DeepSpeed's fp32
    gradient partition, made for the step and dropped after it). A run of at least
    optimizer_scaling.MIN_COPIES identical blocks' shards is traced with 4 and 5 of them and scaled
    (optimizer_scaling.py), where the 4-copy trace scaled gives the 5-copy one exactly; else whole.

    The shards of another GPU count are the same list with other sizes. Where the trace at one
    count, its sizes mapped tensor by tensor (_size_map), gave the traced one at a second count
    exactly, the optimizer makes nothing whose size is not one of its tensors' (a state, a
    temporary of the same shape) or fixed: the traces of further counts are that first trace
    resized, not traced (a GPU count search: 2, 4, 8, ... GPUs)."""
    key = _family(spec, shapes, dtype, keep_grads)
    fam = _FAMILIES.get(key)
    if fam is not None and fam[2]:
        m = _size_map(fam[0], shapes)
        if m is not None:
            return _resized(fam[1], m)
    made = _traced_optimizer(spec, shapes, dtype, keep_grads)
    if fam is None:
        while len(_FAMILIES) >= 16:
            _FAMILIES.pop(next(iter(_FAMILIES)))
        _FAMILIES[key] = [shapes, made, False]
    elif not fam[2] and fam[0] != shapes:
        m = _size_map(fam[0], shapes)
        fam[2] = m is not None and _canonical(_resized(fam[1], m)) == _canonical(made)
    return made


# {family: [shapes, OptimizerTrace, whether resizing it gave a second count's trace exactly]}
_FAMILIES: dict[tuple, list] = {}
_ITEMSIZES = (1, 2, 4, 8)   # a tensor's bytes are its elements times one of these


def _family(spec: WorkloadSpec, shapes, dtype: str, keep_grads: bool) -> tuple:
    """What the optimizer's traces at other GPU counts share: the optimizer, the dtype, and the
    list's pattern (each tensor's dimensions, and the first tensor of its shape)."""
    first: dict = {}
    return spec, dtype, keep_grads, tuple((len(s), first.setdefault(s, i)) for i, s in enumerate(shapes))


def _size_map(a, b) -> dict[int, int] | None:
    """{bytes of a tensor of ``a``: bytes of its counterpart in ``b``}, per element size; None where
    two tensors of one size in ``a`` have counterparts of different sizes."""
    m: dict[int, int] = {}
    for sa, sb in zip(a, b):
        na, nb = math.prod(sa), math.prod(sb)
        for k in _ITEMSIZES:
            if m.setdefault(na * k, nb * k) != nb * k:
                return None
    return m


def _resized(tr: OptimizerTrace, m: dict[int, int]) -> OptimizerTrace:
    def each(events):
        return tuple(with_size(e, m.get(e.size_bytes, e.size_bytes)) for e in events)
    return OptimizerTrace(each(tr.construct), tuple(each(st) for st in tr.steps))


def _canonical(tr: OptimizerTrace) -> tuple:
    events = [*tr.construct, *(e for st in tr.steps for e in st)]
    cuts, at = [len(tr.construct)], len(tr.construct)
    for st in tr.steps:
        at += len(st)
        cuts.append(at)
    return os_.canonical(events, cuts)


def _traced_optimizer(spec: WorkloadSpec, shapes, dtype: str, keep_grads: bool) -> OptimizerTrace:
    run = os_.repeated_run(shapes)
    if run is not None:
        ev4, cuts4 = _optimizer_events(spec, run.cut(shapes, 4), dtype, keep_grads)
        ev5, cuts5 = _optimizer_events(spec, run.cut(shapes, 5), dtype, keep_grads)
        try:
            return _split(*os_.scale((ev4, cuts4), (ev5, cuts5), run.count))
        except os_.NotPeriodic:
            pass   # traced whole
    return _split(*_optimizer_events(spec, shapes, dtype, keep_grads))


def _split(kept, pos) -> OptimizerTrace:
    """The optimizer's events cut at its construction and each step's end."""
    construct = tuple(kept[:pos[0]])
    steps = tuple(tuple(kept[pos[i]:pos[i + 1]]) for i in range(len(pos) - 1))
    return OptimizerTrace(construct, steps)


def _optimizer_events(spec: WorkloadSpec, shapes, dtype: str, keep_grads: bool) -> tuple[list, list]:
    """(the optimizer's events on ``shapes``, the index after its construction and after each of
    its two steps)."""
    tracer = Tracer()
    mode = fc.FakeCudaMode(tracer.recorder)
    hooks = _TracerHooks(tracer, mode)
    cuts = []
    with fc.cuda_answers(total_memory_bytes=1 << 40, capability=(8, 0), scalar_draws_at_the_top=True), mode, \
            fc.CudaFactoryMode():
        tracer.s.category = "parameter"
        params = [nn.Parameter(torch.empty(s, dtype=_DTYPES[dtype], device=fc.DEVICE)) for s in shapes]
        tracer.s.category = None
        hooks.phase("optimizer")
        opt = make_optimizer(spec, params)
        cuts.append(len(tracer.s.events))
        for _ in range(2):
            hooks.phase("setup")
            tracer.s.category = "gradient"
            for p in params:
                p.grad = torch.empty_like(p)
            tracer.s.category = None
            hooks.phase("optimizer")
            opt.step()
            tracer.mark([v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)],
                        "optimizer_state")
            hooks.phase("zero_grad")
            opt.zero_grad(set_to_none=True)
            cuts.append(len(tracer.s.events))
        tracer.freeze()
        del opt
    ev = tracer.finish(2).events
    drop = {e.block for e in ev if e.action == "alloc" and
            (e.category == "parameter" or (e.category == "gradient" and not keep_grads))}
    kept = [e for e in ev if e.block not in drop]
    # cut positions in the kept list
    pos = [sum(1 for e in ev[:c] if e.block not in drop) for c in cuts]
    return kept, pos


def trace_sharded(spec: WorkloadSpec, capability: tuple[int, int] = (8, 0),
                  total_memory_bytes: int = 80 * 2**30) -> AllocTrace:
    """The per-rank trace of a sharded job (sharding.rank_trace)."""
    from .sharding import check_supported

    check_supported(spec)
    t0 = time.perf_counter()
    ut = unit_trace(unit_spec(spec), capability, total_memory_bytes)
    layout = shard_layout(ut.units, spec)
    opt = optimizer_trace(spec.with_(num_gpus=1, parallelism="none"), layout.optimizer_tensors,
                          layout.optimizer_dtype, spec.parallelism.startswith("zero"))
    tr = rank_trace(ut, opt, spec)
    return replace(tr, notes=tr.notes + (f"per-rank trace built in {time.perf_counter() - t0:.2f} s",))
