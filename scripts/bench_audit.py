#!/usr/bin/env python3
"""`vest audit` as a site would use it: learn the floor and headroom from the first half of each
stack's jobs, place the second half with them, measure.

    scripts/bench_audit.py [--results FILE ...] [--out benchmarks/audit-results.csv]

Reads a results file of scripts/bench_accuracy.py (as bench_floors.py does: the estimate without
its floor is the prediction minus the floor it was made with). Per source and GPU type (one site
stack each), the rows in id order are split in halves. The first half are the past jobs, placed
with the default floor (profiles.py, a type no site calibrated) and the default 10% headroom;
`vest audit`'s recommendation (site/audit.py: recommend) is computed from them. The second half
are placed with the recommended floor and headroom and compared with their measurements:
requests below the measurement and median over-provisioning (issue 25: at most 1% and 10%). The
same second half with the defaults is printed beside it. In id order the halves hold different
model families (ids start with the model name); the conformal bound assumes the next jobs are like
the past ones, so a second split, alternate rows in id order, is printed as well (``--split``). A site has one headroom policy; the last
line applies the largest recommended headroom of all types to every type.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tabulate import tabulate  # noqa: E402

from bench_floors import POLICY, RESULTS, at_floor, load  # noqa: E402
from vest_slurm.estimate.profiles import PROFILES, local_memory_mib  # noqa: E402
from vest_slurm.site.audit import recommend  # noqa: E402

TARGET_BELOW, TARGET_OVER = 0.01, 0.10


def placed(rows, floor_mib, headroom_pct):
    """(share below, median over-provisioning) of ``rows`` requested with this floor and headroom."""
    below, over = 0, []
    for r in rows:
        peak, req, _ = at_floor(r, floor_mib)
        q = max(peak, req) * (1 + headroom_pct / 100)
        m = r["_measured"]
        below += q < m
        over.append((q - m) / m)
    return below / len(rows), statistics.median(over)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", action="append", default=None,
                    help=f"results CSV of bench_accuracy.py (repeatable; default {' '.join(RESULTS)})")
    ap.add_argument("--out", default="benchmarks/audit-results.csv")
    ap.add_argument("--split", choices=("halves", "alternate", "both"), default="both")
    a = ap.parse_args(argv)
    a.results = a.results or RESULTS
    out = []
    for split in (("halves", "alternate") if a.split == "both" else (a.split,)):
        out += run(a, split)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out[0]))
        w.writeheader()
        w.writerows(out)
    print(f"results: {a.out}")
    return 0


def run(a, split: str) -> list[dict]:
    rows = load(a.results)
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["source"], r["profile"]), []).append(r)
    table, out, recs = [], [], {}
    for (src, prof), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["id"])
        if split == "halves":
            past, future = rs[:len(rs) // 2], rs[len(rs) // 2:]
        else:
            past, future = rs[0::2], rs[1::2]
        p = PROFILES[prof]
        default = p.context_mib
        rest = []
        for r in past:
            peak, req, _ = at_floor(r, default)
            rest.append(max(peak, req) - default)
        rec = recommend(rest, [r["_measured"] for r in past], local_memory_mib(p.capability, p.sm_count))
        recs[(src, prof)] = (rec, future)
        b, o = placed(future, rec.context_mib, rec.headroom_percent)
        db, do = placed(future, default, POLICY.headroom_percent)
        ok = b <= TARGET_BELOW and o <= TARGET_OVER
        table.append([src, prof, len(past), len(future), rec.context_mib, f"{rec.headroom_percent:g}%",
                      f"{'' if rec.guaranteed else 'max, '}<= {100 * rec.bound:.1f}%",
                      f"{100 * b:.1f}%", f"{100 * o:.1f}%", "yes" if ok else "NO",
                      f"{100 * db:.1f}%", f"{100 * do:.1f}%"])
        out.append({"split": split, "source": src, "gpu_type": prof, "past_jobs": len(past), "future_jobs": len(future),
                    "context_mib": rec.context_mib, "headroom_percent": rec.headroom_percent,
                    "guaranteed": int(rec.guaranteed), "bound": f"{rec.bound:.4f}",
                    "future_below": f"{b:.4f}", "future_median_over": f"{o:.4f}", "meets_target": int(ok),
                    "default_future_below": f"{db:.4f}", "default_future_median_over": f"{do:.4f}"})
    site_h = max(rec.headroom_percent for rec, _ in recs.values())
    all_future = [(rec, r) for rec, fut in recs.values() for r in fut]
    below = sum(max(*at_floor(r, rec.context_mib)[:2]) * (1 + site_h / 100) < r["_measured"] for rec, r in all_future)
    over = statistics.median(max(*at_floor(r, rec.context_mib)[:2]) * (1 + site_h / 100) / r["_measured"] - 1
                             for rec, r in all_future)
    hdr = ["source", "GPU type", "past", "future", "context_mib", "headroom", "P(below) bound", "future < meas",
           "future over-prov", f"<= {100 * TARGET_BELOW:g}% / {100 * TARGET_OVER:g}%", "defaults: < meas",
           "defaults: over-prov"]
    what = "the first half (id order)" if split == "halves" else "alternate rows (id order)"
    print(f"vest audit on {what} of each source and GPU type as past jobs, applied to the others "
          f"({' '.join(a.results)}; {len(rows)} NVIDIA rows)\n")
    print(tabulate(table, headers=hdr, disable_numparse=True))
    print(f"\none site headroom ({site_h:g}%, the largest recommended) with each type's floor, all second halves "
          f"({len(all_future)} jobs): {100 * below / len(all_future):.1f}% below, median over-provisioning "
          f"{100 * over:.1f}%")
    out.append({"split": split, "source": "all", "gpu_type": "site headroom", "past_jobs": sum(o["past_jobs"] for o in out),
                "future_jobs": len(all_future), "context_mib": "", "headroom_percent": site_h, "guaranteed": "",
                "bound": "", "future_below": f"{below / len(all_future):.4f}",
                "future_median_over": f"{over:.4f}", "meets_target": int(below / len(all_future) <= TARGET_BELOW
                                                                          and over <= TARGET_OVER),
                "default_future_below": "", "default_future_median_over": ""})
    print()
    return out


if __name__ == "__main__":
    sys.exit(main())
