"""What the end-to-end tests need from the machine, checked in one place.

Used by tests/conftest.py (the Slurm fixtures fail with this message when something is missing)
and by scripts/run-tests.sh before it starts pytest (``python tests/prereqs.py``), so a developer
and CI read the same words: what is missing, and the fix.

    python tests/prereqs.py                # exit 0: all there; 1: something missing (printed)
    python tests/prereqs.py --python-only  # only the Python imports (VEST_SKIP_SLURM=1 runs)
"""

from __future__ import annotations

import functools
import os
import shutil
import sys

FIX = "bash scripts/install.sh"
OPT_OUT = "VEST_SKIP_SLURM=1"
# The programs vest_slurm.slurm.testbed starts or calls (its missing_binaries() checks the same):
# munge and the Slurm daemons and client of Debian's packages.
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "squeue",
            "slurmdbd", "mariadbd", "mariadb-install-db", "sacct", "sacctmgr")
DEBIAN_PACKAGES = ("slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge lua-cjson lua-socket "
                   "slurmdbd mariadb-server")
# Hard dependencies of the test suite (pyproject's dependencies and its [test] extra): imported at
# the top of the test modules, so a missing one fails the run, as it should.
PYTHON_MODULES = ("torch",)


def _which(prog: str) -> str | None:
    return shutil.which(prog) or shutil.which(prog, path="/usr/sbin:/usr/bin:/sbin:/bin")


def missing_python() -> list[str]:
    out = []
    for mod in PYTHON_MODULES:
        try:
            __import__(mod)
        except Exception as e:   # not installed, or an install that does not import
            out.append(f"python cannot import {mod} ({type(e).__name__}: {e})")
    return out


@functools.lru_cache(maxsize=None)
def missing_slurm() -> tuple[str, ...]:
    """What the Slurm tests lack here: root, and the programs of the Debian packages."""
    out = []
    if os.geteuid() != 0:
        out.append("root (the testbed runs munged and slurmd, makes fake GPU device nodes, and the "
                   "bridge's directive worker drops privileges)")
    progs = [p for p in PROGRAMS if _which(p) is None]
    if progs:
        out.append(f"the programs {', '.join(progs)} (Debian packages {DEBIAN_PACKAGES})")
    return tuple(out)


def message(missing, slurm_missing=()) -> str:
    """``missing``: everything lacking; ``slurm_missing``: the part of it that only the Slurm tests need
    (those a developer may deselect on purpose)."""
    lines = ["this machine lacks what the tests need:"]
    lines += [f"  - {m}" for m in missing]
    lines.append(f"Fix: {FIX} (as root, or with sudo), then run the tests as root.")
    if slurm_missing and len(slurm_missing) == len(missing):
        lines.append(f"Or, deliberately without the end-to-end Slurm tests: {OPT_OUT} bash scripts/run-tests.sh "
                     "(deselects the tests marked slurm: they are not run, not passed).")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    slurm = () if "--python-only" in argv else missing_slurm()
    missing = missing_python() + list(slurm)
    if missing:
        print(message(missing, slurm), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
