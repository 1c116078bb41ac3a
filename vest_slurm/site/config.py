"""The site configuration: GPU types, partitions, policy and the bridge, from one TOML file.

Where it is read from: ``--site-config PATH``, else ``$VEST_SITE_CONFIG``, else
``/etc/vest/site.toml``. Every key is documented in ``site-config/example-site.toml``.

Validation reports every problem at once (a SiteConfigError with the list): unknown keys are named
with the valid ones, types and ranges are checked, and partitions naming undefined GPU types are
caught. Out of the loader come frozen dataclasses only.
"""

from __future__ import annotations

import os
import re
import string
from dataclasses import dataclass
from typing import Any, Mapping

import toml

from ..errors import SiteConfigError
from ..estimate.profiles import PROFILES
from ..units import MiB

DEFAULT_PATH = "/etc/vest/site.toml"
ENV_VAR = "VEST_SITE_CONFIG"

# The device profiles the estimator knows.
DEVICE_PROFILES = tuple(PROFILES)

SELECTIONS = ("smallest-fit", "cost")
USER_CHOICE_POLICIES = ("reroute", "warn", "refuse")
FAIL_MODES = ("open", "closed")
UNKNOWN_JOB_POLICIES = ("allow", "warn", "refuse")

# Slurm's default MessageTimeout is 10 s: past it sbatch reports failure while the job may still be
# created (SLURM-TESTBED.md), so the bridge must give up well before.
MAX_BRIDGE_TIMEOUT_S = 10.0

# Message templates and the placeholders each may use ({help_url} everywhere).
MESSAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "refuse": ("help_url", "user", "reason"),
    "reroute": ("help_url", "user", "partition", "gres", "requested"),
    "warn": ("help_url", "user", "partition", "gres"),
    "unknown_job": ("help_url", "user"),
}
DEFAULT_MESSAGES: dict[str, str] = {
    "refuse": "See {help_url} for help with GPU memory.",
    "reroute": "Your job was moved to partition {partition} ({gres}) because {requested} is too small for it.",
    "warn": "Your job may run out of GPU memory on {partition} ({gres}).",
    "unknown_job": "Submit GPU jobs with vsbatch so their memory can be checked. See {help_url}",
}


@dataclass(frozen=True)
class GpuType:
    """``[gpu.<gres type>]``: a GPU type as named in Slurm's gres (``gpu:<name>:N``)."""

    name: str
    profile: str
    memory_bytes: int | None = None   # overrides the profile's capacity (MIG slice, reserved memory)
    cost: float | None = None
    context_mib: int | None = None    # measured by `vest calibrate` on this site's stack
    cudnn_mib: int | None = None      # likewise, what cuDNN adds for jobs that convolve
    nvswitch: bool | None = None      # its nodes have NVSwitch (NCCL's NVLS buffers); None: the profile's


@dataclass(frozen=True)
class Partition:
    """``[partition.<name>]``: a Slurm partition with GPU nodes."""

    name: str
    gpu_types: tuple[str, ...]
    gpus_per_node: int
    max_gpus_per_job: int | None = None
    cost: float | None = None         # overrides the GPU types' cost for this partition
    nodes: int | None = None          # nodes in the partition (None: unknown); vsbatch sets Slurm's count


@dataclass(frozen=True)
class Messages:
    """``[policy.messages]``: site texts appended to the tool's own explanation."""

    refuse: str = DEFAULT_MESSAGES["refuse"]
    reroute: str = DEFAULT_MESSAGES["reroute"]
    warn: str = DEFAULT_MESSAGES["warn"]
    unknown_job: str = DEFAULT_MESSAGES["unknown_job"]

    def render(self, kind: str, **values: object) -> str:
        """The message with its placeholders filled. Where the site has no help_url, the sentences
        that point to it are left out (an empty message where nothing else is said)."""
        template = getattr(self, kind)
        if not values.get("help_url"):
            template = " ".join(s for s in re.split(r"(?<=[.!?])\s+", template) if "{help_url}" not in s)
        return template.format_map({k: values.get(k, "") for k in MESSAGE_FIELDS[kind]}).strip()


@dataclass(frozen=True)
class Policy:
    """``[policy]``: how jobs are placed and refused."""

    # 10 %: the estimate's error on measured runs has p90 8.3 %, and the request falls below the
    # measured peak on 2.0 % of them (engines of another cuDNN version, passes the workload does not
    # describe; benchmarks/README.md).
    headroom_percent: float = 10.0
    headroom_bytes: int = 0
    selection: str = "smallest-fit"
    on_user_choice_too_small: str = "reroute"
    exempt_users: tuple[str, ...] = ()
    exempt_accounts: tuple[str, ...] = ()
    help_url: str = ""
    messages: Messages = Messages()

    def is_exempt(self, user: str | None, account: str | None) -> bool:
        return (user is not None and user in self.exempt_users) or (
            account is not None and account in self.exempt_accounts)


@dataclass(frozen=True)
class Bridge:
    """``[bridge]``: the job_submit.lua bridge."""

    timeout_s: float = 2.0
    fail: str = "open"
    unknown_jobs: str = "allow"
    allow_vest_directives: bool = False
    socket_path: str = "/run/vest/bridge.sock"
    log_path: str = "/var/log/vest/bridge.log"
    # The confined worker that traces allow-listed #VEST directives (bridge/sandbox.py): its user and
    # limits. CPU seconds per directive; memory (its data segment) for the whole process.
    directive_user: str = "nobody"
    directive_cpu_s: float = 60.0
    directive_memory_mib: int = 4096
    # The budget across calls (job_submit.lua): job_submit runs one call at a time (job_submit_lua.c
    # takes its lua_lock) while each waiting call's RPC thread holds the job read lock
    # (proc_req.c: validate_job_create_req under job_read_lock), so a writer — the next job's
    # job_allocate, the scheduler — waits for the whole queue, and every new reader (sinfo) waits
    # behind that writer (locks.c: a read lock waits while a write lock is pending). What stalls the
    # controller is the SUM of the plugin's calls. Time spent on anything but a healthy server's
    # answer (the per-call program, a server that hangs or dies) is drawn from a token bucket that
    # holds at most fallback_burst_ms and refills at fallback_ms_per_s; a call that finds it empty
    # takes the fail mode at once. No single call waits longer than call_limit_s.
    # The bucket's size is also the longest one call may stall a reader: the first call that finds a
    # hung server waits it out before the breaker opens, and an sinfo that came just after waits that
    # long plus the queued calls' own work (each a fail-mode answer or the Lua's own decision, about
    # 10 ms loaded: benchmarks/bench_bridge_burst.json's lua_call_ms) and the breaker's probes with an
    # empty bucket (0.1 s). 600 ms keeps such a reader within 1 s and still holds one run of the per-call
    # program (about 300 ms); at 800 ms the hang case measured an sinfo of 1,012 ms.
    fallback_ms_per_s: int = 200
    fallback_burst_ms: int = 600

    @property
    def call_limit_s(self) -> float:
        """The longest one call may hold the controller: the timeout, or the bucket's size."""
        return min(self.timeout_s, self.fallback_burst_ms / 1000)

    @property
    def worst_wait_s(self) -> float:
        """The longest a submission can queue behind the plugin's calls: the bucket and one call that
        overruns it (the retry of a request in flight when the server died may take the whole
        timeout), while fallbacks take the refill rate plus the Lua's retries of the server with an
        empty bucket (PROBE_FLOOR_S, 0.1 s once a second): (burst + timeout) / (1 - rate - 0.1).
        Kept below MessageTimeout."""
        return (self.fallback_burst_ms / 1000 + self.timeout_s) / (1 - self.fallback_ms_per_s / 1000 - 0.1)


@dataclass(frozen=True)
class Dynamic:
    """``[dynamic]``: limits of the dynamic analysis (the training script run with fake CUDA on
    the login node, as the user)."""

    timeout_s: float = 120.0
    memory_mib: int = 4096
    steps: int = 3


@dataclass(frozen=True)
class SiteConfig:
    path: str
    gpus: tuple[GpuType, ...]
    partitions: tuple[Partition, ...]
    policy: Policy = Policy()
    bridge: Bridge = Bridge()
    dynamic: Dynamic = Dynamic()

    def gpu(self, name: str) -> GpuType | None:
        return next((g for g in self.gpus if g.name == name), None)

    def partition(self, name: str) -> Partition | None:
        return next((p for p in self.partitions if p.name == name), None)

    def partitions_with(self, gpu_type: str) -> tuple[Partition, ...]:
        return tuple(p for p in self.partitions if gpu_type in p.gpu_types)

    @property
    def gpu_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.gpus)


# ---------------------------------------------------------------- loading

def resolve_path(path: str | None = None, env: Mapping[str, str] = os.environ) -> str:
    return path or env.get(ENV_VAR) or DEFAULT_PATH


def load_site_config(path: str | None = None, env: Mapping[str, str] = os.environ) -> SiteConfig:
    """Load and validate the site config (``path``, else ``$VEST_SITE_CONFIG``, else /etc/vest/site.toml)."""
    where = resolve_path(path, env)
    source = "--site-config" if path else (f"${ENV_VAR}" if env.get(ENV_VAR) else "the default path")
    try:
        with open(where, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise SiteConfigError(where, [f"file not found (from {source})"], (
            f"the site's configuration is the site admins' to install (at {DEFAULT_PATH}: site-config/README.md); "
            f"to use another, give --site-config PATH or set ${ENV_VAR} (site-config/example-site.toml to try "
            "vest out)")) from None
    except (OSError, UnicodeDecodeError) as e:
        raise SiteConfigError(where, [f"cannot be read: {e}"]) from None
    return parse_site_config(text, where)


def parse_site_config(text: str, path: str = "<string>") -> SiteConfig:
    try:
        data = toml.loads(text)
    except toml.TomlDecodeError as e:
        raise SiteConfigError(path, [f"not valid TOML: {e}"]) from None
    return site_config_from_dict(data, path)


class _Checker:
    """Collects problems while reading typed values out of nested dicts."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def keys(self, table: Any, where: str, valid: tuple[str, ...]) -> dict:
        if not isinstance(table, dict):
            self.problems.append(f"{where} must be a table")
            return {}
        for k in table:
            if k not in valid:
                self.problems.append(f"unknown key {where}.{k}; valid keys: {', '.join(valid)}")
        return table

    def get(self, table: dict, where: str, key: str, kind: str, default: Any = None, *,
            required: bool = False, minimum: float | None = None, maximum: float | None = None,
            choices: tuple[str, ...] | None = None, above: float | None = None) -> Any:
        full = f"{where}.{key}"
        if key not in table:
            if required:
                self.problems.append(f"{full} is missing")
            return default
        v = table[key]
        ok = {
            "int": isinstance(v, int) and not isinstance(v, bool),
            "number": isinstance(v, (int, float)) and not isinstance(v, bool),
            "bool": isinstance(v, bool),
            "str": isinstance(v, str),
            "strings": isinstance(v, list) and all(isinstance(x, str) for x in v),
        }[kind]
        if not ok:
            names = {"int": "a whole number", "number": "a number", "bool": "true or false",
                     "str": "a string", "strings": "a list of strings"}
            self.problems.append(f"{full} must be {names[kind]}, not {v!r}")
            return default
        if choices is not None and v not in choices:
            self.problems.append(f"{full} = {v!r}; valid values: {', '.join(choices)}")
            return default
        if minimum is not None and v < minimum:
            self.problems.append(f"{full} = {v!r} must be at least {minimum}")
            return default
        if maximum is not None and v > maximum:
            self.problems.append(f"{full} = {v!r} must be at most {maximum}")
            return default
        if above is not None and v <= above:
            self.problems.append(f"{full} = {v!r} must be greater than {above}")
            return default
        return tuple(v) if kind == "strings" else v


TOP_KEYS = ("gpu", "partition", "policy", "bridge", "dynamic")
GPU_KEYS = ("profile", "memory_mib", "cost", "context_mib", "cudnn_mib", "nvswitch")
DYNAMIC_KEYS = ("timeout_s", "memory_mib", "steps")
PARTITION_KEYS = ("gpu_types", "gpus_per_node", "max_gpus_per_job", "cost", "nodes")
POLICY_KEYS = ("headroom_percent", "headroom_mib", "selection", "on_user_choice_too_small",
               "exempt_users", "exempt_accounts", "help_url", "messages")
BRIDGE_KEYS = ("timeout_s", "fail", "unknown_jobs", "allow_vest_directives", "socket_path", "log_path",
               "directive_user", "directive_cpu_s", "directive_memory_mib", "fallback_ms_per_s",
               "fallback_burst_ms")


def site_config_from_dict(data: Mapping[str, Any], path: str = "<dict>") -> SiteConfig:
    """Validate parsed TOML; raise SiteConfigError listing every problem."""
    c = _Checker()
    top = c.keys(dict(data), "(top level)", TOP_KEYS)

    gpus: list[GpuType] = []
    gpu_tables = dict(_named_tables(c, top, "gpu", "no [gpu.<gres type>] table: define at least one GPU type"))
    for name, table in gpu_tables.items():
        w = f"gpu.{name}"
        t = c.keys(table, w, GPU_KEYS)
        profile = c.get(t, w, "profile", "str", required=True, choices=DEVICE_PROFILES)
        mem = c.get(t, w, "memory_mib", "int", above=0)
        cost = c.get(t, w, "cost", "number", minimum=0)
        context = c.get(t, w, "context_mib", "int", minimum=0)
        cudnn = c.get(t, w, "cudnn_mib", "int", minimum=0)
        nvswitch = c.get(t, w, "nvswitch", "bool")
        if profile is not None:
            gpus.append(GpuType(name, profile, mem * MiB if mem is not None else None, cost, context, cudnn, nvswitch))

    partitions: list[Partition] = []
    for name, table in _named_tables(c, top, "partition", "no [partition.<name>] table: define at least one GPU partition"):
        w = f"partition.{name}"
        t = c.keys(table, w, PARTITION_KEYS)
        types = c.get(t, w, "gpu_types", "strings", required=True)
        if types is not None:
            if not types:
                c.problems.append(f"{w}.gpu_types is empty: name the partition's GPU types")
            for g in types:
                if g not in gpu_tables:
                    c.problems.append(f"{w}.gpu_types names {g!r}, which has no [gpu.{g}] table "
                                      f"(defined: {', '.join(gpu_tables) or 'none'})")
            if len(set(types)) != len(types):
                c.problems.append(f"{w}.gpu_types lists a GPU type twice")
        per_node = c.get(t, w, "gpus_per_node", "int", required=True, minimum=1)
        max_job = c.get(t, w, "max_gpus_per_job", "int", minimum=1)
        cost = c.get(t, w, "cost", "number", minimum=0)
        nodes = c.get(t, w, "nodes", "int", minimum=1)
        if types is not None and per_node is not None:
            partitions.append(Partition(name, types, per_node, max_job, cost, nodes))

    p = c.keys(top.get("policy", {}), "policy", POLICY_KEYS)
    m = c.keys(p.get("messages", {}), "policy.messages", tuple(MESSAGE_FIELDS))
    messages = {}
    for kind, fields in MESSAGE_FIELDS.items():
        text = c.get(m, "policy.messages", kind, "str")
        if text is not None:
            bad = _bad_placeholders(text, fields)
            if bad:
                c.problems.append(f"policy.messages.{kind} uses {bad}; it may use {', '.join('{' + f + '}' for f in fields)}")
            else:
                messages[kind] = text
    selection = c.get(p, "policy", "selection", "str", "smallest-fit", choices=SELECTIONS)
    headroom_mib = c.get(p, "policy", "headroom_mib", "int", 0, minimum=0)
    policy = Policy(
        headroom_percent=float(c.get(p, "policy", "headroom_percent", "number", Policy.headroom_percent, minimum=0, maximum=100)),
        headroom_bytes=headroom_mib * MiB,
        selection=selection,
        on_user_choice_too_small=c.get(p, "policy", "on_user_choice_too_small", "str", "reroute",
                                       choices=USER_CHOICE_POLICIES),
        exempt_users=c.get(p, "policy", "exempt_users", "strings", ()),
        exempt_accounts=c.get(p, "policy", "exempt_accounts", "strings", ()),
        help_url=c.get(p, "policy", "help_url", "str", ""),
        messages=Messages(**messages),
    )
    if selection == "cost":
        by_name = {g.name: g for g in gpus}
        for part in partitions:
            if part.cost is None:
                missing = [g for g in part.gpu_types if g in by_name and by_name[g].cost is None]
                if missing:
                    c.problems.append(f"policy.selection = \"cost\" but partition.{part.name} has no cost and "
                                      f"its GPU type(s) {', '.join(missing)} have none: set a cost")

    b = c.keys(top.get("bridge", {}), "bridge", BRIDGE_KEYS)
    bridge = Bridge(
        timeout_s=float(c.get(b, "bridge", "timeout_s", "number", 2.0, above=0, maximum=MAX_BRIDGE_TIMEOUT_S - 1)),
        fail=c.get(b, "bridge", "fail", "str", "open", choices=FAIL_MODES),
        unknown_jobs=c.get(b, "bridge", "unknown_jobs", "str", "allow", choices=UNKNOWN_JOB_POLICIES),
        allow_vest_directives=c.get(b, "bridge", "allow_vest_directives", "bool", False),
        socket_path=_abs(c, b, "socket_path", Bridge.socket_path),
        log_path=_abs(c, b, "log_path", Bridge.log_path),
        directive_user=c.get(b, "bridge", "directive_user", "str", Bridge.directive_user),
        directive_cpu_s=float(c.get(b, "bridge", "directive_cpu_s", "number", Bridge.directive_cpu_s, above=0)),
        directive_memory_mib=c.get(b, "bridge", "directive_memory_mib", "int", Bridge.directive_memory_mib,
                                   minimum=1024),
        # At most half the controller's time in fallbacks: the other half keeps it answering.
        fallback_ms_per_s=c.get(b, "bridge", "fallback_ms_per_s", "int", Bridge.fallback_ms_per_s,
                                minimum=1, maximum=500),
        # At least 100 ms: it also caps one call (call_limit_s), and a healthy server's answer takes
        # a few ms (a whole sbatch: p99 35 ms, benchmarks/bench_bridge.json); less would cut off a
        # loaded but healthy server. The per-call program needs about 300 ms of it to decide.
        fallback_burst_ms=c.get(b, "bridge", "fallback_burst_ms", "int", Bridge.fallback_burst_ms,
                                minimum=100, maximum=int(MAX_BRIDGE_TIMEOUT_S * 1000) - 1000),
    )
    if bridge.worst_wait_s > MAX_BRIDGE_TIMEOUT_S - 1:
        c.problems.append(f"bridge: fallback_burst_ms, fallback_ms_per_s and timeout_s let a submission queue "
                          f"{bridge.worst_wait_s:.1f} s behind the plugin, past Slurm's MessageTimeout "
                          f"({MAX_BRIDGE_TIMEOUT_S:.0f} s) less a second: lower timeout_s, fallback_burst_ms or fallback_ms_per_s")
    if bridge.directive_user in ("root", "0", ""):
        c.problems.append("bridge.directive_user must be an unprivileged user (the worker that traces #VEST "
                          "directives runs as it), e.g. \"nobody\"")
    d = c.keys(top.get("dynamic", {}), "dynamic", DYNAMIC_KEYS)
    dynamic = Dynamic(
        timeout_s=float(c.get(d, "dynamic", "timeout_s", "number", Dynamic.timeout_s, above=0)),
        memory_mib=c.get(d, "dynamic", "memory_mib", "int", Dynamic.memory_mib, above=0),
        steps=c.get(d, "dynamic", "steps", "int", Dynamic.steps, above=0),
    )
    if c.problems:
        raise SiteConfigError(path, c.problems)
    return SiteConfig(path, tuple(gpus), tuple(partitions), policy, bridge, dynamic)


def _named_tables(c: _Checker, top: dict, key: str, missing: str):
    """The ``[key.<name>]`` tables, or a problem saying there are none."""
    tables = top.get(key, {})
    if not isinstance(tables, dict) or not tables:
        c.problems.append(missing)
        return []
    return list(tables.items())


def _abs(c: _Checker, table: dict, key: str, default: str) -> str:
    v = c.get(table, "bridge", key, "str", default)
    if not v.startswith("/"):
        c.problems.append(f"bridge.{key} = {v!r} must be an absolute path (slurmctld's working directory is not yours)")
        return default
    return v


def _bad_placeholders(text: str, fields: tuple[str, ...]) -> str:
    try:
        parsed = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(text) if f is not None]
    except ValueError as e:
        return f"a malformed placeholder ({e}; write {{{{ and }}}} for literal braces)"
    # Plain names only: no attribute access, index, conversion or format spec.
    bad = [f + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "")
           for f, spec, conv in parsed if f not in fields or spec or conv]
    return ", ".join("{" + n + "}" for n in bad)
