"""Reading a Slurm batch script as sbatch reads it: pure functions over text.

What sbatch does, and what this module mirrors (Slurm 22.05, ``src/sbatch/opt.c`` and
``src/common/slurm_opt.c``; the man page sbatch(1)):

- The first line must start with ``#!``; a script with DOS line breaks or a NUL byte is refused.
- ``#SBATCH`` directives are read from the top of the script until the first line that is neither
  blank nor a comment; ``#SBATCH`` lines after that are ignored (we record their line numbers so
  vsbatch can warn). The magic word must start the line.
- The text after ``#SBATCH`` is split into words: single and double quotes group, a backslash
  escapes the next character, and an unquoted ``#`` starts a comment. The words are then read with
  getopt_long: ``--opt=value``, ``--opt value``, unambiguous long prefixes (``--part=x``), short
  options ``-p x`` / ``-px`` / ``-N2``, bundled flags (``-HQ``), optional arguments only in the
  attached form (``--exclusive=user``, ``-koff``). A word that is not an option is an error.
- On sbatch's own command line the same getopt runs, stopping at the first non-option (the script);
  everything after it goes to the script. ``--`` ends the options.
- Precedence: script directives < ``SBATCH_*`` input environment variables < command line.

``#VEST`` lines are ours: the workload options of ``vest estimate``, split with shell quoting (an
unquoted ``#`` after whitespace starts a comment, as on #SBATCH lines). All ``#VEST`` lines of the
header are concatenated in order. A ``#VEST`` line below the first command is an error, since a
reader would believe it counts. ``#VEST-ESTIMATE`` (see attach.py) and ``#VEST-RECORD`` (the
bridge's record, slurm/accounting.py) are not directives.

Known limitations:
- Heterogeneous jobs (``#SBATCH hetjob``) are refused: vsbatch places one GPU type per job.
- ``#PBS`` directives (which sbatch also reads unless ``--ignore-pbs``) are not interpreted.
- Command lines are logical lines (backslash continuations joined); heredocs and shell syntax are
  not interpreted.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from ..errors import JobScriptError

# How getopt_long treats an option's argument.
NONE, REQUIRED, OPTIONAL = "none", "required", "optional"

# sbatch's options (Slurm 22.05 sbatch(1), OPTIONS): long name -> (short letter or "", argument).
SBATCH_OPTIONS: dict[str, tuple[str, str]] = {
    "account": ("A", REQUIRED), "acctg-freq": ("", REQUIRED), "array": ("a", REQUIRED),
    "batch": ("", REQUIRED), "bb": ("", REQUIRED), "bbf": ("", REQUIRED), "begin": ("b", REQUIRED),
    "chdir": ("D", REQUIRED), "cluster-constraint": ("", REQUIRED), "clusters": ("M", REQUIRED),
    "comment": ("", REQUIRED), "constraint": ("C", REQUIRED), "container": ("", REQUIRED),
    "contiguous": ("", NONE), "core-spec": ("S", REQUIRED), "cores-per-socket": ("", REQUIRED),
    "cpu-freq": ("", REQUIRED), "cpus-per-gpu": ("", REQUIRED), "cpus-per-task": ("c", REQUIRED),
    "deadline": ("", REQUIRED), "delay-boot": ("", REQUIRED), "dependency": ("d", REQUIRED),
    "distribution": ("m", REQUIRED), "error": ("e", REQUIRED), "exclude": ("x", REQUIRED),
    "exclusive": ("", OPTIONAL), "export": ("", REQUIRED), "export-file": ("", REQUIRED),
    "extra-node-info": ("B", REQUIRED), "get-user-env": ("", OPTIONAL), "gid": ("", REQUIRED),
    "gpu-bind": ("", REQUIRED), "gpu-freq": ("", REQUIRED), "gpus": ("G", REQUIRED),
    "gpus-per-node": ("", REQUIRED), "gpus-per-socket": ("", REQUIRED), "gpus-per-task": ("", REQUIRED),
    "gres": ("", REQUIRED), "gres-flags": ("", REQUIRED), "help": ("h", NONE), "hint": ("", REQUIRED),
    "hold": ("H", NONE), "ignore-pbs": ("", NONE), "input": ("i", REQUIRED), "job-name": ("J", REQUIRED),
    "kill-on-invalid-dep": ("", REQUIRED), "licenses": ("L", REQUIRED), "mail-type": ("", REQUIRED),
    "mail-user": ("", REQUIRED), "mcs-label": ("", REQUIRED), "mem": ("", REQUIRED),
    "mem-bind": ("", REQUIRED), "mem-per-cpu": ("", REQUIRED), "mem-per-gpu": ("", REQUIRED),
    "mincpus": ("", REQUIRED), "network": ("", REQUIRED), "nice": ("", OPTIONAL),
    "no-kill": ("k", OPTIONAL), "no-requeue": ("", NONE), "nodefile": ("F", REQUIRED),
    "nodelist": ("w", REQUIRED), "nodes": ("N", REQUIRED), "ntasks": ("n", REQUIRED),
    "ntasks-per-core": ("", REQUIRED), "ntasks-per-gpu": ("", REQUIRED), "ntasks-per-node": ("", REQUIRED),
    "ntasks-per-socket": ("", REQUIRED), "open-mode": ("", REQUIRED), "output": ("o", REQUIRED),
    "overcommit": ("O", NONE), "oversubscribe": ("s", NONE), "parsable": ("", NONE),
    "partition": ("p", REQUIRED), "power": ("", REQUIRED), "prefer": ("", REQUIRED),
    "priority": ("", REQUIRED), "profile": ("", REQUIRED), "propagate": ("", OPTIONAL),
    "qos": ("q", REQUIRED), "quiet": ("Q", NONE), "reboot": ("", NONE), "requeue": ("", NONE),
    "reservation": ("", REQUIRED), "signal": ("", REQUIRED), "sockets-per-node": ("", REQUIRED),
    "spread-job": ("", NONE), "switches": ("", REQUIRED), "test-only": ("", NONE),
    "thread-spec": ("", REQUIRED), "threads-per-core": ("", REQUIRED), "time": ("t", REQUIRED),
    "time-min": ("", REQUIRED), "tmp": ("", REQUIRED), "uid": ("", REQUIRED), "usage": ("", NONE),
    "use-min-nodes": ("", NONE), "verbose": ("v", NONE), "version": ("V", NONE), "wait": ("W", NONE),
    "wait-all-nodes": ("", REQUIRED), "wckey": ("", REQUIRED), "wrap": ("", REQUIRED),
}
# Second long names in slurm_opt.c that set the same option.
SBATCH_ALIASES: dict[str, str] = {"cluster": "clusters"}
SHORT_OPTIONS: dict[str, str] = {short: name for name, (short, _) in SBATCH_OPTIONS.items() if short}

# SBATCH_* input environment variables that matter for placement (sbatch(1), INPUT ENVIRONMENT
# VARIABLES): they override the script and are overridden by the command line.
SBATCH_ENV_OPTIONS: dict[str, str] = {
    "SBATCH_ACCOUNT": "account", "SBATCH_GPUS": "gpus", "SBATCH_GPUS_PER_NODE": "gpus-per-node",
    "SBATCH_GPUS_PER_TASK": "gpus-per-task", "SBATCH_GRES": "gres", "SBATCH_PARTITION": "partition",
    "SBATCH_QOS": "qos", "SBATCH_JOB_NAME": "job-name", "SBATCH_RESERVATION": "reservation",
}

# vsbatch's own options (not sbatch's): long name -> takes a value. The vsbatch entry point may pass
# its own set to parse_sbatch_argv.
VSBATCH_OPTIONS: dict[str, bool] = {"dry-run": False, "json": False, "site-config": True}

GPU_OPTIONS = ("gres", "gpus", "gpus-per-node", "gpus-per-task")

Option = tuple[str, "str | None"]


@dataclass(frozen=True)
class VestDirective:
    """One ``#VEST`` line: its 1-based line number and the words after ``#VEST``."""

    lineno: int
    argv: tuple[str, ...]


@dataclass(frozen=True)
class CommandLine:
    """A logical command line of the script body (continuations joined), with its first line number."""

    lineno: int
    text: str


@dataclass(frozen=True)
class GresEntry:
    """One entry of a ``--gres`` list, ``name[:type][:count]``; count is per node."""

    name: str
    type: str | None
    count: int
    text: str  # the entry as written


@dataclass(frozen=True)
class GpuRequest:
    """The GPUs a job asks for, from its effective options.

    ``source`` is the option family the GPUs were asked with ("gres", "gpus", "gpus-per-node",
    "gpus-per-task"), or None when the job asks for no GPU. ``other_gres`` keeps the non-GPU gres
    entries verbatim so a rewrite of ``--gres`` preserves them.
    """

    source: str | None
    gpu_type: str | None
    gpus_per_node: int
    total_gpus: int
    nodes: int = 1
    ntasks: int | None = None
    ntasks_per_node: int | None = None
    gpus_per_task: int | None = None
    other_gres: tuple[str, ...] = ()

    @property
    def wants_gpu(self) -> bool:
        return self.total_gpus > 0

    def gres_string(self, gpu_type: str) -> str:
        """``gpu:<type>:<per node>`` (at least one GPU)."""
        return f"gpu:{gpu_type}:{max(self.gpus_per_node, 1)}"

    def overrides_for(self, gpu_type: str) -> tuple[Option, ...]:
        """The sbatch options that pin this request to ``gpu_type`` in the family the user used,
        keeping counts and non-GPU gres (command-line options override the script's)."""
        if self.source == "gpus":
            return (("gpus", f"{gpu_type}:{self.total_gpus}"),)
        if self.source == "gpus-per-node":
            return (("gpus-per-node", f"{gpu_type}:{self.gpus_per_node}"),)
        if self.source == "gpus-per-task":
            return (("gpus-per-task", f"{gpu_type}:{self.gpus_per_task}"),)
        return (("gres", ",".join((self.gres_string(gpu_type),) + self.other_gres)),)


@dataclass(frozen=True)
class JobScript:
    """A batch script as sbatch reads it. ``options`` are (long name, value or None) in script order."""

    path: str
    text: str
    shebang: str
    options: tuple[Option, ...]
    vest_directives: tuple[VestDirective, ...]
    commands: tuple[CommandLine, ...]
    first_command_line: int | None  # 1-based; None when the script has no command
    ignored_sbatch_lines: tuple[int, ...] = ()  # #SBATCH below the first command: sbatch ignores them

    @property
    def vest_argv(self) -> tuple[str, ...]:
        return tuple(w for d in self.vest_directives for w in d.argv)

    @property
    def partitions(self) -> tuple[str, ...]:
        return partitions_of(self.options)

    @property
    def gpu_request(self) -> GpuRequest:
        return gpu_request(self.options)

    def option(self, name: str) -> str | None:
        return option_value(self.options, name)


@dataclass(frozen=True)
class SbatchArgv:
    """vsbatch's command line split as sbatch splits it."""

    options: tuple[Option, ...]          # sbatch options, normalized, in order
    script: str | None                   # None: --wrap, or the script comes on stdin
    script_args: tuple[str, ...]
    own: tuple[Option, ...] = ()         # vsbatch's own options (--dry-run, ...)


# ---------------------------------------------------------------- words and getopt

def split_directive(text: str, lineno: int, where: str = "#SBATCH") -> list[str]:
    """Split the text after ``#SBATCH`` as sbatch's ``_get_argument`` does."""
    words: list[str] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i >= n or text[i] == "#":
            return words
        word: list[str] = []
        quote = ""
        while i < n and (quote or not text[i].isspace()):
            c = text[i]
            if c == "\\":
                if i + 1 < n:
                    word.append(text[i + 1])
                i += 2
                continue
            if quote:
                if c == quote:
                    quote = ""
                else:
                    word.append(c)
            elif c in "\"'":
                quote = c
            elif c == "#":
                words.append("".join(word))
                return words
            else:
                word.append(c)
            i += 1
        if quote:
            raise JobScriptError(
                f"line {lineno}: unmatched {quote} in {where} line",
                f"close the quote on line {lineno}, or escape it with a backslash",
            )
        words.append("".join(word))


def _long_name(given: str, where: str) -> str:
    """Resolve a long option name (exact, alias, or unambiguous prefix as getopt_long allows)."""
    if given in SBATCH_OPTIONS:
        return given
    if given in SBATCH_ALIASES:
        return SBATCH_ALIASES[given]
    names = set(SBATCH_OPTIONS) | set(SBATCH_ALIASES)
    hits = {SBATCH_ALIASES.get(n, n) for n in names if n.startswith(given)} if given else set()
    if len(hits) == 1:
        return hits.pop()
    if len(hits) > 1:
        raise JobScriptError(f"{where}: option --{given} is ambiguous ({', '.join('--' + h for h in sorted(hits))})",
                             "write the option's full name")
    raise JobScriptError(f"{where}: unknown sbatch option --{given}",
                         "check the spelling against `man sbatch` (options are case-sensitive)")


def _getopt(words: Sequence[str], where: str, own: Mapping[str, bool] | None = None
            ) -> tuple[list[Option], list[Option], int]:
    """getopt_long with a leading ``+``: returns (options, own options, index of the first operand)."""
    opts: list[Option] = []
    own_opts: list[Option] = []
    own = own or {}
    i = 0
    while i < len(words):
        w = words[i]
        if w == "--":
            return opts, own_opts, i + 1
        if w.startswith("--"):
            body = w[2:]
            name, eq, value = body.partition("=")
            if name in own:
                if own[name]:
                    if not eq:
                        if i + 1 >= len(words):
                            raise JobScriptError(f"{where}: option --{name} needs a value", f"write --{name}=VALUE")
                        i += 1
                        value = words[i]
                    own_opts.append((name, value))
                else:
                    if eq:
                        raise JobScriptError(f"{where}: option --{name} takes no value", f"write --{name} alone")
                    own_opts.append((name, None))
                i += 1
                continue
            name = _long_name(name, where)
            kind = SBATCH_OPTIONS[name][1]
            if kind == NONE:
                if eq:
                    raise JobScriptError(f"{where}: option --{name} takes no value", f"write --{name} alone")
                opts.append((name, None))
            elif kind == OPTIONAL:
                opts.append((name, value if eq else None))
            else:
                if not eq:
                    if i + 1 >= len(words):
                        raise JobScriptError(f"{where}: option --{name} needs a value", f"write --{name}=VALUE")
                    i += 1
                    value = words[i]
                opts.append((name, value))
            i += 1
            continue
        if w.startswith("-") and len(w) > 1:
            j = 1
            while j < len(w):
                c = w[j]
                if c not in SHORT_OPTIONS:
                    raise JobScriptError(f"{where}: unknown sbatch option -{c}",
                                         "check the spelling against `man sbatch` (options are case-sensitive)")
                name = SHORT_OPTIONS[c]
                kind = SBATCH_OPTIONS[name][1]
                rest = w[j + 1:]
                if kind == NONE:
                    opts.append((name, None))
                    j += 1
                    continue
                if kind == OPTIONAL:
                    opts.append((name, rest or None))
                elif rest:
                    opts.append((name, rest))
                else:
                    if i + 1 >= len(words):
                        raise JobScriptError(f"{where}: option -{c} (--{name}) needs a value", f"write -{c} VALUE")
                    i += 1
                    opts.append((name, words[i]))
                break
            i += 1
            continue
        return opts, own_opts, i
    return opts, own_opts, i


# ---------------------------------------------------------------- the script

def parse_job_script(text: str, path: str = "<stdin>") -> JobScript:
    """Parse a batch script's text. Raises JobScriptError naming the line and the fix."""
    if not text.strip():
        raise JobScriptError(f"{path}: the script is empty", "write a batch script starting with #!/bin/bash")
    if "\0" in text:
        raise JobScriptError(f"{path}: the script contains a NUL byte (sbatch refuses it)",
                             "remove the binary content; a batch script is text")
    if "\r\n" in text:
        line = text[: text.index("\r\n")].count("\n") + 1
        raise JobScriptError(f"{path}: line {line}: DOS line breaks (\\r\\n); sbatch refuses them",
                             f"convert the file: dos2unix {path}")
    lines = text.split("\n")
    if not lines[0].startswith("#!"):
        raise JobScriptError(f"{path}: line 1 does not start with #! (sbatch refuses such a script)",
                             "make the first line name the interpreter, e.g. #!/bin/bash")
    options: list[Option] = []
    directives: list[VestDirective] = []
    first_cmd: int | None = None
    ignored: list[int] = []
    for idx, line in enumerate(lines[1:], start=2):
        where = f"{path}: line {idx}"
        if first_cmd is None:
            if line.startswith("#SBATCH"):
                options.extend(_sbatch_line(line[len("#SBATCH"):], idx, where))
                continue
            if line.startswith("#VEST"):
                d = _vest_line(line, idx, where)
                if d is not None:
                    directives.append(d)
                continue
            stripped = line.lstrip()
            if not stripped or stripped.startswith("#"):
                continue
            first_cmd = idx
            continue
        if line.startswith("#SBATCH"):
            ignored.append(idx)
        elif _is_vest_directive(line):
            raise JobScriptError(
                f"{where}: #VEST line below the first command (line {first_cmd}); it would be ignored",
                f"move it above line {first_cmd}, next to the #SBATCH lines",
            )
    commands = tuple(_commands(lines, first_cmd)) if first_cmd else ()
    return JobScript(path=path, text=text, shebang=lines[0], options=tuple(options),
                     vest_directives=tuple(directives), commands=commands,
                     first_command_line=first_cmd, ignored_sbatch_lines=tuple(ignored))


MAX_SCRIPT_BYTES = 64 * 1024 * 1024  # far above Slurm's default max_script_size (4 MB)


def read_job_script(path: str | Path) -> JobScript:
    """Read and parse a script file; a missing, unreadable or huge file is a JobScriptError."""
    p = Path(path)
    try:
        if p.is_dir():
            raise JobScriptError(f"{p} is a directory, not a batch script", "give the path of the job script")
        size = p.stat().st_size
        if size > MAX_SCRIPT_BYTES:
            raise JobScriptError(f"{p} is {size} bytes, too large for a batch script",
                                 "check the path; Slurm refuses scripts over 4 MB by default")
        data = p.read_bytes()
    except FileNotFoundError:
        raise JobScriptError(f"job script {p} not found", "check the path (relative to the current directory)") from None
    except PermissionError:
        raise JobScriptError(f"job script {p} cannot be read (permission denied)", f"chmod u+r {p}") from None
    except OSError as e:
        raise JobScriptError(f"job script {p} cannot be read: {e.strerror}", "check the path") from None
    # surrogateescape keeps undecodable bytes, so hashing the text gives back the file's bytes.
    return parse_job_script(data.decode("utf-8", errors="surrogateescape"), str(path))


def _sbatch_line(rest: str, lineno: int, where: str) -> list[Option]:
    words = split_directive(rest, lineno)
    if words and words[0].lower() in ("hetjob", "packjob"):
        raise JobScriptError(f"{where}: heterogeneous job ({words[0]}) cannot be placed by vsbatch",
                             "submit heterogeneous jobs with plain sbatch")
    opts, _, end = _getopt(words, where)
    if end < len(words):
        raise JobScriptError(f"{where}: invalid #SBATCH directive {words[end]!r} (not an option)",
                             "write options as on the sbatch command line, e.g. #SBATCH --partition=a100")
    return opts


def _is_vest_directive(line: str) -> bool:
    return line == "#VEST" or (line.startswith("#VEST") and line[5].isspace())


def _vest_line(line: str, lineno: int, where: str) -> VestDirective | None:
    if line.startswith(("#VEST-ESTIMATE", "#VEST-RECORD")):
        return None  # attached by vsbatch (attach.py) / the bridge's record (accounting.py), not a directive
    if not _is_vest_directive(line):
        raise JobScriptError(f"{where}: malformed #VEST line {line[:40]!r}",
                             "put a space after #VEST, e.g. #VEST --model torchvision:resnet50 --batch-size 64")
    lex = shlex.shlex(line[5:], posix=True, punctuation_chars=False)
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        words = tuple(lex)
    except ValueError as e:
        raise JobScriptError(f"{where}: #VEST line cannot be split into options ({e})",
                             f"check the quotes on line {lineno}") from None
    return VestDirective(lineno, words)


def _commands(lines: list[str], first: int) -> Iterable[CommandLine]:
    start, parts = 0, []
    for idx in range(first, len(lines) + 1):
        line = lines[idx - 1]
        if not parts:
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            start = idx
        if line.endswith("\\") and idx < len(lines):
            parts.append(line[:-1])
            continue
        parts.append(line)
        yield CommandLine(start, "".join(parts).strip())
        parts = []
    if parts:
        yield CommandLine(start, "".join(parts).strip())


# ---------------------------------------------------------------- command line and precedence

def parse_sbatch_argv(argv: Sequence[str], own: Mapping[str, bool] = VSBATCH_OPTIONS) -> SbatchArgv:
    """Split ``vsbatch [options] script [script args]`` as sbatch does (options after the script
    belong to the script). ``own`` names vsbatch's own long options (name -> takes a value)."""
    opts, own_opts, end = _getopt(list(argv), "command line", own)
    rest = list(argv[end:])
    script = rest[0] if rest else None
    args = tuple(rest[1:])
    if option_value(opts, "wrap") is not None and script is not None:
        raise JobScriptError(f"command line: a script ({script!r}) and --wrap were both given",
                             "give either a job script or --wrap, not both")
    return SbatchArgv(tuple(opts), script, args, tuple(own_opts))


def options_from_env(env: Mapping[str, str]) -> tuple[Option, ...]:
    """The placement-relevant SBATCH_* input environment variables, as options."""
    return tuple((name, env[var]) for var, name in SBATCH_ENV_OPTIONS.items() if env.get(var) is not None)


def effective_options(*layers: Sequence[Option]) -> tuple[Option, ...]:
    """Merge option layers, lowest precedence first (script, environment, command line): for each
    option the last value of the highest layer wins; order is first appearance."""
    merged: dict[str, str | None] = {}
    for layer in layers:
        for name, value in layer:
            merged[name] = value
    return tuple(merged.items())


def option_value(options: Sequence[Option], name: str) -> str | None:
    """The last value given for ``name`` (None when absent or given without a value)."""
    value = None
    for n, v in options:
        if n == name:
            value = v
    return value


def has_option(options: Sequence[Option], name: str) -> bool:
    return any(n == name for n, _ in options)


def partitions_of(options: Sequence[Option]) -> tuple[str, ...]:
    value = option_value(options, "partition")
    return tuple(p.strip() for p in value.split(",") if p.strip()) if value else ()


# ---------------------------------------------------------------- GPUs

_COUNT = re.compile(r"\d+")


def parse_gres(text: str) -> tuple[GresEntry, ...]:
    """Parse a ``--gres`` list (``gpu:a100:2,shard:1``; also ``gres:``/``gres/`` prefixed entries
    as job_submit.lua sees them in tres_per_node). ``none`` is the empty list."""
    entries = []
    if text.strip().lower() in ("", "none"):
        return ()
    for raw in text.split(","):
        item = raw.strip()
        for prefix in ("gres:", "gres/"):
            if item.startswith(prefix):
                item = item[len(prefix):]
        fields = item.split(":")
        if not fields[0] or len(fields) > 3 or any(not f for f in fields):
            raise JobScriptError(f"malformed --gres entry {raw!r}", "write it as name[:type][:count], e.g. gpu:a100:2")
        name, gtype, count = fields[0], None, 1
        if len(fields) == 3:
            gtype, count_text = fields[1], fields[2]
        elif len(fields) == 2:
            if _COUNT.fullmatch(fields[1]) or name != "gpu" and re.fullmatch(r"\d+[KMGTP]?", fields[1], re.I):
                count_text = fields[1]
            else:
                gtype, count_text = fields[1], "1"
        else:
            count_text = "1"
        if name == "gpu":
            if not _COUNT.fullmatch(count_text):
                raise JobScriptError(f"malformed GPU count in --gres entry {raw!r}", "e.g. --gres=gpu:a100:2")
            count = int(count_text)
        else:
            count = int(count_text) if _COUNT.fullmatch(count_text) else 0
        entries.append(GresEntry(name, gtype, count, raw.strip()))
    return tuple(entries)


def _typed_count(option: str, text: str) -> tuple[str | None, int]:
    """``[type:]n`` (a comma list must name one GPU type)."""
    gtype: str | None = None
    total = 0
    for part in text.split(","):
        fields = part.strip().split(":")
        if len(fields) == 1 and _COUNT.fullmatch(fields[0]):
            t, n = None, int(fields[0])
        elif len(fields) == 2 and fields[0] and _COUNT.fullmatch(fields[1]):
            t, n = fields[0], int(fields[1])
        else:
            raise JobScriptError(f"malformed --{option}={text!r}", f"write --{option}=[type:]N, e.g. --{option}=a100:2")
        if t is not None and gtype is not None and t != gtype:
            raise JobScriptError(f"--{option}={text!r} asks for more than one GPU type",
                                 "vsbatch places a job on one GPU type: ask for one")
        gtype = gtype or t
        total += n
    return gtype, total


def _int_option(options: Sequence[Option], name: str) -> int | None:
    value = option_value(options, name)
    if value is None:
        return None
    m = re.fullmatch(r"\s*(\d+)(?:\s*-\s*\d+)?\s*", value)  # --nodes=min[-max]: the minimum
    if not m or int(m.group(1)) < 1:
        raise JobScriptError(f"--{name}={value!r} is not a positive whole number", f"e.g. --{name}=2")
    return int(m.group(1))


def gpu_request(options: Sequence[Option]) -> GpuRequest:
    """Derive the GPU request from effective options (script merged with command line)."""
    nodes = _int_option(options, "nodes") or 1
    ntasks = _int_option(options, "ntasks")
    ntasks_per_node = _int_option(options, "ntasks-per-node")
    tasks_per_node = ntasks_per_node or (math.ceil(ntasks / nodes) if ntasks else 1)
    tasks_total = ntasks or (ntasks_per_node * nodes if ntasks_per_node else nodes)
    asks: list[tuple[str, str | None, int, int]] = []  # (family, type, per node, total)
    other: tuple[str, ...] = ()
    gres = option_value(options, "gres")
    gpus_per_task = None
    if gres is not None:
        entries = parse_gres(gres)
        gpu = [e for e in entries if e.name == "gpu"]
        other = tuple(e.text for e in entries if e.name != "gpu")
        types = {e.type for e in gpu if e.type}
        if len(types) > 1:
            raise JobScriptError(f"--gres={gres!r} asks for more than one GPU type",
                                 "vsbatch places a job on one GPU type: ask for one")
        if gpu:
            per_node = sum(e.count for e in gpu)
            asks.append(("gres", types.pop() if types else None, per_node, per_node * nodes))
    value = option_value(options, "gpus")
    if value is not None:
        t, total = _typed_count("gpus", value)
        asks.append(("gpus", t, math.ceil(total / nodes), total))
    value = option_value(options, "gpus-per-node")
    if value is not None:
        t, per_node = _typed_count("gpus-per-node", value)
        asks.append(("gpus-per-node", t, per_node, per_node * nodes))
    value = option_value(options, "gpus-per-task")
    if value is not None:
        t, gpus_per_task = _typed_count("gpus-per-task", value)
        asks.append(("gpus-per-task", t, gpus_per_task * tasks_per_node, gpus_per_task * tasks_total))
    asks = [a for a in asks if a[3] > 0]
    if not asks:
        return GpuRequest(None, None, 0, 0, nodes, ntasks, ntasks_per_node, None, other)
    types = {a[1] for a in asks if a[1]}
    if len(types) > 1 or len({a[2] for a in asks}) > 1:
        given = ", ".join(f"--{a[0]}" for a in asks)
        raise JobScriptError(f"the GPU options ({given}) disagree on the GPU type or count",
                             "ask for GPUs with one option, e.g. --gres=gpu:a100:2")
    family, _, per_node, total = asks[0]
    return GpuRequest(family, types.pop() if types else None, per_node, total, nodes, ntasks,
                      ntasks_per_node, gpus_per_task, other)
