"""Child process of the dynamic analysis: run an unmodified training script with fake CUDA.

    python -m vest_slurm.dynamic.bootstrap --out RESULT.json --steps 3 --tmpdir DIR [...] -- script.py ARGS
    python -m vest_slurm.dynamic.bootstrap ... --module pkg.train -- ARGS

The parent (vest_slurm/dynamic/runner.py) starts this in a fresh process session with a wall-time and
memory limit. Here:
- Host code runs for real; only the GPU is fake (vest_slurm/estimate/_fakecuda.py, ``host_real``):
  tensors on the host (data loading, index sampling, numpy interop, metrics) are real tensors with
  real values; tensors on ``cuda`` carry shapes, dtypes and strides but no data, so building a
  7-billion-parameter model costs no memory (a module's constructor builds its weights fake).
  ``torch.cuda.is_available()`` is true and the device properties are the target GPU's.
- Values read from a fake tensor (``.item()``, ``.tolist()``, ``bool()``, ``format()``, ``.numpy()``)
  are stand-ins (1 / 1.0 / False / zeros), listed with the script's line (tracked.py); a model
  input shaped by one, or with an empty dimension, ends the run as data-dependent.
- Other calls that need a real GPU get stand-ins (standins.py): GradScaler, ``torch.compile``
  (eager), CUDA events, streams, memory queries (answered from the trace), ``torch.save`` (a
  marker), DistributedDataParallel (DDP's gradient buckets), ``torch.distributed`` (one rank of
  the launch's world size).
- DataLoader workers are forced to 0: only the batches used are read, in this process.
- A PEP 578 audit hook refuses network connections and new processes; writes outside the temp dir
  go into it, behind an overlay the script reads back through (Sandbox); multiprocessing's spawn
  and forkserver children run under the same overlay (spawned.py).
- A no-grad call of the model that repeats an earlier one exactly (evaluation batches, sampled
  tokens) is replayed from its trace instead of run (repeats.py says when; Python state outside
  the model's modules that such a call changes is not seen).
- The script is stopped after N training steps (StopTracing, a BaseException the script's own
  ``except Exception`` does not catch): optimizer steps; without torch.optim, backward passes each
  followed by in-place updates of the parameters; or, with neither, forward passes under grad;
  each optimizer the script made steps at least once (WAIT_FOR_OPTIMIZERS). Where a DataLoader
  feeds those steps, the run first goes on to the end of the epoch (its evaluation, sampling,
  saving: DRAIN_BATCHES) and stops at the next training step.
  The trace is written as JSON for the parent, with what the script did (precision, cudnn.benchmark,
  zero_grad placement, the batch seen) and, on failure, who must act (classify).
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import io
import json
import os
import runpy
import socket
import sys
import threading
import traceback

from ..estimate import frames
from . import children

STATUS_OK = "ok"


# what the runner sends the run when its time limit is reached (at_the_time_limit in run)
TIME_LIMIT_SIGNAL = 10   # SIGUSR1 (signal.SIGUSR1, without importing signal at import time)


CHECKPOINTS_READ = "checkpoints-read"   # in the temp dir: the checkpoint files the run read (Sandbox.checkpoint_read)
CHECKPOINT_LISTED = 64 << 20            # listed from this size: a model's weights, not a config or a small state
_CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


class StopTracing(BaseException):
    """Raised after the N-th optimizer step: ends the script, keeps the trace."""


class DataDependentLoop(BaseException):
    """Raised at the time limit in a loop of training forwards whose test reads stand-ins
    (standins.ScriptState.note_read), before any step: a BaseException, so that no ``except
    Exception`` of the script or of torch's own code keeps the loop going."""


class Refused(PermissionError):
    pass


# ---- sandbox -----------------------------------------------------------------------------------

def _local_host(host) -> bool:
    """An address of this machine only: the wildcard, localhost, loopback."""
    if not isinstance(host, str):
        return False
    return host in ("", "0.0.0.0", "::", "localhost", "::1") or host.startswith("127.")


def _sqlite_file(database) -> str | None:
    """The file an sqlite3.connect() opens read-write: None for ":memory:" and for a read-only URI."""
    if not isinstance(database, (str, bytes, os.PathLike)):
        return None
    name = os.fsdecode(database)
    if name in ("", ":memory:") or (name.startswith("file:") and ("mode=ro" in name or "mode=memory" in name)):
        return None
    return name


def _overlaid_sqlite(sandbox: "Sandbox", guarded) -> None:
    """sqlite3.connect() of a file (a metrics or study database: optuna, MLflow's local store) opens
    it through the overlay: SQLite's C code opens the path itself, past the Python-level overlay
    (under bubblewrap it met the read-only file system and was said as the script's error; under
    the audit hook alone it wrote the real file). Its journal goes beside it, into the overlay."""
    try:
        import sqlite3
    except ImportError:
        return
    real = sqlite3.connect

    def connect(database, *a, **k):
        name = _sqlite_file(database)
        if name is not None and not name.startswith("file:"):
            database = sandbox.update(database)
        return real(database, *a, **k)

    sqlite3.connect = sqlite3.dbapi2.connect = guarded(connect, real)


class _AnyFileIO(type):
    """io.FileIO's stand-in is the real class to isinstance (numpy's and joblib's checks of a file
    object that open() made)."""

    def __instancecheck__(cls, obj):
        return isinstance(obj, _REAL_FILE_IO)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, _REAL_FILE_IO)


_REAL_FILE_IO = io.FileIO


def _overlaid_file_io(opened):
    """io.FileIO made by the script or a library (blobfile's writer subclasses it) through the
    overlay (``opened``: Sandbox.opened, guarded), as open() is; built-in open() makes its own
    FileIO in C, which this does not see."""

    class FileIO(_REAL_FILE_IO, metaclass=_AnyFileIO):
        def __init__(self, file, mode="r", closefd=True, opener=None):
            super().__init__(opened(file, mode), mode, closefd, opener)

    return FileIO


def _writing_mode(mode) -> bool:
    return isinstance(mode, str) and any(c in mode for c in "wax+")


class Sandbox:
    """Writes only in ``tmpdir``, no network, no new processes. Writes to other paths are
    redirected into ``tmpdir/redirected/<the absolute path>``, and the script sees an overlay: a
    later open, stat, listdir, rename, replace, move, utime or remove of such a path, Python-level
    (``open``, pathlib, shutil, numpy) or ``os``-level, finds the redirected file, so a script that
    writes a file and reads it back, or saves atomically through a temp file and ``os.replace``,
    runs as it would. A real file it updates (append, read-write) is copied into the overlay first.
    Paths it never wrote are the real ones, read-only."""

    def __init__(self, tmpdir: str, forks: bool = False):
        self.tmpdir = os.path.realpath(tmpdir)
        # a process with no fake GPU (a child of multiprocessing's spawn or forkserver, spawned.py)
        # may fork: the copy has nothing of the estimate's, and keeps this sandbox (the forkserver
        # forks every worker it is asked for)
        self.forks = forks
        self.root = os.path.join(self.tmpdir, "redirected")
        self.redirected: list[str] = []
        self.refused: list[str] = []
        self.started: list[str] = []   # host tools it ran (children.py)
        # the runner says whether bubblewrap confines this process (and so what it starts)
        self.confined = os.environ.get(children.CONFINED_ENV) == "bubblewrap"

    def inside(self, path) -> bool:
        try:
            p = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return p == self.tmpdir or p.startswith(self.tmpdir + os.sep) or p in ("/dev/null", "/dev/stdout", "/dev/stderr")

    def _target(self, path) -> str:
        return os.path.join(self.root, os.path.abspath(os.fsdecode(path)).lstrip(os.sep))

    def redirect(self, path):
        """Where a write to ``path`` goes (its parent directories made in the overlay)."""
        if isinstance(path, int) or self.inside(path):
            return path
        target = self._target(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if len(self.redirected) < 1000:
            self.redirected.append(os.path.abspath(os.fsdecode(path)))
        return target

    def update(self, path):
        """Where an update of ``path`` goes (append, read-write without truncating): its redirected
        copy, made from the real file on the first such open (copy-on-write, as an overlay file
        system does), so that the script reads what was there and what it added. A lock file that
        an earlier run left (filelock opens it read-write), a log appended to, a cache updated in
        place. A file larger than COPY_ON_WRITE_MAX is refused, not copied."""
        if isinstance(path, int) or self.inside(path):
            return path
        if self.seen(path) != path or not os.path.isfile(path):
            return self.written(path)   # its copy already, or nothing there to keep
        size = os.path.getsize(path)
        if size > COPY_ON_WRITE_MAX:
            self.refused.append(f"update {path}")
            raise Refused(f"vest: the training script opened {os.fsdecode(path)!r} ({size / 2**20:.0f} MiB) to update it "
                          f"in place; vest copies such a file into its temp dir only up to {COPY_ON_WRITE_MAX >> 20} MiB")
        import shutil

        target = self.redirect(path)
        shutil.copyfile(path, target)
        return target

    def written(self, path):
        """Where a write that replaces ``path`` goes: the script's copy where it has one, else a new
        one (redirect)."""
        target = self.seen(path)
        return target if target != path else self.redirect(path)

    def opened(self, file, mode="r"):
        """Where an open of ``file`` in ``mode`` goes: a read sees the script's copy, a write ("w",
        "x") replaces it, an update ("a", "r+") starts from what is there."""
        if isinstance(file, int):
            return file
        if not _writing_mode(mode):
            return self.seen(file)
        if "w" in mode or "x" in mode:
            return self.written(file)
        return self.update(file)

    def seen(self, path):
        """Where a read of ``path`` goes: the redirected copy where the script wrote one."""
        if isinstance(path, int) or path is None:
            return path
        try:
            target = self._target(path)
        except (TypeError, ValueError):
            return path
        # one lstat for the common case (nothing written there); the realpath of ``inside``, an
        # lstat per component, only where there is a copy (Python's imports stat thousands of paths)
        if not os.path.lexists(target) or self.inside(path):
            return path
        return target

    def install(self) -> None:
        real_open = builtins.open
        sandbox = self
        real = {name: getattr(os, name) for name in ("open", "stat", "lstat", "listdir", "scandir", "rename", "replace",
                                                       "remove", "unlink", "utime", "rmdir", "makedirs", "mkdir", "access")}
        # what shutil.copy/copy2/copystat/copymode and checkpoint savers (a hard link, else a copy)
        # do to a file besides reading and writing it: on a file the script wrote, its copy
        real.update({name: getattr(os, name) for name in _ON_ITS_COPY + _NEW_NAME if hasattr(os, name)})

        def open_(file, mode="r", *a, **k):
            return real_open(sandbox.opened(file, mode), mode, *a, **k)

        def os_open(path, flags, *a, **k):
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC):
                if flags & (os.O_WRONLY | os.O_RDWR | os.O_APPEND) and not flags & os.O_TRUNC:
                    path = sandbox.update(path)
                else:
                    path = sandbox.written(path)
            else:
                path = sandbox.seen(path)
            return real["open"](path, flags, *a, **k)

        def reading(name):
            def fn(path=".", *a, **k):
                return real[name](sandbox.seen(path), *a, **k)
            return fn

        def listing(name):
            def fn(path=".", *a, **k):
                if isinstance(path, int):
                    return real[name](path, *a, **k)
                target = sandbox.seen(path)
                if target == path:
                    return real[name](path, *a, **k)
                over = list(real[name](target))
                under = list(real[name](path)) if os.path.isdir(path) else []
                if name == "listdir":
                    return sorted(set(under) | set(over))
                shadowed = {e.name for e in over}
                return _Entries(over + [e for e in under if e.name not in shadowed])
            return fn

        def moving(name):
            def fn(src, dst, *a, **k):
                return real[name](sandbox.seen(src), sandbox.redirect(dst), *a, **k)
            return fn

        def utime(path, *a, **k):
            target = sandbox.seen(path)
            if target == path and not isinstance(path, int) and not sandbox.inside(path) and os.path.lexists(path):
                return None   # a real file's times: left as they are (a write outside the temp dir)
            # (no file there: the real call's FileNotFoundError, which pathlib's touch() takes as
            # "create it", then creates it through os.open, redirected)
            return real["utime"](target, *a, **k)

        def make(name):
            def fn(path, *a, **k):
                return real[name](sandbox.redirect(path), *a, **k)
            return fn

        def new_name(name):   # link(src, dst) / symlink(src, dst): the new name is a write
            def fn(src, dst, *a, **k):
                if name == "symlink" and not os.path.isabs(os.fsdecode(src)):
                    return real[name](src, sandbox.redirect(dst), *a, **k)   # relative to the link's own folder
                return real[name](sandbox.seen(src), sandbox.redirect(dst), *a, **k)
            return fn

        # per thread: another thread inside the sandbox's own work (a TensorBoard writer's thread
        # flushing its event file) must not let this one's calls past the overlay
        busy = threading.local()

        def guarded(fn, orig):
            """The sandbox's own path work (realpath, makedirs) calls the real functions."""
            def call(*a, **k):
                if getattr(busy, "on", False):
                    return orig(*a, **k)
                busy.on = True
                try:
                    return fn(*a, **k)
                finally:
                    busy.on = False
            return call

        open_ = guarded(open_, real_open)
        os_open = guarded(os_open, real["open"])
        builtins.open = open_
        io.open = open_
        os.open = os_open
        io.FileIO = _overlaid_file_io(guarded(sandbox.opened, lambda file, mode="r": file))
        _overlaid_sqlite(sandbox, guarded)
        for name in ("stat", "lstat", "access") + _ON_ITS_COPY:
            if name in real:   # a file outside, never written: the audit hook refuses what changes it
                setattr(os, name, guarded(reading(name), real[name]))
        for name in _NEW_NAME:
            if name in real:
                setattr(os, name, guarded(new_name(name), real[name]))
        for name in ("remove", "unlink", "rmdir"):
            # outside and never written: the audit hook refuses it
            setattr(os, name, guarded(reading(name), real[name]))
        for name in ("listdir", "scandir"):
            setattr(os, name, guarded(listing(name), real[name]))
        for name in ("rename", "replace"):
            setattr(os, name, guarded(moving(name), real[name]))
        os.utime = guarded(utime, real["utime"])
        import shutil

        real_rmtree = shutil.rmtree

        def rmtree(path, *a, **k):   # a directory the run made (or wrote into): its copy in the overlay
            return real_rmtree(sandbox.seen(path), *a, **k)

        rmtree.avoids_symlink_attacks = real_rmtree.avoids_symlink_attacks
        shutil.rmtree = rmtree
        real_chdir = os.chdir

        def chdir(path):   # into a directory only the overlay has (the run made it)
            if not isinstance(path, int) and not os.path.isdir(path):
                path = sandbox.seen(path)
            return real_chdir(path)

        os.chdir = guarded(chdir, real_chdir)
        for name in ("makedirs", "mkdir"):
            setattr(os, name, guarded(make(name), real[name]))
        self._real = real
        self._native_readers()
        self._tokenizer_files()
        sys.addaudithook(self._audit)

    def _tokenizer_files(self) -> None:
        """Hugging Face's tokenizers (Rust) write and read a tokenizer's file themselves, past the
        overlay: ``Tokenizer.save`` (every save_pretrained, Trainer.save_model) into a folder the
        script made, which is in the overlay only, failed with "No such file or directory (os error
        2)", and what the script did after it went untraced. Their paths go through the overlay."""
        try:
            import tokenizers
        except ImportError:
            return
        cls, sandbox = tokenizers.Tokenizer, self
        real_save, real_from_file = cls.save, cls.from_file

        def save(tokenizer, path, pretty=True):
            return real_save(tokenizer, sandbox.redirect(path), pretty)

        def from_file(path):
            return real_from_file(sandbox.seen(path))

        cls.save, cls.from_file = save, staticmethod(from_file)

    def _native_readers(self) -> None:
        """Readers in compiled code open their files past Python's ``open``: safetensors'
        ``safe_open`` (Rust), with which transformers' from_pretrained, accelerate and
        ``load_file`` read checkpoints; torch's zip reader and writer given a path
        (``torch.PyTorchFileReader(path)``: Lightning's _lazy_load, litgpt). Their paths go through
        the overlay too (``seen``, ``redirect``), so that a checkpoint the script saved
        (dynamic/checkpoints.py) is found where it went."""
        import torch

        sandbox = self
        for name, where in (("PyTorchFileReader", self.seen), ("PyTorchFileWriter", self.redirect)):
            real = getattr(torch._C, name, None)
            if real is None:
                continue

            def opened(f, *a, _real=real, _where=where, **k):
                if isinstance(f, (str, os.PathLike)):
                    f = _where(f)
                    if _where == sandbox.seen:
                        sandbox.checkpoint_read(f)
                return _real(f, *a, **k)

            opened.__name__ = opened.__qualname__ = name
            # torch.serialization calls torch._C's (a process without vest's torch.save stand-in:
            # a spawned worker, spawned.py); others the name torch exports
            for owner in (torch, torch._C):
                if getattr(owner, name, None) is real:
                    setattr(owner, name, opened)
        try:
            import safetensors
        except ImportError:
            return
        real_safe_open, sandbox = safetensors.safe_open, self

        def safe_open(filename, *a, **k):
            path = sandbox.seen(filename)
            sandbox.checkpoint_read(path)
            return real_safe_open(path, *a, **k)

        safetensors.safe_open = safe_open
        for name in ("safetensors.torch", "safetensors.numpy"):
            mod = sys.modules.get(name)
            if mod is not None and getattr(mod, "safe_open", None) is real_safe_open:
                mod.safe_open = safe_open

    def checkpoint_read(self, path) -> None:
        """A checkpoint file read here, its values held on the host (the runner names them when the
        run meets its host-memory limit: CHECKPOINTS_READ, one "bytes path" line each, for files of
        CHECKPOINT_LISTED bytes or more)."""
        try:
            size = os.path.getsize(path)
            if size < CHECKPOINT_LISTED:
                return
            with open(os.path.join(self.tmpdir, CHECKPOINTS_READ), "a") as f:
                f.write(f"{size} {os.fsdecode(path)}\n")
        except (OSError, TypeError, ValueError):
            pass

    def _audit(self, event: str, args) -> None:
        if event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
            addr = args[1] if len(args) > 1 else None
            if isinstance(addr, str) or (isinstance(addr, bytes)):
                return   # AF_UNIX of the process itself is harmless; nothing leaves the machine
            if addr is None and getattr(args[0], "family", None) == getattr(socket, "AF_UNIX", None):
                return   # sendmsg on a connected UNIX socket (multiprocessing's forkserver passing pipes)
            if event == "socket.bind" and isinstance(addr, tuple) and addr and _local_host(addr[0]):
                return   # a local port taken (a free MASTER_PORT found by binding port 0): nothing is sent
            self.refused.append(f"network {event} {addr!r}")
            raise Refused(f"vest: the training script tried to use the network ({event} {addr!r}); "
                          "estimates run without network access")
        if event in ("os.fork", "os.forkpty") and self.forks:
            return
        if event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty"):
            launched = _launch_started(event, args)
            if launched is not None:
                raise launched
            why = children.refusal(event, args, self.confined)
            if why is None:   # a host tool a library runs (children.py): it runs, confined as the script is
                argv = children._argv(event, args)
                self.started.append(" ".join(argv)[:200])
                if any(children._stand_in(w) for w in (argv[-1].split() if argv[:1] and argv[0].endswith("sh") else argv[:1])):
                    # nvidia-smi's answer is the GPU type's (nvidia_smi.py): the run holds on this type's class only
                    fake = sys.modules.get("vest_slurm.estimate._fakecuda")
                    if fake is not None:
                        fake.asked("nvidia-smi", None, None)
                return
            self.refused.append(f"process {event}")
            raise Refused(f"vest: the training script tried to start a process ({event}: {why}); "
                          "estimates run in one process")
        if event == "sqlite3.connect" and args:
            name = _sqlite_file(args[0])
            if name is not None and not self.inside(name.split("?")[0].removeprefix("file:")):
                self.refused.append(f"write {name}")
                raise Refused(f"vest: the training script opened the database {name!r} read-write outside the "
                              "estimate's temp dir")
        if event == "open" and len(args) >= 2:
            path, mode = args[0], args[1]
            writing = _writing_mode(mode) or \
                      (isinstance(mode, int) and mode & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND))
            if writing and not isinstance(path, int) and path is not None and not self.inside(path):
                self.refused.append(f"write {path}")
                raise Refused(f"vest: the training script tried to write {os.fsdecode(path)!r} outside the estimate's temp dir")
            if not writing and isinstance(path, (str, bytes)) and os.fsdecode(path).endswith(_CHECKPOINT_SUFFIXES):
                self.checkpoint_read(path)   # torch.load's own open
        if event in ("os.remove", "os.rename", "os.rmdir", "shutil.rmtree", "os.truncate", "os.chmod", "os.chown",
                     "os.symlink", "os.link", "os.setxattr", "os.removexattr"):
            # a link's new name is what it writes (args: src, dst); its source is only read
            path = (args[1] if len(args) > 1 else None) if event in ("os.symlink", "os.link") else (args[0] if args else None)
            gone = event in ("os.remove", "os.rmdir", "shutil.rmtree", "os.rename") and path is not None and \
                not isinstance(path, int) and not os.path.lexists(path)
            # (a name relative to a directory's descriptor, shutil.rmtree's: not looked up here)
            if gone and event in ("os.remove", "os.rmdir") and (len(args) < 2 or args[1] in (None, -1)) \
                    and not self.inside(path):
                # nothing there to change: FileNotFoundError, as on the node (`unlink(missing_ok=True)`
                # goes on); under bubblewrap's read-only mount the call itself says EROFS, which
                # ultralytics' download cleanup did not expect
                import errno

                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fsdecode(path))
            if gone:
                return
            if path is not None and not isinstance(path, int) and not self.inside(path):
                self.refused.append(f"{event} {path}")
                raise Refused(f"vest: the training script tried {event} on {os.fsdecode(path)!r} outside the estimate's temp dir")


def _launch_started(event: str, args):
    """errors.Relaunch for a training launcher the script starts as a child process (a torchrun,
    accelerate launch or deepspeed command: LLaMA-Factory's and axolotl's CLIs, a project's own
    launcher script), or None: the estimate is that launch's, run as the job would run it."""
    import shlex

    from ..errors import Relaunch, WorkloadError
    from .launch import parse_train_command
    from .post_import import set_since_start

    argv = children._argv(event, args)
    if len(argv) == 3 and os.path.basename(argv[0]) in ("sh", "bash", "dash") and argv[1] == "-c":
        try:
            argv = shlex.split(argv[2])
        except ValueError:
            return None
    try:
        if not argv or parse_train_command(argv).launcher not in ("torchrun", "accelerate", "deepspeed"):
            return None
    except (WorkloadError, ValueError):
        return None
    env = {"subprocess.Popen": 3, "os.exec": 2, "os.posix_spawn": 2, "os.spawn": 3}.get(event)
    env = args[env] if env is not None and len(args) > env and args[env] is not None else os.environ
    cwd = args[2] if event == "subprocess.Popen" and len(args) > 2 and args[2] is not None else os.getcwd()
    return Relaunch(argv, os.path.abspath(os.fsdecode(cwd)), set_since_start({os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}))


# os calls on a path that go to the script's own copy where it wrote one (Sandbox.install)
_ON_ITS_COPY = ("chmod", "chown", "truncate", "readlink", "listxattr", "getxattr", "setxattr", "removexattr",
                "statvfs", "pathconf")
# the largest real file an update (append, read-write) copies into the overlay: logs, lock files,
# small caches; a data set opened read-write is refused with its size instead
COPY_ON_WRITE_MAX = 256 << 20
_NEW_NAME = ("link", "symlink")


class _Entries:
    """os.scandir's iterator over a merged listing (the overlay's entries, then the real ones): an
    iterator (os.walk calls next() on it) and a context manager, as os.scandir's is."""

    def __init__(self, entries):
        self._it = iter(entries)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def close(self):
        self._it = iter(())


# ---- the trace run -----------------------------------------------------------------------------

def _user_frame(tb, script_path: str | None):
    """The innermost frame of user code (not torch, not vest, not a library) in a traceback: file
    and line; where the job runs a package's command (a console script: no line of the user's runs),
    the package's innermost line."""
    entries = traceback.extract_tb(tb)[::-1]
    fr = frames.innermost(entries) or frames.innermost(entries, (frames.LIBRARY,))
    return (f"{fr.filename}:{fr.lineno}", (fr.line or "").strip()) if fr else (None, None)


_FAKE_MACHINERY = (os.sep + "vest_slurm" + os.sep, os.sep + "torch" + os.sep + "_subclasses" + os.sep,
                   os.sep + "torch" + os.sep + "_prims", os.sep + "torch" + os.sep + "_meta_registrations",
                   os.sep + "torch" + os.sep + "_decomp" + os.sep, os.sep + "torch" + os.sep + "_refs" + os.sep,
                   # torch's graph capture, which an eager GPU run of the script never enters (vest runs
                   # torch.compile eagerly): reached here by the fake machinery (higher-order operators'
                   # fake rules trace their subgraphs with make_fx)
                   os.sep + "torch" + os.sep + "fx" + os.sep, os.sep + "_functorch" + os.sep + "_aot_autograd" + os.sep,
                   os.sep + "torch" + os.sep + "_higher_order_ops" + os.sep, os.sep + "torch" + os.sep + "_dynamo" + os.sep)
# the CUDA graph APIs (cuda_surface: refused, their private pools are not modelled)
_GRAPH_CAPTURE = ("torch.cuda.CUDAGraph", "torch.cuda.graph", "torch.cuda.graph_pool_handle",
                  "torch.cuda.make_graphed_callables")
# what torch says when a call reached for a real GPU (torch/cuda/__init__.py _lazy_init, c10 CUDA)
_REAL_GPU_REACHED = ("Found no NVIDIA driver", "Torch not compiled with CUDA", "No CUDA GPUs are available",
                     "CUDA driver", "cudaGetDeviceCount", "no accelerator", "Cannot access accelerator",
                     # the autograd engine asked about a CUDA context: under torch.func's transforms
                     # (grad, vjp, vmap of grad) its wrappers carry the fake tensors' CUDA device to C++
                     "hasPrimaryContext",
                     # the CUDA driver loaded by the script's own code (a kernel compiled at run time:
                     # torch.cuda._compile_kernel, cupy, pynvml): there is none on a login node
                     "libcuda.so",
                     # NVML (pynvml) asked for what its stand-in (nvidia_smi.fake_nvml) does not answer
                     "NVML Shared Library Not Found", "libnvidia-ml")


def _api_called(tb) -> str | None:
    """The library function the script's innermost line called (module.function), where the
    traceback goes on past the script's code."""
    entries = traceback.extract_tb(tb)
    last_user = max((i for i, fr in enumerate(entries) if frames.origin(fr.filename) == frames.USER), default=None)
    if last_user is None or last_user + 1 >= len(entries):
        return None
    fr = entries[last_user + 1]
    if frames.origin(fr.filename) == frames.VEST:
        return None   # a C call the fake machinery took (Tensor.to): its hook is no API of the script's
    mod = frames.installed_module(fr.filename)
    return f"{mod}.{fr.name}" if mod else fr.name


# What huggingface_hub (and the libraries on it: transformers, datasets, kernels) raise when a file
# is not in the local cache and HF_HUB_OFFLINE, which the estimate sets, forbids fetching it: the
# job on a node with the network would download it (huggingface_hub/errors.py; transformers'
# cached_file and kernels' version resolution word it so).
_HUB_OFFLINE_ERRORS = ("OfflineModeIsEnabled", "LocalEntryNotFoundError")
_HUB_OFFLINE_WORDS = ("offline mode", "hf_hub_offline", "couldn't connect to 'https://huggingface.co'",
                      "not available in the local cache",
                      # evaluate.load of a metric not in the modules cache, offline
                      "doesn't exist on the hugging face hub either")


def _chain(e: BaseException | None, most: int = 10):
    """The exception and those it was raised from or during, innermost last."""
    while e is not None and most > 0:
        yield e
        e, most = e.__cause__ or e.__context__, most - 1


def needs_hub(e: BaseException) -> bool:
    """Whether the script failed for a Hugging Face Hub file (a model, tokenizer, data set or Hub
    kernel) that is not in the user's cache: the estimate runs offline, the job would fetch it."""
    for x in _chain(e):
        text = str(x).lower()
        if type(x).__name__ in _HUB_OFFLINE_ERRORS or any(w in text for w in _HUB_OFFLINE_WORDS):
            return True
    return False


def hub_repo(e: BaseException) -> str | None:
    """The Hub repository a failure for a missing Hub file names ('owner/name' quoted in one of its
    chained errors: huggingface_hub's, kernels' "'kernels-community/flash-attn2' is not available
    in the local cache"), or None."""
    import re

    for x in _chain(e):
        m = re.search(r"""['"]([A-Za-z0-9][\w.-]*/[\w.-]+)['"]""", str(x))
        if m and not m.group(1).startswith(("http", "/")) and "://" not in m.group(1):
            return m.group(1)
    # else the id the hub's and transformers' own frames were asked for (their messages omit it)
    for x in _chain(e):
        tb = x.__traceback__
        while tb is not None:
            for name in ("repo_id", "path_or_repo_id", "pretrained_model_name_or_path"):
                value = tb.tb_frame.f_locals.get(name)
                if isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", value) \
                        and not os.path.exists(value):
                    return value
            tb = tb.tb_next
    return None


_TORCH_HUB = os.sep + os.path.join("torch", "hub.py")


def _through_torch_hub(e: BaseException) -> bool:
    """Whether the network was wanted by torch.hub (torchvision's and timm's ``pretrained=True``
    weights, ``torch.hub.load``): what it fetches it keeps under $TORCH_HOME/hub, where the
    estimate finds it once it is there."""
    return any(fr.filename.endswith(_TORCH_HUB) for x in _chain(e) for fr in traceback.extract_tb(x.__traceback__))


def _hub_download(e: BaseException) -> list | None:
    """[url, destination] of ``torch.hub.download_url_to_file`` where the script called it itself
    for a file of its own (YOLOv5's font into its config folder), not into torch.hub's cache."""
    for x in _chain(e):
        tb = x.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            if code.co_name == "download_url_to_file" and code.co_filename.endswith(_TORCH_HUB):
                loc = tb.tb_frame.f_locals
                url, dst = loc.get("url"), loc.get("dst")
                if isinstance(url, str) and isinstance(dst, (str, os.PathLike)):
                    return [url, os.fsdecode(dst)]
            tb = tb.tb_next
    return None


def _needs_network(e: BaseException) -> bool:
    """Whether the script failed for want of the network (a name that does not resolve, a refused
    connection, a Hub file offline: estimates run offline), anywhere in the exception's chain."""
    import socket

    for x in _chain(e):
        if isinstance(x, (socket.gaierror, ConnectionError)) or "NameResolution" in type(x).__name__ \
                or type(x).__name__ in ("ConnectionError", "URLError", "MaxRetryError"):
            return True
    return needs_hub(e)


def _bounded_note() -> list[str]:
    """The flag of masks over values the GPU computed that were taken as all selected
    (_fakecuda.FakeCudaMode._bounded_nonzero)."""
    from ..estimate._fakecuda import BOUNDED_MASKS

    places = list(dict.fromkeys(BOUNDED_MASKS))
    if not places:
        return []
    more = f" and {len(places) - 3} more" if len(places) > 3 else ""
    return [f"a mask over values the GPU computed decided a shape ({', '.join(places[:3])}{more}): with no data here, "
            "every element was taken as selected, the most it can select, so the estimate is an upper bound there"]


def missing_import(e: BaseException) -> dict | None:
    """What a script imports that this Python does not have, from the exception's chain: a module
    whose top-level package is not installed here ({"module"}), or a name its installed version
    does not define ({"module", "symbol", "package", "version"}: an ImportError "cannot import name
    X from M", or a submodule it does not have, symbol None), else None. The job fails the same way
    in an environment like this one; in its own (a venv, a conda env, `module load`, the versions
    the script pins) it may not."""
    import importlib.util
    import re
    from importlib import metadata

    for x in _chain(e):
        if not isinstance(x, ImportError) or not x.name:
            continue
        top = x.name.split(".")[0]
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        if isinstance(x, ModuleNotFoundError) and not found:
            return {"module": x.name}
        m = re.match(r"cannot import name '([^']+)' from '([^']+)'", str(x))
        if found and (m or isinstance(x, ModuleNotFoundError)):
            # the package is there, not that part of it: another version than the script's
            dists = metadata.packages_distributions().get(top) or [top]
            try:
                version = metadata.version(dists[0])
            except metadata.PackageNotFoundError:
                version = None
            what = {"module": m.group(2), "symbol": m.group(1)} if m else {"module": x.name, "symbol": None}
            if m:
                what |= _conditional_export(m.group(2), m.group(1)) or {}
            return what | {"package": dists[0], "version": version}
    return _pinned_version(e)


def _conditional_export(module: str, symbol: str) -> dict | None:
    """Where ``module`` defines or imports ``symbol`` only under a condition, that condition, as
    {"condition": the test or the guarded import, "where": file:line, "needs": the package it
    needs, where known}: an optional dependency not installed here, not a version that lacks the
    name. Libraries export their integrations so (accelerate.utils: ``if is_deepspeed_available():
    from .deepspeed import DummyOptim``; ``try: from .x import Y`` / ``except ImportError: pass``).
    The guarded import is tried: the package it reports missing is the one needed; else a test
    ``is_X_available()`` names X."""
    import ast
    import importlib
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec(module)
        path = spec.origin if spec is not None else None
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (ImportError, ValueError, OSError, SyntaxError, TypeError):
        return None

    def names(node) -> bool:
        for n in ast.walk(node):
            if isinstance(n, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name.split(".")[-1]) == symbol
                                                                   for a in n.names):
                return True
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == symbol:
                return True
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == symbol for t in n.targets):
                return True
        return False

    def imports_of(body) -> list[str]:
        out = []
        for n in ast.walk(ast.Module(body=body, type_ignores=[])):
            if isinstance(n, ast.ImportFrom) and any((a.asname or a.name) == symbol for a in n.names):
                base = module if spec.submodule_search_locations else module.rpartition(".")[0]
                out.append(importlib.util.resolve_name("." * n.level + (n.module or ""), base) if n.level
                           else n.module)
        return out

    for node in ast.walk(tree):
        if isinstance(node, ast.If) and names(ast.Module(body=node.body, type_ignores=[])) \
                and not names(ast.Module(body=node.orelse, type_ignores=[])):
            condition, guarded = f"if {ast.unparse(node.test)}", imports_of(node.body)
        elif isinstance(node, ast.Try) and names(ast.Module(body=node.body, type_ignores=[])) and any(
                h.type is None or "ImportError" in ast.unparse(h.type) or "ModuleNotFoundError" in ast.unparse(h.type)
                for h in node.handlers) and not any(names(h) for h in node.handlers):
            condition, guarded = "an import whose ImportError is ignored", imports_of(node.body)
        else:
            continue
        out = {"condition": condition, "where": f"{path}:{node.lineno}"}
        for target in guarded:
            try:
                importlib.import_module(target)
            except ModuleNotFoundError as err:
                if err.name and importlib.util.find_spec(err.name.split(".")[0]) is None:
                    return out | {"needs": err.name.split(".")[0]}
            except Exception:   # the guarded module fails otherwise: the condition says enough
                pass
        if (found := re.search(r"is_(\w+?)_available", condition)):
            out["needs"] = found.group(1)
        return out
    return None


def _innermost(e: BaseException):
    """The innermost entry of ``e``'s traceback (the frame that raised), or None."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def _pinned_version(e: BaseException) -> dict | None:
    """A version check that failed: an AssertionError raised on a line that reads a module's
    ``__version__`` (MAE's ``assert timm.__version__ == "0.3.2"``): {"module", "package",
    "version", "pinned": the line}. The installed package is another version than the script's."""
    import linecache
    import re
    from importlib import metadata

    tb = _innermost(e)
    if not isinstance(e, AssertionError) or tb is None:
        return None
    src = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
    m = re.search(r"([A-Za-z_]\w*)(?:\.\w+)*\.__version__", src)
    if m is None:
        return None
    module = tb.tb_frame.f_globals.get(m.group(1), tb.tb_frame.f_locals.get(m.group(1)))
    name = getattr(module, "__name__", None)
    if not isinstance(name, str):
        return None
    top = name.split(".")[0]
    dists = metadata.packages_distributions().get(top) or [top]
    try:
        version = metadata.version(dists[0])
    except metadata.PackageNotFoundError:
        version = getattr(module, "__version__", None)
    return {"module": name, "symbol": None, "package": dists[0], "version": version, "pinned": src.strip()}


def compiled_extension(e: BaseException) -> tuple[str, str] | None:
    """The compiled extension a failure came from, (the API to name, what it is), else None: a CUDA extension
    built at run time (torch.utils.cpp_extension.load / load_inline: StyleGAN2's fused_act and
    upfirdn2d, most repositories' custom kernels) whose build failed, or a function of a compiled
    module outside torch (pybind11, nanobind) called on the innermost line, which failed on the
    fake tensors it was given (its C++ checks ``x.is_cuda()`` or takes ``data_ptr()``: a fake
    tensor has no device memory). On a GPU node with the toolkit the same code builds and runs:
    vest's limit, not the script's."""
    import linecache
    import re
    import types

    entries = traceback.extract_tb(e.__traceback__)
    build = os.sep + os.path.join("torch", "utils", "cpp_extension.py")
    name = next((fr.name for fr in entries if fr.filename.endswith(build)), None)
    if name is not None:
        return f"torch.utils.cpp_extension.{name}", "a CUDA extension built at run time, whose build failed here"
    tb = _innermost(e)
    if tb is None:
        return None
    frame = tb.tb_frame
    torch_dir = os.path.dirname(sys.modules["torch"].__file__) if "torch" in sys.modules else None
    # the dotted names the line calls (a statement's line, or a continuation line: no parse)
    for dotted in re.findall(r"([A-Za-z_][\w.]*)\s*\(", linecache.getline(frame.f_code.co_filename, tb.tb_lineno)):
        first, *parts = dotted.split(".")
        obj = owner = frame.f_locals.get(first, frame.f_globals.get(first, getattr(builtins, first, None)))
        for attr in parts:   # a dotted name only: nothing is called to resolve it (no property run)
            owner = obj
            obj = None if isinstance(getattr(type(obj), attr, None), property) else getattr(obj, attr, None)
        if type(obj).__name__ not in ("builtin_function_or_method", "nb_func", "nb_bound_method"):
            continue
        # the module it was reached through (cpp_extension.load's module is not in sys.modules)
        module = owner if parts and isinstance(owner, types.ModuleType) else \
            sys.modules.get(getattr(obj, "__module__", None) or "")
        path = getattr(module, "__file__", None) or ""
        if path.endswith((".so", ".pyd")) and not (torch_dir and path.startswith(torch_dir)):
            return f"{module.__name__}.{getattr(obj, '__name__', dotted)}", "a compiled extension's function"
    return None


def past_the_overlay(e: BaseException, sandbox: Sandbox) -> str | None:
    """How a write the overlay never saw failed, where the error says so: compiled code (Rust's
    tokenizers, Arrow, C++) opens its path itself, past the Python-level overlay, and meets the
    read-only file system (EROFS: Rust prints "(os error 30)") or misses a folder the script made,
    which exists in the overlay only (ENOENT, "(os error 2)" where the overlay holds writes). On
    the node the same write succeeds: vest's gap, not the script's."""
    import errno

    text = str(e)
    if (isinstance(e, OSError) and e.errno == errno.EROFS) or "Read-only file system" in text or "(os error 30)" in text:
        return "reached the read-only file system"
    if "(os error 2)" in text and sandbox.redirected:
        return "missed a folder the script made (it is in the overlay)"
    if isinstance(e, OSError) and e.errno == errno.ENOENT:
        # C++'s (Arrow: "Failed to open local file 'out/x.parquet'"): the file's folder is in the overlay only
        import re

        paths = [e.filename] if e.filename else re.findall(r"'([^']+)'|\"([^\"]+)\"", text)
        for path in paths:
            path = path if isinstance(path, str) else next((p for p in path if p), "")
            folder = os.path.dirname(os.path.abspath(path)) if path else ""
            if folder and sandbox.seen(folder) != folder:   # (a folder on disk too: not ENOENT)
                return "missed a folder the script made (it is in the overlay)"
    return _overlay_file_read(e, sandbox)


def _overlay_file_read(e: BaseException, sandbox: Sandbox) -> str | None:
    """A file the script wrote (held in the overlay only) that the failing code was reading: compiled
    code opens the real path (OpenCV's ``cv2.imread`` returns None there, YOLOv5's logger then fails
    on it), which on the node holds the file. Read from the locals of the traceback's frames."""
    # (what a reader that found no file gives: None, which the next line trips on, or an OSError)
    if not sandbox.redirected or not (isinstance(e, OSError) or "NoneType" in str(e)):
        return None
    written = set(sandbox.redirected)
    tb = e.__traceback__
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            if isinstance(value, (str, os.PathLike)):
                try:
                    path = os.path.abspath(os.fsdecode(value))
                except (TypeError, ValueError):
                    continue
                copy = sandbox.seen(path) if path in written else path
                if copy != path and os.path.isfile(copy):   # a file, in the overlay only
                    return f"read {path}, a file the script wrote, which is in the overlay only"
        tb = tb.tb_next
    return None


def classify(e: BaseException) -> str:
    """Who must act on a failure: ``vest-unsupported`` (it failed inside vest's fake CUDA or a
    stand-in, on a fake tensor, or at a CUDA API with no stand-in: the same script would run on a
    GPU), ``data-dependent`` (a shape or branch needs the data), ``refused`` (network, processes,
    writes), ``memory``, ``missing-import`` (a package the script imports is not installed in the
    Python that ran it, or not in the version the script was written for: the user's environment),
    or ``script-error`` (what the script would raise on a GPU too)."""
    name = type(e).__name__
    text = str(e)
    if isinstance(e, Refused) or _needs_network(e):
        return "refused"
    if missing_import(e) is not None:
        return "missing-import"
    if "DataDependent" in name or "DynamicOutputShape" in name or "data-dependent" in text.lower():
        return "data-dependent"
    if isinstance(e, MemoryError):
        return "memory"
    if name in ("NotSupportedHere", "UnsupportedOperatorException") or "FakeTensor" in text or "fake tensor" in text.lower() \
            or any(m in text for m in _REAL_GPU_REACHED):
        return "vest-unsupported"
    if _fails_on_a_gpu(e):
        return "script-error"   # a stand-in's check of what fails on a GPU too
    entries = traceback.extract_tb(e.__traceback__)
    if entries and any(part in entries[-1].filename for part in _FAKE_MACHINERY):
        if _real_host_op_raised(e) or fails_for_real(e):
            return "script-error"   # the op the fake tensors refused fails on real tensors too
        return "vest-unsupported"   # raised by the fake machinery or a stand-in itself
    return "script-error"


def _fails_on_a_gpu(e: BaseException) -> bool:
    """Whether a stand-in raised ``e`` by torch's own check of what fails on a GPU too."""
    from ..errors import FailsOnAGpu

    return isinstance(e, FailsOnAGpu)


def _real_host_op_raised(e: BaseException) -> bool:
    """Whether ``e`` came from an op that the fake mode ran for real on the script's host tensors
    (no fake tensor among its arguments: data loading, index arithmetic; _fakecuda's
    __torch_function__ runs those as they are): it raises the same without vest (an index out of
    range in the data), so the script must act."""
    import torch
    from torch.utils import _pytree as pytree
    from torch._subclasses.fake_tensor import FakeTensor

    tb = _innermost(e)
    if tb is None or not tb.tb_frame.f_code.co_filename.endswith("_fakecuda.py") \
            or tb.tb_frame.f_code.co_name != "__torch_function__":
        return False
    loc = tb.tb_frame.f_locals
    if "func" not in loc or not getattr(loc.get("self"), "host_real", False):
        return False
    leaves = pytree.tree_leaves((loc.get("args", ()), loc.get("kwargs") or {}))
    return any(isinstance(t, torch.Tensor) for t in leaves) and not any(isinstance(t, FakeTensor) for t in leaves)


# the most bytes of real host tensors fails_for_real makes to rerun a refused op
_RERUN_BYTES = 1 << 30


def fails_for_real(e: BaseException) -> bool:
    """Whether the op during which the fake machinery raised ``e`` raises on real tensors of the
    same sizes, strides and dtypes too (run on the host, on zeros: an index is in range): then it fails on
    a GPU as well (a view of a non-contiguous tensor, shapes that do not match), and the script must
    act. False where it runs there, or cannot be rerun (no such op in the traceback, tensors too
    large, a dtype the host's kernels lack: those say nothing of the GPU)."""
    import torch
    from torch.utils import _pytree as pytree
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    tb, call = e.__traceback__, None
    while tb is not None:   # the innermost fake dispatch: its op and arguments
        loc = tb.tb_frame.f_locals
        if tb.tb_frame.f_code.co_filename.endswith("fake_tensor.py") and isinstance(loc.get("func"), torch._ops.OpOverload):
            call = (loc["func"], loc.get("args", ()), loc.get("kwargs") or {})
        tb = tb.tb_next
    if call is None:
        return False
    func, args, kwargs = call
    leaves = pytree.tree_leaves((args, kwargs))
    fakes = [t for t in leaves if isinstance(t, FakeTensor)]
    if sum(t.untyped_storage().nbytes() for t in fakes) > _RERUN_BYTES:
        return False

    def real(t):
        if not isinstance(t, FakeTensor):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu").zero_()   # (valid indices)

    with unset_fake_temporarily(), _disable_current_modes(), torch._C.DisableTorchFunction():
        try:
            rargs, rkwargs = pytree.tree_map(real, (args, kwargs))
            func(*rargs, **rkwargs)
        except NotImplementedError:
            return False
        except (RuntimeError, ValueError, IndexError, TypeError) as err:
            if "not implemented for" in str(err):
                return False
            try:   # what torch says of it on real tensors (the fake kernel's words may differ)
                e.vest_real_error = err
            except AttributeError:
                pass
            return True
    return False


@contextlib.contextmanager
def threads_carry(modes):
    """Threads started while the script runs enter ``modes`` (the fake CUDA mode and the torch
    function modes around it) for their whole run, as the main thread has them: torch keeps modes
    per thread, and transformers (5.x) moves checkpoint tensors to the device in a
    ThreadPoolExecutor, which without them reached for the absent driver."""
    real_run = threading.Thread.run

    def run(self):
        with contextlib.ExitStack() as stack:
            for m in modes:
                stack.enter_context(m)
            return real_run(self)

    threading.Thread.run = run
    try:
        yield
    finally:
        threading.Thread.run = real_run


def run(ns) -> dict:
    from ..estimate import _fakecuda as fc
    from . import standins as sp
    from . import tracked
    from ..estimate.tracing import Tracer
    from .repeats import Repeats

    tracer = Tracer(tuple(ns.capability))
    tracer.s.oom_at = ns.oom_at
    sandbox = Sandbox(ns.tmpdir)
    from .branches import Branches, installed as branches_installed

    # the if bodies of the user's own loops (the script's folder, or the working directory of -m)
    branches = Branches([os.path.dirname(os.path.abspath(ns.script)) if ns.script else os.getcwd()])
    state = sp.ScriptState(tracer=tracer, max_steps=ns.steps, stop=StopTracing, tmpdir=ns.tmpdir,
                           world_size=ns.world_size, branches=branches)
    result: dict = {"status": STATUS_OK, "steps": 0}
    target = ns.module or ns.script
    from .. import errors

    errors.STOPS, final = [], None   # the stops vest raises in the run (swallowed_stops)
    errors.RELAUNCHED = None
    errors.SETTLE = lambda stop: _stop_record(stop, ns.script)
    sys.argv = [ns.script or ns.module] + list(ns.args)
    if ns.script:
        sys.path.insert(0, os.path.dirname(os.path.abspath(ns.script)))
    mode = fc.FakeCudaMode(tracer.recorder, scalar_stand_in=True, host_real=True)
    repeats = Repeats(state, mode)   # identical no-grad calls of the model replayed, not rerun
    # torch's modes are per thread: the script's threads run under the same ones (threads_carry)
    modes = (mode, fc.CudaFactoryMode(host_real=True), sp.UpdateWatch(state), tracked.TaintMode(state.ledger))
    # torch.device("cuda") contexts and set_default_device name the device for the functions in
    # this cached set (torch/utils/_device.py), compared by identity: filled now, with torch's own
    # functions, before cuda_surface wraps the factories (filled after, it held the wrappers, and
    # a model built under `with torch.device("cuda"):` got host weights)
    from torch.utils._device import _device_constructors

    _device_constructors()
    sandbox.install()
    from . import spawned

    spawned.install(ns.tmpdir)   # multiprocessing's spawn/forkserver children run under the sandbox too
    spawned.pools_in_threads()   # and a fork Pool's tasks in threads of this process
    from .nvidia_smi import fake_cuda_runtime

    fake_cuda_runtime()   # the CUDA runtime that host code loads through ctypes answers as the node's
    import signal

    def at_the_time_limit(_signum, _frame):
        # the runner's time limit (runner._run_dynamic): where training steps were traced, the run
        # ends with them, as after the N-th (flagged: what the script did next was cut short)
        if state.steps >= 1 and not tracer.frozen:
            state.cut_at_time_limit = True
            tracer.freeze()
            raise StopTracing()
        if state.steps == 0 and state.host_steps:   # trained on the host until then: said as such
            raise StopTracing()
        if state.steps == 0 and state.loop_read:
            # a loop of training forwards whose test read stand-ins (an adaptive ODE solver whose
            # steps are all rejected: its end time never reached) went on until the time limit
            raise DataDependentLoop(f"a loop runs the model's forward until a value of a GPU tensor ends it (tested "
                                    f"at {state.loop_read}), and the stand-ins vest reads there (no data on this "
                                    "machine) did not end it within the time limit")

    signal.signal(TIME_LIMIT_SIGNAL, at_the_time_limit)
    try:
        with fc.cuda_answers(total_memory_bytes=ns.total_memory, name=ns.gpu_name, capability=tuple(ns.capability),
                             device_count=ns.device_count, sm_count=ns.sm_count, l2_cache_bytes=ns.l2_cache), sp.patched(state), tracer, contextlib.ExitStack() as stack, \
                threads_carry(modes), repeats.installed(), branches_installed(branches):
            for m in modes:
                stack.enter_context(m)
            try:
                from . import accelerate_env   # accelerate launch's variables (nothing for other launchers)

                accelerate_env.apply(ns.script or ns.module)
                from ..estimate import oneshot

                oneshot.settle()   # torch's and vest's objects out of the collector's scans
                from . import post_import

                post_import.START_ENV.update(os.environ)   # what the script sets from here is its own
                if ns.module:
                    runpy.run_module(ns.module, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(ns.script, run_name="__main__")
            except (StopTracing, errors.Relaunch):
                pass
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if code != 0 and state.draining:   # at the epoch's end, after the traced steps
                    state.stop_draining(f"it exited with status {code}")
                elif code != 0:
                    result.update(status="script-exit", message=f"{target} exited with status {code}"
                                  + (f": {e.code}" if isinstance(e.code, str) else ""))
            except Exception as e:
                if getattr(e, "api", None) in _GRAPH_CAPTURE:
                    # a CUDA graph captured after warm-up steps (PyTorch's documented whole-step
                    # capture): the steps traced were the warm-up, the job's steps are the graph's
                    # replays from its private pool, which vest does not model: refused as a capture
                    # at the start is, not estimated from the warm-up
                    raise
                # between training steps (after one, before the next step's forward), where vest
                # cannot follow the script (a detector's validation after an epoch of one step:
                # YOLOv8 accumulates 64 images a step): the steps traced stand, as at an epoch's end
                between = (not state.draining and state.steps >= 1 and not state.forward_since_backward
                           and not state.in_backward and not state.in_optimizer_step
                           and classify(e) in ("data-dependent", "vest-unsupported"))
                if not state.draining and not between:
                    raise
                state.stopped_between = between
                # what the script does at its epoch's end failed here (vest's gap or the script's):
                # the traced steps stand, and the estimate says what was not traced
                traceback.print_exc()
                where, _ = _user_frame(e.__traceback__, ns.script)
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}" + (f" at {where}" if where else "")
                if isinstance(e, StopIteration) and state.epoch_ended:
                    # vest's own end of the loader's epoch, met by the script's next() outside a for
                    # loop: a trainer that counts iterations, not epochs (Megatron's), has no epoch's end
                    why = f"the script's own next(){f' at {where}' if where else ''}"
                    state.iterations_counted = True
                past = past_the_overlay(e, sandbox)
                if past:   # (tokenizers' save after trainer.save_model: on the node it succeeds)
                    why = (f"compiled code opened a path itself and {past}, past the overlay vest's run writes into ({why}): "
                           "vest's gap, not the script's")
                state.stop_draining(why)
            state.finish()
            # what the run asked of the GPU, each question with its answer (trace.holds_on: another
            # GPU class answering them alike makes the same run, so it is not run again there)
            result["gpu_asked"] = fc.gpu_asked()
    except BaseException as e:  # the script failed by itself, or fake tensors could not answer it
        final = e
        traceback.print_exc()   # into the kept log; the parent prints it with VEST_TRACEBACK=1
        where, line = _user_frame(e.__traceback__, ns.script)
        kind = classify(e)
        shown = getattr(e, "vest_real_error", None) or e   # torch's own words where it was rerun for real
        name = type(shown).__name__
        said = f"{name}: {str(shown).splitlines()[0] if str(shown) else ''}".strip()
        if kind == "script-error" and where and tracked.code_line(e.__traceback__) in state.ledger.code_lines:
            # raised on a line that read a GPU tensor's value (`if (boxes[:, 2:] < 0).any(): ...` then a
            # shape error): the value was a stand-in (no data here), so it failed here, not on the GPU.
            # The raising line itself, in the script or a library: not any line under the script's
            # `trainer.fit()`, which a framework's reads of logged values all map to
            kind, said = "data-dependent", (f"this line read a value of a GPU tensor, a stand-in here (vest has no "
                                            f"data), and failed on it ({said}); on a GPU it may hold")
        result.update(status=kind, message=said,
                      where=where, line=line, api=getattr(e, "api", None) or _api_called(e.__traceback__),
                      traceback="".join(traceback.format_exception(e)), hub=kind == "refused" and needs_hub(e),
                      hub_repo=hub_repo(e) if kind == "refused" else None,
                      torch_hub=kind == "refused" and _through_torch_hub(e),
                      hub_download=_hub_download(e) if kind == "refused" else None,
                      missing=missing_import(e) if kind == "missing-import" else None,
                      on_a_gpu=_fails_on_a_gpu(e))
        past = past_the_overlay(e, sandbox)
        extension = compiled_extension(e) if kind == "script-error" else None
        if extension:
            result.update(status="vest-unsupported", api=extension[0], custom_kernel=True, message=(
                f"{extension[1]}: custom CUDA code runs on a GPU's memory, and vest's fake tensors have none to "
                f"give it (on a GPU node with the CUDA toolkit it builds and runs): {result['message']}"))
        elif kind == "script-error" and past:
            result.update(status="vest-unsupported", message=f"compiled code opened a path itself, past vest's file "
                          f"overlay (a tokenizer's or an Arrow writer's save, OpenCV's imread), and {past}: {result['message']}")
    failures = spawned.spawned_failures(ns.tmpdir)
    if failures and result["status"] in ("script-error", "script-exit"):
        gpu = spawned.used_the_gpu(failures)
        if gpu:   # a child without the fake GPU reached for one: vest's limit, not the script's
            result.update(status="vest-unsupported", api="multiprocessing (spawn, forkserver)", message=(
                f"a process the script started with multiprocessing used the GPU, which vest fakes in the "
                f"script's own process only: {gpu}"))
        else:
            result["message"] = f"{result.get('message', '')} (a process it started with multiprocessing failed: {failures[0]})"
    if state.input_problem and result["status"] == STATUS_OK:
        place = state.input_problem.split(" at ", 1)[1].split(";")[0] if " at " in state.input_problem else None
        result.update(status="data-dependent", message=state.input_problem, where=place or (
            state.ledger.reads[-1][1] if state.ledger.reads else None), line=None)
    result["steps"] = state.steps
    result["host_steps"] = state.host_steps
    # the first allocation refused for want of the GPU's memory: (allocated then, asked, module)
    result["oom"] = list(tracer.s.oom) if tracer.s.oom else None
    result["step_branches"] = dict(state.step_branches)   # optimizer -> where its step branched on a stand-in
    result["compiled_transient"] = state.compiled_transient   # intermediates of torch.compile'd calls run eagerly
    result["repeats_replayed"] = repeats.replayed
    result["stopped_by"] = state.stopped_by
    result["reads"] = state.ledger.summary()
    result["steered_loop"] = state.loop_read
    result["loop_never_ended"] = isinstance(final, DataDependentLoop)
    result["sampled"] = list(mode.shadows.sampled_reads) if mode.shadows is not None else []
    result["first_input_shape"] = list(state.first_input_shape) if state.first_input_shape else None
    result["observed"] = {"precision": state.precision, "channels_last": state.channels_last,
                          "cudnn_benchmark": state.cudnn_benchmark,
                          "zero_grad": state.zero_grad, "batch_seen": state.batch_hint, "grad_accum": state.grad_accum,
                          "gradient_checkpointing": "on" if state.recomputed else "off", "optimizer": state.optimizer}
    # (said beside the runner's note on the GPU's random draws: a draw read on the host, an
    # augmentation's choice, need not be what changed the shapes; a length-sorted data set's batches
    # grow through the epoch whatever the draws)
    notes = (sp.frozen_note(state), state.waited_for, sp.drain_note(state), branches.note(state.steps),
             sp.shapes_note(state))
    result["standin_flags"] = list(dict.fromkeys(state.flags + [f for f in notes if f] + _bounded_note()))
    result["cut_at_time_limit"] = state.cut_at_time_limit
    from .cuda_surface import MEMORY_FRACTION

    result["memory_fraction"] = MEMORY_FRACTION[0]   # (fraction, where) the script capped its share at, or None
    result["step_ends"] = list(tracer.s.step_ends)
    result["step_owners"] = list(state.step_owners)
    result["forwards_per_step"] = list(state.forwards_per_step)
    result["steered_steps"] = list(state.steered_steps)
    # the models trained: on the device, or kept on the host (weights never moved to the GPU)
    result["device_models"] = state.device_model_calls
    result["forwards_under_grad"] = state.forwards_under_grad
    result["host_models"] = list(state.host_model_names)[:1]   # the outermost, called first
    result["redirected_writes"] = sandbox.redirected[:20]
    result["refused"] = sandbox.refused[:20]
    result["processes"] = sandbox.started[:20]
    swallowed = swallowed_stops(errors.stops(), final, ns.script)
    errors.STOPS = errors.SETTLE = None
    if swallowed:
        stop = swallowed[0]
        said = (f"vest stopped the run at {stop['where'] or 'a torch call'} ({stop['kind']}: {stop['message']}), "
                f"and the script's own try/except around {stop['caught']} caught that and went on")
        if result["status"] == STATUS_OK and state.steps > 0:
            result["standin_flags"].append(
                f"{said}: what was traced after it is the path the script takes when that call fails, which on a "
                "GPU, with real values, it may not take (a self-test such as an AMP check passes there)")
        elif result["status"] in (STATUS_OK, "script-error", "script-exit"):
            # the run then failed or ended without training: that stop is the cause, not the script
            then = result.get("message") or "it ended without a training step"
            result.update(status=stop["kind"], message=f"{said}; then: {then}", where=stop["where"], line=None,
                          api=stop["api"])
    if errors.RELAUNCHED is not None and state.steps == 0:
        # it started the training's launcher itself: the runner estimates that launch
        r = errors.RELAUNCHED
        result.update(status="relaunch", relaunch={"argv": r.argv, "cwd": r.cwd, "env": [list(kv) for kv in r.env]},
                      message=f"{target} launched {' '.join(r.argv)}")
    if result["status"] == STATUS_OK and state.steps == 0:
        result.update(status="no-step", message=f"{target} ended without an optimizer step, a backward pass "
                      "followed by parameter updates, or forward passes under grad")
        if state.processes_started:   # it trains in processes of its own (I-JEPA: one per GPU)
            result["processes_started"] = list(state.processes_started)
        result["func_transform"] = state.func_transform
    trace = tracer.finish(state.steps, ())
    # (a loop that never ended made events by the hundred thousand, which its refusal does not use:
    # written, they took longer than the runner's grace after the time limit)
    result["events"] = [] if result["loop_never_ended"] else \
        [[e.action[0], e.block, e.size_bytes, e.phase, e.category, e.module, e.detail] for e in trace.events]
    result["batch_hint"] = state.batch_hint
    from . import fake_dist

    result["fsdp"] = fake_dist.result(state)   # what fully_shard was asked (None: no FSDP2)
    from . import fake_tp

    tp = fake_tp.result(state)   # what parallelize_module was asked (None: no tensor parallelism)
    result["tp"] = tp
    if tp and result["fsdp"] and "units" in result["fsdp"]:   # FSDP over the data-parallel mesh beside it
        result["fsdp"]["tp"] = tp["tp"]
    result["notes"] = list(trace.notes) + hub_kernels_note(state.model_types) + ([tp["note"]] if tp else [])
    return result


def swallowed_stops(stops, final: BaseException | None, script: str | None) -> list[dict]:
    """The stops vest raised in the run (errors.stops(): a data-dependent value, an API it cannot
    answer) that code outside vest caught and went on past (a ``try: ... except Exception:`` around
    an AMP self-test, a logger's catch-all around the whole training): not the failure that ended
    the run, nor in its chain of causes. A stop still alive is read now; one the script has let go,
    from its record taken when it was caught (errors.settle_stops)."""
    ended, e = set(), final
    while e is not None and id(e) not in ended:
        ended.add(id(e))
        e = e.__cause__ or e.__context__
    out = []
    for stop, record in stops or ():
        if stop is not None:
            if id(stop) in ended:   # the run's own end
                continue
            record = _stop_record(stop, script)
        if record is not None:
            out.append(record)
    return out


def _stop_record(stop: BaseException, script: str | None) -> dict | None:
    """A stop as its traceback now says: its kind, message, the user's line that raised it, the line
    that caught it (the traceback's first frame), the API; None where it was made and never raised,
    or caught by vest's own fallback."""
    tb = stop.__traceback__
    if tb is None:
        return None
    caught = tb.tb_frame.f_code.co_filename
    if frames.origin(caught) == frames.VEST:   # vest's own fallback
        return None
    where, _ = _user_frame(tb, script)
    kind, text = classify(stop), str(stop).strip().splitlines()
    said = f"{type(stop).__name__}: {text[0][:200] if text else ''}"
    if kind == "data-dependent":
        said = f"{text[0][:120] if text else type(stop).__name__} needs values a fake tensor does not have"
    return {"kind": kind, "message": said, "where": where,
            "caught": f"{caught}:{tb.tb_lineno} (in {tb.tb_frame.f_code.co_name})",
            "api": getattr(stop, "api", None) or _api_called(tb)}


def hub_kernels_note(model_types) -> list[str]:
    """HUB_KERNELS_NOTE where the estimate turned transformers' Hub kernels off (runner._child_env,
    VEST_HUB_KERNELS=off) and the script trained a transformers model (``model_types``, the classes of
    the modules it called as its model, include a PreTrainedModel) with the kernels package installed,
    which since transformers 5 kernelizes every model from_pretrained loads unless USE_HUB_KERNELS
    says no (transformers/modeling_utils.py, integrations/hub_kernels.py): only where one was
    loaded so (post_import.LOADED_PRETRAINED), not for a model built from its constructor, nor where
    another library only imported transformers."""
    from .post_import import LOADED_PRETRAINED

    utils = sys.modules.get("transformers.modeling_utils")
    if os.environ.get("VEST_HUB_KERNELS") != "off" or utils is None:
        return []
    pretrained = getattr(utils, "PreTrainedModel", None)
    # a model from_pretrained loaded (one built from its constructor is not kernelized)
    loaded = [t for t in LOADED_PRETRAINED if pretrained is not None and issubclass(t, pretrained)]
    if not any(issubclass(t, lt) or issubclass(lt, t) for t in model_types for lt in loaded):
        return []
    try:
        import importlib.util

        from ..estimate.trace import HUB_KERNELS_NOTE

        return [HUB_KERNELS_NOTE] if importlib.util.find_spec("kernels") is not None else []
    except (ImportError, ValueError):
        return []


def _die_with_parent() -> None:
    """The runner keeps the child to its limits by polling it. If the runner is killed (a timeout
    around vest, a closed terminal), the child must not run on alone: under bubblewrap its
    --die-with-parent sees to it; under the audit hook alone, Linux's PR_SET_PDEATHSIG sends it
    SIGKILL when its parent exits. Set before the audit hook, which refuses ctypes to the script."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)   # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() == 1 and os.environ.get(children.CONFINED_ENV) != "bubblewrap":
        os._exit(1)   # the parent was gone before the signal was asked for (under bubblewrap's own
        # PID namespace the parent is its init, PID 1)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--spawned"]:   # a child the script started with multiprocessing's spawn
        from . import spawned

        spawned.child_main(argv[1:], Sandbox)
        return 0
    _die_with_parent()
    from ..estimate import oneshot

    oneshot.begin()   # this process runs one script and leaves (os._exit below)
    p = argparse.ArgumentParser(prog="vest_slurm.dynamic.bootstrap")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tmpdir", required=True)
    p.add_argument("--gpu-name", default="NVIDIA A100-SXM4-80GB")
    p.add_argument("--total-memory", type=int, default=80 * 2**30)
    p.add_argument("--capability", type=int, nargs=2, default=(8, 0))
    p.add_argument("--device-count", type=int, default=1)
    p.add_argument("--sm-count", type=int, default=108)
    p.add_argument("--l2-cache", type=int, default=40 * 2**20)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--oom-at", type=int, default=0, help="the GPU's room for tensors, in bytes: an allocation "
                   "past it raises CUDA out-of-memory (0: none)")
    p.add_argument("--module", default=None)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    rest = ns.rest[1:] if ns.rest[:1] == ["--"] else ns.rest
    if ns.module:
        ns.script, ns.args = None, rest
    else:
        ns.script, ns.args = rest[0], rest[1:]
    out_path = ns.out
    profile_to = os.environ.get("VEST_PROFILE")   # developers: cProfile of the child's run
    try:
        if profile_to:
            import cProfile

            prof = cProfile.Profile()
            result = prof.runcall(run, ns)
            prof.dump_stats(profile_to)
        else:
            result = run(ns)
    except BaseException as e:  # the bootstrap itself failed: report, never hang
        result = {"status": "internal", "message": f"{type(e).__name__}: {e}", "events": [], "steps": 0}
    with open(out_path + ".part", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".part", out_path)
    # Leave at once: the script's threads or atexit handlers must not hold the parent up.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
