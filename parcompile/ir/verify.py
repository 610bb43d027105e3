"""Structural checks of the graph, run after lowering and after every pass.

Checks: acyclic; operands numbered 0..n-1 and matching the op table's arity; every
op's layout fits its type on the mesh (dims divide); one layout requirement and one
gradient layout per operand; output types agree with the op table. With ``inserted``
(``insert-collectives`` has run): no edge whose producer layout differs from what its
consumer requires (:func:`parcompile.ir.ops.convert` finds nothing to do) and no edge
that crosses model chunks except into a ``send_recv``. With ``staged``
(``split-pipeline-stages`` has run): every op has a stage. The pass manager passes both
from the passes' results (:class:`parcompile.passes.results.PassResults`).

Verification is incremental: the graph records the ops its editing methods touched
(``Graph.dirty``); when the degrees and the two flags are those of the last successful
run, only those ops and the ops that read them are checked again (an edge check reads
both ends). Everything else was checked before and has not changed, so the result is
the same as a full run, at the cost of the ops a pass changed.
"""

from __future__ import annotations

from typing import Mapping

import networkx as nx

from parcompile.ir.graph import Graph
from parcompile.ir.ops import Trait, convert, spec
from parcompile.ir.types import ShardingError


class VerifyError(ValueError):
    """The graph breaks an invariant; the message names the op (and edge) at fault."""

    def __init__(self, message: str, op: str | None = None):
        super().__init__(message)
        self.op = op


def verify(graph: Graph, degrees: Mapping[str, int] | None = None, staged: bool = False,
           inserted: bool = False) -> None:
    """Raise :class:`VerifyError` on the first broken invariant (see module docstring).

    ``degrees`` (axis -> degree) enables the divisibility and layout-equality checks;
    ``staged`` the every-op-has-a-stage check, ``inserted`` the edge checks (layouts agree,
    chunks change only through ``send_recv``).
    """
    try:
        order = graph.topological()   # raises on a cycle
    except nx.NetworkXUnfeasible:
        raise VerifyError("the graph has a cycle") from None
    deg = dict(degrees or {})
    state = (tuple(sorted(deg.items())), inserted, staged)
    changed: set[str] | None = None
    if graph.verified_state == state:
        changed = {n for n in graph.dirty if n in graph}
        for n in list(changed):
            changed.update(v for v, _ in graph.users(n))
    for name in order:
        if changed is not None and name not in changed:
            continue
        nd = graph.node(name)
        s = spec(nd.kind)
        ins = graph.inputs(name)
        if s.arity is not None and len(ins) != s.arity:
            raise VerifyError(f"op {name}: {nd.kind} takes {s.arity} operands, has {len(ins)}", name)
        if len(nd.requires) != len(ins) or len(nd.grads) != len(ins):
            raise VerifyError(f"op {name}: {len(ins)} operands but {len(nd.requires)} layout requirements", name)
        if staged and nd.stage is None:
            raise VerifyError(f"op {name} has no pipeline stage", name)
        try:
            nd.sharding.local_type(nd.type, deg)
            for u, r in zip(ins, nd.requires):
                r.local_type(graph.node(u).type, deg)
            for pr in nd.params:
                pr.sharding.local_type(pr.type, deg)
        except ShardingError as e:
            raise VerifyError(f"op {name}: {e}", name) from e
        for i, u in enumerate(ins):
            pu = graph.node(u)
            if inserted:
                todo = convert(pu.sharding, nd.requires[i], deg)
                if todo:
                    raise VerifyError(
                        f"edge {u} -> {name} (operand {i}): producer layout {pu.sharding} "
                        f"!= required {nd.requires[i]} after insert-collectives", name)
                if staged and pu.chunk != nd.chunk and not nd.has_trait(Trait.STAGE_TRANSFER):
                    raise VerifyError(
                        f"edge {u} -> {name} crosses model chunks {pu.chunk} -> {nd.chunk} without send/recv", name)
    graph.dirty.clear()
    graph.verified_state = state
