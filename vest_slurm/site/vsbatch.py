"""`vsbatch [sbatch options] job.sh [script args]`: sbatch that estimates the job's GPU memory first.

What it does, in order:

1. Splits its command line as sbatch does (options up to the script; the rest goes to the script).
   Its own options: ``--dry-run`` (print the sbatch command instead of running it), ``--json`` (print
   the decision as one JSON object on stdout), ``--site-config PATH``.
2. Finds the script as sbatch 22.05 does (``search_path`` in src/common/proc_args.c, called from
   src/sbatch/opt.c with R_OK): a path starting with ``.`` or ``/`` is used as given; any other is
   looked up in the --chdir directory (else the current one) first, then in each ``$PATH`` directory.
   No script: read from stdin, as sbatch does.
3. Reads the workload from the script's ``#VEST`` lines (the options of ``vest estimate``). A script
   with none has its Python training command (``python train.py``, ``torchrun ...``, ``srun python``)
   estimated by dynamic analysis (dynamic.py); one with neither is passed to sbatch unchanged, with a
   note.
4. Asks Slurm for its partitions and their GPU types (cluster.py) and warns where the site config
   disagrees; partitions the config names but Slurm lacks are not chosen.
5. Estimates the job on every GPU type of the site (one device profile per gres type; the site's
   ``memory_mib`` is the capacity), places it (placement.py), explains on stderr (estimate, choice,
   why), and runs sbatch with the chosen partition and GPU option and every other option unchanged,
   on a copy of the script with the ``#VEST-ESTIMATE`` line (attach.py) after the shebang. The copy
   keeps the script's file name, so the default job name is the same as with sbatch; the user's
   ``--comment`` is never touched. sbatch's own output is printed as sbatch printed it.
6. When nothing fits it refuses before queueing anything: the estimate, the largest GPU, the
   shortfall, and what would fit (advice.py: largest batch, AMP, more GPUs).

Exit codes (errors.py): sbatch's own after a submission; 3 the job fits no GPU (nothing queued);
2 bad input (script, #SBATCH/#VEST lines, options, site config); 4 Slurm could not be asked;
5 the workload could not be traced; 70 a bug.

JSON (``--json``), one object: ``action`` (submit, refuse, pass-through, error), ``partition``,
``gres``, ``gpu_type``, ``estimate_mib`` (required MiB per GPU on the chosen, or closest, GPU type),
``needed_mib`` (with the site's headroom), ``capacity_mib``, ``changed``, ``reasons``, ``warnings``,
``message`` and ``reason`` (refusals), ``advice``, ``estimates`` (per gres type), ``workload``,
``sbatch_argv``, ``dry_run``, ``job_id``, ``sbatch`` (returncode, stdout, stderr), ``timing``
(seconds per phase), ``exit_code``.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence, TextIO

from .. import __version__
from ..estimate import progress
from ..errors import EXIT_NO_FIT, JobScriptError, SlurmError, VestError, WorkloadError
from ..slurm.jobscript import (VSBATCH_OPTIONS, JobScript, effective_options, gpu_request, has_option,
                        option_value, options_from_env, parse_job_script, parse_sbatch_argv,
                        partitions_of, read_job_script)
from .placement import estimate_need, needed_bytes
from ..units import MiB

EXIT_INTERNAL = 70
STDIN_NAME = "sbatch"        # sbatch names a job read from stdin "sbatch"
WAIT_TIMEOUT_S = 30 * 24 * 3600.0   # sbatch --wait blocks until the job ends

USAGE = """\
usage: vsbatch [--dry-run] [--json] [--site-config PATH] [sbatch options] job.sh [script args]

Estimate the job's peak GPU memory from its #VEST lines (or, without them, by running its Python
training command with fake CUDA), pick a partition and GPU that hold it, and submit with sbatch
(every other option unchanged). Refuses, queueing nothing, when no GPU of the site can hold it, and
says what would fit.

  --dry-run            print the sbatch command instead of running it
  --json               print the decision as one JSON object on stdout
  --site-config PATH   site configuration (else $VEST_SITE_CONFIG, else /etc/vest/site.toml)

In the script, next to #SBATCH:
  #VEST --model torchvision:resnet50 --batch-size 128 --input 3x224x224 --precision amp-bf16
(the options of `vest estimate --help`).

Exit codes: sbatch's own after a submission; 3 does not fit (nothing queued); 2 bad input;
4 Slurm unreachable; 5 workload could not be traced.
"""


# ---------------------------------------------------------------- the script path, as sbatch finds it

def resolve_script_path(script: str, cwd: str, path_env: str | None, chdir: str | None = None) -> str:
    """sbatch 22.05's ``search_path(opt.chdir, cmd, false, R_OK, false)``: ``./x``, ``../x`` and
    ``/x`` as given; any other name in the --chdir directory (else ``cwd``) first, then in each
    ``$PATH`` entry (relative entries are relative to that directory); the first file that exists
    and is not a directory wins. Not found anywhere: the name as given (opening it then fails)."""
    if not script or script.startswith((".", "/")):
        return script
    base = chdir or cwd
    if not path_env:   # an empty PATH: sbatch searches nothing and opens the name as given
        return script
    dirs = [base] + path_env.split(":")
    for d in dirs:
        d = d or "."
        full = os.path.join(base, d, script) if d.startswith(".") else os.path.join(d, script)
        if not os.path.isabs(full):
            full = os.path.join(cwd, full)
        if os.path.exists(full) and not os.path.isdir(full):
            return full
    return script


# ---------------------------------------------------------------- the decision

@dataclass
class Decision:
    """What vsbatch decided and did; rendered as text on stderr and as ``--json``."""

    action: str = "error"
    partition: str | None = None
    gres: str | None = None
    gpu_type: str | None = None
    estimate_bytes: int | None = None
    needed_bytes: int | None = None
    capacity_bytes: int | None = None
    changed: bool = False
    reasons: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    message: str = ""
    reason: str | None = None
    advice: list = field(default_factory=list)
    estimates: dict = field(default_factory=dict)      # gres type -> MemoryEstimate
    workload: dict | None = None
    sbatch_argv: list = field(default_factory=list)
    dry_run: bool = False
    job_id: int | None = None
    sbatch: dict | None = None
    timing: dict = field(default_factory=dict)
    exit_code: int = 0
    error: str | None = None
    fix: str | None = None
    backend: str | None = None
    timing_cluster_query: float | None = None
    not_estimated: list = field(default_factory=list)   # GPU types whose class could not change the choice
    error_kind: str | None = None    # who must act (VestError.kind)
    error_where: str | None = None   # the script's file:line

    def to_json(self) -> str:
        mib = lambda b: None if b is None else round(b / MiB, 1)  # noqa: E731
        doc = {
            "tool": "vsbatch", "version": __version__, "action": self.action,
            "partition": self.partition, "gres": self.gres, "gpu_type": self.gpu_type,
            "estimate_mib": mib(self.estimate_bytes), "needed_mib": mib(self.needed_bytes),
            "capacity_mib": mib(self.capacity_bytes), "changed": self.changed,
            "reasons": self.reasons, "warnings": self.warnings, "message": self.message,
            "reason": self.reason, "advice": [a.to_dict() for a in self.advice],
            "estimates": {t: {"profile": e.gpu, "required_mib": mib(e.required_bytes), "peak_mib": mib(e.peak_bytes),
                              "capacity_mib": mib(e.capacity_bytes)} for t, e in self.estimates.items()},
            "workload": self.workload, "sbatch_argv": self.sbatch_argv, "dry_run": self.dry_run,
            "job_id": self.job_id, "sbatch": self.sbatch,
            "timing": {k: round(v, 4) for k, v in self.timing.items()}, "exit_code": self.exit_code,
            "backend": self.backend, "not_estimated": self.not_estimated,
        }
        if self.error is not None:
            doc["error"], doc["fix"] = self.error, self.fix
            doc["kind"], doc["where"] = self.error_kind, self.error_where
        return json.dumps(doc, indent=2)


class _Clock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now

    def result(self) -> dict[str, float]:
        out = dict(self.phases)
        out["total_s_in_process"] = time.perf_counter() - self.t0
        age = _process_age_s()
        if age is not None:
            out["process_s"] = age
        return out


def _process_age_s() -> float | None:
    """Seconds since this process started (interpreter start-up and imports included); Linux only."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _user() -> str | None:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return None


def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _mib(b: int) -> str:
    return f"{b / MiB:,.0f} MiB"


# ---------------------------------------------------------------- run

class _Out:
    def __init__(self, stdout: TextIO, stderr: TextIO, as_json: bool):
        self.stdout, self.stderr, self.as_json = stdout, stderr, as_json

    def say(self, text: str) -> None:
        progress.done()   # the progress line (a terminal only) is cleared before a message
        for line in text.rstrip("\n").split("\n"):
            print(f"vsbatch: {line}", file=self.stderr)


def run(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
        stdin: TextIO | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """The whole command; returns the exit code. ``env`` is the environment Slurm and the site config
    are read from (default: os.environ)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if env is None else env)
    out = _Out(stdout or sys.stdout, stderr or sys.stderr, "--json" in argv)
    clock = _Clock()
    d = Decision()
    try:
        code = _run(argv, env, stdin or sys.stdin, out, clock, d)
    except VestError as e:
        print(f"vsbatch: error: {e}", file=out.stderr)
        d.action, d.error, d.fix, code = "error", e.what, e.fix, e.exit_code
        d.error_kind, d.error_where = e.kind, e.where
    except KeyboardInterrupt:
        print("vsbatch: interrupted (nothing was submitted unless sbatch said so)", file=out.stderr)
        return 130
    except Exception as e:  # a bug: say so plainly, keep the traceback for VEST_DEBUG=1
        if env.get("VEST_DEBUG"):
            raise
        print(f"vsbatch: internal error: {type(e).__name__}: {e}\n"
              f"  fix: this is a bug in vest-slurm; rerun with VEST_DEBUG=1 and report the traceback",
              file=out.stderr)
        d.action, d.error, code = "error", f"internal error: {type(e).__name__}: {e}", EXIT_INTERNAL
    progress.done()
    d.exit_code = code
    d.timing = clock.result()
    if d.timing_cluster_query is not None:   # overlapped with the estimate: not on the critical path
        d.timing["cluster_query_overlapped_s"] = d.timing_cluster_query
    if out.as_json and code is not None:
        print(d.to_json(), file=out.stdout, flush=True)
    return code


def _run(argv: list[str], env: dict[str, str], stdin: TextIO, out: _Out, clock: _Clock, d: Decision) -> int:
    cmd = parse_sbatch_argv(argv, VSBATCH_OPTIONS)
    own = dict(cmd.own)
    out.as_json = "json" in own
    d.dry_run = "dry-run" in own
    if has_option(cmd.options, "quiet"):   # sbatch's own --quiet/-Q: passed on, and no progress line
        progress.set_quiet(True)
    if has_option(cmd.options, "help") or has_option(cmd.options, "usage"):
        print(USAGE, end="", file=out.stdout)
        return 0
    cwd = os.getcwd()
    # --- the script
    if cmd.script is None and option_value(cmd.options, "wrap") is not None:
        clock.lap("parse_s")
        out.say("note: a --wrap job has no #VEST lines: submitting it unchanged, without a memory check")
        return _pass_through(cmd, None, None, env, out, clock, d)
    if cmd.script is None:
        text = stdin.read()
        js = parse_job_script(text, "<stdin>")
        script_path = None
    else:
        script_path = resolve_script_path(cmd.script, cwd, env.get("PATH"), option_value(cmd.options, "chdir"))
        js = read_job_script(script_path)
    for line in js.ignored_sbatch_lines:
        d.warnings.append(f"{js.path}: line {line}: #SBATCH below the first command; sbatch ignores it")
    train = None
    if not js.vest_directives:
        from ..dynamic.launch import find_train_command

        train = find_train_command([c.text for c in js.commands])
        if train is None:
            clock.lap("parse_s")
            out.say(f"note: {js.path} has no #VEST line and no Python training command: submitting it unchanged, "
                    "without a memory check (add e.g. `#VEST --model torchvision:resnet50 --batch-size 64`)")
            return _pass_through(cmd, js, script_path, env, out, clock, d)

    from .config import load_site_config
    from .trust import check_train_command, parse_directives

    site = load_site_config(own.get("site-config"), env)
    effective = effective_options(js.options, options_from_env(env), cmd.options)
    request = gpu_request(effective)
    partitions = partitions_of(effective)
    spec = None
    auto = False
    if train is None:
        from ..estimate.workload import split_num_gpus_auto

        lines = ", ".join(str(v.lineno) for v in js.vest_directives)
        vest_argv, auto = split_num_gpus_auto(js.vest_argv)
        try:
            spec = parse_directives(vest_argv, script_path, site)
        except WorkloadError as e:
            raise JobScriptError(f"{js.path}: #VEST line(s) {lines}: {e.what}", e.fix) from None
        if not auto:   # auto: the count is chosen below, once Slurm has said how many nodes there are
            from .autogpus import reconcile_shape

            said = any(w == "--num-gpus" or w.startswith("--num-gpus=") for w in js.vest_argv)
            spec, request, warned = reconcile_shape(spec, request, said, js.path)
            d.warnings += warned
        d.workload = spec.to_dict()
    else:
        check_train_command(train, option_value(effective, "chdir") or cwd, script_path, site)
    clock.lap("parse_s")

    # --- the cluster, asked while the estimate runs (it needs nothing from it; both are needed to place)
    from ..slurm.cluster import default_timeout_s, get_backend, reconcile

    backend, why = get_backend(env=env, timeout_s=default_timeout_s(env))
    d.backend = why
    query = _Background(backend.cluster_info)
    clock.lap("cluster_s")

    # --- the estimate
    from .advice import Prober, advisor

    prober = Prober.for_site(site, cache=True)
    classes = _class_order(prober, site, spec)
    pick = None
    try:
        if auto:
            pick = _choose_gpus(spec, request, partitions, site, prober, js, query, d)
            if pick is None:
                return _refuse_auto(spec, request, partitions, site, out, d)
            spec, request = pick.spec, pick.request
            d.workload = spec.to_dict()
            out.say(pick.text)
        if train is not None:
            spec, request = _trace_script(train, request, effective, site, prober, cwd, out)
            d.workload = spec.to_dict()
            d.warnings += [f"estimate flagged: {f}" for f in spec.flags]
        # The GPU class placement is likeliest to choose first (one trace); the others only
        # where they could change the choice (_settled).
        estimates, failed = prober.estimates(spec, classes[0])
    except BaseException:
        query.join()
        raise
    clock.lap("estimate_s")
    info = _cluster_info(query, d)
    d.timing_cluster_query = query.seconds
    if info is not None:
        d.warnings += reconcile(info, set(site.gpu_names), {p.name for p in site.partitions})
        present = tuple(p for p in site.partitions if info.partition(p.name) and info.partition(p.name).nodes)
        if present and len(present) < len(site.partitions):
            site = replace(site, partitions=present)
        # Slurm's node count of each partition (placement refuses a job asking for more nodes)
        site = replace(site, partitions=tuple(replace(p, nodes=len(info.partition(p.name).nodes))
                                              if info.partition(p.name) and info.partition(p.name).nodes else p
                                              for p in site.partitions))
    clock.lap("cluster_s")   # the wait for the query, if it outlasted the estimate
    rest = [t for c in classes[1:] for t in c]
    if rest and not _settled(spec, estimates, rest, request, partitions, site, prober, _user(),
                             option_value(effective, "account")):
        more, more_failed = prober.estimates(spec, rest)
        estimates, failed = {**estimates, **more}, {**failed, **more_failed}
        clock.lap("estimate_s")
    elif rest:
        d.not_estimated = rest
    if not estimates:
        raise next(iter(failed.values()))
    for t, e in failed.items():
        d.warnings.append(f"not placed on {t}: the workload cannot run there ({e.what})")
    d.estimates = estimates
    out.say(_estimate_line(spec, estimates, site, prober.trace_seconds))
    if d.not_estimated:
        slow = [t for t in d.not_estimated if prober.slow_untraced(spec, t)]
        why = f"; bf16 is emulated on {', '.join(slow)}, much slower" if slow else ""
        out.say(f"(not estimated on {', '.join(d.not_estimated)}: placement would not choose "
                f"{'it' if len(d.not_estimated) == 1 else 'them'} over {', '.join(estimates)} even if the job fit{why})")

    # --- placement (advice, when refused, is estimate time too)
    from .placement import NoFit, place

    advice_items: list = []
    advice_s = [0.0]
    give_advice = advisor(spec, site, prober, max(request.gpus_per_node, 1), sink=advice_items)

    def timed_advice(nofit):
        t = time.perf_counter()
        try:
            return give_advice(nofit)
        finally:
            advice_s[0] += time.perf_counter() - t

    account = option_value(effective, "account")
    result = place(estimates, request, partitions, site, user=_user(), account=account, advise=timed_advice,
                   slow=prober.slow_types(spec))
    clock.lap("place_s")
    if advice_s[0]:   # the advice's own estimates: estimate time, not placement's
        clock.phases["place_s"] -= advice_s[0]
        clock.phases["advice_s"] = advice_s[0]
    if isinstance(result, NoFit):
        d.action, d.reason, d.message, d.advice = "refuse", result.reason, result.message, advice_items
        if result.estimate is not None:
            d.estimate_bytes, d.gpu_type = estimate_need(result.estimate), result.closest.gpu_type if result.closest else None
        d.needed_bytes = result.needed_bytes or None
        d.capacity_bytes = result.largest_capacity_bytes or None
        for w in d.warnings:
            out.say(f"warning: {w}")
        print(result.message + "\nNothing was queued.", file=out.stderr)
        return EXIT_NO_FIT
    d.action, d.partition, d.gres, d.gpu_type = "submit", result.partition, result.gres, result.gpu_type
    d.estimate_bytes = estimate_need(result.estimate)
    cand = site.gpu(result.gpu_type)
    d.capacity_bytes = cand.memory_bytes if cand and cand.memory_bytes is not None else result.estimate.capacity_bytes
    d.needed_bytes = needed_bytes(estimate_need(result.estimate), site.policy.headroom_percent, site.policy.headroom_bytes)
    d.changed, d.reasons = result.changed, list(result.reasons)
    d.warnings += list(result.warnings)
    where = f"partition {result.partition}, --gres={result.gres}" if result.changed else \
        f"partition {result.partition} ({result.gres}), as you asked"
    out.say(f"placing on {where}: " + "; ".join(result.reasons))
    for w in d.warnings:
        out.say(f"warning: {w}")
    overrides = dict(result.overrides)
    if pick is None and request.nodes != gpu_request(effective).nodes:   # #VEST's count over its --gpus-per-node
        overrides["nodes"] = str(request.nodes)
        overrides.update(dict(request.overrides_for(result.gpu_type)))
    if pick is not None:   # --num-gpus auto: the chosen count, in the GPU option the user used, and nodes, tasks
        overrides.update(pick.overrides)
        overrides.update(dict(request.overrides_for(result.gpu_type)))
        d.changed = True
        d.reasons.insert(0, pick.text)
    if not partitions and "partition" not in overrides:
        # The user chose a GPU type but no partition: Slurm would use its default partition, which
        # may not have that type. Name the partition placement found it in.
        overrides["partition"] = result.partition
    return _submit(cmd, js, script_path, overrides, estimates, spec, env, out, clock, d)


def _class_order(prober, site, spec=None) -> list[list[str]]:
    """The site's GPU types grouped by capability class (one trace each), the class holding the
    type placement ranks first (smallest, or cheapest with selection = "cost") first; a type that
    emulates bf16 ranks last for a declarative job whose precision computes in it (where the trace
    says so, placement ranks it so: _settled then need not trace its class)."""
    from ..estimate.estimator import gpu_class
    from ..estimate.report import emulated_bf16

    bf16 = spec is not None and spec.computes_bf16
    groups: dict[bool, list[str]] = {}
    for t in site.gpu_names:
        groups.setdefault(gpu_class(prober.profiles[t]), []).append(t)
    rank = {t: _rank(site, prober, t, bf16 and bool(emulated_bf16(prober.profiles[t]))) for t in site.gpu_names}
    return sorted(groups.values(), key=lambda ts: min(rank[t] for t in ts))


def _rank(site, prober, gpu_type: str, slow: bool = False) -> tuple:
    """placement._best's order for the best candidate of ``gpu_type``: (slow, capacity, cost, position)
    for smallest-fit, (slow, cost, capacity, position) for cost."""
    import math

    best = None
    pos = 0
    for part in site.partitions:
        for t in part.gpu_types:
            pos += 1
            if t != gpu_type:
                continue
            gpu = site.gpu(t)
            cost = part.cost if part.cost is not None else gpu.cost
            cap = prober.capacity(t)
            key = ((slow, math.inf if cost is None else cost, cap, pos) if site.policy.selection == "cost"
                   else (slow, cap, 0 if cost is None else cost, pos))
            best = key if best is None else min(best, key)
    return best if best is not None else (True, math.inf, math.inf, math.inf)


def _settled(spec, estimates, missing, request, partitions, site, prober, user, account) -> bool:
    """Whether placement's choice on ``estimates`` (some GPU classes traced) stands whatever the
    ``missing`` types' estimates are: the user left the choice to vsbatch (no partition or GPU
    type), the chosen type fits, and every missing type ranks after it in placement's order even
    fitting, and at full speed unless it is known to be slow without its trace
    (Prober.slow_untraced: bf16 emulated there). Then their classes are not traced (a refusal, or anything less
    certain, traces them all: the closest fit and the advice need every type)."""
    from .placement import Placement, place

    if not estimates or partitions or request.gpu_type is not None:
        return False
    slow = {t: why for t, why in prober.slow_types(spec).items() if t in estimates}
    result = place(estimates, request, partitions, site, user=user, account=account, slow=slow)
    if not isinstance(result, Placement) or result.warnings:
        return False
    chosen = _rank(site, prober, result.gpu_type, result.gpu_type in slow)
    per_node, total = max(request.gpus_per_node, 1), max(request.total_gpus, 1)
    for t in missing:
        usable = any(t in p.gpu_types and per_node <= p.gpus_per_node
                     and (p.max_gpus_per_job is None or total <= p.max_gpus_per_job)
                     and (p.nodes is None or request.nodes <= p.nodes) for p in site.partitions)
        if usable and _rank(site, prober, t, prober.slow_untraced(spec, t)) < chosen:
            return False
    return True


class _Background:
    """One call in a thread (the cluster query: two subprocesses, waiting on Slurm, not the CPU)."""

    def __init__(self, fn):
        self._value = self._error = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._call, args=(fn,), daemon=True)
        self._thread.start()

    def _call(self, fn) -> None:
        t0 = time.perf_counter()
        try:
            self._value = fn()
        except BaseException as e:  # handed to the caller in result()
            self._error = e
        self.seconds = time.perf_counter() - t0

    def join(self) -> None:
        self._thread.join()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _trace_script(train, request, effective, site, prober, cwd: str, out: "_Out"):
    """Dynamic analysis: run the job's training command with fake CUDA, once per GPU class of the
    site, and give the prober its traces. The GPU count is the job's (#SBATCH), else the launcher's."""
    from ..dynamic.runner import Limits, trace_command

    gpus = request.total_gpus if request.wants_gpu else (train.world if train.world > 0 else max(train.nproc, 1))
    if not request.wants_gpu and gpus > 1:
        request = replace(request, gpus_per_node=gpus, total_gpus=gpus)
    limits = Limits.for_site(site)
    workdir = option_value(effective, "chdir") or cwd
    out.say(f"no #VEST line: estimating `{train.display}` by running it with fake CUDA "
            f"({limits.steps} optimizer steps, at most {limits.timeout_s:.0f} s)")
    progress.step(f"running `{train.display}` with fake CUDA")
    spec, summaries, _run = trace_command(train, list(prober.profiles.values()), gpus, limits, cwd=workdir)
    prober.add_script_traces(spec, summaries)
    from ..estimate.report import job_environment_notes

    for note in job_environment_notes(summaries.values()):
        out.say(f"note: {note}")
    prober.trace_seconds += sum(s.seconds for s in summaries.values() if not isinstance(s, VestError))
    return spec, request


def _cluster_info(query, d: Decision, unchecked: str = ""):
    """The cluster query's answer; on a dry run, None where Slurm could not be asked (said in the
    warnings, with what that leaves ``unchecked``)."""
    try:
        return query.result()
    except SlurmError as e:
        if not d.dry_run:
            raise
        d.warnings.append(f"Slurm not asked (dry run): {e.what}{unchecked}")
        return None


def _choose_gpus(spec, request, partitions, site, prober, js: JobScript, query, d: Decision):
    """#VEST --num-gpus auto (autogpus.py): the smallest count that fits, over the nodes Slurm has."""
    from .autogpus import choose, launch_shape

    info = _cluster_info(query, d, "; node counts not checked")
    nodes = {} if info is None else {p.name: len(info.partition(p.name).nodes) for p in site.partitions
                                     if info.partition(p.name) is not None}
    return choose(spec, request, partitions, site, prober, launch_shape(js), nodes, js.path)


def _refuse_auto(spec, request, partitions, site, out: "_Out", d: Decision) -> int:
    from .autogpus import MAX_AUTO_GPUS

    where = ", ".join(filter(None, ["partition " + ",".join(partitions) if partitions else "",
                                    f"GPU type {request.gpu_type}" if request.gpu_type else ""])) or "any GPU of this site"
    d.action, d.reason = "refuse", "no-fit"
    d.message = (f"vsbatch refused the job: #VEST --num-gpus auto: {spec.parallelism} at batch {spec.batch_size} per "
                 f"GPU fits per rank at no GPU count up to what the partitions take (at most {MAX_AUTO_GPUS}, "
                 f"the nodes Slurm has) on {where}. Lower the per-GPU batch, add --offload optimizer, "
                 "or ask `vest check` for what fits.")
    for w in d.warnings:
        out.say(f"warning: {w}")
    print(d.message + "\nNothing was queued.", file=out.stderr)
    return EXIT_NO_FIT


def _estimate_line(spec, estimates, site, seconds: float) -> str:
    parts = ", ".join(f"{t} {_mib(estimate_need(e))}" for t, e in estimates.items())
    gpus = f", {spec.num_gpus} GPUs" if spec.num_gpus > 1 else ""
    return (f"estimate for {_short(spec.model)} batch {spec.batch_size} per GPU{gpus}, {spec.precision}: "
            f"{parts} per GPU ({seconds:.1f} s; site headroom {site.policy.headroom_percent:g}% "
            f"+ {site.policy.headroom_bytes // MiB} MiB)")


def _client(env: dict[str, str], cmd) -> "object":
    from ..slurm.cluster import SlurmCLI, default_timeout_s

    wait = has_option(cmd.options, "wait")
    return SlurmCLI(env=env, timeout_s=WAIT_TIMEOUT_S if wait else default_timeout_s(env))


def _sbatch(cmd, argv: list[str], env, out: _Out, clock: _Clock, d: Decision, input: str | None = None) -> int:
    d.sbatch_argv = argv
    if d.dry_run:
        clock.lap("sbatch_s")
        if not out.as_json:
            from ..slurm.sbatch import format_command
            print(format_command(argv), file=out.stdout)
        return 0
    try:
        job_id, so, se, rc = _client(env, cmd).submit(argv[1:], input=input)
    except SlurmError as e:
        raise SlurmError(e.what, (e.fix or "") + "; the job may still have been queued: check `squeue --me` "
                         "before submitting again") from None
    clock.lap("sbatch_s")
    d.job_id = job_id
    d.sbatch = {"returncode": rc, "stdout": so, "stderr": se}
    if not out.as_json:
        out.stdout.write(so)
        out.stdout.flush()
    out.stderr.write(se)
    return rc


def _pass_through(cmd, js: JobScript | None, script_path: str | None, env, out, clock, d: Decision) -> int:
    from ..slurm.sbatch import build_sbatch_argv

    d.action = "pass-through"
    if js is not None and script_path is None:   # read from stdin: hand the same text to sbatch
        argv = build_sbatch_argv(cmd.options, None)
        return _sbatch(cmd, argv, env, out, clock, d, input=js.text)
    argv = build_sbatch_argv(cmd.options, cmd.script, cmd.script_args)
    return _sbatch(cmd, argv, env, out, clock, d)


def _submit(cmd, js: JobScript, script_path: str | None, overrides: dict, estimates, spec, env, out: _Out,
            clock: _Clock, d: Decision) -> int:
    from ..slurm.attach import attach, make_payload
    from ..slurm.sbatch import build_sbatch_argv

    if d.dry_run:
        shown = cmd.script   # as the user wrote it: sbatch finds it the same way
        argv = build_sbatch_argv(cmd.options, shown, cmd.script_args, overrides)
        if shown is None:
            out.say("(the script comes from stdin; vsbatch passes a copy with its estimate attached)")
        else:
            out.say(f"(vsbatch submits a copy of {js.path} with a #VEST-ESTIMATE line after the shebang)")
        return _sbatch(cmd, argv, env, out, clock, d)
    text = attach(js.text, make_payload(estimates, num_gpus=spec.num_gpus, batch_size=spec.batch_size))
    tmp = tempfile.mkdtemp(prefix="vsbatch-")
    try:
        # Same file name as the user's script: sbatch's default job name is the script's name.
        copy = Path(tmp) / (Path(script_path).name if script_path else STDIN_NAME)
        copy.write_bytes(text.encode("utf-8", errors="surrogateescape"))
        argv = build_sbatch_argv(cmd.options, str(copy), cmd.script_args, overrides)
        return _sbatch(cmd, argv, env, out, clock, d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
