#!/usr/bin/env python3
"""Accuracy of vest's estimate against measured runs, beside two baselines.

    scripts/bench_accuracy.py --data shared/groundtruth/carma.csv --data shared/groundtruth/milabench.csv \
        --out results.csv [--confidence high,medium] [--plot pred_vs_meas.png] [--limit N] [--filter REGEX] [--workers N]
        [--floors calibrated|default] [--job-cudnn row|asked]

Each row of a ground-truth CSV (schema: shared/groundtruth/README.md) is rebuilt as a WorkloadSpec
(scripts/groundtruth.py, row_to_spec) and estimated for the row's GPU (profiles.profile_for_device_name).
Rows that differ only in GPU share one trace (per spec and capability class, as estimator.estimate
does); a process pool runs the traces, one task per distinct trace, so each trace runs once.

Written per row: our peak (what nvidia-smi shows) and required (the least the job runs in), the
request vsbatch would make (the peak with the site's default headroom, placement.needed_bytes),
and two baselines:
- live_tensor_mib: CUDA context + the live-tensor peak of the same trace, what a FakeTensor or
  torch MemTracker count gives (no allocator rounding, caching or fragmentation, no cuDNN);
- param_rule_mib: weights + gradients + optimizer states (Adam/AdamW 2 per parameter, SGD with
  momentum 1, plain SGD 0; the others as workload.OPTIMIZER_TABLE counts them), the rule of
  `accelerate estimate-memory` (no activations, no context).
Baseline requests use the same headroom rule, so the three columns compare like with like.

Floors (profiles.py): with ``--floors calibrated`` (the default) each GPU type with a measured stack
gets that stack's floor (profiles.MEASURED_FLOORS, as `vest calibrate` there would set it), the
figures a site gets once it calibrated; ``--floors default`` uses the built-in profiles as they ship,
the floor of a type no site calibrated. The columns ``floor`` and ``floor_mib`` say which each row
used; scripts/bench_floors.py re-floors a results file without tracing again.

cuDNN (issue 25 item 2): with ``--job-cudnn row`` each row is estimated as vsbatch estimates a job
whose torch ships another cuDNN than the one asked here: $VEST_JOB_CUDNN is the row's
(groundtruth.job_cudnn: milabench's torch 2.6.0+cu126 ships 9.5.1, before 9.8, so it cannot be asked
without a GPU; CARMA's is unknown), and placement takes the largest workspace over the engines
cuDNN may pick (column ``placement_mib``, estimator._engines_bound; peak stays the first plan's).
The request column is then what vsbatch requests for that job (placement.estimate_need). ``asked``
(the default) leaves $VEST_JOB_CUDNN as it is.

Rows on AMD GPUs (no built-in profile: ROCm) are estimated with a stand-in profile (the H100
profile's context and workspaces, the row's memory size) and reported as their own group; nothing
is tuned on them. A row that cannot be rebuilt or traced is written with its status and reason.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import math
import multiprocessing as mp
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# The benchmarks time the work itself: no trace cache and no stored cuDNN answers (tracecache.py).
os.environ["VEST_CACHE_DIR"] = "off"

from tabulate import tabulate  # noqa: E402

from groundtruth import RowSkip, is_amd, job_cudnn, row_to_spec  # noqa: E402
from vest_slurm.site.placement import needed_bytes  # noqa: E402
from vest_slurm.site.config import Policy  # noqa: E402
from vest_slurm.estimate.workload import OPTIMIZER_TABLE  # noqa: E402

MiB = 1 << 20
POLICY = Policy()   # the site's default headroom (siteconfig.Policy defaults)

COLUMNS = ["id", "source", "gpu", "vendor", "profile", "floor", "floor_mib", "confidence", "model_kind", "model_name", "batch_size",
           "precision", "job_cudnn", "predicted_peak_mib", "predicted_required_mib", "placement_mib", "request_mib", "measured_peak_mib",
           "rel_err", "live_tensor_mib", "live_tensor_rel_err", "live_tensor_request_mib", "param_rule_mib",
           "param_rule_rel_err", "param_rule_request_mib", "seconds", "trace_seconds", "trace_shared",
           "status", "reason", "command"]


def request_bytes(need_bytes: float) -> int:
    """What vsbatch requests: placement's headroom rule with the default Policy."""
    return needed_bytes(math.ceil(need_bytes), POLICY.headroom_percent, POLICY.headroom_bytes)


# ------------------------------------------------------------------ profiles

FLOORS = "calibrated"   # --floors
JOB_CUDNN = "asked"     # --job-cudnn


def _floored(p):
    from vest_slurm.estimate.profiles import MEASURED_FLOORS, calibrated

    if p is not None and FLOORS == "calibrated" and p.key in MEASURED_FLOORS:
        return calibrated(p, MEASURED_FLOORS[p.key])
    return p


def row_profile(row: dict):
    """(profile, vendor) for the row's device; AMD gets a stand-in, see the module docstring."""
    from vest_slurm.estimate.profiles import PROFILES, profile_for_device_name

    total = _float(row.get("gpu_total_mib"))
    if is_amd(row):
        base = _floored(PROFILES["h100-80gb"])
        key = re.sub(r"[^a-z0-9]+", "-", row["gpu"].lower()).strip("-") + "-standin"
        return replace(base, key=key, name=row["gpu"], total_mib=int(total or base.total_mib),
                       reserved_mib=round((total or base.total_mib) * 0.01), vendor="amd"), "amd"
    p = profile_for_device_name(row.get("gpu", ""), int(total) if total else None)
    return _floored(p), "nvidia"


# ------------------------------------------------------------------ worker side

def _init_worker() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)   # fake tensors compute nothing; keep the two workers on two cores
    import vest_slurm.estimate.estimator  # noqa: F401  (import torch, torchvision, timm once per worker)
    import vest_slurm.estimate.tracing  # noqa: F401


def run_group(spec, profiles: list, cudnn: str = "") -> dict:
    """Trace ``spec`` once and estimate it for each profile (one task of the pool); ``cudnn``: the
    job's cuDNN for $VEST_JOB_CUDNN ("" leaves it as it is).
    Returns {"trace_seconds", "error", "results": [per profile dict or None]}."""
    from vest_slurm.errors import VestError
    from vest_slurm.estimate.cudnn_ws import JOB_CUDNN_ENV

    if cudnn:
        os.environ[JOB_CUDNN_ENV] = cudnn
    from vest_slurm.estimate.estimator import estimate_from_trace, trace_for

    t0 = time.perf_counter()
    try:
        summary = trace_for(spec, profiles[0])
    except VestError as e:
        return {"trace_seconds": time.perf_counter() - t0, "error": str(e).splitlines()[0], "results": None}
    except Exception as e:  # an estimator bug: keep the type, report it, keep going
        return {"trace_seconds": time.perf_counter() - t0,
                "error": f"internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                "results": None}
    trace_seconds = time.perf_counter() - t0
    results = []
    for p in profiles:
        t1 = time.perf_counter()
        try:
            est = estimate_from_trace(summary, spec, p)
        except Exception as e:
            results.append({"error": f"estimate failed: {type(e).__name__}: {e}"})
            continue
        results.append({
            "peak_bytes": est.peak_bytes, "required_bytes": est.required_bytes,
            "placement_bytes": est.placement_bytes,
            "context_bytes": p.context_mib * MiB, "live_peak_bytes": summary.live_peak_bytes,
            "param_bytes": summary.param_bytes, "seconds": time.perf_counter() - t1,
        })
    return {"trace_seconds": trace_seconds, "error": None, "results": results}


# ------------------------------------------------------------------ main side

@dataclass
class Row:
    data: dict
    out: dict = field(default_factory=dict)
    spec: object = None
    profile: object = None


def load_rows(paths: list[str]) -> list[Row]:
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                rows.append(Row(dict(r)))
    return rows


def _float(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _param_rule_bytes(param_bytes: int, optimizer: str) -> int:
    states = OPTIMIZER_TABLE[optimizer][2]
    return param_bytes * (2 + states)   # weights + gradients (same dtype) + states


def prepare(rows: list[Row], confidences: set[str], pattern, limit: int | None) -> list[Row]:
    """Fill the static columns; return the rows selected for estimation."""
    selected = []
    for row in rows:
        r = row.data
        row.out = {c: "" for c in COLUMNS}
        row.out.update({k: r.get(k, "") for k in ("id", "source", "gpu", "confidence", "model_kind", "model_name",
                                                   "batch_size", "precision")})
        row.out["measured_peak_mib"] = r.get("measured_peak_mib", "")
        if r.get("confidence", "") not in confidences:
            row.out.update(status="excluded", reason=f"confidence {r.get('confidence')!r} not in --confidence")
            continue
        if pattern and not pattern.search(r.get("id", "")):
            row.out.update(status="excluded", reason="--filter")
            continue
        if limit is not None and len(selected) >= limit:
            row.out.update(status="excluded", reason="--limit")
            continue
        selected.append(row)
        try:
            row.spec = row_to_spec(r)
        except RowSkip as e:
            row.out.update(status="skipped", reason=e.reason)
            continue
        profile, vendor = row_profile(r)
        row.out["vendor"] = vendor
        if profile is None:
            row.out.update(status="no_profile", reason=f"no device profile for {r.get('gpu')!r}")
            continue
        row.profile = profile
        row.out.update(profile=profile.key, floor=profile.floor, floor_mib=str(profile.context_mib))
        if JOB_CUDNN == "row":
            row.out["job_cudnn"] = job_cudnn(r)
        row.out["command"] = "vest estimate " + shlex.join(row.spec.to_argv()) + (
            f" --gpu {profile.key}" if vendor == "nvidia" else "")
    return selected


def run_all(selected: list[Row], workers: int) -> float:
    """Estimate every row with a spec and profile; return the wall time of the estimation."""
    groups: dict[tuple, list[Row]] = {}
    for row in selected:
        if row.spec is not None and row.profile is not None:
            key = (row.spec, row.profile.capability >= (8, 0), row.out.get("job_cudnn", ""))
            groups.setdefault(key, []).append(row)
    # Same model next to each other: FakeTensorMode's dispatch cache is per process and keyed by
    # op and shapes, so a worker gains from tracing one architecture's variants in sequence.
    order = sorted(groups, key=lambda k: (k[0].model, k[0].precision, k[0].batch_size))
    t0 = time.perf_counter()
    done = 0
    pending = list(order)
    attempts: dict[tuple, int] = {}
    while pending:
        ctx = mp.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker) as pool:
            futs = {pool.submit(run_group, k[0], [r.profile for r in groups[k]], k[2]): k for k in pending}
            pending = []
            for fut in cf.as_completed(futs):
                k = futs[fut]
                try:
                    res = fut.result()
                except cf.process.BrokenProcessPool:
                    # a worker died (an abort in native code): retry its tasks once in a fresh pool
                    attempts[k] = attempts.get(k, 0) + 1
                    if attempts[k] < 2:
                        pending.append(k)
                    else:
                        res = {"trace_seconds": 0.0, "error": "worker process died while tracing", "results": None}
                        _record(groups[k], res)
                    continue
                _record(groups[k], res)
                done += 1
                print(f"\r  traces {done}/{len(order)}  {time.perf_counter() - t0:6.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return time.perf_counter() - t0


def _record(rows: list[Row], res: dict) -> None:
    for i, row in enumerate(rows):
        out = row.out
        out["trace_seconds"] = f"{res['trace_seconds']:.2f}"
        out["trace_shared"] = "1" if i > 0 else "0"
        if res["error"]:
            out.update(status="failed", reason=res["error"], seconds=f"{res['trace_seconds']:.2f}")
            continue
        e = res["results"][i]
        if "error" in e:
            out.update(status="failed", reason=e["error"])
            continue
        measured = _float(row.data.get("measured_peak_mib"))
        live = e["context_bytes"] + e["live_peak_bytes"]
        rule = _param_rule_bytes(e["param_bytes"], row.spec.optimizer)
        out.update(
            status="ok",
            predicted_peak_mib=f"{e['peak_bytes'] / MiB:.1f}",
            predicted_required_mib=f"{e['required_bytes'] / MiB:.1f}",
            placement_mib=f"{e['placement_bytes'] / MiB:.1f}" if e["placement_bytes"] else "",
            request_mib=f"{request_bytes(max(e['peak_bytes'], e['required_bytes'], e['placement_bytes'])) / MiB:.1f}",
            live_tensor_mib=f"{live / MiB:.1f}",
            live_tensor_request_mib=f"{request_bytes(live) / MiB:.1f}",
            param_rule_mib=f"{rule / MiB:.1f}",
            param_rule_request_mib=f"{request_bytes(rule) / MiB:.1f}",
            seconds=f"{res['trace_seconds'] + e['seconds']:.2f}",
        )
        if measured:
            out["rel_err"] = f"{(e['peak_bytes'] / MiB - measured) / measured:+.4f}"
            out["live_tensor_rel_err"] = f"{(live / MiB - measured) / measured:+.4f}"
            out["param_rule_rel_err"] = f"{(rule / MiB - measured) / measured:+.4f}"


# ------------------------------------------------------------------ report

METHODS = (("vest", "predicted_peak_mib", "request_mib"),
           ("live-tensor", "live_tensor_mib", "live_tensor_request_mib"),
           ("param-rule", "param_rule_mib", "param_rule_request_mib"))


def _pct(x):
    return "" if x is None else f"{100 * x:.1f}%"


def _quantile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    i = q * (len(xs) - 1)
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def metrics(rows: list[Row], pred_col: str, req_col: str) -> dict:
    errs, under, req_under, over = [], 0, 0, []
    n = 0
    for row in rows:
        m = _float(row.out["measured_peak_mib"])
        p = _float(row.out[pred_col])
        q = _float(row.out[req_col])
        if not m or p is None:
            continue
        n += 1
        errs.append(abs(p - m) / m)
        under += p < m
        req_under += q < m
        over.append((q - m) / m)
    return {"rows": n, "median": statistics.median(errs) if errs else None, "p90": _quantile(errs, 0.9),
            "under": under / n if n else None, "req_under": req_under / n if n else None,
            "over": statistics.median(over) if over else None}


def group_table(rows: list[Row], keys: tuple[str, ...], title: str) -> str:
    ok = [r for r in rows if r.out["status"] == "ok"]
    groups: dict[tuple, list[Row]] = {}
    for r in ok:
        groups.setdefault(tuple(r.out[k] for k in keys), []).append(r)
    table = []
    for g in sorted(groups):
        for name, pc, rc in METHODS:
            m = metrics(groups[g], pc, rc)
            table.append(list(g) + [name, m["rows"], _pct(m["median"]), _pct(m["p90"]), _pct(m["under"]),
                                    _pct(m["req_under"]), _pct(m["over"])])
        table.append([""] * (len(keys) + 7))
    if table:
        table.pop()
    hdr = list(keys) + ["method", "rows", "median |err|", "p90 |err|", "pred < meas", "request < meas",
                        "median over-prov (request)"]
    return f"{title}\n" + tabulate(table, headers=hdr, disable_numparse=True)


def model_table(rows: list[Row], title: str) -> str:
    ok = [r for r in rows if r.out["status"] == "ok"]
    groups: dict[tuple, list[Row]] = {}
    for r in ok:
        groups.setdefault((r.out["source"], r.out["model_name"][:28], r.out["precision"][:14]), []).append(r)
    table = []
    for g in sorted(groups):
        rs = groups[g]
        signed = [float(r.out["rel_err"]) for r in rs if r.out["rel_err"]]
        m = metrics(rs, "predicted_peak_mib", "request_mib")
        table.append(list(g) + [m["rows"], _pct(statistics.median(signed)) if signed else "", _pct(min(signed)) if signed else "",
                                _pct(max(signed)) if signed else "", _pct(m["median"]), _pct(m["under"])])
    hdr = ["source", "model", "precision", "rows", "median err (signed)", "min err", "max err", "median |err|", "pred < meas"]
    return f"{title}\n" + tabulate(table, headers=hdr, disable_numparse=True)


def floor_table(rows: list[Row], title: str) -> str:
    """The CUDA-context floor each GPU type's rows imply, taken as `vest calibrate` takes it: per
    model and precision, its smallest-batch row's measured peak minus the estimate without the floor;
    the median over them is what profiles.py's context_mib is set to (benchmarks/README.md)."""
    from vest_slurm.estimate.profiles import MEASURED_FLOORS, PROFILES

    def used(o):   # the floor the row was estimated with (results from before the column: the measured one)
        return _float(o.get("floor_mib")) or MEASURED_FLOORS.get(o["profile"], PROFILES[o["profile"]].context_mib)

    per: dict[str, dict[tuple[str, str], tuple[int, float]]] = {}   # profile -> (model, precision) -> (batch, floor)
    for r in rows:
        o = r.out
        m, p = _float(o["measured_peak_mib"]), _float(o["predicted_peak_mib"])
        if o["status"] != "ok" or not m or p is None or o["profile"] not in PROFILES:
            continue
        floor = m - (p - used(o))
        key = (o["model_name"], o["precision"])
        best = per.setdefault(o["profile"], {}).get(key)
        b = int(o["batch_size"])
        if best is None or b < best[0] or (b == best[0] and floor > best[1]):
            per[o["profile"]][key] = (b, floor)
    table = []
    for prof in sorted(per):
        floors = sorted(f for _, f in per[prof].values())
        table.append([prof, len(floors), f"{statistics.median(floors):.0f}", f"{floors[0]:.0f} .. {floors[-1]:.0f}",
                      MEASURED_FLOORS.get(prof, ""), PROFILES[prof].context_mib])
    hdr = ["profile", "models x precisions", "median floor (MiB)", "range", "MEASURED_FLOORS", "default floor"]
    return f"{title}\n" + tabulate(table, headers=hdr, disable_numparse=True)


def failure_report(selected: list[Row]) -> str:
    bad = [r for r in selected if r.out["status"] not in ("ok",)]
    if not bad:
        return "Rows not estimated: none"
    groups: dict[tuple, list[Row]] = {}
    for r in bad:
        # one reason per cause: numbers (batch sizes, shapes) vary between rows of the same cause
        groups.setdefault((r.out["status"], re.sub(r"\d+", "N", r.out["reason"])), []).append(r)
    lines = [f"Rows not estimated: {len(bad)} ({len(groups)} distinct reasons)"]
    for (status, _), rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        first = rs[0]
        reason = first.out["reason"]
        reason = reason if len(reason) <= 220 else reason[:217] + "..."
        lines.append(f"- [{status}] x{len(rs)} ({', '.join(sorted({r.out['model_name'][:30] for r in rs}))}): {reason}")
        lines.append(f"    first: {first.out['id']}  reproduce: {first.out['command'] or '(no command: the row did not map)'}")
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot: matplotlib is not installed (pip install matplotlib); no plot written"
    ok = [r for r in rows if r.out["status"] == "ok" and _float(r.out["measured_peak_mib"])]
    fig, ax = plt.subplots(figsize=(7, 7))
    by: dict[str, list[Row]] = {}
    for r in ok:
        label = r.out["source"] + (" (AMD stand-in)" if r.out["vendor"] == "amd" else "")
        by.setdefault(label, []).append(r)
    for label, rs in sorted(by.items()):
        ax.scatter([float(r.out["measured_peak_mib"]) for r in rs], [float(r.out["predicted_peak_mib"]) for r in rs],
                   s=12, alpha=0.7, label=f"{label} ({len(rs)})")
    vals = [float(r.out["measured_peak_mib"]) for r in ok] + [float(r.out["predicted_peak_mib"]) for r in ok]
    if vals:
        lo, hi = min(vals) * 0.8, max(vals) * 1.25
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured peak (MiB)")
    ax.set_ylabel("vest predicted peak (MiB)")
    ax.set_title("vest estimate vs measured peak device memory")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot written to {path}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", action="append", default=[], help="ground-truth CSV (repeatable)")
    ap.add_argument("--out", required=True, help="results CSV, one line per input row")
    ap.add_argument("--confidence", default="high,medium", help="confidence levels to estimate (comma list)")
    ap.add_argument("--plot", default=None, help="write predicted vs measured (log-log) to this PNG")
    ap.add_argument("--limit", type=int, default=None, help="estimate at most N selected rows")
    ap.add_argument("--filter", default=None, help="only rows whose id matches this regex")
    ap.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--floors", choices=("calibrated", "default"), default="calibrated",
                    help="calibrated: each measured stack's own floor (profiles.MEASURED_FLOORS); default: the "
                         "built-in profiles' floors for uncalibrated types")
    ap.add_argument("--job-cudnn", choices=("row", "asked"), default="asked",
                    help="row: each row's job's cuDNN ($VEST_JOB_CUDNN; placement bounds the engines where it is not "
                         "the one asked); asked: as the environment says")
    ap.add_argument("--report-only", action="store_true",
                    help="read --out (a results CSV of an earlier run) and print its tables; estimate nothing")
    a = ap.parse_args(argv)
    global FLOORS, JOB_CUDNN
    FLOORS, JOB_CUDNN = a.floors, a.job_cudnn
    if not a.data and not a.report_only:
        ap.error("give at least one --data CSV")

    t_start = time.perf_counter()
    if a.report_only:
        with open(a.out, newline="") as f:
            rows = [Row({}, out=dict(r)) for r in csv.DictReader(f)]
        selected = [r for r in rows if r.out["status"] != "excluded"]
        n_traces = len({r.out["command"].rsplit(" --gpu", 1)[0] for r in selected if r.out["command"]})
        est_wall = sum(float(r.out["trace_seconds"] or 0) for r in selected if r.out["trace_shared"] == "0")
        print(f"report of {a.out} (estimation wall below = sum of trace seconds of that run)")
    else:
        rows = load_rows(a.data)
        confidences = {c.strip() for c in a.confidence.split(",") if c.strip()}
        selected = prepare(rows, confidences, re.compile(a.filter) if a.filter else None, a.limit)
        n_traces = len({(r.spec, r.profile.capability >= (8, 0)) for r in selected if r.spec is not None and r.profile is not None})
        print(f"{len(rows)} rows read, {len(selected)} selected, {n_traces} distinct traces, {a.workers} workers", file=sys.stderr)
        est_wall = run_all(selected, max(1, a.workers))
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            w.writeheader()
            for r in rows:
                w.writerow(r.out)

    nv = [r for r in selected if r.out["vendor"] != "amd"]
    amd = [r for r in selected if r.out["vendor"] == "amd"]
    headroom = f"{POLICY.headroom_percent:g}% + {POLICY.headroom_bytes // MiB} MiB"
    print(f"\nrequest = estimated peak x (1 + headroom) with the site's default headroom ({headroom}); "
          "over-prov = (request - measured) / measured\n")
    print(group_table(nv, ("source",), "NVIDIA rows, per source"))
    print()
    print(group_table(nv, ("gpu",), "NVIDIA rows, per GPU"))
    print()
    for r in nv:
        r.out["scope"] = "all NVIDIA"
    print(group_table(nv, ("scope",), "NVIDIA rows, all"))
    if amd:
        print()
        print(group_table(amd, ("source", "gpu"), "AMD rows (stand-in H100 profile; reported apart, nothing tuned on them)"))
    print()
    print(model_table(nv, "vest per model (NVIDIA rows)"))
    print()
    print(floor_table(nv, "Context floors the rows imply (per model, smallest batch; profiles.py takes the median)"))
    print()
    print(failure_report(selected))
    total = time.perf_counter() - t_start
    n_ok = sum(r.out["status"] == "ok" for r in selected)
    nv_sel = len(nv)
    import resource

    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    if not a.report_only:
        print(f"\nworkers' CPU time {cpu.ru_utime + cpu.ru_stime:.0f} s; load average now "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs (other processes slow the wall time)")
    print(f"rows: {len(selected)} selected ({nv_sel} NVIDIA, {len(amd)} AMD), {n_ok} estimated; "
          f"{n_traces} traces; estimation wall {est_wall:.0f} s, total wall {total:.0f} s; "
          f"{n_ok / est_wall if est_wall else 0:.2f} estimates/s ({n_traces / est_wall if est_wall else 0:.2f} traces/s) "
          f"with {a.workers} workers")
    if a.plot:
        print(plot(selected, a.plot))
    print(f"results: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
