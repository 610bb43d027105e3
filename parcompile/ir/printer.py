"""A stable one-line-per-op text dump of the graph, for golden tests and ``--format``.

Each line::

    NAME = KIND(INPUT, ...) : GLOBAL_TYPE -> local [SHAPE] LAYOUT @stage S[.CHUNK]

ops in deterministic topological order; nothing in it depends on memory addresses,
hash seeds or time.
"""

from __future__ import annotations

from typing import Mapping

from parcompile.ir.graph import Graph


def format_op(graph: Graph, name: str, degrees: Mapping[str, int] | None = None) -> str:
    """One op as one line (see module docstring)."""
    nd = graph.node(name)
    deg = dict(degrees or {})
    local = nd.sharding.local_type(nd.type, deg)
    shape = "[" + ", ".join(str(s) for s in local.shape) + "]"
    where = ""
    if nd.stage is not None:
        where = f" @stage {nd.stage}" + (f".{nd.chunk}" if nd.chunk is not None and nd.chunk != nd.stage else "")
    extra = ""
    if nd.kind == "redistribute":
        a = nd.op.attr_map
        f = "+".join(f"{k}({ax})" for k, ax in a["fwd"]) or "-"
        b = "+".join(f"{k}({ax})" for k, ax in a["bwd"]) or "-"
        extra = f" fwd={f} bwd={b}"
    elif nd.kind == "step_collective":
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
