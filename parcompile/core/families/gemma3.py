"""Gemma 3 (``gemma3_text``): RMSNorm scaled by ``1 + w`` before and after each sub-layer,
GeGLU, qk-norm, embeddings times sqrt(hidden), local and global layers
(``sliding_window_pattern``) with their own RoPE bases.

Weights: Llama's names with four norms per layer: ``input_layernorm`` (our
``attn_norm``), ``post_attention_layernorm`` (``attn_post_norm``),
``pre_feedforward_layernorm`` (``mlp_norm``), ``post_feedforward_layernorm``
(``mlp_post_norm``).
"""

from __future__ import annotations

import json
from typing import Any

from parcompile.core.families.base import (GEMMA_KEYS, HF_ACTIVATIONS, Family, HFConfigError, Source,
                                           decoder_keys, drop_none, layer_types, llama_config, read_bool, read_dict,
                                           read_float, read_int, read_list, read_str, rope_parameters,
                                           rope_scaling_keys, whole, window_pattern)
from parcompile.core.families.llama import llama_sources, llama_style
from parcompile.core.model import ModelKeys, rotary_dim

#: transformers 5.24's Gemma3TextConfig defaults of the fields that shape the model
GEMMA3_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
                   "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "rms_norm_eps": 1e-6,
                   "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}


def _keys(cfg: dict, common: dict[str, Any]) -> dict[str, Any]:
    """`model` keys of a ``gemma3_text`` config.json (transformers' Gemma3TextConfig;
    absent fields take its defaults, :data:`GEMMA3_DEFAULTS`): RMSNorm scaled by ``1 +
    w`` (``zero_centered_gamma``) before and after each sub-layer (``sandwich_norm``),
    embeddings times sqrt(hidden), GeGLU (``gelu_pytorch_tanh``), qk-norm, scores scaled by
    ``query_pre_attn_scalar ** -0.5``, local (``sliding_attention``) and global layers
    (``layer_types`` or ``sliding_window_pattern``) with their own RoPE bases
    (``rope_parameters.sliding_attention`` / ``full_attention``, or ``rope_local_base_freq``
    / ``rope_theta``); linear RoPE scaling of the global layers (``rope_type = linear``).
    """
    base = decoder_keys(cfg, common)
    d = GEMMA3_DEFAULTS
    act = read_str(cfg, "hidden_activation", read_str(cfg, "hidden_act", d["hidden_activation"]))
    if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        raise HFConfigError(f"unsupported activation `{act}` in a gemma3_text config.json",
                            help="parcompile models Gemma's GeGLU with the tanh GELU (gelu_pytorch_tanh)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise HFConfigError(f"`{key}` = {json.dumps(cfg[key])}: logit soft-capping is not modelled",
                                help=f"set `{key}` to null in a copy of the config.json (Gemma 3 has none)")
    if read_bool(cfg, "use_bidirectional_attention", False):
        raise HFConfigError("`use_bidirectional_attention` = true: parcompile models causal decoders only")
    kinds = read_list(cfg, "layer_types")
    if kinds is not None:
        pattern = window_pattern(kinds, "gemma3_text")
    else:
        pattern = read_int(cfg, "sliding_window_pattern", d["sliding_window_pattern"])
    window = read_int(cfg, "sliding_window", d["sliding_window"])
    params = read_dict(cfg, "rope_parameters") or {}
    full = read_dict(params, "full_attention") or {}
    local = read_dict(params, "sliding_attention") or {}
    scaling = read_dict(cfg, "rope_scaling") or {}
    full = {**scaling, **full}
    if local.get("rope_type", "default") != "default":
        raise HFConfigError(f"RoPE scaling `{local.get('rope_type')}` of the sliding-window layers is not modelled")
    theta = read_float(full, "rope_theta", read_float(cfg, "rope_theta", d["rope_theta"]))
    local_theta = read_float(local, "rope_theta", read_float(cfg, "rope_local_base_freq", d["rope_local_base_freq"]))
    has_local = bool(window)           # some layer attends within the window
    return drop_none({
        **base,
        "tie_embeddings": read_bool(cfg, "tie_word_embeddings", d["tie_word_embeddings"]),
        "kv_heads": read_int(cfg, "num_key_value_heads"),
        "head_dim": read_int(cfg, "head_dim", d["head_dim"]),
        "norm": "rmsnorm",
        "norm_eps": read_float(cfg, "rms_norm_eps", d["rms_norm_eps"]),
        "zero_centered_gamma": True,
        "sandwich_norm": True,
        "scale_embeddings": True,
        "activation": "geglu",
        "position": "rope",
        "rope_theta": theta,
        "rope_local_base_freq": local_theta if has_local else None,
        **rope_scaling_keys(full),
        "qk_norm": True,
        "query_pre_attn_scalar": read_float(cfg, "query_pre_attn_scalar", d["query_pre_attn_scalar"]),
        "sliding_window": window or 0,
        "sliding_window_pattern": pattern if window and pattern else None,
        "bias": False,
        "qkv_bias": read_bool(cfg, "attention_bias", False),
    })


def _config(m: ModelKeys, common: dict) -> dict:
    """Gemma3TextConfig of ``m``: the local layers' RoPE base beside the global one,
    ``layer_types``, ``query_pre_attn_scalar`` and no soft-capping."""
    cfg = llama_config(m, common)
    local = m.rope_local_base_freq if m.rope_local_base_freq is not None else m.rope_theta
    cfg.update(hidden_activation=HF_ACTIVATIONS[m.activation], attention_bias=bool(m.qkv_bias),
               query_pre_attn_scalar=whole(m.query_pre_attn_scalar if m.query_pre_attn_scalar is not None
                                           else m.head_dim),   # Gemma3TextConfig types it int
               sliding_window=m.sliding_window or None,
               layer_types=layer_types(m),
               rope_parameters={"full_attention": rope_parameters(m),
                                "sliding_attention": {"rope_type": "default", "rope_theta": float(local)}},
               final_logit_softcapping=None, attn_logit_softcapping=None)
    cfg.pop("hidden_act")
    cfg.pop("rope_theta")
    return cfg


def gemma_sources(m: ModelKeys, name: str, shape: tuple[int, ...]) -> list[Source]:
    """Llama's names, with Gemma's four norms per layer (module docstring; Gemma 2's too)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "layers":
        base = f"model.layers.{parts[1]}."
        norms = {"attn_norm.weight": "input_layernorm.weight", "attn_post_norm.weight": "post_attention_layernorm.weight",
                 "mlp_norm.weight": "pre_feedforward_layernorm.weight",
                 "mlp_post_norm.weight": "post_feedforward_layernorm.weight"}
        rest = ".".join(parts[2:])
        if rest in norms:
            return [Source(base + norms[rest], shape)]
    return llama_sources(m, name, shape)


def gemma_problems(m: ModelKeys, title: str = "Gemma 3") -> list[str]:
    """What a Gemma decoder (RMSNorm and RoPE on the whole head, no biases, no parallel
    residual, no experts, local and global layers) cannot have, each a phrase."""
    out = []
    if m.norm != "rmsnorm" or m.position != "rope" or rotary_dim(m) != m.head_dim:
        out.append("a norm or position other than RMSNorm and RoPE on the whole head")
    if m.bias or m.parallel_residual or m.experts:
        out.append("biases, parallel_residual or experts")
    if m.sliding_window_pattern == 0 and m.sliding_window:
        out.append(f"sliding_window on every layer ({title} alternates: sliding_window_pattern)")
    return out


FAMILIES = (Family("gemma3_text", "Gemma3ForCausalLM", keys=_keys, config=_config, sources=gemma_sources,
                   problems=gemma_problems, matches=lambda m: any(getattr(m, k) == v for k, v in GEMMA_KEYS.items()),
                   rank=30, features=frozenset({"gemma", "window_pattern", "local_rope", "qk_norm"}),
                   title="Gemma 3"),)

PRESETS: dict[str, dict[str, Any]] = {
    # google/gemma-3-27b-it config.json, its text_config (gemma3_text): 62 layers, five local
    # (window 1024, RoPE base 10,000) then one global (RoPE base 1e6, linear scaling 8),
    # query_pre_attn_scalar 168, GeGLU, sandwich (1 + w) RMSNorms, qk-norm, embeddings x
    # sqrt(hidden), tied; vocab 262,208
    "gemma3-27b": llama_style(
        layers=62, hidden=5376, ffn_hidden=21504, heads=32, kv_heads=16, head_dim=128, vocab=262208,
        seq_len=131072, norm_eps=1e-6, rope_theta=1e6, rope_local_base_freq=1e4, rope_type="linear",
        rope_scaling_factor=8.0,
        sliding_window=1024, sliding_window_pattern=6, query_pre_attn_scalar=168.0, activation="geglu",
        qk_norm=True, zero_centered_gamma=True, sandwich_norm=True, scale_embeddings=True, tie_embeddings=True,
    ),
}
