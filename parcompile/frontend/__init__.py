"""The front end: `.par` text -> AST -> :class:`~parcompile.config.schema.SpecConfig`.

Its two steps, which :func:`parcompile.driver.compile_source` runs first:

1. :func:`parse_spec`: read the source and parse it into the AST (:class:`ParsedSpec`);
2. :func:`check_spec`: build the resolved config from the AST and run every rule of
   the checks table (:data:`parcompile.frontend.checks.CHECKS`), raising all the errors
   at once.

:func:`load_spec` is the two together, for the commands that stop at the config
(``parcompile check``, ``search``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from parcompile.core.files import MAX_SPEC_BYTES, read_text
from parcompile.config.schema import SpecConfig
from parcompile.diagnostics import Diagnostic, DiagnosticBag, Sources, Span, SpecError
from parcompile.frontend import ast
from parcompile.frontend.parser import parse, source_text

__all__ = ["ParsedSpec", "check_source", "check_spec", "load_spec", "parse", "parse_spec"]


def check_source(source: object, filename: object = None) -> None:
    """Raise a clear :class:`TypeError` unless ``source`` is spec text (str) or a
    :class:`pathlib.Path` and ``filename`` a str or None (the API boundary's contract)."""
    if isinstance(source, (bytes, bytearray)):
        raise TypeError(f"source must be the spec text (str) or a pathlib.Path, got {type(source).__name__}; "
                        "decode it first: source.decode(\"utf-8\")")
    if isinstance(source, os.PathLike) and not isinstance(source, Path):
        raise TypeError(f"source must be the spec text (str) or a pathlib.Path, got "
                        f"{type(source).__name__}; wrap it: pathlib.Path(source)")
    if not isinstance(source, (str, Path)):
        raise TypeError(f"source must be the spec text (str) or a pathlib.Path, got {type(source).__name__}")
    if filename is not None and not isinstance(filename, str):
        raise TypeError(f"filename must be a str or None, got {type(filename).__name__}")


@dataclass(frozen=True)
class ParsedSpec:
    """A spec read and parsed: its text (BOM stripped), the AST, the file name diagnostics
    show, and the config's ``name`` (the file's stem, ``"spec"`` for text without a file
    name) and ``source_dir`` (the directory `from "x.json"` and `data` paths are resolved
    against; None for text without a file name)."""

    text: str
    spec: ast.Spec
    shown: str
    name: str
    source_dir: str | None
    #: the line of each override applied (:mod:`parcompile.frontend.overrides`), by its file name
    override_lines: Mapping[str, str] = field(default_factory=dict)

    @property
    def sources(self) -> Sources:
        """What diagnostics of this spec quote: its text, or with overrides, file name -> text."""
        return {self.shown: self.text, **self.override_lines} if self.override_lines else self.text


def parse_spec(source: str | Path, filename: str | None = None,
               overrides: Mapping[str, Any] | None = None) -> ParsedSpec:
    """Read ``source`` (the spec's text, or a :class:`pathlib.Path` to read) and parse it;
    apply ``overrides`` (``{"parallel.tp": 4}``) as if written in it
    (:func:`parcompile.frontend.overrides.apply_overrides`).

    Diagnostics name the file ``filename``, else the path as given
    (``examples/tiny.par``), else ``<spec>``; an override's name its own,
    ``<override parallel.tp>``.

    Raises :class:`SpecError` for a syntax error, a file that cannot be read or an
    override that cannot be written in a spec, and :class:`TypeError` for a source that
    is neither text nor a path (:func:`check_source`) or overrides that are not a mapping.
    """
    check_source(source, filename)
    if isinstance(source, Path):
        shown = filename or str(source)
        try:
            text = read_text(source, MAX_SPEC_BYTES)   # a regular file only, size-limited
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise SpecError([Diagnostic("error", f"cannot read `{source}`: {reason}", Span.unknown(shown))]) from None
        path: Path | None = source
    else:
        text, shown = source, filename or "<spec>"
        path = Path(filename) if filename else None
    text = source_text(text)
    name = path.stem if path is not None else "spec"
    source_dir = str(path.parent) if path is not None else None
    spec = parse(text, shown)
    if not overrides:
        if overrides is not None and not isinstance(overrides, Mapping):
            raise TypeError(f"overrides must be a mapping of \"block.key\" to a value, got {type(overrides).__name__}")
        return ParsedSpec(text, spec, shown, name, source_dir)
    from parcompile.frontend.overrides import apply_overrides

    try:
        spec, lines = apply_overrides(spec, overrides)
    except SpecError as e:
        e.source = {shown: text, **e.source}
        raise
    return ParsedSpec(text, spec, shown, name, source_dir, lines)


def check_spec(parsed: ParsedSpec) -> tuple[SpecConfig, list[Diagnostic]]:
    """Build the resolved config of a parsed spec and check it (every rule of
    :data:`parcompile.frontend.checks.CHECKS`); return the config and its warnings.

    Raises :class:`SpecError` with every diagnostic (warnings included, in source order)
    when the spec has an error.
    """
    # imported here: parcompile.frontend.build imports this package's AST
    from parcompile.frontend.build import build_config

    bag = DiagnosticBag()
    config = build_config(parsed.spec, bag, name=parsed.name, source_dir=parsed.source_dir)
    bag.raise_if_errors(parsed.sources)
    return config, bag.sorted()


def load_spec(source: str | Path, filename: str | None = None,
              overrides: Mapping[str, Any] | None = None) -> tuple[SpecConfig, list[Diagnostic]]:
    """Parse, resolve and check a spec (:func:`parse_spec`, then :func:`check_spec`);
    return its config and its warnings. ``overrides`` are applied as :func:`parse_spec`
    applies them.

    ``source`` is the spec's text, or a :class:`pathlib.Path` to read. Diagnostics name
    the file ``filename``, else the path as given (``examples/tiny.par``), else
    ``<spec>``. ``SpecConfig.name`` is the file's stem (``"spec"`` for text without a
    file name) and ``source_dir`` its directory as given, against which `from "x.json"`
    and `data` paths are resolved.

    Raises :class:`SpecError` with every diagnostic (warnings included, in source order)
    when the spec has an error, or when the file cannot be read.
    """
    return check_spec(parse_spec(source, filename, overrides))
