"""Byte units, spelled once."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def fmt_bytes(n: int | float, exact: bool = False) -> str:
    """Human units; with ``exact``, the byte count too where rounding hides it."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" + (f" ({int(n)} B)" if exact else "")
    return f"{int(n)} B"
