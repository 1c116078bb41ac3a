"""The test cluster with the bridge: vest_slurm.slurm.testbed's Slurm plus JobSubmitPlugins=lua, this
repository's job_submit.lua and a decision server, configured from site-config/testbed.toml.

Everything lives in the testbed's workdir: ``etc/vest-site.toml`` (testbed.toml with the bridge's
socket and log moved into the workdir), ``etc/vest-bridge.json`` (the Lua's site facts),
``run/bridge.sock`` (or a short temp dir when the workdir is too deep for a socket path),
``log/bridge.log`` (decisions), ``log/bridge-server.out``.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import toml

from ..errors import SlurmError
from ..slurm.testbed import SlurmTestbed
from .luaconf import FILE_NAME, write_lua_conf
from .server import query_status

REPO = Path(__file__).resolve().parents[2]
JOB_SUBMIT_LUA = REPO / "site-config" / "job_submit.lua"
TESTBED_TOML = REPO / "site-config" / "testbed.toml"
_SUN_PATH_MAX = 100


class BridgeTestbed:
    def __init__(self, workdir: str | os.PathLike, directives: bool = True, accounting: bool = False,
                 **bridge_overrides):
        self.workdir = Path(workdir).resolve()
        self.slurm = SlurmTestbed(self.workdir, job_submit_lua=str(JOB_SUBMIT_LUA), accounting=accounting)
        self.env = self.slurm.env
        self.directives = directives
        self.config_path = self.workdir / "etc" / "vest-site.toml"
        self.lua_conf = self.workdir / "etc" / FILE_NAME
        self.log_path = self.workdir / "log" / "bridge.log"
        sock = self.workdir / "run" / "bridge.sock"
        self._short: str | None = None
        if len(str(sock)) > _SUN_PATH_MAX:
            self._short = tempfile.mkdtemp(prefix="vest-br-")
            sock = Path(self._short) / "bridge.sock"
        self.socket_path = sock
        self.base = toml.loads(TESTBED_TOML.read_text())
        self.server: subprocess.Popen | None = None
        self._overrides = dict(bridge_overrides)
        self._supervisor: threading.Thread | None = None
        self._supervising = False
        self._server_lock = threading.Lock()
        self.restarts = 0

    # --- config -------------------------------------------------------------------------------

    def write_site(self, text: str | None = None, **bridge_overrides) -> None:
        """Write the site config (``text`` verbatim, e.g. a broken one; else testbed.toml with
        overrides of [bridge] / [policy] keys) and, when it is valid, the Lua's facts."""
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            data = copy.deepcopy(self.base)
            data["bridge"].update(socket_path=str(self.socket_path), log_path=str(self.log_path))
            for k, v in {**self._overrides, **bridge_overrides}.items():
                section = "policy" if k in ("exempt_users", "exempt_accounts", "on_user_choice_too_small") else "bridge"
                data[section][k] = v
            text = toml.dumps(data)
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.config_path)
        if text is not None:
            from ..errors import VestError
            from ..site.config import load_site_config
            try:
                write_lua_conf(load_site_config(str(self.config_path)), self.lua_conf,
                               pythonpath=str(REPO))
            except VestError:
                pass

    def configure(self, text: str | None = None, **bridge_overrides) -> None:
        """Change the site config and wait until the server (when running) serves it."""
        before = self.status()["generation"] if self.server_alive() else None
        self.write_site(text, **bridge_overrides)
        if before is None:
            return
        self.server.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            st = self.status()
            if st["generation"] > before or (st["problem"] and st["mtime_ns"] == os.stat(self.config_path).st_mtime_ns):
                return
            time.sleep(0.05)
        raise SlurmError("bridge server did not reload its config within 10 s", f"read {self.log_path}")

    def wait_budget_refilled(self) -> None:
        """Wait until job_submit.lua's bucket of fallback time is full again (it refills at
        bridge.fallback_ms_per_s up to fallback_burst_ms; its state lives in the controller's Lua)."""
        from ..site.config import load_site_config
        b = load_site_config(str(self.config_path)).bridge
        time.sleep(b.fallback_burst_ms / b.fallback_ms_per_s + 0.05)

    # --- server -------------------------------------------------------------------------------

    def _spawn_server(self) -> subprocess.Popen:
        argv = [sys.executable, "-m", "vest_slurm.bridge", "serve", "--site-config", str(self.config_path),
                "--lua-conf", str(self.lua_conf), "--socket", str(self.socket_path)]
        if not self.directives:
            argv.append("--no-directives")
        env = dict(os.environ, PYTHONPATH=str(REPO) + (os.pathsep + os.environ["PYTHONPATH"]
                                                        if os.environ.get("PYTHONPATH") else ""))
        out = open(self.workdir / "log" / "bridge-server.out", "ab")
        try:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=env, cwd=self.workdir)
        finally:
            out.close()

    def supervise(self) -> None:
        """Restart the server at once whenever it exits, as the shipped unit does (Restart=always,
        RestartSec=0), until stop_server(); ``restarts`` counts them."""
        if self._supervisor is not None:
            return
        self._supervising = True

        def loop() -> None:
            while self._supervising:
                proc = self.server
                if proc is None:
                    return
                proc.wait()
                with self._server_lock:
                    if not self._supervising:
                        return
                    self.server = self._spawn_server()
                    self.restarts += 1

        self._supervisor = threading.Thread(target=loop, daemon=True, name="bridge-supervisor")
        self._supervisor.start()

    def start_server(self) -> None:
        self.server = self._spawn_server()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise SlurmError(f"bridge server exited with code {self.server.returncode}",
                                 f"read {self.workdir / 'log' / 'bridge-server.out'}")
            try:
                self.status()
                return
            except OSError:
                time.sleep(0.05)
        raise SlurmError("bridge server not answering after 30 s", f"read {self.log_path}")

    def server_alive(self) -> bool:
        return self.server is not None and self.server.poll() is None

    def status(self) -> dict:
        return query_status(str(self.socket_path))

    def stop_server(self, kill: bool = False) -> None:
        """Stop the server (SIGKILL leaves its socket file behind, as a crash would) and its
        supervisor, if any."""
        with self._server_lock:
            self._supervising = False
        if self._supervisor is not None:
            if self.server is not None and self.server.poll() is None:
                self.server.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            self._supervisor.join(10)
            self._supervisor = None
        if self.server is None:
            return
        if self.server.poll() is None:
            self.server.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.server.wait(5)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        self.server = None

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> "BridgeTestbed":
        for d in ("etc", "log", "run"):
            (self.workdir / d).mkdir(parents=True, exist_ok=True)
        self.write_site()
        self.start_server()
        try:
            self.slurm.start()
        except BaseException:
            self.stop_server()
            raise
        return self

    def stop(self) -> None:
        self.stop_server()
        self.slurm.stop()
        if self._short:
            import shutil
            shutil.rmtree(self._short, ignore_errors=True)

    @property
    def procs(self):
        procs = dict(self.slurm.procs)
        if self.server is not None:
            procs["bridge-server"] = self.server
        return procs

    @property
    def conf_path(self) -> Path:
        return self.slurm.conf_path

    @property
    def start_seconds(self):
        return self.slurm.start_seconds

    @property
    def stop_seconds(self):
        return self.slurm.stop_seconds

    def __enter__(self) -> "BridgeTestbed":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
