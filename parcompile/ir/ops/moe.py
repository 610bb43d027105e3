"""A mixture-of-experts layer's op kinds (ir/lower.py; runtime/model/moe.py; Megatron-Core's
all-to-all token dispatcher): the router, the token dispatch, the grouped experts and the
combine. Local types assume balanced routing: each rank receives as many (token, expert)
rows as it sends, b * s_local * top_k.
"""

from __future__ import annotations

from typing import Any, Mapping

from parcompile.core.model import GATED_ACTIVATIONS
from parcompile.ir.ops.base import (INDEX_BYTES, Code, Collective, OpSpec, Trait, linear_flops,
                                    same_type)
from parcompile.ir.types import TensorType


def _router_type(a, ins):
    # fp32 scores: softmax probabilities, or sigmoid scores (DeepSeek-V3: scoring_func)
    return TensorType(ins[0].dims[:-1] + (a["out_dim"],), "fp32")


def _dispatch_type(a, ins):
    return TensorType(ins[0].dims[:-1] + (a["topk_dim"], ins[0].dims[-1]), ins[0].dtype)


def _combine_type(a, ins):
    return TensorType(ins[0].dims[:-2] + (ins[0].dims[-1],), ins[0].dtype)


def _router_extra(a, ins, out):
    # the fp32 scores are the router's output (saves_output: softmax's and sigmoid's backward
    # both read their output); the top-k (or the gather of the chosen scores) keeps its int64
    # indices, the renormalisation the k weights and their sum (fp32); a 16-bit model's
    # router runs in fp32 and keeps fp32 copies of its input and weight. DeepSeek-V3's
    # choice (correction bias, group mask: topk_method noaux_tc) runs without gradient and
    # keeps nothing; routed_scaling_factor is a constant factor (nothing kept)
    n = ins[0].numel // ins[0].dims[-1].size
    k = a["top_k"]
    extra = n * k * (INDEX_BYTES + 4) + n * 4
    if a.get("fp32_input"):
        extra += ins[0].numel * 4 + a["experts"] * ins[0].dims[-1].size * 4
    return extra


def _router_traffic(a, ins, out):
    # the fp32 logits written and read, the scores written; noaux_tc also writes and reads
    # the corrected scores and their group-masked copy (runtime/model/moe.py: route)
    return (7 if a.get("topk_method") == "noaux_tc" else 3) * out.nbytes


#: Megatron-Core's all-to-all token dispatcher moves the routed rows through two permutations
#: each way (NVIDIA/Megatron-LM d98e8a6, megatron/core/transformer/moe/token_dispatcher.py,
#: MoEAlltoAllTokenDispatcher): ``dispatch_preprocess`` "Permutation 1" (moe_utils.permute: the
#: N tokens' rows gathered into N k rows sorted by expert) and, with more than one local expert,
#: ``dispatch_postprocess`` "Permutation 2" (sort_chunks_by_idxs: the arrivals regrouped by
#: local expert); ``combine_preprocess`` "Unpermutation 2" and ``combine_postprocess``
#: "Unpermutation 1" (moe_utils.unpermute: the N k rows summed back into N) undo them. Fused
#: (``moe_permute_fusion``) or not, each reads and writes its rows once; runtime/model/moe.py's
#: dispatch and combine run the same two row gathers each.


def _dispatch_traffic(a, ins, out):
    """Bytes of a dispatch (the module's two permutations): read the N token rows and write the
    N k sorted rows; with more than one local expert, read and write the N k rows again."""
    return ins[0].nbytes + out.nbytes + (2 * out.nbytes if a.get("local_experts", 1) > 1 else 0)


def _combine_traffic(a, ins, out):
    """Bytes of a combine: with more than one local expert, read and write the N k rows
    (unsort); then read them and write the N token rows (each token's sum over its k)."""
    return ins[0].nbytes + out.nbytes + (2 * ins[0].nbytes if a.get("local_experts", 1) > 1 else 0)


def _dispatch_extra(a, ins, out):
    # two row gathers (tokens to sorted rows, arrivals grouped by expert) keep their indices
    return 2 * INDEX_BYTES * (out.numel // out.dims[-1].size)


def _combine_extra(a, ins, out):
    # the gather back to (token, choice) order keeps its indices (two permutations); the
    # weighted sum keeps the k router weights per token (fp32)
    rows = ins[0].numel // ins[0].dims[-1].size
    return 2 * INDEX_BYTES * rows + 4 * rows


def _experts_gathered(a, ins, degrees: Mapping[str, int]) -> int:
    # expert_tp > 1: the routed rows are all-gathered over expert_tp (runtime/model/moe.py); the
    # experts keep the gathered rows, plus the two int64 indices that group them by expert
    # and restore their order, over the gathered rows
    etp = degrees.get("expert_tp", 1)
    rows = ins[0].numel // ins[0].dims[-1].size
    return (etp - 1) * (ins[0].nbytes + 2 * INDEX_BYTES * rows)


def _expert_mats(a) -> int:
    return 3 if a["activation"] in GATED_ACTIVATIONS else 2


def _experts_flops(a, ins, out):
    # every routed row runs one expert MLP: 2 * rows * h * ffn per weight matrix; with
    # expert_tp the rows are gathered and each rank runs ffn / expert_tp: the same FLOPs
    rows = ins[0].numel // ins[0].dims[-1].size
    return 2 * rows * ins[0].dims[-1].size * a["ffn"] * _expert_mats(a)


def _experts_extra(a, ins, out):
    # the expert activations kept for backward: gate, up and their product (SwiGLU) or the
    # pre- and post-activation (gelu/relu), ffn wide per routed row
    rows = ins[0].numel // ins[0].dims[-1].size
    return rows * a["ffn"] * ins[0].itemsize * _expert_mats(a)


def _experts_traffic(a, ins, out):
    rows = ins[0].numel // ins[0].dims[-1].size
    return rows * a["ffn"] * ins[0].itemsize * _expert_mats(a)


# --- scratch of the serve program (:attr:`OpSpec.scratch`)

def router_scratch(a, ins, out):
    # runtime/model/moe.py Router.forward and route: the input in fp32 (a 16-bit model), the fp32
    # logits beside the scores (the output), the top-k weights (fp32) and experts (int64)
    n = ins[0].numel // ins[0].dims[-1].size
    x32 = ins[0].numel * 4 if ins[0].itemsize < 4 else 0
    return x32 + out.nbytes + n * a["top_k"] * (4 + INDEX_BYTES)


def _routed_rows(out) -> int:
    """The (token, choice) rows of a dispatch's or the experts' local (b, s, k, h) type: N k."""
    return out.numel // out.dims[-1].size


def dispatch_scratch(a, ins, out):
    # runtime/model/moe.py dispatch, every row local (no collective; with ep or expert_tp > 1 the
    # rows received: the graph's balanced estimate): the N k rows sorted by expert (N k h,
    # the model dtype) before their copy grouped by local expert (the output), and per row
    # the int64 sort order, token id, local-expert label and grouping
    r = _routed_rows(out)
    return r * (out.dims[-1].size * out.itemsize + 4 * INDEX_BYTES)


def experts_scratch(a, ins, out):
    # runtime/model/moe.py GroupedExperts: the experts run one at a time, an expert's rows at most
    # the N tokens of the step (each token chooses it once: the bound holds any routing), its
    # gate, up, activation and product (gated: 4 x f, ungated 2 x f; f the rank's ``local_ffn``)
    # beside the outputs of the experts before it; at the end the N k output rows of every
    # expert beside their concatenation (the op's output). Beside them the rows' int64 order
    # and grouping, which the routed rows carry to the combine.
    r, h, e = _routed_rows(out), out.dims[-1].size, out.itemsize
    n = r // a["top_k"]
    f = a.get("local_ffn", a["ffn"])
    inner = (4 if a["activation"] in ("swiglu", "geglu") else 2) * f
    return max(r * h * e, n * inner * e) + 2 * INDEX_BYTES * r


def combine_scratch(a, ins, out):
    # runtime/model/moe.py combine: the rows put back in arrival order, then in (token, choice) order
    # beside them (2 x N k h; one int64 sort per row at a time), then the weighted rows beside
    # the latter; the rows' order and grouping carried from the dispatch
    rows = ins[0]
    r = _routed_rows(rows)
    return 2 * rows.nbytes + 3 * INDEX_BYTES * r


# --- program rows (:class:`Code`)

#: the router's keywords beyond the softmax top-k's, by the op's attributes (ir/lower.py sets
#: them only where not the default: DeepSeek-V3's sigmoid, group-limited choice, scaling;
#: Qwen3-MoE's unnormalised weights)
_ROUTER_KEYS = ("norm_topk_prob", "scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor")


def router_keywords(a, bias: bool) -> str:
    """The runtime router's keywords beyond the softmax top-k's (``, scoring_func='sigmoid',
    ...``) from a router op's attributes ``a``; ``bias``: the op has a bias (gpt-oss)."""
    return "".join(f", {k}={a[k]!r}" for k in _ROUTER_KEYS if k in a) + (", router_bias=True" if bias else "")


def experts_keywords(a, bias: bool) -> str:
    """The runtime experts' keywords (``, bias=True, swiglu_clamp=(alpha, limit)``) from an
    experts op's attributes ``a``; ``bias``: its matrices have biases (gpt-oss)."""
    kw = ", bias=True" if bias else ""
    if a.get("swiglu_limit") is not None:   # gpt-oss's clamped SwiGLU
        kw += f", swiglu_clamp=({a['swiglu_alpha']!r}, {a['swiglu_limit']!r})"
    if a.get("recompute") == "moe_act":   # recompute = [moe_act] (passes/insert_collectives.py)
        kw += ", recompute_act=True"
    return kw


def _router_facts(a) -> dict:
    return {"kw": router_keywords(a, bool(a.get("_bias")))}


def _moe_axes_facts(a) -> dict:
    """The expert axes the dispatch moves rows over, from its collectives (``_axes``): the
    all-to-alls over ep, the all-gather over expert_tp."""
    axes = a.get("_axes", ())
    kw = "".join(f", {ax}=self.{ax}" for ax in ("ep", "expert_tp") if ax in axes)
    return {"kw": kw + _on_input(a)}


def _on_input(a) -> str:
    """Llama 4's ``probs_on_input``: the dispatch scales each row by its router weight, the
    combine sums the rows unweighted."""
    return ", probs_on_input=True" if a.get("probs_on_input") else ""


def _experts_facts(a) -> dict:
    """The experts' keywords and their axes: the MoE module's ``experts`` (ep, expert_tp),
    or, where the graph splits each expert's inner width over tp (serving with ep = 1:
    ``ffn_axis``), every expert on every tp rank (``rt.ExpertAxes.tensor_parallel``)."""
    axes = "rt.ExpertAxes.tensor_parallel(tp)" if a.get("ffn_axis") == "tp" else "experts"
    return {"kw": experts_keywords(a, bool(a.get("_bias"))), "axes": axes}


# --- collectives

COUNTS_BYTES = 8  # the runtime exchanges token counts as int64


def moe_collectives(kind: str, a: Mapping[str, Any], degrees: Mapping[str, int], routed: TensorType,
                    where: str) -> list[Collective]:
    """The token dispatch (``moe_dispatch``) or combine (``moe_combine``) of one MoE layer,
    one micro-batch, one rank (Megatron-Core's all-to-all token dispatcher).

    ``routed`` is the local ``(b, s, top_k, h)`` tensor: the A = b * s_local * top_k
    (token, expert) rows this rank sends, A * h * e bytes. Under balanced routing a rank
    also receives A rows (R = A); the sizes marked ``bytes_per_row`` depend on the router
    (R, or the sum of R over expert_tp) and are that balanced estimate. Forward:

    * dispatch: all-to-all over ep of the token counts per expert (E int64), all-to-all
      over ep of the rows (R h e); with expert_tp > 1 an all-gather over expert_tp of the
      counts (expert_tp * E int64) and of the rows (sum of R over expert_tp);
    * combine: with expert_tp > 1 a reduce-scatter over expert_tp of the experts' partial
      outputs (R h e), then the all-to-all over ep back to the tokens' ranks (A h e, exact).

    Backward mirrors them: combine: all-to-all (R), all-gather over expert_tp (sum of R);
    dispatch: reduce-scatter over expert_tp (R), all-to-all (A, exact). No count exchange
    runs in backward (the forward's splits are reused).


    Serving with ``ep = 1`` (``ffn_axis = "tp"``, set by ``shard-experts``): every rank holds
    every expert and the tokens of the whole tp group, so neither runs a collective; the
    combine's partial sums over tp are all-reduced by the conversion after them.
    """
    ep, etp = degrees.get("ep", 1), degrees.get("expert_tp", 1)
    if a.get("ffn_axis") == "tp":   # experts split over tp, the tokens replicated there: nothing moves
        return []
    row = routed.dims[-1].size * routed.itemsize
    nb = routed.nbytes
    E = a["experts"]
    out: list[Collective] = []
    if kind == "moe_dispatch":
        if ep > 1:
            out.append(Collective("all_to_all", "ep", E * COUNTS_BYTES, "forward", where))
            out.append(Collective("all_to_all", "ep", nb, "forward", where, bytes_per_row=row))
        if etp > 1:
            out.append(Collective("all_gather", "expert_tp", etp * E * COUNTS_BYTES, "forward", where))
            out.append(Collective("all_gather", "expert_tp", etp * nb, "forward", where, bytes_per_row=row))
            out.append(Collective("reduce_scatter", "expert_tp", nb, "backward", where, bytes_per_row=row))
        if ep > 1:
            out.append(Collective("all_to_all", "ep", nb, "backward", where))
    else:
        if etp > 1:
            out.append(Collective("reduce_scatter", "expert_tp", nb, "forward", where, bytes_per_row=row))
        if ep > 1:
            out.append(Collective("all_to_all", "ep", nb, "forward", where))
            out.append(Collective("all_to_all", "ep", nb, "backward", where, bytes_per_row=row))
        if etp > 1:
            out.append(Collective("all_gather", "expert_tp", etp * nb, "backward", where, bytes_per_row=row))
    return out



def _routed_collectives(node, degrees, local_in, local_out) -> list[Collective]:
    """:func:`moe_collectives` of a dispatch (its routed output) or a combine (its routed input)."""
    kind = node.op.kind
    return moe_collectives(kind, node.op.attr_map, degrees, local_out if kind == "moe_dispatch" else local_in[0],
                           node.op.module)


#: the op kinds of this module
DEFINITIONS = [
    OpSpec("router", _router_type, fwd_flops=linear_flops, saves=lambda a: () if a.get("fp32_input") else (0,),
           saved_extra=_router_extra, saves_output=lambda a: True, arity=1, traffic=_router_traffic,
           scratch=router_scratch, traits=frozenset({Trait.GEMM}),
           code=Code(build="rt.Router({name}, {in_features}, {out_features}, {top_k}, tp, SEED{kw}, "
                           "local={local})",
                     facts=_router_facts, inline=False, var="route",
                     comment="fp32 scores; each token's top-k experts and their weights")),
    OpSpec("moe_dispatch", _dispatch_type, saved_extra=_dispatch_extra, arity=2, traffic=_dispatch_traffic,
           scratch=dispatch_scratch, collectives=_routed_collectives,
           code=Code(call="rt.dispatch({0}, {1}, local_experts={a[local_experts]}{kw})", facts=_moe_axes_facts,
                     inline=False, operands=("x", "route"), var="rows",
                     comment="(token, choice) rows to their experts' ranks, grouped by local expert "
                             "(as many as the router sends: the shape is the balanced estimate)")),
    OpSpec("experts", same_type, fwd_flops=_experts_flops, saves=lambda a: (0,), saved_extra=_experts_extra,
           saved_gathered=_experts_gathered, arity=1, traffic=_experts_traffic, scratch=experts_scratch,
           traits=frozenset({Trait.GEMM, Trait.FP8_GEMM, Trait.EXPRESSION}),
           code=Code(build='rt.GroupedExperts({op}, EXPERTS, HIDDEN, EXPERT_FFN, "{a[activation]}", {axes}, SEED, '
                           "OUT_STD{kw}, local={local}{fp8})",
                     facts=_experts_facts, inline=False, var="",
                     comment="each local expert's MLP on its rows (a grouped GEMM)")),
    OpSpec("moe_combine", _combine_type, saves=lambda a: (0,), saved_extra=_combine_extra, arity=2,
           traffic=_combine_traffic, scratch=combine_scratch, collectives=_routed_collectives,
           code=Code(call="rt.combine({0}, {1}, AUX_LOSS_SCALE if self.training else 0.0{kw})",
                     serve_call="rt.combine({0}, {1}{kw})", inline=False, operands=("rows", "route"), var="y",
                     facts=lambda a: {"kw": _on_input(a)},
                     comment="rows back to their tokens, weighted by the router")),
]
