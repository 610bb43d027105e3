"""Overrides: ``{"parallel.tp": 4, "model.seq_len": 4096}`` applied to a parsed spec as if
written in it.

Each override becomes one ``key = value`` entry of the spec's AST: it replaces the entry
of that key in the block of that kind, or is added to the block (a block the spec lacks
is added too). Everything after the AST (types, units, ranges, presets, every check) then
treats it as written, so an override gets exactly the diagnostics a hand edit gets. Its
spans lie in a file of its own, ``<override parallel.tp>``, whose one line is the entry
as a block would hold it::

    <override parallel.tp>:1:17: error: tp = 3 does not divide heads = 32
    parallel { tp = 3 }
                    ^
      help: tp may be 1, 2, 4, 8, 16 or 32

Python values are written as `.par` values: ``True`` -> ``true``, ``4`` -> ``4``, ``3e-4``
-> ``0.0003``, a list -> ``[...]``. A ``str`` is `.par` value text (``"1f1b"``, ``"80
GiB"``, ``"auto"``, ``"[8, 8, 7, 7]"``), except for the keys that take a string (``train.data``,
``parallel.order``...), where it is the string itself (quoted here unless it already is a
quoted `.par` string), as is a :class:`pathlib.Path`. ``None`` removes the key: the spec as if it had not written it.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import PurePath
from typing import Any, Mapping

from parcompile.config.text import did_you_mean, or_list
from parcompile.diagnostics import Diagnostic, Span, SpecError
from parcompile.frontend import ast
from parcompile.frontend.parser import parse

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

#: what a Python value of an override may be
VALUE_TYPES = "a bool, int, float, str, pathlib.Path, a list of those, or None (remove the key)"


def override_file(key: str) -> str:
    """The file name an override's spans carry: ``<override parallel.tp>``."""
    return f"<override {key}>"


def _string(text: str) -> str:
    """``text`` as a `.par` string literal (the parser decodes these escapes back)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace(
        "\r", "\\r").replace("\t", "\\t") + '"'


class _BadValue(Exception):
    """A Python value with no `.par` spelling (the message says why)."""


def value_text(value: Any, takes_string: bool = False) -> str:
    """The `.par` text of an override's Python value (module docstring).

    Raises :class:`_BadValue` (internal) for a value with no `.par` spelling."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _BadValue(f"{value!r} is not a finite number")
        return repr(value)
    if isinstance(value, PurePath):
        return _string(str(value))
    if isinstance(value, str):
        if takes_string:   # already a `.par` string literal ('"data.txt"'): as written
            return value if len(value) >= 2 and value[0] == value[-1] == '"' else _string(value)
        if "\n" in value or "\r" in value:
            raise _BadValue("a value is one line")
        return value.strip()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v, takes_string) for v in value) + "]"
    raise _BadValue(f"a {type(value).__name__} cannot be written in a spec")


def _entry(kind: str, key: str, text: str, file: str) -> tuple[ast.Entry | None, str, list[Diagnostic]]:
    """Parse ``kind { key = text }`` as the override's one line; the entry, the line, and
    what is wrong (a syntax error, or text that is more than one value)."""
    line = f"{kind} {{ {key} = {text} }}"
    try:
        spec = parse(line, file)
    except SpecError as e:
        return None, line, list(e.diagnostics)
    entries = [e for b in spec.blocks for e in b.entries]
    if len(spec.blocks) != 1 or len(entries) != 1:
        col = len(f"{kind} {{ {key} = ") + 1
        return None, line, [Diagnostic(
            "error", f"the override `{kind}.{key}` must be one value, got `{text}`", Span(file, 1, col, 1, col + len(text)),
            help="give one value per key; write each key as its own override")]
    return entries[0], line, []


def apply_overrides(spec: ast.Spec, overrides: Mapping[str, Any]) -> tuple[ast.Spec, dict[str, str]]:
    """``spec`` with ``overrides`` (``"block.key"`` -> Python value) applied as if written
    in it (module docstring), and the text of each override's line by its file name (for
    rendering diagnostics: :data:`parcompile.diagnostics.Sources`).

    Raises:
        SpecError: an override that cannot be written in a spec: a key that is not
            ``block.key`` or names no block, a value with no `.par` spelling or that is
            not one value (all of them at once, each at its override's file).
        TypeError: ``overrides`` is not a mapping with str keys.
    """
    from parcompile.frontend.build import KEYS   # imported here: build imports the checks table

    if not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must be a mapping of \"block.key\" to a value, got {type(overrides).__name__}")
    blocks = list(spec.blocks)
    sources: dict[str, str] = {}
    errors: list[Diagnostic] = []
    for name, value in overrides.items():
        if not isinstance(name, str):
            raise TypeError(f"override keys are str (\"parallel.tp\"), got {type(name).__name__} {name!r}")
        file = override_file(name)
        kind, dot, key = name.partition(".")
        if not dot or not _NAME.fullmatch(kind) or not _NAME.fullmatch(key):
            sources[file] = name
            homes = [k for k, keys in KEYS.items() if name in keys]
            errors.append(Diagnostic(
                "error", f"override `{name}` is not `block.key`", Span(file, 1, 1, 1, len(name) + 1),
                help=(f"did you mean `{homes[0]}.{name}`? " if homes else "")
                + f"name the block and the key, e.g. `parallel.tp`; blocks are {or_list(KEYS, quote=True)}"))
            continue
        if kind not in KEYS:
            sources[file] = name
            errors.append(Diagnostic(
                "error", f"override `{name}`: unknown block `{kind}`", Span(file, 1, 1, 1, len(kind) + 1),
                help=f"{did_you_mean(kind, KEYS, case_note='block kinds are lowercase')}blocks are "
                     f"{or_list(KEYS, quote=True)}"))
            continue
        i = next((j for j, b in enumerate(blocks) if b.kind == kind), None)
        if value is None:   # remove the key: as if the spec had not written it
            if i is not None:
                blocks[i] = replace(blocks[i], entries=tuple(e for e in blocks[i].entries if e.key != key))
            continue
        kt = KEYS[kind].get(key)
        try:
            text = value_text(value, takes_string=kt is not None and kt.kind == "str")
        except _BadValue as e:
            sources[file] = name
            errors.append(Diagnostic("error", f"override `{name}`: {e}", Span(file, 1, 1, 1, len(name) + 1),
                                     help=f"an override value is {VALUE_TYPES}"))
            continue
        entry, line, problems = _entry(kind, key, text, file)
        sources[file] = line
        if entry is None:
            errors += problems
            continue
        other = {"train": "serve", "serve": "train"}.get(kind)
        if i is None and other is not None and any(b.kind == other for b in blocks):
            errors.append(Diagnostic(
                "error", f"override `{name}` adds a `{kind}` block, but the spec has a `{other}` block",
                entry.key_span, help=f"a spec has `train` or `serve`, not both; override keys of `{other}`"))
            continue
        if i is None:   # the spec lacks the block: add it, at the override
            blocks.append(ast.Block(kind, None, None, (entry,), Span(file, 1, 1, 1, len(kind) + 1)))
            continue
        old = blocks[i].entries
        at = next((j for j, e in enumerate(old) if e.key == key), None)
        entries = old + (entry,) if at is None else old[:at] + (entry,) + old[at + 1:]
        blocks[i] = replace(blocks[i], entries=entries)
    if errors:
        raise SpecError(errors, sources)
    return replace(spec, blocks=tuple(blocks)), sources
