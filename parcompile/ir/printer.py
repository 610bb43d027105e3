"""A stable one-line-per-op text dump of the graph, for golden tests and ``--format``.

Each line::

    NAME = KIND(INPUT, ...) : GLOBAL_TYPE -> local [SHAPE] LAYOUT @stage S[.CHUNK]

ops in deterministic topological order; nothing in it depends on memory addresses,
hash seeds or time.
"""

from __future__ import annotations

from typing import Mapping

from parcompile.ir.graph import Graph
from parcompile.ir.ops import Trait


def local_shape_text(nd, degrees: Mapping[str, int] | None = None) -> str:
    """Op ``nd``'s output shape on one rank under ``degrees``, as ``[2, 64, 32]``."""
    return "[" + ", ".join(str(s) for s in nd.sharding.local_type(nd.type, dict(degrees or {})).shape) + "]"


def conversion_text(nd) -> tuple[str, str]:
    """The collectives a redistribution op (``Trait.CONVERSION``) runs in its forward and its
    backward, each as ``all_gather(tp)+reduce_scatter(cp)`` (``-``: none)."""
    a = nd.op.attr_map
    return tuple("+".join(f"{k}({ax})" for k, ax in a[phase]) or "-" for phase in ("fwd", "bwd"))


def format_op(graph: Graph, name: str, degrees: Mapping[str, int] | None = None) -> str:
    """One op as one line (see module docstring)."""
    nd = graph.node(name)
    shape = local_shape_text(nd, degrees)
    where = ""
    if nd.stage is not None:
        where = f" @stage {nd.stage}" + (f".{nd.chunk}" if nd.chunk is not None and nd.chunk != nd.stage else "")
    extra = ""
    if nd.has_trait(Trait.CONVERSION):
        f, b = conversion_text(nd)
        extra = f" fwd={f} bwd={b}"
    elif nd.has_trait(Trait.STEP_COLLECTIVE):
        a = nd.op.attr_map
        extra = f" {a['op']}({a['axis']}) {a['bytes']}B"
    params = ""
    if nd.params:
        params = " params=" + ",".join(f"{p.name}{p.sharding}" for p in nd.params)
    ins = ", ".join(graph.inputs(name))
    return f"{name} = {nd.kind}({ins}) : {nd.type} -> local {shape} {nd.sharding}{where}{extra}{params}"


def dump(graph: Graph, degrees: Mapping[str, int] | None = None) -> str:
    """The whole graph, one line per op, with a trailing newline."""
    return "".join(format_op(graph, n, degrees) + "\n" for n in graph.topological())


def dot(graph: Graph, degrees: Mapping[str, int] | None = None) -> str:
    """The graph in Graphviz DOT: one cluster per pipeline stage, an op per node labelled
    with its kind and local shape, collectives drawn as boxes. Deterministic."""
    deg = dict(degrees or {})
    by_stage: dict[object, list[str]] = {}
    for name in graph.topological():
        by_stage.setdefault(graph.node(name).stage, []).append(name)
    ids = {name: f"n{i}" for i, name in enumerate(graph.topological())}
    out = ["digraph plan {", '  rankdir=TB;', '  node [shape=ellipse, fontsize=10];']
    for stage in sorted(by_stage, key=lambda s: (s is None, s if s is not None else 0)):
        indent = "  "
        if stage is not None:
            out.append(f'  subgraph cluster_stage{stage} {{')
            out.append(f'    label="stage {stage}";')
            indent = "    "
        for name in by_stage[stage]:
            nd = graph.node(name)
            shape = ",".join(str(s) for s in nd.sharding.local_type(nd.type, deg).shape)
            box = nd.has_trait(Trait.CONVERSION) or nd.has_trait(Trait.STEP_COLLECTIVE)
            label = f"{name}\\n{nd.kind} [{shape}]".replace('"', "'")
            out.append(f'{indent}{ids[name]} [label="{label}"{", shape=box" if box else ""}];')
        if stage is not None:
            out.append("  }")
    for src, dst, idx in sorted(graph.edges(), key=lambda e: (ids[e[1]], e[2], ids[e[0]])):
        out.append(f"  {ids[src]} -> {ids[dst]};")
    out.append("}")
    return "\n".join(out) + "\n"
