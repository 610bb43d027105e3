"""gpt-oss (``gpt_oss``): every layer a mixture-of-experts layer with a biased router,
experts with biases and the clamped SwiGLU, biases on q, k, v, o, attention sinks,
sliding-window and full layers alternating, YaRN RoPE.

Weights: Llama's names, with the router ``mlp.router.weight``/``bias``, the sinks
``self_attn.sinks`` (heads,), and the experts in transformers' fused layout, stored (in,
out): ``mlp.experts.gate_up_proj`` (E, h, 2f), gate and up interleaved (columns 0, 2, 4,
... are w1's rows, 1, 3, 5, ... w3's), ``gate_up_proj_bias`` (E, 2f), ``down_proj`` (E, f,
h), ``down_proj_bias`` (E, h).
"""

from __future__ import annotations

from typing import Any

from parcompile.core.families.base import (Family, HFConfigError, Source, decoder_keys, drop_none, layer_types,
                                           llama_config, read_bool, read_float, read_int, read_list, rope_dict,
                                           rope_scaling_keys,
                                           window_pattern)
from parcompile.core.families.llama import llama_sources, llama_style
from parcompile.core.model import ModelKeys

#: transformers 5.24's GptOssConfig defaults of the fields that shape the model
GPT_OSS_DEFAULTS = {"num_local_experts": 128, "num_experts_per_tok": 4, "head_dim": 64, "sliding_window": 128,
                    "rms_norm_eps": 1e-5, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001,
                    "attention_bias": True,
                    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "truncate": False, "original_max_position_embeddings": 4096,
                                        "rope_theta": 150000.0}}


def _keys(cfg: dict, common: dict[str, Any]) -> dict[str, Any]:
    """`model` keys of a ``gpt_oss`` config.json (transformers' GptOssConfig; absent fields
    take its defaults, :data:`GPT_OSS_DEFAULTS`): every layer a MoE layer of
    ``num_local_experts`` experts of width ``intermediate_size``, top ``num_experts_per_tok``
    by a biased router (softmax over the top-k logits: ``norm_topk_prob``), experts with
    biases and the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``), biases on q, k, v, o,
    attention sinks, sliding-window and full layers alternating (``layer_types``), YaRN RoPE."""
    base = decoder_keys(cfg, common)
    d = GPT_OSS_DEFAULTS
    kinds = read_list(cfg, "layer_types")
    pattern = window_pattern(kinds, "gpt_oss") if kinds is not None else 2
    window = read_int(cfg, "sliding_window", d["sliding_window"])
    rope = rope_dict(cfg)   # the hub's config.json (transformers 4) writes `rope_scaling`
    rope = d["rope_parameters"] if rope is None else rope
    theta = read_float(rope, "rope_theta", read_float(cfg, "rope_theta", 150000.0))
    if not read_bool(cfg, "attention_bias", d["attention_bias"]):
        raise HFConfigError("`attention_bias` = false in a gpt_oss config.json cannot be mapped: its experts have "
                            "biases, and parcompile's `bias` puts them on every linear layer")
    ffn = read_int(cfg, "intermediate_size")
    return drop_none({
        **base,
        "kv_heads": read_int(cfg, "num_key_value_heads"),
        "head_dim": read_int(cfg, "head_dim", d["head_dim"]),
        "norm": "rmsnorm",
        "norm_eps": read_float(cfg, "rms_norm_eps", d["rms_norm_eps"]),
        "activation": "swiglu",
        "swiglu_alpha": read_float(cfg, "swiglu_alpha", d["swiglu_alpha"]),
        "swiglu_limit": read_float(cfg, "swiglu_limit", d["swiglu_limit"]),
        "position": "rope",
        "rope_theta": theta,
        **rope_scaling_keys(rope),
        "bias": True,
        "qkv_bias": True,
        "attention_sinks": True,
        "sliding_window": window or 0,
        "sliding_window_pattern": pattern if window and pattern else None,
        "experts": read_int(cfg, "num_local_experts", d["num_local_experts"]),
        "top_k": read_int(cfg, "num_experts_per_tok", d["num_experts_per_tok"]),
        "expert_ffn_hidden": ffn,
        "ffn_hidden": ffn,
        "router_bias": True,
        "norm_topk_prob": True,
        "router_aux_loss": read_float(cfg, "router_aux_loss_coef", d["router_aux_loss_coef"]),
    })


def _config(m: ModelKeys, common: dict) -> dict:
    """GptOssConfig of ``m``."""
    cfg = llama_config(m, common)
    cfg.update(attention_bias=True, intermediate_size=m.expert_ffn_hidden, num_local_experts=m.experts,
               num_experts_per_tok=m.top_k, router_aux_loss_coef=m.router_aux_loss,
               swiglu_alpha=m.swiglu_alpha, swiglu_limit=m.swiglu_limit, sliding_window=m.sliding_window or None,
               layer_types=layer_types(m), output_router_logits=False)
    cfg.pop("hidden_act")
    cfg.pop("rope_theta")
    return cfg


def _sources(m: ModelKeys, name: str, shape: tuple[int, ...]) -> list[Source]:
    """Llama's names, with gpt-oss's router, sinks and fused, transposed, interleaved experts
    (module docstring)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "layers":
        base = f"model.layers.{parts[1]}."
        rest = ".".join(parts[2:])
        f, h, E = m.expert_ffn_hidden, m.hidden, m.experts
        if rest in ("mlp.router.weight", "mlp.router.bias"):
            return [Source(base + rest, shape)]
        if rest == "attn.sinks":
            return [Source(base + "self_attn.sinks", shape)]
        if parts[2:4] == ["mlp", "experts"] and len(parts) == 7:
            e, w, kind = int(parts[4]), parts[5], parts[6]
            if w == "w2":
                if kind == "weight":
                    return [Source(base + "mlp.experts.down_proj", (E, f, h), lead=(e,), transpose=True)]
                return [Source(base + "mlp.experts.down_proj_bias", (E, h), lead=(e,))]
            offset = 0 if w == "w1" else 1
            if kind == "weight":
                return [Source(base + "mlp.experts.gate_up_proj", (E, h, 2 * f), lead=(e,), transpose=True,
                               block=1, stride=2, offset=offset)]
            return [Source(base + "mlp.experts.gate_up_proj_bias", (E, 2 * f), lead=(e,), block=1, stride=2,
                           offset=offset)]
    return llama_sources(m, name, shape)


def _problems(m: ModelKeys) -> list[str]:
    want = {"attention_sinks": True, "router_bias": True, "bias": True, "qkv_bias": True, "norm": "rmsnorm",
            "activation": "swiglu", "position": "rope", "qk_norm": False, "parallel_residual": False,
            "shared_experts": 0, "dense_layers": 0, "norm_topk_prob": True}
    out = [f"{k} = {getattr(m, k)} (gpt-oss has {v})" for k, v in want.items() if getattr(m, k) != v]
    if m.experts <= 0:
        out.append("no experts (every gpt-oss layer is a MoE layer)")
    if m.swiglu_limit is None or m.swiglu_alpha is None:
        out.append("no swiglu_alpha / swiglu_limit (gpt-oss clamps its SwiGLU)")
    if m.sliding_window and m.sliding_window_pattern == 0:
        out.append("sliding_window on every layer (gpt-oss alternates: sliding_window_pattern = 2)")
    return out


FAMILIES = (Family("gpt_oss", "GptOssForCausalLM", keys=_keys, config=_config, sources=_sources,
                   problems=_problems, rank=20,
                   matches=lambda m: bool(m.attention_sinks or m.router_bias or m.swiglu_limit is not None),
                   features=frozenset({"window_pattern", "oss"}), title="gpt-oss"),)

_GPT_OSS = dict(
    hidden=2880, ffn_hidden=2880, heads=64, kv_heads=8, head_dim=64, vocab=201088, seq_len=131072, norm_eps=1e-5,
    rope_theta=150000.0, rope_type="yarn", rope_scaling_factor=32.0, rope_original_max_positions=4096,
    rope_beta_fast=32.0, rope_beta_slow=1.0, rope_truncate=False, sliding_window=128, sliding_window_pattern=2,
    bias=True, qkv_bias=True, attention_sinks=True, top_k=4, expert_ffn_hidden=2880, router_bias=True,
    norm_topk_prob=True, swiglu_alpha=1.702, swiglu_limit=7.0, router_aux_loss=0.001,
)

PRESETS: dict[str, dict[str, Any]] = {
    # openai/gpt-oss-20b and -120b config.json (gpt_oss): every layer MoE (32 / 128 experts,
    # top-4, width 2880) with a biased router and biased experts, clamped SwiGLU (alpha
    # 1.702, limit 7), biases on q, k, v, o, attention sinks, 128-token sliding-window and
    # full layers alternating, YaRN RoPE (factor 32 over 4,096 positions, theta 150,000)
    "gpt-oss-20b": llama_style(**{**_GPT_OSS, "layers": 24, "experts": 32}),
    "gpt-oss-120b": llama_style(**{**_GPT_OSS, "layers": 36, "experts": 128}),
}
