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
row-parallel. The latents entering the column-parallel projections, and the RoPE key
entering the heads, are replicated with gradients that are partial sums over tp (each rank
holds some heads): three all-reduces in backward (:func:`copy_to_tp`), as the plan's
``insert-collectives`` places them. With sequence parallelism the residual stream is
all-gathered before the down projections; their input gradient is then whole, so the
backward keeps this rank's slice (:func:`gather_replicated`).

``interleave`` (HF ``rope_interleave``, DeepSeek's checkpoints): the RoPE dims of q and of
the key are pairs (x0, x1), (x2, x3), ...; they are read as the halves [x0, x2, ...,
x1, x3, ...] and rotated as Llama's ("rotate half"), the same rotation transformers'
``apply_rotary_pos_emb_interleave`` computes, so the weights map one to one.

Serving (:meth:`MLAttention.serve`) caches, per token and layer, the normed latent and the
rotated RoPE key (``c + r`` values, the same on every tp rank: vLLM's and SGLang's MLA
cache) and attends in the latent space: each head's query ``q_nope`` is multiplied by its
slice of wkv_b's key rows (``W_uk``), the scores are ``[q_nope W_uk, q_rope] . [latent,
k_rope]``, and the weighted latents are multiplied by the value rows (``W_uv``): DeepSeek-V2
appendix's absorbed attention, exactly the eager result up to rounding, without
materialising per-head keys and values of the whole cache.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from parcompile.runtime.comm import copy_to_tp, enter_tp, gather_replicated, keep_split_input
from parcompile.runtime.context import Axis
from parcompile.runtime.layers import (INIT_STD, ColumnParallelLinear, RMSNorm, RowParallelLinear, apply_rope,
                                       attention_core, deinterleave, make_param, recompute)
from parcompile.runtime.fp8 import fp8_linear
from parcompile.runtime.wgrad import linear


class ReplicatedLinear(nn.Module):
    """y = x W^T (+ b), W (out, in) whole on every tp rank: (..., in) -> (..., out)."""

    def __init__(self, name: str, in_features: int, out_features: int, bias: bool, tp: Axis, seed: int,
                 std: float = INIT_STD, *, fp8: str | None = None):
        super().__init__()
        self.fp8 = fp8   # the FP8 recipe of its GEMMs (runtime/fp8.py; None: 16-bit)
        self.weight = make_param(f"{name}.weight", (out_features, in_features), seed, std, tp, None)
        self.bias = make_param(f"{name}.bias", (out_features,), seed, 0, tp, None) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            return fp8_linear(x, self.weight, self.bias, self.fp8, None, "replicated")
        return linear(x, self.weight, self.bias)


def mla_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, fused: bool, **kw) -> torch.Tensor:
    """MLA's attention core: q, k (B, H, T, n + r), v (B, H, T, v) -> (B, H, T, v)
    (:func:`parcompile.runtime.layers.attention_core`). The fused kernel takes one head
    width, so v is zero-padded to n + r and the output cut back (vLLM's MLA on FlashAttention
    2): the kernel keeps the padded v and output (the plan counts them: ir/ops.py)."""
    d, dv = q.shape[-1], v.shape[-1]
    if fused and dv < d:
        return attention_core(q, k, F.pad(v, (0, d - dv)), fused=True, **kw)[..., :dv]
    return attention_core(q, k, v, fused=fused, **kw)


class MLAttention(nn.Module):
    """MLA of one decoder layer (module docstring): (B, T, h) -> (B, T, h); with sequence
    parallelism the input and output are (B, T/tp, h).

    Parameters (global shapes; ``prefix`` is ``layers.<i>.attn``): ``wq_a`` (c_q, h),
    ``q_a_norm`` (c_q,), ``wq_b`` (H (n + r), c_q) split by heads [or ``wq`` (H (n + r), h)],
    ``wkv_a`` (c + r, h), ``kv_a_norm`` (c,), ``wkv_b`` (H (n + v), c) split by heads, ``wo``
    (h, H v) split on its input. ``scale``: the softmax scale (None: (n + r) ** -0.5).
    ``down_bias``: biases on wq_a and wkv_a (HF ``attention_bias``); ``out_bias`` on wo.
    ``heads_local``: the heads a rank holds as the program read them off the sharded graph
    (checked against the layout).

    Raises:
        ValueError: tp does not divide the heads, or they split into other than ``heads_local``.
    """

    def __init__(self, prefix: str, hidden: int, heads: int, q_lora_rank: int, kv_lora_rank: int, nope: int,
                 rope: int, v_dim: int, tp: Axis, seed: int, out_std: float, sequence_parallel: bool,
                 eps: float, *, down_bias: bool = False, out_bias: bool = False, interleave: bool = False,
                 fused: bool = True, dropout: float = 0.0, window: int = 0, scale: float | None = None,
                 recompute_core: bool = False, heads_local: int | None = None):
        super().__init__()
        if heads % tp.size:
            raise ValueError(f"tp = {tp.size} does not divide the {heads} heads of MLA")
        if heads_local is not None and heads_local != heads // tp.size:
            raise ValueError(f"{prefix}: the program expects {heads_local} heads per rank, the layout gives "
                             f"{heads} / {tp.size} = {heads // tp.size}")
        self.tp, self.sp = tp, sequence_parallel
        self.heads_local = heads // tp.size
        self.nope, self.rope, self.v_dim, self.kv_rank = nope, rope, v_dim, kv_lora_rank
        self.interleave, self.fused, self.dropout, self.window = interleave, fused, dropout, window
        self.scale = scale if scale is not None else (nope + rope) ** -0.5
        self.recompute_core = recompute_core
        qk = heads * (nope + rope)
        if q_lora_rank:
            self.wq_a = ReplicatedLinear(f"{prefix}.wq_a", hidden, q_lora_rank, down_bias, tp, seed)
            self.q_a_norm = RMSNorm(f"{prefix}.q_a_norm", q_lora_rank, eps, seed, tp)
            self.wq_b = ColumnParallelLinear(f"{prefix}.wq_b", q_lora_rank, qk, False, tp, seed)
            self.wq = None
        else:
            self.wq_a = self.q_a_norm = self.wq_b = None
            self.wq = ColumnParallelLinear(f"{prefix}.wq", hidden, qk, False, tp, seed)
        self.wkv_a = ReplicatedLinear(f"{prefix}.wkv_a", hidden, kv_lora_rank + rope, down_bias, tp, seed)
        self.kv_a_norm = RMSNorm(f"{prefix}.kv_a_norm", kv_lora_rank, eps, seed, tp)
        # replicated and run on the whole (gathered) sequence: gradients whole on every tp rank,
        # so sequence parallelism's step all-reduce of replicated gradients leaves them out
        for mod in (self.wq_a, self.q_a_norm, self.wkv_a, self.kv_a_norm):
            for p in (mod.parameters() if mod is not None else ()):
                p.tp_whole_grad = True
        self.wkv_b = ColumnParallelLinear(f"{prefix}.wkv_b", kv_lora_rank, heads * (nope + v_dim), False, tp, seed)
        self.wo = RowParallelLinear(f"{prefix}.wo", heads * v_dim, hidden, out_bias, tp, seed, out_std,
                                    sequence_parallel)

    def _rope_dims(self, x: torch.Tensor) -> torch.Tensor:
        return deinterleave(x) if self.interleave else x

    def forward(self, x: torch.Tensor, pos) -> torch.Tensor:
        """Training: x (B, T[/tp], h), ``pos`` the program's Positions (RoPE tables at the
        tokens' positions) -> (B, T[/tp], h). With sequence parallelism each projection's
        gathered input is kept split and gathered again in backward (:func:`keep_split_input`)."""
        xs, x = x, gather_replicated(x, self.tp, self.sp)     # (B, T, h): whole gradient back
        B, T, _ = x.shape
        H, n, r = self.heads_local, self.nope, self.rope
        if self.wq is None:   # the query latent: normed, then up-projected by this rank's heads
            with keep_split_input(xs, x, self.tp):
                qa, kva = self.wq_a(x), self.wkv_a(x)
            q = self.wq_b(copy_to_tp(self.q_a_norm(qa), self.tp))
        else:                 # one column-parallel query projection: its own tensor-parallel region
            with keep_split_input(xs, x, self.tp):
                kva = self.wkv_a(x)
            xq = enter_tp(xs, self.tp, self.sp)
            with keep_split_input(xs, xq, self.tp) if self.sp else contextlib.nullcontext():
                q = self.wq(xq)
        q = q.view(B, T, H, n + r)
        c = copy_to_tp(self.kv_a_norm(kva[..., :self.kv_rank]), self.tp)        # (B, T, c)
        k_rope = apply_rope(self._rope_dims(kva[..., self.kv_rank:]).view(B, T, 1, r), *pos.rope)
        k_rope = copy_to_tp(k_rope, self.tp)                                      # (B, T, 1, r)
        kv = self.wkv_b(c).view(B, T, H, n + self.v_dim)
        q = torch.cat([q[..., :n], apply_rope(self._rope_dims(q[..., n:]), *pos.rope)], dim=-1)
        k = torch.cat([kv[..., :n], k_rope.expand(B, T, H, r)], dim=-1)          # (B, T, H, n + r)
        v = kv[..., n:].contiguous()                                              # (B, T, H, v): its own storage
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        kw = dict(fused=self.fused, dropout=self.dropout, training=self.training, window=self.window,
                  q_pos=pos.q, k_pos=pos.k, scale=self.scale)
        y = recompute(mla_core, q, k, v, **kw) if self.recompute_core else mla_core(q, k, v, **kw)
        y = y.transpose(1, 2).reshape(B, T, H * self.v_dim)
        return self.wo(y)

    def serve(self, x: torch.Tensor, step, cache, rope: tuple[torch.Tensor, torch.Tensor], layer: int) -> torch.Tensor:
        """Serving: x (B, T, h) of one step, ``step`` the StepInput, ``cache`` the KVCache
        (the latent as its keys (B, 1, L, c) and the RoPE key as its values (B, 1, L, r)),
        ``rope`` (cos, sin) at the step's positions (B, T, r) -> (B, T, h) (module docstring)."""
        from parcompile.runtime.generate import apply_rope_at, cached_attention

        B, T, _ = x.shape
        H, n, r, c = self.heads_local, self.nope, self.rope, self.kv_rank
        kva = self.wkv_a(x)
        q = (self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))).view(B, T, H, n + r)
        latent = self.kv_a_norm(kva[..., :c]).view(B, 1, T, c)
        k_rope = apply_rope_at(self._rope_dims(kva[..., c:]).view(B, T, 1, r), *rope).transpose(1, 2)
        latent, k_rope = cache.store(layer, latent, k_rope, step.start)          # (B, 1, L, c), (B, 1, L, r)
        w = self.wkv_b.weight.view(H, n + self.v_dim, c)
        q_rope = apply_rope_at(self._rope_dims(q[..., n:]), *rope)              # (B, T, H, r)
        q_latent = torch.einsum("bthn,hnc->bhtc", q[..., :n], w[:, :n])         # (B, H, T, c)
        queries = torch.cat([q_latent, q_rope.transpose(1, 2)], dim=-1)          # (B, H, T, c + r)
        keys = torch.cat([latent, k_rope], dim=-1)                               # (B, 1, L, c + r)
        # one latent "kv head" shared by every query head: the heads' queries as rows of one
        # (no copy of the cache per head), each row with its token's mask
        mask = step.masks[self.window].repeat(1, 1, H, 1)                       # (B, 1, H T, L)
        y = cached_attention(queries.reshape(B, 1, H * T, c + r), keys, latent, mask, self.fused,
                             scale=self.scale).view(B, H, T, c)                 # (B, H, T, c)
        y = torch.einsum("bhtc,hvc->bthv", y, w[:, n:]).reshape(B, T, H * self.v_dim)
        return self.wo(y)


__all__ = ["MLAttention", "ReplicatedLinear", "deinterleave", "mla_core"]
