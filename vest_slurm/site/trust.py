"""Whose code a command may run: a job's code runs as the user who owns it, or not at all.

``vsbatch``, ``vest check`` and ``vest estimate`` run a job's code to estimate it: its training
script (dynamic analysis) and the model factories its ``#VEST`` line names. Run by a user on a
script they chose, that is their choice, as running the script would be. Run by root, or by an
admin the site exempts from the checks (``policy.exempt_users``), on a script another user wrote,
it would be that user's code with the admin's rights. Then vest does what the bridge does:
``#VEST`` lines are read by the allow-list (``allowlist.py``: models named from installed
libraries, no factories), and a training script is not run; the message says how to run the
command as the script's owner instead.

A file owned by root or by the runner is the runner's own; any other owner makes it foreign.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from typing import Iterable

from ..errors import VestError


class ForeignCode(VestError):
    """A privileged runner was about to run another user's code."""


@dataclass(frozen=True)
class Runner:
    uid: int
    name: str | None
    why: str | None      # "root", "an exempt admin", or None (an ordinary user)

    @property
    def privileged(self) -> bool:
        return self.why is not None


def runner(site=None, uid: int | None = None) -> Runner:
    uid = os.geteuid() if uid is None else uid
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = None
    if uid == 0:
        why = "root"
    elif site is not None and name is not None and name in site.policy.exempt_users:
        why = "an exempt admin"
    else:
        why = None
    return Runner(uid, name, why)


def _owner(path: str) -> tuple[int, str]:
    uid = os.stat(path).st_uid
    try:
        return uid, pwd.getpwuid(uid).pw_name
    except KeyError:
        return uid, str(uid)


def foreign_owner(paths: Iterable[str | None], who: Runner) -> tuple[str, str] | None:
    """(path, owner) of the first existing file owned by neither root nor the runner, or None."""
    for p in paths:
        if not p or not os.path.exists(p):
            continue
        uid, name = _owner(p)
        if uid not in (0, who.uid):
            return p, name
    return None


def foreign_job(paths: Iterable[str | None], site=None, who: Runner | None = None) -> tuple[str, str] | None:
    """Where a privileged runner holds another user's job: (path, owner), else None."""
    who = who or runner(site)
    return foreign_owner(paths, who) if who.privileged else None


def refuse_script(path: str, owner: str, what: str, site=None) -> ForeignCode:
    who = runner(site)
    return ForeignCode(
        f"{path} belongs to {owner}; vest does not run another user's code as {who.why} ({what})",
        f"run it as its owner: runuser -u {owner} -- <the same command>, or describe the workload with a "
        "#VEST --model line naming a torchvision, timm, transformers or mlp model (read as the bridge reads it)")


def parse_directives(argv, job_path: str | None, site=None):
    """A job script's #VEST options as a WorkloadSpec: as the user's own (parse_workload_args), or,
    where a privileged runner holds another user's script, by the bridge's allow-list."""
    from ..estimate.workload import parse_workload_args

    foreign = foreign_job([job_path], site)
    if foreign is None:
        return parse_workload_args(list(argv))
    from ..estimate.allowlist import DirectiveRefused, parse_untrusted

    try:
        return parse_untrusted(argv)
    except DirectiveRefused as e:
        raise refuse_script(foreign[0], foreign[1], f"its #VEST line: {e.what}", site) from None


def check_train_command(train, cwd: str, job_path: str | None = None, site=None) -> None:
    """Refuse (ForeignCode) to run a training command whose script, job script, Python environment
    (where it is not vest's) or (for ``python -m``) working directory belongs to another user, when
    the runner is privileged."""
    cwd = train.workdir(cwd)   # where the job script's `cd` lines took it
    script = os.path.join(cwd, train.script) if train.script else None
    from ..estimate.cudnn_ws import environment_of, other_python

    # the job's own Python (a venv's, which the estimate runs the script in and asks for its cuDNN):
    # its environment's folder is its owner's code as much as the script is
    theirs = other_python(train.program, train.path, cwd)
    venv = environment_of(theirs) if theirs else None
    foreign = foreign_job([job_path, script, None if train.script else cwd, venv], site)
    if foreign is not None:
        raise refuse_script(foreign[0], foreign[1], f"the training command `{train.display}`", site)
