"""How one decoder layer's tensors are split over the ranks, for the HTML report: from the
plan's graph (each op's global type, its layout and the local shape on one rank, the
collectives a redistribution runs) and ``comm.collectives`` of plan.json (what each
collective of that layer moves, how often)."""

from __future__ import annotations

from dataclasses import dataclass

from parcompile.core.units import bytes_text
from parcompile.ir.ops import Trait
from parcompile.ir.printer import conversion_text, local_shape_text
from parcompile.ir.types import split_axes


@dataclass(frozen=True)
class TensorRow:
    """One op of the layer: its output's global dims (``name=size``), its shape on one
    rank, which axis splits which dim, the axes holding partial sums, its parameters with
    their splits, and (a redistribution) the collectives of its forward and backward."""

    op: str
    kind: str
    dims: str
    local: str
    split: str
    partial: str
    params: str
    collectives: str


def _split_text(sharding) -> str:
    return ", ".join(f"{d}: {'*'.join(split_axes(a))}" for d, a in sharding.split) or "replicated"


def first_layer(plan) -> int | None:
    """The first decoder layer of the first stage (``stages[0].layers[0]``), None without one."""
    layers = plan.data["stages"][0]["layers"] if plan.data["stages"] else []
    return layers[0] if layers else None


def tensor_rows(plan, layer: int) -> list[TensorRow]:
    """The ops of decoder layer ``layer`` in the graph's order (:class:`TensorRow`)."""
    graph = plan.graph
    prefix = f"layers.{layer}."
    rows = []
    for name in graph.topological():
        if not name.startswith(prefix):
            continue
        nd = graph.node(name)
        coll = ""
        if nd.has_trait(Trait.CONVERSION):
            coll = "forward {}; backward {}".format(*conversion_text(nd))
        params = "; ".join(f"{p.name[len(prefix):]} [{', '.join(map(str, p.type.dims))}] {_split_text(p.sharding)}"
                           for p in nd.params)
        rows.append(TensorRow(name[len(prefix):], nd.kind, ", ".join(map(str, nd.type.dims)),
                              local_shape_text(nd, plan.degrees), _split_text(nd.sharding),
                              ", ".join(sorted(nd.sharding.partial)), params, coll))
    return rows


def layer_collectives(data: dict, layer: int) -> list[dict]:
    """The rows of plan.json ``comm.collectives`` that decoder layer ``layer`` runs (its
    ``where`` is the layer or one of its blocks), in plan.json's order, each with
    ``bytes_text``."""
    prefix = f"layers.{layer}"
    out = []
    for i, c in enumerate(data["comm"]["collectives"]):
        if c["where"] == prefix or c["where"].startswith(prefix + "."):
            out.append(dict(c, index=i, bytes_text=bytes_text(c["bytes"])))
    return out


def first_groups(data: dict) -> list[tuple[str, list[int]]]:
    """Each axis of more than one rank, and the group rank 0 belongs to (``groups``)."""
    out = []
    for axis, groups in data["groups"].items():
        if groups and len(groups[0]) > 1:
            out.append((axis, groups[0]))
    return out
