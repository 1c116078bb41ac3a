"""`vest audit`: finished jobs' estimates joined with their measured peak GPU memory, per GPU type,
and the floor and headroom the site's own jobs recommend.

In: ``AcctJob`` records (slurm/accounting.py: sacct --parsable2 / --json), measurements given
apart (a CSV ``job_id,peak_mib[,gpu_type]``), the site config. Out: ``AuditJob`` per job and a
``TypeAudit`` per GPU type (frozen), the text and JSON of the report, and ``apply`` (the site config
rewritten with the recommendation, after validation, with a backup).

The estimate of a job: vest's record in its AdminComment (written by the bridge), else the same
record in the ``#VEST-RECORD`` line job_submit.lua appends to the batch script (Slurm keeps the
script with ``AccountingStoreFlags=job_script``; it survives Jobstats replacing AdminComment), else
the ``#VEST-ESTIMATE`` line of the stored script (vsbatch, where the bridge did not run) on the GPU
type it ran on, with the site's headroom and the floor the site config gives that type now. The measurement: a CSV line for the job, else sacct's
``gres/gpumem``, else a Jobstats summary in its AdminComment.

CUDA out-of-memory: a job that failed and whose stderr (the path sacct gives, else Slurm's default
``slurm-<id>.out`` in its working directory) says "CUDA out of memory" / "OutOfMemoryError" is
flagged: its measured peak is what the GPU had when it died, a lower bound of its need, and it
counts as requested below its need.

The recommendation, per GPU type, from the jobs with both an estimate and a measurement:
- The estimate without its floor (``rest = need - floor``) does not depend on the stack; the floor
  and the headroom are the stack's. The floor is taken as `vest calibrate` takes it (gpu/calibrate.py:
  the median over small jobs of what each holds outside the allocator): the median of
  ``measured - rest`` over the quarter of the jobs with the smallest ``rest``, where the floor is
  most of the peak and the estimate's relative error moves it least; never below the board's
  local-memory reservation (profiles.local_memory_mib: no context is smaller).
- The headroom is the split-conformal quantile of the relative errors ``measured / (rest + floor)
  - 1`` at level 1 - alpha: the k-th smallest with ``k = ceil((n + 1)(1 - alpha))``; a new job
  exchangeable with the past ones is then requested below its peak with probability at most alpha.
  With ``n < 1/alpha - 1`` jobs (99 at 1%) k exceeds n and no finite quantile has that guarantee:
  the headroom is then the largest error seen (probability at most 1/(n + 1)) and the report says so.
- Exchangeable means: the next jobs are like the past ones. A site whose users start training a
  family of models the past jobs did not have gets no such bound; scripts/bench_audit.py measures
  the recommendation on jobs it did not see.
"""

from __future__ import annotations

import math
import os
import re
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import VestError
from ..slurm.accounting import AcctJob, Record, decode_record, jobstats_peak_bytes, script_record

MiB = 1 << 20
ALPHA = 0.01                  # issue 25: requests below the measurement on at most 1% of jobs
SMALL_SHARE = 4               # the floor from the smallest quarter of the jobs
MIN_FLOOR_JOBS = 4            # at least one job in that quarter; fewer: the floor is kept
OOM_PATTERNS = re.compile(r"CUDA out of memory|torch\.OutOfMemoryError|torch\.cuda\.OutOfMemoryError|"
                          r"CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED")
STDERR_TAIL_BYTES = 256 * 1024


@dataclass(frozen=True)
class AuditJob:
    job_id: str
    gpu_type: str
    record: Record | None          # the estimate as the job was placed; None: none found
    record_from: str               # "admin_comment" | "script-record" | "script" | ""
    measured_bytes: int | None
    measured_from: str             # "csv" | "sacct-gpumem" | "jobstats" | ""
    oom: bool = False
    note: str = ""


@dataclass(frozen=True)
class Recommendation:
    context_mib: int
    headroom_percent: float
    n: int
    guaranteed: bool               # the conformal level holds at this n (n >= 1/alpha - 1)
    bound: float                   # the probability of a request below the peak it guarantees
    would_below: int               # past jobs the recommendation would have requested below
    would_over: float              # their median over-provisioning with it
    floor_from_jobs: bool = True   # False: too few jobs, the current floor kept


@dataclass(frozen=True)
class TypeAudit:
    gpu_type: str
    jobs: int                      # with an estimate and a measurement
    oom_jobs: int
    median_abs_err: float | None
    below_share: float | None      # requested below the measured peak (the OOM risk)
    median_over: float | None
    smaller_type_jobs: int         # would have fit a GPU type with less memory
    floor: str                     # the floor the site config gives this type now
    floor_mib: int
    recommendation: Recommendation | None


# ---------------------------------------------------------------- the join

def read_stderr_tail(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - STDERR_TAIL_BYTES))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def stderr_path(job: AcctJob) -> str:
    """The job's stderr: sacct's (``%j``, ``%x``, ``%u`` expanded), else sbatch's default."""
    p = job.std_err
    if p:
        p = p.replace("%j", job.job_id).replace("%A", job.job_id).replace("%x", job.name)
    elif job.work_dir:
        p = os.path.join(job.work_dir, f"slurm-{job.job_id}.out")
    return p


def is_cuda_oom(job: AcctJob, read=read_stderr_tail) -> tuple[bool, str]:
    """(died of CUDA out-of-memory, a note when it cannot be told)."""
    if job.state.upper() in ("COMPLETED", "RUNNING", "PENDING", ""):
        return False, ""
    path = stderr_path(job)
    text = read(path) if path else None
    if text is None:
        return False, f"{job.state}: stderr not readable ({path or 'no path'}), CUDA OOM not checked"
    return bool(OOM_PATTERNS.search(text)), ""


def _script_record(job: AcctJob, site) -> Record | None:
    """The estimate vsbatch attached to the stored script, on the type the job ran on."""
    if not job.script or not job.gpu_type or site is None:
        return None
    from ..slurm.attach import AttachError, detach
    from .placement import needed_bytes

    att = None
    # Slurm 22.05's `sacct --batch-script` ends the script with one more newline than was stored
    texts = (job.script, job.script[:-1]) if job.script.endswith("\n\n") else (job.script,)
    for text in texts:
        try:
            _, att = detach(text)
            break
        except AttachError:
            continue
    e = att.gpu(job.gpu_type) if att is not None else None
    if e is None:
        return None
    need = max(e.peak_bytes, e.required_bytes)
    floor, source = _site_floor(site, job.gpu_type)
    return Record(job.gpu_type, need, needed_bytes(need, site.policy.headroom_percent, site.policy.headroom_bytes),
                  floor * MiB, source)


def _site_floor(site, gpu_type: str) -> tuple[int, str]:
    from .advice import site_profiles

    p = site_profiles(site).get(gpu_type)
    return (p.context_mib, p.floor) if p is not None else (0, "")


def join(acct: Sequence[AcctJob], measured: Mapping[str, tuple[int, str]], site=None,
         read=read_stderr_tail) -> list[AuditJob]:
    out = []
    for job in acct:
        rec, rec_from = decode_record(job.admin_comment), "admin_comment"
        if rec is None:     # replaced (Jobstats): the bridge's line in the stored script
            rec, rec_from = script_record(job.script), "script-record"
            # slurmdbd stores one text per hash of the submitted script: an identical script placed
            # on another type (sbatch --gres on the command line) shows the first job's line
            if rec is not None and job.gpu_type and rec.gpu_type != job.gpu_type:
                rec = None
        if rec is None:
            rec, rec_from = _script_record(job, site), "script"
        if rec is None:
            rec_from = ""
        m, m_from, gtype = None, "", job.gpu_type or (rec.gpu_type if rec else "")
        if job.job_id in measured:
            m, t = measured[job.job_id]
            m_from, gtype = "csv", t or gtype
        elif job.gpumem_bytes:
            m, m_from = job.gpumem_bytes, "sacct-gpumem"
        elif (js := jobstats_peak_bytes(job.admin_comment)) is not None:
            m, m_from = js, "jobstats"
        oom, note = is_cuda_oom(job, read)
        out.append(AuditJob(job.job_id, gtype, rec, rec_from, m, m_from, oom, note))
    return out


# ---------------------------------------------------------------- the recommendation

def conformal_quantile(errors: Sequence[float], alpha: float = ALPHA) -> tuple[float, bool]:
    """(the k-th smallest error, k = ceil((n+1)(1-alpha)); whether k <= n, i.e. the level holds)."""
    xs = sorted(errors)
    k = math.ceil((len(xs) + 1) * (1 - alpha))
    if k > len(xs):
        return xs[-1], False
    return xs[k - 1], True


def recommend(rest_mib: Sequence[float], measured_mib: Sequence[float], min_floor_mib: int,
              alpha: float = ALPHA, current_floor_mib: int | None = None) -> Recommendation | None:
    """The floor and headroom of one GPU type from its past jobs (``rest``: each estimate without
    its floor; ``measured``: each measured peak; MiB). See the module docstring. With fewer than
    MIN_FLOOR_JOBS jobs the floor is not taken from them (one job's estimate error would become the
    floor): ``current_floor_mib`` is kept and only the headroom is fitted."""
    n = len(rest_mib)
    if n == 0:
        return None
    order = sorted(range(n), key=lambda i: rest_mib[i])
    small = order[:max(1, n // SMALL_SHARE)]
    from_jobs = n >= MIN_FLOOR_JOBS or current_floor_mib is None
    if from_jobs:
        f = max(float(min_floor_mib), statistics.median(measured_mib[i] - rest_mib[i] for i in small))
    else:
        f = float(current_floor_mib)
    f = math.ceil(f)
    errs = [m / max(r + f, 1.0) - 1 for r, m in zip(rest_mib, measured_mib)]
    h, ok = conformal_quantile(errs, alpha)
    pct = math.ceil(max(h, 0.0) * 1000) / 10     # up to a tenth of a percent: never below the quantile
    below = sum((r + f) * (1 + pct / 100) < m for r, m in zip(rest_mib, measured_mib))
    over = statistics.median((r + f) * (1 + pct / 100) / m - 1 for r, m in zip(rest_mib, measured_mib))
    return Recommendation(int(f), pct, n, ok, alpha if ok else 1 / (n + 1), below, over, from_jobs)


def audit_types(jobs: Sequence[AuditJob], site=None, alpha: float = ALPHA) -> list[TypeAudit]:
    from ..estimate.profiles import get_profile, local_memory_mib
    from .advice import site_profiles
    profiles = site_profiles(site) if site is not None else {}
    usable = {t: p.usable_bytes for t, p in profiles.items()}
    out = []
    for t in sorted({j.gpu_type for j in jobs if j.gpu_type}):
        js = [j for j in jobs if j.gpu_type == t and j.record is not None and j.measured_bytes]
        p = profiles.get(t)
        if p is None:
            try:
                p = get_profile(t)
            except VestError:
                p = None
        floor_mib, floor = (p.context_mib, p.floor) if p is not None else (0, "")
        if not js:
            out.append(TypeAudit(t, 0, 0, None, None, None, 0, floor, floor_mib, None))
            continue
        m = [j.measured_bytes for j in js]
        need = [j.record.need_bytes for j in js]
        req = [j.record.request_bytes for j in js]
        below = sum(q < mm or j.oom for q, mm, j in zip(req, m, js))
        smaller = 0
        for j, mm in zip(js, m):
            here = usable.get(t, 0)
            # the measured peak with this type's floor swapped for the other type's would fit it
            for other, cap in usable.items():
                if other != t and cap < here and not j.oom:
                    of = profiles[other].context_mib * MiB
                    if mm - j.record.floor_bytes + of <= cap:
                        smaller += 1
                        break
        rest = [(j.record.need_bytes - j.record.floor_bytes) / MiB for j in js]
        lm = local_memory_mib(p.capability, p.sm_count) if p is not None else 0
        rec = recommend(rest, [x / MiB for x in m], lm, alpha, current_floor_mib=floor_mib if p is not None else None)
        out.append(TypeAudit(
            t, len(js), sum(j.oom for j in js),
            statistics.median(abs(n_ - mm) / mm for n_, mm in zip(need, m)), below / len(js),
            statistics.median((q - mm) / mm for q, mm in zip(req, m)), smaller, floor, floor_mib, rec))
    return out


# ---------------------------------------------------------------- report

def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def report_text(jobs: Sequence[AuditJob], types: Sequence[TypeAudit]) -> str:
    from tabulate import tabulate

    rows = []
    for a in types:
        r = a.recommendation
        rows.append([a.gpu_type, a.jobs, a.oom_jobs, _pct(a.median_abs_err), _pct(a.below_share), _pct(a.median_over),
                     a.smaller_type_jobs, f"{a.floor_mib} {a.floor}",
                     "" if r is None else f"{r.context_mib}{'' if r.floor_from_jobs else ' (kept)'}", "" if r is None else f"{r.headroom_percent:g}%",
                     "" if r is None else (f"<= {100 * r.bound:.1f}% (n={r.n})" + ("" if r.guaranteed else ", max")),
                     "" if r is None else f"{r.would_below} / {_pct(r.would_over)}"])
    hdr = ["GPU type", "jobs", "CUDA OOM", "median |err|", "request < meas", "median over-prov", "fit a smaller type",
           "floor now", "context_mib", "headroom", "P(request < peak)", "past jobs: below / over-prov"]
    lines = [tabulate(rows, headers=hdr, disable_numparse=True)]
    no_est = [j.job_id for j in jobs if j.record is None]
    no_meas = [j.job_id for j in jobs if j.record is not None and not j.measured_bytes]
    if no_est:
        lines.append(f"{len(no_est)} job(s) without a vest estimate (no record, no #VEST-ESTIMATE in a stored script)")
    if no_meas:
        lines.append(f"{len(no_meas)} job(s) without a measured peak (no gres/gpumem, Jobstats or --measured line): "
                     + " ".join(no_meas[:10]))
    for j in jobs:
        if j.oom:
            lines.append(f"job {j.job_id}: died of CUDA out of memory on {j.gpu_type} (measured peak is a lower bound)")
        elif j.note:
            lines.append(f"job {j.job_id}: {j.note}")
    for a in types:
        r = a.recommendation
        if r is not None and not r.floor_from_jobs:
            lines.append(f"{a.gpu_type}: {r.n} job(s), fewer than {MIN_FLOOR_JOBS}: the floor is kept, only the headroom "
                         "is fitted")
        if r is not None and not r.guaranteed:
            lines.append(f"{a.gpu_type}: {r.n} jobs; the {100 * ALPHA:g}% bound needs at least "
                         f"{math.ceil(1 / ALPHA) - 1}: the headroom is the largest error seen")
    return "\n".join(lines)


def report_json(jobs: Sequence[AuditJob], types: Sequence[TypeAudit]) -> dict:
    def rec(r):
        return None if r is None else {"context_mib": r.context_mib, "context_from_jobs": r.floor_from_jobs,
                                       "headroom_percent": r.headroom_percent,
                                       "jobs": r.n, "alpha": ALPHA, "guaranteed": r.guaranteed, "bound": r.bound,
                                       "past_jobs_below": r.would_below, "past_jobs_median_over": r.would_over}
    return {
        "types": [{"gpu_type": a.gpu_type, "jobs": a.jobs, "cuda_oom_jobs": a.oom_jobs,
                   "median_abs_err": a.median_abs_err, "request_below_share": a.below_share,
                   "median_over_provisioning": a.median_over, "fit_smaller_type_jobs": a.smaller_type_jobs,
                   "floor": {"context_mib": a.floor_mib, "source": a.floor}, "recommendation": rec(a.recommendation)}
                  for a in types],
        "jobs": [{"job_id": j.job_id, "gpu_type": j.gpu_type, "estimate_from": j.record_from or None,
                  "need_mib": j.record.need_bytes / MiB if j.record else None,
                  "request_mib": j.record.request_bytes / MiB if j.record else None,
                  "measured_mib": j.measured_bytes / MiB if j.measured_bytes else None,
                  "measured_from": j.measured_from or None, "cuda_oom": j.oom, "note": j.note or None}
                 for j in jobs],
    }


# ---------------------------------------------------------------- --apply

def _set_key(text: str, table: str, key: str, value: str) -> str:
    """``key = value`` in ``[table]`` of TOML text (replaced, or added under the table's header;
    the table is appended when missing). Comments and the rest are kept."""
    lines = text.splitlines()
    head = re.compile(r"^\s*\[\s*" + re.escape(table).replace(r"\.", r"\s*\.\s*") + r"\s*\]\s*(#.*)?$")
    any_head = re.compile(r"^\s*\[")
    start = next((i for i, ln in enumerate(lines) if head.match(ln)), None)
    if start is None:
        return text.rstrip("\n") + f"\n\n[{table}]\n{key} = {value}\n"
    end = next((i for i in range(start + 1, len(lines)) if any_head.match(lines[i])), len(lines))
    kre = re.compile(r"^\s*" + re.escape(key) + r"\s*=")
    for i in range(start + 1, end):
        if kre.match(lines[i]):
            lines[i] = f"{key} = {value}    # vest audit --apply"
            return "\n".join(lines) + "\n"
    lines.insert(start + 1, f"{key} = {value}    # vest audit --apply")
    return "\n".join(lines) + "\n"


def apply(path: str, types: Sequence[TypeAudit], now: str) -> tuple[str, str]:
    """Write the recommendations into the site config at ``path``: ``context_mib`` per GPU type
    (where the floor came from its jobs: MIN_FLOOR_JOBS), the policy's ``headroom_percent`` as the largest of the types' (one policy for the site). The
    new text is validated as the site config before anything is written; the old file is kept as
    ``<path>.bak-<now>``. Returns (backup path, the new text)."""
    from .config import parse_site_config

    with open(path) as f:
        old = f.read()
    new = old
    recs = [a for a in types if a.recommendation is not None]
    if not recs:
        raise VestError("vest audit --apply: no GPU type has jobs with both an estimate and a measured peak",
                        "give measurements (--measured CSV, gres/gpumem accounting, Jobstats) and audit again")
    for a in recs:
        if a.recommendation.floor_from_jobs:     # a floor kept for want of jobs is not a measurement
            new = _set_key(new, f"gpu.{a.gpu_type}", "context_mib", str(a.recommendation.context_mib))
    new = _set_key(new, "policy", "headroom_percent", f"{max(a.recommendation.headroom_percent for a in recs):g}")
    parse_site_config(new, path)     # raises SiteConfigError listing every problem; nothing written then
    backup = f"{path}.bak-{now}"
    with open(backup, "w") as f:
        f.write(old)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)
    return backup, new
