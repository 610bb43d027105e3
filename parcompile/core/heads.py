"""How tensor parallelism lays out attention's kv heads (Megatron-LM; vLLM when serving).

With ``tp`` dividing ``kv_heads`` each rank holds ``kv_heads / tp`` whole kv heads (and the
query heads of their groups). Serving also accepts ``tp`` a multiple of ``kv_heads`` (vLLM's
rule, ``vllm/model_executor/layers/linear.py: QKVParallelLinear``: ``num_kv_head_replicas =
tp / kv_heads``): every rank then holds one kv head, each kv head replicated on ``tp /
kv_heads`` consecutive ranks of the tp group (rank r holds kv head ``r // replicas``), and
the graph keeps the k/v projections unsplit. Any other pair is rejected by the checks
(``frontend/checks.py``), so the functions below assume one of the two cases.
"""

from __future__ import annotations


def kv_heads_replicated(kv_heads: int, tp: int) -> bool:
    """True when ``tp`` does not divide ``kv_heads`` (so, after the checks, tp is a multiple
    of kv_heads and every kv head is replicated on ``tp / kv_heads`` ranks). False at tp = 1."""
    return kv_heads % tp != 0


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """kv heads one rank holds: ``kv_heads / tp`` when tp divides kv_heads, else 1 (replicated)."""
    return 1 if kv_heads_replicated(kv_heads, tp) else kv_heads // tp


def kv_head_replicas(kv_heads: int, tp: int) -> int:
    """Ranks of a tp group holding the same kv head: ``tp / kv_heads`` when tp is a multiple
    of kv_heads that kv_heads does not divide (replicated, vLLM), else 1."""
    return tp // kv_heads if kv_heads_replicated(kv_heads, tp) and tp % kv_heads == 0 else 1


__all__ = ["kv_heads_replicated", "kv_heads_per_rank", "kv_head_replicas"]
