"""Llama 4's text model (``llama4_text``; transformers 5.25 ``Llama4ForCausalLM``,
models/llama4/modeling_llama4.py and configuration_llama4.py): RoPE and NoPE layers
interleaved (``no_rope_layers``: every ``no_rope_layer_interval``-th layer without RoPE),
chunked attention on the RoPE layers (``attention_chunk_size``), attention temperature
tuning on the NoPE layers (``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``),
an L2 (weightless RMS) norm of q and k after RoPE on the RoPE layers (``use_qk_norm``),
RoPE on interleaved pairs (complex multiplication), mixture-of-experts layers
(``moe_layers`` / ``interleave_moe_layer_step``) of ``num_local_experts`` experts of width
``intermediate_size`` and one shared expert of that width, the others dense MLPs of
``intermediate_size_mlp``; the router takes the top ``num_experts_per_tok`` logits, their
sigmoid scaling each chosen expert's input (Llama4TextMoe).

Weights: Llama's names with the MLP under ``feed_forward``: a dense layer's
``feed_forward.gate_proj/up_proj/down_proj``; a MoE layer's ``feed_forward.router``
(E, h), ``feed_forward.shared_expert.gate_proj/up_proj/down_proj`` and the experts fused,
stored (in, out): ``feed_forward.experts.gate_up_proj`` (E, h, 2f), gate columns ``[0, f)``,
up ``[f, 2f)``, and ``feed_forward.experts.down_proj`` (E, f, h).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from parcompile.core.families.base import (Family, HFConfigError, Source, decoder_keys, drop_none, llama_config,
                                           llama_like_problems, read_bool, read_float, read_int, read_list,
                                           read_str, rope_dict, rope_parameters, rope_scaling_keys, rope_theta,
                                           whole)
from parcompile.core.families.llama import llama_sources, llama_style
from parcompile.core.model import LLAMA4_KEYS, ModelKeys, moe_layer, rope_layer

#: transformers 5.25's Llama4TextConfig defaults of the fields that shape the model
#: (configuration_llama4.py; ``default_theta`` 500,000)
LLAMA4_DEFAULTS = {"intermediate_size": 8192, "intermediate_size_mlp": 16384, "head_dim": 128, "rms_norm_eps": 1e-5,
                   "num_experts_per_tok": 1, "num_local_experts": 16, "interleave_moe_layer_step": 1,
                   "use_qk_norm": True, "no_rope_layer_interval": 4, "attention_chunk_size": 8192,
                   "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1, "rope_theta": 500000.0,
                   "router_aux_loss_coef": 0.001}


def _interval(rope: list, layers: int) -> int:
    """``nope_layer_interval`` of a ``no_rope_layers`` list (1: RoPE, 0: NoPE per layer; one
    entry per layer, which transformers' Llama4TextAttention indexes by layer). Raises
    HFConfigError for another entry, another length or a pattern not every Nth layer."""
    if not all(x in (0, 1) and not isinstance(x, float) for x in rope):
        raise HFConfigError(f"`no_rope_layers` should hold 0 (NoPE) or 1 (RoPE) per layer, got {json.dumps(rope)}")
    if len(rope) != layers:
        raise HFConfigError(f"`no_rope_layers` has {len(rope)} entries for num_hidden_layers = {layers}",
                            help="write one entry per layer, or leave it out for `no_rope_layer_interval`'s")
    for n in [0] + list(range(1, layers + 1)):
        if [int(not (n and (i + 1) % n == 0)) for i in range(layers)] == [int(bool(x)) for x in rope[:layers]]:
            return n
    raise HFConfigError(f"`no_rope_layers` = {json.dumps(rope)}: parcompile places a NoPE layer every Nth layer",
                        help="write the list transformers makes from `no_rope_layer_interval` (0 at every "
                             "(i + 1) % N == 0), or leave it out")


def _check_layer_types(cfg: dict, layers: int, interval: int, chunk: int) -> None:
    """A config.json's ``layer_types`` (transformers 5 writes it; its Llama4TextModel picks each
    layer's mask by it, not by ``attention_chunk_size``) must be the one Llama4TextConfig
    derives: ``chunked_attention`` on the RoPE layers when there is a chunk, else
    ``full_attention``. Raises HFConfigError otherwise (a model parcompile would chunk
    differently)."""
    kinds = read_list(cfg, "layer_types")
    if kinds is None:
        return
    keys = SimpleNamespace(position="rope", nope_layer_interval=interval)
    want = ["chunked_attention" if chunk and rope_layer(keys, i) else "full_attention" for i in range(layers)]
    if kinds != want:
        raise HFConfigError(f"`layer_types` = {json.dumps(kinds)[:200]} is not the one `no_rope_layers` and "
                            f"`attention_chunk_size` give ({json.dumps(want)[:200]}): parcompile chunks the RoPE "
                            "layers' attention exactly when `attention_chunk_size` is set",
                            help="remove `layer_types`, or make it match (attention_chunk_size = null: every "
                                 "layer full_attention)")


def _moe_placement(cfg: dict, layers: int, step: int) -> tuple[int, int]:
    """(``dense_layers``, ``interleave_moe_layer_step``) of the config's ``moe_layers``
    (transformers: ``range(step - 1, layers, step)`` when absent)."""
    listed = cfg.get("moe_layers")
    if listed is None:
        return 0, step
    if not isinstance(listed, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in listed):
        raise HFConfigError(f"`moe_layers` should be a list of layer indices, got {json.dumps(listed)}")
    want = sorted(set(listed))
    if not want:
        return layers, 1
    s = want[1] - want[0] if len(want) > 1 else want[0] + 1
    dense = 0 if want[0] == s - 1 else want[0]
    keys = ModelKeys(layers=layers, hidden=1, heads=1, vocab=1, seq_len=1, experts=1, dense_layers=dense,
                     interleave_moe_layer_step=max(s, 1))
    if s < 1 or [i for i in range(layers) if moe_layer(keys, i)] != want:
        raise HFConfigError(f"`moe_layers` = {json.dumps(listed)}: parcompile's MoE layers are every Nth layer "
                            "after the leading dense ones",
                            help="`moe_layers` = range(dense + N - 1, layers, N), or `interleave_moe_layer_step`")
    return dense, s


def _keys(cfg: dict, common: dict[str, Any]) -> dict[str, Any]:
    """`model` keys of a ``llama4_text`` config.json (module docstring; absent fields take
    Llama4TextConfig's defaults, :data:`LLAMA4_DEFAULTS`)."""
    d = LLAMA4_DEFAULTS
    base = decoder_keys(cfg, common)
    layers = base["layers"]
    if read_str(cfg, "hidden_act", "silu") != "silu":
        raise HFConfigError(f"unsupported activation `{cfg['hidden_act']}` in a llama4_text config.json",
                            help="Llama 4's MLPs and experts are SwiGLU (`hidden_act` silu)")
    if read_bool(cfg, "attention_bias", False):
        raise HFConfigError("`attention_bias` = true in a llama4_text config.json cannot be mapped: it puts a bias "
                            "on o_proj too, and parcompile's `bias` puts one on every linear layer")
    rope = read_list(cfg, "no_rope_layers")
    interval = read_int(cfg, "no_rope_layer_interval", d["no_rope_layer_interval"])
    if interval == 0:   # Llama4TextConfig builds its default list with (i + 1) % interval, listed or not
        raise HFConfigError("`no_rope_layer_interval` = 0: transformers divides by it and cannot load this config",
                            help="a NoPE layer every N layers (Llama 4: 4); for none, a `no_rope_layers` of 1s")
    if rope and layers is not None:
        interval = _interval(rope, layers)
    chunk = cfg.get("attention_chunk_size", d["attention_chunk_size"])
    chunk = read_int(cfg, "attention_chunk_size") if chunk is not None else 0
    if chunk == 0 and "attention_chunk_size" in cfg:   # transformers' chunked mask divides positions by it
        raise HFConfigError("`attention_chunk_size` = 0: transformers divides positions by it",
                            help="write null for no chunked attention (our 0), or the chunk in tokens (Llama 4: 8192)")
    if layers is not None:
        _check_layer_types(cfg, layers, interval, chunk)
    tuning = cfg.get("attn_temperature_tuning", d["attn_temperature_tuning"])   # Scout's config.json writes 4
    if not isinstance(tuning, (bool, int)):
        raise HFConfigError(f"`attn_temperature_tuning` should be true or false, got {json.dumps(tuning)}")
    experts = read_int(cfg, "num_local_experts", d["num_local_experts"])
    dense, step = (_moe_placement(cfg, layers, read_int(cfg, "interleave_moe_layer_step",
                                                           d["interleave_moe_layer_step"]))
                   if layers is not None else (None, None))
    if experts == 0 and dense != layers:
        raise HFConfigError("`num_local_experts` = 0 with MoE layers (`moe_layers` / `interleave_moe_layer_step`)",
                            help="the experts each MoE layer holds (Scout: 16), or `moe_layers` = [] for dense layers")
    params = rope_dict(cfg)
    return drop_none({
        **base,
        "ffn_hidden": read_int(cfg, "intermediate_size_mlp", d["intermediate_size_mlp"]),
        "kv_heads": read_int(cfg, "num_key_value_heads"),
        "head_dim": read_int(cfg, "head_dim", d["head_dim"]),
        "norm": "rmsnorm",
        "norm_eps": read_float(cfg, "rms_norm_eps", d["rms_norm_eps"]),
        "activation": "swiglu",
        "position": "rope",
        "rope_theta": rope_theta(cfg) or d["rope_theta"],
        **rope_scaling_keys(params),
        "rope_interleave": True,
        "bias": False,
        "qkv_bias": False,
        "nope_layer_interval": interval,
        "attention_chunk_size": chunk,
        "attn_temperature_tuning": bool(tuning),
        "floor_scale": read_float(cfg, "floor_scale", d["floor_scale"]),
        "attn_scale": read_float(cfg, "attn_scale", d["attn_scale"]),
        "qk_l2_norm": read_bool(cfg, "use_qk_norm", d["use_qk_norm"]),
        "experts": experts if dense != layers else 0,
        "top_k": read_int(cfg, "num_experts_per_tok", d["num_experts_per_tok"]) if dense != layers else None,
        "expert_ffn_hidden": read_int(cfg, "intermediate_size", d["intermediate_size"]),
        "shared_experts": 1 if experts and dense != layers else 0,
        "dense_layers": dense if dense != layers else 0,
        "interleave_moe_layer_step": step,
        "scoring_func": "sigmoid",
        "norm_topk_prob": False,
        "moe_apply_probs_on_input": True,
        "router_aux_loss": read_float(cfg, "router_aux_loss_coef", d["router_aux_loss_coef"]),
    })


def _config(m: ModelKeys, common: dict) -> dict:
    """Llama4TextConfig of ``m`` (the layer lists written out)."""
    cfg = llama_config(m, common)
    cfg.pop("rope_theta")
    cfg.update(intermediate_size=m.expert_ffn_hidden, intermediate_size_mlp=m.ffn_hidden, attention_bias=False,
               num_local_experts=max(m.experts, 1), num_experts_per_tok=max(m.top_k, 1),
               moe_layers=[i for i in range(m.layers) if moe_layer(m, i)],
               interleave_moe_layer_step=m.interleave_moe_layer_step,
               no_rope_layers=[int(rope_layer(m, i)) for i in range(m.layers)],
               attention_chunk_size=m.attention_chunk_size or None,
               attn_temperature_tuning=bool(m.attn_temperature_tuning), floor_scale=whole(m.floor_scale),
               attn_scale=m.attn_scale, use_qk_norm=bool(m.qk_l2_norm), router_aux_loss_coef=m.router_aux_loss,
               rope_parameters=rope_parameters(m), output_router_logits=False)
    return cfg


def _sources(m: ModelKeys, name: str, shape: tuple[int, ...]) -> list[Source]:
    """Llama's names, with the MLP under ``feed_forward`` and the fused, transposed experts
    (module docstring)."""
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "layers" and parts[2] == "mlp":
        base = f"model.layers.{parts[1]}.feed_forward."
        f, h, E = m.expert_ffn_hidden, m.hidden, m.experts
        rest = ".".join(parts[3:])
        if rest == "router.weight":
            return [Source(base + "router.weight", shape)]
        if parts[3] == "experts" and len(parts) == 7:
            e, w = int(parts[4]), parts[5]
            if w == "w2":
                return [Source(base + "experts.down_proj", (E, f, h), lead=(e,), transpose=True)]
            return [Source(base + "experts.gate_up_proj", (E, h, 2 * f), lead=(e,), transpose=True,
                           offset=0 if w == "w1" else f)]
        names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
        shared = parts[3] == "shared"
        w = parts[4] if shared else parts[3]
        if w in names and parts[-1] == "weight":
            return [Source(base + ("shared_expert." if shared else "") + names[w] + ".weight", shape)]
    return llama_sources(m, name, shape)


def _problems(m: ModelKeys) -> list[str]:
    """What Llama 4 cannot run beyond other families' keys."""
    out = llama_like_problems(m)
    if m.bias or m.qkv_bias:
        out.append("biases")
    if not m.rope_interleave:
        out.append("rope_interleave = false (Llama 4 rotates interleaved pairs)")
    if m.experts:
        want = {"shared_experts": 1, "scoring_func": "sigmoid", "topk_method": "greedy", "norm_topk_prob": False,
                "moe_apply_probs_on_input": True, "routed_scaling_factor": 1.0}
        out += [f"{k} = {getattr(m, k)} (Llama 4 has {v})" for k, v in want.items() if getattr(m, k) != v]
    return out


def _owned(m: ModelKeys, family: Family) -> list[str]:
    return [f"{k} = {getattr(m, k)}" for k, v in LLAMA4_KEYS.items() if getattr(m, k) != v]


FAMILIES = (Family("llama4_text", "Llama4ForCausalLM", keys=_keys, config=_config, sources=_sources,
                   problems=_problems, rank=12, matches=lambda m: any(getattr(m, k) != v for k, v in LLAMA4_KEYS.items()),
                   features=frozenset({"rope_pairs", "router"}), title="Llama 4", owns={"llama4": (_owned, False)}),)

PRESETS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-4-Scout-17B-16E config.json, its text_config (llama4_text): 48 layers, every
    # one MoE (16 experts top-1, width 8192, one shared expert), a NoPE layer every 4th, chunks of
    # 8,192 on the RoPE layers, temperature tuning, L2 qk-norm, llama3 RoPE scaling
    "llama4-scout": llama_style(
        layers=48, hidden=5120, ffn_hidden=16384, heads=40, kv_heads=8, head_dim=128, vocab=202048,
        seq_len=262144, norm_eps=1e-5, rope_theta=500000.0, rope_type="llama3", rope_scaling_factor=8.0,
        rope_original_max_positions=8192, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_interleave=True,
        nope_layer_interval=4, attention_chunk_size=8192, attn_temperature_tuning=True, qk_l2_norm=True,
        experts=16, top_k=1, expert_ffn_hidden=8192, shared_experts=1, scoring_func="sigmoid", norm_topk_prob=False,
        moe_apply_probs_on_input=True, router_aux_loss=0.001,
    ),
}
