"""GPT-NeoX (``gpt_neox``): LayerNorm and RoPE on ``rotary_pct`` of each head (parallel
residual or not), biases everywhere.

Weights: ``query_key_value`` interleaves q, k, v per head: rows ``[q_0 k_0 v_0 q_1 k_1 v_1
...]``, ``head_dim`` rows each; the head is ``embed_out`` (or ``lm_head``).
"""

from __future__ import annotations

from typing import Any

from parcompile.core.families.base import (Family, Source, activation, decoder_config, decoder_keys, drop_none,
                                           read_bool, read_float, read_str, rope_param, rope_theta)
from parcompile.core.families.gpt2 import gpt_problems
from parcompile.core.model import ModelKeys, rotary_dim


def _keys(cfg: dict, common: dict[str, Any]) -> dict[str, Any]:
    """`model` keys of a ``gpt_neox`` config.json: ``rotary_pct`` (transformers 5:
    ``rope_parameters.partial_rotary_factor``) -> ``rotary_fraction``, ``rotary_emb_base``
    -> ``rope_theta``, ``use_parallel_residual`` (default true)."""
    return drop_none({
        **decoder_keys(cfg, common),
        "norm": "layernorm",
        "norm_eps": read_float(cfg, "layer_norm_eps"),
        "activation": activation(read_str(cfg, "hidden_act", "gelu"), gated=False),
        "position": "rope",
        "rotary_fraction": read_float(cfg, "rotary_pct", rope_param(cfg, "partial_rotary_factor")),
        "rope_theta": read_float(cfg, "rotary_emb_base", rope_theta(cfg)),
        "parallel_residual": read_bool(cfg, "use_parallel_residual", True),
        "bias": True,
    })


def _config(m: ModelKeys, common: dict) -> dict:
    """GPTNeoXConfig of ``m`` (transformers 4's ``rotary_pct`` / ``rotary_emb_base`` beside
    ``rope_parameters``)."""
    return {**decoder_config(m, common, partial_rope=True), "layer_norm_eps": m.norm_eps,
            "use_parallel_residual": bool(m.parallel_residual), "attention_bias": True,
            "rotary_pct": rotary_dim(m) / m.head_dim, "rotary_emb_base": float(m.rope_theta),
            "attention_dropout": m.dropout, "hidden_dropout": m.dropout}


def _sources(m: ModelKeys, name: str, shape: tuple[int, ...]) -> list[Source]:
    simple = {"embedding.weight": "gpt_neox.embed_in.weight",
              "final_norm.weight": "gpt_neox.final_layer_norm.weight",
              "final_norm.bias": "gpt_neox.final_layer_norm.bias"}
    if name in simple:
        return [Source(simple[name], shape)]
    parts = name.split(".")
    i, rest = parts[1], ".".join(parts[2:])
    base = f"gpt_neox.layers.{i}."
    stem, _, kind = rest.rpartition(".")
    d, H = m.head_dim, m.heads
    renames = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "attn.wo": "attention.dense",
               "mlp.w1": "mlp.dense_h_to_4h", "mlp.w2": "mlp.dense_4h_to_h"}
    if stem in renames:
        return [Source(f"{base}{renames[stem]}.{kind}", shape)]
    if stem in ("attn.wq", "attn.wk", "attn.wv"):
        j = ("attn.wq", "attn.wk", "attn.wv").index(stem)
        full = (3 * H * d,) + tuple(shape[1:])
        return [Source(f"{base}attention.query_key_value.{kind}", full, block=d, stride=3 * d, offset=j * d)]
    return []


FAMILIES = (Family("gpt_neox", "GPTNeoXForCausalLM", keys=_keys, config=_config, sources=_sources,
                   problems=lambda m: gpt_problems(m, "gpt_neox"), rank=50,
                   matches=lambda m: m.norm == "layernorm" and m.position == "rope", title="GPT-NeoX",
                   head=("embed_out.weight", "lm_head.weight")),)

PRESETS: dict[str, dict[str, Any]] = {}
