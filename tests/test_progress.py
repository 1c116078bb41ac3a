"""Progress goes to stderr only when it is a terminal, and --quiet silences it there too."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MLP = ["--model", 'mlp:[["Linear",64,64],["ReLU"],["Linear",64,10]]', "--input", "64", "--batch-size", "8",
       "--gpu", "a100-40gb"]


def _estimate(extra: list[str], tty: bool) -> str:
    """stderr of `vest estimate` on a pseudo-terminal 120 columns wide, or on a pipe."""
    env = dict(os.environ, VEST_CACHE_DIR="off", PYTHONPATH=str(ROOT))
    env.pop("VEST_QUIET", None)
    argv = [sys.executable, "-m", "vest_slurm.cli", "estimate", *MLP, *extra]
    if not tty:
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return r.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:   # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    assert p.wait(timeout=600) == 0
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_progress_on_a_terminal_only_and_quiet_silences_it():
    shown = _estimate([], tty=True)
    assert "vest:" in shown and "[1] tracing mlp:" in shown and "allocator replay" in shown
    assert "tracing" not in _estimate([], tty=False)
    assert "tracing" not in _estimate(["--quiet"], tty=True)
