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
    """Compile a spec to a :class:`parcompile.plan.Plan`.

    Args:
        source: the spec's text, or a ``pathlib.Path`` to a `.par` file.
        filename: the name shown in diagnostics for text sources.

    Raises:
        SpecError: the spec has errors (all of them in ``.diagnostics``).
        TypeError: ``source`` is neither a str nor a ``pathlib.Path`` (bytes, None, a number).
    """
    from parcompile.driver import paused_gc
    from parcompile.frontend import check_source

    check_source(source, filename)
    with paused_gc():
        return _compile(source, filename)


def _compile(source, filename):
    from parcompile.driver import compile_config
    from parcompile.frontend import load_spec
    from parcompile.search import check_layout, needs_search, resolve, settle_split

    cfg, warnings = load_spec(source, filename)
    result = None
    if needs_search(cfg):   # `auto` layout keys: compile the best layout the search finds
        cfg, result = resolve(cfg)
        seen = {(d.message, d.span) for d in warnings}
        warnings = list(warnings) + [d for d in check_layout(cfg) if d.severity == "warning"
                                     and (d.message, d.span) not in seen]
    cfg, split_note = settle_split(cfg)   # layers that do not divide into the chunks: the uneven split
    if split_note is not None:
        warnings = list(warnings) + [split_note]
    plan = compile_config(cfg)
    plan.warnings = list(warnings) + list(plan.warnings)
    if result is not None:
        plan.search = result
        plan.data["search"] = {
            "auto": sorted(cfg.parallel.auto),
            "chosen": result.best.degrees_text(),
            "enumerated": result.enumerated,
            "valid": result.valid,
            "fitting": result.fitting,
        }
    return plan


__all__ = ["compile", "SpecError", "Diagnostic", "Span", "__version__"]
