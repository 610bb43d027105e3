"""``shard-tensor-parallel``: Megatron-LM tensor parallelism and vocabulary padding.

* Vocabulary padding (always, tp = 1 included): every ``vocab`` dim becomes
  ``padded_vocab = ceil(vocab / (vocab_multiple * tp)) * vocab_multiple * tp``; parameters
  remember their unpadded count (``Param.logical_numel``). Padded rows stay zero and are
  kept out of the loss (the vocab-parallel cross-entropy masks them).
* With tp > 1, each op gets the layout of its ``tp`` style (:func:`parcompile.ir.tp.tp_rule`):
  wq/wk/wv/w1/w3 and the LM head column-parallel, wo/w2 row-parallel (output
  ``partial(tp)``), a vocab-parallel embedding (output ``partial(tp)``), attention and
  activations split on heads/ffn, a vocab-parallel cross-entropy; norms and residual
  adds replicated, or split on ``seq`` with sequence parallelism; qk-norm split on heads
  with its weight replicated and its gradient ``partial(tp)`` (``Param.grad_partial``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parcompile.core.heads import kv_heads_replicated
from parcompile.ir.graph import Graph
from parcompile.ir.ops import spec
from parcompile.ir.tp import TpRule, tp_rule
from parcompile.ir.types import Dim, Sharding
from parcompile.passes.base import PassContext


def pad_vocab(graph: Graph, padded: int) -> None:
    """Replace every ``vocab`` dim (op outputs and parameters) by one of ``padded`` rows."""
    newv = Dim("vocab", padded)
    for n in graph.topological():
        nd = graph.node(n)
        if nd.type.has_dim("vocab"):
            graph.retype(n, nd.type.replace_dim("vocab", newv))
        if any(p.type.has_dim("vocab") for p in nd.params):
            graph.set_params(n, [
                replace(p, type=p.type.replace_dim("vocab", newv), logical_numel=p.numel)
                if p.type.has_dim("vocab") else p
                for p in nd.params
            ])


def _without_kv_split(rule: TpRule) -> TpRule:
    return TpRule(
        out_split=None if rule.out_split == "kv" else rule.out_split,
        out_partial=rule.out_partial,
        in_split=tuple(None if d == "kv" else d for d in rule.in_split),
        grad_partial=rule.grad_partial,
        param_split={k: (None if d == "kv" else d) for k, d in rule.param_split.items()},
        # a kv op left whole: every rank holds all its heads, so nothing is partial
        param_grad_partial=() if rule.out_split == "kv" else rule.param_grad_partial,
    )


@dataclass(frozen=True)
class ShardTensorParallel:
    """Pad the vocabulary, then apply Megatron column/row parallelism (module docstring)."""

    name: str = "shard-tensor-parallel"

    def apply(self, graph: Graph, ctx: PassContext) -> None:
        cfg = ctx.cfg
        tp = ctx.degrees["tp"]
        pad_vocab(graph, cfg.model.padded_vocab(tp))
        if tp == 1:
            return
        sp = cfg.parallel.sequence_parallel
        # serving with tp a multiple of kv_heads: every rank keeps the kv projections whole
        # (vLLM replicates each kv head on tp / kv_heads ranks; counted here as replicated)
        kv_replicated = kv_heads_replicated(cfg.model.kv_heads, tp)
        for n in ctx.visit(graph.topological()):
            nd = graph.node(n)
            style = nd.op.attr("tp")
            if style is None:
                continue
            in_types = graph.input_types(n)
            rule = tp_rule(style, nd.op.attr_map, in_types, nd.type, sp, spec(nd.kind).tp_styles)
            if kv_replicated:
                if rule.out_split == "kv":   # the program's kv projection takes one head (its mark)
                    graph.set_attrs(n, kv_replicas=tp // cfg.model.kv_heads)
                rule = _without_kv_split(rule)
            out = nd.sharding
            if rule.out_split:
                out = out.with_split(rule.out_split, "tp")
            if rule.out_partial:
                out = out.with_partial("tp")
            reqs, grads = [], []
            for i, (r, gr) in enumerate(zip(nd.requires, nd.grads)):
                d = rule.in_split[i] if i < len(rule.in_split) else None
                if d:
                    r, gr = r.with_split(d, "tp"), gr.with_split(d, "tp")
                if i < len(rule.grad_partial) and rule.grad_partial[i]:
                    gr = gr.with_partial("tp")
                reqs.append(r)
                grads.append(gr)
            graph.set_sharding(n, out=out, requires=reqs, grads=grads)
            if nd.params and (rule.param_split or rule.param_grad_partial):
                ps = []
                for p in nd.params:
                    suffix = p.name.rsplit(".", 1)[-1]
                    d = rule.param_split.get(suffix)
                    if d:
                        p = replace(p, sharding=p.sharding.with_split(d, "tp"))
                    if suffix in rule.param_grad_partial:
                        p = replace(p, grad_partial=p.grad_partial + ("tp",))
                    ps.append(p)
                graph.set_params(n, ps)
