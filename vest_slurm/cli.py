"""`vest`: estimate a training job's GPU memory, check where a job script fits, run the bridge.

Only this entry point (and vsbatch's) turns the tool's own exceptions into a message and an exit
code; everything below raises.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from .estimate import progress
from .errors import EXIT_BAD_INPUT, VestError
from .estimate.timeline import add_picture_arguments, write_pictures
from .estimate.workload import add_workload_arguments, spec_from_namespace

EXIT_INTERNAL = 70   # a bug in vest-slurm (EX_SOFTWARE)


class _ArgParser(argparse.ArgumentParser):
    def error(self, message):
        raise VestError(f"{self.prog}: {message}", f"see `{self.prog} --help`")


def _add_estimate(sub) -> None:
    p = sub.add_parser("estimate", help="estimate peak GPU memory of a training workload",
                       description="Estimate a training job's peak GPU memory on the CPU, per GPU type.")
    add_workload_arguments(p, required=False)
    p.add_argument("--gpu", action="append", default=[], metavar="TYPE",
                   help="GPU type (repeatable): one of the site config's, or a built-in profile such as a100-40gb; "
                        "default: the site config's types where there is one, else every built-in type")
    p.add_argument("--site-config", metavar="PATH",
                   help="site configuration (else $VEST_SITE_CONFIG, else /etc/vest/site.toml where it exists): "
                        "its GPU types, with the floors the site measured (`vest calibrate`)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_picture_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress line on stderr (shown only on a terminal)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py ... (dynamic analysis)")
    p.set_defaults(func=cmd_estimate)


def cmd_estimate(ns) -> int:
    from .estimate.estimator import estimates_for, gpu_class, trace_classes
    from .estimate.report import estimate_json, estimate_table, slow_types
    from .site.targets import estimate_targets, site_for_estimate

    if ns.command and ns.command[0] == "--":
        ns.command = ns.command[1:]
    site = site_for_estimate(ns.site_config)
    targets = estimate_targets(ns.gpu, site)
    t0 = time.perf_counter()
    if ns.command:
        from .dynamic.launch import parse_train_command
        from .dynamic.runner import Limits, trace_command
        from .site.trust import check_train_command

        if ns.model:
            raise VestError("give either --model ... or a training command after --, not both",
                            "drop --model to estimate the command, or drop the command")
        cmd = parse_train_command(ns.command)
        check_train_command(cmd, os.getcwd(), None, site)
        from .estimate.workload import _num_gpus

        gpus = _num_gpus(ns.num_gpus) if ns.num_gpus else None   # "auto": refused for a command (its launcher fixes it)
        # the site's [dynamic] limits, as vsbatch and vest check run the script (--steps wins)
        limits = Limits.for_site(site) if site is not None else Limits()
        if ns.steps:
            limits = dataclasses.replace(limits, steps=int(ns.steps))
        progress.step(f"running `{cmd.display}` with fake CUDA")
        spec, summaries, run = trace_command(cmd, list(targets.values()), gpus, limits, alloc_conf=ns.alloc_conf)
    elif ns.num_gpus == "auto":
        return _estimate_auto(ns, site, targets, t0)
    else:
        spec = spec_from_namespace(ns)
        summaries = trace_classes(spec, targets.values(), cache=True)
    estimates, failed = estimates_for(spec, summaries, targets)
    if not estimates:
        raise next(iter(failed.values()))
    for name, failure in failed.items():
        print(f"vest: not estimated on {name}: {failure.what}", file=sys.stderr)
    # where the trace computed in bf16 on a GPU that emulates it
    slow = slow_types(targets, lambda p: summaries.get(gpu_class(p)))
    seconds = time.perf_counter() - t0
    progress.done()
    from .estimate.report import trace_notes

    kw = dict(profiles={name: p.key for name, p in targets.items()}, site_config=site.path if site else None,
              trace_notes=trace_notes(summaries.values()))
    print(estimate_json(spec, estimates, seconds, **kw) if ns.json else estimate_table(spec, estimates, slow, **kw),
          end="" if not ns.json else "\n")
    write_pictures(ns, spec, lambda p: summaries.get(gpu_class(p)), targets)
    return 0


def _estimate_auto(ns, site, targets, t0) -> int:
    """`vest estimate --num-gpus auto`: per GPU type, the fewest GPUs at which the sharded job fits
    per rank (site/autogpus.py), each row estimated at its own count."""
    import json
    from dataclasses import replace

    from .errors import EstimateError
    from .estimate.report import estimate_json, estimate_table, trace_notes
    from .site.advice import Prober
    from .site.autogpus import MAX_AUTO_GPUS, smallest_counts

    ns.num_gpus = None
    spec = spec_from_namespace(ns)
    pol = site.policy if site else None
    prober = Prober(targets, pol.headroom_percent if pol else 0.0, pol.headroom_bytes if pol else 0)
    per_node = {g.name: max((p.gpus_per_node for p in site.partitions_with(g.name)), default=1)
                for g in site.gpus} if site else {}
    picks = smallest_counts(spec, prober, per_node)
    found = {t: p for t, p in picks.items() if p is not None}
    none = [t for t, p in picks.items() if p is None]
    if not found:
        raise EstimateError(f"--num-gpus auto: {spec.parallelism} fits per rank on none of "
                            f"{', '.join(targets)} at any count up to {MAX_AUTO_GPUS} GPUs",
                            "offload (--offload optimizer / params), checkpoint activations, or a smaller batch")
    progress.done()
    seconds = time.perf_counter() - t0
    summaries = [s for s in prober._traces.values() if not isinstance(s, Exception)]
    notes = [f"--num-gpus auto: " + "; ".join(f"{t}: {p.gpus} GPU(s), {p.nodes} node(s) x {p.per_node}"
                                               for t, p in found.items())
             + (f"; fits at no count up to {MAX_AUTO_GPUS} on {', '.join(none)}" if none else "")
             + f" (per-GPU batch {spec.batch_size}: the global batch is the count x {spec.batch_size})"]
    notes += trace_notes(summaries)
    kw = dict(profiles={name: p.key for name, p in targets.items()}, site_config=site.path if site else None,
              trace_notes=notes)
    if ns.json:
        doc = json.loads(estimate_json(spec, [replace(p.estimate, gpu=t) for t, p in found.items()], seconds, **kw))
        doc["workload"]["num_gpus"] = "auto"
        for row, p in zip(doc["estimates"], found.values()):
            row["num_gpus"], row["nodes"], row["gpus_per_node"] = p.gpus, p.nodes, p.per_node
        doc["num_gpus_auto"] = {t: (None if p is None else p.gpus) for t, p in picks.items()}
        print(json.dumps(doc, indent=2))
    else:
        rows = [replace(p.estimate, gpu=f"{t} x{p.gpus}") for t, p in found.items()]
        kw["profiles"] = {f"{t} x{p.gpus}": targets[t].key for t, p in found.items()}
        print(estimate_table(spec, rows, **kw), end="")
    return 0


def _add_site(sub) -> None:
    p = sub.add_parser("site", help="the site configuration (validate)",
                       description="Check a site configuration and show what vest reads from it.")
    ssub = p.add_subparsers(dest="site_cmd", metavar="SUBCOMMAND", parser_class=type(p))
    v = ssub.add_parser("validate", help="load and check a site config; print its GPU types, partitions and policy")
    v.add_argument("--site-config", metavar="PATH", help="site configuration (else $VEST_SITE_CONFIG, else /etc/vest/site.toml)")
    v.set_defaults(func=cmd_site_validate)


def cmd_site_validate(ns) -> int:
    """Every problem at once (SiteConfigError lists them); on success, what placement will use."""
    from .site.config import load_site_config
    from .units import MiB

    site = load_site_config(ns.site_config)
    print(f"{site.path}: valid")
    for g in site.gpus:
        mem = f"{g.memory_bytes // MiB} MiB" if g.memory_bytes is not None else "the profile's memory"
        ctx = f", context {g.context_mib} MiB (calibrated)" if g.context_mib is not None else ""
        print(f"  gpu {g.name}: profile {g.profile}, {mem}{ctx}")
    for part in site.partitions:
        print(f"  partition {part.name}: {', '.join(part.gpu_types)}, {part.gpus_per_node} GPUs per node")
    pol, b = site.policy, site.bridge
    print(f"  policy: headroom {pol.headroom_percent:g}% + {pol.headroom_bytes // MiB} MiB, {pol.selection}, "
          f"a choice too small: {pol.on_user_choice_too_small}")
    print(f"  bridge: timeout {b.timeout_s:g} s, fail {b.fail}, unknown jobs {b.unknown_jobs}, "
          f"directives {'traced as ' + b.directive_user if b.allow_vest_directives else 'off'}")
    print(f"  bridge budget across calls: {b.fallback_ms_per_s} ms/s of fallback, bucket {b.fallback_burst_ms} ms; "
          f"one call at most {b.call_limit_s:g} s; a submission waits at most {b.worst_wait_s:.1f} s behind the plugin")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser; the modules they come from import nothing heavy until a command runs."""
    from . import __version__
    from .bridge.cli import add_bridge_commands
    from .gpu.calibrate import add_calibrate_parser
    from .gpu.monitor import add_monitor_parser
    from .site.audit_cmd import add_audit_parser
    from .site.check import add_check_parser

    p = _ArgParser(prog="vest", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"vest-slurm {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_ArgParser)
    _add_estimate(sub)
    add_check_parser(sub)
    add_calibrate_parser(sub)
    add_bridge_commands(sub)
    _add_site(sub)
    add_audit_parser(sub)
    add_monitor_parser(sub)
    return p


def run(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or build_parser()
    try:
        ns = parser.parse_args(argv)
        progress.set_quiet(getattr(ns, "quiet", False))
        if not getattr(ns, "func", None):
            parser.print_help(sys.stderr)
            return EXIT_BAD_INPUT
        return ns.func(ns)
    except VestError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        if "--json" in (sys.argv[1:] if argv is None else argv):
            import json   # one object on stdout: error, kind (who must act), where (file:line), fix

            print(json.dumps(e.to_dict(), indent=2))
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug: say so plainly, keep the traceback for VEST_DEBUG=1
        if os.environ.get("VEST_DEBUG"):
            raise
        print(f"{parser.prog}: internal error: {type(e).__name__}: {e}\n"
              f"  fix: this is a bug in vest-slurm; rerun with VEST_DEBUG=1 and report the traceback", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        progress.done()


def main(argv: list[str] | None = None) -> None:
    from .estimate import oneshot

    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["bridge"]:   # the bridge's server and worker live on: the normal exit
        sys.exit(run(argv))
    oneshot.begin()
    oneshot.leave(run(argv))


if __name__ == "__main__":
    main()
