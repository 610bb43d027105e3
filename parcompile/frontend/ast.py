"""The syntax tree of a `.par` spec: what was written, with a source span on every node.

Produced by :func:`parcompile.frontend.parser.parse`; consumed by
:mod:`parcompile.frontend.build`. Nothing here is validated beyond syntax: unknown block
kinds or keys, wrong types and units are all representable, so that the builder can
report every one of them with its span.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from parcompile.diagnostics import Span


@dataclass(frozen=True)
class Int:
    """An integer literal (``128_256``, ``-1``). ``text`` is as written."""

    value: int
    text: str
    span: Span


@dataclass(frozen=True)
class Float:
    """A floating-point literal (``3e-4``, ``0.1``). ``text`` is as written."""

    value: float
    text: str
    span: Span


@dataclass(frozen=True)
class Bool:
    """``true`` or ``false``."""

    value: bool
    text: str
    span: Span


@dataclass(frozen=True)
class Word:
    """A bare word (``rmsnorm``, ``auto``, ``1f1b``)."""

    value: str
    text: str
    span: Span


@dataclass(frozen=True)
class String:
    """A double-quoted string; ``value`` has the escapes decoded, ``text`` keeps the quotes."""

    value: str
    text: str
    span: Span


@dataclass(frozen=True)
class Quantity:
    """A number followed by a unit (``80 GiB``). The unit is not checked here."""

    number: Union[Int, Float]
    unit: str
    unit_span: Span
    text: str
    span: Span


@dataclass(frozen=True)
class List:
    """``[v, v, ...]``; items may be any value (the builder checks their kind)."""

    items: tuple["Value", ...]
    text: str
    span: Span


Value = Union[Int, Float, Bool, Word, String, Quantity, List]


@dataclass(frozen=True)
class Entry:
    """``key = value``; ``key_span`` covers the key, ``value_span`` the value."""

    key: str
    value: Value
    key_span: Span
    value_span: Span


@dataclass(frozen=True)
class Block:
    """``kind [name] [from "source"] { entries }``.

    ``span`` covers the header (kind through source); ``name_span``/``source_span`` are
    set when a name / `from` was written.
    """

    kind: str
    name: str | None
    source: str | None
    entries: tuple[Entry, ...]
    span: Span
    name_span: Span | None = None
    source_span: Span | None = None


@dataclass(frozen=True)
class Spec:
    """A parsed spec: its blocks in source order, the file name shown, and the text."""

    blocks: tuple[Block, ...]
    filename: str
    text: str
