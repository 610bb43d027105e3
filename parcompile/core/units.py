"""Byte counts as people read them (report.md, diagnostics, the search's table)."""

from __future__ import annotations


def bytes_text(n: float) -> str:
    """Bytes in binary units, scaled to stay readable: ``1.50 MiB``, ``27.51 GiB``, ``512 B``.

    Args:
        n: a byte count (may be negative, for differences).
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
