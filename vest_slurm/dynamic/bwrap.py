"""The dynamic-analysis child in a real sandbox: bubblewrap (Debian's ``bubblewrap``) around its
command line.

In: the child's argv, its temp dir (the one place it may write) and working directory. Out: the
argv to run instead (``bwrap OPTIONS -- argv``), or the argv unchanged with the reason when
bubblewrap cannot run here: not installed, or user namespaces disabled (some login nodes set
``kernel.unprivileged_userns_clone=0`` or ``user.max_user_namespaces=0``, or an AppArmor rule
forbids them). Then the child runs under bootstrap.py's audit hook only, which code outside Python
(ctypes, an extension module, a program it starts) can go around; ``sandbox_argv`` says so once per
process on stderr.

What the child sees under bubblewrap:
- every mount read-only (``--ro-bind / /``), with fresh empty tmpfs on /tmp, /var/tmp, /run and
  /dev/shm (other programs' files and UNIX sockets there are out of sight: connecting to a UNIX
  socket needs no write permission, so a read-only bind alone would not stop it), and the temp dir
  bound writable on top; writes anywhere else fail with EROFS, whoever makes them;
- a minimal /dev (``--dev``), its own /proc for its own PID namespace (``--unshare-pid``);
- a network namespace of its own with only loopback (``--unshare-net``), IPC and UTS namespaces;
- ``--die-with-parent``: killed when the runner dies; the runner's kill of the child's process
  group takes everything in it (bubblewrap keeps the group: no ``--new-session``).
bootstrap.py's audit hook stays on inside: it makes Python-level refusals readable and redirects
the script's own writes (logs, checkpoints) into the temp dir.

``VEST_BWRAP`` names the bubblewrap program (default ``bwrap`` on PATH); ``VEST_BWRAP=none`` runs
without it (the audit hook only), as on a host where it cannot run.

Known limitations:
- the read-only root still lets the child read what its user can read (that is the user's own job,
  run as the user: vsbatch never runs another user's script, site/trust.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ENV_VAR = "VEST_BWRAP"
_PROBE_TIMEOUT_S = 10.0      # one start of bwrap and /bin/true; only a wedged host takes longer
_HIDDEN = ("/tmp", "/var/tmp", "/run", "/dev/shm")

_probe: tuple[str | None, str] | None = None     # (bwrap path or None, why not)
_said = False


def _package_root() -> str:
    """The directory that holds the vest_slurm package (a checkout, or site-packages)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _under_hidden(paths) -> list[str]:
    """The existing directories among ``paths`` that lie strictly under a hidden directory, real
    paths, without those inside another of them (one bind shows the whole subtree)."""
    found: list[str] = []
    for p in paths:
        if not p:
            continue
        p = os.path.realpath(p)
        if not os.path.isdir(p) or not any(p.startswith(d + os.sep) for d in _HIDDEN):
            continue
        found.append(p)
    found = sorted(set(found))
    return [p for p in found if not any(p != q and p.startswith(q + os.sep) for q in found)]


def options(tmpdir: str, cwd: str, read: tuple[str, ...] = ()) -> list[str]:
    """bubblewrap's options for a child that may write ``tmpdir`` only and starts in ``cwd``;
    ``read``: other folders it reads (the user's model caches) wherever they are."""
    opts = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    for d in _HIDDEN:
        if os.path.isdir(d) and not os.path.islink(d):
            opts += ["--tmpfs", d]
    # What the child must read that lives under a hidden directory (a job in /tmp/..., a checkout
    # or a venv there, as CI's may be): visible again, read-only, as every other path. The job's
    # directory; vest_slurm itself (an editable install is found by a finder, not by sys.path);
    # every sys.path entry of this process, which the child inherits. Its writes go to the temp
    # dir (bootstrap.Sandbox).
    for path in _under_hidden([cwd, _package_root(), *sys.path, *read]):
        opts += ["--ro-bind", path, path]
    opts += ["--bind", tmpdir, tmpdir,
             "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
             "--die-with-parent", "--chdir", cwd]
    return opts


def available() -> tuple[str | None, str]:
    """(the bwrap program, "") when it can confine a child here, else (None, why not). Probed once
    per process by running ``/bin/true`` under the same options."""
    global _probe
    if _probe is not None:
        return _probe
    name = os.environ.get(ENV_VAR, "bwrap")
    if name == "none":
        _probe = (None, f"{ENV_VAR}=none")
        return _probe
    path = shutil.which(name)
    if path is None:
        _probe = (None, f"bubblewrap ({name}) is not installed (Debian: apt-get install bubblewrap)")
        return _probe
    tmp = os.path.realpath(os.environ.get("TMPDIR") or "/tmp")
    try:
        p = subprocess.run([path, *options(tmp, "/"), "--", "/bin/true"], capture_output=True,
                           stdin=subprocess.DEVNULL, timeout=_PROBE_TIMEOUT_S)
        why = "" if p.returncode == 0 else (p.stderr.decode(errors="replace").strip().splitlines() or
                                           [f"exit {p.returncode}"])[0]
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    _probe = (path, "") if not why else (None, f"bubblewrap cannot run here: {why[:200]} "
                                                "(user namespaces disabled?)")
    return _probe


def sandbox_argv(argv: list[str], tmpdir: str, cwd: str, read: tuple[str, ...] = ()) -> tuple[list[str], str]:
    """(the argv to run, "bubblewrap" or why only the audit hook confines the child)."""
    global _said
    path, why = available()
    if path is not None:
        return [path, *options(os.path.realpath(tmpdir), os.path.realpath(cwd), tuple(map(os.path.realpath, read))),
                "--", *argv], "bubblewrap"
    if not _said:
        _said = True
        sys.stderr.write(f"vest: {why}; the training script runs under Python's audit hook only, which "
                         "code outside Python (ctypes, extension modules) can go around\n")
    return list(argv), f"audit-hook: {why}"


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and every process under it (under bubblewrap the child is a
    grandchild of the runner, in its own PID namespace)."""
    return rss_bytes(_tree(pid))


def rss_bytes(pids) -> int:
    """Resident memory of these processes (one /proc/PID/status read each; gone ones count 0)."""
    return sum(_rss(p) for p in pids)


def tree_pids(pid: int) -> list[int]:
    """``pid`` and every process under it: a scan of all of /proc, a few ms of CPU."""
    return _tree(pid)


def tree_cpu_wait_s(pid: int) -> float:
    """Seconds the busiest process under ``pid`` (the script's; the bubblewrap parents only wait)
    spent runnable but waiting for a CPU that other work held: the second field of its
    /proc/PID/schedstat (the kernel's run-queue delay, ns, of its main thread, which runs the
    script). 0.0 where the kernel gives no schedstat."""
    worst = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/schedstat") as f:
                worst = max(worst, int(f.read().split()[1]))
        except (OSError, ValueError, IndexError):
            continue
    return worst / 1e9


def _tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
            ppid = int(data[data.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def reset_probe() -> None:
    """Forget the probe and the message (tests that change VEST_BWRAP)."""
    global _probe, _said
    _probe, _said = None, False
