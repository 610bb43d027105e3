"""Multi-head latent attention (MLA; DeepSeek-AI 2024, "DeepSeek-V2", section 2.1; DeepSeek-V3)
for the training and serving programs, laid out as the plan's graph lays it out
(:func:`parcompile.ir.lower.lower`, ``mla``).

Per token, with ``H`` heads (``H/tp`` per rank), ``n`` = qk_nope_head_dim, ``r`` =
qk_rope_head_dim, ``v`` = v_head_dim, ``c`` = kv_lora_rank, ``c_q`` = q_lora_rank::

    q      = wq_b(q_a_norm(wq_a(x)))            (H, n + r)   [wq(x) when c_q = 0]
    latent = wkv_a(x) = [kv, k_rope]            (c + r,)
    kv     = wkv_b(kv_a_norm(latent[:c]))       (H, n + v): k_nope, value per head
    k      = [k_nope, rope(latent[c:])]         the RoPE key (r,) shared by every head
    q      = [q[:n], rope(q[n:])]
    y      = softmax(q k^T * scale) value, causal; out = wo(y)

Tensor parallelism (Megatron-Core's MLASelfAttention): wq_a, wkv_a and the two latent norms
are replicated (whole on every rank); wq_b and wkv_b column-parallel by heads; wo
row-parallel. The training program runs these ops one by one as the graph's op table writes
them (:mod:`parcompile.ir.ops.mla`: runtime/model/layers.py ``rope_tail``, ``rope_key``,
``mla_key``); this module holds the down projections' module and the serving form.

``interleave`` (HF ``rope_interleave``, DeepSeek's checkpoints): the RoPE dims of q and of
the key are pairs (x0, x1), (x2, x3), ...; they are read as the halves [x0, x2, ...,
x1, x3, ...] and rotated as Llama's ("rotate half"), the same rotation transformers'
``apply_rotary_pos_emb_interleave`` computes, so the weights map one to one.

Serving (the serving graph's absorbed form, :func:`parcompile.ir.lower.mla_absorbed`;
DeepSeek-V2 section 2.1.1 and appendix B, vLLM's MLA backend) caches, per token and layer,
the normed latent and the rotated RoPE key (``c + r`` values, the same on every tp rank:
vLLM's and SGLang's MLA cache) and attends in the latent space: each head's query
``q_nope`` is multiplied by its slice of wkv_b's key rows (``W_uk``,
:func:`mla_absorb_query`), the scores are ``[q_nope W_uk, q_rope] . [latent, k_rope]``
(:func:`latent_attention`), and the weighted latents are multiplied by the value rows
(``W_uv``, :func:`mla_value_up`): exactly the eager result up to rounding, without
materialising per-head keys and values of the whole cache. Every function takes the
per-rank sizes the program read off the sharded graph and checks them against its tensors
and weights; none derives one.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parcompile.runtime.distributed.context import Axis
from parcompile.runtime.serve.generate import apply_rope_at, by_group, cached_attention, write_step
from parcompile.runtime.model.layers import INIT_STD, deinterleave, make_param
from parcompile.runtime.model.fp8 import fp8_linear
from parcompile.runtime.train.wgrad import linear


class ReplicatedLinear(nn.Module):
    """y = x W^T (+ b), W (out, in) whole on every tp rank: (..., in) -> (..., out)."""

    def __init__(self, name: str, in_features: int, out_features: int, bias: bool, tp: Axis, seed: int,
                 std: float = INIT_STD, *, fp8: str | None = None):
        super().__init__()
        self.fp8 = fp8   # the FP8 recipe of its GEMMs (runtime/model/fp8.py; None: 16-bit)
        self.weight = make_param(f"{name}.weight", (out_features, in_features), seed, std, tp, None)
        self.bias = make_param(f"{name}.bias", (out_features,), seed, 0, tp, None) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            return fp8_linear(x, self.weight, self.bias, self.fp8, None, "replicated")
        return linear(x, self.weight, self.bias)


def _check(what: str, got, want) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"{what}: the program expects {tuple(want)}, got {tuple(got)}")


def rope_tail_at(x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
                 interleave: bool = False) -> torch.Tensor:
    """Serving's :func:`~parcompile.runtime.model.layers.rope_tail`: RoPE at per-sequence positions
    (cos/sin (B, T, r): :func:`parcompile.runtime.serve.generate.apply_rope_at`) on the dims of each
    head from ``start`` on: x (B, T, H, start + r) -> same (MLA's query)."""
    tail = x[..., start:]
    return torch.cat([x[..., :start], apply_rope_at(deinterleave(tail) if interleave else tail, cos, sin)], dim=-1)


def rope_key_at(x: torch.Tensor, rope_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                interleave: bool = False) -> torch.Tensor:
    """Serving's :func:`~parcompile.runtime.model.layers.rope_key`: the last ``rope_dim``
    features of wkv_a's output x (B, T, c + r) as one head, rotated at per-sequence
    positions (cos/sin (B, T, r)) -> (B, T, 1, r)."""
    tail = x[..., x.shape[-1] - rope_dim:]
    return apply_rope_at((deinterleave(tail) if interleave else tail).unsqueeze(-2), cos, sin)


def mla_absorb_query(q: torch.Tensor, weight: torch.Tensor, *, heads: int, nope: int, v_dim: int,
                     latent: int) -> torch.Tensor:
    """The absorbed query of MLA (module docstring): q (B, T, H, n + r) of this rank's
    ``heads`` (RoPE applied to the last r), ``weight`` this rank's rows of wkv_b (H (n + v),
    c) -> (B, T, H, c + r) = [q_nope W_uk, q_rope], W_uk each head's first n rows.

    ``heads``, ``nope`` (n), ``v_dim`` (v), ``latent`` (c): the program's per-rank sizes
    (the sharded graph's), checked against q and the weight.

    Raises:
        ValueError: q or the weight is not of those sizes."""
    _check("wkv_b's rows on this rank (H (n + v), c)", weight.shape, (heads * (nope + v_dim), latent))
    _check("the absorbed query's heads", q.shape[-2:-1], (heads,))
    w_uk = weight.view(heads, nope + v_dim, latent)[:, :nope]                    # (H, n, c)
    q_latent = torch.einsum("bthn,hnc->bthc", q[..., :nope], w_uk)                # (B, T, H, c)
    return torch.cat([q_latent, q[..., nope:]], dim=-1)                          # (B, T, H, c + r)


def latent_attention(q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, pos, window: int, *,
                     heads: int, fused: bool, scale: float, softcap: float | None = None) -> torch.Tensor:
    """MLA's absorbed attention core over the latent cache (module docstring): q (B, T, H,
    c + r) absorbed queries of this rank's ``heads``; latent (B, T, 1, c) and k_rope (B, T,
    1, r) of the step's tokens, written into ``pos.cache`` (a
    :class:`~parcompile.runtime.serve.generate.LayerStep`; the cache keeps the latent as its keys
    and the RoPE key as its values) -> (B, T, H, c): each head's softmax over ``[latent,
    k_rope]`` of the cache so far (the step's mask for ``window``) times the latents.
    A packed step's tensors are (1, N, ...) (:func:`~parcompile.runtime.serve.generate.by_group`
    runs each group of rows padded alike). ``scale``: the query's (n + r) softmax scale,
    not the latent key's width. ``softcap``:
    the scores capped as :func:`~parcompile.runtime.serve.generate.cached_attention` caps them
    (the absorbed scores are the attention's own: absorption reorders the products only).

    Raises:
        ValueError: q holds other than ``heads`` heads, or q's width is not c + r."""
    H, d = q.shape[-2:]
    c, r = latent.shape[-1], k_rope.shape[-1]
    _check("the latent attention's heads and width (H, c + r)", (H, d), (heads, c + r))

    def core(where, masks, q, latent, k_rope):
        B, T = q.shape[:2]
        lat, kr = pos.cache.store(pos.layer, latent.transpose(1, 2), k_rope.transpose(1, 2), where)
        keys = torch.cat([lat, kr], dim=-1)                                      # (B, 1, L, c + r)
        # one latent "kv head" shared by every query head: the heads' queries as rows of one
        # (no copy of the cache per head), each row with its token's mask
        mask = masks[window].repeat(1, 1, H, 1)                                  # (B, 1, H T, L)
        y = cached_attention(q.transpose(1, 2).reshape(B, 1, H * T, d), keys, lat, mask, fused, scale=scale,
                             softcap=softcap)
        return y.view(B, H, T, c).transpose(1, 2)                                # (B, T, H, c)

    write_step(pos, latent, k_rope)
    return by_group(pos.step, core, q, latent, k_rope)


def mla_value_up(y: torch.Tensor, weight: torch.Tensor, *, heads: int, nope: int, v_dim: int,
                 latent: int) -> torch.Tensor:
    """The absorbed output of MLA: y (B, T, H, c) each head's weighted latents, ``weight``
    this rank's rows of wkv_b (H (n + v), c) -> (B, T, H v) = y W_uv^T per head, W_uv each
    head's last v rows. Sizes as :func:`mla_absorb_query` (checked).

    Raises:
        ValueError: y or the weight is not of those sizes."""
    _check("wkv_b's rows on this rank (H (n + v), c)", weight.shape, (heads * (nope + v_dim), latent))
    _check("the latent attention's output (H, c)", y.shape[-2:], (heads, latent))
    w_uv = weight.view(heads, nope + v_dim, latent)[:, nope:]                    # (H, v, c)
    return torch.einsum("bthc,hvc->bthv", y, w_uv).flatten(-2)                  # (B, T, H v)


__all__ = ["ReplicatedLinear", "deinterleave", "latent_attention", "mla_absorb_query",
           "mla_value_up", "rope_key_at", "rope_tail_at"]
