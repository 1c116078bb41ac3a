"""The bridge's decision: one job description and the site config in, one Decision out.

Order (the first that applies wins):

1. root and the exempt users/accounts of ``[policy]``: allow, untouched.
2. The GPU request (partition, tres_per_node/job/task) read as jobscript reads sbatch options; a
   request that cannot be read is a job we cannot check (unknown-job policy).
3. A CPU-only job without an attached estimate: allow (not the bridge's business).
4. The estimate vsbatch attached (attach.detach: format, version, size, script hash). Only GPU types
   of the site whose device profile matches the one the estimate was made for are used, and the
   capacity always comes from the site, never from the estimate. An estimate made for another GPU
   count than the job asks for is not this job's estimate.
5. Without a usable estimate: ``#VEST`` directives when ``bridge.allow_vest_directives``, read by
   the allow-list (allowlist.py: models named from installed libraries, built-in optimizers; a
   line naming code, a file or a path is refused and logged) and traced by the resident server's
   confined worker within a time budget (the per-call program traces nothing); else
   ``bridge.unknown_jobs``: allow, warn, refuse.
6. placement.place on those estimates: a Placement that changes the job becomes ``modify`` (the
   job_desc fields to set), a NoFit becomes ``refuse`` with placement's message.

Nothing here runs a model, a shell or code a job names; the cost is one SHA-256 of the script plus
placement (and the allow-list's reading of a #VEST line).
"""

from __future__ import annotations

import pwd
import sys
import time
from typing import Callable, Mapping, Sequence

from ..slurm.attach import AttachError, AttachedEstimate, detach
from ..errors import VestError
from ..estimate.record import MemoryEstimate
from ..slurm.jobscript import GpuRequest, gpu_request, parse_job_script
from ..site.placement import NoFit, place
from ..estimate.profiles import get_profile
from ..site.config import SiteConfig
from .protocol import (ESLURM_ACCESS_DENIED, ESLURM_INVALID_GRES, SAFE_VALUE, Decision, JobRequest,
                       ProtocolError, kv, parse_request)

# (allow-listed vest argv, num_gpus, {gres type: profile key}) -> {profile: (required, peak)}, or None
# when the trace did not finish in time; raises DirectiveFailed (directives.py).
DirectiveEstimator = Callable[[tuple[str, ...], int, Mapping[str, str]], "Mapping[str, tuple[int, int]] | None"]
UserLookup = Callable[[int], "str | None"]


def passwd_user(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return None


def _tres_values(text: str | None) -> list[str]:
    """``gres:gpu:a100:2,gres:shard:1`` (22.05) or ``gres/gpu:...`` (newer) -> ``["gpu:a100:2", ...]``."""
    if not text:
        return []
    out = []
    for item in text.split(","):
        item = item.strip()
        for prefix in ("gres:", "gres/"):
            if item.startswith(prefix):
                item = item[len(prefix):]
        if item:
            out.append(item)
    return out


def _gpu_count_value(text: str | None) -> str | None:
    """A tres_per_job/task GPU entry as ``--gpus`` takes it: ``gpu:a100:2`` -> ``a100:2``."""
    gpus = [v[len("gpu:"):] if v.startswith("gpu:") else None for v in _tres_values(text)
            if v == "gpu" or v.startswith("gpu:")]
    vals = [g for g in gpus if g]
    return ",".join(vals) if vals else None


def request_options(req: JobRequest) -> tuple[tuple[str, str], ...]:
    """The job's placement-relevant options, as jobscript names them (sbatch long options)."""
    opts: list[tuple[str, str]] = []
    if req.partition:
        opts.append(("partition", req.partition))
    per_node = _tres_values(req.tres_per_node) or _tres_values(req.gres)
    if per_node:
        opts.append(("gres", ",".join(per_node)))
    job = _gpu_count_value(req.tres_per_job)
    if job:
        opts.append(("gpus", job))
    task = _gpu_count_value(req.tres_per_task)
    if task:
        opts.append(("gpus-per-task", task))
    if req.min_nodes:
        opts.append(("nodes", str(req.min_nodes)))
    if req.num_tasks:
        opts.append(("ntasks", str(req.num_tasks)))
    if req.ntasks_per_node:
        opts.append(("ntasks-per-node", str(req.ntasks_per_node)))
    return tuple(opts)


def _prefix(req: JobRequest) -> str:
    """Write tres back in the spelling the controller gave us (22.05: ``gres:``, newer: ``gres/``)."""
    for text in (req.tres_per_node, req.tres_per_job, req.tres_per_task):
        if text and text.startswith("gres/"):
            return "gres/"
    return "gres:"


def _fields_for(overrides: Sequence[tuple[str, str | None]], req: JobRequest) -> tuple[tuple[str, str], ...]:
    """placement's sbatch overrides -> job_desc fields."""
    pre = _prefix(req)
    out: dict[str, str] = {}
    for name, value in overrides:
        if value is None:
            continue
        if name == "partition":
            out["partition"] = value
        elif name in ("gres", "gpus-per-node"):
            entries = value.split(",") if name == "gres" else [f"gpu:{value}"]
            out["tres_per_node"] = ",".join(pre + e for e in entries)
        elif name == "gpus":
            out["tres_per_job"] = pre + "gpu:" + value
        elif name == "gpus-per-task":
            out["tres_per_task"] = pre + "gpu:" + value
    for k, v in out.items():
        if not SAFE_VALUE.fullmatch(v):
            raise ValueError(f"unsafe value for {k}: {v!r}")
    return tuple(out.items())


def decision_record(site: SiteConfig, gpu_type: str, est: MemoryEstimate) -> str:
    """vest's record of a placed job for its AdminComment (`vest audit` reads it back): the type,
    the estimate's need, the request after the site's headroom, and the floor in the estimate as
    the site config gives it (calibrated context_mib, else the profile's default)."""
    from ..site.placement import estimate_need, needed_bytes
    from ..slurm.accounting import Record, encode_record

    g = site.gpu(gpu_type)
    if g is None:
        return ""
    need = estimate_need(est)
    floor_mib, floor = ((g.context_mib, "calibrated") if g.context_mib is not None
                        else (get_profile(g.profile).context_mib, "default"))
    return encode_record(Record(gpu_type, need, needed_bytes(need, site.policy.headroom_percent,
                                                             site.policy.headroom_bytes), floor_mib << 20, floor))


def _capacity(g) -> int:
    """A site GPU type's capacity: its memory_mib, else its profile's usable memory."""
    return g.memory_bytes if g.memory_bytes is not None else get_profile(g.profile).usable_bytes


def site_estimates(att: AttachedEstimate, site: SiteConfig) -> dict[str, MemoryEstimate]:
    """The attached per-type needs, on the site's GPU types whose profile matches; capacities are
    the site's (memory_mib, else the profile's usable memory)."""
    out = {}
    for g in site.gpus:
        entry = att.gpu(g.name)
        if entry is not None and entry.profile == g.profile:
            out[g.name] = MemoryEstimate(g.profile, _capacity(g), entry.required_bytes, entry.peak_bytes)
    return out


def _directive_estimates(per_profile: Mapping[str, tuple[int, int]], site: SiteConfig) -> dict[str, MemoryEstimate]:
    """A directive trace's (required, peak) per device profile, on the site's GPU types."""
    return {g.name: MemoryEstimate(g.profile, _capacity(g), *per_profile[g.profile])
            for g in site.gpus if g.profile in per_profile}


class _Log:
    def __init__(self, req: JobRequest, user: str | None):
        self.head = {"uid": req.uid, "user": user, "account": req.account, "job": req.name,
                     "partition": req.partition, "tres_per_node": req.tres_per_node,
                     "tres_per_job": req.tres_per_job}

    def line(self, action: str, reason: str, **more: object) -> str:
        fields = {"action": action, "reason": reason, **self.head, **more}
        return "vest-bridge: " + " ".join(f"{k}={kv(v)}" for k, v in fields.items())


def decide(req: JobRequest, site: SiteConfig, *, users: UserLookup = passwd_user,
           directives: DirectiveEstimator | None = None) -> Decision:
    t0 = time.perf_counter()
    d = _decide(req, site, users, directives)
    ms = (time.perf_counter() - t0) * 1000
    return Decision(d.action, d.reason, f"{d.log} ms={ms:.1f}", d.set, d.msg, d.errno, ms, d.detail, d.record)


def _unknown(site: SiteConfig, user: str | None, log: _Log, reason: str, note: str = "", detail: str = "") -> Decision:
    """The site's policy for a job without a usable estimate. ``detail`` (a refused directive, a
    failed trace) goes into the log line and, where the user is told anything, to the user."""
    pol, policy = site.policy, site.bridge.unknown_jobs
    text = pol.messages.render("unknown_job", help_url=pol.help_url, user=user or "")
    why = f"This GPU job has no usable memory estimate ({note or detail or reason})."
    more = {"detail": detail[:300]} if detail else {}
    if policy == "refuse":
        return Decision("refuse", reason, log.line("refuse", reason, unknown_jobs="refuse", **more),
                        msg=f"{why} It was not submitted. {text}", errno=ESLURM_ACCESS_DENIED, detail=detail)
    if policy == "warn":
        return Decision("allow", reason, log.line("allow", reason, unknown_jobs="warn", **more),
                        msg=f"{why} {text}", detail=detail)
    return Decision("allow", reason, log.line("allow", reason, unknown_jobs="allow", **more), detail=detail)


def _decide(req: JobRequest, site: SiteConfig, users: UserLookup,
            directives: DirectiveEstimator | None) -> Decision:
    user = users(req.uid)
    log = _Log(req, user)
    if req.uid == 0 or site.policy.is_exempt(user, req.account):
        return Decision("allow", "exempt", log.line("allow", "exempt"))
    try:
        request: GpuRequest = gpu_request(request_options(req))
    except VestError as e:
        return _unknown(site, user, log, "gpu-request-unreadable", f"its GPU request cannot be read: {e.what}")
    script = req.script
    attached: AttachedEstimate | None = None
    bad_estimate = ""
    if script is not None:
        try:
            _, attached = detach(script)
        except AttachError as e:
            bad_estimate = e.reason
    if not request.wants_gpu and attached is None:
        return Decision("allow", "no-gpu", log.line("allow", "no-gpu"))
    if bad_estimate:
        return _unknown(site, user, log, f"estimate-{bad_estimate}",
                        f"the attached estimate was rejected: {bad_estimate}")
    estimates: Mapping[str, MemoryEstimate] | None = None
    source = "attached"
    if attached is not None:
        if request.wants_gpu and attached.num_gpus != request.total_gpus:
            return _unknown(site, user, log, "estimate-gpu-count",
                            f"the estimate is for {attached.num_gpus} GPU(s), the job asks for {request.total_gpus}")
        estimates = site_estimates(attached, site)
        if not estimates:
            return _unknown(site, user, log, "estimate-no-site-gpu",
                            "the estimate names none of this site's GPU types and profiles")
    else:
        estimates, why, detail = _from_directives(script, request, site, directives)
        source = "directives"
        if estimates is None:
            return _unknown(site, user, log, why, detail=detail)
    result = place(estimates, request, [p for p in (req.partition or "").split(",") if p], site,
                   user=user, account=req.account)
    if isinstance(result, NoFit):
        msg = result.message.replace("vsbatch refused the job:", "The job was refused:", 1)
        return Decision("refuse", result.reason, log.line("refuse", result.reason, source=source,
                                                          need_mib=result.needed_bytes >> 20,
                                                          largest=result.largest_gpu),
                        msg=msg, errno=ESLURM_INVALID_GRES)
    msg = "\n".join(result.warnings)
    record = decision_record(site, result.gpu_type, result.estimate)
    if not result.changed:
        return Decision("allow", "fits", log.line("allow", "fits", source=source, gpu=result.gpu_type), msg=msg,
                        record=record)
    fields = _fields_for(result.overrides, req)
    reason = "rerouted" if req.partition or request.gpu_type else "placed"
    if not msg:
        msg = f"vest: job placed on partition {result.partition} ({result.gres}): {result.reasons[0]}."
    return Decision("modify", reason, log.line("modify", reason, source=source, to_partition=result.partition,
                                               to_gres=result.gres), set=fields, msg=msg, record=record)


def _from_directives(script: str | None, request: GpuRequest, site: SiteConfig,
                     directives: DirectiveEstimator | None) -> tuple[Mapping[str, MemoryEstimate] | None, str, str]:
    """(estimates or None, the reason for the log, a note for the user). The directives are read by
    the allow-list (allowlist.py) before anything else sees them: code a job names is never run."""
    if script is None:
        return None, "no-script", ""
    if not site.bridge.allow_vest_directives:
        return None, "no-estimate", ""
    try:
        argv = parse_job_script(script, "<job>").vest_argv
    except VestError:
        return None, "no-estimate", ""
    if not argv:
        return None, "no-estimate", ""
    # Only jobs with #VEST lines and no attached estimate pay for these imports.
    from ..estimate.allowlist import MAX_NUM_GPUS, DirectiveRefused, parse_untrusted
    from .directives import DirectiveFailed

    try:
        spec = parse_untrusted(argv)
    except DirectiveRefused as e:
        return None, f"directives-refused-{e.reason}", f"{e.what}; {e.fix}"
    except VestError as e:
        return None, "directives-invalid", e.what
    if request.total_gpus > MAX_NUM_GPUS:   # the count the trace runs at (#VEST --num-gpus auto means it)
        return None, "directives-refused-bad-value", f"the job asks for {request.total_gpus} GPUs, more than {MAX_NUM_GPUS}"
    if directives is None:
        return None, "directives-not-here", ""    # the per-call program has no time for a trace
    try:
        per_profile = directives(tuple(spec.to_argv()), max(request.total_gpus, 1),
                                 {g.name: g.profile for g in site.gpus})
    except DirectiveFailed as e:
        return None, e.reason, e.what
    if per_profile is None:
        return None, "directives-over-budget", ""
    estimates = _directive_estimates(per_profile, site)
    return (estimates, "directives", "") if estimates else (None, "directives-no-site-gpu", "")


def error_decision(reason: str, what: str) -> Decision:
    """The bridge could not decide: job_submit.lua applies the site's fail mode."""
    return Decision("error", reason, f"vest-bridge: action=error reason={kv(reason)} detail={kv(what)}")


def decide_bytes(data: bytes, site: SiteConfig | None, site_problem: str = "", **kw) -> Decision:
    """The whole per-request path, never raising: bytes in, Decision out."""
    if site is None:
        return error_decision("site-config", site_problem or "no site config loaded")
    try:
        req = parse_request(data)
    except ProtocolError as e:
        return error_decision(f"request-{e.reason}", str(e))
    try:
        return decide(req, site, **kw)
    except Exception as e:  # a bug must not become a crash in front of slurmctld
        return error_decision("internal", f"{type(e).__name__}: {e}")


def main(argv: Sequence[str] | None = None) -> int:
    """The per-call fallback: ``python -m vest_slurm.bridge.decide --site-config PATH < request``.
    Always prints one answer line and exits 0 (job_submit.lua reads the answer, not the code)."""
    import argparse

    from ..site.config import load_site_config
    from .protocol import MAX_REQUEST_BYTES

    ap = argparse.ArgumentParser(prog="vest-bridge-decide")
    ap.add_argument("--site-config", default=None)
    ns = ap.parse_args(argv)
    data = sys.stdin.buffer.read(MAX_REQUEST_BYTES + 1)
    try:
        site, problem = load_site_config(ns.site_config), ""
    except VestError as e:
        site, problem = None, str(e).replace("\n", " ")
    d = decide_bytes(data.rstrip(b"\n"), site, problem)
    sys.stdout.buffer.write(d.wire())
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
