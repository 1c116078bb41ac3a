"""Tensor parallelism (``parallelize_module`` with torch's ParallelStyles) in an unmodified torchrun
script, estimated as one rank of the tensor-parallel group. Dynamic analysis only.

Why not run torch's own code: its DTensors need a device mesh over a real process group, and
``distribute_tensor`` reads values (the mesh's coordinates, the scatter) that fake CUDA does not
have. What one rank holds and computes is simple enough to make directly, and it is what the
caching allocator sees on that rank:

- **Weights**: the rank's shard, as ``distribute_tensor`` cuts it (torch.chunk's split: the first
  rank holds ceil(n / tp) rows or columns, the largest). ColwiseParallel: Linear weight and bias
  Shard(0), Embedding weight Shard(1); RowwiseParallel: Linear weight Shard(1), bias replicated,
  Embedding weight Shard(0). The shards are plain tensors of that shape, so gradients and optimizer
  states come out at the shard's size, as DTensor's local tensors are.
- **Activations**: each module computes on its local tensors, as DTensor's sharding propagation
  does for these styles (a column-parallel Linear gives out_features / tp features; a row-parallel
  one a full-size partial sum).
- **Redistributions**: what DTensor's ``redistribute`` does between the layouts the plan names, with
  functional collectives that write into a new tensor: Partial -> Replicate is an all-reduce (a new
  tensor of the same size), Partial -> Shard(d) a reduce-scatter (1/tp along d), Shard(d) ->
  Replicate an all-gather (tp times along d), Replicate -> Shard(d) a local chunk (made contiguous).
  Backward runs the reverse, as ``Redistribute.backward`` does (a Partial source is taken back to
  Replicate).
- ``loss_parallel()``: the cross-entropy over vocabulary-sharded logits is computed on the local
  shard (its all-reduces carry one value per token): the context changes no memory here.

With FSDP2 over the other dimension of a 2-D mesh (``fully_shard(model, mesh=mesh["dp"])`` after
parallelize_module over ``mesh["tp"]``), fake_dist.per_rank shards these tensor-parallel shards over
the data-parallel ranks (WorkloadSpec.tensor_parallel: the job's GPUs are dp x tp, a communicator
per dimension).

use_local_output=False (the script keeps a DTensor): its computation is the local tensor's, and
``view``/``reshape`` to global sizes (an attention splitting features into the model's whole head
count) view the shard with the sharded dimension divided, as DTensor's view propagation does; one
that does not map onto a dimension is refused. Other uses of global shapes (``.shape`` of such an
output) see the local shape.

Refused by name (vest's gap): a ParallelStyle of the script's own, DTensors the script makes itself
(distribute_tensor, DTensor.from_local), and parallelize_module after fully_shard.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
from torch import nn

# a placement: ("R",) Replicate, ("S", dim) Shard(dim), ("P",) Partial (sum)
_R, _P = ("R",), ("P",)


def _placement(p) -> tuple:
    """torch's Placement object as one of ours."""
    name = type(p).__name__
    if name == "Replicate":
        return _R
    if name in ("Partial", "_Partial", "MaskPartial", "_MaskPartial"):
        return _P
    if name in ("Shard", "_StridedShard"):
        return ("S", p.dim)
    from .cuda_surface import NotSupportedHere

    raise NotSupportedHere(f"the DTensor placement {name}", "tensor parallelism is modelled for Replicate, Shard and "
                           "Partial placements")


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _norm(p: tuple, ndim: int) -> tuple:
    return ("S", _dim(p[1], ndim)) if p[0] == "S" else p


def _resized(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = size
    return x.new_empty(shape).contiguous()


def _convert(x: torch.Tensor, src: tuple, dst: tuple, tp: int) -> torch.Tensor:
    """What redistribute(src -> dst) leaves on this rank: a new tensor of the new local shape."""
    if src == _P and dst == _R:       # all-reduce (functional: into a new tensor)
        return torch.empty_like(x)
    if src == _P and dst[0] == "S":   # reduce-scatter
        d = _dim(dst[1], x.ndim)
        return _resized(x, d, -(-x.shape[d] // tp))
    if src[0] == "S" and dst == _R:   # all-gather
        d = _dim(src[1], x.ndim)
        return _resized(x, d, x.shape[d] * tp)
    if src == _R and dst[0] == "S":   # a local chunk, made contiguous
        d = _dim(dst[1], x.ndim)
        return _resized(x, d, -(-x.shape[d] // tp))
    if src[0] == "S" and dst[0] == "S":   # all-to-all
        a, b = _dim(src[1], x.ndim), _dim(dst[1], x.ndim)
        shape = list(x.shape)
        shape[a], shape[b] = shape[a] * tp, -(-shape[b] // tp)
        return x.new_empty(shape)
    if src == _R and dst == _P:       # a replicated value taken as a partial sum: no communication
        return x
    from .cuda_surface import NotSupportedHere

    raise NotSupportedHere(f"redistributing a DTensor from {src} to {dst}", "not modelled for tensor parallelism")


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dst, tp):
        ctx.src, ctx.dst, ctx.tp = src, dst, tp
        out = _convert(x, src, dst, tp)
        return out if out is not x else x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        back = _R if ctx.src == _P else ctx.src
        dst = _R if ctx.dst == _P else ctx.dst   # a Partial gradient arrives as one to reduce
        if dst == back:
            return g, None, None, None
        return _convert(g, dst, back, ctx.tp), None, None, None


class _Gathered(torch.autograd.Function):
    """An all-gather of uneven last-dimension shards (DTensor pads and unpads them): the whole width."""

    @staticmethod
    def forward(ctx, x, full):
        ctx.local = x.shape[-1]
        return _resized(x, x.ndim - 1, full)

    @staticmethod
    def backward(ctx, g):
        return _resized(g, g.ndim - 1, ctx.local), None


def redistribute(x, src: tuple, dst: tuple, tp: int):
    """x (a local tensor) from layout src to dst; anything else as it is."""
    if not isinstance(x, torch.Tensor) or tp == 1:
        return x
    src, dst = (_norm(src, x.ndim), _norm(dst, x.ndim))
    if src == dst:
        return x
    if x.requires_grad or x.is_floating_point():
        return _Redistribute.apply(x, src, dst, tp)
    return _convert(x, src, dst, tp)


def _each(values: tuple, src: tuple, dst: tuple, tp: int) -> tuple:
    """Each of ``values`` redistributed from its layout in ``src`` to ``dst`` (None: left as it is)."""
    pad = (None,) * len(values)
    return tuple(redistribute(v, s, d, tp) if s is not None and d is not None else v
                 for v, s, d in zip(values, src + pad, dst + pad))


def _layouts(value, n: int | None = None) -> tuple:
    """A style's layouts (one Placement, a tuple of them, None entries) as ours."""
    if value is None:
        return (None,) * (n or 1)
    if not isinstance(value, (list, tuple)):
        value = (value,)
    out = []
    for p in value:
        if p is None:
            out.append(None)
        elif isinstance(p, (list, tuple)):   # one placement per mesh dimension: a 1-D mesh has one
            out.append(_placement(p[0]))
        else:
            out.append(_placement(p))
    return tuple(out)


class TensorParallel:
    """What parallelize_module was asked, and the stand-in that shards one rank's modules."""

    def __init__(self, state):
        self.state = state
        self.tp = 0
        self.styles: dict[str, int] = {}

    # -- parallelize_module ---------------------------------------------------------------------------

    def parallelize_module(self, module, device_mesh=None, parallelize_plan=None, *, src_data_rank=0):
        from fnmatch import fnmatch

        from torch.distributed.tensor.parallel.style import ParallelStyle

        if parallelize_plan is None:
            return module
        fsdp = getattr(self.state, "fsdp", None)
        if fsdp is not None and fsdp.wrapped:
            from .cuda_surface import NotSupportedHere

            raise NotSupportedHere("parallelize_module of a model under fully_shard (FSDP + TP over a 2-D mesh)",
                                   "tensor parallelism is modelled alone, and FSDP alone; not the two together")
        tp = self._mesh_size(device_mesh)
        if isinstance(parallelize_plan, ParallelStyle):
            self._apply(parallelize_plan, module, tp)
            return module
        if not isinstance(parallelize_plan, dict):
            raise TypeError("Expect Union[ParallelStyle, Dict[str, ParallelStyle]] for parallelize_plan, "
                            f"{type(parallelize_plan)} found!")
        for path, style in parallelize_plan.items():
            if path == "":
                self.parallelize_module(module, device_mesh, style)
                continue
            token, _, rest = path.partition(".")
            for _, child in [t for t in module.named_children() if fnmatch(t[0], token)]:
                self.parallelize_module(child, device_mesh, {rest: style} if rest else style)
        return module

    def _mesh_size(self, mesh) -> int:
        if mesh is None:
            size = self.state.world_size
        else:
            shape = tuple(getattr(mesh, "shape", ()) or ())
            if len(shape) != 1:
                raise ValueError(f"parallelize_module only accepts a 1-D DeviceMesh, got {len(shape)}-D: slice it "
                                 "first (device_mesh[\"tp\"])")
            size = shape[0]
        if self.tp and size != self.tp:
            from .cuda_surface import NotSupportedHere

            raise NotSupportedHere("parallelize_module over meshes of different sizes",
                                   f"one tensor-parallel group is modelled ({self.tp} and {size} ranks asked)")
        self.tp = size
        return size

    def _apply(self, style, module: nn.Module, tp: int) -> None:
        from torch.distributed.tensor.parallel import style as styles

        from .cuda_surface import NotSupportedHere

        kind = type(style)
        name = kind.__name__
        self.styles[name] = self.styles.get(name, 0) + 1
        if kind in (styles.ColwiseParallel, styles.RowwiseParallel):
            colwise = kind is styles.ColwiseParallel
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                raise NotImplementedError(f"{name} currently only support nn.Linear and nn.Embedding!")
            self._shard(module, colwise, tp)
            embedding = isinstance(module, nn.Embedding)
            inp = _layouts(style.input_layouts)[0]
            desired = _R if colwise or embedding else ("S", -1)
            computed = ("S", -1) if colwise else _P
            out = _layouts(style.output_layouts)[0]
            # a column-parallel Linear's input gradient is a partial sum: from_local's backward reduces it
            # to the input's layout (an all-reduce into a new tensor where it was replicated)
            module.register_forward_pre_hook(functools.partial(_inputs, (inp,), (desired,), {}, {}, tp,
                                                               colwise and not embedding), with_kwargs=True)
            # a column-parallel output gathered whole is the module's own width, uneven shards or not
            full = (module.embedding_dim if embedding else module.out_features) if colwise else None
            module.register_forward_hook(functools.partial(_outputs, (computed,), (out,), tp, full))
            if not style.use_local_output:   # a DTensor to the script: its views take global sizes
                module.register_forward_hook(functools.partial(_keeps_dtensor, out, tp))
            if not colwise and not embedding and inp[0] == "S" and module.in_features % tp:
                module.register_forward_pre_hook(functools.partial(_uneven_rows, module.in_features, tp))
            if embedding and not colwise:
                module.forward = types.MethodType(_masked_embedding, module)
        elif kind is styles.SequenceParallel:
            # parameters replicated (norms, dropout); the input is taken as already sharded on the sequence
            # dimension, and the output stays so: the module computes on its local tokens
            self._to_device(module)
        elif kind in (styles.PrepareModuleInput, styles.PrepareModuleInputOutput):
            pin = style if kind is styles.PrepareModuleInput else style.prepare_module_input
            self._prepare_input(pin, module, tp)
            if kind is styles.PrepareModuleInputOutput:
                self._prepare_output(style.prepare_module_output, module, tp)
        elif kind is styles.PrepareModuleOutput:
            self._prepare_output(style, module, tp)
        else:
            raise NotSupportedHere(f"the ParallelStyle {kind.__module__}.{name}",
                                   "only torch's own styles (ColwiseParallel, RowwiseParallel, SequenceParallel, "
                                   "PrepareModuleInput/Output) are modelled")

    def _prepare_input(self, style, module, tp) -> None:
        src = _layouts(style.input_layouts)
        dst = _layouts(style.desired_input_layouts, len(src))
        ksrc = {k: _layouts(v)[0] for k, v in (style.input_kwarg_layouts or {}).items()}
        kdst = {k: _layouts(v)[0] for k, v in (style.desired_input_kwarg_layouts or {}).items()}
        module.register_forward_pre_hook(functools.partial(_inputs, src, dst, ksrc, kdst, tp, False), with_kwargs=True)

    def _prepare_output(self, style, module, tp) -> None:
        src = _layouts(style.output_layouts)
        dst = _layouts(style.desired_output_layouts, len(src))
        module.register_forward_hook(functools.partial(_outputs, src, dst, tp, None))

    def _to_device(self, module: nn.Module) -> None:
        if any(p.device.type != "cuda" for p in module.parameters()):
            module.to(torch.device("cuda", 0))

    def _shard(self, module: nn.Module, colwise: bool, tp: int) -> None:
        """The module's parameters replaced by this rank's shards (distribute_tensor: the first rank's
        chunk, ceil(n / tp), the largest); the full ones are freed as the real ones are once replaced."""
        embedding = isinstance(module, nn.Embedding)
        for pname, p in list(module.named_parameters(recurse=False)):
            if pname == "bias" and not colwise:
                dim = None                        # RowwiseParallel: the bias is replicated
            elif embedding:
                dim = 1 if colwise else 0
            else:
                dim = 0 if colwise else (1 if p.ndim > 1 else None)
            shape = list(p.shape)
            if dim is not None:
                shape[dim] = -(-shape[dim] // tp)
            local = torch.empty(shape, dtype=p.dtype, device=torch.device("cuda", 0))
            module.register_parameter(pname, nn.Parameter(local, requires_grad=p.requires_grad))
        if embedding and not colwise:
            module._vest_rows = module.weight.shape[0]
        self._to_device(module)

    def result(self) -> dict | None:
        if not self.tp:
            return None
        styles = ", ".join(f"{n} x{c}" for n, c in sorted(self.styles.items()))
        return {"tp": self.tp, "styles": self.styles,
                "note": f"tensor parallelism (parallelize_module) over {self.tp} ranks ({styles}): one rank's "
                        "shards, activations and the new tensors of its redistributions are traced; the "
                        "collectives' NCCL buffers are the communicator's"}


def _masked_embedding(self, ids):
    """A row-sharded Embedding's lookup on one rank, as DTensor's MaskPartial does it: the ids outside
    this rank's rows are masked, looked up at row 0 and zeroed; the partial sums are then all-reduced."""
    rows = self._vest_rows
    mask = ids >= rows
    local = ids.clamp(max=rows - 1)
    out = nn.functional.embedding(local, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                                  self.scale_grad_by_freq, self.sparse)
    return out.masked_fill(mask.unsqueeze(-1), 0)


class _PartialGrad(torch.autograd.Function):
    """A replicated input whose gradient comes back as a partial sum, all-reduced into a new tensor."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch.empty_like(g)


def _inputs(src, dst, ksrc, kdst, tp, partial_grad, _module, args, kwargs):
    if partial_grad and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad and tp > 1 \
            and src[0] == _R:
        args = (_PartialGrad.apply(args[0]),) + tuple(args[1:])
    args = _each(tuple(args), src, dst, tp)
    kwargs = {k: redistribute(v, ksrc[k], kdst[k], tp) if k in ksrc and k in kdst and ksrc[k] and kdst[k] else v
              for k, v in kwargs.items()}
    return args, kwargs


def _uneven_rows(features, tp, module, _args):
    """What a GPU run does with a row-parallel Linear whose input features do not divide over the ranks:
    DTensor.from_local takes each rank's input as an even shard, and sharding propagation fails."""
    from .cuda_surface import FailsOnAGpu

    local = -(-features // tp)
    raise FailsOnAGpu(f"RowwiseParallel {type(module).__name__}({features} input features) over {tp} ranks: "
                       f"DTensor.from_local takes the rank's {local} input features as an even shard ({local * tp} "
                       f"in all, not {features}), and sharding propagation fails (a and b must have same "
                       "reduction dim); make the features a multiple of the tensor-parallel size")


def _keeps_dtensor(placement, tp, _module, _args, output):
    """use_local_output=False: the script holds the output as a DTensor. Its computation on one rank is
    the local tensor's, except for views and reshapes to global sizes (_global_view)."""
    if isinstance(output, torch.Tensor) and placement is not None and placement[0] == "S":
        for method in ("view", "reshape"):
            setattr(output, method, _global_view(output, placement[1], tp, method))
    return output


def _global_view(t, shard: int, tp: int, method: str):
    """``t.view(*sizes)`` / ``t.reshape(*sizes)`` of a column-parallel output the script keeps as a
    DTensor (use_local_output=False): the sizes are the global tensor's, as DTensor's view takes them
    (an attention splitting its features into the model's whole head count); the local shard is
    viewed with the dimension that holds the shard divided over the ranks, as DTensor's sharding
    propagation of view does. The result is a local tensor; its later ops see local shapes."""
    real = getattr(type(t), method)

    def view(*sizes):
        # the first view to global sizes takes the stand-ins off: they hold the tensor (a cycle through
        # its __dict__ that would keep it alive past its last use, until the garbage collector ran)
        for m in ("view", "reshape"):
            t.__dict__.pop(m, None)
        if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
            sizes = tuple(sizes[0])
        if len(sizes) == 1 and isinstance(sizes[0], torch.dtype):
            return real(t, *sizes)
        return real(t, *_local_sizes(tuple(t.shape), shard, tp, tuple(int(s) for s in sizes)))

    return view


def _local_sizes(local: tuple, shard: int, tp: int, sizes: tuple) -> tuple:
    from .cuda_surface import NotSupportedHere

    shard = shard + len(local) if shard < 0 else shard
    glob = list(local)
    glob[shard] *= tp
    numel = 1
    for g in glob:
        numel *= g
    if sizes.count(-1) == 1:
        known = 1
        for s in sizes:
            known *= s if s != -1 else 1
        if known == 0 or numel % known:
            return sizes   # a shape the tensor cannot take: torch's own view says so, as on a GPU
        sizes = tuple(numel // known if s == -1 else s for s in sizes)
    total = 1
    for s in sizes:
        total *= s
    if total != numel:
        return sizes
    before = 1
    for g in glob[:shard]:
        before *= g
    acc, out = 1, list(sizes)
    for i, s in enumerate(sizes):
        if acc == before and s % tp == 0 and s > 1:   # the first dimension of the shard's extent
            out[i] = s // tp
            return tuple(out)
        acc *= s
        if acc > before:
            break
    raise NotSupportedHere(f"a view of a DTensor to {sizes}", f"the sharded dimension (size {glob[shard]} over {tp} "
                           "ranks) does not map onto one dimension of that shape")


def _outputs(src, dst, tp, full, _module, _args, output):
    if isinstance(output, torch.Tensor):
        s, d = src[0], dst[0]
        if full is not None and s == ("S", -1) and d == _R and output.shape[-1] * tp != full:
            return _Gathered.apply(output, full)   # uneven shards, gathered to the module's width
        return redistribute(output, s, d, tp) if s is not None and d is not None else output
    if isinstance(output, tuple):
        return _each(output, src, dst, tp)
    return output


@contextlib.contextmanager
def loss_parallel():
    """torch.distributed.tensor.parallel.loss_parallel: the cross-entropy of vocabulary-sharded logits.
    On one rank it computes on the local shard (the all-reduces carry per-token values), which the
    local logits here do already."""
    yield


def dtensor_makers() -> list[tuple[object, str, str]]:
    """(owner, attribute, API name) of the calls by which a script makes DTensors itself (the live
    oracle refuses them too). Their other bindings (the _api module's) are patched by
    standins._aliases, as every stand-in's are."""
    import torch.distributed.tensor as dtensor

    return [(dtensor, "distribute_tensor", "torch.distributed.tensor.distribute_tensor"),
            (dtensor, "distribute_module", "torch.distributed.tensor.distribute_module"),
            (dtensor.DTensor, "from_local", "DTensor.from_local")]


def patches(state) -> list[tuple]:
    """The stand-ins, each at its public binding (standins._aliases patches the modules that
    re-export it: parallel.api's parallelize_module, parallel.loss's loss_parallel)."""
    import torch.distributed.tensor.parallel as tpmod

    rec = TensorParallel(state)
    state.tp = rec
    out = [(tpmod, "parallelize_module", rec.parallelize_module), (tpmod, "loss_parallel", loss_parallel)]
    # DTensors made by the script itself need the real mesh and values: refused at once, by name
    for owner, attr, api in dtensor_makers():
        refuse = _refuse(api)
        out.append((owner, attr, staticmethod(refuse) if isinstance(owner, type) else refuse))
    return out


def _refuse(api: str):
    def refuse(*_a, **_k):
        from .cuda_surface import NotSupportedHere

        raise NotSupportedHere(api, "DTensors do not run on fake CUDA; tensor parallelism through parallelize_module "
                               "with torch's ParallelStyles is modelled")

    return refuse


def result(state) -> dict | None:
    rec = getattr(state, "tp", None)
    return rec.result() if rec is not None else None
