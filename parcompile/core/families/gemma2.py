"""Gemma 2 (``gemma2``): Gemma 3 without qk-norm and with logit soft-capping: RMSNorm
scaled by ``1 + w`` before and after each sub-layer, GeGLU, embeddings times
sqrt(hidden), scores scaled by ``query_pre_attn_scalar ** -0.5`` and capped at
``attn_logit_softcapping``, local and global layers alternating (one RoPE base for both),
the LM head's logits capped at ``final_logit_softcapping``.

The soft-cap ``cap * tanh(x / cap)`` and where it applies are transformers 5.24's
``models/gemma2/modeling_gemma2.py`` (``eager_attention_forward``: after the scale, before
the mask; ``Gemma2ForCausalLM.forward``: on the logits); the defaults its
``configuration_gemma2.py`` (:data:`GEMMA2_DEFAULTS`). Weights: Gemma 3's names without
``q_norm``/``k_norm`` (:func:`~parcompile.core.families.gemma3.gemma_sources`).
"""

from __future__ import annotations

from typing import Any

from parcompile.core.families.base import (GEMMA_KEYS, HF_ACTIVATIONS, Family, HFConfigError, decoder_keys,
                                           drop_none, layer_types, llama_config, read_bool, read_float, read_int,
                                           read_str, rope_parameters, rope_scaling_keys, rope_theta, whole,
                                           window_pattern)
from parcompile.core.families.gemma3 import gemma_problems, gemma_sources
from parcompile.core.model import ModelKeys

#: transformers 5.24's Gemma2Config defaults of the fields that shape the model (layer_types:
#: local and global alternate, from a local one)
GEMMA2_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 10_000.0,
                   "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                   "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}
SOFTCAP_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")


def _keys(cfg: dict, common: dict[str, Any]) -> dict[str, Any]:
    """`model` keys of a ``gemma2`` config.json (transformers' Gemma2Config; absent fields
    take its defaults, :data:`GEMMA2_DEFAULTS`; a null soft-cap is none)."""
    d = GEMMA2_DEFAULTS
    act = read_str(cfg, "hidden_activation", read_str(cfg, "hidden_act", d["hidden_activation"]))
    if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        raise HFConfigError(f"unsupported activation `{act}` in a gemma2 config.json",
                            help="parcompile models Gemma's GeGLU with the tanh GELU (gelu_pytorch_tanh)")
    if read_bool(cfg, "use_bidirectional_attention", False):
        raise HFConfigError("`use_bidirectional_attention` = true: parcompile models causal decoders only")
    kinds = cfg.get("layer_types")
    pattern = window_pattern(kinds, "gemma2") if isinstance(kinds, list) else 2
    window = read_int(cfg, "sliding_window", d["sliding_window"])
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else cfg.get("rope_scaling")
    theta = rope_theta(cfg)
    caps = {k: read_float(cfg, k, d[k]) if k not in cfg or cfg[k] is not None else None for k in SOFTCAP_KEYS}
    return drop_none({
        **decoder_keys(cfg, common),
        "tie_embeddings": read_bool(cfg, "tie_word_embeddings", d["tie_word_embeddings"]),
        "kv_heads": read_int(cfg, "num_key_value_heads"),
        "head_dim": read_int(cfg, "head_dim", d["head_dim"]),
        "norm": "rmsnorm",
        "norm_eps": read_float(cfg, "rms_norm_eps", d["rms_norm_eps"]),
        **GEMMA_KEYS,
        "position": "rope",
        "rope_theta": theta if theta is not None else d["rope_theta"],
        **rope_scaling_keys(params),
        "query_pre_attn_scalar": read_float(cfg, "query_pre_attn_scalar", d["query_pre_attn_scalar"]),
        "sliding_window": window or 0,
        "sliding_window_pattern": pattern if window and pattern else None,
        "bias": False,
        "qkv_bias": read_bool(cfg, "attention_bias", False),
        **caps,
    })


def _config(m: ModelKeys, common: dict) -> dict:
    """Gemma2Config of ``m``: ``layer_types``, ``query_pre_attn_scalar`` and the two
    soft-caps (null where ``m`` has none)."""
    cfg = llama_config(m, common)
    cfg.update(hidden_activation=HF_ACTIVATIONS[m.activation], attention_bias=bool(m.qkv_bias),
               query_pre_attn_scalar=whole(m.query_pre_attn_scalar if m.query_pre_attn_scalar is not None
                                           else m.head_dim),   # Gemma2Config types it int
               sliding_window=m.sliding_window or None, layer_types=layer_types(m),
               rope_parameters=rope_parameters(m),
               **{k: getattr(m, k) for k in SOFTCAP_KEYS})
    cfg.pop("hidden_act")
    return cfg


def _softcap(m: ModelKeys, family: Family) -> list[str]:
    """The soft-caps ``m`` has (a phrase each), for the families without them."""
    return [f"{k} = {getattr(m, k)} (logit soft-capping: gemma2)" for k in SOFTCAP_KEYS if getattr(m, k) is not None]


FAMILIES = (Family("gemma2", "Gemma2ForCausalLM", keys=_keys, config=_config, sources=gemma_sources,
                   problems=lambda m: gemma_problems(m, "Gemma 2"),
                   # Gemma's keys without qk-norm (Gemma 3 has it), or with a soft-cap
                   matches=lambda m: any(getattr(m, k) == v for k, v in GEMMA_KEYS.items())
                   and (not m.qk_norm or any(getattr(m, k) is not None for k in SOFTCAP_KEYS)),
                   rank=29, features=frozenset({"gemma", "window_pattern"}), title="Gemma 2",
                   owns={"softcap": (_softcap, False)}),)

#: none yet: a Gemma 2 model comes from its config.json (``model m from "config.json"``)
PRESETS: dict[str, dict[str, Any]] = {}
