"""Which processes a training script may start during the estimate.

In: an audit event that starts a process (``subprocess.Popen``, ``os.system``, ``os.exec``,
``os.posix_spawn``, ``os.spawn``, ``os.fork``, ``os.forkpty``) and its arguments, and whether the
child runs under bubblewrap (bwrap.py). Out: ``None`` when the process may start, else the reason
it may not (the sandbox raises it as a refusal naming the command).

Why not refuse every process: libraries start host tools while they import or introspect, and
catch the refusal as they would catch a tool that is missing, then take another path, silently.
Measured on the corpus (scripts/corpus.toml, Lightning's examples): jsonargparse runs
``python -c 'import sys, json; print(json.dumps(sys.path))'`` to find type stubs, and with it
refused, LightningCLI built no ``model`` arguments at all, so the model got none of its
hyperparameters and the script failed at ``self.hparams.learning_rate``; matplotlib runs
``fc-list``, ``ctypes.util.find_library`` runs ``ldconfig``, ``gcc`` and ``ld``. Such a tool
cannot do the job's GPU work: under bubblewrap it runs for real, confined as the script is (no
network, read-only files but the temp dir).

What stays refused, because its GPU work would be missing from the estimate without a word:
- a Python interpreter running a file or a module (``python train.py``, ``python -m pkg``), a
  program whose first line names Python (torchrun, accelerate, deepspeed are such launchers), or
  a shell command line that names one; a one-line ``python -c`` query runs, and so does a file of
  an installed package that names no torch (py-cpuinfo's query of the CPU);
- ``os.fork``/``os.forkpty``: the copy would carry the fake CUDA state and trace nothing;
- everything, when bubblewrap cannot run here: then only the audit hook confines the script, and
  a program it starts would not be confined at all.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil

CONFINED_ENV = "VEST_CONFINED"   # set by runner.py to "bubblewrap" when the child runs under it
_PYTHON = re.compile(r"^(python|pypy)[0-9.]*$")
_SHELLS = {"sh", "bash", "dash", "zsh", "ksh"}
_FORKS = {"os.fork", "os.forkpty"}


def _argv(event: str, args) -> list[str]:
    """The command's argv from the audit event's arguments (CPython's sys.audit calls)."""
    try:
        if event == "subprocess.Popen":        # (executable, args, cwd, env)
            exe, argv = args[0], args[1]
            argv = [os.fsdecode(a) for a in ([argv] if isinstance(argv, (str, bytes, os.PathLike)) else argv)]
            return ([os.fsdecode(exe)] + argv[1:]) if exe else argv
        if event == "os.system":               # (command,)
            return ["/bin/sh", "-c", os.fsdecode(args[0])]
        if event in ("os.exec", "os.posix_spawn", "os.spawn"):   # (path, argv, env) / (mode, path, argv, env)
            path, argv = (args[1], args[2]) if event == "os.spawn" else (args[0], args[1])
            return [os.fsdecode(path)] + [os.fsdecode(a) for a in list(argv)[1:]]
    except (IndexError, TypeError, ValueError):
        pass
    return []


def _runs_python(exe: str) -> bool:
    name = os.path.basename(exe)
    if _PYTHON.match(name):
        return True
    path = exe if os.sep in exe else shutil.which(exe)
    try:
        with open(path or "", "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def _python_work(argv: list[str]) -> bool:
    """Whether a Python interpreter's argv runs a file or a module (not a ``-c`` one-liner)."""
    for a in argv[1:]:
        if a == "-c" or (a.startswith("-") and not a.startswith("--") and a.endswith("c") and "m" not in a):
            return False
        if a == "-m" or not a.startswith("-"):
            return True
    return False   # the bare interpreter reads stdin: a query piped in


def refusal(event: str, args, confined: bool) -> str | None:
    """None when the process may start; else why not, for the refusal message."""
    if event in _FORKS:
        return "a fork would copy the fake GPU state"
    if not confined:
        return "without bubblewrap a program it starts would not be confined"
    argv = _argv(event, args)
    if not argv:
        return "a process vest could not read the command of"
    return _training_work(argv)


def _stand_in(exe: str) -> bool:
    """The run's own nvidia-smi (nvidia_smi.py): a query answered from the GPU type, no GPU work."""
    mine = os.environ.get("VEST_NVIDIA_SMI")
    return bool(mine) and (exe == mine or shutil.which(exe) == mine)


def _training_work(argv: list[str]) -> str | None:
    exe = argv[0]
    if _stand_in(exe):
        return None
    if os.path.basename(exe) in _SHELLS and "-c" in argv[1:-1]:
        line = argv[argv.index("-c") + 1]
        try:
            words = shlex.split(line)
        except ValueError:
            return f"a shell command vest could not read ({line[:80]!r})"
        for i, w in enumerate(words):
            if not _stand_in(w) and _runs_python(w) and _python_work(words[i:]):
                return f"its GPU work ({line[:80]!r}) would be missing from the estimate"
        return None
    if _runs_python(exe):
        if _python_work(argv) and not _host_tool_of_a_library(argv):
            return f"its GPU work ({' '.join(argv)[:80]!r}) would be missing from the estimate"
        return None
    return None


def _host_tool_of_a_library(argv: list[str]) -> bool:
    """Whether a Python interpreter's argv runs a file of an installed package that uses no torch:
    a library querying the host in a process of its own (py-cpuinfo runs ``python cpuinfo.py
    --json``, which MosaicML composer's Trainer and DeepSpeed's op builders call). It can do no GPU
    work; refused, it stopped every composer Trainer. A module run with ``-m``, or a file that
    names torch (a launcher, a library's worker), stays refused."""
    from ..estimate import frames

    path = next((a for a in argv[1:] if not a.startswith("-")), None)
    if path is None or "-m" in argv[1:argv.index(path)] or frames.origin(os.path.abspath(path)) != frames.LIBRARY:
        return False
    try:
        if os.path.getsize(path) > 4 << 20:
            return False
        with open(path, "rb") as f:
            return re.search(rb"\btorch\b", f.read()) is None
    except OSError:
        return False
