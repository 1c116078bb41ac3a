"""The decision server as a process, without Slurm: readiness (nothing listens before a site config
has loaded; READY=1 to systemd after), the watchdog pings, and answers after a restart."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import toml

from vest_slurm.bridge.server import query_status, watchdog_period_s

REPO = Path(__file__).resolve().parents[1]


def _wait(cond, limit_s: float = 60.0, what: str = "") -> None:
    """Wait for a state (a hang bound, not a speed check)."""
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {limit_s} s: {what}"
        time.sleep(0.05)


def _stop_server(p, listener, short):
    """Stop the server, close systemd's stand-in socket, remove the short socket folder."""
    p.terminate()
    p.wait(30)
    listener.close()
    for name in os.listdir(short):
        os.unlink(os.path.join(short, name))
    os.rmdir(short)


def test_server_listens_only_once_its_config_loads_then_tells_systemd(tmp_path):
    short = tempfile.mkdtemp(prefix="vest-srv-")          # AF_UNIX paths are short
    sock, notify = os.path.join(short, "bridge.sock"), os.path.join(short, "notify")
    cfg, lua = tmp_path / "site.toml", tmp_path / "vest-bridge.json"
    cfg.write_text("this is [not toml\n")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # stands where systemd's socket is
    listener.bind(notify)
    listener.settimeout(60)
    env = dict(os.environ, NOTIFY_SOCKET=notify, PYTHONPATH=str(REPO))
    log = tmp_path / "bridge.log"
    p = subprocess.Popen([sys.executable, "-m", "vest_slurm.bridge", "serve", "--site-config", str(cfg),
                          "--socket", sock, "--lua-conf", str(lua), "--log", str(log), "--no-directives"],
                         env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait(lambda: log.exists() and "result=failed" in log.read_text(), what="the failed load logged")
        assert p.poll() is None and not os.path.exists(sock) and not lua.exists()   # up, not serving
        data = toml.loads((REPO / "site-config" / "testbed.toml").read_text())
        data["bridge"].update(socket_path=sock, log_path=str(log))
        cfg.write_text(toml.dumps(data))
        assert listener.recv(4096) == b"READY=1"
        assert os.path.exists(sock) and lua.exists()
        st = query_status(sock)
        assert st["generation"] == 1 and st["problem"] == "" and st["pid"] == p.pid
    finally:
        _stop_server(p, listener, short)


def test_the_shipped_unit_restarts_at_once_and_waits_for_readiness(tmp_path):
    """site-config/vest-bridge.service: Type=notify (READY=1 above), Restart=always, RestartSec=0,
    a start limit; and systemd itself reads it without complaint (systemd-analyze verify, with the
    program path pointed at one that exists here)."""
    import shutil
    unit = (REPO / "site-config" / "vest-bridge.service").read_text()
    settings = dict(ln.split("=", 1) for ln in unit.splitlines() if "=" in ln and not ln.startswith("#"))
    assert settings["Type"] == "notify" and settings["NotifyAccess"] == "main"
    assert settings["Restart"] == "always" and settings["RestartSec"] == "0"
    assert int(settings["StartLimitBurst"]) >= 5 and "--lua-conf" in settings["ExecStart"]
    assert 0 < float(settings["WatchdogSec"]) < 10       # the server pings at half of it
    analyze = shutil.which("systemd-analyze")
    if analyze:                      # Debian's systemd package; the settings above are checked anyway
        copy = tmp_path / "vest-bridge.service"
        copy.write_text(unit.replace("/usr/local/bin/vest ", "/bin/true "))
        r = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stderr.strip() == "", r.stderr


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_watchdog_pings_only_while_the_server_answers(tmp_path):
    """Under WatchdogSec (systemd's $WATCHDOG_USEC) the server sends WATCHDOG=1 after READY=1, each
    after answering through its own socket; a stopped (hung) server sends none, so systemd restarts
    it; pings resume when it runs again."""
    short = tempfile.mkdtemp(prefix="vest-wd-")
    sock, notify = os.path.join(short, "bridge.sock"), os.path.join(short, "notify")
    data = toml.loads((REPO / "site-config" / "testbed.toml").read_text())
    log = tmp_path / "bridge.log"
    data["bridge"].update(socket_path=sock, log_path=str(log))
    cfg = tmp_path / "site.toml"
    cfg.write_text(toml.dumps(data))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify)
    listener.settimeout(60)
    env = dict(os.environ, NOTIFY_SOCKET=notify, WATCHDOG_USEC="400000", PYTHONPATH=str(REPO))
    env.pop("WATCHDOG_PID", None)
    p = subprocess.Popen([sys.executable, "-m", "vest_slurm.bridge", "serve", "--site-config", str(cfg),
                          "--socket", sock, "--no-directives"],
                         env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert listener.recv(4096) == b"READY=1"
        assert [listener.recv(4096) for _ in range(3)] == [b"WATCHDOG=1"] * 3
        os.kill(p.pid, signal.SIGSTOP)
        _wait(lambda: _state(p.pid) == "T", what="the server stopped")
        listener.setblocking(False)
        while True:                               # what was sent before the stop
            try:
                listener.recv(4096)
            except BlockingIOError:
                break
        listener.settimeout(2.0)                  # five periods of pings the stopped server owes
        with pytest.raises(socket.timeout):
            listener.recv(4096)
        os.kill(p.pid, signal.SIGCONT)
        listener.settimeout(60)
        assert listener.recv(4096) == b"WATCHDOG=1"
    finally:
        os.kill(p.pid, signal.SIGCONT)
        _stop_server(p, listener, short)


def test_watchdog_period_follows_systemds_variables(monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert watchdog_period_s() is None
    monkeypatch.setenv("WATCHDOG_USEC", "5000000")
    assert watchdog_period_s() == 5.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))     # meant for another process
    assert watchdog_period_s() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_period_s() == 5.0
