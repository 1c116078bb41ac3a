"""Traces of the other GPU classes made beside the first one, in forked children.

A job is traced once per GPU class (estimator.trace_classes; advice.Prober for `vest check`), one
after another, and a trace is most of what an estimate costs. On a login node with cores to spare
the other classes' traces start ahead in children forked before the first one begins: ``start``
forks one per (workload, GPU type) asked for; ``take`` gives the child's trace (TraceSummary, or the
EstimateError its trace raised) where the same workload is traced on the same GPU type, and
estimator.trace_for calls it first. Where the first class's trace turns out to hold on another
(trace.holds_on) the caller shares it and ``cancel`` stops that child. Nothing here changes what
is traced: a child runs trace_for as the parent would, from the state the parent had at the fork
(no trace running), and a child that fails to answer (killed, a result that cannot be pickled)
leaves the trace to the parent. ``VEST_TRACE_AHEAD=0`` turns it off; it is off with one core, and
where no core is idle (the tasks runnable now: _idle_cores), as on a login node busy with other
users' work.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal

_AHEAD: dict[tuple, "_Child"] = {}


def cores() -> int:
    """The cores this process may use (cudnn_ws's pool of workers: those of them free now): those
    it may run on (a cgroup's cpuset), and no more than its cgroups' CPU quota allows (a login
    node's per-user limit, systemd's CPUQuota=: two processes under a one-core quota take turns)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _quota_cores()
    return max(1, min(n, int(quota))) if quota is not None else n


def _quota_cores(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> float | None:
    """The CPU time per period this process's cgroup and its parents allow, in cores (the least
    of them), from cgroup v2's cpu.max or v1's cpu.cfs_quota_us / cpu.cfs_period_us; None where no
    quota is set or none can be read."""
    try:
        with open(own) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    least = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        v2 = hid == "0" and controllers == ""
        if not v2 and "cpu" not in controllers.split(","):
            continue
        base = root if v2 else os.path.join(root, controllers)
        here = path.strip("/")
        while True:
            q = _read_quota(os.path.join(base, here), v2)
            if q is not None:
                least = q if least is None else min(least, q)
            if not here:
                break
            here = os.path.dirname(here)
    return least


def _read_quota(folder: str, v2: bool) -> float | None:
    try:
        if v2:
            with open(os.path.join(folder, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
        else:
            with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()
            with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        if quota in ("max", "-1") or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _idle_cores(loadavg: str | None = None, own: int | None = None) -> float:
    """Cores a child could have beside this process: the cores, less one for this process, less
    the other tasks runnable now (/proc/loadavg's fourth field, less this process's own runnable
    threads: ``own``, read from /proc/self/task where not given). Not the load average: it trails
    the last minute, in which this process's own earlier commands and their children ran (a
    benchmark's or a script's commands one after another found it at 1 to 2 on two idle cores and
    started no child), while another user's busy process is runnable now as it was then. Not this
    process's threads: after a parallel region of torch's CPU ops its OpenMP workers spin for a
    while before they sleep, runnable, and counted as busy cores they kept every child off."""
    try:
        if loadavg is None:
            with open("/proc/loadavg") as f:
                loadavg = f.read()
        running = int(loadavg.split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    if own is None:
        own = _own_runnable()
    return float(cores() - 1 - max(0, running - max(own, 1)))


def _own_runnable() -> int:
    """This process's threads runnable now (their state in /proc/self/task/*/stat), at least this one."""
    n = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                n += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            continue
    return max(n, 1)


def free_cores() -> int:
    """The cores work forked now would have: this process's (it waits for the work) and those
    idle now (_idle_cores), within ``cores()``; at least one."""
    return max(1, min(cores(), 1 + int(_idle_cores())))


# A child is started where a core is free for it: on two cores with nothing else runnable a child
# doubles the work done; beside another busy process it only slows this one.
MIN_IDLE_CORES = 1


def enabled() -> bool:
    return os.environ.get("VEST_TRACE_AHEAD", "1") != "0" and cores() >= 2 and _idle_cores() >= MIN_IDLE_CORES


class _Child:
    def __init__(self, pid: int, fd: int):
        self.pid, self.fd = pid, fd

    def result(self):
        """(True, value) or (False, None) where the child gave no answer."""
        try:
            with os.fdopen(self.fd, "rb") as f:
                data = f.read()
            os.waitpid(self.pid, 0)
            ok, value = pickle.loads(data)
            return ok, value
        except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError):
            return False, None

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.close(self.fd)
            os.waitpid(self.pid, 0)
        except OSError:
            pass


# What a process keeps at its exit (atexit) that a child's work adds to, run at the end of each
# child's work: a child leaves by os._exit, skipping the atexit handlers, which are the parent's
# (its temporary directories' clean-up among them). cuDNN's answers file registers its save here:
# the answers a child asked were lost, and a warm `vest check` asked them again on every run.
_AT_CHILD_END: list = []


def at_child_end(fn) -> None:
    """Have ``fn()`` run in every child (start) after its work, before its answer is sent."""
    if fn not in _AT_CHILD_END:
        _AT_CHILD_END.append(fn)


def _run_child(w: int, fn, args) -> None:
    try:
        out = (True, fn(*args))
    except Exception as e:   # an EstimateError is an answer; anything else the parent meets itself
        from ..errors import EstimateError

        out = (True, e) if isinstance(e, EstimateError) else (False, None)
    for end in _AT_CHILD_END:
        try:
            end()
        except Exception:
            pass   # what is kept saves time, never an answer
    try:
        data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        data = pickle.dumps((False, None))
    with os.fdopen(w, "wb") as f:
        f.write(data)


def start(key: tuple, fn, *args) -> bool:
    """Fork a child computing ``fn(*args)`` for ``key`` (where none runs yet); False where none
    could be started (off, one core, no fork)."""
    if key in _AHEAD or not enabled():
        return False
    from . import progress

    try:
        r, w = os.pipe()
        with progress.held_for_fork():
            pid = os.fork()
    except OSError:
        return False
    if pid == 0:   # the child: never returns into the caller's code
        code = 0
        try:
            progress.after_fork_in_child()
            os.close(r)
            for other in _AHEAD.values():   # the parent's other children are the parent's to take
                os.close(other.fd)
            _AHEAD.clear()
            _run_child(w, fn, args)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    _AHEAD[key] = _Child(pid, r)
    return True


def take(key: tuple):
    """(True, the child's answer) for ``key``, waiting for it; (False, None) where no child ran
    for it or it gave no answer (the caller makes the trace itself)."""
    child = _AHEAD.pop(key, None)
    if child is None:
        return False, None
    return child.result()


def cancel(match=lambda key: True) -> None:
    """Stop the children whose key ``match``es (their traces are not needed)."""
    for key in [k for k in _AHEAD if match(k)]:
        _AHEAD.pop(key).kill()


atexit.register(cancel)
