"""Processes of this machine, for tests that check an estimate leaves nothing running."""

from __future__ import annotations

import os


def procs_with(marker: str) -> list[str]:
    """PIDs whose command line contains ``marker``."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        out.append(pid)
            except OSError:
                pass
    return out
