"""Units of `.par` quantities (SPEC 1, "Units") and their conversion to SI.

A quantity is a number followed by a unit (``80 GiB``, ``400 Gb/s``). Each unit has a
*dimension*; a key that takes a quantity names the dimension it wants. Conversion goes
to the SI base units the config uses: bytes, bytes/s, FLOP/s, seconds, and a plain
ratio for ``%``. Units are case-sensitive: ``GB`` is 10^9 bytes, ``GiB`` 2^30,
``Gb/s`` gigabits per second (10^9 / 8 bytes/s), ``GB/s`` gigabytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Dimension = Literal["memory", "bandwidth", "compute", "time", "fraction"]


@dataclass(frozen=True)
class Unit:
    """A unit: its symbol, its dimension and how many SI base units one of it is."""

    symbol: str
    dimension: Dimension
    factor: float


_TABLE: tuple[Unit, ...] = (
    Unit("B", "memory", 1),
    Unit("KB", "memory", 10**3),
    Unit("MB", "memory", 10**6),
    Unit("GB", "memory", 10**9),
    Unit("TB", "memory", 10**12),
    Unit("KiB", "memory", 2**10),
    Unit("MiB", "memory", 2**20),
    Unit("GiB", "memory", 2**30),
    Unit("TiB", "memory", 2**40),
    Unit("MB/s", "bandwidth", 1e6),
    Unit("GB/s", "bandwidth", 1e9),
    Unit("TB/s", "bandwidth", 1e12),
    Unit("Gb/s", "bandwidth", 1e9 / 8),
    Unit("GFLOPS", "compute", 1e9),
    Unit("TFLOPS", "compute", 1e12),
    Unit("PFLOPS", "compute", 1e15),
    Unit("ns", "time", 1e-9),
    Unit("us", "time", 1e-6),
    Unit("ms", "time", 1e-3),
    Unit("s", "time", 1.0),
    Unit("%", "fraction", 0.01),
)

#: Every unit by its symbol.
UNITS: dict[str, Unit] = {u.symbol: u for u in _TABLE}

#: How a dimension is named in messages ("expected a memory size, got a bandwidth").
DIMENSION_WORDS: dict[str, str] = {
    "memory": "a memory size",
    "bandwidth": "a bandwidth",
    "compute": "a compute rate",
    "time": "a time",
    "fraction": "a fraction",
}

#: The unit a help line suggests for a bare number of each dimension (`80` -> `80 GiB`).
SUGGESTED_UNIT: dict[str, str] = {
    "memory": "GiB",
    "bandwidth": "GB/s",
    "compute": "TFLOPS",
    "time": "us",
    "fraction": "%",
}


def dimension_of(unit: str) -> Dimension | None:
    """The dimension of ``unit``, or None when no such unit exists."""
    u = UNITS.get(unit)
    return u.dimension if u else None


def units_of(dimension: str) -> tuple[str, ...]:
    """The symbols of all units of ``dimension``, in table order."""
    return tuple(u.symbol for u in _TABLE if u.dimension == dimension)


def to_si(number: float, unit: str) -> float:
    """``number`` in ``unit`` converted to the SI base unit of its dimension.

    Bytes come back as a float too; callers round where they need integers.
    Raises ``KeyError`` for an unknown unit.
    """
    return number * UNITS[unit].factor


def quantity(text: str) -> float:
    """Parse ``"80 GiB"`` (number, space, unit) to SI; for writing tables of constants.

    Raises ``ValueError`` on malformed text and ``KeyError`` on an unknown unit.
    """
    number, unit = text.split()
    return to_si(float(number), unit)
