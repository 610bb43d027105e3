"""Mixture of experts at run time: router, token dispatch and combine over expert
parallelism, grouped expert MLPs.

One MoE layer on one rank, for its N local tokens x (N, h) (with sequence parallelism
each tp rank holds its own part of the sequence; Megatron-Core requires it for MoE with
tp > 1, and so does parcompile):

1. **Router** (:class:`Router`, :func:`route`; Switch Transformer, Fedus et al. 2021;
   Mixtral's top-k): fp32 logits ``x W_r^T`` (N, E), ``p = softmax(logits)``, the top_k
   experts of each token, with weights ``p_top / sum(p_top)`` (renormalised over the k
   chosen, as Mixtral, when the model key ``norm_topk_prob`` is true, its default) or
   ``p_top`` itself (``norm_topk_prob = false``: Qwen3-MoE's ``Qwen3MoeTopKRouter`` without
   normalisation; with top_k = 1 the weight is p itself either way, as Switch).
   DeepSeek-V3 (``scoring_func = sigmoid``, ``topk_method = noaux_tc``; transformers'
   ``DeepseekV3TopkRouter``): scores ``s = sigmoid(logits)``; the experts are chosen on
   ``s + b`` with ``b`` the per-expert ``e_score_correction_bias`` (an fp32 buffer, held
   fixed: DeepSeek's auxiliary-loss-free bias update, Megatron-Core's
   ``--moe-router-enable-expert-bias``, is not modelled), among the ``topk_group`` of
   ``n_group`` expert groups whose two best ``s + b`` sum highest; the weights are the
   chosen ``s`` (without b), divided by their sum + 1e-20 when ``norm_topk_prob``, times
   ``routed_scaling_factor``. **Dropless**: every (token, expert) assignment is computed,
   no capacity factor, no token dropped.
2. **Auxiliary load-balancing loss** (Switch Transformer eq. 4, GShard's top-k form):
   ``aux = alpha * E * sum_e f_e * P_e`` with ``f_e`` the fraction of this rank's N * top_k
   assignments that chose expert e and ``P_e`` the mean router probability of e over the N
   tokens (sigmoid scores: each token's scores divided by their sum + 1e-20 first, as
   DeepSeek-V3's balance loss, eq. 19-20 of its report, and Megatron-Core's sigmoid aux
   loss normalise them; ``f_e`` counts the experts chosen, with bias and groups, where those
   count the top_k of the plain scores: the same while the bias is 0 and the groups do not
   bind; over the rank's tokens, not per sequence); alpha is the model key
   ``router_aux_loss`` (default 0.01). Its gradient is
   injected in backward (Megatron-Core's ``MoEAuxLossAutoScaler``) scaled like the main
   loss, ``alpha / (num_microbatches * tp_sp)``: the mean over micro-batches and over the
   sequence-parallel ranks, whose router gradients are summed. It is computed on each
   rank's own tokens, so it depends on the layout; ``verify`` runs with alpha = 0.
3. **Dispatch** (Megatron-Core's all-to-all token dispatcher): the N * top_k rows are
   sorted by expert; ep rank r holds experts ``[r E/ep, (r+1) E/ep)``. The per-expert counts
   are exchanged with one all-to-all over ep (E int64), then the rows with one all-to-all
   over ep with uneven splits (``all_to_all_single``). With expert_tp > 1 the received
   rows of the expert_tp group are all-gathered (counts first, expert_tp * E int64), so
   each expert_tp rank runs its ffn / expert_tp slice of every expert on all of them.
4. **Experts**: the rows are grouped by local expert and each expert's MLP runs on its
   group (a grouped GEMM, here a loop); w1/w3 column- and w2 row-parallel over expert_tp.
   Under ``train.precision = fp8`` each expert matrix's GEMMs run in FP8
   (:func:`expert_linear`, the one hook on the grouped matmul).
5. **Combine**: with expert_tp > 1 a reduce-scatter over expert_tp sums the partial outputs
   back to the rows each rank received; an all-to-all over ep returns them to their tokens'
   ranks; each token's output is the router-weighted sum of its top_k rows.

Uneven all-gathers and reduce-scatters over expert_tp run as ``all_to_all_single`` (gloo's
all-gather needs equal sizes); they are counted as the all-gather / reduce-scatter they are.
Collectives whose size the router decides are recorded with their ``rows``
(:class:`parcompile.runtime.distributed.comm.CommCounter`).

The optimizer side of expert weights (reduced over ``expert_dp``, averaged over dp * cp)
is :class:`parcompile.runtime.train.optim_moe.MoEOptimizer`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parcompile.runtime.model.discard import discarding
from parcompile.runtime.distributed.comm import COUNTER, all_gather_single, nbytes
from parcompile.runtime.distributed.context import Axis, ParallelContext
from parcompile.runtime.model.fp8 import fp8_linear
from parcompile.runtime.model.layers import ACTIVATIONS, GATED, INIT_STD, clamped_swiglu, make_param

COUNT_DTYPE = torch.int64


@dataclasses.dataclass
class ExpertAxes:
    """The expert-parallel groups of this rank (Megatron-Core's expert RankGenerator)."""

    ep: Axis
    expert_tp: Axis
    expert_dp: Axis

    @classmethod
    def of(cls, ctx: ParallelContext) -> "ExpertAxes":
        return cls(ctx.axes["ep"], ctx.axes["expert_tp"], ctx.axes["expert_dp"])

    @classmethod
    def tensor_parallel(cls, tp: Axis) -> "ExpertAxes":
        """The experts served tensor parallel (vLLM's ``FusedMoE`` without expert parallelism,
        its default; the serving graph's ``ffn_axis = "tp"``): every expert on every rank of
        ``tp``, each expert's inner width split over ``tp``; ep and expert_dp this rank alone."""
        rank = tp.ranks[tp.index]
        return cls(Axis("ep", [rank], 0), tp, Axis("expert_dp", [rank], 0))


# --------------------------------------------------------------------------- collectives


def _all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], axis: Axis,
                     routed: bool, op: str = "all_to_all", produced: int | None = None) -> torch.Tensor:
    """Rows ``x`` (sum(in_splits), h): in_splits[j] rows to rank j of ``axis``; returns the
    (sum(out_splits), h) rows received, in rank order. Counted as ``op`` producing
    ``produced`` rows (default: the rows received)."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    rows = out.shape[0] if produced is None else produced
    COUNTER.record(op, axis.name, rows * math.prod(x.shape[1:]) * x.element_size(), rows if routed else None)
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=axis.group)
    return out


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all of rows over ``axis``; backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, axis, routed_fwd, routed_bwd):
        ctx.meta = (out_splits, in_splits, axis, routed_bwd)
        return _all_to_all_rows(x, out_splits, in_splits, axis, routed_fwd)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits, axis, routed = ctx.meta
        return _all_to_all_rows(g, in_splits, out_splits, axis, routed), None, None, None, None, None


def _gather_rows(x: torch.Tensor, member_rows: list[int], axis: Axis) -> torch.Tensor:
    """Uneven all-gather of rows over ``axis`` (member j holds member_rows[j] rows)."""
    n = axis.size
    return _all_to_all_rows(x.repeat(n, 1), member_rows, [x.shape[0]] * n, axis, True, op="all_gather")


def _scatter_rows(y: torch.Tensor, member_rows: list[int], axis: Axis) -> torch.Tensor:
    """Uneven reduce-scatter of rows over ``axis``: member j gets the sum of its rows."""
    n, mine = axis.size, member_rows[axis.index]
    got = _all_to_all_rows(y, [mine] * n, member_rows, axis, True, op="reduce_scatter", produced=mine)
    return got.view(n, mine, *y.shape[1:]).sum(0)


class _GatherRows(torch.autograd.Function):
    """Forward: uneven all-gather over expert_tp; backward: uneven reduce-scatter."""

    @staticmethod
    def forward(ctx, x, member_rows, axis):
        ctx.meta = (member_rows, axis)
        return _gather_rows(x, member_rows, axis)

    @staticmethod
    def backward(ctx, g):
        member_rows, axis = ctx.meta
        return _scatter_rows(g, member_rows, axis), None, None


class _ScatterRows(torch.autograd.Function):
    """Forward: uneven reduce-scatter over expert_tp; backward: uneven all-gather."""

    @staticmethod
    def forward(ctx, y, member_rows, axis):
        ctx.meta = (member_rows, axis)
        return _scatter_rows(y, member_rows, axis)

    @staticmethod
    def backward(ctx, g):
        member_rows, axis = ctx.meta
        return _gather_rows(g, member_rows, axis), None, None


def _exchange_counts(counts: torch.Tensor, axis: Axis) -> torch.Tensor:
    """All-to-all of the per-expert counts (E,) over ep: returns, per source rank, its counts
    for this rank's experts, (ep * E/ep,)."""
    out = torch.empty_like(counts)
    COUNTER.record("all_to_all", axis.name, nbytes(out))
    dist.all_to_all_single(out, counts.contiguous(), group=axis.group)
    return out


def _gather_counts(counts: torch.Tensor, axis: Axis) -> torch.Tensor:
    out = counts.new_empty((axis.size * counts.numel(),))
    COUNTER.record("all_gather", axis.name, nbytes(out))
    all_gather_single(out, counts.contiguous(), group=axis.group)
    return out


class _AuxLossScaler(torch.autograd.Function):
    """Forward: identity on ``y``; backward: also a gradient of ``scale`` for ``aux``
    (Megatron-Core's MoEAuxLossAutoScaler: the aux loss joins the backward of the layer)."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return y

    @staticmethod
    def backward(ctx, g):
        return g, torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=g.device), None


# --------------------------------------------------------------------------- the layer


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True, scoring_func: str = "softmax",
          correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
          routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing of fp32 ``logits`` (N, E): (weights (N, k) fp32, experts (N, k) int64,
    balance scores (N, E) fp32, the ``P`` of :func:`load_balancing_loss`).

    ``scoring_func = "softmax"``: ``p = softmax(logits)``, the k largest, weights the chosen p
    renormalised over the k when ``norm_topk_prob`` and k > 1 (Mixtral; transformers'
    ``norm_topk_prob`` of Qwen3-MoE), else as they are (Switch for k = 1; Qwen3-MoE with
    ``norm_topk_prob`` false); balance scores p.

    ``scoring_func = "sigmoid"`` (DeepSeek-V3; transformers 5's ``DeepseekV3TopkRouter``,
    operation for operation): ``s = sigmoid(logits)``; the experts are chosen on ``s + b``
    (``correction_bias`` b (E,) fp32, None: 0) and only there: with ``n_group`` > 1 the E
    experts form n_group groups of E / n_group (E / n_group >= 2), each scored by the sum of
    its two largest ``s + b``; the ``topk_group`` best groups are kept, the others' experts
    masked to -inf; then the k largest (unsorted, as transformers). Weights: the chosen
    ``s``, divided by their sum + 1e-20 when ``norm_topk_prob`` (any k). Balance scores:
    ``s / (sum_e s + 1e-20)`` (DeepSeek-V3's balance loss; Megatron-Core's sigmoid aux loss).

    Either way the weights are then times ``routed_scaling_factor``. The choice takes no
    gradient; the weights' gradient reaches the logits through the chosen scores only.
    Nothing depends on the rank: each rank routes its own tokens with the same replicated
    router (ep and tp ranks alike).
    """
    logits = logits.float()
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"scoring_func must be softmax or sigmoid, got {scoring_func!r}")
    if correction_bias is None and n_group == 1:
        weights, experts = scores.topk(top_k, dim=-1)
    else:
        E = scores.shape[-1]
        with torch.no_grad():
            choice = scores.detach()
            if correction_bias is not None:
                choice = choice + correction_bias
            if n_group > 1:   # group-limited: keep the topk_group groups of the best top-2 sums
                grouped = choice.view(-1, n_group, E // n_group)
                group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)                      # (N, n_group)
                group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
                group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
                score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
                choice = choice.masked_fill(~score_mask, float("-inf"))
            experts = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
    if scoring_func == "sigmoid":
        if norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        balance = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        if norm_topk_prob and top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        balance = scores
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, experts, balance


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``E * sum_e f_e P_e`` (Switch Transformer eq. 4; 1 when perfectly balanced), without
    the coefficient: f_e (no gradient) the share of assignments to e, P_e the mean of p_e
    (``probs`` (N, E): :func:`route`'s balance scores, summing to 1 per token)."""
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts).float()
    f = counts / max(experts.numel(), 1)
    return num_experts * (f * probs.mean(dim=0)).sum()


def expert_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: str | None = None,
                  axis: Axis | None = None, split: str = "column") -> torch.Tensor:
    """One expert matrix on its group of rows: ``x`` (n, K) @ ``weight`` (N, K)^T [+ ``bias``]
    -> (n, N), the grouped expert GEMM of step 4 (module docstring) for one group.

    ``fp8`` (a recipe of :mod:`parcompile.runtime.model.fp8`; None: ``F.linear`` in the model dtype):
    its forward and backward GEMMs in FP8 as a dense FP8 linear's (:func:`fp8_linear`), with
    the group as the GEMM: ``tensorwise`` one scale per expert weight and one per group's
    input and output gradient (Transformer Engine's ``GroupedLinear``: an FP8 GEMM with its
    own scales per expert); ``rowwise`` one power-of-two scale per row of the group's rows
    and per row of the expert's weight along each GEMM's reduction dimension, the weight
    gradient's per column over the group's rows, as torchao's FP8 grouped GEMM
    (``torchao/prototype/moe_training/fp8_grouped_mm.py``, ``_Float8GroupedMM`` at pytorch/ao
    36027d82: A rowwise, B_t per expert and output column, ``grad_B`` from per-group
    column-wise scales of the output gradient and A, ``round_scales_to_power_of_2=True``,
    E4M3 everywhere); ``mxfp8`` 32-element blocks along each GEMM's reduction dimension, the
    weight gradient's along the group's rows (zero-padded to whole blocks), as Transformer
    Engine's ``GroupedLinear`` under ``MXFP8BlockScaling`` (local scales: nothing all-reduced).
    ``axis`` and ``split``: expert_tp and how it splits the matrix
    (``"column"``: w1, w3; ``"row"``: w2), whose amaxes are all-reduced over it. The weight
    gradient is never deferred (a zero-bubble step defers the dense layers' only, as in 16
    bits). The router stays 16-bit/fp32 (not an expert GEMM)."""
    if fp8:
        return fp8_linear(x, weight, bias, fp8, axis, split, deferrable=False, routed=True)
    return F.linear(x, weight, bias)


#: the layout attributes of a tensor (:func:`parcompile.runtime.model.layers.make_param`)
_LAYOUT = ("global_name", "shard_dim", "shard_index", "num_shards", "global_shape", "valid_rows")


class Router(nn.Module):
    """The router of one MoE layer (module docstring, step 1), the same in training
    (the generated programs' MoE class, training and serving):
    tokens (..., h) -> :func:`route`'s (weights (N, k), experts (N, k), balance scores
    (N, E)) over their N.

    Tensors, replicated: ``{name}.weight`` (E, h) parameter (``name``: ``layers.<i>.mlp.router``;
    ``local``: its shape as the program read it off the graph, checked); ``.bias`` (E,) with
    ``router_bias`` (gpt-oss); with ``topk_method = "noaux_tc"`` the persistent buffer
    ``{name}.e_score_correction_bias`` (E,), fp32 under any model dtype, zeros
    until loaded (HF weights, DCP checkpoints: it carries the layout attributes that
    :func:`parcompile.runtime.state.weights.layout_tensors` finds). It is not a parameter: no
    gradient, no optimizer, held fixed in training (DeepSeek-V3's bias update between steps
    is not modelled). ``n_group``/``topk_group`` apply with ``noaux_tc`` only (``greedy``:
    a plain top-k).
    """

    def __init__(self, name: str, hidden: int, num_experts: int, top_k: int, tp: Axis, seed: int,
                 norm_topk_prob: bool = True, router_bias: bool = False, scoring_func: str = "softmax",
                 topk_method: str = "greedy", n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, local: tuple[int, int] | None = None):
        super().__init__()
        if topk_method not in ("greedy", "noaux_tc"):
            raise ValueError(f"topk_method must be greedy or noaux_tc, got {topk_method!r}")
        if topk_method == "noaux_tc" and (num_experts % n_group or num_experts // n_group < 2
                                          or not 1 <= topk_group <= n_group):
            raise ValueError(f"noaux_tc needs n_group ({n_group}) dividing experts ({num_experts}) into groups "
                             f"of 2 or more, and 1 <= topk_group ({topk_group}) <= n_group")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.scoring_func, self.topk_method = scoring_func, topk_method
        grouped = topk_method == "noaux_tc"
        self.n_group, self.topk_group = (n_group, topk_group) if grouped else (1, 1)
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = make_param(f"{name}.weight", (num_experts, hidden), seed, INIT_STD, tp, None)
        if local is not None and tuple(local) != tuple(self.weight.shape):
            raise ValueError(f"{name}: the program expects a {tuple(local)} router weight, the model makes "
                             f"{tuple(self.weight.shape)}")
        self.bias = make_param(f"{name}.bias", (num_experts,), seed, 0, tp, None) if router_bias else None
        if grouped:
            b = torch.zeros(num_experts, dtype=torch.float32)
            _set_layout(b, f"{name}.e_score_correction_bias")
            self.register_buffer("e_score_correction_bias", b, persistent=True)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = x.reshape(-1, x.shape[-1])                    # (N, h): every token of the rank
        rb = None if self.bias is None else self.bias.float()
        return route(F.linear(x.float(), self.weight.float(), rb), self.top_k, self.norm_topk_prob,
                     self.scoring_func, self.e_score_correction_bias, self.n_group, self.topk_group,
                     self.routed_scaling_factor)

    def _apply(self, fn, recurse=True):
        # module.to(dtype=bf16) would cast the buffer (and drop its layout attributes with the
        # old tensor): it follows the device only, stays fp32 and keeps its layout
        b = self._buffers.get("e_score_correction_bias")
        out = super()._apply(fn, recurse)
        if b is not None:
            kept = b.to(device=self._buffers["e_score_correction_bias"].device)   # b itself if unmoved
            if kept is not b:
                _copy_layout(b, kept)
            self._buffers["e_score_correction_bias"] = kept
        return out


def _set_layout(t: torch.Tensor, name: str) -> None:
    """The layout attributes of a replicated global tensor ``name`` on ``t``."""
    t.global_name, t.shard_dim, t.shard_index, t.num_shards = name, None, 0, 1
    t.global_shape, t.valid_rows = tuple(t.shape), None


def _copy_layout(src: torch.Tensor, dst: torch.Tensor) -> None:
    for a in _LAYOUT:
        setattr(dst, a, getattr(src, a))


@dataclasses.dataclass
class Routed:
    """The (token, expert) rows one rank's experts run, between :func:`dispatch` and
    :func:`combine`: ``rows`` (R, h) grouped by local expert, ``per_expert`` rows per local
    expert (R in all: routing decides it; the graph's local type is the balanced estimate),
    and how they came (what :func:`combine` undoes): ``order`` the sort of this rank's
    N * k (token, choice) rows by expert, ``group`` the arrival order -> grouped by local
    expert, ``send``/``recv`` rows per ep rank, ``member_rows`` rows per expert_tp rank
    (None: no gather), ``ep``/``expert_tp`` the axes the rows crossed (None: none), ``shape``
    the tokens' (B, T, h)."""

    rows: torch.Tensor
    per_expert: list[int]
    order: torch.Tensor
    group: torch.Tensor
    send: list[int]
    recv: list[int]
    member_rows: list[int] | None
    ep: Axis | None
    expert_tp: Axis | None
    shape: torch.Size


def dispatch(x: torch.Tensor, route: tuple[torch.Tensor, torch.Tensor, torch.Tensor], local_experts: int,
             ep: Axis | None = None, expert_tp: Axis | None = None, probs_on_input: bool = False) -> Routed:
    """Token dispatch (module docstring, step 3; Megatron-Core's all-to-all token dispatcher):
    tokens ``x`` (B, T, h) and their :class:`Router` choice -> the :class:`Routed` rows of
    this rank's ``local_experts`` experts (the program's, off the sharded graph: ep rank r
    holds experts ``[r * local_experts, (r + 1) * local_experts)``).

    ``ep``: the all-to-alls over ep (the per-expert counts, E int64, then the rows with
    uneven splits), where the graph's dispatch runs them (None: every expert is here);
    ``expert_tp``: the all-gather over expert_tp of the received counts and rows (None:
    none). Backward: the reduce-scatter over expert_tp, the reverse all-to-all (N * k rows,
    exact). ``probs_on_input`` (Llama 4: transformers 5.25 Llama4TextMoe, Megatron-Core's
    ``moe_apply_probs_on_input``): each row times its router weight, in x's dtype, before it
    leaves (:func:`combine` then sums unweighted).

    Raises:
        ValueError: ``local_experts`` (times ep) is not the router's expert count.
    """
    weights, chosen, balance = route
    shape = x.shape
    x = x.reshape(-1, shape[-1])                      # (N, h)
    N, K = chosen.shape
    E = balance.shape[-1]
    ranks = ep.size if ep is not None else 1
    if local_experts * ranks != E:
        raise ValueError(f"the program's {local_experts} experts per rank x {ranks} ep rank(s) is not the "
                         f"router's {E} experts")
    flat = chosen.reshape(-1)                         # (N k,) expert of each assignment
    order = torch.argsort(flat, stable=True)
    token = torch.arange(N, device=x.device).repeat_interleave(K)[order]
    rows = x.index_select(0, token)                   # (N k, h) sorted by expert
    if probs_on_input:
        rows = rows * weights.reshape(-1)[order].to(rows.dtype).unsqueeze(-1)
    counts = torch.bincount(flat, minlength=E).to(COUNT_DTYPE)
    send = counts.view(ranks, local_experts).sum(1).tolist()
    if ep is not None:
        recv_counts = _exchange_counts(counts, ep)    # (ep * E/ep,): per source, per local expert
        recv = recv_counts.view(ranks, local_experts).sum(1).tolist()
        rows = _AllToAll.apply(rows, recv, send, ep, True, False)   # (R, h); backward exact N k
    else:
        recv_counts, recv = counts, send
    blocks = recv_counts.view(-1, local_experts)      # (sources, local experts)
    member_rows = None
    if expert_tp is not None:
        all_counts = _gather_counts(recv_counts, expert_tp)
        member_rows = all_counts.view(expert_tp.size, -1).sum(1).tolist()
        rows = _GatherRows.apply(rows, member_rows, expert_tp)   # (sum of R over expert_tp, h)
        blocks = all_counts.view(-1, local_experts)
    # group the received rows by local expert (they arrive by source, then expert)
    label = torch.arange(local_experts, device=x.device).repeat(blocks.shape[0])
    label = label.repeat_interleave(blocks.reshape(-1).to(x.device))
    group = torch.argsort(label, stable=True)
    return Routed(rows.index_select(0, group), blocks.sum(0).tolist(), order, group, send, recv, member_rows,
                  ep, expert_tp, shape)


class GroupedExperts(nn.Module):
    """The expert MLPs one rank holds (module docstring, step 4): :class:`Routed` rows in,
    the same rows' outputs out (partial sums over expert_tp), each local expert's MLP on its
    group (a grouped GEMM, here a loop).

    ``local``: the per-rank shape of the stacked w1 the program read off the sharded graph,
    (experts held, expert ffn / expert_tp, h); ep rank r holds experts
    ``[r * local[0], (r + 1) * local[0])``. Parameters per local expert e:
    ``{name}.{e}.w1.weight`` (ffn/expert_tp, h) [and w3], ``{name}.{e}.w2.weight``
    (h, ffn/expert_tp), marked ``expert = True`` (reduced over expert_dp); with ``bias``
    (gpt-oss) their biases, w1's and w3's split like their rows, w2's added by expert_tp
    rank 0 only (so the sum over expert_tp holds it once). ``activation``: swiglu or geglu (w1 the gate, w3 the up
    projection; ``swiglu_clamp`` (alpha, limit): gpt-oss's clamped SwiGLU), gelu or relu. ``fp8``: the FP8 recipe of the expert GEMMs (:func:`expert_linear`;
    None: 16-bit).

    Raises:
        ValueError: ``local`` disagrees with the experts and the shards this rank makes.
    """

    def __init__(self, name: str, num_experts: int, hidden: int, ffn: int, activation: str, axes: ExpertAxes,
                 seed: int, out_std: float, local: tuple[int, int, int], bias: bool = False,
                 swiglu_clamp: tuple[float, float] | None = None, fp8: str | None = None,
                 recompute_act: bool = False):
        super().__init__()
        self.activation, self.swiglu_clamp = activation, swiglu_clamp
        self.recompute_act = recompute_act   # parallel.recompute's moe_act (_expert)
        self.axes, self.fp8 = axes, fp8
        ep, etp = axes.ep, axes.expert_tp
        self.local = local[0]
        if self.local * ep.size != num_experts:
            raise ValueError(f"{name}: the program expects {self.local} experts per ep rank, the layout holds "
                             f"{num_experts} experts on {ep.size} ep rank(s)")
        self.first = ep.index * self.local
        self.w2_bias_here = etp.index == 0
        mats = ("w1", "w3", "w2") if activation in GATED else ("w1", "w2")
        for e in range(self.first, self.first + self.local):
            mod = nn.Module()
            for w in mats:
                shape, dim, std = ((hidden, ffn), 1, out_std) if w == "w2" else ((ffn, hidden), 0, INIT_STD)
                p = make_param(f"{name}.{e}.{w}.weight", shape, seed, std, etp, dim)
                p.expert = True
                setattr(mod, w, p)
                b = None
                if bias:
                    b = make_param(f"{name}.{e}.{w}.bias", (shape[0],), seed, 0, etp, None if w == "w2" else 0)
                    b.expert = True
                setattr(mod, f"{w}_bias", b)
            self.add_module(str(e), mod)   # {name}.{e}.*: the expert's own names
        got = tuple(self._modules[str(self.first)].w1.shape)
        if got != tuple(local[1:]):
            raise ValueError(f"{name}: the program expects w1 shards of {tuple(local[1:])}, the layout makes {got}")

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        mod = self._modules[str(e)]
        etp, f8 = self.axes.expert_tp, self.fp8

        def up(w: str) -> torch.Tensor:   # w1 / w3: column-parallel over expert_tp
            return expert_linear(x, getattr(mod, w), getattr(mod, f"{w}_bias"), f8, etp, "column")

        ups = (up("w1"), up("w3")) if self.activation in GATED else (up("w1"),)
        # moe_act (recompute_act): the activation's output freed once w2 has saved it, rebuilt
        # before w2's backward (runtime/model/discard.py, Megatron-Core's CheckpointWithoutOutput)
        act = discarding(self._act, *ups) if self.recompute_act else None
        h = act.out if act is not None else self._act(*ups)
        # partial sums over expert_tp
        y = expert_linear(h, mod.w2, mod.w2_bias if self.w2_bias_here else None, f8, etp, "row")
        if act is not None:
            act.discard(y)
        return y

    def _act(self, *ups: torch.Tensor) -> torch.Tensor:
        """The experts' activation of w1's (and w3's) outputs."""
        if self.activation == "swiglu" and self.swiglu_clamp is not None:
            return clamped_swiglu(*ups, *self.swiglu_clamp)
        if self.activation in GATED:   # w1 the gate, w3 the up projection
            return GATED[self.activation](*ups)
        return ACTIVATIONS[self.activation](*ups)

    def forward(self, routed: Routed) -> Routed:
        if len(routed.per_expert) != self.local:
            raise ValueError(f"rows of {len(routed.per_expert)} experts dispatched to {self.local} local experts")
        outs, start = [], 0
        for j, n in enumerate(routed.per_expert):
            # under FP8 every local expert runs, an empty group too: its casts' amax all-reduces
            # over expert_tp are then the plan's for any routing (analysis/fp8.py
            # amax_collectives); in 16 bits an empty group runs nothing (no collective)
            if n or self.fp8:
                outs.append(self._expert(self.first + j, routed.rows[start:start + n]))
            start += n
        # no rows at all: an empty y that still hangs off the received rows, so that the
        # backward runs this rank's half of the all-to-all the other ranks run (a fresh tensor
        # would cut the graph and leave them waiting)
        y = torch.cat(outs) if outs else routed.rows * 0
        return dataclasses.replace(routed, rows=y)


def combine(routed: Routed, route: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
            aux_loss_scale: float = 0.0, probs_on_input: bool = False) -> torch.Tensor:
    """Combine (module docstring, step 5): the experts' :class:`Routed` outputs back to their
    tokens, (B, T, h): reduce-scattered over expert_tp and returned by all-to-all over ep
    where :func:`dispatch` sent them (backward: all-to-all, all-gather), then each token's
    router-weighted sum over its k choices (``probs_on_input``: the plain sum, :func:`dispatch`
    weighted the inputs). ``aux_loss_scale`` > 0 (training): the
    load-balancing loss's gradient joins the backward (step 2, :class:`_AuxLossScaler`)."""
    weights, chosen, balance = route
    y = routed.rows.index_select(0, torch.argsort(routed.group))   # back to arrival order
    if routed.expert_tp is not None:
        y = _ScatterRows.apply(y, routed.member_rows, routed.expert_tp)   # (R, h): summed over expert_tp
    if routed.ep is not None:
        y = _AllToAll.apply(y, routed.send, routed.recv, routed.ep, False, True)   # (N k, h); backward routed
    # back to (token, choice) order, then the router-weighted sum over the k choices
    # (backward keeps y and the weights, not a second (N k, h) product)
    N, K = chosen.shape
    y = y.index_select(0, torch.argsort(routed.order)).view(N, K, -1)
    out = y.sum(1) if probs_on_input else (y * weights.to(y.dtype).unsqueeze(-1)).sum(1)
    if aux_loss_scale:
        out = _AuxLossScaler.apply(out, load_balancing_loss(balance, chosen, balance.shape[-1]), aux_loss_scale)
    return out.view(routed.shape)


# --------------------------------------------------------------------------- optimizer side


__all__ = ["ExpertAxes", "GroupedExperts", "Routed", "Router", "combine", "dispatch",
           "expert_linear", "load_balancing_loss", "route"]
