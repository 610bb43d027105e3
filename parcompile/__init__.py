"""parcompile: a compiler for parallel execution plans of large language models.

``parcompile.compile(source, filename=None) -> Plan`` parses a `.par` spec (text or a
``pathlib.Path``), checks it, and returns the plan; ``Plan.to_json()`` is plan.json.
A spec with errors raises :class:`SpecError`, whose ``.diagnostics`` lists them all.
"""

from __future__ import annotations

__version__ = "0.1.0"

from parcompile.diagnostics import Diagnostic, SpecError, Span  # noqa: E402


def compile(source, filename: str | None = None):  # noqa: A001 - SPEC fixes the name
    """Compile a spec to a :class:`parcompile.plan.Plan`.

    Args:
        source: the spec's text, or a ``pathlib.Path`` to a `.par` file.
        filename: the name shown in diagnostics for text sources.

    Raises:
        SpecError: the spec has errors (all of them in ``.diagnostics``).
        TypeError: ``source`` is neither a str nor a ``pathlib.Path`` (bytes, None, a number).
    """
    from parcompile.driver import compile_config
    from parcompile.frontend import check_source, load_spec

    check_source(source, filename)

    cfg, warnings = load_spec(source, filename)
    plan = compile_config(cfg)
    plan.warnings = list(warnings) + list(plan.warnings)
    return plan


__all__ = ["compile", "SpecError", "Diagnostic", "Span", "__version__"]
