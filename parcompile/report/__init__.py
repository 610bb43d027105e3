"""The plan as one self-contained HTML page (``parcompile plan SPEC --html FILE``,
``parcompile search SPEC --html FILE``, ``report.html`` of ``compile -o``; issue 50).

What it shows, each from the plan (``plan.json`` for every number; the plan's graph for how
one layer's tensors are split; the plan's search for its candidates), nothing recomputed:
memory per pipeline stage as stacked bars against the capacity, the step time by cause
(communication per axis with its link), the simulated pipeline timeline
(:func:`parcompile.analysis.trace.timeline_svg`, inlined), the split of one decoder layer's
tensors and the collectives it runs, for a serve plan its memory per GPU, TTFT / TPOT and
their causes, and after a search its candidates (step time against memory, or a sizing
search's Pareto front) with the chosen one marked.

No network at view time and no script: styles and SVG are inline, tables plain HTML. Each
number sits in a cell ``<td data-key="PLAN.JSON PATH" data-value="JSON VALUE">`` (the
test reads them back against plan.json). Plots need matplotlib (the ``report`` extra);
without it the tables stand alone. Deterministic: the same plan gives the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2

from parcompile.report import figures, layer, search, tables

TEMPLATES = Path(__file__).parent / "templates"
_env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                          autoescape=True, keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
_env.filters["json"] = lambda v: json.dumps(v, sort_keys=True)


def _search_context(result, data: dict) -> dict | None:
    """The search section's figure and rows, None without a search."""
    if result is None:
        return None
    serve = search.is_serve_search(result)
    pts = search.points(result)
    counts = {k: getattr(result, k) for k in ("enumerated", "valid", "fitting")}
    return {"serve": serve, "points": pts, "counts": counts,
            "svg": figures.search_svg(pts, serve, None if serve else data["memory"]["capacity"]),
            "chosen": next((p.label for p in pts if p.chosen), "")}


def _layer_context(plan) -> dict | None:
    """One decoder layer's tensors and collectives (:mod:`parcompile.report.layer`)."""
    lid = layer.first_layer(plan)
    if lid is None or plan.graph is None:
        return None
    return {"id": lid, "tensors": layer.tensor_rows(plan, lid), "collectives": layer.layer_collectives(plan.data, lid),
            "groups": layer.first_groups(plan.data)}


def render_html(plan, search_result=None, timeline: str | None = None) -> str:
    """The report of ``plan`` (a :class:`parcompile.plan.Plan`) as HTML text (module
    docstring); ``search_result`` the search whose candidates it plots (default: the one
    that chose the plan's layout, ``plan.search``; None: no search section); ``timeline``
    the plan's timeline.svg text when the caller has it (default: drawn here,
    :func:`parcompile.analysis.trace.timeline_svg`)."""
    from parcompile.analysis.trace import timeline_svg

    data = plan.data
    result = search_result if search_result is not None else plan.search
    serve = data.get("serve")
    breakdown = tables.breakdown_rows(data)
    ctx = {
        "name": data["name"], "workload": data["workload"], "version": data["version"],
        "summary": tables.summary_cells(data), "warnings": [d.message for d in plan.warnings],
        "memory_terms": tables.memory_terms(data), "memory_rows": tables.memory_rows(data),
        "memory_limits": tables.memory_limits(data), "memory_svg": figures.memory_svg(data),
        "breakdown": breakdown, "step_time": data["estimate"]["step_time"],
        "breakdown_svg": None if serve else figures.breakdown_svg("breakdown",
                                                                  [(c.text, c.value) for c in breakdown]),
        "network": tables.network_rows(data), "per_step": tables.per_step_rows(data),
        "timeline_svg": timeline if timeline is not None else timeline_svg(plan), "layer": _layer_context(plan),
        "serve": None, "search": _search_context(result, data), "plots": figures.available(),
    }
    if serve:
        sb = tables.serve_breakdown_rows(data)
        ctx["serve"] = {"cells": tables.serve_cells(data), "breakdown": sb,
                        "svg": figures.breakdown_svg("serve_breakdown",
                                                     [(c.key.split(".")[-1], c.value) for c in sb])}
    return _env.get_template("report.html.j2").render(**ctx)


__all__ = ["render_html"]
