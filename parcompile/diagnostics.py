"""Diagnostics: every user mistake is reported with a source span, never a traceback.

The rendered form is fixed by SPEC section 1 ("Diagnostics")::

    llama.par:21:10: error: tp = 3 does not divide heads = 32
        tp = 3
             ^
      help: tp may be 1, 2, 4, 8, 16 or 32

Lines and columns are 1-based; the source line is shown as it stands in the file, so
the caret sits under column ``col``. A :class:`Diagnostic` carries the span; rendering needs
the source text to show the offending line and caret.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping, Union

#: ``note`` reports a decision the compiler made for the user (an automatic split), not a problem
Severity = Literal["error", "warning", "note"]

#: the text diagnostics quote: one spec's text, or file name -> text when the spans lie in
#: several (a spec and the overrides applied to it, ``<override parallel.tp>``)
Sources = Union[str, Mapping[str, str], None]


#: The longest source line an excerpt shows whole (characters); a longer one (a 15 MB string
#: on one line) is cut to a window around the caret, marked with `...`.
MAX_EXCERPT = 160


def _excerpt(text: str, column: int, width: int) -> tuple[str, int, int]:
    """The excerpt of source line ``text`` shown for a caret at 1-based ``column`` spanning
    ``width`` characters: the line itself when at most :data:`MAX_EXCERPT` long, else a window
    of that many characters starting a little before the caret, cut ends marked ``...``;
    returns (excerpt, the caret's column in it, the caret's width in it)."""
    if len(text) <= MAX_EXCERPT:
        return text, column, width
    start = max(0, min(column - 1 - 40, len(text) - MAX_EXCERPT))
    end = start + MAX_EXCERPT
    head = "..." if start > 0 else ""
    shown = head + text[start:end] + ("..." if end < len(text) else "")
    caret = column - start + len(head)
    return shown, caret, max(1, min(width, end - (column - 1)))


@dataclass(frozen=True, order=True)
class Span:
    """A region of a spec file. ``line``/``column`` are 1-based; ``end_column`` is exclusive.

    ``file`` is the name shown to the user (as given, never made absolute).
    """

    file: str
    line: int
    column: int
    end_line: int | None = None
    end_column: int | None = None

    @classmethod
    def unknown(cls, file: str = "<spec>") -> "Span":
        """A span for facts that have no place in the source (line 1, column 1)."""
        return cls(file, 1, 1)


@dataclass(frozen=True)
class Diagnostic:
    """One error or warning about a spec.

    ``help`` says what would work; ``note`` adds context. Both are optional.
    """

    severity: Severity
    message: str
    span: Span
    help: str | None = None
    note: str | None = None
    code: str | None = None  # a stable tag for diagnostics that callers act on ("does-not-fit")

    def render(self, source: Sources) -> str:
        """Render in the SPEC format; ``source`` is the spec text, or a mapping from file
        name to text (the excerpt is taken from ``source[span.file]``), or None (no excerpt)."""
        return self._render(_Lines(source))

    def _render(self, lines: "_Lines") -> str:
        """:meth:`render` with the source already split into lines (:class:`_Lines`): many
        diagnostics of one file split it once, not once each (linear in their number)."""
        s = self.span
        out = [f"{s.file}:{s.line}:{s.column}: {self.severity}: {self.message}"]
        text = lines.line(s.file, s.line)
        if text is not None:
            # control bytes (terminal escapes in a pasted or binary file) shown as `?`, one
            # column each, so the excerpt cannot drive the terminal and the caret stays put
            width = 1
            if s.end_line == s.line and s.end_column and s.end_column > s.column:
                width = s.end_column - s.column
            text, column, width = _excerpt(text, s.column, width)
            text = "".join(ch if ch == "\t" or ch.isprintable() else "?" for ch in text)
            out.append(text)
            out.append(" " * (column - 1) + "^" * width)
        if self.help:
            out.append(f"  help: {self.help}")
        if self.note:
            out.append(f"  note: {self.note}")
        return "\n".join(out)

    def to_dict(self) -> dict:
        """The JSON-lines form used by ``parcompile check --format json``."""
        return {
            "file": self.span.file,
            "line": self.span.line,
            "column": self.span.column,
            "end_line": self.span.end_line,
            "end_column": self.span.end_column,
            "severity": self.severity,
            "message": self.message,
            "help": self.help,
            "note": self.note,
            "code": self.code,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@dataclass
class DiagnosticBag:
    """Collects diagnostics so that all errors of a spec are reported in one run."""

    items: list[Diagnostic] = field(default_factory=list)

    def error(self, message: str, span: Span, help: str | None = None, note: str | None = None) -> None:
        self.items.append(Diagnostic("error", message, span, help, note))

    def warning(self, message: str, span: Span, help: str | None = None, note: str | None = None,
                code: str | None = None) -> None:
        self.items.append(Diagnostic("warning", message, span, help, note, code))

    def extend(self, diags: Iterable[Diagnostic]) -> None:
        self.items.extend(diags)

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.items if d.severity == "error"]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.items if d.severity == "warning"]

    def sorted(self) -> list[Diagnostic]:
        """Diagnostics in source order (stable for equal spans)."""
        return sorted(self.items, key=lambda d: (d.span.file, d.span.line, d.span.column))

    def raise_if_errors(self, source: Sources = None) -> None:
        """Raise :class:`SpecError` when any error was collected."""
        if self.errors:
            raise SpecError(self.sorted(), source)


class SpecError(Exception):
    """A spec has errors. ``.diagnostics`` lists all of them (warnings included), in source order.

    ``str(err)`` renders them in the SPEC format when the source text is known
    (``source``: the spec's text, or file name -> text, see :data:`Sources`).
    """

    def __init__(self, diagnostics: list[Diagnostic], source: Sources = None):
        self.diagnostics = list(diagnostics)
        self.source = source
        # rendered when shown (``__str__``), not here: the source may be set later, and
        # rendering every diagnostic of a large spec on each raise would be wasted
        super().__init__(self.diagnostics, source)

    def render(self, limit: int | None = None) -> str:
        """The diagnostics in the SPEC format (:func:`render_all`; at most ``limit``)."""
        return render_all(self.diagnostics, self.source, limit)

    def __str__(self) -> str:   # rendered now: ``source`` may have been set after raising
        return self.render()


#: how many diagnostics the CLI prints in text form before "... and N more" (JSON lists all)
SHOWN = 50


class _Lines:
    """The lines of each file of a :data:`Sources`, split once on first use."""

    def __init__(self, source: Sources):
        self.source = source
        self.split: dict[str | None, list[str]] = {}

    def line(self, file: str, line: int) -> str | None:
        """The text of 1-based ``line`` of ``file`` (None: no source, or no such line)."""
        key = None if isinstance(self.source, str) else file
        lines = self.split.get(key)
        if lines is None:
            text = self.source if isinstance(self.source, str) or self.source is None else self.source.get(file)
            lines = self.split[key] = text.splitlines() if text is not None else []
        return lines[line - 1] if 1 <= line <= len(lines) else None


def render_all(diags: Iterable[Diagnostic], source: Sources, limit: int | None = None) -> str:
    """Render several diagnostics, one block each, separated by newlines; linear in their
    number (each file's text is split once). With ``limit``, only the first ``limit`` are
    rendered, then one line ``... and N more (K errors); ...`` counting the rest."""
    diags = list(diags)
    lines = _Lines(source)
    shown = diags if limit is None else diags[:limit]
    out = [d._render(lines) for d in shown]
    rest = diags[len(shown):]
    if rest:
        errors = sum(d.severity == "error" for d in rest)
        out.append(f"... and {len(rest):,} more ({errors:,} error{'s' if errors != 1 else ''}); "
                   f"fix the ones above and check again")
    return "\n".join(out)
