"""Byte counts and times as people read them (report.md, diagnostics, the search's table)."""

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


def seconds_text(s: float) -> str:
    """A time in the unit that keeps it readable: ``850 us``, ``7.33 ms``, ``1.25 s``,
    ``3.2 min``, ``5.1 h``, ``8.4 days`` (four significant digits below a second, three
    from one to two minutes, one decimal in minutes, hours and days; from a million days on,
    three significant digits: ``1.16e+295 days``, not a count of 290 digits).

    Args:
        s: seconds (not negative; ``inf`` is ``-``).
    """
    if s != s or s == float("inf"):
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.3g} us"
    if s < 1:
        return f"{s * 1e3:.4g} ms"
    for unit, scale in (("days", 86400), ("h", 3600), ("min", 60)):
        if s >= 2 * scale:
            return f"{s / scale:,.1f} {unit}" if s < 1e6 * scale else f"{s / scale:.3g} {unit}"
    return f"{s:.3g} s"
