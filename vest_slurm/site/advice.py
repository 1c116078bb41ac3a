"""What would fit: the largest batch, AMP, checkpointing, an 8-bit optimizer, more GPUs; and the
estimates of one workload's variants.

``Prober`` estimates a workload and its variants (other batch sizes, precisions, GPU counts) on the
site's GPU types. Each trace is made once and shared:

- by every GPU type of the same capability class (the estimator's rule: what a trace can depend on
  is flash attention / native bf16, sm80+), and
- by every GPU count: the trace is per GPU (``num_gpus``, ``parallelism`` and ``alloc_conf`` only
  change the replay: DDP buckets, NCCL, allocator settings), so "4 GPUs at batch 32 per GPU" reuses
  the trace the batch search made at batch 32;
- by every batch size, once a line holds (estimate/batch_scaling.py): the first two traces of a
  workload at two batches make a line (the same events, sizes affine in the batch); when a third
  batch is asked for, a real trace at the top of the range any search here reaches must equal the
  line's there, and then the line gives every batch between the first and that top without a
  trace. Where it does not, every batch is traced, as before. The example's `vest check` makes 6
  traces instead of 12.

It stops starting new traces past its time budget or trace count; a probe it did not make answers
None and the advice says the search stopped.

``search_largest_batch`` finds the largest batch whose need fits a capacity: two probes (the job's
batch and twice it, or batch 1 where it does not fit) give a line, affine in the batch as training
memory is; where it meets the capacity is the answer, confirmed by a probe there (fits) and one a
resolution step above (does not fit). Where a confirmation disagrees, one more line through the
two batches nearest the boundary, then ``bisection_search`` (the search before: exponential steps
up, then interpolation with a bisection fallback) finishes from what is known. The first two probes are shared by every GPU type of a capability class; a floor
(parameters, gradients and optimizer state, which no batch shrinks; Prober.floor_needed) above the
capacity answers "none" with no probe at all, and so does it for a variant whose floor is (another
optimizer, checkpointing, more GPUs data parallel).

``advise`` turns a placement refusal (``placement.NoFit``) into what would fit: the largest batch on
the largest GPU; AMP (bf16 on sm80+, fp16 before); activation checkpointing (transformers and timm
models, through their own switch); an 8-bit Adam/AdamW state (bitsandbytes, where it is installed);
more GPUs (data parallel, the per-GPU batch divided so the global batch stays); sharded (FSDP2, with
checkpointing where the model has the switch, ZeRO-3 with the optimizer offloaded), per rank.

Known limitations:
- The search assumes the need does not shrink as the batch grows. The allocator's peak can: the
  example MLP (scripts/examples/mlp-too-big-for-v100.sbatch) on the testbed's A100 fits at batch
  41,894 and 50,000-52,312 but not at 42,548-46,000 (its cached blocks fragment there, the peak
  reserved 2-4 GiB above what is required). A search then answers one boundary where the need
  crosses the capacity (the answer fits, a resolution step above does not), not necessarily the
  largest batch that fits: this one 41,894, the bisection before it 52,312.
- Data-parallel advice replicates the model on each GPU (DDP): it never helps a job whose
  parameters, gradients and optimizer state alone exceed the GPU; the sharded alternatives
  (sharded_alternatives, per rank) are the advice for those.
"""

from __future__ import annotations

import importlib.util
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Collection, Iterable, Mapping, Sequence

from ..errors import EstimateError, VestError
from ..estimate.record import MemoryEstimate
from ..estimate.estimator import gpu_class
from .placement import NoFit, estimate_need, needed_bytes
from ..estimate.profiles import DeviceProfile, get_profile
from .config import SiteConfig
from ..units import MiB, fmt_mib
from ..estimate.workload import OPTIMIZER_TABLE, SHARDED, WorkloadSpec

SCRIPT_PREFIX = "script:"   # WorkloadSpec.model of a training script estimated by dynamic analysis
MAX_BATCH = 1 << 16          # the search never proposes a larger per-GPU batch
ADVICE_BUDGET_S = 20.0       # vsbatch: the user waits for the refusal; advice stops starting traces after this
ADVICE_MAX_TRACES = 16
AFFINE_ROUNDS = 2            # lines tried (two probes each) before the search falls back to bisection


# ---------------------------------------------------------------- site GPU types as profiles

def site_profiles(site: SiteConfig) -> dict[str, DeviceProfile]:
    """{gres type: device profile}, with the site's ``memory_mib`` as the usable capacity."""
    out = {}
    for g in site.gpus:
        p = get_profile(g.profile)
        if g.memory_bytes is not None:
            # memory_mib is what a process can use: no further driver reservation on top.
            p = replace(p, total_mib=g.memory_bytes // MiB, reserved_mib=0)
        out[g.name] = p.with_overrides(context_mib=g.context_mib, cudnn_mib=g.cudnn_mib, nvswitch=g.nvswitch)   # `vest calibrate`
    return out


def _trace_key(spec: WorkloadSpec) -> WorkloadSpec:
    # What the trace does not depend on (estimator.py: DDP buckets, NCCL, alloc conf are replay-side).
    # A sharded job's per-rank trace depends on its GPU count and strategy (sharding.py; the unsharded
    # model it is made from is traced once per process, sharded_trace.unit_trace).
    if spec.parallelism in SHARDED:
        return replace(spec, alloc_conf="")
    return replace(spec, num_gpus=1, parallelism="ddp", alloc_conf="")


def _floor_key(spec: WorkloadSpec) -> WorkloadSpec:
    # What parameters, gradients and optimizer state do not depend on: the batch, the GPU count
    # (data parallel), activation checkpointing, where zero_grad runs, the allocator settings; and
    # the optimizer, whose state a sibling's gradients bound (Prober.floor_needed).
    return replace(spec, batch_size=1, num_gpus=1, parallelism="ddp", alloc_conf="", gradient_checkpointing="off",
                   zero_grad="after-step", grad_accum=1, pre_forward="none", optimizer="adam",
                   optimizer_impl="auto", weight_decay=None)


class Prober:
    """Estimates of a workload and its variants on the site's GPU types, traces shared and cached."""

    def __init__(self, profiles: Mapping[str, DeviceProfile], headroom_percent: float = 0.0,
                 headroom_bytes: int = 0, budget_s: float | None = None, max_traces: int | None = None,
                 clock: Callable[[], float] = time.monotonic, cache: bool = False, scale_batches: bool = True):
        self.profiles = dict(profiles)
        self.scale_batches = scale_batches   # a batch's trace from a confirmed line through two others
        self.cache = cache   # read and keep traces in the trace cache (tracecache.py)
        self.headroom_percent = headroom_percent
        self.headroom_bytes = headroom_bytes
        self.budget_s = budget_s
        self.max_traces = max_traces
        self._clock = clock
        self._start = clock()
        self._traces: dict = {}        # (trace key, class) -> TraceSummary | EstimateError
        self._estimates: dict = {}     # (spec, gres type) -> MemoryEstimate
        self.traces_made = 0
        self.traces_scaled = 0         # traces given by a confirmed batch_scaling.BatchLine, not traced
        self._lines: dict = {}         # (trace key at batch 1, class) -> BatchLine, or why there is none
        self.trace_seconds = 0.0
        self.stopped = False           # a probe was refused for the budget
        self.floored: set = set()      # (spec, gres type) answered by floor_needed, not traced

    @classmethod
    def for_site(cls, site: SiteConfig, **kw) -> "Prober":
        return cls(site_profiles(site), site.policy.headroom_percent, site.policy.headroom_bytes, **kw)

    def restart_budget(self, budget_s: float | None, max_traces: int | None = None) -> None:
        """Give the next searches a fresh budget (the first estimate is not advice)."""
        self._start, self.budget_s = self._clock(), budget_s
        self.max_traces = None if max_traces is None else self.traces_made + max_traces
        self.stopped = False

    def capacity(self, gres_type: str) -> int:
        return self.profiles[gres_type].usable_bytes

    # ---- independent searches beside one another
    #
    # Searches that share no trace (the sharded alternatives built from different unsharded
    # traces; vest check's batch searches on GPU types that do not share the job's trace) are
    # independent: each gives what it would give after the others. Where there are
    # cores (estimate/ahead.py: the same gate and fork as the traces of other GPU classes), each
    # group but the first runs in a forked child from this prober's state, and its answers and
    # counts come back; a child that gives no answer leaves its group to this process. Not where
    # the budget counts traces (vsbatch's advice): the groups would share that count.

    _COUNTS = ("traces_made", "traces_scaled", "trace_seconds")

    def in_groups(self, items: Sequence, run: Callable, group_of: Callable) -> list:
        """[run(item) for item in items], the items grouped by ``group_of(item)`` (in order within a
        group), the groups after the first beside this process where ahead.enabled()."""
        from ..estimate import ahead

        groups: dict = {}
        for i, item in enumerate(items):
            groups.setdefault(group_of(item), []).append(i)
        order = list(groups.values())

        def child(idx):
            before = [getattr(self, c) for c in self._COUNTS]
            answers = [run(items[i]) for i in idx]
            return answers, [getattr(self, c) - b for c, b in zip(self._COUNTS, before)], self.stopped, self.floored

        started = {}
        if self.max_traces is None:
            for g, idx in enumerate(order[1:], 1):
                key = ("in_groups", id(self), tuple(idx))
                if ahead.start(key, child, idx):
                    started[g] = key
        out: list = [None] * len(items)
        try:
            for g, idx in enumerate(order):
                ok, got = ahead.take(started[g]) if g in started else (False, None)
                if ok and isinstance(got, tuple):
                    answers, deltas, stopped, floored = got
                    for c, d in zip(self._COUNTS, deltas):
                        setattr(self, c, getattr(self, c) + d)
                    self.stopped = self.stopped or stopped
                    self.floored |= floored
                else:
                    answers = [run(items[i]) for i in idx]
                for i, answer in zip(idx, answers):
                    out[i] = answer
        finally:
            ahead.cancel(lambda k: k in started.values())
        return out

    def _over_budget(self) -> bool:
        if self.budget_s is not None and self._clock() - self._start >= self.budget_s:
            return True
        return self.max_traces is not None and self.traces_made >= self.max_traces

    def add_script_traces(self, spec: WorkloadSpec, summaries: Mapping[bool, object]) -> None:
        """Traces of a training script (dynamic analysis), per capability class. The script fixes
        its own batch and precision: variants of it cannot be traced, so advice about them is not
        offered (probes of variants answer None)."""
        for cls, summary in summaries.items():
            self._traces[(_trace_key(spec), cls)] = summary

    def _trace(self, spec: WorkloadSpec, profile: DeviceProfile, bounded: bool):
        from ..estimate.estimator import trace_for   # torch is imported only when a trace is made

        key = (_trace_key(spec), gpu_class(profile))
        if key not in self._traces and spec.model.startswith(SCRIPT_PREFIX):
            if bounded:
                self.stopped = True
                return None
            raise EstimateError(f"{spec.model[len(SCRIPT_PREFIX):].strip()} was not run for this GPU class",
                                "add #VEST --model ... lines to describe the workload")
        if key not in self._traces:
            from ..estimate.estimator import shared_trace

            # the other class's trace where it holds here (trace.holds_on): the trace this one makes
            other = shared_trace((v for (k, _), v in self._traces.items() if k == key[0]), profile)
            if other is not None:
                self._traces[key] = other
        if key not in self._traces:
            scaled = self._scaled(key, profile, bounded)   # a line's: no trace (but its one check)
            if scaled is not None:
                self._traces[key] = scaled
                self.traces_scaled += 1
                return scaled
            if bounded and self._over_budget():
                self.stopped = True
                return None
            t0 = time.perf_counter()
            try:
                self._traces[key] = trace_for(key[0], profile, self.cache)
            except VestError as e:   # EstimateError; WorkloadError for a variant the model refuses
                self._traces[key] = e
            finally:
                self.traces_made += 1
                self.trace_seconds += time.perf_counter() - t0
            self._confirm(key)
        return self._traces[key]

    # ---- batch sizes from a line (estimate/batch_scaling.py)
    #
    # The first two real traces of a workload at two batch sizes (on one GPU class) make a BatchLine,
    # with its top: the largest batch any search here can probe (where the live tensors alone, which
    # the need never goes below, fill the largest GPU of the site, a resolution step above). The first
    # time a batch between the two and the top is asked for, the top is traced for real and compared
    # with the line's trace there, event for event: equal, the line gives that batch and every later
    # one in its range (no trace); not equal, or no line through the first two, every batch is traced
    # as before. So a line's trace is used only where the tracer made the same run, sizes on the
    # line, at both ends of the range and at a batch inside it; and a search that needs no third
    # batch makes no third trace.

    @staticmethod
    def _line_key(key):
        spec, cls = key
        return (replace(spec, batch_size=1), cls)

    def _real(self, key) -> dict:
        """{batch: TraceSummary} of the real traces made of this workload on this class."""
        from ..estimate.estimator import TraceSummary

        lk = self._line_key(key)
        return {k[0].batch_size: v for k, v in self._traces.items()
                if isinstance(v, TraceSummary) and not v.scaled and self._line_key(k) == lk}

    def _scaled(self, key, profile: DeviceProfile, bounded: bool):
        """The trace at key's batch from the workload's line (checked at its top first), else None."""
        from ..estimate.batch_scaling import SCALED_NOTE, BatchLine, NotAffine
        from ..estimate.estimator import summarize

        lk = self._line_key(key)
        line = self._lines.get(lk)
        b = key[0].batch_size
        if not isinstance(line, BatchLine) or not line.b0 <= b <= line.top or b in (line.b0, line.b1):
            return None
        if not line.confirmed:
            if b == line.top or (bounded and self._over_budget()):
                return None   # traced as asked (at the top, that trace is the check)
            self._trace(replace(key[0], batch_size=line.top), profile, bounded)   # the check: _confirm
            line = self._lines.get(lk)
            if not getattr(line, "confirmed", False):
                return None
        try:
            trace = line.at(b)
        except NotAffine:
            return None
        trace = replace(trace, notes=tuple(trace.notes) + (SCALED_NOTE,))
        return replace(summarize(trace, 0.0), scaled=True)

    def _top(self, lo, b0: int, hi, b1: int) -> int | None:
        """The largest batch a search here can probe: where the live-tensor peak, affine in the batch,
        reaches the largest GPU's capacity, a resolution step above. None where it does not grow."""
        slope = (hi.live_peak_bytes - lo.live_peak_bytes) / (b1 - b0)
        if slope <= 0:
            return None
        cap = max(p.usable_bytes for p in self.profiles.values())
        top = b0 + max(0, math.ceil((cap - lo.live_peak_bytes) / slope))
        return min(max(top + resolution(top), b1 + 1), MAX_BATCH)

    def _confirm(self, key) -> None:
        """After a real trace: the line through the first two, or its check by the trace at its top."""
        if not self.scale_batches or key[0].model.startswith(SCRIPT_PREFIX):
            return
        from ..estimate.batch_scaling import BatchLine, NotAffine, first_difference, same

        lk = self._line_key(key)
        line = self._lines.get(lk)
        real = self._real(key)
        if line is None and len(real) >= 2:
            (b0, s0), (b1, s1) = sorted(real.items())[:2]
            try:
                line = BatchLine(s0.trace, b0, s1.trace, b1)
            except NotAffine as e:
                self._lines[lk] = f"no line through batches {b0} and {b1}: {e}"
                return
            top = self._top(s0, b0, s1, b1)
            if top is None:
                self._lines[lk] = f"no line through batches {b0} and {b1}: the live tensors do not grow"
                return
            line.top = top
            self._lines[lk] = line
        if not isinstance(line, BatchLine) or line.confirmed or line.top not in real:
            return
        top = real[line.top].trace
        try:
            made = line.at(line.top)
            ok = same(made, top)
            why = "" if ok else first_difference(made, top)
        except NotAffine as e:
            ok, why = False, str(e)
        if ok:
            line.confirmed = True
        else:
            self._lines[lk] = f"the line through batches {line.b0} and {line.b1} missed batch {line.top}: {why}"

    def estimate(self, spec: WorkloadSpec, gres_type: str, bounded: bool = True) -> MemoryEstimate | None:
        """The estimate of ``spec`` on ``gres_type``; None when the budget stopped it (bounded) or
        the variant cannot be traced (e.g. batch 1 with BatchNorm1d). Unbounded: raises EstimateError."""
        k = (spec, gres_type)
        if k in self._estimates:
            return self._estimates[k]
        from ..estimate.estimator import ask_cudnn_ahead, estimate_from_trace

        profile = self.profiles[gres_type]
        summary = self._trace(spec, profile, bounded)
        if summary is None:
            return None
        if isinstance(summary, VestError):
            if bounded:
                return None
            raise summary
        ask_cudnn_ahead([(summary, profile)])
        est = estimate_from_trace(summary, spec, profile)
        self._estimates[k] = est
        return est

    def slow_types(self, spec: WorkloadSpec) -> dict[str, str]:
        """{GPU type: why} where ``spec`` runs much slower: its trace for that type's class computes
        in bfloat16, emulated before sm80 (report.slow_types). Only traces already made count."""
        from ..estimate.report import slow_types

        return slow_types(self.profiles, lambda p: self._traces.get((_trace_key(spec), gpu_class(p))))

    def slow_untraced(self, spec: WorkloadSpec, gres_type: str) -> bool:
        """Whether ``spec`` runs much slower on ``gres_type`` (bf16 emulated there), known before its
        class is traced: a declarative job whose precision computes in bfloat16 (autocast to it, or
        bf16 weights: the same ops cast on every GPU), traced on another class computing in bf16,
        where every bf16-support question that run asked is answered alike here (a model that picks
        its dtype by the GPU asks one; trace.gpu_asked records it; autocast itself asks whether bf16
        runs with emulation, which every GPU answers yes)."""
        from ..estimate.estimator import TraceSummary
        from ..estimate.report import emulated_bf16
        from ..estimate.trace import gpu_answer

        profile = self.profiles[gres_type]
        if spec.model.startswith(SCRIPT_PREFIX) or not spec.computes_bf16:
            return False
        if not emulated_bf16(profile):
            return False
        k = _trace_key(spec)
        return any(isinstance(v, TraceSummary) and v.computes_bf16 and v.trace.gpu_asked is not None
                   and all(gpu_answer(q, arg, profile.capability) == answer
                           for q, arg, answer in v.trace.gpu_asked if q == "bf16_supported")
                   for (key, _), v in self._traces.items() if key == k)

    def summary(self, spec: WorkloadSpec, profile: DeviceProfile):
        """The trace made for ``spec`` on ``profile``'s class (TraceSummary, the error, or None)."""
        return self._traces.get((_trace_key(spec), gpu_class(profile)))

    def estimates(self, spec: WorkloadSpec, types: Iterable[str] | None = None
                  ) -> tuple[dict[str, MemoryEstimate], dict[str, EstimateError]]:
        """The job's own estimate on every GPU type (or ``types``), unbounded: (estimates, errors).
        A workload can fail on one class only (a script that needs sm80+); the caller decides."""
        from ..estimate.estimator import TraceSummary, ask_cudnn_ahead, traced_ahead

        types = list(types or self.profiles)
        pairs = []
        # the other GPU classes traced beside the first, where there are cores
        key = _trace_key(spec)
        with traced_ahead(key, [self.profiles[t] for t in types
                                if (key, gpu_class(self.profiles[t])) not in self._traces], self.cache):
            for t in types:   # the traces first, then cuDNN's questions of all of them at once, in parallel
                if (spec, t) not in self._estimates:
                    try:
                        summary = self._trace(spec, self.profiles[t], bounded=False)
                    except EstimateError:
                        continue   # estimate() raises it again below
                    if isinstance(summary, TraceSummary):
                        pairs.append((summary, self.profiles[t]))
        ask_cudnn_ahead(pairs)
        ok, failed = {}, {}
        for t in types:
            try:
                ok[t] = self.estimate(spec, t, bounded=False)
            except EstimateError as e:
                failed[t] = e
        return ok, failed

    def floor_needed(self, spec: WorkloadSpec, gres_type: str) -> int | None:
        """A need no batch size, GPU count (data parallel), activation checkpointing or optimizer
        of ``spec`` goes below on ``gres_type``, with the site's headroom, from an estimate already
        made of a sibling (the same model and precision): what lives outside the allocator (CUDA
        context, cuDNN) plus the parameters, gradients and optimizer state, which are all alive at
        every optimizer step after the first (the step reads every gradient and updates every state
        in place; DDP keeps a full copy of each per GPU) and which none of those changes shrinks.
        With another optimizer, its state is bounded below from the sibling's gradients (one per
        trainable element, in the parameter's dtype): ``states`` per element in that dtype
        (workload.OPTIMIZER_TABLE; torch's optimizers keep ``zeros_like(param)``, bitsandbytes'
        8-bit ones two uint8 per element, 0.5 of a float32 and more than that of a half dtype).
        A job sharded by FSDP (fsdp2, fsdp, hsdp; nothing offloaded) keeps a shard of each on every
        rank, at least their sum over the ranks that shard them (sharding.strategy_world; the
        largest rank's padded shard is not smaller). None where no sibling was estimated, or where
        the job shards otherwise (DeepSpeed's own layouts, CPU offload)."""
        share = 1
        if spec.num_gpus > 1 and spec.parallelism not in ("ddp", "dp"):
            if spec.parallelism not in ("fsdp", "fsdp2", "hsdp") or spec.offload != "none":
                return None
            from ..estimate.sharding import strategy_world

            share = strategy_world(spec)
        key = _floor_key(spec)
        best = None
        for (s, t), est in self._estimates.items():
            if t != gres_type or _floor_key(s) != key or (s.num_gpus > 1 and s.parallelism not in ("ddp", "dp")):
                continue
            parts = dict(est.breakdown)
            grads = parts.get("gradients", 0)
            if s.optimizer == spec.optimizer or spec.optimizer not in OPTIMIZER_TABLE:
                state = parts.get("optimizer_state", 0)
            else:
                state = int(OPTIMIZER_TABLE[spec.optimizer][2] * grads)
            floor = (parts.get("cuda_context", 0) + parts.get("cudnn", 0)
                     + (parts.get("parameters", 0) + grads + state) // share)
            best = floor if best is None else max(best, floor)
        return None if best is None else needed_bytes(best, self.headroom_percent, self.headroom_bytes)

    def is_floor(self, spec: WorkloadSpec, gres_type: str) -> bool:
        return (spec, gres_type) in self.floored

    def needed(self, spec: WorkloadSpec, gres_type: str, fits_only: bool = False) -> int | None:
        """Per-GPU need with the site's headroom (placement's rule), or None (budget / untraceable).
        Where a sibling's floor (floor_needed) is already above the GPU, that floor, with no trace
        (``is_floor`` says so: the need is at least that). ``fits_only``: the caller asks only
        whether it fits (a GPU count below the one the sharded advice proposes); where the trace's
        bound without the allocator's replay (estimator.need_at_least), or the one from its uncapped
        replay without the capacity search (estimator.peak_at_least), is above the GPU, that bound
        (``is_floor`` says so too)."""
        if (spec, gres_type) not in self._estimates:
            floor = self.floor_needed(spec, gres_type)
            if floor is not None and floor > self.capacity(gres_type):
                self.floored.add((spec, gres_type))
                return floor
            if fits_only:
                from ..estimate.estimator import TraceSummary, need_at_least, peak_at_least

                profile = self.profiles[gres_type]
                summary = self._trace(spec, profile, True)
                if isinstance(summary, TraceSummary):
                    for bound in (need_at_least, peak_at_least):   # the cheaper first
                        low = needed_bytes(bound(summary, spec, profile), self.headroom_percent, self.headroom_bytes)
                        if low > self.capacity(gres_type):
                            self.floored.add((spec, gres_type))
                            return low
        est = self.estimate(spec, gres_type)
        if est is None:
            return None
        return needed_bytes(estimate_need(est), self.headroom_percent, self.headroom_bytes)


# ---------------------------------------------------------------- the batch search

@dataclass(frozen=True)
class BatchSearch:
    """``batch``: the largest batch known to fit (None: not even batch 1, or nothing probed fits).
    ``exact``: batch + resolution(batch) is known not to fit, or batch is ``max_batch``. ``complete``: the search
    ran to its end (not stopped by the budget)."""

    batch: int | None
    exact: bool
    complete: bool
    needed_bytes: int | None
    probes: tuple[int, ...]
    capped: bool = False
    method: str = "bisection"   # affine (the line held), bisection (the fallback), floor (nothing can fit)

    def text(self) -> str:
        if self.batch is None:
            return "none" if self.complete else "?"
        if self.capped:
            return f">={self.batch}"
        return str(self.batch) if self.exact else f">={self.batch}"


def resolution(batch: int) -> int:
    """How close the search gets: exact up to batch 64, then within 1/64 (1.6 %) of the largest
    batch that fits, never above it. Finer than the estimate's own error, and it saves the last
    six or so estimates of a plain binary search."""
    return max(1, batch // 64)


def search_largest_batch(need: Callable[[int], int | None], capacity_bytes: int, start: int,
                         max_batch: int = MAX_BATCH, known: Mapping[int, int] | None = None,
                         floor_bytes: int | None = None) -> BatchSearch:
    """The largest batch b in [1, max_batch] with need(b) <= capacity_bytes, to ``resolution(b)``:
    the answer always fits, and a batch ``resolution`` larger is known not to.

    ``need(b)`` gives the per-GPU need at batch b, or None when it cannot be had (budget); ``known``
    holds needs already measured. ``start`` is where the search begins (the job's own batch).
    ``floor_bytes``: a need no batch goes below (the parameters and optimizer state with what lives
    outside the allocator, Prober.floor_needed); above the capacity, nothing fits and nothing is probed.

    Training memory is affine in the batch between the allocator's rounding steps (every activation,
    gradient of an activation and temporary has the batch as a factor; parameters, gradients,
    optimizer state and workspaces do not). So: the need at ``start`` and at a second batch (twice
    ``start`` where it fits, batch 1 where it does not) gives a line, and where the line meets the
    capacity is the answer; one probe at the answer (it must fit) and one a resolution step above
    (it must not) confirm it (or, where the answer does not fit, one a step below must). Where a
    confirmation disagrees (a rounding step of the allocator, a cuDNN workspace that changes with the
    batch), the line through the two batches now nearest the boundary is tried once more; only
    then does the search fall back to ``bisection_search`` over what is known, so a wrong line
    costs probes, never a wrong answer. Four probes where the line holds (two of them shared by
    every GPU type of a capability class).
    """
    seen: dict[int, int] = dict(known or {})
    probes: list[int] = []
    start = max(1, min(start, max_batch))

    def probe(b: int) -> int | None:
        if b not in seen:
            v = need(b)
            if v is None:
                return None
            seen[b] = v
            probes.append(b)
        return seen[b]

    def done(batch: int | None, exact: bool, complete: bool, method: str, capped: bool = False) -> BatchSearch:
        return BatchSearch(batch, exact, complete, seen.get(batch) if batch else None, tuple(probes), capped, method)

    if floor_bytes is not None and floor_bytes > capacity_bytes:
        return done(None, True, True, "floor")
    n0 = probe(start)
    if n0 is None:
        return done(None, False, False, "affine")
    if n0 <= capacity_bytes and start >= max_batch:
        return done(start, True, True, "affine", capped=True)
    b1 = min(start * 2, max_batch) if n0 <= capacity_bytes else 1
    n1 = probe(b1) if b1 != start else n0
    if n1 is None:
        return done(start if n0 <= capacity_bytes else None, False, False, "affine")
    if n0 > capacity_bytes and n1 > capacity_bytes and b1 == 1:
        return done(None, True, True, "affine")   # not even batch 1

    def bracket() -> tuple[int, int | None]:
        lo = max((b for b, v in seen.items() if v <= capacity_bytes), default=0)
        return lo, min((b for b, v in seen.items() if v > capacity_bytes and b > lo), default=None)

    for _ in range(AFFINE_ROUNDS):
        lo, hi = bracket()
        if hi is not None and hi - lo <= resolution(lo):
            return done(lo, True, True, "affine")
        # The line through the two known batches nearest the boundary: the bracket's ends where
        # there is one, else the two largest that fit (extrapolating up).
        if lo and hi is not None:
            (ba, na), (bb, nb) = (lo, seen[lo]), (hi, seen[hi])
        else:
            pts = sorted(seen)[-2:] if hi is None else sorted(b for b in seen if b <= hi)[:2]
            if len(pts) < 2:
                break
            (ba, na), (bb, nb) = [(b, seen[b]) for b in pts]
        if nb <= na:
            break   # flat: no line to follow
        predicted = ba + (capacity_bytes - na) * (bb - ba) // (nb - na)
        guess = min(max(predicted, lo, 1), max_batch if hi is None else hi - 1)
        ng = probe(guess)
        if ng is None:
            return done(bracket()[0] or None, False, False, "affine")
        if ng <= capacity_bytes:
            if guess >= max_batch:
                return done(guess, True, True, "affine", capped=True)
            other = min(guess + resolution(guess), max_batch)   # must not fit
        else:
            other = max(guess - resolution(guess), lo + 1, 1)   # must fit
            while other + resolution(other) < guess:
                other += 1
        if other != guess and probe(other) is None:
            return done(bracket()[0] or None, False, False, "affine")
        if other == max_batch and seen[other] <= capacity_bytes:
            return done(other, True, True, "affine", capped=True)
    lo, hi = bracket()
    if hi is not None and hi - lo <= resolution(lo):
        return done(lo, True, True, "affine")
    # The line did not hold here: bisection over the bracket the probes made.
    fit_known = max((b for b, v in seen.items() if v <= capacity_bytes), default=0)
    rest = bisection_search(need, capacity_bytes, fit_known or min(seen), max_batch, known=seen)
    return replace(rest, probes=tuple(probes) + rest.probes, method="bisection")


def bisection_search(need: Callable[[int], int | None], capacity_bytes: int, start: int,
                         max_batch: int = MAX_BATCH, known: Mapping[int, int] | None = None) -> BatchSearch:
    """The search before issue 27, and the new one's fallback: the largest batch b in [1, max_batch]
    with need(b) <= capacity_bytes, to ``resolution(b)``:
    the answer always fits, and a batch ``resolution`` larger is known not to.

    ``need(b)`` gives the per-GPU need at batch b, or None when it cannot be had (budget); ``known``
    holds needs already measured. ``start`` is where the search begins (the job's own batch).
    """
    seen: dict[int, int] = dict(known or {})
    probes: list[int] = []
    stopped = False

    def probe(b: int) -> int | None:
        nonlocal stopped
        if b not in seen:
            v = need(b)
            if v is None:
                stopped = True
                return None
            seen[b] = v
            probes.append(b)
        return seen[b]

    def fits(b: int) -> bool | None:
        v = probe(b)
        return None if v is None else v <= capacity_bytes

    def bracket() -> tuple[int, int | None]:
        ok = [b for b, v in seen.items() if v <= capacity_bytes]
        bad = [b for b, v in seen.items() if v > capacity_bytes]
        lo = max(ok, default=0)
        hi = min((b for b in bad if b > lo), default=None)
        return lo, hi

    def result(complete: bool) -> BatchSearch:
        lo, hi = bracket()
        capped = lo >= max_batch
        exact = complete and (capped or (hi is not None and hi - lo <= resolution(lo)))
        return BatchSearch(lo or None, exact, complete and not stopped, seen.get(lo), tuple(probes), capped)

    start = max(1, min(start, max_batch))
    if fits(start) is None:
        return result(False)
    lo, hi = bracket()
    if lo == 0:
        # Down: batch 1 says whether anything fits; then the binary search below over [1, start].
        r = fits(1)
        if r is None or r is False:
            return result(r is False)
    else:
        # Up: double, or jump to where the line through the last two fitting batches meets the
        # capacity when that is further, until a batch does not fit or the cap.
        prev = None
        while hi is None and lo < max_batch:
            b = lo * 2
            if prev is not None and seen[lo] > seen[prev]:
                predicted = lo + (capacity_bytes - seen[lo]) * (lo - prev) // (seen[lo] - seen[prev])
                b = max(b, predicted + 1)   # one past the prediction: a failing probe closes the bracket
            if fits(min(b, max_batch)) is None:
                return result(False)
            prev = lo
            lo, hi = bracket()
            if lo == prev:   # the probe did not fit: hi is set
                break
        if hi is None:
            return result(True)
    # Binary search on (lo, hi) down to the resolution. Interpolation rounds first: the interpolated
    # guess and a second batch 1/32 of the bracket beyond it, on the side the first probe points
    # to; with a near-linear need the two straddle the boundary and the bracket shrinks 32-fold in two
    # estimates. A round that does not shrink it 4-fold (a step-shaped need, from the allocator's
    # segment rounding, defeats interpolation) switches to plain bisection for good, so the worst
    # case stays logarithmic.
    interpolate = True
    while True:
        lo, hi = bracket()
        if hi is None or hi - lo <= resolution(lo):
            return result(True)
        width = hi - lo
        if interpolate and seen[hi] > seen[lo]:
            guess = lo + (capacity_bytes - seen[lo]) * width // (seen[hi] - seen[lo])
            guess = min(max(guess, lo + 1), hi - 1)
            r = fits(guess)
            if r is None:
                return result(False)
            step = max(1, width // 32)
            second = guess + step if r else guess - step
            if lo < second < hi and fits(second) is None:
                return result(False)
            lo2, hi2 = bracket()
            interpolate = (hi2 - lo2) * 4 <= width
        elif fits((lo + hi) // 2) is None:
            return result(False)


# ---------------------------------------------------------------- advice

@dataclass(frozen=True)
class Advice:
    """One thing that would fit (or an honest 'this does not help'). ``fits`` False: a negative
    finding. ``change`` is the #VEST / sbatch change in words."""

    kind: str                      # as-is, batch, amp, checkpointing, optimizer, gpus, note
    text: str
    fits: bool
    change: str = ""
    batch_size: int | None = None
    precision: str | None = None
    num_gpus: int | None = None
    gpu_type: str | None = None
    partition: str | None = None
    needed_bytes: int | None = None

    def to_dict(self) -> dict:
        return {"kind": self.kind, "text": self.text, "fits": self.fits, "change": self.change,
                "batch_size": self.batch_size, "precision": self.precision, "num_gpus": self.num_gpus,
                "gpu_type": self.gpu_type, "partition": self.partition,
                "needed_mib": None if self.needed_bytes is None else round(self.needed_bytes / MiB, 1)}


def amp_precision(profile: DeviceProfile) -> str:
    """bf16 autocast where the GPU has it natively (sm80+), fp16 with a GradScaler before (bf16
    runs there too, emulated in fp32 arithmetic: slower, the same memory)."""
    return "amp-bf16" if profile.capability >= (8, 0) else "amp-fp16"


def _partitions_for(site: SiteConfig, gres_type: str, gpus_per_node: int, total_gpus: int) -> list[str]:
    return [p.name for p in site.partitions_with(gres_type)
            if gpus_per_node <= p.gpus_per_node and (p.max_gpus_per_job is None or total_gpus <= p.max_gpus_per_job)]


def _by_size(prober: Prober, types: Iterable[str]) -> list[str]:
    return sorted(types, key=lambda t: (prober.capacity(t), t))


def _fit_order(prober: Prober, site: SiteConfig, slow: Collection[str]) -> list[str]:
    """The order in which advice tries the site's GPU types, as placement chooses: smallest first,
    those where the job runs much slower (``slow``: Prober.slow_types) after all the others."""
    return sorted(site.gpu_names, key=lambda t: (t in slow, prober.capacity(t), t))


def _smallest_fit(prober: Prober, site: SiteConfig, spec: WorkloadSpec, gpus_per_node: int,
                  slow: Collection[str] = (), fits_only: bool = False) -> tuple[str | None, str | None, int | None, bool]:
    """(gpu type, partition, need, complete) of the smallest GPU type where ``spec`` fits (``slow``
    types last). ``fits_only``: where it fits nowhere, the need may be a bound (Prober.needed)."""
    best_need, complete = None, True
    for t in _fit_order(prober, site, slow):
        parts = _partitions_for(site, t, gpus_per_node, spec.num_gpus)
        if not parts:
            continue
        n = prober.needed(spec, t, fits_only)
        if n is None:
            complete = False
            continue
        if n <= prober.capacity(t):
            return t, parts[0], n, complete
        best_need = n if best_need is None else min(best_need, n)
    return None, None, best_need, complete


def _first_fit(prober: Prober, site: SiteConfig, variant_on: Callable[[str], WorkloadSpec], gpus_per_node: int,
               total_gpus: int, big: str, slow: Collection[str] = ()) -> tuple[str | None, str | None, int | None]:
    """A variant of the job (``variant_on(gpu type)``) on the site's GPU types, smallest first
    (``slow`` types last):
    (type, partition, need) of the first it fits; where none does, (type, None, need) on ``big``
    (the largest, or the last type probed if ``big`` could not be); (None, None, None) where
    nothing was probed."""
    tried: list[tuple[str, int]] = []
    for t in _fit_order(prober, site, slow):
        parts = _partitions_for(site, t, gpus_per_node, total_gpus)
        if not parts:
            continue
        n = prober.needed(variant_on(t), t)
        if n is None:
            continue
        if n <= prober.capacity(t):
            return t, parts[0], n
        tried.append((t, n))
    if not tried:
        return None, None, None
    t, n = next(((t, n) for t, n in tried if t == big), tried[-1])
    return t, None, n


def _variant_advice(prober: Prober, site: SiteConfig, spec: WorkloadSpec, gpus_per_node: int, big: str,
                    kind: str, variant_on: Callable[[str], WorkloadSpec], what: Callable[[str], str],
                    change: Callable[[str], str], slow: Collection[str] = (),
                    **fields: Callable[[str], object]) -> Advice | None:
    """Advice for one variant of the job (``variant_on(gpu type)``): the smallest GPU type it fits,
    or that it does not help (its need on the largest); None where nothing could be probed.
    ``what(t)`` names the variant, ``change(t)`` says how to make it, ``fields`` fill Advice's."""
    t, part, n = _first_fit(prober, site, variant_on, gpus_per_node, spec.num_gpus, big, slow)
    if t is None:
        return None
    extra = {k: f(t) for k, f in fields.items()}
    if part is not None:
        return Advice(kind, f"{what(t)} fits {t} (partition {part}): needs {fmt_mib(n)} per GPU with headroom",
                      True, change(t), gpu_type=t, partition=part, needed_bytes=n, **extra)
    least = "at least " if prober.is_floor(variant_on(t), t) else ""
    return Advice(kind, f"{what(t)} alone does not fit: needs {least}{fmt_mib(n)} per GPU on {t} "
                        f"({fmt_mib(prober.capacity(t))})", False, gpu_type=t, needed_bytes=n, **extra)


def _checkpointing_not_used(spec: WorkloadSpec) -> bool:
    """The model has its own activation checkpointing switch (transformers, timm) and the job does
    not turn it on: advice may propose it."""
    return spec.gradient_checkpointing == "off" and spec.model.split(":", 1)[0] in ("hf", "timm")


def largest_gpu(prober: Prober, site: SiteConfig, gpus_per_node: int = 1, total_gpus: int = 1) -> str | None:
    usable = [t for t in site.gpu_names if _partitions_for(site, t, gpus_per_node, total_gpus)]
    return _by_size(prober, usable)[-1] if usable else None


def advise(spec: WorkloadSpec, site: SiteConfig, prober: Prober, nofit: NoFit | None = None,
           gpus_per_node: int = 1, more: str = "run `vest check` on the script for a complete search"
           ) -> tuple[Advice, ...]:
    """What would fit the refused job ``spec``: largest batch on the largest GPU, AMP, activation
    checkpointing (models with a switch), an 8-bit Adam/AdamW (bitsandbytes installed), more GPUs,
    sharded alternatives. ``more`` says how to get further where the search stopped at its budget.
    Only memory refusals get advice (``nofit.reason`` no-fit or user-choice-too-small)."""
    if nofit is not None and nofit.reason not in ("no-fit", "user-choice-too-small"):
        return ()
    out: list[Advice] = []
    slow = prober.slow_types(spec)   # placement's order: where the job runs much slower, last
    if nofit is not None and nofit.reason == "user-choice-too-small":
        t, part, n, _ = _smallest_fit(prober, site, spec, gpus_per_node, slow)
        if t is not None:
            out.append(Advice("as-is", f"as it is, the job fits {t} (partition {part}, needs {fmt_mib(n)} "
                                       f"per GPU with headroom): drop your --partition/--gres choice",
                              True, f"--partition={part}", gpu_type=t, partition=part, needed_bytes=n))
            return tuple(out)
    big = largest_gpu(prober, site, gpus_per_node, spec.num_gpus)
    if big is None:
        return ()
    cap = prober.capacity(big)
    big_part = _partitions_for(site, big, gpus_per_node, spec.num_gpus)[0]

    # 1. The largest batch on the largest GPU.
    s = search_largest_batch(lambda b: prober.needed(spec.with_(batch_size=b), big), cap, spec.batch_size,
                             max_batch=spec.batch_size, floor_bytes=prober.floor_needed(spec, big))
    if s.batch is not None and s.batch < spec.batch_size:
        exact = "" if s.exact else " (search stopped early; a larger batch may fit)"
        out.append(Advice("batch", f"batch size {s.batch} per GPU fits {big} (partition {big_part}): needs "
                                   f"{fmt_mib(s.needed_bytes)} of {fmt_mib(cap)} with headroom{exact}",
                          True, f"#VEST --batch-size {s.batch}", batch_size=s.batch, gpu_type=big,
                          partition=big_part, needed_bytes=s.needed_bytes))
    elif s.complete and s.batch is None and s.method == "floor":
        n1 = prober.floor_needed(spec, big)
        out.append(Advice("batch", f"no batch size fits {big}: the parameters, gradients and optimizer state alone need "
                                   f"{fmt_mib(n1)} of {fmt_mib(cap)} with headroom",
                          False, batch_size=None, gpu_type=big, needed_bytes=n1))
    elif s.complete and s.batch is None:
        n1 = prober.needed(spec.with_(batch_size=1), big)
        out.append(Advice("batch", f"no batch size fits {big}: even batch 1 needs "
                                   f"{fmt_mib(n1) if n1 else '?'} of {fmt_mib(cap)} with headroom",
                          False, batch_size=None, gpu_type=big, needed_bytes=n1))

    # 2. AMP, where the job trains in full precision.
    if spec.precision in ("fp32", "tf32"):
        def amp(t):
            return amp_precision(prober.profiles[t])
        out.append(_variant_advice(prober, site, spec, gpus_per_node, big, "amp",
                                   lambda t: spec.with_(precision=amp(t)), lambda t: f"AMP (--precision {amp(t)})",
                                   lambda t: f"#VEST --precision {amp(t)}", precision=amp))

    # 3. Activation checkpointing, where the model has its own switch (transformers, timm) and the
    # job does not use it.
    if _checkpointing_not_used(spec):
        variant = spec.with_(gradient_checkpointing="on")
        out.append(_variant_advice(prober, site, spec, gpus_per_node, big, "checkpointing", lambda t: variant,
                                   lambda t: "activation checkpointing (--gradient-checkpointing on, the model's "
                                             "own switch)",
                                   lambda t: "#VEST --gradient-checkpointing on (and turn it on in the script)", slow))

    # 3b. An 8-bit Adam/AdamW (bitsandbytes), where it is installed: a quarter of the state.
    eight = {"adam": "adam-8bit", "adamw": "adamw-8bit"}.get(spec.optimizer)
    if eight is not None and importlib.util.find_spec("bitsandbytes") is not None:
        variant = spec.with_(optimizer=eight, optimizer_impl="auto")
        cls = "bnb.optim." + ("AdamW8bit" if eight == "adamw-8bit" else "Adam8bit")
        out.append(_variant_advice(prober, site, spec, gpus_per_node, big, "optimizer", lambda t: variant,
                                   lambda t: f"an 8-bit optimizer state (--optimizer {eight}, bitsandbytes)",
                                   lambda t: f"#VEST --optimizer {eight} (and {cls} in the script)", slow))
    out = [a for a in out if a is not None]

    # 4. More GPUs on one node, data parallel, the global batch kept (per-GPU batch divided).
    most = max((p.gpus_per_node for p in site.partitions), default=1)
    k, last = 2, None
    while spec.num_gpus * k <= most and k <= spec.batch_size:
        variant = spec.with_(num_gpus=spec.num_gpus * k, batch_size=math.ceil(spec.batch_size / k))
        t, part, n, _ = _smallest_fit(prober, site, variant, variant.num_gpus, slow)
        if t is not None:
            out.append(Advice("gpus", f"{variant.num_gpus} GPUs (data parallel) at batch {variant.batch_size} per GPU, "
                                      f"the same global batch: fits {t} (partition {part}, --gres=gpu:{t}:{variant.num_gpus}), "
                                      f"needs {fmt_mib(n)} per GPU with headroom", True,
                              f"#VEST --num-gpus {variant.num_gpus} --batch-size {variant.batch_size}; "
                              f"#SBATCH --gres=gpu:{t}:{variant.num_gpus}",
                              batch_size=variant.batch_size, num_gpus=variant.num_gpus, gpu_type=t, partition=part,
                              needed_bytes=n))
            break
        last = (variant, n, any(prober.is_floor(variant, t) for t in site.gpu_names))
        k *= 2
    else:
        if last is not None and last[1] is not None:
            variant, n, least = last
            out.append(Advice("gpus", f"more GPUs do not help: at {variant.num_gpus} GPUs and batch "
                                      f"{variant.batch_size} per GPU it still needs {'at least ' if least else ''}"
                                      f"{fmt_mib(n)} per GPU "
                                      "(data parallel keeps a full copy of the model, its gradients and "
                                      "optimizer state on every GPU)", False,
                              num_gpus=variant.num_gpus, batch_size=variant.batch_size, needed_bytes=n))
    # 5. Sharded alternatives, per rank (sharding.py): at the job's own GPU count first, then more.
    if spec.parallelism not in SHARDED and not spec.model.startswith(SCRIPT_PREFIX):
        out.extend(sharded_alternatives(spec, site, prober, slow))
    if prober.stopped:
        out.append(Advice("note", f"(advice search stopped after {prober.traces_made} traces; {more})", False))
    return tuple(out)


# The sharded variants advice tries, in order: FSDP2 (parameters, gradients and optimizer state
# sharded; the job's own dtypes); FSDP2 with activation checkpointing where the model has the switch
# and the job does not use it (sharding divides the states only; the activations of a long sequence
# stay whole on every rank); DeepSpeed ZeRO-3 with the optimizer offloaded to the CPU.
SHARDED_VARIANTS = (("fsdp2", {}, "fsdp2"),
                    ("fsdp2", {"gradient_checkpointing": "on"}, "fsdp2 with activation checkpointing"),
                    ("zero3", {"offload": "optimizer"}, "zero3 with optimizer offload"))
MAX_SHARDED_GPUS = 64   # the largest job size advice proposes


def sharded_counts(spec: WorkloadSpec, site: SiteConfig) -> list[int]:
    """GPU counts advice tries: the job's own (at least 2), then doubling, up to what a partition takes."""
    cap = max(((p.max_gpus_per_job or MAX_SHARDED_GPUS) for p in site.partitions), default=MAX_SHARDED_GPUS)
    cap = min(cap, MAX_SHARDED_GPUS)
    n, out = max(2, spec.num_gpus), []
    while n <= cap:
        out.append(n)
        n *= 2
    return out


def sharded_alternatives(spec: WorkloadSpec, site: SiteConfig, prober: Prober,
                         slow: Collection[str] = ()) -> list[Advice]:
    """Per sharded variant, the smallest GPU count (and the smallest GPU type at it) where the job
    fits per rank. The per-GPU batch is kept: at another GPU count the global batch changes, and
    the advice says so (vsbatch suggests; only ``#VEST --num-gpus auto`` lets it choose)."""
    most = max((p.gpus_per_node for p in site.partitions), default=1)
    out = []
    big = largest_gpu(prober, site)
    est = prober.estimate(spec, big) if big else None
    need = prober.needed(spec, big) if big else None
    if est is None or need is None:
        return out
    parts = dict(est.breakdown)
    states = sum(parts.get(k, 0) for k in ("parameters", "gradients", "optimizer_state"))
    # sharding divides only the model's states; the activations and the rest stay per GPU, so
    # where the states are smaller than the shortfall no GPU count closes it without checkpointing
    closes = states > need - prober.capacity(big)
    switch = _checkpointing_not_used(spec)
    variants = [v for v in SHARDED_VARIANTS if (switch if "gradient_checkpointing" in v[1] else closes)]

    def search(variant) -> Advice | None:
        kind, extra, name = variant
        for n in sharded_counts(spec, site):
            sharded = spec.with_(parallelism=kind, num_gpus=n, **extra)
            per_node = min(n, most)
            # only the count where it fits is shown: the others' needs may be bounds
            t, part, need, _ = _smallest_fit(prober, site, sharded, per_node, slow, fits_only=True)
            if t is None:
                continue
            nodes = -(-n // per_node)
            batch = "" if n == spec.num_gpus else \
                f"; the global batch becomes {n} x {spec.batch_size} (was {spec.num_gpus} x {spec.batch_size})"
            opts = f"--parallelism {kind} --num-gpus {n}" + "".join(f" --{k.replace('_', '-')} {v}"
                                                                      for k, v in extra.items())
            return Advice("sharded", f"{name} over {n} x {t} ({nodes} node{'s' if nodes > 1 else ''}, partition "
                                     f"{part}) fits: {fmt_mib(need)} per GPU with headroom{batch}", True,
                          f"#VEST {opts}; #SBATCH --nodes={nodes} --gres=gpu:{t}:{per_node}",
                          num_gpus=n, gpu_type=t, partition=part, needed_bytes=need)
        return None

    from ..estimate.sharding import unit_spec

    # variants built from one unsharded trace (sharded_trace.unit_trace) are searched together
    found = prober.in_groups(variants, search, lambda v: unit_spec(spec.with_(parallelism=v[0], num_gpus=2, **v[1])))
    return [a for a in found if a is not None]


def advisor(spec: WorkloadSpec, site: SiteConfig, prober: Prober, gpus_per_node: int = 1,
            sink: list | None = None, budget_s: float = ADVICE_BUDGET_S,
            max_traces: int = ADVICE_MAX_TRACES) -> Callable[[NoFit], Sequence[str]]:
    """placement.place's ``advise`` callback; the structured advice is appended to ``sink``."""

    def _advise(nofit: NoFit) -> Sequence[str]:
        prober.restart_budget(budget_s, max_traces)
        items = advise(spec, site, prober, nofit, gpus_per_node)
        if sink is not None:
            sink.extend(items)
        return [a.text for a in items]

    return _advise


def smallest_gpu_counts(spec: WorkloadSpec, site: SiteConfig, prober: Prober) -> dict[str, tuple[int, int, int] | None]:
    """Per GPU type of the site, for a sharded job: (GPU count, node count, need per GPU) of the
    smallest count in sharded_counts (2, 4, 8, ... up to what a partition takes) at which the job's
    strategy fits per rank, or None where none does. Nodes: the count over the GPUs per node of the
    type's partition (``--gpus-per-node`` where the job gives it). The per-GPU batch is the job's."""
    out: dict[str, tuple[int, int, int] | None] = {}
    counts = sharded_counts(spec.with_(num_gpus=1), site)
    for g in site.gpus:
        t = g.name
        per_node = spec.gpus_per_node or max((p.gpus_per_node for p in site.partitions_with(t)), default=1)
        out[t] = None
        for n in counts:
            if not _partitions_for(site, t, min(n, per_node), n):
                break
            need = prober.needed(spec.with_(num_gpus=n), t, fits_only=True)   # shown where it fits only
            if need is None:
                break
            if need <= prober.capacity(t):
                out[t] = (n, -(-n // per_node), need)
                break
    return out
