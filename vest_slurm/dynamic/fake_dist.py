"""FSDP1 (``FullyShardedDataParallel``) and FSDP2 (``fully_shard``) in an unmodified torchrun script,
estimated as one rank of a fake process group: the script runs unsharded on fake CUDA, with what it
asked of the wrapper recorded, and the per-rank trace is built from that run by the same model as a
declarative ``--parallelism fsdp`` / ``fsdp2`` / ``hsdp`` (estimate/sharding.py). Dynamic analysis only.

Child side (``patches(state)``, added to standins.patched; ``result(state)`` into the child's JSON):
``fully_shard(module, mesh=..., reshard_after_forward=..., mp_policy=..., offload_policy=...)``
records the module as a wrapping unit and does what FSDP2 does to the computation: the unit's
parameters are cast to the policy's param_dtype (the all-gathered parameters the forward and backward
compute with; FSDP2 keeps the sharded originals in their own dtype, which the per-rank model places)
and floating-point forward inputs are cast to it (MixedPrecisionPolicy.cast_forward_inputs). The
module's class becomes FSDP<Class>(FSDPModule, Class) as fully_shard makes it, each FSDPModule method
decided (no-op, noted as unmodelled, or refused by name); its parameters answer Shard(0) placements.
``init_device_mesh`` answers a mesh of the launch's shape. ``FullyShardedDataParallel`` is a subclass
of the real class whose auto-wrapping is torch's own (_wrap_utils._auto_wrap, every policy kind);
each instance records its unit, its sharding strategy (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD,
_HYBRID_SHARD_ZERO2; NO_SHARD is refused with DDP's advice), MixedPrecision and CPUOffload. Where each
unit's forward and backward begin and end is marked as for the declarative trace (sharded_trace._Marks).

Parent side (``per_rank``): the first optimizer step of the script's trace becomes a UnitTrace (setup:
what the script allocated before its first batch, parameters aside; the iteration: from the first batch
to the first optimizer step; tail: what step 1 left allocated, freed when the next step frees it), the
script's optimizer class and settings are traced on this rank's shards, and sharding.rank_trace builds
the per-rank trace. The real FSDP code is not run: on fake CUDA its DTensor and device-mesh set-up
needs values (``nonzero``) fake tensors do not have, and FSDP1's flat parameters need real storage.

Not covered (refused with the reason): CPU offload of an FSDP2 script (FSDP1's CPUOffload(offload_params)
is the per-rank model's --offload params), FSDP1's NO_SHARD, a script mixing FSDP1 and FSDP2; explicit
prefetch settings and FSDP1's backward_prefetch other than BACKWARD_PRE, forward_prefetch and
limit_all_gathers=False are recorded as unmodelled notes.
"""

from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass

import torch
from torch import nn

from ..estimate.trace import AllocEvent
from ..estimate.workload import optimizer_name

_DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# FSDPModule's methods, each decided (the class a module becomes under fully_shard, _as_fsdp_module).
# No-ops: with one rank's computation traced they change nothing the per-rank model does not already
# place (gradient sync on/off, divide factors and post-optimizer events only time or scale the
# collectives; unshard/reshard called by hand move nothing the schedule does not already move).
_NOOP_METHODS = ("set_requires_gradient_sync", "set_requires_all_reduce", "set_reshard_after_backward",
                 "set_is_last_backward", "set_post_optim_event", "set_reduce_scatter_divide_factor",
                 "set_gradient_divide_factor", "set_force_sum_reduction_for_comms", "set_unshard_in_backward",
                 "set_reduce_scatter_unused_params", "set_separate_reduce_scatter_group", "reset_iter_state",
                 "reshard", "set_allocate_memory_from_process_group_for_comm", "_set_unshard_async_op",
                 "set_all_reduce_hook")
# Accepted, and said in the estimate's notes: they change what is alive at once in ways the per-rank
# schedule (sharding.py: implicit forward prefetch, backward prefetch of one, one reduce-scatter input
# in flight, NCCL's own buffers) does not follow.
_UNMODELLED = {"set_modules_to_forward_prefetch": "explicit forward prefetch",
               "set_modules_to_backward_prefetch": "explicit backward prefetch",
               "set_custom_all_gather": "a custom all-gather", "set_custom_reduce_scatter": "a custom reduce-scatter",
               "set_reduce_scatter_max_input_buffers": "more reduce-scatter inputs in flight",
               "set_symm_mem_for_comm": "symmetric-memory communication buffers"}


class _UnshardHandle:
    """What unshard(async_op=True) returns: wait() has nothing to wait for."""

    def wait(self) -> None:
        return None


@dataclass
class _Wrapped:
    module: nn.Module
    param_dtype: str
    reduce_dtype: str
    reshard_after_forward: bool
    offload: bool
    mesh_shape: tuple[int, ...]
    kind: str = "fsdp2"           # fsdp2 (fully_shard) or fsdp (FSDP1, FullyShardedDataParallel)
    sharding: str = "full-shard"  # FSDP1's sharding_strategy (workload.SHARDINGS)


class _FakeMesh:
    """What init_device_mesh returns to a script: its shape and names, nothing to communicate over."""

    def __init__(self, device_type, shape, names=None, root=None):
        self.device_type = device_type
        self.shape = tuple(shape)
        self.mesh_dim_names = tuple(names) if names else None
        self.ndim = len(self.shape)
        self._root = root          # the mesh it was cut or reshaped from (None: it is the root)
        self._flattened = {}       # name -> the 1-D mesh a _flatten made (found by name on the root)

    def size(self, mesh_dim=None):
        if mesh_dim is None:
            n = 1
            for s in self.shape:
                n *= s
            return n
        return self.shape[mesh_dim]

    def get_local_rank(self, mesh_dim=None):
        return 0

    def get_rank(self):
        return 0

    def get_coordinate(self):
        return [0] * self.ndim

    def get_group(self, mesh_dim=None):
        # the fake process group of the launch (standins._init_process_group): collectives on it
        # return at once; None (the default group) where the script has not initialised one
        import torch.distributed as dist

        return dist.group.WORLD if dist.is_initialized() else None

    def __getitem__(self, names):
        names = (names,) if isinstance(names, str) else tuple(names)
        flat = self._get_root_mesh()._flattened
        if len(names) == 1 and names[0] in flat and names[0] not in (self.mesh_dim_names or ()):
            return flat[names[0]]
        idx = [self.mesh_dim_names.index(n) for n in names] if self.mesh_dim_names else list(range(len(names)))
        return _FakeMesh(self.device_type, [self.shape[i] for i in idx], names, self._get_root_mesh())

    def _get_root_mesh(self):
        return self._root if self._root is not None else self

    def _unflatten(self, dim, mesh_sizes, mesh_dim_names, backend_override=None):
        """One dimension split into several named ones (torchtitan's ParallelDims.build_mesh: a 1-D
        world mesh unflattened into dp_replicate, fsdp, cp, tp, ...), as DeviceMesh._unflatten."""
        i = self.mesh_dim_names.index(dim) if isinstance(dim, str) else int(dim)
        sizes, new = tuple(int(n) for n in mesh_sizes), tuple(mesh_dim_names)
        if math.prod(sizes) != self.shape[i] or len(sizes) != len(new):
            raise ValueError(f"the sizes {sizes} named {new} do not unflatten mesh dimension {dim} of size {self.shape[i]}")
        names = self.mesh_dim_names or tuple(f"dim{k}" for k in range(self.ndim))
        return _FakeMesh(self.device_type, self.shape[:i] + sizes + self.shape[i + 1:], names[:i] + new + names[i + 1:],
                         self._get_root_mesh())

    def _flatten(self, mesh_dim_name=None, backend_override=None):
        """This mesh as one dimension, found by its name on the root afterwards (DeviceMesh._flatten)."""
        name = mesh_dim_name or "_".join(self.mesh_dim_names or ())
        mesh = _FakeMesh(self.device_type, (self.size(),), (name,), self._get_root_mesh())
        self._get_root_mesh()._flattened[name] = mesh
        return mesh

    def __getattr__(self, name):
        # Only what the fully_shard and parallelize_module stand-ins (fake_tp.py) read is here; a
        # script's own DTensors ask for more, and they do not run on fake CUDA: vest's gap.
        from .cuda_surface import NotSupportedHere

        if name.startswith("__"):
            raise AttributeError(name)
        raise NotSupportedHere(f"DeviceMesh.{name}", "a device mesh is modelled for fully_shard and "
                               "parallelize_module; other uses of it (DTensors the script makes) are not traced")


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
        self._classes: dict[type, type] = {}
        self._outermost: dict[int, bool] = {}
        self.refusal: tuple[str, str] | None = None   # (what is not modelled, what to do)
        self.orig_dtype: str | None = None
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        # the script's optimizer, read at its first step (the object is gone once the script stops)
        self._hook = register_optimizer_step_pre_hook(self._first_step)

    def _first_step(self, o, _args, _kwargs):
        if self.optimizer is None and self.wrapped:
            self.optimizer = describe_optimizer(o)

    def fully_shard(self, module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                    mp_policy=None, offload_policy=None, ignored_params=None, **_kw):
        if isinstance(module, (list, tuple)):
            for m in module:
                self.fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                                 offload_policy=offload_policy, ignored_params=ignored_params)
            return module
        if not isinstance(module, (list, tuple)):
            states = [*module.parameters(), *module.buffers()]
            # FSDP2 moves a module's CPU states to the device (_fsdp_init._move_states_to_device; meta
            # ones stay for to_empty): transformers' Trainer and accelerate leave the model on the CPU
            if states and not any(t.is_meta for t in states) and any(t.device.type == "cpu" for t in states):
                module.to(torch.device("cuda", 0))
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
        self._as_fsdp_module(module)
        return module

    def materialize(self, module: nn.Module, param_init_fn, device_id) -> None:
        """What FSDP1 does to a module's parameters before it flattens them (_init_utils.py
        _materialize_with_param_init_fn / _materialize_meta_module, _move_module_to_device): meta
        parameters are made by the script's param_init_fn, else to_empty + reset_parameters on the
        device; CPU parameters go to the device (with device_id; without one FSDP1 also computes on
        the current CUDA device)."""
        params = list(module.parameters())
        if any(p.is_meta for p in params):
            if param_init_fn is not None:
                param_init_fn(module)
            else:
                module.to_empty(device=torch.device("cuda", 0))
                for m in module.modules():
                    if callable(getattr(m, "reset_parameters", None)):
                        m.reset_parameters()
        elif any(p.device.type != "cuda" for p in params):
            module.to(torch.device("cuda", 0))

    def fsdp1(self, wrapper: nn.Module, module: nn.Module, strategy, cpu_offload, mixed, backward_prefetch,
              forward_prefetch, limit_all_gathers, process_group, device_mesh) -> None:
        """Record one FullyShardedDataParallel unit (the wrapper; the root is the outermost one)."""
        name = getattr(strategy, "name", None) or "FULL_SHARD"
        if name == "NO_SHARD":
            self.refusal = ("ShardingStrategy.NO_SHARD keeps whole parameters, gradients and states on every rank "
                            "(DistributedDataParallel's memory)", "describe the workload with #VEST --model ... --num-gpus N "
                            "(data parallel)")
        sharding = _FSDP1_SHARDING.get(name)
        if sharding is None and name != "NO_SHARD":
            self.refusal = (f"FSDP1 sharding_strategy {name} is not modelled", "describe the workload with #VEST "
                            "--model ... --parallelism fsdp --sharding full-shard|shard-grad-op")
        sharding = sharding or "full-shard"
        shape = (self.state.world_size,)
        if device_mesh is not None and hasattr(device_mesh, "shape"):
            shape = tuple(device_mesh.shape)
        elif sharding.startswith("hybrid"):
            # _init_process_group_state_for_hybrid_shard: a tuple (shard group, replicate group) as given,
            # else the intra-node group of torch.cuda.device_count() ranks (one node's GPUs)
            intra = process_group[0] if isinstance(process_group, tuple) else None
            size = intra.size() if intra is not None and hasattr(intra, "size") else torch.cuda.device_count()
            size = max(1, min(size, self.state.world_size))
            shape = (self.state.world_size // size, size)
        param = getattr(mixed, "param_dtype", None)
        reduce = getattr(mixed, "reduce_dtype", None)
        offload = bool(getattr(cpu_offload, "offload_params", False))
        w = _Wrapped(wrapper, _DTYPE_NAME.get(param, "auto"), _DTYPE_NAME.get(reduce, "auto"),
                     sharding in ("full-shard", "hybrid-shard"), offload, shape, "fsdp", sharding)
        if self.orig_dtype is None:
            self.orig_dtype = next((str(p.dtype).replace("torch.", "") for p in module.parameters()
                                    if p.is_floating_point()), None)
        self.wrapped.append(w)
        bp = getattr(backward_prefetch, "name", backward_prefetch)
        if bp not in ("BACKWARD_PRE", None):
            self.notes.append(f"FSDP1 backward_prefetch={bp} is not modelled: the per-rank schedule prefetches one "
                              "unit before each unit's backward (BACKWARD_PRE)")
        if bp is None:
            self.notes.append("FSDP1 backward_prefetch=None is not modelled: the per-rank schedule prefetches one unit "
                              "in backward (BACKWARD_PRE), which holds one more unit than the run would")
        if forward_prefetch:
            self.notes.append("FSDP1 forward_prefetch=True is not modelled: one more unit may be unsharded in forward")
        if not limit_all_gathers:
            self.notes.append("FSDP1 limit_all_gathers=False is not modelled: the CPU may run further ahead of the "
                              "all-gathers than the two units the per-rank schedule keeps")
        if param is not None:
            self._cast_parameters(module, param)
        buffer = getattr(mixed, "buffer_dtype", None)
        if buffer is not None:
            for m in module.modules():
                for k, b in list(m._buffers.items()):
                    if b is not None and b.is_floating_point() and b.dtype != buffer:
                        m._buffers[k] = b.to(buffer)
        if param is not None:
            root_cast = getattr(mixed, "cast_root_forward_inputs", True)
            child_cast = getattr(mixed, "cast_forward_inputs", False)

            def cast(mod, args, kwargs):
                if child_cast or (root_cast and self.is_outermost(mod)):
                    return _cast_inputs(param, mod, args, kwargs)
                return None

            wrapper.register_forward_pre_hook(cast, with_kwargs=True)
        wrapper.register_forward_pre_hook(self._first_forward)

    def is_outermost(self, module: nn.Module) -> bool:
        """Whether no other wrapped unit contains ``module`` (FSDP1's root), decided at its first call."""
        if id(module) not in self._outermost:
            self._outermost[id(module)] = not any(c is module for w in self.wrapped if w.module is not module
                                                  for c in w.module.modules())
        return self._outermost[id(module)]

    def _as_fsdp_module(self, module: nn.Module) -> None:
        """The module's class becomes FSDP<Class>(FSDPModule, Class), as fully_shard makes it
        (_fsdp_init._apply_to_module): scripts check ``isinstance(model, FSDPModule)``. FSDPModule's
        methods that would reach FSDP2's state do nothing here (_NOOP_METHODS) or are noted
        (_UNMODELLED); the parameters answer ``placements`` as FSDP2's DTensor shards do (Shard(0))."""
        from torch.distributed.fsdp import FSDPModule

        cls = type(module)
        if not isinstance(module, FSDPModule):
            new = self._classes.get(cls)
            if new is None:
                new = self._classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), self._fsdp_methods(cls))
            module.__class__ = new
        try:
            from torch.distributed.tensor import Shard

            for p in module.parameters():
                if not hasattr(p, "placements"):
                    p.placements = (Shard(0),)
        except ImportError:
            pass

    def _fsdp_methods(self, cls: type) -> dict:
        """FSDPModule's attributes for FSDP<cls>: every one decided; one torch adds later refuses by
        name (vest must act) rather than reach FSDP2's state, which this run does not build."""
        from torch.distributed.fsdp import FSDPModule

        from .cuda_surface import NotSupportedHere

        rec = self
        dct: dict = {"__deepcopy__": FSDPModule.__dict__.get("__deepcopy__"), "_apply": cls._apply}
        for name in _NOOP_METHODS:
            dct[name] = lambda _self, *a, **k: None
        for name, what in _UNMODELLED.items():
            dct[name] = (lambda w: lambda _self, *a, **k: rec._unmodelled(w))(what)

        def unshard(_self, async_op=False):
            return _UnshardHandle() if async_op else None

        def set_reshard_after_forward(_self, reshard_after_forward, recurse=True):
            for w in rec.wrapped:
                if w.module is _self or (recurse and any(m is w.module for m in _self.modules())):
                    w.reshard_after_forward = bool(reshard_after_forward)

        dct.update(unshard=unshard, set_reshard_after_forward=set_reshard_after_forward)
        for name in FSDPModule.__dict__:
            if name not in dct and not name.startswith("__") and name != "_orig_cls_mro_index":
                def refuse(_self, *a, _n=name, **k):
                    raise NotSupportedHere(f"FSDPModule.{_n}", "the dynamic estimate does not build FSDP2's state")
                dct[name] = refuse
        if dct["__deepcopy__"] is None:
            del dct["__deepcopy__"]
        return dct

    def _unmodelled(self, what: str) -> None:
        self.notes.append(f"{what} (set by the script) is not modelled: the per-rank schedule prefetches one unit "
                          "in backward, overlaps the next one's all-gather in forward, keeps one reduce-scatter "
                          "input in flight")

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
        raf = {n: w.reshard_after_forward for w in self.wrapped for n, mod in self.units if mod is w.module}
        for name, ps in m.params.items():
            units.append({"name": name or "<root>", "root": name == "", "shapes": [list(p.shape) for p in ps],
                          "reshard_after_forward": raf.get(name),
                          "fwd_pre": m.fwd_pre.get(name), "fwd_post": m.fwd_post.get(name),
                          "bwd_pre": m.bwd_pre.get(name), "bwd_post": m.bwd_post.get(name),
                          "grad_blocks": list(m.grad_blocks.get(name, ()))})
        opt = self.optimizer
        kinds = {w.kind for w in self.wrapped}
        if len(kinds) > 1:
            return {"refused": ["the script wraps with both FSDP1 (FullyShardedDataParallel) and FSDP2 (fully_shard): "
                                "the per-rank model places one of them", "describe the workload with #VEST --model ... "
                                "--parallelism fsdp|fsdp2"]}
        if self.refusal:
            return {"refused": list(self.refusal)}
        return {"units": units, "first_forward": self.start, "param_dtype": root_w.param_dtype,
                "kind": root_w.kind, "sharding": root_w.sharding,
                # (the most common of the units' settings; each unit keeps its own: accelerate keeps its
                # tail units -- final norm, LM head -- unsharded after forward, its blocks not)
                "reduce_dtype": root_w.reduce_dtype, "reshard_after_forward": _most_common(
                    [w.reshard_after_forward for w in self.wrapped if w.module is not self.root], True),
                "offload": any(w.offload for w in self.wrapped), "mesh_shape": list(root_w.mesh_shape),
                "orig_dtype": self.orig_dtype or "float32", "optimizer": opt, "notes": sorted(set(self.notes))}


def _most_common(values: list, default):
    return max(values, key=values.count) if values else default


# FSDP1's ShardingStrategy by name -> the per-rank model's --sharding (NO_SHARD is DDP: refused with
# that advice; the hybrid ones shard within a group and replicate across groups, _init_utils.py).
_FSDP1_SHARDING = {"FULL_SHARD": "full-shard", "SHARD_GRAD_OP": "shard-grad-op", "HYBRID_SHARD": "hybrid-shard",
                   "_HYBRID_SHARD_ZERO2": "hybrid-shard-grad-op"}


def _fsdp1_public_state(fsdp, process_group, sharding_strategy, cpu_offload, backward_prefetch, mixed_precision,
                        device_id, forward_prefetch, limit_all_gathers) -> None:
    """The attributes FSDP1's constructor sets that scripts read (torch/distributed/fsdp/_init_utils.py:
    DINOv2 tests ``x.sharding_strategy`` before resharding its teacher), with its defaults; the
    process group's rank and size where the wrapper shards over that one group (not the hybrid
    strategies, whose shard group torch makes per node)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

    fsdp.sharding_strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
    fsdp.mixed_precision = mixed_precision or MixedPrecision()
    fsdp.cpu_offload = cpu_offload or CPUOffload()
    fsdp.backward_prefetch = BackwardPrefetch[backward_prefetch] if isinstance(backward_prefetch, str) else backward_prefetch
    fsdp.forward_prefetch, fsdp.limit_all_gathers = forward_prefetch, limit_all_gathers
    index = device_id.index if isinstance(device_id, torch.device) else device_id
    fsdp.compute_device = torch.device("cuda", index if index is not None else torch.cuda.current_device())
    if fsdp.sharding_strategy not in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        fsdp.process_group, fsdp.rank, fsdp.world_size = group, group.rank(), group.size()


def _fsdp1_class(rec: "FsdpRecord"):
    """A FullyShardedDataParallel stand-in (a subclass, so isinstance checks of scripts and of
    accelerate hold): the wrapping the script asked for is done by torch's own auto-wrap code
    (_wrap_utils._auto_wrap with this class as the wrapper, so every policy -- ModuleWrapPolicy,
    transformer_auto_wrap_policy, size_based_auto_wrap_policy, lambda and custom policies -- picks
    the units the real FSDP would), each instance records its unit, and the computation is what
    FSDP1 does to it: parameters in MixedPrecision.param_dtype (the flat unsharded parameter the
    unit computes with), buffers in buffer_dtype, the root's floating-point inputs cast to the
    param dtype (cast_root_forward_inputs), a child's only with cast_forward_inputs. Nothing is
    flattened or sharded here: the per-rank model (sharding.py, --parallelism fsdp) places flat
    shards, all-gathers and reduce-scatters from the units recorded."""
    import contextlib

    from torch.distributed.fsdp import FullyShardedDataParallel as Real
    from torch.distributed.fsdp._common_utils import TrainingState

    class FullyShardedDataParallel(Real):
        def __init__(self, module, process_group=None, sharding_strategy=None, cpu_offload=None,
                     auto_wrap_policy=None, backward_prefetch="BACKWARD_PRE", mixed_precision=None,
                     ignored_modules=None, param_init_fn=None, device_id=None, sync_module_states=False,
                     forward_prefetch=False, limit_all_gathers=True, use_orig_params=False, ignored_states=None,
                     device_mesh=None):
            nn.Module.__init__(self)
            self._use_orig_params = use_orig_params
            self.training_state = TrainingState.IDLE
            _fsdp1_public_state(self, process_group, sharding_strategy, cpu_offload, backward_prefetch,
                                mixed_precision, device_id, forward_prefetch, limit_all_gathers)
            rec.materialize(module, param_init_fn, device_id)
            ignored = set(ignored_modules or ())
            if auto_wrap_policy is not None:
                from torch.distributed.fsdp._wrap_utils import _auto_wrap

                kwargs = dict(process_group=process_group, sharding_strategy=sharding_strategy,
                              cpu_offload=cpu_offload, backward_prefetch=backward_prefetch,
                              mixed_precision=mixed_precision, param_init_fn=param_init_fn, device_id=device_id,
                              sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                              limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params,
                              device_mesh=device_mesh)
                ignored_params = {p for m in ignored for p in m.parameters()}
                kwargs["ignored_states"] = ignored_params
                _auto_wrap(module, auto_wrap_policy, ignored, ignored_params, kwargs, type(self))
            self._fsdp_wrapped_module = module
            rec.fsdp1(self, module, sharding_strategy, cpu_offload, mixed_precision, backward_prefetch,
                      forward_prefetch, limit_all_gathers, process_group, device_mesh)

        def forward(self, *args, **kwargs):
            return self._fsdp_wrapped_module(*args, **kwargs)

        @contextlib.contextmanager
        def no_sync(self):
            yield

        @torch.no_grad()
        def clip_grad_norm_(self, max_norm, norm_type=2.0):
            # over the unsharded gradients here; FSDP1 computes the local shards' norms and all-reduces
            return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)

        @staticmethod
        @contextlib.contextmanager
        def state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None):
            yield

        @staticmethod
        def set_state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None):
            return None

        @staticmethod
        def get_state_dict_type(module):
            from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, StateDictSettings,
                                                StateDictType)

            return StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())

        # Checkpoints of the optimizer (accelerate's save_fsdp_optimizer, the Trainer's at an
        # epoch's end): nothing is flattened or sharded here, so the optimizer's own state dict is
        # the one a full state dict would gather, and the one to load is what the script saved.
        @staticmethod
        def optim_state_dict(model, optim, optim_state_dict=None, group=None):
            return optim.state_dict() if optim_state_dict is None else optim_state_dict

        @staticmethod
        def optim_state_dict_to_load(model, optim, optim_state_dict, is_named_optimizer=False, load_directly=False,
                                     group=None):
            if load_directly:
                optim.load_state_dict(optim_state_dict)
            return optim_state_dict

        @staticmethod
        def full_optim_state_dict(model, optim, optim_input=None, rank0_only=True, group=None):
            return optim.state_dict()

        @staticmethod
        def sharded_optim_state_dict(model, optim, group=None):
            return optim.state_dict()

        @staticmethod
        def shard_full_optim_state_dict(full_optim_state_dict, model, optim_input=None, optim=None):
            return full_optim_state_dict

        @staticmethod
        def flatten_sharded_optim_state_dict(sharded_optim_state_dict, model, optim):
            return sharded_optim_state_dict

        @staticmethod
        def scatter_full_optim_state_dict(full_optim_state_dict, model, optim_input=None, optim=None, group=None):
            return full_optim_state_dict

        @staticmethod
        @contextlib.contextmanager
        def summon_full_params(module, recurse=True, writeback=True, rank0_only=False, offload_to_cpu=False,
                               with_grads=False):
            yield

    FullyShardedDataParallel.__module__ = Real.__module__
    FullyShardedDataParallel.__qualname__ = Real.__qualname__
    return FullyShardedDataParallel


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
    import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp1_mod

    fsdp1 = _fsdp1_class(rec)
    out += [(fsdp, "FullyShardedDataParallel", fsdp1), (fsdp1_mod, "FullyShardedDataParallel", fsdp1)]
    try:
        import torch.distributed._composable.fsdp as comp
        out.append((comp, "fully_shard", rec.fully_shard))
    except ImportError:
        pass
    import torch.distributed as dist
    if hasattr(dist, "init_device_mesh"):
        out.append((dist, "init_device_mesh", init_device_mesh))
    coalesced_collectives()
    return out + _sync_batch_norm()


_COALESCED = None   # the c10d library's Meta kernels below, registered once per process


def coalesced_collectives() -> None:
    """Meta kernels for c10d's coalesced collectives, which torch gives none (its allreduce_,
    allgather_ and reduce_scatter_ have theirs): ``dist._coalescing_manager`` (Megatron-LM's DDP
    gradient buffers and distributed optimizer, DeepSpeed ZeRO's bucketed reductions) batches the
    calls in it into allreduce_coalesced_ / allgather_into_tensor_coalesced_ /
    reduce_scatter_tensor_coalesced_, which the fake mode refused. Each writes its outputs in place
    (no device memory of the caching allocator's; NCCL's buffers are modelled per communicator) and
    returns a finished work, as the fake process group's own collectives do."""
    global _COALESCED
    if _COALESCED is not None:
        return
    import torch
    from torch._C._distributed_c10d import FakeWork

    def work(*_args, **_kwargs):
        return FakeWork().boxed()

    def gather_into_tensor(output, *_args, **_kwargs):
        return output, FakeWork().boxed()

    lib = torch.library.Library("c10d", "IMPL")
    for name, kernel in (("allreduce_coalesced_", work), ("allgather_coalesced_", work),
                         ("allgather_into_tensor_coalesced_", work), ("reduce_scatter_tensor_coalesced_", work),
                         ("gather_into_tensor_", gather_into_tensor)):
        op = getattr(torch.ops.c10d, name, None)
        if op is not None and not torch._C._dispatch_has_kernel_for_dispatch_key(op.default.name(), "Meta"):
            lib.impl(name, kernel, "Meta")
    _COALESCED = lib


def _sync_batch_norm() -> list[tuple]:
    """nn.SyncBatchNorm's forward drops the ranks whose batch was empty with a boolean mask over the
    gathered counts (``count_all[count_all >= 1]``), a shape that follows values a fake tensor has not.
    Every rank of the fake group runs this rank's batch, so no count is zero (an empty batch is
    refused as a zero-size model input), and the mask keeps them all: the forward runs as torch
    runs it under CUDA-graph capture, where it skips the mask (torch/nn/modules/_functions.py)."""
    import torch
    from torch.nn.modules import _functions

    cls = getattr(_functions, "SyncBatchNorm", None)
    real = getattr(cls, "forward", None)
    if real is None:
        return []

    def forward(*args, **kwargs):
        capturing = torch.cuda.is_current_stream_capturing
        torch.cuda.is_current_stream_capturing = lambda: True
        try:
            return real(*args, **kwargs)
        finally:
            torch.cuda.is_current_stream_capturing = capturing

    return [(cls, "forward", staticmethod(forward))]


def result(state) -> dict | None:
    rec = getattr(state, "fsdp", None)
    return rec.result() if rec is not None else None


# ---- parent side ---------------------------------------------------------------------------------

def describe_optimizer(o) -> dict:
    """What the workload needs of a script's optimizer (read at its first step: the object is gone
    once the script stops): its class and the defaults that decide its state and kernels."""
    d = o.defaults
    groups = list(getattr(o, "param_groups", ()) or ())

    def over_groups(k, pick):
        # per group where the groups set it (timm's and the Trainer's: decay on the matrices only,
        # the defaults' 0): the one that keeps the most state or makes the most temporaries
        vals = [g.get(k, d.get(k)) for g in groups] or [d.get(k)]
        vals = [v for v in vals if v is not None]
        return pick(vals) if vals else d.get(k)

    return {"class": type(o).__name__, "module": type(o).__module__,
            **{k: d.get(k) for k in ("foreach", "fused")},
            **{k: over_groups(k, max) for k in ("weight_decay", "momentum")},
            **{k: over_groups(k, any) for k in ("amsgrad", "centered")}}


def _optimizer_name(opt: dict | None) -> tuple[str, str, float | None]:
    """(--optimizer, --optimizer-impl, weight_decay) of the script's optimizer."""
    from ..errors import EstimateError

    if opt is None:
        raise EstimateError("the FSDP2 script made no optimizer before its first step", "this is a bug in vest-slurm; report it")
    cls = opt["class"]
    name = optimizer_name(opt)
    if name is None:
        raise EstimateError(f"the script's optimizer {opt['module']}.{cls} is not one the per-rank model traces on shards",
                            "describe the workload with #VEST --model ... --optimizer ...")
    impl = "fused" if opt.get("fused") else ("for-loop" if opt.get("foreach") is False else "foreach")
    return name, impl, opt.get("weight_decay")


def per_rank(info: dict, events: tuple[AllocEvent, ...], step_ends: tuple[int, ...], base_spec, profile):
    """(the per-rank AllocTrace, the WorkloadSpec it stands for) of an FSDP2 script's run."""
    from ..errors import EstimateError
    from ..estimate.sharded_trace import optimizer_trace
    from ..estimate.sharding import Unit, UnitTrace, kept_for_process, rank_trace, shard_layout

    if "error" in info:
        raise EstimateError(f"FSDP script: {info['error']}", "this is a bug in vest-slurm; report it with the script")
    if "refused" in info:
        what, fix = info["refused"]
        raise EstimateError(f"FSDP script: {what} (not modelled by the dynamic estimate)", fix, kind="vest-unsupported")
    kind = info.get("kind", "fsdp2")
    if info["offload"] and kind == "fsdp2":
        raise EstimateError("CPUOffloadPolicy in an FSDP2 script is not modelled by the dynamic estimate",
                            "describe the workload with #VEST --model ... --parallelism fsdp2 --offload params")
    shape = info["mesh_shape"]
    world = 1
    for s in shape:
        world *= s
    group = 0
    if kind == "fsdp":   # FSDP1: flat parameters per unit; hybrid strategies shard within the mesh's last dim
        parallelism, sharding = "fsdp", info.get("sharding", "full-shard")
        if sharding.startswith("hybrid"):
            group = shape[-1]
    else:
        parallelism, sharding = ("hsdp" if len(shape) == 2 and shape[0] > 1 else "fsdp2"), "full-shard"
        group = shape[-1] if parallelism == "hsdp" else 0
    name, impl, wd = _optimizer_name(info["optimizer"])
    tp = int(info.get("tp") or 1)   # FSDP over the data-parallel dimension of a 2-D mesh beside tensor parallelism
    spec = base_spec.with_(parallelism=parallelism, num_gpus=world * tp, tensor_parallel=tp,
                           shard_group_size=group, sharding=sharding,
                           offload="params" if info["offload"] else "none",
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
    if spec.grad_accum > 1:   # the first micro-batch: its forward and backward (rank_trace adds the others')
        back = next((i for i in range(first, stop) if events[i].phase == "backward"), stop)
        stop = next((i for i in range(back, stop) if events[i].phase != "backward"), stop)
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
        if e.action == "alloc" and e.block not in freed_in and e.block not in seen and e.block not in grads \
                and not kept_for_process(e):
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
                              rel(u["bwd_post"], len(iteration)), tuple(u["grad_blocks"]),
                              reshard_after_forward=u.get("reshard_after_forward")))
    if not any(u.is_root for u in units):
        units.insert(0, Unit("<root>", (), 0, first_bwd, first_bwd, first_bwd, (), True))
    ut = UnitTrace(setup, iteration, tuple(tail), tuple(units), info["orig_dtype"], info["orig_dtype"],
                   tuple(info.get("notes", ())))
    layout = shard_layout(ut.units, spec)
    opt = optimizer_trace(spec.with_(num_gpus=1, parallelism="none"), layout.optimizer_tensors,
                          layout.optimizer_dtype, False)
    return rank_trace(ut, opt, spec), spec
