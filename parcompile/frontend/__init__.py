"""The front end: `.par` text -> AST -> :class:`~parcompile.config.schema.SpecConfig`.

:func:`load_spec` is the entry point the driver and the command line use.
"""

from __future__ import annotations

import os
from pathlib import Path

from parcompile.config.schema import SpecConfig
from parcompile.diagnostics import Diagnostic, DiagnosticBag, Span, SpecError
from parcompile.frontend.parser import parse, strip_bom

__all__ = ["check_source", "load_spec", "parse"]


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


def load_spec(source: str | Path, filename: str | None = None) -> tuple[SpecConfig, list[Diagnostic]]:
    """Parse, resolve and check a spec; return its config and its warnings.

    ``source`` is the spec's text, or a :class:`pathlib.Path` to read. Diagnostics name
    the file ``filename``, else the path as given (``examples/tiny.par``), else
    ``<spec>``. ``SpecConfig.name`` is the file's stem (``"spec"`` for text without a
    file name) and ``source_dir`` its directory as given, against which `from "x.json"`
    and `data` paths are resolved.

    Raises :class:`SpecError` with every diagnostic (warnings included, in source order)
    when the spec has an error, or when the file cannot be read.
    """
    check_source(source, filename)
    # imported here: parcompile.config.build imports this package's AST
    from parcompile.config.build import build_config

    if isinstance(source, Path):
        shown = filename or str(source)
        try:
            text = source.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise SpecError([Diagnostic("error", f"cannot read `{source}`: {reason}", Span.unknown(shown))]) from None
        path: Path | None = source
    else:
        text, shown = source, filename or "<spec>"
        path = Path(filename) if filename else None
    text = strip_bom(text)
    name = path.stem if path is not None else "spec"
    source_dir = str(path.parent) if path is not None else None
    spec = parse(text, shown)
    bag = DiagnosticBag()
    config = build_config(spec, bag, name=name, source_dir=source_dir)
    bag.raise_if_errors(text)
    return config, bag.sorted()
