"""``shard-data-parallel``: split every activation's ``batch`` dim over ``dp`` and its
``seq`` dim over ``cp`` (context parallelism), and say how the training step shards its
states over those ranks: the pass returns the plan's
:class:`~parcompile.core.data_parallel.DataParallelSharding` (ZeRO's stage over ``dp_cp``),
which ``insert-collectives``, the analyses, codegen and the program's optimizer read. The
graph's parameters stay replicated over both axes; their gradients are reduced over
``dp_cp`` by ``insert-collectives`` as that value says."""

from __future__ import annotations

from dataclasses import dataclass

from parcompile.core.data_parallel import DataParallelSharding, data_parallel_sharding
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
    any edge. Returns the step's data-parallel sharding (module docstring)."""

    name: str = "shard-data-parallel"

    def apply(self, graph: Graph, ctx: PassContext) -> DataParallelSharding:
        dp, cp = ctx.degrees["dp"], ctx.degrees["cp"]
        sharding = data_parallel_sharding(ctx.cfg.parallel)
        if dp == 1 and cp == 1:
            return sharding
        for n in ctx.visit(graph.topological()):
            nd = graph.node(n)
            in_types = graph.input_types(n)
            graph.set_sharding(
                n,
                out=_data_split(nd.sharding, nd.type, dp, cp),
                requires=[_data_split(r, t, dp, cp) for r, t in zip(nd.requires, in_types)],
                grads=[_data_split(r, t, dp, cp) for r, t in zip(nd.grads, in_types)],
            )
        return sharding
