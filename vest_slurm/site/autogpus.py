"""``#VEST --num-gpus auto``: the smallest GPU count (and node count) at which a sharded job fits.

In: the job script (its torchrun line, read as words, never run), the sharded WorkloadSpec, the
job's GpuRequest, the partitions and GPU type the user named, the site, a Prober, and the nodes of
each partition where Slurm told them. Out: an ``AutoGpus`` (count, nodes, GPUs per node, the spec
and request at that count, the sbatch options that ask for it), ``None`` when no count up to what a
partition takes fits, or a JobScriptError naming the script line that keeps vsbatch from choosing.

Why only sharded strategies: under FSDP/HSDP/ZeRO the per-rank shards of parameters, gradients and
optimizer states fall as the GPU count grows (sharding.py); under DDP every GPU holds the whole
model, so more GPUs lower nothing per GPU. The count changes the global batch (the per-GPU batch is
kept), which is why only ``auto`` lets vsbatch choose it; without it vsbatch only suggests.

The torchrun line constrains the shape, as torchrun itself reads its options (torch.distributed.run:
``--nproc_per_node`` default 1, ``--nnodes`` default 1): a number there is a fixed per-node or node
count; ``gpu``/``auto`` and ``$SLURM_GPUS_ON_NODE`` follow the GPUs Slurm gives each node, and
``$SLURM_NNODES``/``$SLURM_JOB_NUM_NODES`` the nodes it gives the job; anything else (another
variable, an elastic ``MIN:MAX``) cannot be read here, and vsbatch refuses rather than guess.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from ..errors import JobScriptError
from ..estimate.workload import SHARDED, WorkloadSpec
from ..slurm.jobscript import GpuRequest, JobScript
from .config import SiteConfig

MAX_AUTO_GPUS = 64   # as advice.MAX_SHARDED_GPUS: the largest job size vsbatch proposes or chooses
# torchrun's values that follow Slurm's allocation (torch.distributed.run: "gpu" = the visible
# CUDA devices, "auto" = the same where CUDA is available; Slurm sets SLURM_GPUS_ON_NODE per node,
# SLURM_NNODES / SLURM_JOB_NUM_NODES for the job).
_FOLLOWS_GPUS = re.compile(r"gpu|auto|\$SLURM_GPUS_ON_NODE|\$\{SLURM_GPUS_ON_NODE\}")
_FOLLOWS_NODES = re.compile(r"\$(SLURM_NNODES|\{SLURM_NNODES\}|SLURM_JOB_NUM_NODES|\{SLURM_JOB_NUM_NODES\})")
_NPROC = ("--nproc_per_node", "--nproc-per-node")


@dataclass(frozen=True)
class LaunchShape:
    """What the script's torchrun line fixes: processes per node and nodes (None: follows Slurm)."""

    lineno: int | None = None      # None: no torchrun line (srun python ..., or no command)
    per_node: int | None = None
    nodes: int | None = None


@dataclass(frozen=True)
class AutoGpus:
    gpus: int
    nodes: int
    per_node: int
    spec: WorkloadSpec
    request: GpuRequest
    overrides: tuple[tuple[str, str], ...]   # sbatch options (the GPU option is placement's, per type)
    text: str


def launch_shape(js: JobScript) -> LaunchShape:
    """The first torchrun (or ``python -m torch.distributed.run``) line's per-node and node counts."""
    for c in js.commands:
        try:
            words = shlex.split(c.text, comments=True)
        except ValueError:
            continue
        at = next((i + 1 for i, w in enumerate(words) if w.rsplit("/", 1)[-1] == "torchrun"), None)
        if at is None:
            at = next((i + 1 for i, w in enumerate(words[:-1]) if w == "-m"
                       and words[i + 1] in ("torch.distributed.run", "torch.distributed.launch")), None)
            at = at + 1 if at is not None else None
        if at is None:
            continue
        seen: dict[str, str] = {}
        i = at
        while i < len(words) and words[i].startswith("-"):
            k, eq, v = words[i].partition("=")
            if eq:
                seen[k], i = v, i + 1
            elif k in _NPROC + ("--nnodes",) and i + 1 < len(words):
                seen[k], i = words[i + 1], i + 2
            else:
                i += 1   # other options: their values are not counts, and do not start with "-" rarely matter here
        nproc = next((seen[k] for k in _NPROC if k in seen), "1")
        nnodes = seen.get("--nnodes", "1")
        return LaunchShape(c.lineno, _count(js, c.lineno, "--nproc_per_node", nproc, _FOLLOWS_GPUS,
                                            "$SLURM_GPUS_ON_NODE"),
                           _count(js, c.lineno, "--nnodes", nnodes, _FOLLOWS_NODES, "$SLURM_NNODES"))
    return LaunchShape()


def _count(js: JobScript, lineno: int, name: str, value: str, follows: re.Pattern, var: str) -> int | None:
    if follows.fullmatch(value):
        return None
    if re.fullmatch(r"[0-9]{1,6}", value) and int(value) > 0:
        return int(value)
    raise JobScriptError(f"{js.path}: line {lineno}: torchrun {name} {value!r}: vsbatch cannot tell what count "
                         f"that is, so it cannot choose the GPU count (#VEST --num-gpus auto)",
                         f"write {name}={var} (follows what vsbatch asks Slurm for) or a number there, "
                         "or give #VEST --num-gpus N")


def _shapes(per_node_max: int, nodes_max: int, fixed_per_node: int | None, fixed_nodes: int | None
            ) -> list[tuple[int, int, int]]:
    """(GPUs, per node, nodes) a partition allows, fewest GPUs first: one node filled one GPU at a
    time, then whole nodes (a job over several nodes runs as many ranks on each: torchrun's
    nproc_per_node is one number for every node)."""
    out = []
    for nodes in range(1, nodes_max + 1):
        if fixed_nodes is not None and nodes != fixed_nodes:
            continue
        per = [fixed_per_node] if fixed_per_node is not None else (
            range(1, per_node_max + 1) if nodes == 1 or fixed_nodes is not None else [per_node_max])
        out += [(p * nodes, p, nodes) for p in per if p <= per_node_max and p * nodes <= MAX_AUTO_GPUS]
    return sorted(set(out))


def choose(spec: WorkloadSpec, request: GpuRequest, partitions: Sequence[str], site: SiteConfig, prober,
           shape: LaunchShape, node_counts: Mapping[str, int], where: str) -> AutoGpus | None:
    """The smallest count (then fewest nodes) at which some allowed (partition, GPU type) holds the
    job per rank with the site's headroom; placement then picks the type at that count."""
    if spec.parallelism not in SHARDED:
        raise JobScriptError(f"{where}: #VEST --num-gpus auto applies to sharded jobs (--parallelism "
                             f"{', '.join(SHARDED)}), not {spec.parallelism}: every {spec.parallelism} GPU holds "
                             "the whole model, so more GPUs lower nothing per GPU",
                             "add --parallelism fsdp2 (or another sharded strategy), or give --num-gpus N")
    if request.source == "gpus-per-task":
        raise JobScriptError(f"{where}: #VEST --num-gpus auto with --gpus-per-task: vsbatch would have to change "
                             "the task count", "ask with --gres=gpu:N or --gpus-per-node, or give --num-gpus N")
    fixed_per_node = spec.gpus_per_node or None
    if shape.per_node is not None:
        if fixed_per_node is not None and fixed_per_node != shape.per_node:
            raise JobScriptError(f"{where}: line {shape.lineno}: torchrun --nproc_per_node {shape.per_node} but "
                                 f"#VEST --gpus-per-node {fixed_per_node}",
                                 "make them the same, or write --nproc_per_node=$SLURM_GPUS_ON_NODE")
        fixed_per_node = shape.per_node
    pool = [(p, t) for p in site.partitions for t in p.gpu_types
            if (not partitions or p.name in partitions) and (request.gpu_type is None or t == request.gpu_type)]
    options = sorted({(n, per, nodes, p.name, t) for p, t in pool
                      for n, per, nodes in _shapes(p.gpus_per_node, node_counts.get(p.name, p.nodes or MAX_AUTO_GPUS),
                                                   fixed_per_node, shape.nodes)
                      if p.max_gpus_per_job is None or n <= p.max_gpus_per_job})
    from .placement import estimate_need, needed_bytes

    pol = site.policy
    unknown: set[int] = set()   # counts the prober could not estimate (its trace budget): said, not hidden
    for n, per, nodes, _part, t in options:
        if spec.parallelism == "hsdp" and spec.shard_group_size and n % spec.shard_group_size:
            continue
        at = spec.with_(num_gpus=n, gpus_per_node=per if nodes > 1 or spec.gpus_per_node else spec.gpus_per_node)
        est = prober.estimate(at, t)
        if est is None:
            unknown.add(n)
            continue
        need = needed_bytes(estimate_need(est), pol.headroom_percent, pol.headroom_bytes)
        if need <= prober.capacity(t):
            return _result(at, request, shape, n, per, nodes, sorted(u for u in unknown if u < n))
    return None


def _result(spec: WorkloadSpec, request: GpuRequest, shape: LaunchShape, n: int, per: int, nodes: int,
            unknown: Sequence[int] = ()) -> AutoGpus:
    old_tasks_per_node = request.ntasks_per_node or (-(-request.ntasks // max(request.nodes, 1))
                                                     if request.ntasks else 1)
    # One task per GPU stays one task per GPU (srun python ...); a torchrun job keeps its launchers
    # per node (torchrun starts the per-GPU processes itself).
    per_gpu = shape.lineno is None and request.wants_gpu and old_tasks_per_node == request.gpus_per_node > 1
    tasks_per_node = per if per_gpu else old_tasks_per_node
    overrides = [("nodes", str(nodes))]
    if request.ntasks_per_node is not None or per_gpu:
        overrides.append(("ntasks-per-node", str(tasks_per_node)))
    if request.ntasks is not None:
        overrides.append(("ntasks", str(tasks_per_node * nodes)))
    source = request.source or "gres"
    req = replace(request, source=source, gpus_per_node=per, total_gpus=n, nodes=nodes,
                  ntasks=tasks_per_node * nodes if request.ntasks is not None else None,
                  ntasks_per_node=tasks_per_node if (request.ntasks_per_node is not None or per_gpu) else None)
    fewer = "not at fewer" if not unknown else \
        f"not at fewer it was estimated at; not estimated at {', '.join(map(str, unknown))} (trace budget)"
    text = (f"--num-gpus auto: {n} GPU(s), {nodes} node(s) x {per} ({spec.parallelism} fits per rank at {n}, "
            f"{fewer}); the global batch is {n} x {spec.batch_size}")
    return AutoGpus(n, nodes, per, spec, req, tuple(overrides), text)


def reconcile_shape(spec: WorkloadSpec, request: GpuRequest, said_gpus: bool, where: str
                    ) -> tuple[WorkloadSpec, GpuRequest, list[str]]:
    """The job's GPU count and per-node shape from ``#VEST`` and ``#SBATCH`` (a given count, not
    ``auto``): (spec, request, warnings).

    - #SBATCH's GPUs when #VEST names no count; #VEST's count when #SBATCH asks for no GPU, placed
      ``--gpus-per-node`` per node (#VEST's; else over #SBATCH's ``--nodes``), the nodes following
      (a ``--nodes`` that disagrees is refused: vsbatch does not choose between them);
    - both given and different: #VEST's is estimated, with a warning (the user's count is not changed);
    - a sharded job over several nodes without #VEST ``--gpus-per-node`` is estimated at #SBATCH's
      GPUs per node (HSDP's default shard group and NCCL's intra-node rings are one node's GPUs)."""
    warnings: list[str] = []
    if request.wants_gpu and not said_gpus and request.total_gpus != spec.num_gpus:
        spec = spec.with_(num_gpus=request.total_gpus)
    elif not request.wants_gpu and spec.num_gpus > 1:
        per = spec.gpus_per_node or -(-spec.num_gpus // max(request.nodes, 1))
        nodes = -(-spec.num_gpus // per)
        if request.nodes > 1 and nodes != request.nodes:
            raise JobScriptError(f"{where}: #SBATCH --nodes={request.nodes} but #VEST --num-gpus {spec.num_gpus} "
                                 f"with {per} per node needs {nodes} node(s)",
                                 "make --nodes x --gpus-per-node equal --num-gpus, or drop --nodes")
        request = replace(request, gpus_per_node=min(per, spec.num_gpus), total_gpus=spec.num_gpus, nodes=nodes)
    elif request.wants_gpu and said_gpus and request.total_gpus != spec.num_gpus:
        warnings.append(f"#VEST --num-gpus {spec.num_gpus} but the job asks Slurm for {request.total_gpus} "
                        "GPU(s); estimated for #VEST's count")
    if request.wants_gpu and spec.gpus_per_node and spec.gpus_per_node != request.gpus_per_node:
        warnings.append(f"#VEST --gpus-per-node {spec.gpus_per_node} but the job asks Slurm for "
                        f"{request.gpus_per_node} per node; estimated for #VEST's")
    elif spec.parallelism in SHARDED and not spec.gpus_per_node and request.nodes > 1 and request.gpus_per_node:
        spec = spec.with_(gpus_per_node=request.gpus_per_node)
    return spec, request, warnings


# Without a site config, the GPUs of one node that `vest estimate --num-gpus auto` assumes: the
# 8 NVLink-connected GPUs of an HGX/DGX board (A100, H100, H200, B200), the node most sharded jobs
# run on; a site config gives each GPU type's own (its partitions' gpus_per_node).
DEFAULT_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class SmallestCount:
    """One GPU type's answer to ``--num-gpus auto``: the fewest GPUs (then nodes) that hold the job
    per rank, the spec at that count, and its estimate there."""

    gpu: str
    gpus: int
    nodes: int
    per_node: int
    spec: WorkloadSpec
    estimate: object   # MemoryEstimate


def smallest_counts(spec: WorkloadSpec, prober, per_node: Mapping[str, int]) -> dict[str, SmallestCount | None]:
    """Per GPU type of ``prober``, the fewest GPUs at which ``spec``'s strategy fits per rank with the
    prober's headroom (placement's rule), over the shapes ``_shapes`` allows (one node filled a GPU
    at a time, then whole nodes, up to MAX_AUTO_GPUS); None where no count does. Every count below
    the answer was estimated (or its floor alone, or its bound without the allocator's replay, is
    above the GPU: Prober.needed's fits_only) and does not fit."""
    if spec.parallelism not in SHARDED:
        raise JobScriptError(f"--num-gpus auto applies to sharded jobs (--parallelism {', '.join(SHARDED)}), not "
                             f"{spec.parallelism}: every {spec.parallelism} GPU holds the whole model, so more GPUs "
                             "lower nothing per GPU", "add --parallelism fsdp2 (or another sharded strategy), or give --num-gpus N")
    out: dict[str, SmallestCount | None] = {}
    for t in prober.profiles:
        g = spec.gpus_per_node or per_node.get(t, DEFAULT_GPUS_PER_NODE)
        out[t] = None
        for n, per, nodes in _shapes(g, MAX_AUTO_GPUS // g, spec.gpus_per_node or None, None):
            if spec.parallelism == "hsdp" and spec.shard_group_size and n % spec.shard_group_size:
                continue
            at = spec.with_(num_gpus=n, gpus_per_node=per if nodes > 1 or spec.gpus_per_node else 0)
            need = prober.needed(at, t, fits_only=True)
            if need is not None and need <= prober.capacity(t) and (at, t) not in prober.floored:
                out[t] = SmallestCount(t, n, nodes, per, at, prober.estimate(at, t))
                break
    return out
