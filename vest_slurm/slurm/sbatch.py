"""The sbatch command line, built by one pure function, and pure parsers of sbatch's output.

The argv goes to ``subprocess`` as a list (never through a shell), so no value is quoted here;
``format_command`` quotes only for display (``vsbatch --dry-run``).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import SlurmError, VestError
from .jobscript import SBATCH_OPTIONS, Option

REMOVE = object()  # an override value that drops the option


def build_sbatch_argv(options: Sequence[Option], script_path: str | None, script_args: Sequence[str] = (),
                      overrides: Mapping[str, object] | Sequence[tuple[str, object]] = (),
                      sbatch: str = "sbatch") -> list[str]:
    """``[sbatch, --opt=value..., script, args...]``: the user's options in their order, except the
    overridden ones, which take the override's value at their first place (later repeats dropped);
    overrides of options the user did not give come after. Value None means a flag (``--hold``),
    ``REMOVE`` drops the option. ``script_path`` None: no script (``--wrap``)."""
    over = dict(overrides.items() if isinstance(overrides, Mapping) else overrides)
    for name in over:
        _check_name(name)
    out = [sbatch]
    done: set[str] = set()
    for name, value in options:
        _check_name(name)
        if name in over:
            if name not in done and over[name] is not REMOVE:
                out.append(_arg(name, over[name]))
            done.add(name)
            continue
        out.append(_arg(name, value))
    out += [_arg(n, v) for n, v in over.items() if n not in done and v is not REMOVE]
    if script_path is not None:
        _check_value("script path", script_path)
        if not script_path:
            raise VestError("empty script path", "give the path of the job script")
        # A path starting with "-" would be read as an option.
        out.append("./" + script_path if script_path.startswith("-") else script_path)
        for a in script_args:
            _check_value("script argument", a)
            out.append(a)
    return out


def _check_name(name: str) -> None:
    if name not in SBATCH_OPTIONS:
        raise VestError(f"--{name} is not an sbatch option", "use the option's full long name, e.g. partition")


def _check_value(what: str, value: object) -> None:
    if not isinstance(value, str):
        raise VestError(f"{what} {value!r} is not a string", "pass option values as strings")
    if "\0" in value:
        raise VestError(f"{what} contains a NUL byte, which cannot be passed to a program", "remove it")


def _arg(name: str, value: object) -> str:
    if value is None:
        return f"--{name}"
    _check_value(f"--{name} value", value)
    return f"--{name}={value}"


def format_command(argv: Sequence[str]) -> str:
    """Shell-quoted, for display only."""
    return shlex.join(argv)


@dataclass(frozen=True)
class Submitted:
    job_id: int
    cluster: str | None = None


_SUBMITTED = re.compile(r"^Submitted batch job (\d+)(?: on cluster (\S+))?\s*$", re.M)
_PARSABLE = re.compile(r"^(\d+)(?:;(\S+))?\s*$", re.M)


def parse_sbatch_output(stdout: str) -> Submitted:
    """``Submitted batch job 123`` (``on cluster X`` with -M), or ``--parsable``'s ``123`` / ``123;cluster``."""
    m = _SUBMITTED.search(stdout) or _PARSABLE.search(stdout)
    if not m:
        raise SlurmError(f"sbatch printed no job id: {stdout.strip()[:200]!r}",
                         "check squeue for the job, and sbatch's messages above")
    return Submitted(int(m.group(1)), m.group(2))


@dataclass(frozen=True)
class WouldStart:
    job_id: int
    start: str
    processors: int
    nodes: str
    partition: str


_TEST_ONLY = re.compile(r"Job (\d+) to start at (\S+) using (\d+) processors on nodes (\S+) in partition (\S+)")


def parse_test_only(stderr: str) -> WouldStart:
    """``sbatch --test-only`` prints where the job would start on stderr."""
    m = _TEST_ONLY.search(stderr)
    if not m:
        raise SlurmError(f"sbatch --test-only said: {stderr.strip()[:200]!r}", "see sbatch's message")
    return WouldStart(int(m.group(1)), m.group(2), int(m.group(3)), m.group(4), m.group(5))
