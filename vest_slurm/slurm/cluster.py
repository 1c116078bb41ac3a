"""The cluster as Slurm sees it: partitions, their nodes' GPU types, jobs; and submitting.

One interface, two backends:

- ``SlurmCLI`` (default) drives the command-line tools. Every subprocess goes through one seam,
  ``run_slurm``, which bounds it with a timeout and turns a missing tool, a timeout or a controller
  that cannot be reached into a ``SlurmError`` that says what to check. Parsers of Slurm's output are
  small pure functions over strings below (tested on recorded real output in tests/data/slurm).
- ``PySlurmBackend`` uses pyslurm when it imports AND its version matches the running Slurm. PyPI's
  pyslurm (25.11) builds only against Slurm 25.11 headers, so on Debian 12 (Slurm 22.05) it is never
  used; ``get_backend()`` decides and says why.

Slurm 22.05 notes (why the parsers look like this):
- ``sinfo --json`` and ``squeue --json`` exist; a controller that cannot be reached gives exit code 0
  and an ``errors`` list in the JSON, after retrying for about 9 s.
- ``scontrol ... --json`` does not exist before 23.02: ``scontrol show -o`` prints one record per
  line as ``Key=value`` pairs separated by spaces, and values may themselves contain spaces, commas
  and ``=`` (job names, comments, paths, node reasons). See ``parse_scontrol_line``.

Known limitations:
- A value that contains `` Key=`` where Key is a real key of that record and sits where that key
  could be (e.g. a comment ending in ``StdErr=x`` right before the real StdErr) is ambiguous in
  Slurm's own output; the parser keeps the longest consistent reading (see ``parse_scontrol_line``).
- ``PartitionInfo.gpu_counts`` gives, per GPU type, the most GPUs any one node of the partition has.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SlurmError

DEFAULT_TIMEOUT_S = 5.0
SLOW_PROBE_S = 0.5       # a healthy 22.05 controller answers sinfo/scontrol in 10-30 ms
TIMEOUT_ENV = "VEST_SLURM_TIMEOUT_S"
INSTALL_HINT = ("install the Slurm client tools (Debian: apt-get install slurm-client) and make sure "
                "they are on PATH")
# stderr lines meaning the controller could not be asked at all (as opposed to a refused request).
_UNREACHABLE = (
    "Unable to contact slurm controller",
    "Socket timed out on send/recv",
    "Could not establish a configuration source",
    "Unable to process configuration file",
    "Zero Bytes were transmitted or received",
    "Communication connection failure",
)


def default_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """Seconds every Slurm command may take: $VEST_SLURM_TIMEOUT_S (of ``env``, else os.environ), else 5."""
    raw = (os.environ if env is None else env).get(TIMEOUT_ENV)
    if raw:
        try:
            value = float(raw)
            if value > 0:
                return value
        except ValueError:
            pass
        raise SlurmError(f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds",
                         f"set {TIMEOUT_ENV} to e.g. 5, or unset it")
    return DEFAULT_TIMEOUT_S


# --- the seam ---------------------------------------------------------------------------------

def run_slurm(argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout_s: float,
              input: str | None = None) -> subprocess.CompletedProcess:
    """Run one Slurm command (never through a shell) and return its CompletedProcess (text mode).

    A non-zero exit code is returned as is (sbatch's refusals are the caller's business), except when
    stderr says the controller could not be reached. Raises SlurmError for a missing program, a
    command still running after ``timeout_s`` (it is killed), or an unreachable controller.
    """
    argv = [str(a) for a in argv]
    run_env = dict(os.environ if env is None else env)
    prog = argv[0]
    if shutil.which(prog, path=run_env.get("PATH")) is None and shutil.which(prog) is None:
        raise SlurmError(f"{prog} is not installed or not on PATH", INSTALL_HINT)
    try:
        proc = _run_bounded(argv, run_env, input, timeout_s)
    except FileNotFoundError:
        raise SlurmError(f"{prog} is not installed or not on PATH", INSTALL_HINT) from None
    except _ControllerDown as e:
        raise SlurmError(
            f"`{' '.join(argv[:3])}` could not reach the Slurm controller: {e}",
            "check that slurmctld is running (`scontrol ping`, its log) and that SLURM_CONF points "
            "at the right slurm.conf",
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(
            f"`{' '.join(argv[:3])}` did not answer within {timeout_s:g} s: "
            f"{describe_controller(run_env)}",
            "check that slurmctld is running (`scontrol ping`, its log), that SLURM_CONF points at "
            f"the right slurm.conf, or raise {TIMEOUT_ENV}",
        ) from None
    if proc.returncode != 0 and any(s in proc.stderr for s in _UNREACHABLE):
        raise SlurmError(
            f"`{' '.join(argv[:3])}` could not reach the Slurm controller: "
            f"{_first_line(proc.stderr)} ({describe_controller(run_env)})",
            "check that slurmctld is running (`scontrol ping`, its log) and that SLURM_CONF points "
            "at the right slurm.conf",
        )
    return proc


class _ControllerDown(Exception):
    pass


def _run_bounded(argv: list[str], env: dict[str, str], input: str | None,
                 timeout_s: float) -> subprocess.CompletedProcess:
    """subprocess.run with a timeout, plus one shortcut: a command still running after
    SLOW_PROBE_S is usually retrying a dead controller (Slurm retries for about 9 s), so probe
    the controller's port once; if nothing listens there, stop now instead of at the timeout.
    The probe runs only on this slow path, so a healthy controller never sees it."""
    p = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE if input is not None else
                         subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, errors="replace")
    deadline = time.monotonic() + timeout_s
    try:
        try:
            out, err = p.communicate(input, timeout=min(SLOW_PROBE_S, timeout_s))
        except subprocess.TimeoutExpired:
            state = describe_controller(env)
            if "controller is down" in state:
                raise _ControllerDown(state) from None
            out, err = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except BaseException:
        p.kill()
        p.wait()
        raise
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else "(no message)"


def controller_address(env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """(address, port) of the primary controller from slurm.conf, or None if it cannot be told."""
    conf = (env if env is not None else os.environ).get("SLURM_CONF", "/etc/slurm/slurm.conf")
    try:
        text = Path(conf).read_text(errors="replace")
    except OSError:
        return None
    host, port = None, 6817
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        key, _, value = line.partition("=")
        key = key.strip().lower()
        value = value.strip()
        if key in ("slurmctldhost", "controlmachine") and host is None:
            m = re.match(r"([^(\s]+)(?:\(([^)]+)\))?", value)
            if m:
                host = m.group(2) or m.group(1)
        elif key == "controladdr":
            host = value or host
        elif key == "slurmctldport":
            try:
                port = int(value.split("-", 1)[0])
            except ValueError:
                return None
    return (host, port) if host else None


def describe_controller(env: Mapping[str, str] | None = None, probe_s: float = 0.3) -> str:
    """A short phrase on whether anything listens where slurm.conf says the controller is."""
    addr = controller_address(env)
    if addr is None:
        return "the controller may be down or too slow"
    try:
        with socket.create_connection(addr, timeout=probe_s):
            pass
    except OSError as e:
        return f"nothing answers at {addr[0]}:{addr[1]} ({e.strerror or e}); the controller is down"
    return f"the controller at {addr[0]}:{addr[1]} accepts connections but is too slow"


# --- records ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeInfo:
    name: str
    partitions: tuple[str, ...]
    gres: str                       # as Slurm prints it, e.g. "gpu:a100:4"
    gres_used: str                  # e.g. "gpu:a100:1(IDX:0)"
    state: str                      # lower case, e.g. "idle", "mixed", "down"
    state_flags: tuple[str, ...] = ()
    cpus: int = 0
    real_memory_mb: int = 0
    reason: str = ""

    @property
    def gpu_counts(self) -> dict[str, int]:
        """{gpu type: count} configured on this node ("" for GPUs without a type)."""
        return gpu_counts(self.gres)

    @property
    def gpus_used(self) -> dict[str, int]:
        return gpu_counts(self.gres_used)


@dataclass(frozen=True)
class PartitionInfo:
    name: str
    nodes: tuple[str, ...]
    gpu_counts: dict[str, int]      # {gres type: GPUs per node (most on any node)}
    default: bool = False
    state: str = "UP"
    max_time: str = "UNLIMITED"     # as Slurm prints it
    max_time_minutes: int | None = None   # None: unlimited
    default_time: str = "NONE"
    total_cpus: int = 0


@dataclass(frozen=True)
class ClusterInfo:
    partitions: tuple[PartitionInfo, ...]
    nodes: tuple[NodeInfo, ...] = ()
    slurm_version: str = ""

    def partition(self, name: str) -> PartitionInfo | None:
        return next((p for p in self.partitions if p.name == name), None)

    @property
    def default_partition(self) -> PartitionInfo | None:
        return next((p for p in self.partitions if p.default), None)

    @property
    def gpu_types(self) -> set[str]:
        return {t for p in self.partitions for t in p.gpu_counts if t}


@dataclass(frozen=True)
class QueueEntry:
    job_id: int
    name: str
    partition: str
    state: str
    user_name: str = ""
    nodes: str = ""
    array_job_id: int | None = None
    array_task_id: int | None = None
    tres_per_node: str = ""


class JobRecord(Mapping):
    """One job as ``scontrol show -o job`` prints it: a read-only mapping of its keys (JobState,
    Partition, TresPerNode, ...) with the fields vest uses as attributes."""

    def __init__(self, fields: Mapping[str, str]):
        self._fields = dict(fields)

    def __getitem__(self, key: str) -> str:
        return self._fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        return f"JobRecord(job_id={self.job_id}, state={self.state!r}, partition={self.partition!r})"

    def _get(self, key: str) -> str:
        v = self._fields.get(key, "")
        return "" if v == "(null)" else v

    job_id = property(lambda self: int(self._fields.get("JobId", "0") or 0))
    name = property(lambda self: self._get("JobName"))
    state = property(lambda self: self._get("JobState"))
    reason = property(lambda self: self._get("Reason"))
    partition = property(lambda self: self._get("Partition"))
    node_list = property(lambda self: self._get("NodeList"))
    tres = property(lambda self: self._get("TRES"))
    tres_per_node = property(lambda self: self._get("TresPerNode"))
    tres_per_job = property(lambda self: self._get("TresPerJob"))
    time_limit = property(lambda self: self._get("TimeLimit"))
    dependency = property(lambda self: self._get("Dependency"))
    array_job_id = property(lambda self: self._get("ArrayJobId"))
    array_task_id = property(lambda self: self._get("ArrayTaskId"))
    std_out = property(lambda self: self._get("StdOut"))
    std_err = property(lambda self: self._get("StdErr"))
    work_dir = property(lambda self: self._get("WorkDir"))
    comment = property(lambda self: self._get("Comment"))
    exit_code = property(lambda self: self._get("ExitCode"))

    @property
    def gpu_counts(self) -> dict[str, int]:
        """GPUs per node requested through --gres (TresPerNode), by type."""
        return gpu_counts(self.tres_per_node)


# --- pure parsers -----------------------------------------------------------------------------

_SBATCH_RE = re.compile(r"^Submitted batch job (\d+)", re.MULTILINE)
_PARSABLE_RE = re.compile(r"^(\d+)(?:;\S*)?\s*$", re.MULTILINE)


def parse_sbatch_output(stdout: str) -> int | None:
    """The job id in sbatch's stdout ("Submitted batch job N", or N[;cluster] with --parsable)."""
    m = _SBATCH_RE.search(stdout) or _PARSABLE_RE.search(stdout)
    return int(m.group(1)) if m else None


def parse_sinfo_version(stdout: str) -> str:
    """"slurm-wlm 22.05.8" / "slurm 23.02.1" -> "22.05.8" ("" when there is no version)."""
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", stdout)
    return m.group(1) if m else ""


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside parentheses ("gpu:a100:2(IDX:0,2),mps:100" has one top comma)."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


_COUNT_SUFFIX = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "t": 1024 ** 4}


@dataclass(frozen=True)
class GresItem:
    name: str           # "gpu"
    type: str           # "a100", or "" when untyped
    count: int
    detail: str = ""    # what was in parentheses, e.g. "IDX:0-1" or "S:0"


def parse_gres(text: str) -> tuple[GresItem, ...]:
    """Parse a GRES string as sinfo/scontrol print it.

    Accepts "gpu:a100:4", "gpu:4", "gpu:a100:4(S:0-1)", "gpu:a100:1(IDX:0)", comma lists,
    "gres:gpu:a100:1" / "gres/gpu:a100:1" (TresPerNode on 22.05 / newer), and "(null)", "N/A", "".
    Items that cannot be read are skipped (this describes what Slurm has, it is not user input).
    """
    text = (text or "").strip()
    if text in ("", "(null)", "N/A", "none"):
        return ()
    items = []
    for part in _split_top_level(text):
        detail = ""
        m = re.match(r"^(.*?)\((.*)\)$", part)
        if m:
            part, detail = m.group(1), m.group(2)
        for prefix in ("gres:", "gres/"):
            if part.startswith(prefix):
                part = part[len(prefix):]
        fields = part.split(":")
        name, gtype, count_s = fields[0], "", "1"
        if len(fields) == 2:
            if re.fullmatch(r"\d+[kKmMgGtT]?", fields[1]):
                count_s = fields[1]
            else:
                gtype = fields[1]
        elif len(fields) >= 3:
            gtype, count_s = ":".join(fields[1:-1]), fields[-1]
        cm = re.fullmatch(r"(\d+)([kKmMgGtT]?)", count_s)
        if not name or not cm:
            continue
        items.append(GresItem(name, gtype, int(cm.group(1)) * _COUNT_SUFFIX[cm.group(2).lower()],
                              detail))
    return tuple(items)


def gpu_counts(gres_text: str) -> dict[str, int]:
    """{gpu type: count} from a GRES string; untyped GPUs count under ""."""
    out: dict[str, int] = {}
    for item in parse_gres(gres_text):
        if item.name == "gpu":
            out[item.type] = out.get(item.type, 0) + item.count
    return out


def _load_json(text: str, what: str) -> dict:
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        raise SlurmError(f"{what} did not print JSON ({e}): {text[:200]!r}",
                         "run the command by hand to see what it prints") from None
    if not isinstance(data, dict):
        raise SlurmError(f"{what} printed JSON that is not an object", "run the command by hand")
    errors = data.get("errors") or []
    if errors:
        msgs = "; ".join(
            str(e.get("error") or e.get("description") or e) if isinstance(e, dict) else str(e)
            for e in errors)
        raise SlurmError(
            f"{what} reported errors: {msgs} (the controller may be down or unreachable)",
            "check that slurmctld is running (`scontrol ping`, its log) and that SLURM_CONF points "
            "at the right slurm.conf")
    return data


def _state_of(value) -> tuple[str, tuple[str, ...]]:
    """22.05 gives "state": "idle" and "state_flags": [...]; 23.x+ gives "state": ["IDLE", ...]."""
    if isinstance(value, list):
        states = [str(v) for v in value]
        return (states[0].lower() if states else "unknown"), tuple(s.upper() for s in states[1:])
    return str(value or "unknown").lower(), ()


def parse_sinfo_json(text: str) -> tuple[NodeInfo, ...]:
    """Nodes from ``sinfo --json`` (22.05 openapi v0.0.38; newer layouts read where they agree)."""
    data = _load_json(text, "sinfo --json")
    nodes = []
    for n in data.get("nodes") or []:
        state, flags = _state_of(n.get("state"))
        flags = tuple(str(f).upper() for f in (n.get("state_flags") or [])) or flags
        mem = n.get("real_memory", 0)
        nodes.append(NodeInfo(
            name=str(n.get("name", "")),
            partitions=tuple(str(p) for p in (n.get("partitions") or [])),
            gres=str(n.get("gres") or ""),
            gres_used=str(n.get("gres_used") or ""),
            state=state,
            state_flags=flags,
            cpus=int(n.get("cpus") or 0),
            real_memory_mb=int(mem if isinstance(mem, int) else 0),
            reason=str(n.get("reason") or ""),
        ))
    return tuple(nodes)


def parse_squeue_json(text: str) -> tuple[QueueEntry, ...]:
    """Jobs from ``squeue --json`` (22.05 lists every job the controller still holds, finished
    ones included until MinJobAge)."""
    data = _load_json(text, "squeue --json")

    def opt_int(v):
        if isinstance(v, dict):  # 23.x+: {"set": true, "number": 5}
            return int(v["number"]) if v.get("set") else None
        return int(v) if isinstance(v, int) else None

    out = []
    for j in data.get("jobs") or []:
        state = j.get("job_state", "")
        if isinstance(state, list):
            state = state[0] if state else ""
        task = opt_int(j.get("array_task_id"))
        array_job = opt_int(j.get("array_job_id"))
        out.append(QueueEntry(
            job_id=int(opt_int(j.get("job_id")) or 0),
            name=str(j.get("name") or ""),
            partition=str(j.get("partition") or ""),
            state=str(state),
            user_name=str(j.get("user_name") or ""),
            nodes=str(j.get("nodes") or ""),
            array_job_id=array_job or None,
            array_task_id=task,
            tres_per_node=str(j.get("tres_per_node") or ""),
        ))
    return tuple(out)


# Key order of ``scontrol show -o`` records in Slurm 22.05 (src/api/job_info.c, node_info.c,
# partition_info.c, checked against tests/data/slurm). Keys on one line share a position (Slurm
# prints one or the other). Used only to tell real keys from look-alikes inside free-text values.
JOB_KEY_ORDER: tuple[tuple[str, ...], ...] = tuple(tuple(s.split("|")) for s in """
JobId ArrayJobId ArrayTaskId ArrayTaskThrottle HetJobId HetJobOffset HetJobIdSet JobName UserId
GroupId MCS_label Priority Nice Account QOS WCKey JobState Reason Dependency Requeue Restarts
BatchFlag Reboot ExitCode DerivedExitCode RunTime TimeLimit TimeMin SubmitTime EligibleTime
AccrueTime StartTime EndTime Deadline PreemptEligibleTime PreemptTime SuspendTime SecsPreSuspend
LastSchedEval ResizeTime Scheduler Partition AllocNode:Sid ReqNodeList ExcNodeList NodeList
SchedNodeList BatchHost NumNodes NumCPUs NumTasks CPUs/Task ReqB:S:C:T TRES Socks/Node
NtasksPerN:B:S:C CoreSpec MinCPUsNode MinMemoryNode|MinMemoryCPU MinTmpDiskNode Features
ClusterFeatures Prefer DelayBoot Reservation OverSubscribe Contiguous Licenses Network Command
WorkDir AdminComment SystemComment Comment StdErr StdIn StdOut BurstBuffer BurstBufferState
CpuFreqMin CpuFreqMax CpuFreqGov Power CpusPerTres MemPerTres TresBind TresFreq TresPerJob
TresPerNode TresPerSocket TresPerTask MailUser MailType NtasksPerTRES
""".split())
NODE_KEY_ORDER: tuple[tuple[str, ...], ...] = tuple(tuple(s.split("|")) for s in """
NodeName Arch CoresPerSocket CPUAlloc CPUEfctv CPUTot CPULoad AvailableFeatures ActiveFeatures Gres
GresDrain GresUsed NodeAddr NodeHostName Port Version OS RealMemory AllocMem FreeMem Sockets Boards
CoreSpecCount CPUSpecList MemSpecLimit State ThreadsPerCore TmpDisk Weight Owner MCS_label
Partitions BootTime SlurmdStartTime LastBusyTime ResumeAfterTime CfgTRES AllocTRES CapWatts
CurrentWatts AveWatts ExtSensorsJoules ExtSensorsWatts ExtSensorsTemp Reason Comment Extra
""".split())
PARTITION_KEY_ORDER: tuple[tuple[str, ...], ...] = tuple(tuple(s.split("|")) for s in """
PartitionName AllowGroups AllowAccounts|DenyAccounts AllowQos|DenyQos AllocNodes Default QoS
DefaultTime DisableRootJobs ExclusiveUser GraceTime Hidden MaxNodes MaxTime MinNodes LLN
MaxCPUsPerNode MaxCPUsPerSocket Nodes PriorityJobFactor PriorityTier RootOnly ReqResv OverSubscribe
OverTimeLimit PreemptMode State TotalCPUs TotalNodes SelectTypeParameters JobDefaults
DefMemPerCPU|DefMemPerNode MaxMemPerCPU|MaxMemPerNode TRES TRESBillingWeights ResumeTimeout
SuspendTimeout SuspendTime PowerDownOnIdle
""".split())
# Values a user or admin writes freely; an unknown key inside them is text, not a new key.
_FREE_TEXT_KEYS = frozenset({
    "JobName", "Comment", "AdminComment", "SystemComment", "Command", "WorkDir", "StdErr", "StdIn",
    "StdOut", "MailUser", "Reason", "OS", "Extra", "Features", "AvailableFeatures",
    "ActiveFeatures", "Licenses", "Reservation", "BurstBuffer",
})
_KEY_RE = re.compile(r"(?:(?<=\s)|^)([A-Za-z][A-Za-z0-9_:/.]*)=")


def parse_scontrol_line(line: str, key_order: Sequence[Sequence[str]] | None = None) -> dict[str, str]:
    """One ``scontrol show -o`` record into {key: value}; values keep their spaces, commas and '='.

    Every `` Word=`` is a candidate key. Without ``key_order`` each starts a new key (first wins
    for repeats). With ``key_order`` (the record type's known key order), the real keys are the
    longest run of candidates in that order, so "JobName=x Partition=evil" or a comment holding
    "TresPerNode=..." stay text; ties go to the later candidate (the look-alike sits inside the
    value before the real key). A candidate with an unknown key (a newer Slurm) is a key unless it
    falls inside a free-text value.
    """
    line = line.rstrip("\n")
    cands = [(m.start(), m.end(), m.group(1)) for m in _KEY_RE.finditer(line)]
    if not cands:
        return {}
    if key_order is None:
        chosen = cands
    else:
        rank = {k: i for i, group in enumerate(key_order) for k in group}
        known = [(i, c) for i, c in enumerate(cands) if c[2] in rank]
        # Longest strictly increasing run by rank (O(n^2), n < 100); among equals prefer later ones.
        best_len = [1] * len(known)
        prev = [-1] * len(known)
        for a in range(len(known)):
            for b in range(a):
                if rank[known[b][1][2]] < rank[known[a][1][2]] and best_len[b] + 1 >= best_len[a]:
                    best_len[a], prev[a] = best_len[b] + 1, b
        keep: set[int] = set()
        if known:
            top = max(best_len)
            a = max(i for i, n in enumerate(best_len) if n == top)
            while a != -1:
                keep.add(known[a][0])
                a = prev[a]
        chosen = []
        current = None
        for i, c in enumerate(cands):
            if i in keep:
                chosen.append(c)
                current = c[2]
            elif c[2] not in rank and current not in _FREE_TEXT_KEYS and cands[0][2] in rank:
                chosen.append(c)
                current = c[2]
        if cands[0] not in chosen:  # the record's own first key always starts it
            chosen.insert(0, cands[0])
    out: dict[str, str] = {}
    for n, (start, end, key) in enumerate(chosen):
        stop = chosen[n + 1][0] if n + 1 < len(chosen) else len(line)
        if key not in out:
            out[key] = line[end:stop].rstrip(" ")
    return out


def parse_scontrol_records(text: str, key_order: Sequence[Sequence[str]] | None = None
                           ) -> list[dict[str, str]]:
    """Every non-empty line of ``scontrol show -o ...`` output as a record."""
    return [r for r in (parse_scontrol_line(ln, key_order) for ln in text.splitlines()
                        if ln.strip()) if r]


def parse_scontrol_jobs(text: str) -> list[dict[str, str]]:
    return parse_scontrol_records(text, JOB_KEY_ORDER)


def parse_scontrol_nodes(text: str) -> list[dict[str, str]]:
    return parse_scontrol_records(text, NODE_KEY_ORDER)


def parse_scontrol_partitions(text: str) -> list[dict[str, str]]:
    return parse_scontrol_records(text, PARTITION_KEY_ORDER)


def parse_time_minutes(text: str) -> int | None:
    """Slurm time ("UNLIMITED", "30", "1:00:00", "2-12", "1-00:00:00") in minutes; None: no limit."""
    t = (text or "").strip()
    if t.upper() in ("UNLIMITED", "INFINITE", "NONE", "N/A", ""):
        return None
    days = 0
    if "-" in t:
        d, t = t.split("-", 1)
        days = int(d)
        parts = [int(x) for x in t.split(":")] + [0, 0]
        h, m, s = parts[0], parts[1], parts[2]
    else:
        parts = [int(x) for x in t.split(":")]
        if len(parts) == 1:
            h, m, s = 0, parts[0], 0
        elif len(parts) == 2:
            h, m, s = 0, parts[0], parts[1]
        else:
            h, m, s = parts[0], parts[1], parts[2]
    return days * 1440 + h * 60 + m + (1 if s else 0)


def build_cluster_info(nodes: Sequence[NodeInfo], partition_records: Sequence[Mapping[str, str]],
                       slurm_version: str = "") -> ClusterInfo:
    """Partitions (from scontrol) joined with their nodes' GPUs (from sinfo)."""
    parts = []
    for rec in partition_records:
        name = rec.get("PartitionName", "")
        members = tuple(n.name for n in nodes if name in n.partitions)
        counts: dict[str, int] = {}
        for n in nodes:
            if name in n.partitions:
                for gtype, c in n.gpu_counts.items():
                    counts[gtype] = max(counts.get(gtype, 0), c)
        max_time = rec.get("MaxTime", "UNLIMITED")
        try:
            minutes = parse_time_minutes(max_time)
        except ValueError:
            minutes = None
        try:
            cpus = int(rec.get("TotalCPUs", "0"))
        except ValueError:
            cpus = 0
        parts.append(PartitionInfo(
            name=name, nodes=members, gpu_counts=counts, default=rec.get("Default") == "YES",
            state=rec.get("State", ""), max_time=max_time, max_time_minutes=minutes,
            default_time=rec.get("DefaultTime", "NONE"), total_cpus=cpus,
        ))
    return ClusterInfo(partitions=tuple(parts), nodes=tuple(nodes), slurm_version=slurm_version)


def reconcile(cluster_info: ClusterInfo, configured_gpu_types: set[str],
              configured_partitions: set[str]) -> list[str]:
    """Warnings where the site config and what Slurm has disagree (empty when they agree)."""
    warnings = []
    seen_types: dict[str, list[str]] = {}
    for p in cluster_info.partitions:
        for gtype in p.gpu_counts:
            seen_types.setdefault(gtype, []).append(p.name)
    for gtype in sorted(set(seen_types) - set(configured_gpu_types)):
        label = f"gres type '{gtype}'" if gtype else "untyped GPUs (gres 'gpu:N')"
        warnings.append(f"{label} in partition(s) {', '.join(seen_types[gtype])} has no GPU type "
                        "entry in the site config: jobs are never placed there")
    for gtype in sorted(set(configured_gpu_types) - set(seen_types)):
        warnings.append(f"site config GPU type '{gtype}' matches no node's gres in Slurm")
    for pname in sorted(configured_partitions):
        p = cluster_info.partition(pname)
        if p is None:
            warnings.append(f"site config partition '{pname}' does not exist in Slurm")
        elif not p.nodes:
            warnings.append(f"site config partition '{pname}' has no nodes in Slurm")
        elif not p.gpu_counts:
            warnings.append(f"site config partition '{pname}' has no GPUs in Slurm")
    for p in cluster_info.partitions:
        if p.gpu_counts and p.name not in configured_partitions:
            warnings.append(f"Slurm partition '{p.name}' has GPUs "
                            f"({', '.join(sorted(t or 'untyped' for t in p.gpu_counts))}) "
                            "but is not in the site config")
    return warnings


# --- backends ---------------------------------------------------------------------------------

@dataclass
class SlurmCLI:
    """The cluster through sinfo, scontrol, squeue and sbatch (every call via ``run_slurm``)."""

    env: Mapping[str, str] | None = None
    timeout_s: float = field(default_factory=default_timeout_s)
    name = "cli"

    def _run(self, argv: Sequence[str], input: str | None = None) -> subprocess.CompletedProcess:
        return run_slurm(argv, env=self.env, timeout_s=self.timeout_s, input=input)

    def _checked(self, argv: Sequence[str]) -> str:
        p = self._run(argv)
        if p.returncode != 0:
            raise SlurmError(f"`{' '.join(argv)}` failed (exit {p.returncode}): "
                             f"{_first_line(p.stderr)}",
                             "run the command by hand; check SLURM_CONF and the slurmctld log")
        return p.stdout

    def version(self) -> str:
        return parse_sinfo_version(self._checked(["sinfo", "--version"]))

    def nodes(self) -> tuple[NodeInfo, ...]:
        return parse_sinfo_json(self._checked(["sinfo", "--json"]))

    def cluster_info(self) -> ClusterInfo:
        nodes = self.nodes()
        parts = parse_scontrol_partitions(self._checked(["scontrol", "show", "-o", "partition"]))
        return build_cluster_info(nodes, parts)

    def submit(self, argv: Sequence[str], *, input: str | None = None
               ) -> tuple[int | None, str, str, int]:
        """Run ``sbatch`` with ``argv`` (its arguments, without "sbatch"); return
        (job id or None, stdout, stderr, exit code) exactly as sbatch gave them."""
        p = self._run(["sbatch", *argv], input=input)
        return parse_sbatch_output(p.stdout), p.stdout, p.stderr, p.returncode

    def job(self, job_id: int | str) -> JobRecord | None:
        """``scontrol show -o job ID`` (None when the controller no longer knows it). For an array
        job the record of that id, else the first task's."""
        p = self._run(["scontrol", "show", "-o", "job", str(job_id)])
        if p.returncode != 0:
            if "Invalid job id" in p.stderr:
                return None
            raise SlurmError(f"`scontrol show job {job_id}` failed: {_first_line(p.stderr)}",
                             "check the job id and the slurmctld log")
        records = parse_scontrol_jobs(p.stdout)
        if not records:
            return None
        same = [r for r in records if r.get("JobId") == str(job_id)]
        return JobRecord(same[0] if same else records[0])

    def queue(self) -> tuple[QueueEntry, ...]:
        return parse_squeue_json(self._checked(["squeue", "--json"]))

    def queue_ids(self) -> set[int]:
        """Ids of every job the controller holds (pending, running, and finished within MinJobAge)."""
        return {e.job_id for e in self.queue()}


class PySlurmBackend(SlurmCLI):
    """The same interface through pyslurm's API (pyslurm >= 23.2: ``Nodes``, ``Partitions``,
    ``Job``). Submission stays with sbatch, so that every option keeps sbatch's exact meaning."""

    name = "pyslurm"

    def __init__(self, pyslurm_module, env: Mapping[str, str] | None = None,
                 timeout_s: float | None = None):
        super().__init__(env=env, timeout_s=timeout_s or default_timeout_s())
        self._ps = pyslurm_module

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # pyslurm.RPCError and friends
            raise SlurmError(f"pyslurm: {e}", "check that slurmctld is running (`scontrol ping`)"
                             ) from None

    def nodes(self) -> tuple[NodeInfo, ...]:
        out = []
        for name, n in self._call(self._ps.Nodes.load).items():
            gres = ",".join(f"{k}:{v}" for k, v in (getattr(n, "configured_gres", None) or {}).items())
            used = ",".join(
                f"{k}:{v['count'] if isinstance(v, dict) else v}"
                for k, v in (getattr(n, "allocated_gres", None) or {}).items())
            state, flags = _state_of(getattr(n, "state", "unknown"))
            out.append(NodeInfo(
                name=str(name), partitions=tuple(getattr(n, "partitions", None) or ()), gres=gres,
                gres_used=used, state=state, state_flags=flags,
                cpus=int(getattr(n, "total_cpus", 0) or 0),
                real_memory_mb=int(getattr(n, "real_memory", 0) or 0),
                reason=str(getattr(n, "reason", "") or "")))
        return tuple(out)

    def cluster_info(self) -> ClusterInfo:
        nodes = self.nodes()
        records = []
        for name, p in self._call(self._ps.Partitions.load).items():
            max_time = getattr(p, "max_time", None)
            records.append({
                "PartitionName": str(name),
                "Default": "YES" if getattr(p, "is_default", False) else "NO",
                "State": str(getattr(p, "state", "") or ""),
                "MaxTime": "UNLIMITED" if max_time in (None, "UNLIMITED") else str(max_time),
                "TotalCPUs": str(getattr(p, "total_cpus", 0) or 0),
            })
        return build_cluster_info(nodes, records)

    def job(self, job_id: int | str) -> JobRecord | None:
        try:
            j = self._ps.Job.load(int(job_id))
        except Exception:
            return super().job(job_id)
        d = j.to_dict() if hasattr(j, "to_dict") else j.as_dict()
        keys = {"job_id": "JobId", "name": "JobName", "state": "JobState", "partition": "Partition",
                "nodes": "NodeList", "time_limit": "TimeLimit", "standard_output": "StdOut",
                "standard_error": "StdErr", "working_directory": "WorkDir", "comment": "Comment"}
        return JobRecord({keys.get(k, k): "" if v is None else str(v) for k, v in d.items()})


def _major_minor(version: str) -> tuple[int, int] | None:
    """"23.2.2" and "23.02.1" -> (23, 2): pyslurm drops the zero Slurm prints."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def get_backend(env: Mapping[str, str] | None = None, timeout_s: float | None = None,
                pyslurm_module=None) -> tuple[SlurmCLI, str]:
    """(backend, why): pyslurm when it imports and its major.minor matches the running Slurm's,
    else the command-line tools."""
    cli = SlurmCLI(env=env, timeout_s=timeout_s or default_timeout_s())
    ps = pyslurm_module
    if ps is None:
        try:
            import pyslurm as ps  # type: ignore[import-not-found]
        except Exception as e:  # ImportError, or a build against other headers failing to load
            return cli, f"command-line tools (pyslurm not importable: {type(e).__name__}: {e})"
    ps_version = str(getattr(ps, "__version__", "") or "")
    if not ps_version and callable(getattr(ps, "version", None)):
        ps_version = str(ps.version())
    try:
        slurm_version = cli.version()
    except SlurmError as e:
        return cli, f"command-line tools (could not read the Slurm version: {e.what})"
    if not slurm_version or _major_minor(ps_version) != _major_minor(slurm_version):
        return cli, (f"command-line tools (pyslurm {ps_version or '?'} does not match Slurm "
                     f"{slurm_version or '?'}; PyPI's pyslurm needs the same Slurm release)")
    return PySlurmBackend(ps, env=env, timeout_s=cli.timeout_s), (
        f"pyslurm {ps_version} (matches Slurm {slurm_version})")
