"""FSDP2 (``fully_shard``) in an unmodified torchrun script, estimated as one rank of a fake process
group: the script runs unsharded on fake CUDA, with what it asked of ``fully_shard`` recorded, and the
per-rank trace is built from that run by the same model as a declarative ``--parallelism fsdp2``
(estimate/sharding.py). Dynamic analysis only.

Child side (``patches(state)``, added to standins.patched; ``result(state)`` into the child's JSON):
``fully_shard(module, mesh=..., reshard_after_forward=..., mp_policy=..., offload_policy=...)``
records the module as a wrapping unit and does what FSDP2 does to the computation: the unit's
parameters are cast to the policy's param_dtype (the all-gathered parameters the forward and backward
compute with; FSDP2 keeps the sharded originals in their own dtype, which the per-rank model places)
and floating-point forward inputs are cast to it (MixedPrecisionPolicy.cast_forward_inputs). The module
keeps its class; FSDPModule's methods a training loop calls (set_requires_gradient_sync, reshard, ...)
are there and do nothing. ``init_device_mesh`` answers a mesh of the launch's shape. Where each unit's
forward and backward begin and end is marked as for the declarative trace (sharded_trace._Marks).

Parent side (``per_rank``): the first optimizer step of the script's trace becomes a UnitTrace (setup:
what the script allocated before its first batch, parameters aside; the iteration: from the first batch
to the first optimizer step; tail: what step 1 left allocated, freed when the next step frees it), the
script's optimizer class and settings are traced on this rank's shards, and sharding.rank_trace builds
the per-rank trace. The real FSDP2 code is not run: on fake CUDA its DTensor and device-mesh set-up
needs values (``nonzero``) fake tensors do not have.

Not covered (refused with the reason): FSDP1 (FullyShardedDataParallel), CPU offload of an FSDP2
script, explicit prefetch settings (set_modules_to_*_prefetch, recorded as unmodelled notes).
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
from torch import nn

from ..estimate.trace import AllocEvent

_DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# FSDPModule's methods a training loop calls; with one rank's computation traced they change nothing
# the per-rank model does not already place (gradient sync on/off only times the reduce-scatter).
_NOOP_METHODS = ("set_requires_gradient_sync", "set_requires_all_reduce", "set_reshard_after_backward",
                 "set_is_last_backward", "set_post_optim_event", "set_reduce_scatter_divide_factor",
                 "set_unshard_in_backward", "reshard", "unshard", "set_allocate_memory_from_process_group_for_comm")
_UNMODELLED = ("set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch")


@dataclass
class _Wrapped:
    module: nn.Module
    param_dtype: str
    reduce_dtype: str
    reshard_after_forward: bool
    offload: bool
    mesh_shape: tuple[int, ...]


class _FakeMesh:
    """What init_device_mesh returns to a script: its shape and names, nothing to communicate over."""

    def __init__(self, device_type, shape, names=None):
        self.device_type = device_type
        self.shape = tuple(shape)
        self.mesh_dim_names = tuple(names) if names else None
        self.ndim = len(self.shape)

    def size(self, dim=None):
        if dim is None:
            n = 1
            for s in self.shape:
                n *= s
            return n
        return self.shape[dim]

    def get_local_rank(self, dim=None):
        return 0

    def get_rank(self):
        return 0

    def __getitem__(self, names):
        names = (names,) if isinstance(names, str) else tuple(names)
        idx = [self.mesh_dim_names.index(n) for n in names] if self.mesh_dim_names else list(range(len(names)))
        return _FakeMesh(self.device_type, [self.shape[i] for i in idx], names)


class FsdpRecord:
    """What the script asked of fully_shard, and where its units ran (in the child)."""

    def __init__(self, state):
        self.state = state
        self.wrapped: list[_Wrapped] = []
        self.claimed: set[int] = set()
        self.marks = None
        self.root: nn.Module | None = None
        self.notes: list[str] = []
        self.optimizer: dict | None = None
        self.orig_dtype: str | None = None
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        # the script's optimizer, read at its first step (the object is gone once the script stops)
        self._hook = register_optimizer_step_pre_hook(self._first_step)

    def _first_step(self, o, _args, _kwargs):
        if self.optimizer is None and self.wrapped:
            d = o.defaults
            self.optimizer = {"class": type(o).__name__, "module": type(o).__module__,
                              "foreach": d.get("foreach"), "fused": d.get("fused"),
                              "weight_decay": d.get("weight_decay"), "momentum": d.get("momentum"),
                              "amsgrad": d.get("amsgrad"), "centered": d.get("centered")}

    def fully_shard(self, module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                    mp_policy=None, offload_policy=None, ignored_params=None, **_kw):
        if isinstance(module, (list, tuple)):
            for m in module:
                self.fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                                 offload_policy=offload_policy, ignored_params=ignored_params)
            return module
        param = getattr(mp_policy, "param_dtype", None)
        reduce = getattr(mp_policy, "reduce_dtype", None)
        offload = offload_policy is not None and type(offload_policy).__name__ == "CPUOffloadPolicy"
        shape = tuple(mesh.shape) if mesh is not None and hasattr(mesh, "shape") else (self.state.world_size,)
        raf = True if reshard_after_forward is None else bool(reshard_after_forward)
        w = _Wrapped(module, _DTYPE_NAME.get(param, "auto"), _DTYPE_NAME.get(reduce, "auto"), raf, offload, shape)
        if self.orig_dtype is None:   # the dtype FSDP2 keeps the shards in: the script's own parameters'
            self.orig_dtype = next((str(p.dtype).replace("torch.", "") for p in module.parameters()
                                    if p.is_floating_point()), None)
        self.wrapped.append(w)
        if param is not None:
            self._cast_parameters(module, param)
            module.register_forward_pre_hook(functools.partial(_cast_inputs, param), with_kwargs=True)
        module.register_forward_pre_hook(self._first_forward)
        for name in _NOOP_METHODS:
            setattr(module, name, types.MethodType(lambda self, *a, **k: None, module))
        for name in _UNMODELLED:
            setattr(module, name, types.MethodType(functools.partial(self._unmodelled, name), module))
        return module

    def _unmodelled(self, name, _module, *a, **k):
        self.notes.append(f"{name} (explicit prefetch) is not modelled: one unit is prefetched in backward, "
                          "the next one's all-gather overlaps in forward")

    def _cast_parameters(self, module: nn.Module, dtype: torch.dtype) -> None:
        """The unit's parameters (not those of a unit wrapped before) in the param dtype: the
        unsharded parameters FSDP2's forward computes with. A new Parameter per tensor, as FSDP2's
        sharded DTensor parameters are new ones (scripts build the optimizer after fully_shard)."""
        tr = self.state.tracer
        prev, tr.s.category = tr.s.category, "parameter"
        try:
            new_of: dict[int, nn.Parameter] = {}
            for m in module.modules():
                for name, p in list(m._parameters.items()):
                    if p is None or id(p) in self.claimed:
                        continue
                    if id(p) not in new_of:
                        if p.dtype.is_floating_point and p.dtype != dtype:
                            with torch.no_grad():
                                q = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                        else:
                            q = p
                        new_of[id(p)] = q
                    m._parameters[name] = new_of[id(p)]
            self.claimed.update(id(p) for p in new_of.values())
        finally:
            tr.s.category = prev

    def _first_forward(self, module, _args):
        if self.marks is not None:
            return
        from ..estimate.sharded_trace import _Marks

        mods = [w.module for w in self.wrapped]
        inner = {id(c) for m in mods for c in m.modules() if c is not m}
        roots = [m for m in mods if id(m) not in inner]
        self.root = roots[0]
        ids = {id(m) for m in mods if m is not self.root}
        units = [(n, m) for n, m in self.root.named_modules() if n and id(m) in ids]
        self.units = units
        self.marks = _Marks(self.state.tracer, self.root, units)
        self.start = len(self.state.tracer.s.events)

    def result(self) -> dict | None:
        if not self.wrapped:
            return None
        if self.marks is None:
            return {"error": "fully_shard was called but no wrapped module ran a forward"}
        m = self.marks
        root_w = next(w for w in self.wrapped if w.module is self.root)
        units = []
        for name, ps in m.params.items():
            units.append({"name": name or "<root>", "root": name == "", "shapes": [list(p.shape) for p in ps],
                          "fwd_pre": m.fwd_pre.get(name), "fwd_post": m.fwd_post.get(name),
                          "bwd_pre": m.bwd_pre.get(name), "bwd_post": m.bwd_post.get(name),
                          "grad_blocks": list(m.grad_blocks.get(name, ()))})
        opt = self.optimizer
        return {"units": units, "first_forward": self.start, "param_dtype": root_w.param_dtype,
                "reduce_dtype": root_w.reduce_dtype, "reshard_after_forward": all(
                    w.reshard_after_forward for w in self.wrapped if w.module is not self.root),
                "offload": any(w.offload for w in self.wrapped), "mesh_shape": list(root_w.mesh_shape),
                "orig_dtype": self.orig_dtype or "float32", "optimizer": opt, "notes": sorted(set(self.notes))}


def _cast_inputs(dtype, _module, args, kwargs):
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def patches(state) -> list[tuple]:
    """(object, attribute, replacement) for standins.patched; state.fsdp keeps the record."""
    import torch.distributed.device_mesh as dm
    import torch.distributed.fsdp as fsdp

    rec = FsdpRecord(state)
    state.fsdp = rec

    def init_device_mesh(device_type, mesh_shape, *, mesh_dim_names=None, **_kw):
        return _FakeMesh(device_type, mesh_shape, mesh_dim_names)

    out = [(fsdp, "fully_shard", rec.fully_shard), (dm, "init_device_mesh", init_device_mesh)]
    try:
        import torch.distributed._composable.fsdp as comp
        out.append((comp, "fully_shard", rec.fully_shard))
    except ImportError:
        pass
    import torch.distributed as dist
    if hasattr(dist, "init_device_mesh"):
        out.append((dist, "init_device_mesh", init_device_mesh))
    return out


def result(state) -> dict | None:
    rec = getattr(state, "fsdp", None)
    return rec.result() if rec is not None else None


# ---- parent side ---------------------------------------------------------------------------------

_OPT_NAMES = {("SGD", False): "sgd", ("SGD", True): "sgd-momentum", ("Adam", False): "adam", ("AdamW", False): "adamw",
              ("Adam", True): "adam-amsgrad", ("AdamW", True): "adamw-amsgrad"}


def _optimizer_name(opt: dict | None) -> tuple[str, str, float | None]:
    """(--optimizer, --optimizer-impl, weight_decay) of the script's optimizer."""
    from ..errors import EstimateError
    from ..estimate.workload import OPTIMIZER_TABLE

    if opt is None:
        raise EstimateError("the FSDP2 script made no optimizer before its first step", "this is a bug in vest-slurm; report it")
    cls = opt["class"]
    flag = bool(opt.get("momentum")) if cls == "SGD" else bool(opt.get("amsgrad"))
    name = _OPT_NAMES.get((cls, flag))
    if name is None:
        name = next((k for k, (c, kw, _) in OPTIMIZER_TABLE.items() if c == cls and not kw), None)
    if name is None:
        raise EstimateError(f"the script's optimizer {opt['module']}.{cls} is not one the per-rank model traces on shards",
                            "describe the workload with #VEST --model ... --optimizer ...")
    impl = "fused" if opt.get("fused") else ("for-loop" if opt.get("foreach") is False else "foreach")
    return name, impl, opt.get("weight_decay")


def per_rank(info: dict, events: tuple[AllocEvent, ...], step_ends: tuple[int, ...], base_spec, profile):
    """(the per-rank AllocTrace, the WorkloadSpec it stands for) of an FSDP2 script's run."""
    from ..errors import EstimateError
    from ..estimate.sharded_trace import optimizer_trace
    from ..estimate.sharding import Unit, UnitTrace, rank_trace, shard_layout

    if "error" in info:
        raise EstimateError(f"FSDP2 script: {info['error']}", "this is a bug in vest-slurm; report it with the script")
    if info["offload"]:
        raise EstimateError("CPUOffloadPolicy in an FSDP2 script is not modelled by the dynamic estimate",
                            "describe the workload with #VEST --model ... --parallelism fsdp2 --offload params")
    shape = info["mesh_shape"]
    world = 1
    for s in shape:
        world *= s
    parallelism = "hsdp" if len(shape) == 2 and shape[0] > 1 else "fsdp2"
    name, impl, wd = _optimizer_name(info["optimizer"])
    spec = base_spec.with_(parallelism=parallelism, num_gpus=world, shard_group_size=shape[-1] if parallelism == "hsdp" else 0,
                           param_dtype=info["param_dtype"], reduce_dtype=info["reduce_dtype"],
                           reshard_after_forward="on" if info["reshard_after_forward"] else "off",
                           optimizer=name, optimizer_impl=impl, weight_decay=wd,
                           precision={"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[info["orig_dtype"]])
    end = step_ends[0] if step_ends else len(events)
    first = info["first_forward"]
    # the iteration begins with the batch: after the last parameter or optimizer event before the first forward
    start = first
    while start > 0 and events[start - 1].category != "parameter" and events[start - 1].phase != "optimizer":
        start -= 1
    stop = next((i for i in range(first, end) if events[i].phase in ("optimizer", "zero_grad")), end)
    setup = tuple(e for e in events[:start] if e.category != "parameter" and e.phase != "optimizer")
    iteration = tuple(events[start:stop])
    made = {e.block for e in iteration if e.action == "alloc"}
    freed_in = {e.block for e in iteration if e.action == "free"}
    grads = {b for u in info["units"] for b in u["grad_blocks"]}   # rank_trace reduces and frees them
    tail, seen = [], set()
    for e in events[stop:]:   # what step 1 keeps: freed when a later step frees it, else at the run's end
        if e.action == "free" and e.block in made and e.block not in freed_in and e.block not in seen \
                and e.block not in grads:
            seen.add(e.block)
            tail.append(e)
    for e in iteration:
        if e.action == "alloc" and e.block not in freed_in and e.block not in seen and e.block not in grads:
            tail.append(AllocEvent("free", e.block, 0, 0, "", ""))

    def rel(i, default):
        return default if i is None else min(max(i - start, 0), len(iteration))

    first_bwd = next((i for i, e in enumerate(iteration) if e.phase == "backward"), len(iteration))
    units = []
    for u in info["units"]:
        if not u["shapes"]:
            continue
        if u["root"]:
            units.insert(0, Unit("<root>", tuple(tuple(s) for s in u["shapes"]), 0, first_bwd, first_bwd,
                                 rel(u["bwd_post"], len(iteration)), tuple(u["grad_blocks"]), True))
        else:
            units.append(Unit(u["name"], tuple(tuple(s) for s in u["shapes"]), rel(u["fwd_pre"], 0),
                              rel(u["fwd_post"], first_bwd), rel(u["bwd_pre"], first_bwd),
                              rel(u["bwd_post"], len(iteration)), tuple(u["grad_blocks"])))
    if not any(u.is_root for u in units):
        units.insert(0, Unit("<root>", (), 0, first_bwd, first_bwd, first_bwd, (), True))
    ut = UnitTrace(setup, iteration, tuple(tail), tuple(units), info["orig_dtype"], info["orig_dtype"],
                   tuple(info.get("notes", ())))
    layout = shard_layout(ut.units, spec)
    opt = optimizer_trace(spec.with_(num_gpus=1, parallelism="none"), layout.optimizer_tensors,
                          layout.optimizer_dtype, False)
    return rank_trace(ut, opt, spec), spec
