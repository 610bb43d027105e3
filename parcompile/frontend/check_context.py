"""What the spec's checks share (:mod:`parcompile.frontend.checks` and its submodules):
:class:`CheckContext`, where each value was written and which are known wrong, the
:data:`AUTO` marker of a key written as ``auto``, and the help lines' number lists
(:func:`may_be`, :func:`nearest_multiples`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from parcompile.config.text import choices_words
from parcompile.diagnostics import DiagnosticBag, Span


class _Auto:
    """The value of a key written as ``auto`` (before resolution)."""

    def __repr__(self) -> str:
        return "auto"


AUTO: Any = _Auto()


@dataclass
class CheckContext:
    """Where values are written and which are known wrong, for the builder and the checks.

    ``spans`` maps ``"block.key"`` to the value's span and ``"block"`` to its header;
    ``bad`` holds the ``"block.key"`` whose value was reported wrong or is missing;
    ``provided`` those set by the spec, a preset or an import (not a default).
    """

    bag: DiagnosticBag
    filename: str = "<spec>"
    spans: dict[str, Span] = field(default_factory=dict)
    bad: set[str] = field(default_factory=set)
    provided: set[str] = field(default_factory=set)

    def ok(self, *keys: str) -> bool:
        """True when none of ``keys`` was reported wrong (so a check may read them)."""
        return not any(k in self.bad for k in keys)

    def span(self, *keys: str) -> Span:
        """The span of the first of ``keys`` written in the spec, else the first key's block."""
        for k in keys:
            if k in self.spans:
                return self.spans[k]
        block = keys[0].split(".")[0]
        return self.spans.get(block, Span.unknown(self.filename))

    def given(self, key: str) -> bool:
        return key in self.spans


def may_be(values: list[int]) -> str:
    """Valid choices for a help line (``"1, 2, 4 or 8"``); ``"a divisor"`` when too many to compute."""
    return choices_words(values) if values else "a divisor"


def nearest_multiples(x: int, unit: int, at_least: int = 1) -> list[int]:
    """The multiples of ``unit`` just below and above ``x`` (positive ones; ``at_least`` of them)."""
    below = x // unit * unit
    out = [v for v in (below, below + unit) if v > 0]
    while len(out) < at_least:
        out.append(out[-1] + unit)
    return out
