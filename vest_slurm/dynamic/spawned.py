"""Processes a training script starts with multiprocessing's spawn or forkserver method, run under
the estimate's sandbox.

Such a child is a fresh interpreter that multiprocessing starts through ``_posixsubprocess``
directly, which raises no audit event: the sandbox's process policy (children.py) never sees it,
and without this module it ran outside the file overlay (bootstrap.Sandbox), so a preprocessing
worker's write into the job's directories (litdata's ``optimize``, a spawn Pool tokenising files)
hit the read-only file system and the script failed here though it runs on the node. ``install``
points multiprocessing at a launcher that runs the child under a Sandbox of the same temp dir: the
overlay is a folder (``tmpdir/redirected/<path>``), so parent and children see the same files.

The child has no fake GPU: host work (the workers' usual job) runs as it would. A child that
fails records its error in ``tmpdir/spawned/<pid>.err``; an error of CUDA there (the driver
missing) is vest's limit, said as such (``spawned_failures``, bootstrap.classify's caller), since
the estimate traces the script's own process only.

    python -m vest_slurm.dynamic.bootstrap --spawned TMPDIR [interpreter options] -c CODE [args]
"""

from __future__ import annotations

import os
import sys

_CUDA_WORDS = ("CUDA", "NVIDIA", "cuda", "nvidia")


def install(tmpdir: str) -> str:
    """Make multiprocessing start spawn and forkserver children through this module (in the
    script's process, after the sandbox is installed); returns the launcher's path."""
    import multiprocessing

    folder = os.path.join(tmpdir, "bin")
    os.makedirs(folder, exist_ok=True)
    launcher = os.path.join(folder, "vest-spawned-python")
    with open(launcher, "w") as f:
        f.write(f"#!/bin/sh\nexec {_quote(sys.executable)} -m vest_slurm.dynamic.bootstrap --spawned {_quote(tmpdir)} \"$@\"\n")
    os.chmod(launcher, 0o755)
    multiprocessing.set_executable(launcher)
    return launcher


def pools_in_threads() -> None:
    """A ``multiprocessing`` Pool of the fork start method (Linux's default before Python 3.14) runs
    its tasks in threads of the script's process instead (``multiprocessing.pool.ThreadPool``, the
    same API): host work such as a data set scanning its files with ``Pool().imap`` (Pytorch-UNet)
    runs, where a fork, whose GPU work the estimate would not see, is refused. The threads carry
    the run's fake CUDA and sandbox as the script's own threads do; so does concurrent.futures'
    ProcessPoolExecutor (a ThreadPoolExecutor). Pools of spawn and forkserver stay processes (install)."""
    import multiprocessing
    import multiprocessing.pool as mp_pool
    from concurrent import futures
    from concurrent.futures import process as futures_process
    from multiprocessing import context
    from multiprocessing.pool import ThreadPool

    real_pool = context.BaseContext.Pool

    def pool(self, processes=None, initializer=None, initargs=(), maxtasksperchild=None):
        if self.get_start_method() != "fork":
            return real_pool(self, processes, initializer, initargs, maxtasksperchild)
        return ThreadPool(processes, initializer, initargs)

    context.BaseContext.Pool = pool
    multiprocessing.Pool = pool.__get__(context._default_context)

    # the class itself (`from multiprocessing.pool import Pool`: YOLOv5's and ultralytics' label
    # caches), and concurrent.futures' process pool, made with the default (fork) context: the
    # same, through __new__ (a subclass, so `class MyPool(Pool)` and isinstance keep working;
    # defined at the module's level, so that a Manager started by spawn, whose registry holds the
    # class, can pickle it: lingua's)
    mp_pool.Pool = _ForkPoolInThreads
    futures.ProcessPoolExecutor = futures_process.ProcessPoolExecutor = _ForkExecutorInThreads


def _pool_classes():
    import multiprocessing
    import multiprocessing.pool as mp_pool
    from concurrent import futures
    from concurrent.futures import process as futures_process

    def in_threads(processes=None, initializer=None, initargs=(), maxtasksperchild=None, context=None):
        if (context or multiprocessing.get_context()).get_start_method() == "fork":
            return mp_pool.ThreadPool(processes, initializer, initargs)
        return None

    class _ForkPoolInThreads(mp_pool.Pool):
        def __new__(cls, *args, **kwargs):
            if cls is _ForkPoolInThreads:
                pool = in_threads(*args, **kwargs)
                return super().__new__(cls) if pool is None else pool
            if (kwargs.get("context") or multiprocessing.get_context()).get_start_method() == "fork":
                # a subclass (a library's pool with methods of its own; the "NoDaemonPool" recipe
                # with a Process of its own): itself, with ThreadPool's workers and queues in front
                # (Python runs its own __init__ on what __new__ returns)
                return super().__new__(_threaded(cls))
            return super().__new__(cls)

    class _ForkExecutorInThreads(futures_process.ProcessPoolExecutor):
        def __new__(cls, max_workers=None, mp_context=None, initializer=None, initargs=(), **kwargs):
            if cls is _ForkExecutorInThreads and \
                    (mp_context or multiprocessing.get_context()).get_start_method() == "fork":
                return futures.ThreadPoolExecutor(max_workers, initializer=initializer, initargs=initargs)
            return super().__new__(cls)

        # a subclass (fastcore's ProcessPoolExecutor, under fastai's tokenization and parallel()):
        # itself, with its own methods, its tasks submitted to threads (Executor.map and the
        # subclass's map go through submit)
        def __init__(self, max_workers=None, mp_context=None, initializer=None, initargs=(), **kwargs):
            if (mp_context or multiprocessing.get_context()).get_start_method() != "fork":
                return super().__init__(max_workers, mp_context, initializer, initargs, **kwargs)
            self._vest_threads = futures.ThreadPoolExecutor(max_workers, initializer=initializer, initargs=initargs)
            self._max_workers = self._vest_threads._max_workers

        def submit(self, fn, /, *args, **kwargs):
            threads = self.__dict__.get("_vest_threads")
            return threads.submit(fn, *args, **kwargs) if threads else super().submit(fn, *args, **kwargs)

        def shutdown(self, wait=True, *, cancel_futures=False):
            threads = self.__dict__.get("_vest_threads")
            if threads is None:
                return super().shutdown(wait, cancel_futures=cancel_futures)
            return threads.shutdown(wait, cancel_futures=cancel_futures)

    threaded = {}

    def _threaded(cls):
        """``cls`` with ThreadPool's overrides (its Process, queues, sentinels) taking precedence."""
        if cls not in threaded:
            own = {k: v for k, v in vars(mp_pool.ThreadPool).items() if k not in ("__init__", "__module__", "__doc__")}
            threaded[cls] = type(cls.__name__, (cls,), {**own, "__module__": cls.__module__,
                                                         "__qualname__": cls.__qualname__})
        return threaded[cls]

    for c in (_ForkPoolInThreads, _ForkExecutorInThreads):
        c.__qualname__ = c.__name__   # (pickled by reference: module and name)
    return _ForkPoolInThreads, _ForkExecutorInThreads


_ForkPoolInThreads, _ForkExecutorInThreads = _pool_classes()


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def spawned_failures(tmpdir: str) -> list[str]:
    """The errors the spawned children recorded (their first lines)."""
    folder = os.path.join(tmpdir, "spawned")
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        try:
            with open(os.path.join(folder, name)) as f:
                out.append(f.read().strip()[:300])
        except OSError:
            continue
    return out


def used_the_gpu(failures: list[str]) -> str | None:
    """The first failure of a child that reached for the GPU it does not have, if any."""
    return next((f for f in failures if any(w in f for w in _CUDA_WORDS)), None)


def _record_failures(tmpdir: str) -> None:
    """A child's target that raises: its error into ``tmpdir/spawned/<pid>.err`` (multiprocessing
    prints the traceback and exits 1; the parent sees only the exit code)."""
    from multiprocessing import process

    real_run = process.BaseProcess.run

    def run(self):
        try:
            return real_run(self)
        except BaseException as e:
            folder = os.path.join(tmpdir, "spawned")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{os.getpid()}.err"), "w") as f:
                f.write(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                        f"(in {getattr(self, '_target', None) and getattr(self._target, '__qualname__', '?')})")
            raise

    process.BaseProcess.run = run


def child_main(argv: list[str], sandbox) -> None:
    """The spawned child (bootstrap.py --spawned): ``sandbox``, bootstrap's Sandbox class, over the
    parent's temp dir, then multiprocessing's own code line as __main__."""
    tmpdir, rest = argv[0], argv[1:]
    if "-c" not in rest:
        raise SystemExit(f"vest: a spawned child without -c CODE: {rest!r}")
    i = rest.index("-c")
    code, args = rest[i + 1], rest[i + 2:]
    sandbox(tmpdir, forks=True).install()
    _record_failures(tmpdir)
    from .branches import noops

    noops()   # code of the parent's, compiled with markers, may be sent here by value
    sys.argv = ["-c", *args]
    import __main__

    exec(compile(code, "<string>", "exec"), __main__.__dict__)
