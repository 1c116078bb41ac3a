"""The server's side of directive tracing: one confined worker process (``worker.py``), restarted
when it dies, and the answers kept by directive.

``DirectiveEstimator(site_of)`` is what ``decide`` calls with an allow-listed spec's options: it
returns (required, peak) bytes per device profile, None when the trace did not finish within half the
bridge's timeout (it goes on in the worker and is kept, so the job's next submission is decided
from it), or raises ``DirectiveFailed`` with a reason for the log. A directive whose trace failed,
or killed the worker (CPU or memory limit), is kept as failed: submitting it again costs nothing.

The worker is started in its own process session, with a clean environment and an empty working
directory, and told the site's ``bridge.directive_user`` and limits; it confines itself before it
reads a request (``sandbox.py``). A worker that cannot confine itself never serves: every
directive then fails with the worker's own explanation, which the server logs once.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from typing import Callable, Mapping

from ..errors import VestError

CACHE_ENTRIES = 512
READY_TIMEOUT_S = 120.0      # confinement plus importing torch and the model libraries
_BOOT = "import sys; del sys.path[0]; from vest_slurm.bridge.worker import main; sys.exit(main())"


class DirectiveFailed(VestError):
    def __init__(self, reason: str, what: str):
        super().__init__(what)
        self.reason = reason


class _Worker:
    """One worker process and its pipes; requests are sent one at a time by the owning thread."""

    def __init__(self, user: str, memory_mib: int, cpu_s: float, log: Callable[[str], None]):
        self.log = log
        self.cwd = tempfile.mkdtemp(prefix="vest-worker-")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "VEST_CACHE_DIR": "off", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = pkg_root
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, "--user", user, "--memory-mib", str(memory_mib), "--cpu-s", str(cpu_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, cwd=self.cwd, env=env,
            start_new_session=True, close_fds=True)
        self.cpu_s = cpu_s
        first = self._read(READY_TIMEOUT_S)
        if first is None or not first.get("ready"):
            problem = (first or {}).get("problem") or "it exited or did not answer within {:.0f} s".format(READY_TIMEOUT_S)
            self.kill()
            raise DirectiveFailed("directives-unavailable", f"the directive worker could not start confined: {problem}")
        self.confinement = first.get("confinement", "")
        log(f"vest-bridge: action=worker-start pid={self.proc.pid} {self.confinement}")

    def _read(self, timeout_s: float) -> dict | None:
        out = self.proc.stdout
        ready, _, _ = select.select([out], [], [], timeout_s)
        if not ready:
            return None
        line = out.readline()
        if not line:
            return None
        try:
            return json.loads(line)
        except ValueError:
            return None

    def ask(self, request: dict, timeout_s: float) -> dict | None:
        """The answer, or None when the worker died or ran past ``timeout_s`` (then it is killed)."""
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            return None
        answer = self._read(timeout_s)
        if answer is None:
            self.kill()
        return answer

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            os.rmdir(self.cwd)
        except OSError:
            pass


class DirectiveEstimator:
    """Estimates from allow-listed #VEST directives within a time budget, in a confined worker."""

    def __init__(self, site_of, log: Callable[[str], None] = lambda line: None):
        self._site_of = site_of
        self._log = log
        self._lock = threading.Lock()
        self._results: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._queue: queue.Queue = queue.Queue()
        self._worker: _Worker | None = None
        self._unavailable: str | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="directive-worker")
        self._thread.start()
        self._queue.put(None)   # start the worker now: importing torch takes seconds

    # --- the owning thread ----------------------------------------------------------------------

    def _ensure_worker(self) -> _Worker:
        if self._worker is not None and self._worker.alive():
            return self._worker
        if self._worker is not None:
            self._worker.kill()
            self._log(f"vest-bridge: action=worker-restart exit={self._worker.proc.returncode}")
        b = self._site_of().bridge
        self._worker = None
        self._worker = _Worker(b.directive_user, b.directive_memory_mib, b.directive_cpu_s, self._log)
        return self._worker

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if self._closed:
                return
            if item is None:
                try:
                    self._ensure_worker()
                except DirectiveFailed as e:
                    self._unavailable = e.what
                    self._log(f"vest-bridge: action=worker-unavailable problem={json.dumps(e.what)}")
                except Exception as e:  # this thread must outlive any one request
                    self._log(f"vest-bridge: action=worker-error problem={json.dumps(f'{type(e).__name__}: {e}')}")
                continue
            kind, arg, fut = item
            try:
                fut.set_result(self._trace(arg) if kind == "trace" else self._probe(arg))
            except DirectiveFailed as e:
                fut.set_exception(e)
            except Exception as e:  # a bug here fails this directive, not the thread
                fut.set_exception(DirectiveFailed("directives-internal", f"{type(e).__name__}: {e}"))

    def _probe(self, write_paths) -> dict:
        if self._unavailable:
            raise DirectiveFailed("directives-unavailable", self._unavailable)
        answer = self._ensure_worker().ask({"op": "probe", "write": list(write_paths)}, timeout_s=30)
        if answer is None:
            raise DirectiveFailed("directives-limit", "the worker did not answer the probe")
        return answer

    def _trace(self, key) -> dict:
        argv, num_gpus, profiles = key
        if self._unavailable:
            raise DirectiveFailed("directives-unavailable", self._unavailable)
        worker = self._ensure_worker()
        answer = worker.ask({"op": "trace", "argv": list(argv), "num_gpus": num_gpus, "profiles": list(profiles)},
                            timeout_s=worker.cpu_s * 2 + 10)
        if answer is None:
            raise DirectiveFailed("directives-limit", "the directive's trace went past the worker's limits "
                                                      "(CPU time, memory) and was stopped")
        if not answer.get("ok"):
            raise DirectiveFailed(f"directives-{answer.get('reason', 'failed')}"[:64], str(answer.get("error", ""))[:500])
        return {p: tuple(v) for p, v in answer["estimates"].items()}

    # --- callers (the server's request threads) -------------------------------------------------

    def __call__(self, argv: tuple[str, ...], num_gpus: int, profiles: Mapping[str, str]):
        key = (tuple(argv), num_gpus, tuple(sorted(set(profiles.values()))))
        with self._lock:
            fut = self._results.get(key)
            if fut is None:
                while len(self._results) >= CACHE_ENTRIES:
                    self._results.popitem(last=False)
                fut = self._results[key] = concurrent.futures.Future()
                self._queue.put(("trace", key, fut))
            else:
                self._results.move_to_end(key)
        try:
            return fut.result(timeout=self._site_of().bridge.call_limit_s / 2)
        except concurrent.futures.TimeoutError:
            return None

    def probe(self, write_paths=(), timeout_s: float = READY_TIMEOUT_S) -> dict:
        """What the worker can do (its user, writes, sockets), in its own words."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(("probe", tuple(write_paths), fut))
        return fut.result(timeout=timeout_s)

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        deadline = time.monotonic() + 1
        while self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._worker is not None:
            self._worker.kill()

