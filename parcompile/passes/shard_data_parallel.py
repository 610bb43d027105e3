"""``shard-data-parallel``: split every activation's ``batch`` dim over ``dp`` and its
``seq`` dim over ``cp`` (context parallelism). Parameters stay replicated over both;
their gradients are reduced over ``dp_cp`` by ``insert-collectives``."""

from __future__ import annotations

from dataclasses import dataclass

from parcompile.ir.graph import Graph
from parcompile.ir.types import Sharding, TensorType
from parcompile.passes.base import PassContext


def _data_split(s: Sharding, t: TensorType, dp: int, cp: int) -> Sharding:
    if dp > 1 and t.has_dim("batch"):
        s = s.with_split("batch", "dp")
    if cp > 1 and t.has_dim("seq"):
        s = s.with_split("seq", "cp")
    return s


@dataclass(frozen=True)
class ShardDataParallel:
    """Split ``batch`` over dp and ``seq`` over cp on every tensor (outputs, operand
    requirements and gradient layouts alike), so no data-parallel collective appears on
    any edge."""

    name: str = "shard-data-parallel"

    def apply(self, graph: Graph, ctx: PassContext) -> None:
        dp, cp = ctx.degrees["dp"], ctx.degrees["cp"]
        if dp == 1 and cp == 1:
            return
        for n in ctx.visit(graph.topological()):
            nd = graph.node(n)
            in_types = graph.input_types(n)
            graph.set_sharding(
                n,
                out=_data_split(nd.sharding, nd.type, dp, cp),
                requires=[_data_split(r, t, dp, cp) for r, t in zip(nd.requires, in_types)],
                grads=[_data_split(r, t, dp, cp) for r, t in zip(nd.grads, in_types)],
            )
