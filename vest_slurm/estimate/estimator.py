"""From a WorkloadSpec to a MemoryEstimate per GPU type: trace, replay, add what lives outside.

    trace_training(spec)                       (tracing.py: fake CUDA on the CPU)
      -> workspace sizes of this GPU type     (cuBLAS per profile; cuDNN per convolution, cudnn_ws.py)
      -> the last step repeated               (steady.py: until the allocator's layout settles)
      -> replay(...)                          (allocator.py: the caching allocator)
      -> + CUDA context, cuDNN, NCCL          (profiles.py)
      = peak     what nvidia-smi shows on this GPU type (cuDNN takes the workspace of its
                 heuristics' first plan, as on a GPU with room for it)
      = required the smallest device memory at which the job runs (the allocator's
                 flush-and-retry applied; cuDNN falls back to plans without a workspace)

Multi-GPU data parallel jobs are estimated per GPU: the batch is per GPU; DDP adds its gradient
buckets (one flat copy of the gradients, torch DistributedDataParallel's default
gradient_as_bucket_view=False) and NCCL's buffers.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

from . import steady
from .allocator import live_need_bytes, replay
from .allocator_config import parse_alloc_conf
from ..errors import EstimateError, WorkloadError
from .record import MemoryEstimate
from .sharding import data_world, strategy_world
from .profiles import DeviceProfile, capability_class, eager_loading
from .trace import BF16_NOTE, CAUGHT_OOM, AllocEvent, AllocTrace, with_size
from ..units import MiB
from .workload import SHARDED, WorkloadSpec

# NCCL's buffers per communicator for a ring all-reduce: per channel, a send and a receive buffer
# for each protocol (SIMPLE NCCL_BUFFSIZE 4 MiB, LL128 ~4.6 MiB, LL 256 KiB), ~9 MiB per peer
# direction; NCCL opens 16 channels or more on NVLink/NVSwitch nodes: 2 x 16 x 9 MiB ~ 288 MiB.
NCCL_BYTES = 288 * MiB
# NCCL's NVLink SHARP (NVLS) buffers, per communicator, as src/transport/nvls.cc (NCCL 2.2x) sets them
# up: only where the GPU supports multicast (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED: Hopper and later
# on NVSwitch; NCCL_NVLS_ENABLE's default 2 asks the device) and the communicator has more than two
# GPUs on the node (ncclNvlsInit: gpuCount <= 2 returns). ncclNvlsBufferSetup then binds on every GPU
# nvlsTotalSize = nvlsChannels x 2 (reduce and broadcast) x buffSize x nHeads, with buffSize =
# NCCL_NVLS_CHUNKSIZE (128 KiB) x NCCL_STEPS (8) = 1 MiB and one head per local rank; the credits
# (64 B per channel, direction and head) are negligible. nvlsChannels: NVLS_NCHANNELS_SM90 16,
# NVLS_NCHANNELS_SM100 32. 8 H100 of one HGX node: 16 x 2 x 1 MiB x 8 = 256 MiB per GPU. Older NCCL
# (2.18-2.19) sized buffSize as the SIMPLE protocol's 4 MiB plus 2 MiB alignment, six times more; a
# job that exports NCCL_NVLS_ENABLE=0 holds none (not read from the job: the estimate errs high).
NVLS_BUFF_BYTES = 128 * 1024 * 8
NVLS_CHANNELS = {9: 16, 10: 32}


def nvls_bytes(profile: DeviceProfile, local_ranks: int) -> int:
    """NCCL's NVLS buffers of one communicator with ``local_ranks`` GPUs on this GPU's node (0 where
    NCCL would not set NVLS up)."""
    if not profile.nvswitch or local_ranks <= 2 or profile.capability[0] < 9:
        return 0
    channels = NVLS_CHANNELS.get(profile.capability[0], max(NVLS_CHANNELS.values()))
    return channels * 2 * NVLS_BUFF_BYTES * local_ranks


def _nvls_parts(spec: WorkloadSpec, profile: DeviceProfile) -> list[tuple[str, int]]:
    """NVLS buffers of the job's communicators: the data-parallel (or shard) group's, whose local ranks
    are the GPUs of one node it spans (--gpus-per-node, else one HGX node's 8 at most); HSDP's and
    FSDP1 hybrid's replicate group has one rank per node, so none."""
    if spec.num_gpus <= 2 or spec.parallelism not in ("ddp", *SHARDED):   # dp: one process, not modelled
        return []
    per_node = spec.gpus_per_node or min(spec.num_gpus, 8)
    group = strategy_world(spec) if spec.parallelism in SHARDED else spec.num_gpus
    n = nvls_bytes(profile, min(group, per_node))
    return [("nccl_nvls", n)] if n else []


DDP_BUCKET_BLOCK = -10_000_000   # block id of the DDP buckets the estimator adds (not from the trace)
CACHED_NOTE = "read from the trace cache"
_CUDNN_WORKSPACES = ("cudnn", "cudnn_find")   # per convolution run; benchmark mode's timing one per shape


@dataclass(frozen=True)
class TraceSummary:
    trace: AllocTrace
    seconds: float
    uses_cudnn: bool
    live_peak_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    has_ddp_buckets: bool = False   # the trace itself holds DDP's buckets (dynamic analysis)
    scaled: bool = False            # given by a confirmed batch_scaling.BatchLine, not traced

    @property
    def computes_bf16(self) -> bool:
        return BF16_NOTE in self.trace.notes


@dataclass(frozen=True)
class SizedToGpu(TraceSummary):
    """A script that caught CUDA out-of-memory and went on (a batch-size finder) made a run per room
    for tensors (DeviceProfile.tensor_room_bytes) of the GPU types of its class: this is the first,
    and ``by_room`` each of them; estimate_from_trace takes the one of the type it estimates."""
    by_room: tuple[tuple[int, TraceSummary], ...] = ()

    def for_profile(self, profile: DeviceProfile) -> TraceSummary:
        return dict(self.by_room).get(profile.tensor_room_bytes, self)


def summarize(trace: AllocTrace, seconds: float) -> TraceSummary:
    # parameter / optimizer-state bytes: each the more of what is alive at the end and at the end of
    # the last step (a script that ended on its own freed its model and optimizer as it exited; one
    # that ran on to its epoch's end, its optimizer's state); gradient: the largest set alive at once.
    live: dict[int, AllocEvent] = {}
    grad_live = grad_max = 0
    last_step = trace.step_ends[-1] if trace.step_ends else None
    at_step = (0, 0)

    def kept() -> tuple[int, int]:
        return (sum(e.size_bytes for e in live.values() if e.category == "parameter"),
                sum(e.size_bytes for e in live.values() if e.category == "optimizer_state"))

    for i, e in enumerate(trace.events):
        if i == last_step:
            at_step = kept()
        if e.action == "alloc":
            live[e.block] = e
            if e.category == "gradient":
                grad_live += e.size_bytes
                grad_max = max(grad_max, grad_live)
        else:
            a = live.pop(e.block, None)
            if a is not None and a.category == "gradient":
                grad_live -= a.size_bytes
    params, states = (max(a, b) for a, b in zip(kept(), at_step))
    uses_cudnn = any(e.module == "cudnn" for e in trace.events if e.category == "workspace")
    ddp = any(e.module == "ddp_buckets" for e in trace.events if e.action == "alloc")
    return TraceSummary(trace, seconds, uses_cudnn, trace.live_peak_bytes(), params, grad_max, states, ddp)


def _cudnn_question(e: AllocEvent) -> bool | None:
    """Whether ``e`` is a cuDNN workspace sized per GPU type by cuDNN's answer for its convolution:
    None where it is not, else whether the question is benchmark mode's (cudnn_ws.workspace_for)."""
    if e.category == "workspace" and e.action == "alloc" and e.module in _CUDNN_WORKSPACES and e.detail:
        return e.module == "cudnn_find"
    return None


def _events_for(events: Sequence[AllocEvent], profile: DeviceProfile, spec: WorkloadSpec,
                summary: TraceSummary) -> list[AllocEvent]:
    """The trace with this GPU type's workspaces, and DDP's buckets for multi-GPU jobs.

    cuBLAS: PyTorch's default workspace per handle (profiles.py). cuDNN: the workspace of the plan
    PyTorch runs on a GPU with room for it (cudnn_ws.py, cuDNN's own heuristics)."""
    from . import cudnn_ws

    # a script's trace holds DDP's buckets where it wrapped its model in DDP (the stand-in allocates
    # them); one that did not (tensor parallelism, gradients all-reduced by hand) has none to add
    ddp = (spec.num_gpus > 1 and spec.parallelism == "ddp" and not summary.has_ddp_buckets
           and not spec.model.startswith("script:"))
    last_param = max((i for i, e in enumerate(events) if e.category == "parameter"), default=-1) if ddp else -1
    out: list[AllocEvent] = []
    for i, e in enumerate(events):
        if e.category == "workspace" and e.action == "alloc" and e.module == "cublas":
            e = with_size(e, profile.cublas_workspace_bytes)
        elif (benchmark := _cudnn_question(e)) is not None:
            e = with_size(e, cudnn_ws.workspace_for(profile, e.detail, benchmark=benchmark))
        out.append(e)
        if i == last_param:
            # DDP's gradient buckets, allocated when the model is wrapped (after it is on the GPU).
            out.append(AllocEvent("alloc", DDP_BUCKET_BLOCK, summary.param_bytes, 0, "setup", "gradient", "ddp_buckets"))
    return out


def _with_rest_of_run(events: list[AllocEvent], summary: TraceSummary, config):
    """(the events with the steps after the traced ones, until the allocator's layout settles
    (steady.py), how many steps were added, their uncapped replay). Step ends after an event
    _events_for inserted (DDP's buckets) move by one."""
    added = [i for i, e in enumerate(events) if e.module == "ddp_buckets" and e.block == DDP_BUCKET_BLOCK]
    ends = [i + sum(1 for a in added if a <= i) for i in summary.trace.step_ends]
    return steady.extend_and_replay(events, ends, config)


def _without_cudnn_workspaces(events: list[AllocEvent]) -> list[AllocEvent]:
    """The events at capacity (replaycache.zero_cudnn): ``required`` counts no cuDNN workspace."""
    from .replaycache import zero_cudnn

    return zero_cudnn(events)


def _largest(events: Sequence[AllocEvent], module: str, default):
    """The largest allocation of this workspace kind (default where there is none)."""
    return max((e.size_bytes for e in events if e.module == module and e.action == "alloc"), default=default)


def _settled_need(full: list[AllocEvent], config) -> int:
    """What a script that caught CUDA out-of-memory and went on (a batch-size finder) needs: the
    capacity search over its run from the last out-of-memory it caught (trace.CAUGHT_OOM), with what
    was alive there. The attempts before it end in that error on a GPU too, by the script's design;
    what they held is freed and their cached blocks released (empty_cache, or the allocator's own
    release before it raises), so they ask nothing of the GPU the settled run does not."""
    from .replaycache import need_bytes

    last = max(i for i, e in enumerate(full) if e.module == CAUGHT_OOM)
    alive: dict[int, AllocEvent] = {}
    for e in full[:last]:
        if e.action == "alloc":
            alive[e.block] = e
        else:
            alive.pop(e.block, None)
    return need_bytes(list(alive.values()) + list(full[last:]), config)


def live_need(events: list[AllocEvent], config) -> int:
    """No capacity below this runs ``events`` without cuDNN's workspaces (which the capacity search
    zeroes): the peak of the live blocks' rounded requests (allocator.live_need_bytes)."""
    from .replaycache import zero_cudnn

    return live_need_bytes(zero_cudnn(events), config)


def _peak_on(profile: DeviceProfile, peak: int, required: int) -> int:
    """The peak as this GPU shows it. The replay's peak has no ceiling; where it is above what the
    GPU has but the job runs (required fits), the allocator empties its cache and retries and cuDNN
    takes smaller workspaces instead of failing, so the device fills up to what it has."""
    if required <= profile.usable_bytes < peak:
        return profile.usable_bytes
    return peak


def trace_for(spec: WorkloadSpec, profile: DeviceProfile, cache: bool = False) -> TraceSummary:
    """The CPU trace of ``spec`` on a GPU like ``profile``. ``cache``: read it from the trace cache
    (tracecache.py) where the same workload was traced by the same code before, and keep it there;
    the CLI commands use it, the benchmarks (which time the tracing) do not."""
    from . import ahead, tracecache

    made, answer = ahead.take((spec, profile.key, cache))   # traced beside another class (traced_ahead)
    if made:
        if isinstance(answer, EstimateError):
            raise answer
        return answer
    from . import oneshot

    if spec.parallelism in SHARDED:
        # per rank (sharding.py); the unsharded model's trace is kept in memory by sharded_trace
        from .sharded_trace import trace_sharded

        oneshot.settle()   # torch's objects and the traces before out of the collector's scans
        t0 = time.perf_counter()
        trace = trace_sharded(spec, capability=profile.capability, total_memory_bytes=profile.total_bytes)
        return summarize(trace, time.perf_counter() - t0)
    k = tracecache.key(spec, profile.capability, profile.total_bytes) if cache else None
    hit = tracecache.load(k)
    if hit is not None:
        trace, seconds = hit
        return summarize(replace(trace, notes=trace.notes + (CACHED_NOTE,)), seconds)
    from . import progress
    from .step_scaling import trace_scaled   # torch is imported only when an estimate is made

    oneshot.settle()   # torch's and torchvision's objects out of the collector's scans
    progress.step(f"tracing {spec.model} at batch {spec.batch_size} on fake CUDA "
                  f"(sm{profile.capability[0]}{profile.capability[1]} class)")
    t0 = time.perf_counter()
    try:
        # a stack of identical blocks traced with 4 and 5 of them and scaled, where that is exact
        trace = trace_scaled(spec, profile.capability, profile.total_bytes)
    except (EstimateError, WorkloadError) as e:
        tracecache.store(k, e, time.perf_counter() - t0)
        raise
    seconds = time.perf_counter() - t0
    tracecache.store(k, trace, seconds)
    return summarize(trace, seconds)


# The allocator's answers for one trace, keyed by all the replay sees: the events as this GPU type
# and job make them (_events_for: workspace sizes, cuBLAS per handle and cuDNN per convolution;
# DDP's buckets) and the allocator settings. GPU types that agree on them (most of the 22 built-in
# profiles do, per architecture) get the same replay, so it is made once:
# {id(summary): (summary, {key: answers})}.
_REPLAYS: dict[int, tuple[TraceSummary, dict]] = {}
_REPLAYS_KEPT = 8   # traces whose replays are kept (a batch search holds a few at a time)


def _replayed(summary: TraceSummary, events: list[AllocEvent], spec: WorkloadSpec, config):
    """replaycache.Replayed (the events with the rest of the run, the ReplayResult, the required
    bytes), made once per distinct ``events`` (what a GPU type changes in them: workspace sizes)
    and allocator settings; read from disk where the trace cache is on and an earlier process made it."""
    # Within one trace the events a GPU type makes differ only in the workspace sizes and in DDP's
    # buckets (one event more): the sizes, in order, say which events they are. Hashing them is
    # cheap; hashing and comparing the events (frozen dataclasses) cost as much as a replay's tenth.
    key = (spec.alloc_conf, tuple(e.size_bytes for e in events))
    held = _REPLAYS.get(id(summary))
    if held is None or held[0] is not summary:
        while len(_REPLAYS) >= _REPLAYS_KEPT:
            _REPLAYS.pop(next(iter(_REPLAYS)))
        held = _REPLAYS[id(summary)] = (summary, {})
    if key not in held[1]:
        from .replaycache import replayed

        held[1][key] = replayed(events, summary.trace.step_ends, config,
                                lambda: _with_rest_of_run(events, summary, config)[::2])
    return held[1][key]


def replayed_events(summary: TraceSummary, spec: WorkloadSpec, profile: DeviceProfile):
    """(the events estimate_from_trace replays on ``profile``, the allocator settings): what the
    timeline picture and the memory snapshot (timeline.py) show."""
    config = parse_alloc_conf(spec.alloc_conf)
    return _replayed(summary, _events_for(summary.trace.events, profile, spec, summary), spec, config).full(), config


def _outside_parts(summary: TraceSummary, spec: WorkloadSpec, profile: DeviceProfile) -> list[tuple[str, int]]:
    """What lives outside the caching allocator on ``profile``: the CUDA context, eagerly loaded
    modules, cuDNN's handle, NCCL's communicators and NVLS buffers ((name, bytes) each)."""
    parts = [("cuda_context", profile.context_mib * MiB)]
    if profile.floor == "default" and eager_loading():
        # a default floor bounds lazily loaded code only; eager loading loads every module (eager.py).
        # A calibrated floor was measured on the site's own stack and loading mode
        from .eager import eager_code_bytes

        eager, _ = eager_code_bytes(profile.capability, summary.uses_cudnn, spec.num_gpus > 1)
        if eager:
            parts.append(("eager_module_loading", eager))
    if summary.uses_cudnn:
        parts.append(("cudnn", profile.cudnn_mib * MiB))
    if spec.num_gpus > 1 and spec.parallelism in ("ddp", "dp"):
        parts.append(("nccl", NCCL_BYTES))
    elif spec.num_gpus > 1 and spec.parallelism in SHARDED:
        # one communicator for the all-gathers and reduce-scatters (FSDP's and DeepSpeed's data
        # parallel group); HSDP adds the replicate group's (its all-reduce across shard groups)
        comms = 2 if spec.parallelism in ("hsdp", "fsdp") and strategy_world(spec) < data_world(spec) else 1
        comms += 1 if spec.tensor_parallel > 1 else 0   # beside a 2-D mesh's tensor-parallel group
        parts.append(("nccl", comms * NCCL_BYTES))
    parts += _nvls_parts(spec, profile)
    return parts


def need_at_least(summary: TraceSummary, spec: WorkloadSpec, profile: DeviceProfile) -> int:
    """A bound no estimate of ``summary`` on ``profile`` goes below, made without the allocator's
    replay: what lives outside the allocator and the peak of the live blocks' rounded requests
    (live_need), below which no capacity runs the events, so neither the need nor the peak is
    below it. Where it is above a GPU (with the site's headroom), the job does not fit there,
    whatever the replay would add. 0 for a run that caught out-of-memory (its live tensors hold
    the failed attempts', which the settled run does not)."""
    if isinstance(summary, SizedToGpu):
        summary = summary.for_profile(profile)
    events = _events_for(summary.trace.events, profile, spec, summary)
    if any(e.module == CAUGHT_OOM for e in events):
        return 0
    return sum(v for _, v in _outside_parts(summary, spec, profile)) + live_need(events, parse_alloc_conf(spec.alloc_conf))


def _replay_of(summary: TraceSummary, spec: WorkloadSpec, profile: DeviceProfile):
    """(the summary of this GPU type's run, the allocator settings, the events as this GPU type makes
    them, their uncapped replay with the rest of the run: replaycache.Replayed, made once)."""
    if isinstance(summary, SizedToGpu):
        summary = summary.for_profile(profile)
    config = parse_alloc_conf(spec.alloc_conf)
    events = _events_for(summary.trace.events, profile, spec, summary)
    return summary, config, events, _replayed(summary, events, spec, config)


def peak_at_least(summary: TraceSummary, spec: WorkloadSpec, profile: DeviceProfile) -> int:
    """A bound no estimate's peak (so no need placement applies its headroom to) goes below, from
    the uncapped replay alone: the peak is the uncapped replay's, or, where that is above the GPU,
    the GPU's usable memory or the uncapped one (estimate_from_trace: the capacity search, made
    only then, decides which). Where the site's headroom puts even the usable memory above the GPU,
    the job does not fit, and the search is not needed to say so. The replay is kept for the estimate."""
    summary, _config, _events, done = _replay_of(summary, spec, profile)
    fixed = sum(v for _, v in _outside_parts(summary, spec, profile))
    return min(fixed + done.result.peak_reserved_bytes, profile.usable_bytes)


def estimate_from_trace(summary: TraceSummary, spec: WorkloadSpec, profile: DeviceProfile) -> MemoryEstimate:
    summary, config, events, done = _replay_of(summary, spec, profile)
    result = done.result
    caught = any(e.module == CAUGHT_OOM for e in events)

    @functools.cache
    def need_of() -> int:
        return min(done.need_bytes, _settled_need(done.full(), config)) if caught else done.need_bytes
    # the steps steady.py adds repeat the last one: the run's largest workspaces are the trace's
    cudnn_ws_max = _largest(events, "cudnn", default=0)
    cudnn_find_max = _largest(events, "cudnn_find", default=None)
    parts = _outside_parts(summary, spec, profile)
    fixed = sum(v for _, v in parts)
    breakdown = tuple(parts) + (
        ("parameters", summary.param_bytes),
        ("gradients", summary.grad_bytes),
        ("optimizer_state", summary.optimizer_state_bytes),
        ("live_tensor_peak", summary.live_peak_bytes),
        ("allocator_peak_allocated", result.peak_allocated_bytes),
        ("allocator_peak_reserved", result.peak_reserved_bytes),
    )
    trace = summary.trace
    if trace.step_ends and any(e.action == "alloc" for e in trace.events[trace.step_ends[-1]:]):
        # a script's run went on past its training steps (the epoch's end: evaluation, sampling):
        # the steps' own live peak, beside the whole run's, for what describes the training alone
        at = [k for k, _ in breakdown].index("live_tensor_peak") + 1
        breakdown = breakdown[:at] + (("live_tensor_peak_steps", trace.live_peak_bytes(trace.step_ends[-1])),) + breakdown[at:]
    placement = 0
    if summary.uses_cudnn:
        breakdown += (("cudnn_workspace_max", cudnn_ws_max),)
        placement = _engines_bound(done.full, profile, config, fixed)
        if placement:
            breakdown += (("cudnn_engines_bound_peak", placement),)
    if cudnn_find_max is not None:
        breakdown += (("cudnn_benchmark_workspace_max", cudnn_find_max),)
    peak = fixed + result.peak_reserved_bytes
    # The capacity search decides the peak only where the uncapped replay is above the GPU and the
    # live tensors are not (the job may run by flushing the cache): elsewhere it is searched when
    # asked for (record.MemoryEstimate.required_bytes). A script that caught out-of-memory has the
    # failed attempts' tensors among the live ones: its need is the settled run's, searched.
    if peak > profile.usable_bytes and (caught or profile.usable_bytes >= fixed + live_need(events, config)):
        peak = _peak_on(profile, peak, fixed + need_of())
    return MemoryEstimate(
        gpu=profile.key,
        capacity_bytes=profile.usable_bytes,
        required=lambda: fixed + need_of(),
        peak_bytes=peak,
        breakdown=breakdown,
        floor=profile.floor,
        placement_bytes=placement,
    )


def _engines_bound(full_events, profile: DeviceProfile, config, fixed: int) -> int:
    """Where the cuDNN asked is not the job's (cudnn_ws.heuristics_are_the_jobs), the peak with each
    convolution's workspace at the largest over the engines cuDNN may pick for it (heuristics mode
    A and the fallback list: cudnn_ws.find_workspace_bytes); 0 where it is the job's. Placement
    takes the larger of this and the first plan's peak (placement.estimate_need): the caching
    allocator's peak is not monotone in the request sizes (larger workspaces can fragment less), so
    neither alone bounds the other, and a mix of engines is bounded only approximately."""
    from . import cudnn_ws

    ok, _ = cudnn_ws.heuristics_are_the_jobs()
    if ok:
        return 0
    events = full_events()   # the run's events (replaycache.Replayed.full)
    bounded = [replace(e, size_bytes=max(e.size_bytes, cudnn_ws.workspace_for(profile, e.detail, benchmark=True)))
               if _cudnn_question(e) is False else e for e in events]
    return fixed + replay(bounded, config).peak_reserved_bytes


def gpu_class(profile: DeviceProfile) -> bool:
    """The profile's GPU class (profiles.capability_class): GPU types of one class share a trace."""
    return capability_class(profile.capability)


def shared_trace(made: Iterable, profile: DeviceProfile) -> TraceSummary | None:
    """A trace already made (of another GPU class) that holds on ``profile`` (trace.holds_on)."""
    from .trace import holds_on

    return next((s for s in made if isinstance(s, TraceSummary) and holds_on(s.trace, profile.capability)), None)


@contextlib.contextmanager
def traced_ahead(spec: WorkloadSpec, profiles: Iterable[DeviceProfile], cache: bool = False):
    """For the duration: the traces of ``spec`` on the first GPU type of every GPU class of
    ``profiles`` but the first, made in forked children (ahead.py) where they are not in the trace
    cache; trace_for takes them, and those not taken (a class that took another's trace) are stopped
    at the end."""
    from . import ahead, tracecache

    started = []
    if not spec.model.startswith("script:"):   # a training script runs in its own child (dynamic/runner.py)
        firsts: dict[bool, DeviceProfile] = {}
        for p in profiles:
            firsts.setdefault(gpu_class(p), p)
        for p in list(firsts.values())[1:]:
            if cache and tracecache.stored(tracecache.key(spec, p.capability, p.total_bytes)):
                continue
            if ahead.start((spec, p.key, cache), trace_for, spec, p, cache):
                started.append((spec, p.key, cache))
    try:
        yield
    finally:
        ahead.cancel(lambda k: k in started)


def trace_classes(spec: WorkloadSpec, profiles: Iterable[DeviceProfile],
                  cache: bool = False) -> dict[bool, TraceSummary | EstimateError]:
    """One trace per GPU class of ``profiles``, or the EstimateError of a class whose trace failed
    (a model that refuses GPUs before sm80). Bad input (WorkloadError) is raised. A class whose
    GPUs answer every GPU-dependent question a trace of another class asked alike (trace.holds_on:
    none asked, as for a CNN in fp32 or fp16) takes that trace: it is the trace it would make.
    The other classes are traced beside the first one where there are cores (traced_ahead)."""
    profiles = list(profiles)
    out: dict[bool, TraceSummary | EstimateError] = {}
    with traced_ahead(spec, profiles, cache):
        for p in profiles:
            if gpu_class(p) not in out:
                same = shared_trace(out.values(), p)
                if same is not None:
                    out[gpu_class(p)] = same
                    continue
                try:
                    out[gpu_class(p)] = trace_for(spec, p, cache)
                except EstimateError as e:
                    out[gpu_class(p)] = e
    return out


def ask_cudnn_ahead(pairs: Iterable[tuple[TraceSummary, DeviceProfile]]) -> int:
    """Answer in parallel the cuDNN questions that estimating each (trace, GPU type) will ask
    (_events_for, and _engines_bound where the cuDNN asked is not the job's): cudnn_ws.ask_ahead.
    Returns how many were answered ahead."""
    from . import cudnn_ws

    pairs = [(summary, profile) for summary, profile in pairs if summary.uses_cudnn]
    if not pairs:
        return 0
    bound = not cudnn_ws.heuristics_are_the_jobs()[0]
    keys: dict[int, set[tuple[str, bool]]] = {}   # per trace: (convolution, benchmark)
    questions = []
    for summary, profile in pairs:
        if id(summary) not in keys:
            ks = keys[id(summary)] = set()
            for e in summary.trace.events:
                if (benchmark := _cudnn_question(e)) is not None:
                    ks.add((e.detail, benchmark))
                    if bound and not benchmark:
                        ks.add((e.detail, True))
        questions += [(profile, k, benchmark) for k, benchmark in keys[id(summary)]]
    return cudnn_ws.ask_ahead(questions)


def estimates_for(spec: WorkloadSpec, summaries: Mapping[bool, TraceSummary | EstimateError],
                  targets: Mapping[str, DeviceProfile]) -> tuple[list[MemoryEstimate], dict[str, EstimateError]]:
    """(an estimate per target whose GPU class traced, labelled with the target's name; {name:
    EstimateError} for the others)."""
    from . import oneshot, progress

    progress.step(f"allocator replay on {len(targets)} GPU type(s)")
    oneshot.settle()   # the traces, kept to the end: out of the collector's scans during the replays
    ask_cudnn_ahead((summaries[gpu_class(p)], p) for p in targets.values()
                    if isinstance(summaries[gpu_class(p)], TraceSummary))
    estimates, failed = [], {}
    for name, p in targets.items():
        summary = summaries[gpu_class(p)]
        if isinstance(summary, EstimateError):
            failed[name] = summary
        else:
            estimates.append(replace(estimate_from_trace(summary, spec, p), gpu=name))
    return estimates, failed


def estimate(spec: WorkloadSpec, profiles: Sequence[DeviceProfile], cache: bool = False) -> list[MemoryEstimate]:
    """One MemoryEstimate per profile, the trace shared within a GPU class; raises the first
    EstimateError (estimates_for reports a class that does not trace and goes on)."""
    traces: dict[bool, TraceSummary] = {}
    out = []
    for p in profiles:
        if gpu_class(p) not in traces:
            traces[gpu_class(p)] = trace_for(spec, p, cache)
        out.append(estimate_from_trace(traces[gpu_class(p)], spec, p))
    return out
