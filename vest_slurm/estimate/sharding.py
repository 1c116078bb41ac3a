"""Sharded data parallel per rank: what FSDP1, FSDP2 (fully_shard), HSDP and DeepSpeed ZeRO-1/2/3
keep on one GPU, as an AllocTrace the caching-allocator replay runs.

Enters: a ``UnitTrace`` (sharded_trace.py: one traced forward/backward of the unsharded model, with
where each wrapping unit's forward and backward begin and end, its parameters' shapes and the
blocks of their unsharded gradients) and the optimizer's own trace on this rank's shards; the
WorkloadSpec's strategy. Leaves: the per-rank trace (``rank_trace``) and the exact per-rank shard
sizes (``shard_layout``), pure data, no torch.

Shard sizes, as each library cuts them (the largest rank decides where ranks differ; it is rank 0
for every rule here):
- fsdp2 / hsdp (torch/distributed/fsdp/_fully_shard/_fsdp_param.py init_sharded_param): each
  parameter is cut on dim 0 with torch.chunk into ceil(d0/S) rows; every rank stores the padded
  chunk (``_sharded_param_data``), rank 0 holds a full chunk, the last ones fewer rows or none.
  Optimizer states are zeros_like the unpadded local shard (rank 0: min(ceil, d0) rows). Sharded
  gradients are views of one flat reduce-scatter output per unit (foreach_reduce), padded.
- fsdp (FSDP1, _flat_param.py FlatParamHandle, use_orig_params=False): one flat parameter per unit,
  padded to a multiple of S, every rank ceil(T/S) elements; the optimizer sees the flat shards.
- zero1 / zero2 (deepspeed/runtime/zero/stage_1_and_2.py): the bit16 parameters of a group flattened
  and padded to a multiple of 2 x S (nccl_start_alignment_factor = 2), T_pad / S per rank; fp32
  master and optimizer states over that partition; parameters stay whole on every rank.
- zero3 (deepspeed/runtime/zero/partition_parameters.py _partition_param): each parameter padded to
  a multiple of S, ceil(numel / S) per rank; fp32 masters and states flattened over those.

What the per-rank trace adds around the traced activations (FSDP2's schedule, _fsdp_param_group.py):
forward: per unit, the copy-in of the shards in param dtype (all-gather copy-in stream), the
all-gather output (that stream's pool: stream 1), the unsharded parameters copied out of it (the
compute stream); the output is freed after the next unit's copy-out (implicit prefetch keeps one
more alive: "AllGatherState"); after forward the unit reshards (not the root, which FSDP2 keeps
unsharded for backward). backward: the unit and the next one in backward order are all-gathered
(explicit backward prefetch of one); after its gradients are complete: reshard, reduce-scatter
input (compute stream, reduce dtype), the unsharded gradients freed, the reduce-scatter output on
the reduce-scatter stream (stream 2), cast to the parameters' dtype where the reduce dtype
differs; one reduce-scatter input is kept in flight (reduce_scatter_max_input_buffers = 1). For a
job on torch before 2.5 ($VEST_JOB_TORCH) the reduce-scatter input is on the reduce-scatter stream
and freed there at once (RS_INPUT_ON_COMPUTE_SINCE). FSDP1's
post-backward hook casts, pads and reduce-scatters on its post-backward stream (stream 2). FSDP1
all-gathers into one flat buffer on its unshard stream and frees it with record_stream to the
compute stream: the free takes effect when the compute stream has passed it; the CPU runs ahead by
at most two all-gathers (limit_all_gathers), so the free is placed two units later. Streams have
separate pools in the replay, as in CUDACachingAllocator (a block is only reused on its stream).
ZeRO-3 keeps a unit gathered from its forward to its backward where DeepSpeed would fetch it again
within stage3_max_reuse_distance (zero3_kept_after_forward): the last blocks, or a small model whole.

Known limitations (each said in the estimate's notes where it applies): DeepSpeed is modelled from
its defaults, not traced (stage3_prefetch_bucket_size 5e7 elements; reduce_bucket_size 5e8
elements and stage3_max_reuse_distance 1e9 unless the workload gives its own, --reduce-bucket-size,
--max-reuse-distance; the reuse distance per unit, not per module, and the root, which ZeRO-3
releases after its output layer's backward, kept to the end of backward as FSDP2 keeps it: both
err high); ZeRO-3's working set of gathered
parameters under parameter offload is not sized (such a workload is flagged,
workload.ZERO3_OFFLOAD_FLAG); activations are traced once and repeated. NCCL's NVLS buffers are
added outside the allocator where the GPU type's nodes have NVSwitch (estimator.nvls_bytes). FSDP's
behaviour is the installed torch's, or that of $VEST_JOB_TORCH where the job runs another (before
2.5 only the reduce-scatter input's stream differs; for a script, use_job_torch sets it from the
job's own Python); FSDP1's record_stream frees are placed two all-gathers later
(limit_all_gathers), not where the GPU would pass them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

from ..errors import WorkloadError
from .trace import AllocEvent, AllocTrace
from .workload import WorkloadSpec

COMPUTE, ALL_GATHER, REDUCE_SCATTER = 0, 1, 2   # stream ids of the replay (separate pools)
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
SHARD_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# DeepSpeed defaults (deepspeed/runtime/zero/config.py): ZeRO-2's reduce bucket (reduce_bucket_size
# 5e8 elements, contiguous_gradients on: one ipg buffer of that size in the model dtype) and
# ZeRO-3's prefetch (stage3_prefetch_bucket_size 5e7 elements).
ZERO_REDUCE_BUCKET = 500_000_000
ZERO3_PREFETCH = 50_000_000
ZERO_ALIGN = 2   # stage_1_and_2.py nccl_start_alignment_factor: partitions padded to 2 x world size


# FSDP2's reduce-scatter input (the unit's unsharded gradients in the reduce dtype): allocated on
# the compute stream since pytorch/pytorch PR #129721 (2024-06-27, first in torch 2.5: "to avoid
# fragmenting that memory across stream memory pools"); before it, on the reduce-scatter stream,
# whose pool the compute stream cannot reuse (_fsdp_collectives.py foreach_reduce_scatter).
RS_INPUT_ON_COMPUTE_SINCE = (2, 5)
JOB_TORCH_ENV = "VEST_JOB_TORCH"   # the job's torch where it is not this one (e.g. 2.4.1): its FSDP2


_JOB_TORCH = None   # cudnn_ws.JobSetting of $VEST_JOB_TORCH, made when first used (cudnn_ws imported then)


def use_job_torch(program: str, env_path: str | None = None, cwd: str | None = None) -> str:
    """Where a job's command runs another Python than this process (a venv's), set $VEST_JOB_TORCH
    to that Python's torch for this estimate, so that FSDP's schedule is modelled as the job's torch
    runs it (RS_INPUT_ON_COMPUTE_SINCE). Nothing where the site or the user set it, or where the
    job's Python is this one or has no torch. Returns the note ("" where nothing changed)."""
    import re

    from .cudnn_ws import JobSetting, other_python, probe

    global _JOB_TORCH
    _JOB_TORCH = _JOB_TORCH or JobSetting(JOB_TORCH_ENV)
    if not _JOB_TORCH.clear():
        return ""                  # the site's or the user's
    interp = other_python(program, env_path, cwd)
    torch_v = probe(interp)[0] if interp else None
    if not torch_v or not re.match(r"\d+\.\d+", torch_v):
        return ""
    _JOB_TORCH.set(torch_v.split("+")[0])
    return f"FSDP modelled as torch {torch_v} of the job's python {interp} runs it"


def job_torch_version() -> tuple[int, int]:
    """(major, minor) of the torch the job runs: $VEST_JOB_TORCH where set, else the installed one
    (read from its package metadata: this module imports no torch)."""
    import os
    import re
    from importlib import metadata

    text = os.environ.get(JOB_TORCH_ENV) or ""
    if not text:
        try:
            text = metadata.version("torch")
        except metadata.PackageNotFoundError:
            return (99, 0)
    m = re.match(r"(\d+)\.(\d+)", text)
    if not m:
        raise WorkloadError(f"${JOB_TORCH_ENV}={text!r} is not a torch version", "set it like 2.4 or 2.4.1, or unset it")
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class Unit:
    """One wrapping unit (a transformer block, a top-level child, the root's own parameters)."""

    name: str
    shapes: tuple[tuple[int, ...], ...]   # its parameters' shapes, in order
    fwd_pre: int       # event index (in UnitTrace.iteration) where its forward begins
    fwd_post: int      # ... ends
    bwd_pre: int       # where its backward begins (its output's gradient is ready)
    bwd_post: int      # where its parameters' gradients are all complete
    grad_blocks: tuple[int, ...] = ()   # the traced unsharded gradients of its parameters
    is_root: bool = False
    recomputed: bool = False   # its forward ran again in backward (activation checkpointing)
    # FSDP2's fully_shard(reshard_after_forward=...) of this unit where the script set it per unit
    # (None: the workload's --reshard-after-forward)
    reshard_after_forward: bool | None = None

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)


@dataclass(frozen=True)
class UnitTrace:
    """One traced forward/backward of the unsharded model, with the units marked (sharded_trace.py)."""

    setup: tuple[AllocEvent, ...]       # buffers and other setup allocations (not parameters)
    iteration: tuple[AllocEvent, ...]   # batch, forward, backward (parameter gradients included)
    tail: tuple[AllocEvent, ...]        # frees of what the loop keeps into the next iteration
    units: tuple[Unit, ...]             # in forward order; the root first
    orig_dtype: str                     # the parameters' own dtype (sharded, and the states')
    compute_dtype: str                  # the dtype the forward ran in (the param dtype)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class OptimizerTrace:
    """The optimizer traced on this rank's shard tensors (sharded_trace.py): its construction, and
    each step's events (states created in the first), each with fresh block ids."""

    construct: tuple[AllocEvent, ...]
    steps: tuple[tuple[AllocEvent, ...], ...]


@dataclass(frozen=True)
class RankLayout:
    """Exact per-rank bytes on the largest rank (rank 0) of one strategy."""

    world: int                  # ranks that shard the parameters (the shard group for hsdp)
    param_bytes: int            # parameters kept on the GPU between steps (shards, or whole for zero1/2)
    grad_bytes: int             # sharded gradients kept until the step (zero1: whole)
    master_bytes: int           # fp32 masters apart from the parameters (DeepSpeed)
    optimizer_tensors: tuple[tuple[int, ...], ...]   # shapes of the tensors the optimizer steps (rank 0)
    optimizer_dtype: str        # their dtype


def data_world(spec: WorkloadSpec) -> int:
    """The data-parallel ranks: all of them, or, beside tensor parallelism (a script's FSDP over a 2-D
    mesh), the GPUs over the tensor-parallel size."""
    return max(1, spec.num_gpus // max(1, spec.tensor_parallel))


def strategy_world(spec: WorkloadSpec) -> int:
    """Ranks over which parameters are sharded (hsdp: the shard group)."""
    dp = data_world(spec)
    if spec.parallelism == "hsdp" or (spec.parallelism == "fsdp" and spec.sharding.startswith("hybrid")):
        g = spec.shard_group_size or spec.gpus_per_node or dp
        return max(1, min(g, dp))
    return dp


def dtypes(spec: WorkloadSpec) -> tuple[str, str, str]:
    """(orig, param, reduce) dtypes. orig: the weights' dtype (--precision); param: the mixed-precision
    policy's (default orig; DeepSpeed's bf16/fp16 engines train half weights with fp32 masters);
    reduce: default the param dtype (FSDP's MixedPrecision(Policy) reduce_dtype=None)."""
    orig = spec.weight_dtype
    param = SHARD_DTYPE_NAMES.get(spec.param_dtype, orig)
    reduce = SHARD_DTYPE_NAMES.get(spec.reduce_dtype, param)
    return orig, param, reduce


def chunk_rows(d0: int, world: int) -> tuple[int, int]:
    """(padded rows every rank stores, rows rank 0 holds) for torch.chunk over ``world`` ranks."""
    per = -(-d0 // world) if d0 else 0
    return per, min(per, d0)


def fsdp2_shard_numels(shape: tuple[int, ...], world: int) -> tuple[int, int]:
    """(padded storage numel, rank-0 local numel) of one parameter's FSDP2 shard."""
    if not shape:
        shape = (1,)
    rest = math.prod(shape[1:])
    padded, local = chunk_rows(shape[0], world)
    return padded * rest, local * rest


def flat_shard_numel(total: int, world: int, align: int = 1) -> int:
    """One rank's share of a flat buffer padded to a multiple of align x world."""
    m = align * world
    return (-(-total // m) * m) // world


def shard_layout(units: Sequence[Unit], spec: WorkloadSpec) -> RankLayout:
    """The exact per-rank shard bytes of parameters, gradients, masters and what the optimizer steps."""
    orig, param, reduce = dtypes(spec)
    o, p = ITEMSIZE[orig], ITEMSIZE[param]
    w = strategy_world(spec)
    kind = spec.parallelism
    total = sum(sum(u.numels) for u in units)
    if kind in ("fsdp2", "hsdp"):
        shapes = [s or (1,) for u in units for s in u.shapes]
        pads = [fsdp2_shard_numels(s, w)[0] for s in shapes]
        local = tuple((chunk_rows(s[0], w)[1],) + tuple(s[1:]) for s in shapes)
        return RankLayout(w, sum(pads) * o, sum(pads) * o, 0, local, orig)
    if kind == "fsdp":
        shards = tuple(flat_shard_numel(sum(u.numels), w) for u in units)
        return RankLayout(w, sum(shards) * o, sum(shards) * o, 0, tuple((n,) for n in shards), orig)
    # DeepSpeed: half weights of the model dtype on the GPU, fp32 masters (unless the model is fp32)
    master = "float32"
    if kind in ("zero1", "zero2"):
        part = flat_shard_numel(total, w, ZERO_ALIGN)
        grads = total * p if kind == "zero1" else part * ITEMSIZE[reduce]
        masters = part * 4   # always a clone (single_partition_of_fp32_groups), fp32 models too
        return RankLayout(w, total * p, grads, masters, ((part,),), master)
    if kind == "zero3":
        part = sum(flat_shard_numel(n, w) for u in units for n in u.numels)
        masters = part * 4   # fp32_partitioned_groups_flat
        return RankLayout(w, part * p, part * ITEMSIZE[reduce], masters, ((part,),), master)
    raise WorkloadError(f"--parallelism {kind} is not sharded", "use one of fsdp, fsdp2, hsdp, zero1, zero2, zero3")


def kept_for_process(e: AllocEvent) -> bool:
    """A block the traced iteration allocates once for the life of the process: a thread's cuBLAS
    workspace (CublasHandlePool.cpp: workspaces keyed by handle and stream, freed only at exit; the
    tracer records the forward thread's and autograd's). Later steps reuse it, never allocate it again."""
    return e.category == "workspace" and e.module == "cublas"


def check_supported(spec: WorkloadSpec) -> None:
    """Refuse the combinations the per-rank model does not cover, with the reason."""
    if spec.parallelism in ("fsdp", "fsdp2", "hsdp") and spec.offload == "optimizer":
        raise WorkloadError("FSDP offloads parameters together with their gradients and optimizer states "
                            "(CPUOffload / CPUOffloadPolicy): there is no optimizer-only offload",
                            "use --offload params, or --parallelism zero2/zero3 for DeepSpeed's offload_optimizer")
    if spec.parallelism in ("zero1", "zero2") and spec.offload == "params":
        raise WorkloadError("DeepSpeed offloads parameters only with ZeRO-3 (offload_param)",
                            "use --parallelism zero3 --offload params, or --offload optimizer")
    if spec.zero_grad != "after-step":
        raise WorkloadError(f"--zero-grad {spec.zero_grad} is not modelled for sharded jobs (the sharded "
                            "gradients are freed at the step's zero_grad)", "drop --zero-grad")
    if spec.pre_forward != "none":
        raise WorkloadError("--pre-forward is not modelled for sharded jobs", "drop --pre-forward")


class _Ids:
    """Fresh block ids for the events the per-rank trace adds or copies."""

    def __init__(self, start: int = 1 << 44):
        self.n = start

    def new(self) -> int:
        self.n += 1
        return self.n


class _Builder:
    def __init__(self):
        self.events: list[AllocEvent] = []
        self.ids = _Ids()

    def alloc(self, size: int, stream: int, phase: str, category: str, module: str) -> int:
        b = self.ids.new()
        self.events.append(AllocEvent("alloc", b, int(size), stream, phase, category, module))
        return b

    def free(self, block: int | None) -> None:
        if block is not None:
            self.events.append(AllocEvent("free", block, 0, 0, "", ""))

    def free_all(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self.free(b)

    def copy(self, events: Iterable[AllocEvent], mapping: dict[int, int]) -> None:
        """Append events with their blocks renamed (fresh per copy; a free of a block this copy did
        not allocate keeps the name ``mapping`` gives it, from the copy before)."""
        for e in events:
            if e.action == "alloc":
                mapping[e.block] = self.ids.new()
            self.events.append(AllocEvent(e.action, mapping.get(e.block, e.block), e.size_bytes, e.stream,
                                          e.phase, e.category, e.module, e.detail))


def zero3_kept_after_forward(units: Sequence[Unit], max_reuse: int) -> frozenset[str]:
    """The units whose gathered parameters ZeRO-3 keeps from their forward to their backward.

    DeepSpeed records the order in which modules fetch their parameters over one forward and
    backward; from then on (partitioned_param_coordinator.py __params_to_release), a module's
    parameters are released after its forward only if they are not fetched again before
    ``max_reuse`` elements of parameters (stage3_max_reuse_distance, default 1e9:
    WorkloadSpec.max_reuse_distance; ds_numel: the whole, unsharded sizes) have been fetched in between. The step releases everything (stage3.py step:
    _partition_all_parameters), so a unit's backward always ends in a release. Between a unit's
    forward and its backward are: the units after it in forward, the root's own parameters (the
    output layer: lm_head and the final norm, or a tied embedding, fetched in forward and in
    backward; counted once, the untied case, so a tied model errs high), and the units before it
    in backward, twice for a unit whose forward runs again in backward (activation checkpointing:
    its recompute fetches them, then its backward). Per unit, not per module: the distance from a
    unit's last module, the shortest of its modules', so a unit at the boundary is kept whole."""
    blocks = [u for u in units if not u.is_root]
    root = sum(sum(u.numels) for u in units if u.is_root)
    fwd = sorted(blocks, key=lambda u: u.fwd_pre)
    bwd = sorted(blocks, key=lambda u: u.bwd_pre)
    kept = set()
    for i, u in enumerate(fwd):
        between = sum(sum(v.numels) for v in fwd[i + 1:]) + root
        for v in bwd:
            if v is u or between >= max_reuse:
                break
            between += sum(v.numels) * (2 if v.recomputed else 1)
        if between < max_reuse:
            kept.add(u.name)
    return frozenset(kept)


@dataclass
class _UnitState:
    unsharded: list = field(default_factory=list)   # blocks of its unsharded parameters
    gathered: int | None = None    # all-gather output (FSDP2) waiting for its copy-out
    grads: list = field(default_factory=list)       # its sharded gradient blocks (kept to the step)


# how the per-rank trace's notes begin (rank_trace): what the output says about a sharded estimate
# (report.trace_notes shows the notes that begin so)
PER_RANK_NOTES = tuple(f"{k} over " for k in ("fsdp", "fsdp2", "hsdp", "zero1", "zero2", "zero3")) + (
    "DeepSpeed modelled from", "gradient accumulation over", "ZeRO-3 keeps")


def rank_trace(ut: UnitTrace, opt: OptimizerTrace, spec: WorkloadSpec) -> AllocTrace:
    """The per-rank trace: sharded parameters, then ``spec.steps`` steps of the traced iteration with
    the strategy's all-gathers, reduce-scatters and sharded gradients, then the optimizer's step."""
    check_supported(spec)
    kind = spec.parallelism
    orig, param, reduce = dtypes(spec)
    o, p, r = ITEMSIZE[orig], ITEMSIZE[param], ITEMSIZE[reduce]
    w = strategy_world(spec)
    units = ut.units
    layout = shard_layout(units, spec)
    b = _Builder()
    offload_params = spec.offload == "params"
    offload_opt = spec.offload != "none"
    fsdp2 = kind in ("fsdp2", "hsdp")
    rs_input_on_rs_stream = fsdp2 and job_torch_version() < RS_INPUT_ON_COMPUTE_SINCE
    flat = kind == "fsdp"
    zero3 = kind == "zero3"
    gathers = fsdp2 or flat or zero3          # parameters are all-gathered per unit
    if flat:
        reshard_fwd = spec.sharding in ("full-shard", "hybrid-shard") and spec.reshard_after_forward == "on"
    else:
        reshard_fwd = spec.reshard_after_forward == "on"
    kept_fwd = zero3_kept_after_forward(units, spec.max_reuse_distance) if zero3 and reshard_fwd else frozenset()

    def reshards_fwd(u: Unit) -> bool:
        return reshard_fwd if u.reshard_after_forward is None or not fsdp2 else u.reshard_after_forward

    def unit_numels(u: Unit) -> tuple[int, int]:
        """(this rank's shard numel, the padded unsharded numel) of a unit."""
        if fsdp2:
            pads = [fsdp2_shard_numels(s, w)[0] for s in u.shapes]
            return sum(pads), sum(pads) * w
        if flat:
            s = flat_shard_numel(sum(u.numels), w)
            return s, s * w
        s = sum(flat_shard_numel(n, w) for n in u.numels)
        return s, s * w

    # -- setup: what the wrapper leaves on the GPU before the first step
    b.copy(ut.setup, {})
    if not offload_params:
        for u in units:
            if fsdp2:
                for s in u.shapes:   # one padded shard per parameter
                    b.alloc(fsdp2_shard_numels(s, w)[0] * o, COMPUTE, "setup", "parameter", u.name)
            elif flat:
                b.alloc(unit_numels(u)[0] * o, COMPUTE, "setup", "parameter", u.name)
            elif zero3:
                b.alloc(unit_numels(u)[0] * p, COMPUTE, "setup", "parameter", u.name)
            else:   # zero1/2: the whole model in its dtype on every rank
                for n in u.numels:
                    b.alloc(n * p, COMPUTE, "setup", "parameter", u.name)
    if kind.startswith("zero") and layout.master_bytes and not offload_opt:
        b.alloc(layout.master_bytes, COMPUTE, "setup", "parameter", "fp32_master")
    if not offload_opt:
        b.copy(opt.construct, {})
    zero2_bucket = None
    if kind in ("zero2", "zero3"):
        # contiguous_gradients: one ipg bucket of reduce_bucket_size elements (or the model, if smaller)
        bucket = spec.reduce_bucket_size or ZERO_REDUCE_BUCKET
        zero2_bucket = b.alloc(min(bucket, sum(sum(u.numels) for u in units)) * p, COMPUTE,
                               "setup", "other", "zero_ipg_bucket")

    grad_blocks = {g: u for u in units for g in u.grad_blocks}
    # markers: event index -> actions, in the order they run at that point
    at: dict[int, list] = {}
    for u in units:
        at.setdefault(u.fwd_pre, []).append(("fwd_pre", u))
        at.setdefault(u.fwd_post, []).append(("fwd_post", u))
        at.setdefault(u.bwd_pre, []).append(("bwd_pre", u))
        at.setdefault(u.bwd_post, []).append(("bwd_post", u))
    order = {"fwd_post": 0, "bwd_post": 1, "fwd_pre": 2, "bwd_pre": 3}
    for k in at:
        at[k].sort(key=lambda a: order[a[0]])
    bwd_order = sorted((u for u in units), key=lambda u: u.bwd_pre)
    next_in_bwd = {bwd_order[i].name: bwd_order[i + 1] for i in range(len(bwd_order) - 1)}
    sharded_grads: list[int] = []
    prev_map: dict[int, int] = {}
    steps = max(1, spec.steps)
    step_ends = []
    for step in range(steps):
        state = {u.name: _UnitState() for u in units}
        pending_ag: list[int | None] = [None]        # FSDP2 forward: the previous unit's all-gather output
        delayed: list[tuple[int, list[int]]] = []    # FSDP1 record_stream frees: (effective at gather #, blocks)
        gathers_done = [0]
        rs_inflight: list[int] = []

        def release_delayed(now: int | None = None) -> None:
            keep = []
            for due, blocks in delayed:
                if now is None or due <= now:
                    b.free_all(blocks)
                else:
                    keep.append((due, blocks))
            delayed[:] = keep

        def gather(u: Unit, phase: str) -> None:
            """All-gather u's parameters; FSDP2 leaves the output for its copy-out."""
            st = state[u.name]
            if st.unsharded or st.gathered is not None:
                return
            shard, full = unit_numels(u)
            gathers_done[0] += 1
            release_delayed(gathers_done[0])
            if offload_params:   # H2D staging of the CPU shard (orig dtype), then the cast below
                staged = b.alloc(shard * (o if not zero3 else p), ALL_GATHER, phase, "other", "offload_staging")
            else:
                staged = None
            cast = None
            if (fsdp2 or flat) and p != o:   # copy-in (FSDP2) / _mp_shard (FSDP1) in param dtype
                cast = b.alloc(shard * p, ALL_GATHER, phase, "other", "fsdp_copy_in")
            if fsdp2:
                st.gathered = b.alloc(full * p, ALL_GATHER, phase, "other", "all_gather_output")
                b.free(cast)
                b.free(staged)
            else:   # FSDP1 / ZeRO-3: the unsharded flat buffer itself, on the unshard stream
                st.unsharded = [b.alloc(full * p, ALL_GATHER, phase, "other", "unsharded_params")]
                if cast is not None:
                    delayed.append((gathers_done[0] + 1, [cast]))
                b.free(staged)

        def copy_out(u: Unit, phase: str) -> None:
            st = state[u.name]
            if not fsdp2 or st.gathered is None:
                return
            st.unsharded = [b.alloc(fsdp2_shard_numels(s, w)[0] * w * p, COMPUTE, phase, "other", "unsharded_params")
                            for s in u.shapes]
            if phase == "forward":   # kept until the next unit's copy-out (AllGatherState)
                b.free(pending_ag[0])
                pending_ag[0] = st.gathered
            else:
                b.free(st.gathered)
            st.gathered = None

        def reshard(u: Unit) -> None:
            st = state[u.name]
            if not st.unsharded:
                return
            if fsdp2:
                b.free_all(st.unsharded)
            else:   # record_stream(compute): effective once the CPU is two all-gathers ahead
                delayed.append((gathers_done[0] + 2, list(st.unsharded)))
            st.unsharded = []

        def pre(u: Unit, phase: str) -> None:
            if not gathers:
                return
            gather(u, phase)
            copy_out(u, phase)

        def reduce(u: Unit, traced_grads: list[int]) -> None:
            shard, full = unit_numels(u)
            if kind == "zero1":   # gradients stay whole (in the traced blocks) until the step
                state[u.name].grads.extend(traced_grads)
                return
            if kind in ("zero2", "zero3"):
                # reduced through the ipg bucket into this rank's partition of the gradients
                b.free_all(traced_grads)
                if not state[u.name].grads and not offload_opt:
                    state[u.name].grads.append(b.alloc(shard * r if zero3 else
                                                       flat_shard_numel(sum(u.numels), w, ZERO_ALIGN) * r,
                                                       COMPUTE, "backward", "gradient", u.name))
                return
            if flat:
                # The flat gradient (SplitBackward of the views) is the compute stream's. FSDP1's
                # post-backward hook runs in its post-backward stream (_runtime_utils.py
                # _post_backward_hook: `with stream(_post_backward_stream)`): the cast to the reduce
                # dtype, the padding to a multiple of the ranks (_get_reduce_scatter_tensors' F.pad)
                # and the sharded output are that stream's (2), the first two freed there when the
                # hook returns; the autograd gradient is record_stream'ed to it (freed when that
                # stream has passed it).
                numel = sum(u.numels)
                grad_in = b.alloc(numel * p, COMPUTE, "backward", "temporary", "fsdp_flat_grad")
                b.free_all(traced_grads)
                hook = []
                if r != p:
                    hook.append(b.alloc(numel * r, REDUCE_SCATTER, "backward", "temporary", "fsdp_grad_cast"))
                if full > numel:
                    hook.append(b.alloc(full * r, REDUCE_SCATTER, "backward", "temporary", "fsdp_grad_pad"))
                out = b.alloc(shard * r, REDUCE_SCATTER, "backward", "gradient", u.name)
                b.free_all(hook)
                delayed.append((gathers_done[0] + 1, [grad_in]))   # record_stream(post-backward stream)
            elif rs_input_on_rs_stream:   # FSDP2 before PR #129721: copy-in on the RS stream, freed there
                rs_in = b.alloc(full * r, REDUCE_SCATTER, "backward", "temporary", "reduce_scatter_input")
                b.free_all(traced_grads)
                out = b.alloc(shard * r, REDUCE_SCATTER, "backward", "gradient", u.name)
                b.free(rs_in)   # a local of foreach_reduce_scatter, used on its own stream only
            else:
                while len(rs_inflight) >= 1:   # reduce_scatter_max_input_buffers
                    b.free(rs_inflight.pop(0))
                rs_in = b.alloc(full * r, COMPUTE, "backward", "temporary", "reduce_scatter_input")
                b.free_all(traced_grads)
                out = b.alloc(shard * r, REDUCE_SCATTER, "backward", "gradient", u.name)
                rs_inflight.append(rs_in)
            if r != o:   # _to_dtype_if_needed / _cast_grad_to_param_dtype
                cast = b.alloc(shard * o, REDUCE_SCATTER, "backward", "gradient", u.name)
                b.free(out)
                out = cast
            if offload_params:   # D2H to the CPU gradient
                b.free(out)
                return
            if state[u.name].grads or step_grads.get(u.name):
                b.free(out)   # accumulated into the existing sharded gradient in place
            else:
                step_grads[u.name] = out

        step_grads: dict[str, int] = {}
        pending_grads = {u.name: [] for u in units}
        mapping: dict[int, int] = {}
        # Gradient accumulation: the traced iteration is the last micro-batch of the step, and the
        # ones before it leave their gradients, alive from its forward on: FSDP's unsharded ones
        # (no_sync / set_requires_gradient_sync(False), as accelerate and the Trainer accumulate:
        # each rank keeps the unit's whole gradient in the param dtype until the micro-batch that
        # syncs, which adds into it and reduce-scatters it), ZeRO-1's whole ones, ZeRO-2/3's
        # reduced partitions (added into in place).
        accumulated: dict[str, int] = {}
        if spec.grad_accum > 1 and not offload_params:
            for u in units:
                if not sum(u.numels):
                    continue   # a unit without parameters of its own (the root of a wrapped model)
                if kind in ("zero2", "zero3"):
                    if not offload_opt:
                        state[u.name].grads.append(b.alloc(
                            unit_numels(u)[0] * r if zero3 else flat_shard_numel(sum(u.numels), w, ZERO_ALIGN) * r,
                            COMPUTE, "forward", "gradient", u.name))
                else:
                    accumulated[u.name] = b.alloc(sum(u.numels) * p, COMPUTE, "forward", "gradient",
                                                  f"{u.name} (accumulated)")
        # frees of what the previous copy kept (its tail), at the points the loop drops them
        tail_inputs = [e for e in ut.tail if e.category == "input"]
        tail_rest = [e for e in ut.tail if e.category != "input"]
        if step:
            b.copy(tail_inputs, prev_map)
        first_backward = next((i for i, e in enumerate(ut.iteration) if e.phase == "backward"), len(ut.iteration))
        for i, e in enumerate(list(ut.iteration) + [None]):
            if i == first_backward and step:
                b.copy(tail_rest, prev_map)
            if i == first_backward:   # the last forward's all-gather output is flushed (root post-forward)
                b.free(pending_ag[0])
                pending_ag[0] = None
            for what, u in at.get(i, ()):
                if what == "fwd_pre":
                    pre(u, "forward")
                elif what == "fwd_post":
                    # the root stays unsharded for backward (FSDP2), as do the units ZeRO-3 reuses soon
                    if gathers and reshards_fwd(u) and not u.is_root and u.name not in kept_fwd:
                        reshard(u)
                elif what == "bwd_pre":
                    pre(u, "backward")
                    nxt = next_in_bwd.get(u.name)
                    if gathers and nxt is not None and not state[nxt.name].unsharded:
                        gather(nxt, "backward")   # BACKWARD_PRE prefetch of one unit
                elif what == "bwd_post":
                    if gathers:
                        reshard(u)
                    reduce(u, [mapping.get(g, g) for g in pending_grads[u.name]])
                    pending_grads[u.name] = []
                    b.free(accumulated.pop(u.name, None))   # reduced with this micro-batch's (the step's)
            if e is None:
                break
            if step and e.action == "alloc" and kept_for_process(e):
                continue   # the first step's is still there
            if e.action == "alloc" and e.block in grad_blocks:
                pending_grads[grad_blocks[e.block].name].append(e.block)
                if kind != "zero1":   # unsharded: reduced and dropped in backward
                    e = AllocEvent(e.action, e.block, e.size_bytes, e.stream, e.phase, "temporary", "unsharded_grad")
            b.copy([e], mapping)
        b.free_all(rs_inflight)
        release_delayed()
        for u in units:   # whatever is still unsharded after backward (a unit never reached)
            reshard(u)
        release_delayed()
        for name, g in step_grads.items():
            state[name].grads.append(g)
        # the step: the optimizer on this rank's shards (on the CPU with offload)
        if not offload_opt:
            b.copy(opt.steps[min(step, len(opt.steps) - 1)], {})
        for st in state.values():   # zero_grad(set_to_none=True)
            b.free_all(st.grads)
        prev_map = mapping
        step_ends.append(len(b.events))
    b.copy(ut.tail, prev_map)
    del zero2_bucket
    tp = (f", {data_world(spec)} data-parallel x {spec.tensor_parallel} tensor-parallel"
          if spec.tensor_parallel > 1 else "")
    notes = ut.notes + (f"{kind} over {spec.num_gpus} GPUs{tp}, per rank"
                        + (f" (shard group {w})" if kind == "hsdp" else ""),)
    if kind.startswith("zero"):
        notes += ("DeepSpeed modelled from its default configuration, not traced",)
    if spec.grad_accum > 1 and not offload_params:
        notes += (f"gradient accumulation over {spec.grad_accum} micro-batches: the last one traced, with the "
                  "gradients the others leave" + (" unsharded on each rank (FSDP's no_sync, as accelerate and the "
                                                  "Trainer accumulate; a loop that reduce-scatters every micro-batch "
                                                  "needs less)" if kind in ("fsdp", "fsdp2", "hsdp") else ""),)
    if kept_fwd:
        notes += (f"ZeRO-3 keeps {len(kept_fwd)} of {sum(not u.is_root for u in units)} units gathered from forward to "
                  f"backward (used again within stage3_max_reuse_distance, {spec.max_reuse_distance:.0e} elements)",)
    return AllocTrace(tuple(b.events), steps, notes, tuple(step_ends))


_PRECISION_OF = {"bfloat16": "bf16", "float16": "fp16"}


def unit_spec(spec: WorkloadSpec) -> WorkloadSpec:
    """The spec the unsharded model is traced with (sharded_trace.unit_trace; variants of a job with
    the same unit_spec share that trace): weights in the param dtype (what the forward
    computes with under FSDP's mixed precision and DeepSpeed's bf16/fp16 engines), one step of one
    micro-batch, and nothing of the parallelism (the per-rank trace adds it) or of the optimizer (traced apart)."""
    _, param, _ = dtypes(spec)
    precision = spec.precision
    if param != spec.weight_dtype:
        precision = _PRECISION_OF.get(param, "fp32")
    # The unit trace is cut before the optimizer step (optimizer_trace traces the step on the
    # rank's shards), so the unsharded model steps with plain SGD: no state, one in-place update.
    # One micro-batch: rank_trace adds what the step's earlier micro-batches leave (grad_accum).
    return replace(spec, precision=precision, steps=1, grad_accum=1, num_gpus=1, parallelism="none", sharding="full-shard",
                   optimizer="sgd", optimizer_impl="auto", weight_decay=None,
                   shard_group_size=0, gpus_per_node=0, param_dtype="auto", reduce_dtype="auto",
                   offload="none", reshard_after_forward="on", reduce_bucket_size=0,
                   max_reuse_distance=WorkloadSpec.max_reuse_distance, alloc_conf="")
