"""parcompile: a compiler for parallel execution plans of large language models.

``parcompile.compile(source, filename=None) -> Plan`` parses a `.par` spec (text or a
``pathlib.Path``), checks it, and returns the plan (a spec with ``auto`` layout keys
compiles the best layout :mod:`parcompile.search` finds); ``Plan.to_json()`` is plan.json.
A spec with errors raises :class:`SpecError`, whose ``.diagnostics`` lists them all.
"""

from __future__ import annotations

from parcompile.core.version import VERSION as __version__  # noqa: E402

from parcompile.diagnostics import Diagnostic, SpecError, Span  # noqa: E402


def compile(source, filename: str | None = None):  # noqa: A001 - SPEC fixes the name
    """Compile a spec to a :class:`parcompile.plan.Plan` (the steps are
    :func:`parcompile.driver.compile_source`'s).

    Args:
        source: the spec's text, or a ``pathlib.Path`` to a `.par` file.
        filename: the name shown in diagnostics for text sources.

    Raises:
        SpecError: the spec has errors (all of them in ``.diagnostics``).
        TypeError: ``source`` is neither a str nor a ``pathlib.Path`` (bytes, None, a number).
    """
    # imported here: `import parcompile` stays light (no torch, no pydantic models)
    from parcompile.driver import compile_source

    return compile_source(source, filename)


__all__ = ["compile", "SpecError", "Diagnostic", "Span", "__version__"]
