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
* Serving with ``ep = 1`` (:meth:`ShardExperts._tensor_parallel`): every rank holds every
  expert, each expert's inner width split over ``tp`` (vLLM's tensor-parallel ``FusedMoE``,
  its default); the tokens, replicated over tp, are dispatched locally (no collective),
  the experts and the combine give partial sums over tp, the shared experts' (a
  row-parallel w2 left unreduced) are added to them, and the one conversion after the sum
  all-reduces them over tp. The three MoE ops are marked ``ffn_axis = "tp"``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parcompile.ir.graph import Graph
from parcompile.ir.types import REPLICATED
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
            if ctx.cfg.workload == "serve" and ep == 1:
                self._tensor_parallel(graph, n, ctx)
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

    def _tensor_parallel(self, graph: Graph, experts: str, ctx: PassContext) -> None:
        """Serving with ep = 1 (module docstring): the experts op ``experts``' weights split
        on ``expert_ffn`` over tp (not w2's bias), its dispatch, itself and its combine marked
        ``ffn_axis = "tp"``; with tp > 1 the experts' and the combine's outputs partial over
        tp, and so the shared experts' sum after the combine (an ``add`` of the MoE's module reading it), whose
        reader's conversion all-reduces it once. The serve checks hold expert_tp = tp."""
        tp = ctx.degrees["tp"]
        combine = next(v for v, _ in graph.users(experts) if graph.node(v).kind == "moe_combine")
        dispatch = next(s for s in graph.inputs(experts) if graph.node(s).kind == "moe_dispatch")
        for n in (dispatch, experts, combine):
            graph.set_attrs(n, ffn_axis="tp")
        self._mark_dispatch(graph, experts, ctx)
        if tp == 1:
            return
        graph.set_params(experts, [
            replace(p, sharding=p.sharding.with_split("expert_ffn", "tp"))
            if p.expert and any(d.name == "expert_ffn" for d in p.type.dims) else p
            for p in graph.node(experts).params])
        partial = REPLICATED.with_partial("tp")
        graph.set_sharding(experts, out=partial)
        nd = graph.node(combine)
        graph.set_sharding(combine, out=partial, requires=[partial, *nd.requires[1:]],
                           grads=[REPLICATED, *nd.grads[1:]])
        for v, _ in graph.users(combine):   # the shared experts' sum (in the MoE's module): partial + partial
            if graph.node(v).kind == "add" and graph.node(v).op.module == nd.op.module:
                graph.set_sharding(v, out=partial, requires=[partial, partial], grads=[REPLICATED, REPLICATED])

    @staticmethod
    def _mark_dispatch(graph: Graph, experts: str, ctx: PassContext) -> None:
        """The dispatch feeding the experts op ``experts`` gets ``local_experts``: the experts
        each ep rank holds (the local size of the stacked weights' ``experts`` dim), the
        rows' destination rule the program's dispatch follows, and the combine it feeds the
        same (both regroup the rows by local expert where there are several: their traffic); the experts op gets
        ``local_ffn``, the inner units of each expert one rank holds (its serving scratch)."""
        p = next(p for p in graph.node(experts).params if p.expert)
        local = p.sharding.local_type(p.type, ctx.degrees)
        held = next(d.size for d in local.dims if d.name == "experts")
        graph.set_attrs(experts, local_ffn=next(d.size for d in local.dims if d.name == "expert_ffn"))
        for src in graph.inputs(experts):
            if graph.node(src).kind == "moe_dispatch":
                graph.set_attrs(src, local_experts=held)
        for dst, _ in graph.users(experts):   # the combine undoes the dispatch's regrouping (its traffic)
            if graph.node(dst).kind == "moe_combine":
                graph.set_attrs(dst, local_experts=held)
