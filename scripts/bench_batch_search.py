#!/usr/bin/env python3
"""The largest-batch search: the affine search (advice.search_largest_batch) against the search
before it (advice.bisection_search), same answers or not, and how many estimates each needs.

Workloads: the example job scripts with #VEST lines (scripts/examples/*.sbatch, on the testbed
site's GPU types with its headroom, as `vest check` searches them) and the accuracy workloads (one
per model, precision and source of the ground truth's high- and medium-confidence NVIDIA rows, the
row with the smallest batch, on the row's GPU, with the site's default headroom, as
scripts/bench_accuracy.py builds them; --data, where shared/groundtruth is at hand).

Both searches start from the workload's own batch with its need known (as `vest check` does). The
affine search runs on the workload's Prober, as `vest check` runs it (a batch's trace from a
confirmed line through two others: estimate/batch_scaling.py); the bisection after it on a Prober
of its own that traces every batch it asks for, so its answers are those of real traces. ``probes``
are the estimates each asked for, ``traced`` the traces each made, ``scaled`` the traces the
affine search took from a batch line. The
answers agree when they are equal, or "within resolution" when both are within the search's
resolution (1/64 above batch 64) of the boundary, which is all either promises.

    python scripts/bench_batch_search.py --out benchmarks/batch-search-compare.csv \
        --data ../shared/groundtruth/carma.csv --data ../shared/groundtruth/milabench.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
os.environ["VEST_CACHE_DIR"] = "off"   # every trace is made here, not read from an earlier run

from tabulate import tabulate  # noqa: E402

from vest_slurm.errors import VestError  # noqa: E402
from vest_slurm.estimate.workload import WorkloadSpec  # noqa: E402
from vest_slurm.site.advice import Prober, bisection_search, resolution, search_largest_batch  # noqa: E402
from vest_slurm.site.config import Policy, load_site_config  # noqa: E402
from vest_slurm.site.placement import estimate_need, needed_bytes  # noqa: E402
from vest_slurm.units import MiB  # noqa: E402

COLUMNS = ["workload", "source", "gpu", "batch", "new", "new_method", "new_probes", "new_traces", "new_scaled",
           "old", "old_probes", "old_traces", "agree", "seconds"]


def example_workloads(site_path: Path) -> list[tuple[str, WorkloadSpec, Prober, list[str]]]:
    from vest_slurm.site.trust import parse_directives
    from vest_slurm.slurm.jobscript import read_job_script

    site = load_site_config(str(site_path))
    out = []
    for path in sorted((ROOT / "scripts" / "examples").glob("*.sbatch")):
        js = read_job_script(str(path))
        if not js.vest_directives:
            continue   # dynamic analysis: the script fixes its batch, no search
        spec = parse_directives(js.vest_argv, str(path), site)
        out.append((os.path.relpath(path, ROOT), spec, Prober.for_site(site), list(site.gpu_names)))
    return out


def accuracy_workloads(paths: list[str], one_per_model: bool = False) -> list[tuple[str, WorkloadSpec, Prober, list[str]]]:
    from bench_accuracy import row_profile
    from groundtruth import RowSkip, is_amd, row_to_spec

    best: dict[tuple, tuple[int, dict]] = {}
    for p in paths:
        with open(p, newline="") as f:
            for r in csv.DictReader(f):
                if r.get("confidence") not in ("high", "medium") or is_amd(r):
                    continue
                k = (r["model_kind"], r["model_name"], r["precision"], r.get("num_gpus", "1")) if one_per_model else \
                    (r["source"], r["gpu"], r["model_kind"], r["model_name"], r["precision"], r.get("num_gpus", "1"))
                b = int(r["batch_size"])
                if k not in best or (b < best[k][0] and not one_per_model):
                    best[k] = (b, r)
    pol = Policy()
    out = []
    for k, (_, r) in sorted(best.items()):
        try:
            spec = row_to_spec(r)
        except RowSkip:
            continue
        profile, _ = row_profile(r)
        prober = Prober({profile.key: profile}, pol.headroom_percent, pol.headroom_bytes)
        out.append((r["id"], spec, prober, [profile.key]))
    return out


def compare(name: str, spec: WorkloadSpec, prober: Prober, types: list[str]) -> list[dict]:
    rows = []
    for t in types:
        t0 = time.perf_counter()
        row = {"workload": name, "gpu": t, "batch": spec.batch_size}
        try:
            est = prober.estimate(spec, t, bounded=False)
        except VestError as e:
            rows.append(dict(row, agree=f"not estimated: {e.what[:60]}"))
            continue
        need0 = needed_bytes(estimate_need(est), prober.headroom_percent, prober.headroom_bytes)
        cap = prober.capacity(t)
        made, scaled = prober.traces_made, prober.traces_scaled
        new = search_largest_batch(lambda b: prober.needed(spec.with_(batch_size=b), t), cap, spec.batch_size,
                                   known={spec.batch_size: need0}, floor_bytes=prober.floor_needed(spec, t))
        made, scaled = prober.traces_made - made, prober.traces_scaled - scaled
        # the search before, with every batch traced (no batch lines), on a Prober of its own
        alone = Prober(prober.profiles, prober.headroom_percent, prober.headroom_bytes, scale_batches=False)
        old = bisection_search(lambda b: alone.needed(spec.with_(batch_size=b), t), cap, spec.batch_size,
                               known={spec.batch_size: need0})
        if new.batch == old.batch:
            agree = "same"
        elif new.batch is not None and old.batch is not None and \
                abs(new.batch - old.batch) < max(resolution(new.batch), resolution(old.batch)):
            agree = "within resolution"
        else:
            agree = "DIFFERENT"
        rows.append(dict(row, new=new.text(), new_method=new.method, new_probes=len(new.probes), new_traces=made,
                         new_scaled=scaled, old=old.text(), old_probes=len(old.probes), old_traces=alone.traces_made,
                         agree=agree, seconds=round(time.perf_counter() - t0, 1)))
        print(f"  {name} {t}: new {new.text()} ({len(new.probes)} probes, {made} traced, {scaled} scaled, "
              f"{new.method}), old {old.text()} ({len(old.probes)} probes, {alone.traces_made} traced): {agree}",
              file=sys.stderr)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", action="append", default=[], help="ground-truth CSV (repeatable); none: examples only")
    ap.add_argument("--site-config", type=Path, default=ROOT / "site-config" / "testbed.toml")
    ap.add_argument("--filter", default="", help="only workloads whose name contains this")
    ap.add_argument("--one-per-model", action="store_true",
                    help="one accuracy workload per model and precision (the first source's row), not per GPU too")
    ap.add_argument("--max-seconds", type=float, default=None, help="start no workload after this long")
    ap.add_argument("--out", type=Path, default=Path("bench-results") / "batch-search-compare.csv")
    a = ap.parse_args()
    work = [("example", *w) for w in example_workloads(a.site_config)]
    work += [("accuracy", *w) for w in accuracy_workloads(a.data, a.one_per_model)]
    rows = []
    t0, left = time.perf_counter(), 0
    for source, name, spec, prober, types in work:
        if a.filter and a.filter not in name:
            continue
        if a.max_seconds is not None and time.perf_counter() - t0 > a.max_seconds:
            left += 1
            continue
        rows += [dict(r, source=source) for r in compare(name, spec, prober, types)]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    searched = [r for r in rows if "new_probes" in r]
    print(tabulate([[r["workload"], r["gpu"], r["batch"], r.get("new"), r.get("new_method"), r.get("new_probes"),
                     r.get("new_traces"), r.get("new_scaled"), r.get("old"), r.get("old_probes"), r.get("old_traces"),
                     r["agree"]] for r in rows],
                   headers=["workload", "GPU", "batch", "new", "method", "probes", "traced", "scaled", "old", "probes",
                            "traced", "answers"]))
    n = len(searched)
    same = sum(r["agree"] == "same" for r in searched)
    near = sum(r["agree"] == "within resolution" for r in searched)
    print(f"\n{n} searches: {same} the same answer, {near} within the resolution, {n - same - near} different; "
          f"probes {sum(r['new_probes'] for r in searched)} (affine) against {sum(r['old_probes'] for r in searched)} "
          f"(bisection); traced {sum(r['new_traces'] for r in searched)} and scaled "
          f"{sum(r['new_scaled'] for r in searched)} (affine, batch lines) against "
          f"{sum(r['old_traces'] for r in searched)} traced (bisection alone); affine held in {sum(r['new_method'] == 'affine' for r in searched)}, floor in "
          f"{sum(r['new_method'] == 'floor' for r in searched)}, bisection fallback in "
          f"{sum(r['new_method'] == 'bisection' for r in searched)}")
    if left:
        print(f"{left} workload(s) not started: --max-seconds {a.max_seconds:g} reached")
    print(f"results written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
