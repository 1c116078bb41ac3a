"""`vest check job.sh` / `vest check --model ...`: does the job fit, and where, on every GPU type of the site.

One row per GPU type of the site config: the estimate (per GPU), the capacity, the need with the
site's headroom, what is left, fits or not, the largest batch that fits (searched with the estimator,
advice.search_largest_batch; ``>=N`` when the search stopped at its budget or cap), and the
partitions with that GPU type. Below the table: where vsbatch would place the job (the same
placement.place call), or why it would refuse and what would fit. Nothing is submitted and Slurm is
not asked: the answer depends only on the workload and the site config.

Exit codes: 0 the job fits somewhere (vsbatch would submit it); 3 it fits nowhere; 2 bad input;
5 the workload could not be traced.
"""

from __future__ import annotations

import json
import os
import time

from tabulate import tabulate

from .. import __version__
from ..estimate import progress
from ..errors import EXIT_NO_FIT, JobScriptError, WorkloadError
from ..units import MiB
from ..estimate.workload import SHARDED, WorkloadSpec, add_workload_arguments, spec_from_namespace

SEARCH_BUDGET_S = 60.0


def add_check_parser(sub) -> None:
    p = sub.add_parser("check", help="does a job fit, and where: one row per GPU type of the site",
                       description="Estimate a job on every GPU type of the site and say where it fits, "
                                   "with the largest batch that fits each. Submits nothing.")
    p.add_argument("script", nargs="?", help="job script with #VEST lines (workload options given here override them)")
    add_workload_arguments(p, required=False)
    p.add_argument("--site-config", metavar="PATH", help="site configuration (else $VEST_SITE_CONFIG, else /etc/vest/site.toml)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-search", action="store_true", help="skip the largest-batch search (one estimate per GPU class)")
    from ..estimate.timeline import add_picture_arguments

    add_picture_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress line on stderr (shown only on a terminal)")
    p.add_argument("--search-budget", type=float, default=SEARCH_BUDGET_S, metavar="SECONDS",
                   help=f"stop starting new estimates for the batch search after this long (default {SEARCH_BUDGET_S:g})")
    p.set_defaults(func=cmd_check)


def _workload(ns, site=None):
    """(spec, GpuRequest, partitions, source) from the script's #VEST/#SBATCH lines and the options.
    Another user's script, in the hands of root or an exempt admin, is read as the bridge reads it
    (trust.py): no code of it runs."""
    from ..slurm.jobscript import GpuRequest, gpu_request, read_job_script
    from .trust import check_train_command, parse_directives

    from ..estimate.workload import NUM_GPUS_AUTO, split_num_gpus_auto

    ns.num_gpus_auto = ns.num_gpus == NUM_GPUS_AUTO   # resolved by cmd_check (autogpus.py)
    if ns.num_gpus_auto:
        ns.num_gpus = None
    from .autogpus import reconcile_shape

    if ns.script is None:
        spec = spec_from_namespace(ns)
        spec, request, _ = reconcile_shape(spec, GpuRequest(None, None, 0, 0), True, "options")
        return spec, request if request.wants_gpu else GpuRequest(None, None, 1, 1), (), "options"
    js = read_job_script(ns.script)
    base = None
    if js.vest_directives:
        lines = ", ".join(str(v.lineno) for v in js.vest_directives)
        try:
            vest_argv, auto = split_num_gpus_auto(js.vest_argv)
            ns.num_gpus_auto = ns.num_gpus_auto or (auto and ns.num_gpus is None)   # a count given here wins
            base = parse_directives(vest_argv, js.path, site)
        except WorkloadError as e:
            raise JobScriptError(f"{js.path}: #VEST line(s) {lines}: {e.what}", e.fix) from None
    elif not ns.model:
        from ..dynamic.launch import TORCHRUN_LIKE, find_train_command

        train = find_train_command([c.text for c in js.commands])
        if train is None:
            raise JobScriptError(f"{js.path} has no #VEST line, no Python training command, and no --model was given",
                                 "describe the workload in the script, e.g. #VEST --model torchvision:resnet50 "
                                 "--batch-size 64, or give the options here")
        check_train_command(train, os.getcwd(), js.path, site)
        request = gpu_request(js.options)
        if not request.wants_gpu:
            n = train.world if train.world > 0 else max(train.nproc, 1)
            per_node = train.nproc if train.world > 0 and train.launcher in TORCHRUN_LIKE else n
            request = GpuRequest(None, None, per_node, n, max(request.nodes, n // per_node))
        return train, request, js.partitions, js.path
    spec = spec_from_namespace(ns, base)
    request = gpu_request(js.options)
    said = ns.num_gpus is not None or any(w.startswith("--num-gpus") for w in js.vest_argv)
    if ns.num_gpus_auto:
        return spec, request, js.partitions, js.path
    spec, request, _ = reconcile_shape(spec, request, said, js.path)
    if not request.wants_gpu:
        request = GpuRequest(None, None, 1, 1, request.nodes)
    return spec, request, js.partitions, js.path


def cmd_check(ns) -> int:
    from .advice import Prober, advise, search_largest_batch
    from .placement import NoFit, estimate_need, needed_bytes, place
    from .config import load_site_config

    t0 = time.perf_counter()
    site = load_site_config(ns.site_config)
    spec, request, partitions, source = _workload(ns, site)
    if ns.search_budget <= 0:
        raise WorkloadError("--search-budget must be positive", "e.g. --search-budget 30, or --no-search")
    prober = Prober.for_site(site, cache=True)
    auto_text = None
    script_notes: list[str] = []
    if getattr(ns, "num_gpus_auto", False) and isinstance(spec, WorkloadSpec):
        from ..slurm.jobscript import read_job_script
        from .autogpus import LaunchShape, choose, launch_shape

        shape = launch_shape(read_job_script(ns.script)) if ns.script else LaunchShape()
        pick = choose(spec, request, partitions, site, prober, shape, {}, source)   # node counts: Slurm's, in vsbatch
        if pick is None:
            auto_text = (f"--num-gpus auto: {spec.parallelism} fits per rank at no GPU count up to what the "
                         f"partitions take; shown at {spec.num_gpus} GPU(s)")
        else:
            spec, request, auto_text = pick.spec, pick.request, pick.text
    if not isinstance(spec, WorkloadSpec):   # a training command: dynamic analysis, batch set by the script
        from ..dynamic.runner import Limits, trace_command

        limits = Limits.for_site(site)
        progress.step(f"running `{spec.display}` with fake CUDA")
        spec, summaries, _run = trace_command(spec, list(prober.profiles.values()), request.total_gpus, limits,
                                              cwd=os.getcwd())   # where sbatch would run it
        prober.add_script_traces(spec, summaries)
        ns.no_search = True
        from ..estimate.report import job_environment_notes

        script_notes = job_environment_notes(summaries.values())
    estimates, failed = prober.estimates(spec)
    if not estimates:
        raise next(iter(failed.values()))
    pol = site.policy
    searches = {}
    if not ns.no_search:
        prober.restart_budget(ns.search_budget)

        def search(t):
            need0 = needed_bytes(estimate_need(estimates[t]), pol.headroom_percent, pol.headroom_bytes)
            return search_largest_batch(lambda b: prober.needed(spec.with_(batch_size=b), t), prober.capacity(t),
                                        spec.batch_size, known={spec.batch_size: need0},
                                        floor_bytes=prober.floor_needed(spec, t))
        types = sorted(estimates, key=lambda t: prober.capacity(t))
        # GPU types that share the job's trace (one GPU class, or classes it holds on) share their
        # batch lines: searched together, the others beside them (Prober.in_groups)
        searches = dict(zip(types, prober.in_groups(types, search,
                                                    lambda t: id(prober.summary(spec, prober.profiles[t])))))
    smallest = {}
    # per GPU type: the smallest GPU (and node) count that fits per rank; a script's run is of its
    # own GPU count (other counts would be other runs), so it is not searched
    if spec.parallelism in SHARDED and not spec.model.startswith("script:"):
        from .advice import smallest_gpu_counts

        smallest = smallest_gpu_counts(spec, site, prober)
    slow = prober.slow_types(spec)
    result = place(estimates, request, partitions, site, slow=slow)
    advice = advise(spec, site, prober, result, max(request.gpus_per_node, 1),
                    more="--search-budget SECONDS gives it longer") if isinstance(result, NoFit) else ()
    rows = []
    for g in site.gpus:
        parts = [p.name for p in site.partitions_with(g.name)]
        cap = prober.capacity(g.name)
        if g.name not in estimates:
            err = failed.get(g.name)
            rows.append(dict(gpu=g.name, profile=g.profile, capacity_bytes=cap, estimate_bytes=None,
                             peak_bytes=None, needed_bytes=None, headroom_bytes=None, fits=False,
                             largest_batch=None, largest_batch_text="-", partitions=parts,
                             note=f"cannot run here: {err.what}" if err else "no estimate"))
            continue
        e = estimates[g.name]
        need = needed_bytes(estimate_need(e), pol.headroom_percent, pol.headroom_bytes)
        s = searches.get(g.name)
        rows.append(dict(gpu=g.name, profile=g.profile, capacity_bytes=cap, estimate_bytes=estimate_need(e),
                         peak_bytes=e.peak_bytes, needed_bytes=need, headroom_bytes=cap - need, fits=need <= cap,
                         largest_batch=s.batch if s else None, largest_batch_exact=bool(s and s.exact),
                         largest_batch_text=s.text() if s else "(not searched)", partitions=parts,
                         note=slow.get(g.name, ""), smallest_gpus=smallest.get(g.name)))
    seconds = time.perf_counter() - t0
    from ..estimate.timeline import write_pictures

    write_pictures(ns, spec, lambda p: prober.summary(spec, p), prober.profiles)
    progress.done()
    if ns.json:
        print(_json(spec, site, source, rows, result, advice, seconds, prober, auto_text, script_notes))
    else:
        print(_table(spec, site, source, rows, result, advice, seconds, prober, auto_text, script_notes), end="")
    return EXIT_NO_FIT if isinstance(result, NoFit) else 0


def _m(b) -> str:
    return "-" if b is None else f"{b / MiB:,.0f}"


def _table(spec, site, source, rows, result, advice, seconds, prober, auto_text=None, script_notes=()) -> str:
    from .placement import NoFit

    gpus = f"  {spec.num_gpus} GPUs" if spec.num_gpus > 1 else ""
    if spec.model.startswith("script:"):
        what = (f"{spec.model[len('script:'):].strip()}\n(dynamic analysis: the training command ran with fake "
                f"CUDA, batch {spec.batch_size} seen per GPU{gpus}; the batch is the script's, so no batch search)")
    else:
        what = (f"{spec.model}  batch {spec.batch_size} per GPU  input {spec.input}  {spec.optimizer}  "
                f"{spec.precision}{gpus}")
    head = (f"{what}\n(from {source}; site config {site.path}; headroom "
            f"{site.policy.headroom_percent:g}% + {site.policy.headroom_bytes // MiB} MiB)")
    table = tabulate(
        [[r["gpu"], r["profile"], _m(r["capacity_bytes"]), _m(r["estimate_bytes"]), _m(r["needed_bytes"]),
          _m(r["headroom_bytes"]), "yes" if r["fits"] else "NO", r["largest_batch_text"], ",".join(r["partitions"]) or "-"]
         for r in rows],
        headers=["GPU", "profile", "capacity MiB", "estimate MiB", "with headroom", "left MiB", "fits",
                 "largest batch", "partitions"],
        tablefmt="simple", disable_numparse=True,
        colalign=("left", "left", "right", "right", "right", "right", "left", "right", "left"))
    notes = [f"FLAGGED: {f}" for f in spec.flags] + [f"{r['gpu']}: {r['note']}" for r in rows if r["note"]]
    notes += [auto_text] if auto_text else []
    notes += [f"note: {n}" for n in script_notes]
    if spec.parallelism in SHARDED and not spec.model.startswith("script:"):
        for r in rows:
            sm = r.get("smallest_gpus")
            notes.append(f"{r['gpu']}: smallest {spec.parallelism} configuration that fits: " + (
                f"{sm[0]} GPUs ({sm[1]} node{'s' if sm[1] > 1 else ''}), {_m(sm[2])} MiB per GPU with headroom"
                if sm else "none up to the largest job a partition takes") + f" (batch {spec.batch_size} per GPU)")
    if isinstance(result, NoFit):
        verdict = result.message.replace("vsbatch refused the job", "vsbatch would refuse the job", 1)
    else:
        verdict = (f"vsbatch would submit to partition {result.partition} (--gres={result.gres}): "
                   + "; ".join(result.reasons))
    if advice:   # what vsbatch would say with its refusal: AMP, activation checkpointing, more GPUs
        verdict += "\nWhat would fit:\n" + "\n".join(f"  - {a.text}" for a in advice)
    scaled = f", {prober.traces_scaled} more from batch lines" if prober.traces_scaled else ""
    tail = [f"({seconds:.1f} s, {prober.traces_made} trace(s){scaled}"
            + ("; the batch search stopped at its budget: >=N is a lower bound" if prober.stopped else "") + ")"]
    return "\n\n".join([head, table] + (["\n".join(notes)] if notes else []) + [verdict] + tail) + "\n"


def _json(spec, site, source, rows, result, advice, seconds, prober, auto_text=None, script_notes=()) -> str:
    from .placement import NoFit

    mib = lambda b: None if b is None else round(b / MiB, 1)  # noqa: E731
    gpus = [{"gpu": r["gpu"], "profile": r["profile"], "capacity_mib": mib(r["capacity_bytes"]),
             "estimate_mib": mib(r["estimate_bytes"]), "peak_mib": mib(r["peak_bytes"]),
             "needed_mib": mib(r["needed_bytes"]), "headroom_mib": mib(r["headroom_bytes"]), "fits": r["fits"],
             "largest_batch": r["largest_batch"], "largest_batch_exact": r.get("largest_batch_exact", False),
             "partitions": r["partitions"], "note": r["note"],
             "smallest_gpus": (dict(zip(("gpus", "nodes", "needed_mib"), (r["smallest_gpus"][0], r["smallest_gpus"][1],
                                                                          mib(r["smallest_gpus"][2]))))
                               if r.get("smallest_gpus") else None)} for r in rows]
    if isinstance(result, NoFit):
        placement = {"action": "refuse", "reason": result.reason, "message": result.message,
                     "partition": None, "gres": None}
    else:
        placement = {"action": "submit", "partition": result.partition, "gres": result.gres,
                     "gpu_type": result.gpu_type, "changed": result.changed, "reasons": list(result.reasons),
                     "warnings": list(result.warnings)}
    return json.dumps({"tool": "vest check", "version": __version__, "source": source, "site_config": site.path,
                       "workload": spec.to_dict(), "gpus": gpus, "placement": placement, "num_gpus_auto": auto_text,
                       "notes": list(script_notes),
                       "advice": [a.to_dict() for a in advice], "traces": prober.traces_made, "traces_scaled": prober.traces_scaled,
                       "search_stopped": prober.stopped, "seconds": round(seconds, 3)}, indent=2)
