"""The front end: `.par` text -> AST -> :class:`~parcompile.config.schema.SpecConfig`.

:func:`load_spec` is the entry point the driver and the command line use.
"""

from __future__ import annotations

from pathlib import Path

from parcompile.config.schema import SpecConfig
from parcompile.diagnostics import Diagnostic, DiagnosticBag, Span, SpecError
from parcompile.frontend.parser import parse

__all__ = ["load_spec", "parse"]


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
    name = path.stem if path is not None else "spec"
    source_dir = str(path.parent) if path is not None else None
    spec = parse(text, shown)
    bag = DiagnosticBag()
    config = build_config(spec, bag, name=name, source_dir=source_dir)
    bag.raise_if_errors(text)
    return config, bag.sorted()
