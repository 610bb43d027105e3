"""The KV cache, one rule for the plan's memory, its serving report and the serve program.

A decoder layer keeps, per token of a sequence and per rank, its keys and values:
``2 * kv_heads_per_rank * head_dim * kv_bytes`` bytes (K and V; kv heads split over tp, or
one replicated on ``tp / kv_heads`` ranks: :mod:`parcompile.core.heads`; ``kv_bytes`` the
``kv_dtype``'s, 4/2/2/1 for fp32/bf16/fp16/fp8). A sliding-window layer attends to the last
``window`` tokens only, so it keeps at most ``window`` of them (vLLM and transformers'
sliding-window caches): a sequence of L tokens costs ``min(L, window)`` tokens there and
L in a full-attention layer (:func:`parcompile.core.model.layer_windows`). Multi-head
latent attention caches one latent per token instead (:func:`kv_token_bytes`).
"""

from __future__ import annotations

from typing import Sequence

from parcompile.core.dtypes import DTYPE_BYTES
from parcompile.core.heads import kv_head_replicas, kv_heads_per_rank
from parcompile.core.model import cached_tokens
from parcompile.core.schedule import LOOP, Placement


def kv_dtype(cfg) -> str:
    """The cache's dtype: ``serve.kv_dtype``, else the model's."""
    return cfg.serve.kv_dtype if cfg.serve is not None and cfg.serve.kv_dtype else cfg.model.dtype


def kv_token_bytes(cfg) -> int:
    """Bytes one token adds to one layer's cache on one rank: ``2 * kv_heads_per_rank *
    head_dim * kv_bytes``; multi-head latent attention (``kv_lora_rank > 0``) keeps the
    latent and the RoPE key instead, ``(kv_lora_rank + qk_rope_head_dim) * kv_bytes`` on
    every tp rank (replicated, as vLLM and SGLang keep it; DeepSeek-V2 section 2.1.2)."""
    m = cfg.model
    if m.kv_lora_rank:
        return (m.kv_lora_rank + m.qk_rope_head_dim) * DTYPE_BYTES[kv_dtype(cfg)]
    return 2 * kv_heads_per_rank(m.kv_heads, cfg.parallel.tp) * m.head_dim * DTYPE_BYTES[kv_dtype(cfg)]


def cache_heads(m, tp: int) -> tuple[int, int]:
    """(kv heads one rank's cache holds, tp ranks holding the same one), as plan.json
    reports them: :mod:`parcompile.core.heads`'s rule, or for multi-head latent attention
    one latent "kv head" on every tp rank (``(1, tp)``, vLLM's MLA cache)."""
    if m.kv_lora_rank:
        return 1, tp
    return kv_heads_per_rank(m.kv_heads, tp), kv_head_replicas(m.kv_heads, tp)


def stage_layers(chunks: Sequence[Sequence[int]], pp: int, place: Placement = LOOP) -> list[list[int]]:
    """The layer ids of each pipeline rank, chunk by chunk: model chunk k sits where ``place``
    puts it (the schedule's placement; ``loop``: on rank ``k % pp``)."""
    return [[i for ls in place.layers(s, chunks, pp) for i in ls] for s in range(pp)]


def kv_bytes_per_token(cfg, chunks: Sequence[Sequence[int]]) -> list[int]:
    """Per pipeline rank: the bytes one more token adds while no window is full (every
    layer of the rank keeps it): ``layers_s * kv_token_bytes``."""
    return [kv_token_bytes(cfg) * len(ls) for ls in _rank_layers(cfg, chunks)]


def kv_bytes_per_sequence(cfg, chunks: Sequence[Sequence[int]], tokens: int) -> list[int]:
    """Per pipeline rank: the cache of one sequence of ``tokens`` tokens, each layer keeping
    :func:`cached_tokens` of them (equal to ``tokens * kv_bytes_per_token`` without sliding
    windows)."""
    windows = cfg.model.layer_windows
    per = kv_token_bytes(cfg)
    return [per * sum(cached_tokens(windows[i], tokens) for i in ls) for ls in _rank_layers(cfg, chunks)]


def _rank_layers(cfg, chunks: Sequence[Sequence[int]]) -> list[list[int]]:
    """:func:`stage_layers` of ``cfg``'s layout and schedule."""
    return stage_layers(chunks, cfg.parallel.pp, cfg.parallel.pipeline_schedule.placement)


__all__ = ["cache_heads", "kv_dtype", "kv_token_bytes", "stage_layers", "kv_bytes_per_token",
           "kv_bytes_per_sequence"]
