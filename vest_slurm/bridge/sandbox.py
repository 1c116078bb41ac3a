"""Confinement of the bridge's directive worker: its own user, no network, no writes, bounded.

The worker (``worker.py``) traces ``#VEST`` directives for the decision server, which runs as the
controller's user. The directives are checked against an allow-list first (``allowlist.py``), so
the worker runs no code a job names; this module is the second wall, for the day a library it
builds models with turns out to do something it should not with a value from a job. In order:

1. ``unshare(CLONE_NEWNS | CLONE_NEWNET)``: a mount namespace of its own and a network namespace
   with no interface up (not even loopback), so no address is reachable.
2. Every mount remounted read-only (bind remounts, keeping each mount's nosuid/nodev/noexec), and a
   fresh, size-limited tmpfs on ``/tmp`` owned by the worker's user: its only writable place,
   invisible outside (the host's ``/tmp`` is hidden, too).
3. ``setgroups([]); setgid; setuid`` to the site's ``bridge.directive_user`` (default ``nobody``).
4. Resource limits: file size, data segment (memory), and CPU time per request (``limit_cpu``).
5. Once its libraries are loaded: ``PR_SET_NO_NEW_PRIVS`` and a seccomp filter that answers
   ``socket()`` (any family, UNIX sockets included: a net namespace does not cover those),
   ``execve`` and ``execveat`` with EACCES, so no socket is opened and no program started, even
   from C code.

Steps 1-3 need CAP_SYS_ADMIN and CAP_SETUID/CAP_SETGID: the server runs as root, or with those
capabilities as ambient ones (the shipped systemd unit). Without them the worker does not start
and the server says why; directives then count as no estimate (the site's unknown-job policy).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import pwd
import resource
import struct
from dataclasses import dataclass

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 0x400, 0x800, 0x200000
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
_MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2

# seccomp: per architecture, (AUDIT_ARCH, syscall numbers to refuse). From linux/audit.h and each
# architecture's unistd table (x86_64: socket 41, execve 59, execveat 322; aarch64's generic
# table: socket 198, execve 221, execveat 281).
_SECCOMP_ARCH = {"x86_64": (0xC000003E, (41, 59, 322)), "aarch64": (0xC00000B7, (198, 221, 281))}
_X32_SYSCALL_BIT = 0x40000000
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x06
_SECCOMP_RET_ALLOW, _SECCOMP_RET_KILL_PROCESS, _SECCOMP_RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000

TMP_DIR = "/tmp"
TMP_SIZE_MIB = 64


class SandboxError(RuntimeError):
    """The worker could not be confined; it must not serve."""


@dataclass(frozen=True)
class Confinement:
    """What the worker achieved, reported to the server (and its log) at start."""

    user: str
    uid: int
    gid: int
    network: str        # "none" (own namespace, no interface)
    filesystem: str     # "read-only, private tmpfs at /tmp"
    seccomp: str        # "socket, execve refused" or why not

    def line(self) -> str:
        return (f"user={self.user} uid={self.uid} network={self.network} filesystem={self.filesystem!r} "
                f"seccomp={self.seccomp!r}")


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    return libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise SandboxError(f"{what}: {os.strerror(e)}")


def _mounts() -> list[tuple[str, int]]:
    """(mount point, per-mount flags to keep) from /proc/self/mountinfo, parents before children."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")   # \040 for a space
            flags = 0
            for opt in fields[5].split(","):
                flags |= _MOUNT_FLAGS.get(opt, 0)
            out.append((point, flags))
    return sorted(out, key=lambda m: m[0].count("/"))


def _traversable(path: str, uid: int, gid: int) -> bool:
    st = os.stat(path)
    bits = (st.st_mode >> 6) if st.st_uid == uid else (st.st_mode >> 3) if st.st_gid == gid else st.st_mode
    return bool(bits & 1)


def _blocked(paths, uid: int, gid: int) -> dict[str, set[str]]:
    """{directory the user cannot enter: the names below it on the way to one of ``paths``}."""
    out: dict[str, set[str]] = {}
    for p in paths:
        parts = os.path.realpath(p).strip("/").split("/")
        for i in range(len(parts)):
            d = "/" + "/".join(parts[:i])
            if not _traversable(d, uid, gid):
                out.setdefault(d, set()).add(parts[i])
                break
    return out


def _expose(libc, paths, uid: int, gid: int) -> list[str]:
    """Make ``paths`` (Python, its libraries, vest itself) reachable for the worker's user where a
    directory on the way is closed to it (Python installed under /root, say), without opening that
    directory: it is covered by an empty tmpfs into which only the needed entries are bind-mounted.
    What else it held (a home directory) stays out of the worker's sight."""
    covered = []
    for _ in range(8):                     # a needed entry can sit below another closed directory
        blocked = _blocked(paths, uid, gid)
        if not blocked:
            return covered
        for d, names in sorted(blocked.items()):
            fds = {n: os.open(os.path.join(d, n), os.O_PATH) for n in names}
            _check(libc.mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=1m"),
                   f"covering {d}")
            for n, fd in fds.items():
                target = os.path.join(d, n)
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    os.mkdir(target)
                else:
                    open(target, "w").close()
                _check(libc.mount(f"/proc/self/fd/{fd}".encode(), target.encode(), None, MS_BIND | MS_REC, None),
                       f"exposing {target}")
                os.close(fd)
            covered.append(d)
    raise SandboxError(f"cannot make {', '.join(paths)} reachable for uid {uid}")


def needed_paths() -> list[str]:
    """What the worker reads after dropping privileges: the interpreter's prefixes, its import path,
    and the vest_slurm package."""
    import sys

    pkg = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)), pkg}
    paths.update(p for p in sys.path if p)
    return sorted(p for p in paths if os.path.exists(p))


def _readonly(libc, point: str, keep: int) -> None:
    rc = libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, None)
    if rc != 0 and ctypes.get_errno() not in (errno.EACCES, errno.ENOENT, errno.EINVAL):
        _check(rc, f"remounting {point} read-only")


def confine(user: str, memory_bytes: int, fsize_bytes: int = TMP_SIZE_MIB << 20) -> Confinement:
    """Steps 1-4 of the module docstring, in this process. Raises SandboxError if any fails."""
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise SandboxError(f"bridge.directive_user {user!r} does not exist on this host") from None
    if pw.pw_uid == 0:
        raise SandboxError("bridge.directive_user must not be root")
    libc = _libc()
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET),
           "unshare(mount, network) (needs root or CAP_SYS_ADMIN; see the systemd unit)")
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making mounts private")
    needed = needed_paths()
    _expose(libc, needed, pw.pw_uid, pw.pw_gid)
    # What the worker needs from under the host's /tmp (a checkout there, say) goes back on top of
    # the private tmpfs, read-only; nothing else of the host's /tmp stays visible.
    under_tmp = {p: os.open(p, os.O_PATH) for p in {os.path.realpath(q) for q in needed}
                 if p.startswith(TMP_DIR + "/")}
    for point, keep in _mounts():
        _readonly(libc, point, keep)
    opts = f"size={fsize_bytes},mode=0700,uid={pw.pw_uid},gid={pw.pw_gid}".encode()
    _check(libc.mount(b"tmpfs", TMP_DIR.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts), f"a private tmpfs on {TMP_DIR}")
    for path, fd in sorted(under_tmp.items()):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "w").close()
        _check(libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, MS_BIND | MS_REC, None),
               f"keeping {path} visible")
        _readonly(libc, path, MS_NOSUID | MS_NODEV)
        os.close(fd)
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        raise SandboxError("privileges could be regained after dropping them")
    os.chdir(TMP_DIR)
    os.environ.update(HOME=TMP_DIR, TMPDIR=TMP_DIR, USER=user, LOGNAME=user)
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_bytes, fsize_bytes))
    resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return Confinement(user, pw.pw_uid, pw.pw_gid, "none", f"read-only, private tmpfs at {TMP_DIR}", "pending")


def limit_cpu(seconds: float) -> None:
    """At most ``seconds`` more CPU time from now (SIGXCPU ends the worker; the server restarts it)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    soft = int(used + seconds) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _seccomp_program(machine: str) -> bytes:
    arch, refused = _SECCOMP_ARCH[machine]

    def ins(code, jt, jf, k):
        return struct.pack("HBBI", code, jt, jf, k)

    eacces = _SECCOMP_RET_ERRNO | errno.EACCES
    prog = [ins(_BPF_LD_W_ABS, 0, 0, 4),                      # seccomp_data.arch
            ins(_BPF_JEQ_K, 1, 0, arch),
            ins(_BPF_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS),
            ins(_BPF_LD_W_ABS, 0, 0, 0)]                      # seccomp_data.nr
    if machine == "x86_64":                                   # the x32 ABI's numbers alias others
        prog += [ins(_BPF_JGE_K, 0, 1, _X32_SYSCALL_BIT), ins(_BPF_RET_K, 0, 0, eacces)]
    for nr in refused:
        prog += [ins(_BPF_JEQ_K, 0, 1, nr), ins(_BPF_RET_K, 0, 0, eacces)]
    prog.append(ins(_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW))
    return b"".join(prog)


def refuse_sockets_and_exec() -> str:
    """Step 5: no new privileges, then the seccomp filter. Returns what is in force."""
    libc = _libc()
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    machine = platform.machine()
    if machine not in _SECCOMP_ARCH:
        raise SandboxError(f"no seccomp filter for {machine}: sockets could be opened")
    code = _seccomp_program(machine)
    n = len(code) // 8
    buf = ctypes.create_string_buffer(code, len(code))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(n, ctypes.addressof(buf))
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "installing the seccomp filter")
    return "socket, execve refused"
