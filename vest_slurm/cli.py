"""`vest`: estimate a training job's GPU memory, check where a job script fits, run the bridge.

Only this entry point (and vsbatch's) turns the tool's own exceptions into a message and an exit
code; everything below raises.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .errors import EXIT_BAD_INPUT, VestError
from .workload import add_workload_arguments, spec_from_namespace

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
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py ... (dynamic analysis)")
    p.set_defaults(func=cmd_estimate)


def _site_for_estimate(path: str | None):
    """The site config `vest estimate` reads: one it was pointed to (an error if it cannot be read),
    else the default file where it exists, else None (built-in profiles)."""
    from .siteconfig import DEFAULT_PATH, ENV_VAR, load_site_config

    if path or os.environ.get(ENV_VAR) or os.path.exists(DEFAULT_PATH):
        return load_site_config(path)
    return None


def estimate_targets(gpus: list[str], site) -> dict:
    """{label: DeviceProfile} to estimate on. With a site config, a site GPU type is estimated as
    vsbatch places it (its profile, memory and calibrated floors) under its own name, and the
    default is the site's types; a built-in profile can still be named."""
    from .errors import WorkloadError
    from .profiles import PROFILES, get_profile

    site_types = {}
    if site is not None:
        from .advice import site_profiles

        site_types = site_profiles(site)
        if not gpus:
            return dict(site_types)
    elif not gpus:
        return dict(PROFILES)
    out = {}
    for g in gpus:
        if g in site_types:
            out[g] = site_types[g]
            continue
        try:
            p = get_profile(g)
        except WorkloadError as e:
            if not site_types:
                raise
            raise WorkloadError(f"unknown GPU type {g!r}", f"use one of the site's types ({', '.join(site_types)}) "
                                                           f"or a built-in profile: {', '.join(PROFILES)}") from e
        out[p.key] = p
    return out


def cmd_estimate(ns) -> int:
    from .estimator import estimates_for, gpu_class, trace_classes
    from .report import estimate_json, estimate_table, slow_types

    if ns.command and ns.command[0] == "--":
        ns.command = ns.command[1:]
    site = _site_for_estimate(ns.site_config)
    targets = estimate_targets(ns.gpu, site)
    t0 = time.perf_counter()
    if ns.command:
        from .dynamic import Limits, trace_command
        from .launch import parse_train_command
        from .trust import check_train_command

        if ns.model:
            raise VestError("give either --model ... or a training command after --, not both",
                            "drop --model to estimate the command, or drop the command")
        cmd = parse_train_command(ns.command)
        check_train_command(cmd, os.getcwd(), None, site)
        gpus = int(ns.num_gpus) if ns.num_gpus else None
        steps = int(ns.steps) if ns.steps else Limits().steps
        spec, summaries, run = trace_command(cmd, list(targets.values()), gpus, Limits(steps=steps),
                                             alloc_conf=ns.alloc_conf)
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
    kw = dict(profiles={name: p.key for name, p in targets.items()}, site_config=site.path if site else None)
    print(estimate_json(spec, estimates, seconds, **kw) if ns.json else estimate_table(spec, estimates, slow, **kw),
          end="" if not ns.json else "\n")
    return 0


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this GPU type's floor for the site config (run on a GPU node)",
                       description="Measure what PyTorch training processes hold on this node's GPU outside the "
                                   "caching allocator (CUDA context and loaded kernels): a few small jobs, each in "
                                   "a fresh process, and their median. Prints the [gpu.<type>] lines for the site "
                                   "config. Run it on each GPU type, e.g. "
                                   "`srun -p a100 --gres=gpu:1 vest calibrate --gres-type a100`.")
    p.add_argument("--gres-type", required=True, help="the GPU's gres type name in Slurm (e.g. a100)")
    p.add_argument("--profile", default=None, help="device profile (default: from the device name)")
    p.add_argument("--dry-run", action="store_true",
                   help="run the calibration jobs on this machine's CPU instead (checks they build here; measures nothing)")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(ns) -> int:
    from .calibrate import JOBS, run_jobs, site_lines
    from .profiles import get_profile, profile_for_device_name

    if ns.dry_run:
        results = run_jobs(device="cpu")
        print(f"dry run: the {len(results)} calibration jobs ran on the CPU "
              f"({', '.join(f'{r.name} {r.seconds:.1f} s' for r in results)}); nothing was measured. "
              f"On a GPU node: vest calibrate --gres-type {ns.gres_type}")
        return 0
    import torch

    if not torch.cuda.is_available():
        raise VestError("no CUDA GPU is visible to this process",
                        "run vest calibrate on a GPU node, e.g. srun --gres=gpu:1 vest calibrate --gres-type a100 "
                        "(or --dry-run here to check that its jobs build)")
    print(f"vest calibrate: {len(JOBS)} jobs on {torch.cuda.get_device_name(0)}, one process each ...", file=sys.stderr)
    results = run_jobs(device="cuda")
    first = results[0]
    profile = get_profile(ns.profile) if ns.profile else profile_for_device_name(first.device_name, int(first.total_mib or 0))
    if profile is None:
        raise VestError(f"no built-in profile matches {first.device_name!r}", "give --profile with the closest built-in type")
    print(site_lines(results, ns.gres_type, profile.key), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _ArgParser(prog="vest", description=__doc__.splitlines()[0])
    from . import __version__

    p.add_argument("--version", action="version", version=f"vest-slurm {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_ArgParser)
    _add_estimate(sub)
    _add_calibrate(sub)
    for hook in _EXTRA_COMMANDS:
        hook(sub)
    return p


def _add_check(sub) -> None:   # vest check (check.py)
    from .check import add_check_parser
    add_check_parser(sub)


# Other modules add subcommands here (check, bridge, calibrate) without cli.py importing them eagerly.
_EXTRA_COMMANDS: list = [_add_check]


def _add_bridge(sub) -> None:   # vest bridge (bridge/cli.py)
    from .bridge.cli import add_bridge_commands

    add_bridge_commands(sub)


_EXTRA_COMMANDS.append(_add_bridge)


def run(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or build_parser()
    try:
        ns = parser.parse_args(argv)
        if not getattr(ns, "func", None):
            parser.print_help(sys.stderr)
            return EXIT_BAD_INPUT
        return ns.func(ns)
    except VestError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
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


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(argv))


if __name__ == "__main__":
    main()
