"""Llama 4's per-head operations the op table's program rows call (ir/ops/dense.py ``l2_norm`` and
``attn_temperature``), as transformers 5.25 models/llama4/modeling_llama4.py
``Llama4TextAttention`` computes them."""

from __future__ import annotations

import torch

from parcompile.runtime.model.layers import rms_norm


def l2_norm(x: torch.Tensor, eps: float, skip: bool | None = False) -> torch.Tensor:
    """Llama 4's qk-norm: each head of x (B, T, H, D) divided by its root mean square,
    ``x * rsqrt(mean(x^2) + eps)`` in fp32, cast back, no weight (``Llama4TextL2Norm``), as
    :func:`~parcompile.runtime.model.layers.rms_norm` by a weight of ones (exact). ``skip``: x as it
    is (the NoPE layers)."""
    return x if skip else rms_norm(x, torch.ones(x.shape[-1], dtype=x.dtype, device=x.device), eps)


def temperature_scales(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Attention temperature tuning of the NoPE layers: the factor of the query at each
    position p, ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``, fp32
    (``Llama4TextAttention``; Nakanishi 2025, arXiv 2501.19399)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def tuned_queries(q: torch.Tensor, pos, floor_scale: float, attn_scale: float,
                  skip: bool | None = False) -> torch.Tensor:
    """q (B, T, H, D) times :func:`temperature_scales` of each token's position (``pos.q``, the
    :class:`~parcompile.runtime.distributed.context_parallel.Positions`; None: 0..T-1), in q's dtype.
    ``skip``: q as it is (the RoPE layers)."""
    if skip:
        return q
    at = pos.q if pos.q is not None else torch.arange(q.shape[1], device=q.device)
    return (q * temperature_scales(at, floor_scale, attn_scale).to(q.device)[None, :, None, None]).to(q.dtype)


__all__ = ["l2_norm", "temperature_scales", "tuned_queries"]
