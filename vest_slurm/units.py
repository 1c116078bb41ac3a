"""Byte units. Sizes are integer bytes everywhere; only reports format MiB/GiB."""

from __future__ import annotations

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


def mib(n_bytes: int | float) -> float:
    return n_bytes / MiB


def fmt_mib(n_bytes: int | float) -> str:
    return f"{n_bytes / MiB:,.0f} MiB"


def fmt_gib(n_bytes: int | float) -> str:
    return f"{n_bytes / GiB:,.1f} GiB"
