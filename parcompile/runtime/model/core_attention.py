"""The attention core of generated programs: training's (:func:`attention`,
:func:`attention_core`: torch's fused SDPA or the softmax spelt out, with context
parallelism's k/v gather and selective recomputation) and the math both it and serving
(runtime/serve/generate.py ``cached_attention``) spell out once (:func:`spelled_out`). Which kernel
runs is the program's row's (``fused=``: the attention op's one decision,
parcompile/ir/ops/attention.py ``attention_kernel_for``); nothing here decides it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parcompile.runtime.distributed.context import Axis
from parcompile.runtime.distributed.context_parallel import gather_kv as gather_kv_along
from parcompile.runtime.model.layers import wide
from parcompile.runtime.model.layers import recompute as _recompute   # attention()'s flag of the same name shadows it


#: a window or chunk at least this long (2^62 tokens) spans every position an int64 holds: the
#: masks compare with it instead of a longer one, which torch cannot convert (OverflowError)
_UNBOUNDED = 2 ** 62


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, chunk: int = 0) -> torch.Tensor:
    """Boolean (Tq, Tk) mask, True where a query at position i may attend a key at j: j <= i,
    i - j < window with a sliding window, i // chunk == j // chunk with ``chunk`` (Llama 4's
    chunked attention, transformers' ``chunked_causal_mask``). A window or chunk longer than
    any position (a spec may write 10**30) masks as :data:`_UNBOUNDED`: the same mask."""
    i, j = q_pos[:, None], k_pos[None, :]
    window, chunk = min(window or 0, _UNBOUNDED), min(chunk or 0, _UNBOUNDED)
    keep = j <= i
    if window:
        keep &= (i - j) < window
    return keep & (i // chunk == j // chunk) if chunk else keep


class _Softmax(torch.autograd.Function):
    """Softmax over the last dim computed in fp32, returned and kept for backward in the
    input's dtype (Megatron-LM's fused scale-mask-softmax keeps 16-bit probabilities)."""

    @staticmethod
    def forward(ctx, scores):
        probs = torch.softmax(wide(scores), dim=-1).to(scores.dtype)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad_out):
        (probs,) = ctx.saved_tensors
        p, g = wide(probs), wide(grad_out)
        return (p * (g - (g * p).sum(-1, keepdim=True))).to(probs.dtype)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's logit soft-capping ``cap * tanh(x / cap)``, elementwise, any shape, in
    ``x``'s dtype (transformers' ``Gemma2ForCausalLM`` and ``eager_attention_forward``):
    the values stay within (-cap, cap). Keeps only its output for backward (d/dx = 1 - (y /
    cap)^2), as the op table counts it (ir/ops/dense.py ``softcap``)."""
    return _SoftCap.apply(x, float(cap))


class _SoftCap(torch.autograd.Function):
    """:func:`softcap`, saving its output only (torch's composite would keep tanh's output
    beside it)."""

    @staticmethod
    def forward(ctx, x, cap: float):
        y = torch.tanh(x / cap) * cap
        ctx.save_for_backward(y)
        ctx.cap = cap
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        t = y / ctx.cap
        return grad * (1 - t * t), None


def check_fused(fused: bool, sinks, softcap) -> None:
    """Refuse torch's fused SDPA for what it cannot apply (sink logits, a soft-cap): the
    kernel is decided once, by the program's row (parcompile/ir/ops/attention.py
    ``attention_kernel_for``), and never changed here."""
    if fused and (sinks is not None or softcap is not None):
        raise ValueError("fused attention asked for with " + ("sinks" if sinks is not None else "a soft-cap")
                         + ": torch's SDPA applies neither; the program's kernel choice runs these unfused")


def spelled_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *, scale: float | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None, dropout: float = 0.0,
                training: bool = False, expand_kv: bool = False) -> torch.Tensor:
    """The attention math, spelt out once for training (:func:`attention_core`) and serving
    (:func:`parcompile.runtime.serve.generate.cached_attention`): ``softmax(mask(cap(q k^T *
    scale)) [, sink]) v``. q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv), ``keep``
    a boolean mask (True: attend) of shape (Tq, Tk) or (B, 1, Tq, Tk) -> (B, Hq, Tq, Dv).

    ``scale`` None: 1 / sqrt(D). ``softcap``: Gemma 2's ``cap * tanh(scores / cap)`` before the
    mask (:func:`softcap`, keeping its output). ``sinks`` (Hq,): one more logit per query head
    in each softmax's denominator, dropped after it (gpt-oss). The softmax runs in fp32 and
    returns (and keeps for backward) the scores' dtype (:class:`_Softmax`, Megatron-LM's
    fused scale-mask-softmax), then dropout (``dropout`` when ``training``).

    GQA: by default each kv head multiplies its group of Hq / Hkv query heads at once, so
    backward keeps k and v at their own size (training); ``expand_kv`` repeats k and v to Hq
    heads first (serving: the products then round as transformers' eager ``repeat_kv``
    attention's, which serving's greedy tokens are compared with). The mask is an additive
    bias where autograd records (it keeps nothing for backward; ``masked_fill`` would keep the
    mask), ``masked_fill`` elsewhere: the same values."""
    B, hq, Tq, D = q.shape
    hkv, Tk = k.shape[1], k.shape[2]
    rep = hq // hkv
    if expand_kv:
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-2, -1)                                             # (B, Hq, Tq, Tk)
    else:
        scores = (q.reshape(B, hkv, rep * Tq, D) @ k.transpose(-2, -1)).view(B, hkv, rep, Tq, Tk)
        keep = keep.unsqueeze(2) if keep.dim() == 4 else keep                      # (B, 1, 1, Tq, Tk)
    scores = scores * (scale if scale is not None else D ** -0.5)
    if softcap is not None:
        scores = _SoftCap.apply(scores, float(softcap))
    if torch.is_grad_enabled():
        scores = scores + torch.zeros(keep.shape, dtype=scores.dtype, device=q.device).masked_fill(~keep, float("-inf"))
    else:
        scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:   # one more column per query head, dropped after the softmax
        sink = sinks.to(scores.dtype).view(1, *scores.shape[1:-2], 1, 1).expand(*scores.shape[:-1], 1)
        probs = _Softmax.apply(torch.cat([scores, sink], dim=-1))[..., :-1]
    else:
        probs = _Softmax.apply(scores)
    probs = F.dropout(probs, dropout if training else 0.0, training)
    if expand_kv:
        return probs @ v
    return (probs.view(B, hkv, rep * Tq, Tk) @ v).view(B, hq, Tq, v.shape[-1])   # MLA: v's head width


def attention_core(q, k, v, fused: bool, dropout: float, training: bool, window: int,
                   q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
                   scale: float | None = None, sinks: torch.Tensor | None = None,
                   softcap: float | None = None, chunk: int = 0) -> torch.Tensor:
    """softmax(q k^T * scale) v, causal (``window``, ``chunk``: :func:`causal_mask`); ``scale`` None: 1 / sqrt(d) (Gemma's is
    ``query_pre_attn_scalar ** -0.5``). q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D) -> (B, Hq, Tq, D).

    ``softcap`` (Gemma 2's ``attn_logit_softcapping``): the scaled scores become ``cap *
    tanh(scores / cap)`` before the mask and softmax; torch's SDPA cannot cap, so the
    softmax is spelt out (the program's kernel choice, parcompile/ir/ops/attention.py
    ``attention_kernel_for``, passes ``fused=False``), keeping the capped scores
    (:func:`softcap`) beside the probabilities.

    ``sinks`` (Hq,): one logit per query head added to each softmax's denominator and
    dropped after it (gpt-oss; Xiao et al. 2023, "Efficient Streaming Language Models with
    Attention Sinks"). torch's fused kernels take no sinks, so with sinks the softmax is
    spelt out (the program passes ``fused=False``, the plan counts it so).

    GQA: each group of Hq/Hkv query heads shares one kv head; k and v are never expanded
    to Hq heads (the fused kernel's ``enable_gqa``; the unfused path multiplies each kv head
    with its group of query heads at once), so backward keeps them at their own size.
    ``q_pos``/``k_pos`` are the tokens' positions in the sequence when they are not 0..T-1
    (context parallelism). ``fused`` uses torch's ``scaled_dot_product_attention`` (flash
    kernels: it keeps q, k, v, its output and an fp32 log-sum-exp per query and head);
    otherwise the softmax is spelt out and its (B, Hq, Tq, Tk) probabilities are kept, as
    Megatron-LM 2021-22 did. The kernel is the caller's (the program's row): this function
    decides none.

    Raises:
        ValueError: ``fused`` with sinks or a soft-cap (torch's SDPA applies neither).
    """
    check_fused(fused, sinks, softcap)
    rep = q.shape[1] // k.shape[1]
    p = dropout if training else 0.0
    plain = q_pos is None and (not window or window >= q.shape[2]) and (not chunk or chunk >= q.shape[2])
    if q_pos is None:
        q_pos = torch.arange(q.shape[2], device=q.device)
        k_pos = torch.arange(k.shape[2], device=q.device)
    gqa = {"enable_gqa": True} if rep > 1 else {}
    if scale is not None:
        gqa["scale"] = scale
    if fused:
        if plain:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, **gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q_pos, k_pos, window, chunk),
                                              dropout_p=p, **gqa)
    return spelled_out(q, k, v, causal_mask(q_pos, k_pos, window, chunk), scale=scale, softcap=softcap, sinks=sinks,
                       dropout=dropout, training=training)


def _padded_core(q, k, v, *, fused: bool, **kw) -> torch.Tensor:
    """:func:`attention_core`; a v narrower than q and k (MLA: v_head_dim < n + r) is
    zero-padded for the fused kernel, which takes one head width, and the output cut back
    (vLLM's MLA on FlashAttention 2: the kernel keeps the padded v and output, as the plan
    counts them: ir/ops/attention.py)."""
    d, dv = q.shape[-1], v.shape[-1]
    if fused and dv < d:
        return attention_core(q, k, F.pad(v, (0, d - dv)), fused=True, **kw)[..., :dv]
    return attention_core(q, k, v, fused=fused, **kw)


def attention(q, k, v, *, fused: bool, dropout: float, training: bool, window: int, pos,
              gather_kv: Axis | None = None, recompute: bool = False, scale: float | None = None,
              sinks: torch.Tensor | None = None, softcap: float | None = None, chunk: int = 0) -> torch.Tensor:
    """The attention core on per-head tensors: q (B, T, Hq, D), k (B, T, Hkv, D), v (B, T,
    Hkv, Dv) -> (B, T, Hq * Dv) (Dv < D: MLA, :func:`_padded_core`), causal, at the positions ``pos`` (:class:`~parcompile.runtime.distributed.context_parallel.Positions`).

    ``gather_kv``: context parallelism, k and v all-gathered over that axis (backward:
    reduce-scattered) before the core; ``recompute``: selective recomputation
    (Korthikanti et al. 2022), the core keeps only its inputs and runs again in backward.
    The generated program passes both from the sharded graph (the op's collectives, the
    pass's ``recompute`` mark). See :func:`attention_core` for the rest (``chunk``: Llama 4's)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if gather_kv is not None:
        k, v = gather_kv_along(k, gather_kv), gather_kv_along(v, gather_kv)
    kw = dict(fused=fused, dropout=dropout, training=training, window=window, q_pos=pos.q, k_pos=pos.k,
              scale=scale, sinks=sinks, softcap=softcap, chunk=chunk)
    y = _recompute(_padded_core, q, k, v, **kw) if recompute else _padded_core(q, k, v, **kw)
    return y.transpose(1, 2).flatten(2)


__all__ = ["attention", "attention_core", "causal_mask", "check_fused", "softcap", "spelled_out"]
