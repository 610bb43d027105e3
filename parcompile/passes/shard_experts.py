"""``shard-experts``: place the routed experts of every MoE layer (Megatron-Core's expert
parallelism with parallel folding).

* Expert weights (``Param.expert``, dims ``experts`` x ``expert_ffn`` x ``hidden``) are split
  on ``experts`` over ``ep``: ep rank r holds the contiguous block of experts
  ``[r * E / ep, (r + 1) * E / ep)``; and inside each expert on ``expert_ffn`` over
  ``expert_tp`` (w1 and w3 column-parallel, w2 row-parallel), as Megatron-Core's grouped
  MLP does. They are replicated over ``expert_dp`` and their gradients are reduced there
  (``insert-collectives``), not over ``dp_cp``.
* Token tensors keep the dense layout: the dispatch and combine ops run the all-to-alls
  themselves (:func:`parcompile.ir.ops.moe_collectives`), so no edge conversion appears.
  Each dispatch is marked ``local_experts``: the experts one ep rank holds (every layout,
  ep = 1 included), which decides where its rows go.
* The router weight and shared experts are dense parameters (replicated, or tensor
  parallel over tp like an MLP).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parcompile.ir.graph import Graph
from parcompile.passes.base import PassContext


@dataclass(frozen=True)
class ShardExperts:
    """Split expert weights over ep (experts) and expert_tp (expert ffn); module docstring."""

    name: str = "shard-experts"

    def apply(self, graph: Graph, ctx: PassContext) -> None:
        ep, etp = ctx.degrees["ep"], ctx.degrees["expert_tp"]
        if ctx.cfg.model.experts == 0:
            return
        for n in ctx.visit(graph.topological()):
            nd = graph.node(n)
            if not any(p.expert for p in nd.params):
                continue
            if ep == 1 and etp == 1:
                self._mark_dispatch(graph, n, ctx)
                continue
            ps = []
            for p in nd.params:
                if p.expert:
                    s = p.sharding
                    if ep > 1:
                        s = s.with_split("experts", "ep")
                    if etp > 1 and any(d.name == "expert_ffn" for d in p.type.dims):   # not w2's bias
                        s = s.with_split("expert_ffn", "expert_tp")
                    p = replace(p, sharding=s)
                ps.append(p)
            graph.set_params(n, ps)
            self._mark_dispatch(graph, n, ctx)

    @staticmethod
    def _mark_dispatch(graph: Graph, experts: str, ctx: PassContext) -> None:
        """The dispatch feeding the experts op ``experts`` gets ``local_experts``: the experts
        each ep rank holds (the local size of the stacked weights' ``experts`` dim), the
        rows' destination rule the program's dispatch follows."""
        p = next(p for p in graph.node(experts).params if p.expert)
        local = p.sharding.local_type(p.type, ctx.degrees)
        held = next(d.size for d in local.dims if d.name == "experts")
        for src in graph.inputs(experts):
            if graph.node(src).kind == "moe_dispatch":
                graph.set_attrs(src, local_experts=held)
