#!/usr/bin/env python3
"""Leave-one-stack-out: the default floor (profiles.default_floor_mib) built without a stack, on that stack.

    scripts/bench_floors.py [--results FILE ...] [--out benchmarks/floors-results.csv]

The default results: benchmarks/accuracy-results.csv, with the rows of scripts/bench_accuracy.py
--job-cudnn row (each row with its job's cuDNN: benchmarks/accuracy-jobcudnn-carma.csv and
-milabench.csv, where present) in place of the same ids. There placement takes the cuDNN engines'
bound of a job whose cuDNN is not the one asked (column placement_mib): the request is what vsbatch
requests for that job, max(peak, required, placement) with the headroom. A later file's row replaces
an earlier one's of the same id; the table's title names the files read.

Reads a results file of scripts/bench_accuracy.py (each row's prediction and the floor it was
made with: columns floor_mib, or profiles.MEASURED_FLOORS for a file from before that column) and
re-floors every estimated NVIDIA row without tracing again: the rest of the estimate (allocator
peak, workspaces) does not depend on the floor, so the estimate with floor F is the prediction
minus its floor plus F (capped at the GPU's usable memory where the job still fits, as
estimator._peak_on does).

Last, the "shipped" rows: every stack kept, the default floors as the built-in profiles carry them
(the "default" figures of README's accuracy table).

For each group left out (a source, then a GPU type), the floors of the stacks measured without it
(MEASURED_FLOORS minus the left-out group's GPU types) give term 2's bound; the left-out rows are
estimated with the default floor that bound gives their board (term 1 + bound), and the request is
the default headroom's (placement.needed_bytes on max(peak, required)). Printed per group: rows,
requests below the measurement, median over-provisioning, median |error| of the peak, beside the
same rows with their own stack's floor (calibrated). One line per left-out group goes to --out.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tabulate import tabulate  # noqa: E402

from vest_slurm.estimate.profiles import (MEASURED_FLOORS, PROFILES, default_floor_mib,  # noqa: E402
                                          lazy_code_bound_mib)
from vest_slurm.site.config import Policy  # noqa: E402
from vest_slurm.site.placement import needed_bytes  # noqa: E402

MiB = 1 << 20
POLICY = Policy()
TARGET_BELOW, TARGET_OVER = 0.05, 0.15     # issue 25: at most 5% below, median over-provisioning at most 15%


RESULTS = [p for p in ("benchmarks/accuracy-results.csv", "benchmarks/accuracy-jobcudnn-carma.csv",
                       "benchmarks/accuracy-jobcudnn-milabench.csv") if os.path.exists(p)]


def load(paths) -> list[dict]:
    by_id: dict[str, dict] = {}
    for path in [paths] if isinstance(paths, str) else paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                if r["status"] == "ok" and r["vendor"] == "nvidia" and r["measured_peak_mib"] and r["profile"] in PROFILES:
                    by_id[r["id"]] = r
    rows = list(by_id.values())
    for r in rows:
        used = float(r.get("floor_mib") or MEASURED_FLOORS.get(r["profile"], PROFILES[r["profile"]].context_mib))
        r["_rest_peak"] = float(r["predicted_peak_mib"]) - used
        r["_rest_req"] = float(r["predicted_required_mib"]) - used
        # the cuDNN engines' bound (placement.estimate_need takes it where the job's cuDNN is not the one asked)
        r["_rest_place"] = float(r["placement_mib"]) - used if r.get("placement_mib") else 0.0
        r["_measured"] = float(r["measured_peak_mib"])
    return rows


def at_floor(r: dict, floor_mib: float) -> tuple[float, float, float]:
    """(peak, need, request) in MiB of row ``r`` with ``floor_mib``; need is what placement applies
    the headroom to (placement.estimate_need: peak, required, the cuDNN engines' bound)."""
    p = PROFILES[r["profile"]]
    usable = p.usable_bytes / MiB
    peak, req = r["_rest_peak"] + floor_mib, r["_rest_req"] + floor_mib
    if req <= usable < peak:
        peak = usable
    need = max(peak, req, r["_rest_place"] + floor_mib if r["_rest_place"] else 0.0)
    request = needed_bytes(math.ceil(need * MiB), POLICY.headroom_percent, POLICY.headroom_bytes) / MiB
    return peak, need, request


def metrics(rows: list[dict], floor_of) -> dict:
    below, over, err = 0, [], []
    for r in rows:
        peak, _, request = at_floor(r, floor_of(r))
        m = r["_measured"]
        below += request < m
        over.append((request - m) / m)
        err.append(abs(peak - m) / m)
    n = len(rows)
    return {"rows": n, "below": below / n, "over": statistics.median(over), "err": statistics.median(err)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", action="append", default=None,
                    help=f"results CSV of bench_accuracy.py (repeatable; default {' '.join(RESULTS)})")
    ap.add_argument("--out", default="benchmarks/floors-results.csv")
    a = ap.parse_args(argv)
    a.results = a.results or RESULTS
    rows = load(a.results)
    groups = [("source", s) for s in sorted({r["source"] for r in rows})] + \
             [("gpu type", k) for k in sorted({r["profile"] for r in rows})] + \
             [("shipped", s) for s in sorted({r["source"] for r in rows})] + [("shipped", "all")]
    table, out = [], []
    for kind, name in groups:
        if kind == "shipped":   # nothing left out: the default floors as profiles.py ships them
            left = [r for r in rows if name in ("all", r["source"])]
            types_out = {r["profile"] for r in left}
            kept = dict(MEASURED_FLOORS)
        else:
            left = [r for r in rows if (r["source"] if kind == "source" else r["profile"]) == name]
            types_out = {r["profile"] for r in left}
            kept = {k: f for k, f in MEASURED_FLOORS.items() if k not in types_out}
        if not kept:
            continue
        bound = lazy_code_bound_mib(kept)

        def default(r, kept=kept):
            p = PROFILES[r["profile"]]
            return default_floor_mib(p.capability, p.sm_count, kept)

        d = metrics(left, default)
        c = metrics(left, lambda r: MEASURED_FLOORS[r["profile"]])
        ok = d["below"] <= TARGET_BELOW and d["over"] <= TARGET_OVER
        floors = ", ".join(f"{k} {default(next(r for r in left if r['profile'] == k))}" for k in sorted(types_out))
        table.append([f"{kind}: {name}", d["rows"], ", ".join(sorted(kept)), bound, floors,
                      f"{100 * d['below']:.1f}%", f"{100 * d['over']:.1f}%", f"{100 * d['err']:.1f}%",
                      "yes" if ok else "NO", f"{100 * c['below']:.1f}%", f"{100 * c['over']:.1f}%"])
        out.append({"left_out": f"{kind}:{name}", "rows": d["rows"], "floors_kept": " ".join(sorted(kept)),
                    "lazy_code_bound_mib": bound, "default_floor_mib": floors,
                    "default_request_below": f"{d['below']:.4f}", "default_median_over": f"{d['over']:.4f}",
                    "default_median_abs_err": f"{d['err']:.4f}", "meets_target": int(ok),
                    "calibrated_request_below": f"{c['below']:.4f}", "calibrated_median_over": f"{c['over']:.4f}",
                    "calibrated_median_abs_err": f"{c['err']:.4f}"})
    hdr = ["left out", "rows", "floors kept", "term-2 bound MiB", "default floor MiB", "request < meas",
           "median over-prov", "median |err|", f"<= {100 * TARGET_BELOW:.0f}% / {100 * TARGET_OVER:.0f}%",
           "calibrated: < meas", "calibrated: over-prov"]
    print(f"Leave-one-stack-out on {' '.join(a.results)} ({len(rows)} NVIDIA rows): default floor = SMs x threads/SM x 1 KiB "
          f"+ the largest (floor - that) of the stacks kept; request = max(peak, required, cuDNN engines bound) x (1 + {POLICY.headroom_percent:g}%)\n")
    print(tabulate(table, headers=hdr, disable_numparse=True))
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out[0]))
        w.writeheader()
        w.writerows(out)
    print(f"\nresults: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
