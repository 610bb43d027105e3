"""parcompile: a compiler for parallel execution plans of large language models.

The Python API (docs/python.md; :mod:`parcompile.api` holds it, the command line is a
thin layer over it):

- ``parcompile.compile(source, filename=None, *, overrides=None) -> Plan``: parse a `.par`
  spec (text or a ``pathlib.Path``), check it and plan it; ``overrides={"parallel.tp": 4}``
  applies values as if written in the spec. ``plan.to_json()`` is plan.json,
  ``plan.write(directory)`` writes what ``parcompile compile -o`` writes, and plan.json's
  sections are typed attributes (``plan.memory.peak``, ``plan.estimate.step_time``).
- ``parcompile.search(source, top=10, ...) -> SearchReport``: ranked layouts of the
  spec's ``auto`` keys, with their estimates.
- ``parcompile.verify(source, ...) -> VerifyReport``: a miniature run against a
  single-process reference (``.rows``, ``.passed``).
- ``parcompile.export(plan, target) -> Export``: Megatron-LM, Megatron-Bridge, torchtitan, DeepSpeed, vLLM or SGLang
  configuration.
- ``parcompile.diff(old, new, fail_on=()) -> PlanDiff``: what changed between two plans;
  ``parcompile.load_plan(path) -> PlanJSON`` reads a plan.json file, typed.
- :mod:`parcompile.testing`: hold a spec's plan against a golden plan.json in tests.

A spec with errors raises :class:`SpecError`, whose ``.diagnostics`` lists them all.

``search``, ``verify`` and ``export`` are plain functions; the modules that implement them
are :mod:`parcompile.layout_search`, :mod:`parcompile.verification` and
:mod:`parcompile.exporters`. ``import parcompile`` stays light (no torch, no pydantic):
everything loads on first use.
"""

from __future__ import annotations

from parcompile.core.version import VERSION as __version__

from parcompile.diagnostics import Diagnostic, SpecError, Span


def compile(source, filename: str | None = None, *, overrides=None):  # noqa: A001 - SPEC fixes the name
    """Compile a spec to a :class:`parcompile.plan.Plan` (:func:`parcompile.api.compile`:
    the arguments, what it returns and raises).

    Args:
        source: the spec's text, or a ``pathlib.Path`` to a `.par` file.
        filename: the name shown in diagnostics for text sources.
        overrides: ``{"block.key": value}`` applied as if written in the spec.

    Raises:
        SpecError: the spec has errors (all of them in ``.diagnostics``).
        TypeError: ``source`` is neither a str nor a ``pathlib.Path`` (bytes, None, a number).
    """
    # imported here: `import parcompile` stays light (no torch, no pydantic models)
    from parcompile.api import compile as compile_spec

    return compile_spec(source, filename, overrides=overrides)


def diff(old, new, *, fail_on=()):
    """What changed from plan ``old`` to ``new`` (:func:`parcompile.api.diff`): each a Plan,
    a plan.json dict, or a path to a plan.json, a ``compile -o`` directory or a `.par` spec."""
    from parcompile.api import diff as diff_plans

    return diff_plans(old, new, fail_on=fail_on)


def load_plan(path):
    """A plan.json file as its typed model, :class:`parcompile.plan_schema.PlanJSON`
    (:func:`parcompile.api.load_plan`)."""
    from parcompile.api import load_plan as load

    return load(path)


def search(source, top: int = 10, *, filename: str | None = None, overrides=None, cross_node_tp: bool = False,
           progress=None):
    """Rank the layouts (or, for a ``serve`` spec, the deployments) a spec's ``auto`` keys
    allow (:func:`parcompile.api.search`: the arguments, what it returns and raises; the
    implementation is :mod:`parcompile.layout_search`)."""
    from parcompile.api import search as search_spec

    return search_spec(source, top, filename=filename, overrides=overrides, cross_node_tp=cross_node_tp,
                       progress=progress)


def verify(source, *, filename: str | None = None, overrides=None, steps: int = 3, dtype: str = "fp32",
           timeout_s: float = 900.0):
    """Run a miniature of the spec's plan under torchrun and compare it with a single-process
    reference (:func:`parcompile.api.verify`; the implementation is
    :mod:`parcompile.verification`)."""
    from parcompile.api import verify as verify_spec

    return verify_spec(source, filename=filename, overrides=overrides, steps=steps, dtype=dtype, timeout_s=timeout_s)


def export(plan, target: str, torchtitan_version: str = "0.3"):
    """The plan as another engine's configuration (:func:`parcompile.api.export`; the
    exporters are :mod:`parcompile.exporters`)."""
    from parcompile.api import export as export_plan

    return export_plan(plan, target, torchtitan_version)


#: names loaded on first use: name -> the module that defines it
_LAZY = {
    "Plan": "parcompile.plan", "PlanJSON": "parcompile.plan_schema", "SearchReport": "parcompile.api",
    "VerifyReport": "parcompile.api", "PlanFileError": "parcompile.api", "PlanDiff": "parcompile.plandiff",
    "Change": "parcompile.plandiff", "BoundError": "parcompile.plandiff", "Export": "parcompile.exporters",
}


def __getattr__(name: str):
    """The classes of :data:`_LAZY`, loaded on first use (PEP 562)."""
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["compile", "search", "verify", "export", "diff", "load_plan", "SpecError", "Diagnostic", "Span",
           "Plan", "PlanJSON", "SearchReport", "VerifyReport", "PlanDiff", "__version__"]
