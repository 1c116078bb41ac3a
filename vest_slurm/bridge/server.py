"""The resident decision server: a threaded UNIX-socket server, one request line per connection.

- Bounded: a request over ``MAX_REQUEST_BYTES`` or not complete within the per-request budget (the
  site's ``bridge.timeout_s``) is answered "error" (job_submit.lua then applies the fail mode; it
  has given up by then anyway).
- Concurrent-safe: every connection has its own thread; the loaded config is one immutable object
  swapped by a single assignment; the log file is written under a lock.
- Reload: SIGHUP, or the config file's mtime changing (checked every second). A config that fails
  to load is logged and the last good one stays. SIGHUP also reopens the log file (logrotate).
- Readiness: the socket is bound only once a site config has loaded (until then the server retries
  every second and nothing listens, so job_submit.lua's connect fails at once and it falls back);
  then, under systemd (Type=notify), READY=1 goes to $NOTIFY_SOCKET. A server restarted by its
  unit (Restart=always, RestartSec=0) rewrites vest-bridge.json on load, which tells the Lua's
  circuit breaker to try it at once.
- Watchdog: under a unit with ``WatchdogSec=`` (systemd sets ``$WATCHDOG_USEC``), a thread asks the
  server its status through its own socket every half period and sends WATCHDOG=1 only when that
  answer came: a server whose accept loop or request threads hang (a deadlock, SIGSTOP, a wedged
  file system) stops pinging and systemd kills and restarts it (``Restart=always``).
- ``#VEST`` directives (``bridge.allow_vest_directives``): read by the allow-list in the request
  thread; those allowed are traced in one confined worker process (directives.py, sandbox.py: its
  own unprivileged user, no network, no writes but a private tmpfs, CPU and memory limits), never in
  the server's threads, with half the timeout as budget; a trace past its budget finishes in the
  background and is kept, so the job's next submission is decided from it.

Known limitations:
- The directive worker is one process: a burst of distinct directive jobs waits in its queue (each
  still answered "over budget" in time).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import socketserver
import threading
import time
from pathlib import Path

from ..errors import VestError
from ..site.config import SiteConfig, load_site_config
from .decide import decide_bytes, error_decision
from .directives import DirectiveEstimator
from .luaconf import write_lua_conf
from .protocol import MAX_REQUEST_BYTES

WATCH_INTERVAL_S = 1.0


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        srv: BridgeServer = self.server.bridge  # type: ignore[attr-defined]
        srv.handle(self.request)


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 128


class BridgeServer:
    def __init__(self, config_path: str, socket_path: str | None = None, lua_conf: str | None = None,
                 directives: bool = True, log_path: str | None = None):
        self.config_path = os.path.abspath(config_path)
        self.lua_conf = lua_conf
        self.site: SiteConfig | None = None
        self.problem = ""
        self.generation = 0
        self.mtime_ns: int | None = None
        self._reload = threading.Event()
        self._stop = threading.Event()
        self._log_lock = threading.Lock()
        self._log_file = None
        self._log_path_override = log_path
        self._socket_override = socket_path
        self._want_directives = directives
        self._directives: DirectiveEstimator | None = None
        self._server: _UnixServer | None = None
        self._reopen_log()                 # --log: failures before the first good load are logged too
        self.load()

    @property
    def socket_path(self) -> str | None:
        return self._socket_override or (self.site.bridge.socket_path if self.site else None)

    def wait_for_config(self) -> None:
        """Retry loading every WATCH_INTERVAL_S until a site config loads (or SIGTERM): nothing is
        served before, so no answer ever comes from a server that has no rules."""
        while self.site is None and not self._stop.is_set():
            hup = self._reload.wait(WATCH_INTERVAL_S)
            self._reload.clear()
            try:
                mtime = os.stat(self.config_path).st_mtime_ns
            except OSError:
                mtime = None
            if not self._stop.is_set() and (hup or mtime != self.mtime_ns):
                self.load()
        if self.site is not None and self._directives is None and self._want_directives \
                and self.site.bridge.allow_vest_directives:
            self._directives = DirectiveEstimator(lambda: self.site, self.log)

    # --- config -------------------------------------------------------------------------------

    def load(self) -> bool:
        try:
            mtime = os.stat(self.config_path).st_mtime_ns
        except OSError:
            mtime = None
        self.mtime_ns = mtime
        try:
            site = load_site_config(self.config_path)
        except VestError as e:
            self.problem = str(e).replace("\n", " ")
            self.log(f"vest-bridge: action=reload result=failed keeping_generation={self.generation} "
                     f"problem={json.dumps(self.problem[:500])}")
            return False
        self.site, self.problem = site, ""
        self.generation += 1
        if self.lua_conf:
            try:
                write_lua_conf(site, self.lua_conf)
            except OSError as e:
                self.log(f"vest-bridge: action=reload lua_conf_error={json.dumps(str(e))}")
        self._reopen_log()
        self.log(f"vest-bridge: action=reload result=ok generation={self.generation} fail={site.bridge.fail} "
                 f"unknown_jobs={site.bridge.unknown_jobs} timeout_s={site.bridge.timeout_s}")
        return True

    def _reopen_log(self) -> None:
        path = self._log_path_override or (self.site.bridge.log_path if self.site else None)
        with self._log_lock:
            if self._log_file:
                self._log_file.close()
                self._log_file = None
            if path:
                try:
                    Path(path).parent.mkdir(parents=True, exist_ok=True)
                    self._log_file = open(path, "a", buffering=1, encoding="utf-8", errors="backslashreplace")
                except OSError:
                    self._log_file = None

    def log(self, line: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        with self._log_lock:
            if self._log_file:
                self._log_file.write(f"{stamp} {line}\n")

    def _watch(self) -> None:
        while not self._stop.is_set():
            hup = self._reload.wait(WATCH_INTERVAL_S)
            self._reload.clear()
            try:
                mtime = os.stat(self.config_path).st_mtime_ns
            except OSError:
                mtime = None
            if hup or mtime != self.mtime_ns:
                self.load()

    # --- requests -----------------------------------------------------------------------------

    def handle(self, conn: socket.socket) -> None:
        site = self.site
        budget = site.bridge.call_limit_s if site else 2.0
        deadline = time.monotonic() + budget
        chunks, size = [], 0
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                conn.settimeout(left)
                data = conn.recv(1 << 20)
                if not data:
                    break
                chunks.append(data)
                size += len(data)
                if data.endswith(b"\n") or size > MAX_REQUEST_BYTES:
                    break
            raw = b"".join(chunks).rstrip(b"\n")
            if size > MAX_REQUEST_BYTES:
                d = error_decision("request-too-large", f"{size} bytes or more")
            elif raw.startswith(b'{"op":"status"'):
                conn.sendall(self.status_line())
                return
            else:
                d = decide_bytes(raw, site, self.problem, directives=self._directives)
            conn.settimeout(max(0.05, deadline - time.monotonic()))
            conn.sendall(d.wire())
            self.log(d.log + " via=server")
        except (OSError, TimeoutError):
            self.log("vest-bridge: action=error reason=request-timeout via=server")

    def status_line(self) -> bytes:
        obj = {"generation": self.generation, "config": self.config_path, "mtime_ns": self.mtime_ns,
               "problem": self.problem, "pid": os.getpid(),
               "fail": self.site.bridge.fail if self.site else None,
               "unknown_jobs": self.site.bridge.unknown_jobs if self.site else None}
        return (json.dumps(obj) + "\n").encode()

    # --- lifecycle ----------------------------------------------------------------------------

    def bind(self) -> None:
        self.wait_for_config()
        path = self.socket_path
        if self.site is None or path is None:      # stopped before any config loaded
            raise VestError(f"no site config loaded ({self.problem})", "fix the site config")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(0.5)
            try:
                probe.connect(path)
                raise VestError(f"another bridge server is listening on {path}", "stop it first")
            except (ConnectionRefusedError, FileNotFoundError, socket.timeout):
                os.unlink(path)
            finally:
                probe.close()
        old = os.umask(0o177)           # the socket: the server's user only (slurmctld runs as it)
        try:
            self._server = _UnixServer(path, _Handler)
        finally:
            os.umask(old)
        self._server.bridge = self  # type: ignore[attr-defined]

    def serve_forever(self) -> None:
        signal.signal(signal.SIGHUP, lambda *_: self._reload.set())
        signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=self.shutdown, daemon=True).start())
        if self._server is None:
            self.wait_for_config()
            if self.site is None:                    # SIGTERM before any config loaded
                self.log("vest-bridge: action=stop before_config=yes")
                return
            self.bind()
        watcher = threading.Thread(target=self._watch, daemon=True, name="config-watch")
        watcher.start()
        self.log(f"vest-bridge: action=start socket={self.socket_path} pid={os.getpid()}")
        sd_notify(b"READY=1")
        period = watchdog_period_s()
        if period is not None:
            threading.Thread(target=self._watchdog, args=(period,), daemon=True, name="watchdog").start()
        try:
            self._server.serve_forever(poll_interval=0.2)
        finally:
            self._stop.set()
            self._server.server_close()
            try:
                os.unlink(self.socket_path)
            except OSError:
                pass
            if self._directives:
                self._directives.close()
            self.log("vest-bridge: action=stop")

    def _watchdog(self, period_s: float) -> None:
        """WATCHDOG=1 every half period (sd_watchdog_enabled(3) advises pinging at half of it), each
        after a status answer through our own socket within a quarter period, so that what is
        vouched for is the serving path slurmctld uses, not merely this thread."""
        interval = period_s / 2
        while not self._stop.wait(interval):
            try:
                query_status(self.socket_path, timeout_s=max(interval / 2, 0.05))
            except (OSError, ValueError):
                self.log("vest-bridge: action=watchdog result=no-answer (no ping: systemd restarts a hung server)")
                continue
            sd_notify(b"WATCHDOG=1")

    def shutdown(self) -> None:
        self._stop.set()
        self._reload.set()
        if self._server:
            self._server.shutdown()


def sd_notify(message: bytes) -> bool:
    """Tell systemd (Type=notify units) our state: one datagram to $NOTIFY_SOCKET (sd_notify(3));
    False where there is none (not under systemd)."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]          # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(message)
        return True
    except OSError:
        return False


def watchdog_period_s() -> float | None:
    """The unit's WatchdogSec as systemd passes it ($WATCHDOG_USEC, for $WATCHDOG_PID when set:
    sd_watchdog_enabled(3)), None when there is no watchdog for this process."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1e6


def query_status(socket_path: str, timeout_s: float = 2.0) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(socket_path)
        s.sendall(b'{"op":"status"}\n')
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data)
