"""Placement: from per-GPU-type estimates, the job's GPU request and the site rules, where the job goes.

The policy, stated once:

- Headroom. A GPU type is acceptable for a job when
  ``peak_bytes * (1 + headroom_percent / 100) + headroom_mib MiB <= capacity_bytes``,
  where ``peak_bytes`` is the estimator's per-GPU peak on that type (what nvidia-smi would show: the
  job runs there without the caching allocator ever having to flush its cache; the estimate's
  ``required_bytes``, the least it could run in, is never more) and ``capacity_bytes`` is the site's
  ``memory_mib`` for the type when set, else the device profile's capacity from the estimate.
- A candidate is a (partition, GPU type) of the site config with an estimate for that type. It fits
  when the memory is acceptable and the job's GPUs per node, total and nodes fit the partition
  (``gpus_per_node``, ``max_gpus_per_job``, ``nodes`` where known: the site's, or Slurm's in vsbatch).
- Rules run in order; the first refusal wins (``RULES``). Exempt users and accounts turn the
  refusals of exemptable rules into warnings.
- Selection among fitting candidates: the smallest GPU (ties: cost, then config order), or with
  ``selection = "cost"`` the cheapest (ties: smallest, then config order); GPU types where the job
  runs much slower (``slow``: bf16 emulated before sm80) only when no other fits, with a warning.
- The user's own choice (``--partition`` and/or a typed GPU request) is kept, unchanged, when every
  candidate it allows fits; narrowed to the fitting ones when only some fit; when none fits the site's
  ``on_user_choice_too_small`` decides: reroute (select among all), warn (keep it, with a warning),
  refuse.
- Every refusal has two texts: ``admin_line``, one greppable line (``vest: refuse user=... reason=...``)
  and ``message``, a plain explanation for the user.
"""

from __future__ import annotations

import math
import re
import urllib.parse
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, Sequence

from ..estimate.record import MemoryEstimate
from ..slurm.jobscript import GpuRequest, Option
from .config import SiteConfig
from ..units import MiB, fmt_mib


@dataclass(frozen=True)
class Candidate:
    partition: str
    gpu_type: str
    capacity_bytes: int
    needed_bytes: int           # the estimated peak with the site's headroom
    cost: float | None
    gpus_ok: bool               # the GPU count fits this partition

    @property
    def memory_ok(self) -> bool:
        return self.needed_bytes <= self.capacity_bytes

    @property
    def fits(self) -> bool:
        return self.memory_ok and self.gpus_ok

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.needed_bytes - self.capacity_bytes)


@dataclass(frozen=True)
class Placement:
    """Where the job goes. ``overrides`` are the sbatch options to set (empty when unchanged)."""

    partition: str
    gres: str
    gpu_type: str
    estimate: MemoryEstimate
    reasons: tuple[str, ...]
    changed: bool
    warnings: tuple[str, ...] = ()
    overrides: tuple[Option, ...] = ()
    admin_line: str = ""


@dataclass(frozen=True)
class NoFit:
    """A refusal. ``reason`` is a stable code (no-fit, user-choice-too-small, unknown-partition,
    unknown-gpu-type, too-many-gpus, no-estimate)."""

    reason: str
    message: str
    admin_line: str
    estimate: MemoryEstimate | None = None     # on the closest candidate's GPU type
    needed_bytes: int = 0                      # per GPU, headroom included, on that type
    largest_gpu: str | None = None
    largest_capacity_bytes: int = 0
    shortfall_bytes: int = 0                   # needed minus the largest GPU's capacity
    closest: Candidate | None = None
    advice: tuple[str, ...] = ()

    @property
    def shortfall_mib(self) -> float:
        return self.shortfall_bytes / MiB


Advise = Callable[[NoFit], Iterable[str]]


def needed_bytes(peak_bytes: int, headroom_percent: float, headroom_bytes: int) -> int:
    """The headroom rule: peak × (1 + percent/100) + fixed headroom, rounded up to a byte."""
    return math.ceil(peak_bytes * (1 + headroom_percent / 100)) + headroom_bytes


def estimate_need(est: MemoryEstimate) -> int:
    """What the headroom rule is applied to: the peak (never below what the job requires, nor below
    the cuDNN engines' bound where the cuDNN asked is not the job's: record.py). The estimator's
    peak is never below its need (the uncapped replay runs; a peak capped at the GPU is one the need
    fits), so a need not yet searched (record.MemoryEstimate.required) is not searched for this."""
    required = 0 if callable(est.required) else est.required
    return max(est.peak_bytes, required, est.placement_bytes)


# ---------------------------------------------------------------- context and rules

@dataclass(frozen=True)
class _Ctx:
    site: SiteConfig
    estimates: Mapping[str, MemoryEstimate]
    request: GpuRequest
    partitions: tuple[str, ...]
    user: str | None
    account: str | None
    candidates: tuple[Candidate, ...]
    slow: Mapping[str, str]   # GPU type -> why the job runs much slower there

    @property
    def constrained(self) -> bool:
        return bool(self.partitions) or self.request.gpu_type is not None

    @property
    def chosen(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates
                     if (not self.partitions or c.partition in self.partitions)
                     and (self.request.gpu_type is None or c.gpu_type == self.request.gpu_type))


@dataclass(frozen=True)
class _Refusal:
    reason: str
    text: str


def _rule_has_estimates(ctx: _Ctx) -> _Refusal | None:
    if not ctx.candidates:
        known = ", ".join(ctx.site.gpu_names)
        return _Refusal("no-estimate", f"there is no memory estimate for any GPU type of this site ({known}).")
    return None


def _rule_known_partitions(ctx: _Ctx) -> _Refusal | None:
    unknown = [p for p in ctx.partitions if ctx.site.partition(p) is None]
    if unknown:
        valid = ", ".join(p.name for p in ctx.site.partitions)
        return _Refusal("unknown-partition",
                        f"partition {', '.join(unknown)} is not a GPU partition of this site (GPU partitions: {valid}).")
    return None


def _rule_known_gpu_type(ctx: _Ctx) -> _Refusal | None:
    t = ctx.request.gpu_type
    if t is None:
        return None
    if ctx.site.gpu(t) is None:
        return _Refusal("unknown-gpu-type",
                        f"GPU type {t!r} does not exist here (GPU types: {', '.join(ctx.site.gpu_names)}).")
    if ctx.partitions and not any(t in ctx.site.partition(p).gpu_types for p in ctx.partitions):
        return _Refusal("unknown-gpu-type", f"partition {', '.join(ctx.partitions)} has no {t} GPUs "
                        f"({t} is in: {', '.join(p.name for p in ctx.site.partitions_with(t)) or 'no partition'}).")
    return None


def _rule_gpu_count(ctx: _Ctx) -> _Refusal | None:
    pool = ctx.chosen if ctx.constrained and ctx.site.policy.on_user_choice_too_small == "refuse" else ctx.candidates
    if pool and not any(c.gpus_ok for c in pool):
        r = ctx.request
        nodes = f" on {r.nodes} nodes" if r.nodes > 1 else ""
        return _Refusal("too-many-gpus", f"the job asks for {max(r.gpus_per_node, 1)} GPU(s) per node, "
                        f"{max(r.total_gpus, 1)} in all{nodes}, more than any partition allows "
                        f"({_shapes(ctx)}).")
    return None


def _rule_fits_somewhere(ctx: _Ctx) -> _Refusal | None:
    if not any(c.fits for c in ctx.candidates):
        return _Refusal("no-fit", "the job does not fit on any GPU of this site.")
    return None


def _rule_user_choice(ctx: _Ctx) -> _Refusal | None:
    if ctx.constrained and ctx.site.policy.on_user_choice_too_small == "refuse" \
            and not any(c.fits for c in ctx.chosen):
        return _Refusal("user-choice-too-small", f"the job does not fit on the GPUs you asked for ({_choice_text(ctx)}).")
    return None


def _shapes(ctx: _Ctx) -> str:
    return "; ".join(f"{p.name}: {p.gpus_per_node} per node" + (f", {p.nodes} node{'s' if p.nodes > 1 else ''}"
                                                                   if p.nodes is not None else "")
                     + (f", at most {p.max_gpus_per_job} a job" if p.max_gpus_per_job is not None else "")
                     for p in ctx.site.partitions)


# (rule, exemptable): the first refusal wins; exempt users get exemptable refusals as warnings.
RULES: tuple[tuple[Callable[[_Ctx], _Refusal | None], bool], ...] = (
    (_rule_has_estimates, False),
    (_rule_known_partitions, False),
    (_rule_known_gpu_type, False),
    (_rule_gpu_count, True),
    (_rule_fits_somewhere, True),
    (_rule_user_choice, True),
)


# ---------------------------------------------------------------- place

def place(estimates: Mapping[str, MemoryEstimate], request: GpuRequest, partitions: Sequence[str],
          site: SiteConfig, user: str | None = None, account: str | None = None,
          advise: Advise | None = None, slow: Mapping[str, str] | None = None) -> Placement | NoFit:
    """Place a job: ``estimates`` maps a gres GPU type to its per-GPU estimate; ``partitions`` are the
    ones the user asked for (empty: any). ``advise`` (optional) fills ``NoFit.advice``. ``slow`` maps
    GPU types where the job runs much slower to why (chosen last among those that fit)."""
    ctx = _Ctx(site, estimates, request, tuple(partitions), user, account, _candidates(site, estimates, request),
               dict(slow or {}))
    exempt = site.policy.is_exempt(user, account)
    warnings: list[str] = []
    for rule, exemptable in RULES:
        refusal = rule(ctx)
        if refusal is None:
            continue
        if exempt and exemptable:
            warnings.append(f"exempt from the rule: {refusal.text}")
            continue
        return _refuse(ctx, refusal, advise)
    return _select(ctx, warnings, exempt)


def _candidates(site: SiteConfig, estimates: Mapping[str, MemoryEstimate], request: GpuRequest) -> tuple[Candidate, ...]:
    pol = site.policy
    per_node, total = max(request.gpus_per_node, 1), max(request.total_gpus, 1)
    out = []
    for part in site.partitions:
        for t in part.gpu_types:
            est = estimates.get(t)
            gpu = site.gpu(t)
            if est is None or gpu is None:
                continue
            capacity = gpu.memory_bytes if gpu.memory_bytes is not None else est.capacity_bytes
            gpus_ok = (per_node <= part.gpus_per_node and (part.max_gpus_per_job is None or total <= part.max_gpus_per_job)
                       and (part.nodes is None or max(request.nodes, 1) <= part.nodes))
            out.append(Candidate(part.name, t, capacity, needed_bytes(estimate_need(est), pol.headroom_percent,
                                                                      pol.headroom_bytes),
                                 part.cost if part.cost is not None else gpu.cost, gpus_ok))
    return tuple(out)


def _best(ctx: _Ctx, pool: Iterable[Candidate]) -> Candidate:
    order = {c: i for i, c in enumerate(ctx.candidates)}
    if ctx.site.policy.selection == "cost":
        return min(pool, key=lambda c: (c.gpu_type in ctx.slow, c.cost if c.cost is not None else math.inf,
                                        c.capacity_bytes, order[c]))
    return min(pool, key=lambda c: (c.gpu_type in ctx.slow, c.capacity_bytes, c.cost if c.cost is not None else 0,
                                    order[c]))


def _largest(pool: Iterable[Candidate]) -> Candidate:
    return max(pool, key=lambda c: (c.gpus_ok, c.capacity_bytes - c.needed_bytes))


def _select(ctx: _Ctx, warnings: list[str], exempt: bool) -> Placement:
    pol, req = ctx.site.policy, ctx.request
    fitting = [c for c in ctx.candidates if c.fits]
    reasons: list[str] = []
    chosen = ctx.chosen
    if ctx.constrained and chosen:
        good = [c for c in chosen if c.fits]
        if good:
            best = _best(ctx, good)
            changed = len(good) < len(chosen)
            reasons.append(f"your choice ({_choice_text(ctx)}) fits" if not changed else
                           f"narrowed your choice ({_choice_text(ctx)}) to {best.partition} {best.gpu_type}, where it fits")
        elif pol.on_user_choice_too_small == "reroute" and fitting and not exempt:
            best = _best(ctx, fitting)
            changed = True
            reasons.append(f"rerouted: {_choice_text(ctx)} is too small for the job")
            gres = req.gres_string(best.gpu_type)
            warnings.append(pol.messages.render("reroute", help_url=pol.help_url, user=ctx.user or "",
                                                partition=best.partition, gres=gres, requested=_choice_text(ctx)))
        else:
            best = _largest(chosen)
            changed = False
            reasons.append(f"kept your choice ({_choice_text(ctx)}) although it may not fit")
            warnings.append(f"needs {fmt_mib(best.needed_bytes)} per GPU with headroom, {best.gpu_type} has "
                            f"{fmt_mib(best.capacity_bytes)}")
            warnings.append(pol.messages.render("warn", help_url=pol.help_url, user=ctx.user or "",
                                                partition=best.partition, gres=req.gres_string(best.gpu_type)))
    else:
        best = _best(ctx, fitting) if fitting else _largest(ctx.candidates)
        changed = True
        rule = "cheapest" if pol.selection == "cost" else "smallest"
        passed_over = best.gpu_type not in ctx.slow and any(c.gpu_type in ctx.slow for c in fitting)
        reasons.append(f"{rule} GPU that fits{' at full speed' if passed_over else ''}: "
                       f"{best.gpu_type} in partition {best.partition}" if fitting
                       else f"nothing fits; largest GPU {best.gpu_type} chosen for an exempt user")
    if not req.wants_gpu:
        changed = True
        reasons.append("the job asked for no GPU; asking for one")
    if best.gpu_type in ctx.slow:
        warnings.append(f"{best.gpu_type}: {ctx.slow[best.gpu_type]}")
    est = ctx.estimates[best.gpu_type]
    reasons.append(f"needs {fmt_mib(best.needed_bytes)} per GPU with headroom "
                   f"(estimated peak {fmt_mib(est.peak_bytes)}), {best.gpu_type} has {fmt_mib(best.capacity_bytes)}")
    gres = req.gres_string(best.gpu_type)
    overrides = ((("partition", best.partition),) + req.overrides_for(best.gpu_type)) if changed else ()
    admin = _admin("place", ctx, partition=best.partition, gres=gres, changed="yes" if changed else "no",
                   need_mib=best.needed_bytes // MiB, capacity_mib=best.capacity_bytes // MiB,
                   warnings=len(warnings))
    return Placement(best.partition, gres, best.gpu_type, est, tuple(reasons), changed, tuple(warnings),
                     overrides, admin)


def _refuse(ctx: _Ctx, refusal: _Refusal, advise: Advise | None) -> NoFit:
    pol = ctx.site.policy
    pool = [c for c in ctx.candidates if c.gpus_ok] or list(ctx.candidates)
    if refusal.reason == "user-choice-too-small":
        pool = [c for c in ctx.chosen if c.gpus_ok] or list(ctx.chosen) or pool
    closest = min(pool, key=lambda c: (c.shortfall_bytes, -c.capacity_bytes)) if pool else None
    largest = max(ctx.candidates, key=lambda c: c.capacity_bytes) if ctx.candidates else None
    est = ctx.estimates.get(closest.gpu_type) if closest else None
    lines = [f"vsbatch refused the job: {refusal.text}"]
    if closest is not None and est is not None:
        lines.append(f"It needs {fmt_mib(closest.needed_bytes)} per GPU with the site's headroom "
                     f"(estimated peak {fmt_mib(estimate_need(est))}).")
    if largest is not None:
        lines.append(f"The largest GPU here is {largest.gpu_type} with {fmt_mib(largest.capacity_bytes)}"
                     + (f": {fmt_mib(largest.shortfall_bytes)} short." if largest.shortfall_bytes else "."))
    if closest is not None and refusal.reason in ("no-fit", "user-choice-too-small", "too-many-gpus"):
        lines.append(f"Closest: partition {closest.partition}, {ctx.request.gres_string(closest.gpu_type)}.")
    site_text = pol.messages.render("refuse", help_url=pol.help_url, user=ctx.user or "", reason=refusal.reason)
    fields = dict(need_mib=closest.needed_bytes // MiB if closest else None,
                  largest=largest.gpu_type if largest else None,
                  capacity_mib=largest.capacity_bytes // MiB if largest else None,
                  shortfall_mib=math.ceil(largest.shortfall_bytes / MiB) if largest else None,
                  closest=f"{closest.partition}/{closest.gpu_type}" if closest else None)
    nofit = NoFit(refusal.reason, "\n".join(lines), _admin("refuse", ctx, reason=refusal.reason, **fields), est,
                  closest.needed_bytes if closest else 0, largest.gpu_type if largest else None,
                  largest.capacity_bytes if largest else 0, largest.shortfall_bytes if largest else 0, closest)
    advice = tuple(str(a) for a in advise(nofit)) if advise is not None and est is not None else ()
    tail = [f"  - {a}" for a in advice]
    message = "\n".join([nofit.message] + (["What would fit:"] + tail if tail else []) + ([site_text] if site_text.strip() else []))
    return replace(nofit, message=message, advice=advice)


def _choice_text(ctx: _Ctx) -> str:
    parts = []
    if ctx.partitions:
        parts.append("partition " + ",".join(ctx.partitions))
    if ctx.request.gpu_type:
        parts.append(f"GPU type {ctx.request.gpu_type}")
    return ", ".join(parts) or "any GPU"


_SAFE = re.compile(r"[A-Za-z0-9_.,:/@+-]+")


def _kv(value: object) -> str:
    """A log value that greps and cannot forge another field: percent-encoded unless plain
    (no space, quote, '=' or newline can appear)."""
    text = "-" if value is None else str(value)
    if _SAFE.fullmatch(text):
        return text
    return urllib.parse.quote(text.encode("utf-8", errors="surrogateescape"), safe=",:/@+-")


def _admin(action: str, ctx: _Ctx, **fields: object) -> str:
    head = {"user": ctx.user, "account": ctx.account}
    return f"vest: {action} " + " ".join(f"{k}={_kv(v)}" for k, v in {**head, **fields}.items())
