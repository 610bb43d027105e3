"""The Llama family: ``llama``, ``mistral``, ``mixtral``, ``qwen2``, ``qwen3`` and
``qwen3_moe``, one decoder (RMSNorm, SwiGLU, RoPE on the whole head) told apart by flags.

=========  ==========================================================================
llama      RMSNorm, SwiGLU, RoPE; no biases or biases on every linear layer
mistral    Llama with a sliding attention window
mixtral    routed experts (SwiGLU, no shared experts, no dense layers). Written as
           ``save_pretrained`` of transformers 5.24 writes it (and vLLM reads it):
           ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``, ``block_sparse_moe.gate``;
           transformers' own fused layout (``mlp.experts.gate_up_proj`` (E, 2f, h):
           w1 rows ``[0, f)``, w3 rows ``[f, 2f)``; ``mlp.experts.down_proj`` (E, h, f);
           ``mlp.gate``) is read too
qwen2      Llama with biases on q, k, v only (``qkv_bias`` and not ``bias``)
qwen3      Llama with qk-norm (``qk_norm``: ``self_attn.q_norm``/``k_norm``, one
           ``(head_dim,)`` weight each), its own ``head_dim``, no biases
qwen3_moe  qwen3 with routed experts (no shared experts; the first ``dense_layers``
           layers dense: ``mlp_only_layers`` = [0, ..., dense_layers - 1]; top-k
           weights renormalised or not: ``norm_topk_prob``). Written as ``save_pretrained``
           of transformers 5.24 writes it: ``mlp.experts.{e}.gate_proj/up_proj/down_proj
           .weight``, router ``mlp.gate.weight``; the fused in-memory layout
           (``mlp.experts.gate_up_proj`` (E, 2f, h), ``mlp.experts.down_proj`` (E, h, f),
           as mixtral's) is read too
=========  ==========================================================================

The presets are published models of these families (their config.json; ``seq_len`` is
``max_position_embeddings``).
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from parcompile.core.families.base import (Family, HFConfigError, Source, activation, decoder_keys, drop_none,
                                           llama_config, llama_like_problems, read_bool, read_float, read_int,
                                           read_list, read_str, rope_dict, rope_scaling_keys, rope_theta)
from parcompile.core.model import ModelKeys

#: transformers' default `max_window_layers` of Qwen2Config and Qwen3Config
QWEN_MAX_WINDOW_LAYERS = 28
#: transformers 5.24's Qwen3MoeConfig defaults of the MoE fields (what it loads when a
#: config.json leaves one out); `num_experts` is also written `num_local_experts`
QWEN3_MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1,
                      "mlp_only_layers": []}


# --------------------------------------------------------------------------- config.json -> keys


def qwen3_moe_keys(cfg: dict, layers: int | None) -> dict[str, Any]:
    """The MoE keys of a ``qwen3_moe`` config.json (transformers' Qwen3MoeConfig; absent
    fields take its defaults, :data:`QWEN3_MOE_DEFAULTS`): ``num_experts`` -> ``experts``,
    ``num_experts_per_tok`` -> ``top_k``, ``moe_intermediate_size`` ->
    ``expert_ffn_hidden``, ``norm_topk_prob``, ``router_aux_loss_coef`` ->
    ``router_aux_loss``, and ``dense_layers`` from the layer placement.

    Qwen3MoeDecoderLayer makes layer i MoE when i is not in ``mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0``; parcompile's MoE models have their first
    ``dense_layers`` layers dense and every later one MoE, so any other placement is an
    :class:`HFConfigError` naming the layers.
    """
    d = QWEN3_MOE_DEFAULTS
    experts = read_int(cfg, "num_experts", read_int(cfg, "num_local_experts", d["num_experts"]))
    step = read_int(cfg, "decoder_sparse_step", d["decoder_sparse_step"])
    step = d["decoder_sparse_step"] if step is None else step
    only = cfg.get("mlp_only_layers")
    only = d["mlp_only_layers"] if only is None else only
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise HFConfigError(f"`mlp_only_layers` in the config.json should be a list of layer indices, "
                            f"got {json.dumps(only)}")
    if step < 1:
        raise HFConfigError(f"`decoder_sparse_step` in the config.json should be at least 1, got {step}")
    dense_layers = None
    if layers is not None and experts:
        moe = [i not in only and (i + 1) % step == 0 for i in range(layers)]
        first = next((i for i, x in enumerate(moe) if x), layers)   # the leading dense layers
        dense_after = [i for i in range(first, layers) if not moe[i]]
        if dense_after:
            moe_layers = [i for i in range(layers) if moe[i]]
            raise HFConfigError(
                f"`decoder_sparse_step` = {step} with `mlp_only_layers` = {json.dumps(sorted(only))} makes "
                f"{'layers' if len(dense_after) > 1 else 'layer'} {', '.join(map(str, dense_after[:8]))}"
                f"{' ...' if len(dense_after) > 8 else ''} dense after the "
                f"mixture-of-experts layer {moe_layers[0]}: parcompile's MoE models have their first "
                "`dense_layers` layers dense and every later one mixture-of-experts",
                help="a qwen3_moe config.json parcompile imports has `decoder_sparse_step` = 1 and "
                     "`mlp_only_layers` = [0, 1, ..., N - 1] (or []), which is `dense_layers = N`")
        dense_layers = first
    return {
        "experts": experts,
        "top_k": read_int(cfg, "num_experts_per_tok", d["num_experts_per_tok"]),
        "expert_ffn_hidden": read_int(cfg, "moe_intermediate_size", d["moe_intermediate_size"]),
        "norm_topk_prob": read_bool(cfg, "norm_topk_prob", d["norm_topk_prob"]),
        "router_aux_loss": read_float(cfg, "router_aux_loss_coef", d["router_aux_loss_coef"]),
        "dense_layers": dense_layers,
    }


def _qwen_window(cfg: dict, layers: int | None, sliding: int | None) -> int | None:
    """transformers' Qwen2Config / Qwen3Config: the window is on only with
    `use_sliding_window`, and then only for the layers in `layer_types` marked
    "sliding_attention"; without `layer_types`, the layers i >= `max_window_layers`
    (default 28), so a model of at most 28 layers has none."""
    kinds = read_list(cfg, "layer_types")
    window_layers = read_int(cfg, "max_window_layers")
    if window_layers is None:
        window_layers = QWEN_MAX_WINDOW_LAYERS
    if not isinstance(kinds, list) and layers is not None:
        kinds = ["sliding_attention" if i >= window_layers else "full_attention" for i in range(layers)]
    sliding_layers = sum(k == "sliding_attention" for k in kinds) if isinstance(kinds, list) else None
    if not read_bool(cfg, "use_sliding_window", False) or sliding_layers == 0:
        return None
    if sliding_layers is not None and sliding_layers < len(kinds):
        raise HFConfigError(
            f"`use_sliding_window` with the window on {sliding_layers} of {len(kinds)} layers "
            f"(`max_window_layers` = {window_layers}) cannot be mapped: parcompile uses one attention "
            "window for every layer",
            help="set `sliding_window` in the block (0: full attention) after importing a copy "
                 "of the config.json without `use_sliding_window`")
    return sliding


#: The model types whose transformers class reads `attention_bias`.
_ATTENTION_BIAS = ("llama", "qwen3", "qwen3_moe")


def _keys(model_type: str, cfg: dict, common: dict[str, Any]) -> dict[str, Any]:
    """`model` keys of a Llama-family config.json of ``model_type``."""
    base = decoder_keys(cfg, common)
    sliding = read_int(cfg, "sliding_window")
    if model_type == "qwen3_moe" and not read_bool(cfg, "use_sliding_window", False):
        sliding = None   # Qwen3MoeConfig: the window (on every layer) only with `use_sliding_window`
    if model_type in ("qwen2", "qwen3"):
        sliding = _qwen_window(cfg, base["layers"], sliding)
    # which bias fields the model_type's transformers class reads (transformers 5.25
    # models/*/modeling_*.py): llama `attention_bias` (q, k, v, o) and `mlp_bias` (gate, up,
    # down); qwen3 and qwen3_moe `attention_bias` (q, k, v, o); qwen2 always q, k, v;
    # mistral and mixtral none, whatever their config.json says
    attention_bias = bool(read_bool(cfg, "attention_bias", False)) if model_type in _ATTENTION_BIAS else False
    mlp_bias = bool(read_bool(cfg, "mlp_bias", False)) if model_type == "llama" else False
    if model_type != "qwen2" and attention_bias != mlp_bias:
        where = ("the q, k, v and output projections but not the MLP" if attention_bias
                 else "the MLP's gate, up and down projections but not attention")
        raise HFConfigError(
            f"`attention_bias` = {str(attention_bias).lower()} with `mlp_bias` = {str(mlp_bias).lower()} "
            f"cannot be mapped: it puts biases on {where}",
            help="parcompile models biases on the QKV projection only (`qkv_bias = true`) or on every "
                 "linear layer (`bias = true`)")
    attention_dropout = read_float(cfg, "attention_dropout") or 0.0
    if attention_dropout != 0:  # every class of this family drops attention probabilities only (also -1, NaN)
        raise HFConfigError(
            f"`attention_dropout` = {attention_dropout:g} cannot be mapped: parcompile's `dropout` drops the "
            "hidden states and the attention probabilities together",
            help="set `dropout` in the model block after importing a copy of the config.json with "
                 "`attention_dropout` = 0 (it changes training only, not inference)")
    moe = qwen3_moe_keys(cfg, base["layers"]) if model_type == "qwen3_moe" else {
        "experts": read_int(cfg, "num_local_experts"), "top_k": read_int(cfg, "num_experts_per_tok")}
    return drop_none({
        **base,
        "kv_heads": read_int(cfg, "num_key_value_heads"),
        "head_dim": read_int(cfg, "head_dim"),
        "norm": "rmsnorm",
        "norm_eps": read_float(cfg, "rms_norm_eps"),
        "activation": activation(read_str(cfg, "hidden_act", "silu"), gated=True),
        "position": "rope",
        "rope_theta": rope_theta(cfg),
        **rope_scaling_keys(rope_dict(cfg)),
        "bias": attention_bias and mlp_bias,
        "qkv_bias": True if model_type == "qwen2" else attention_bias,
        "sliding_window": sliding,
        "qk_norm": True if model_type in ("qwen3", "qwen3_moe") else None,
        **moe,
    })


# --------------------------------------------------------------------------- keys -> config.json


def _config(model_type: str, m: ModelKeys, common: dict) -> dict:
    """The config.json of ``m`` as a ``model_type`` of this family."""
    cfg = llama_config(m, common)
    if model_type == "llama":
        cfg.update(attention_bias=bool(m.bias), mlp_bias=bool(m.bias))
    elif model_type == "mistral":
        cfg.update(sliding_window=m.sliding_window or None)
    elif model_type in ("qwen2", "qwen3"):
        window = m.sliding_window
        if model_type == "qwen3":
            cfg.update(attention_bias=False)
        cfg.update(use_sliding_window=bool(window), sliding_window=window or None,
                   max_window_layers=0 if window else m.layers)
    elif model_type == "qwen3_moe":
        cfg.update(attention_bias=False, use_sliding_window=bool(m.sliding_window),
                   sliding_window=m.sliding_window or None, moe_intermediate_size=m.expert_ffn_hidden,
                   num_experts=m.experts, num_experts_per_tok=m.top_k, norm_topk_prob=bool(m.norm_topk_prob),
                   router_aux_loss_coef=m.router_aux_loss, decoder_sparse_step=1,
                   mlp_only_layers=list(range(m.dense_layers)), output_router_logits=False)
    elif model_type == "mixtral":
        cfg.update(intermediate_size=m.expert_ffn_hidden, num_local_experts=m.experts,
                   num_experts_per_tok=m.top_k, router_aux_loss_coef=m.router_aux_loss,
                   sliding_window=m.sliding_window or None, output_router_logits=False)
    return cfg


# --------------------------------------------------------------------------- weights


#: our gated MLP's names -> transformers'
GATED_MLP = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def llama_sources(m: ModelKeys, name: str, shape: tuple[int, ...]) -> list[Source]:
    """LlamaForCausalLM's names (and Mixtral's experts, saved and fused)."""
    parts = name.split(".")
    simple = {
        "embedding.weight": "model.embed_tokens.weight",
        "final_norm.weight": "model.norm.weight",
    }
    if name in simple:
        return [Source(simple[name], shape)]
    i, rest = parts[1], ".".join(parts[2:])
    base = f"model.layers.{i}."
    per_layer = {
        "attn_norm.weight": "input_layernorm.weight",
        "mlp_norm.weight": "post_attention_layernorm.weight",
        "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
        "attn.wo": "self_attn.o_proj",
        "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight",
        "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj",
    }
    if rest in per_layer:
        return [Source(base + per_layer[rest], shape)]
    stem, _, kind = rest.rpartition(".")
    if stem in per_layer:
        return [Source(base + per_layer[stem] + "." + kind, shape)]
    if rest == "mlp.router.weight":
        return [Source(base + "block_sparse_moe.gate.weight", shape), Source(base + "mlp.gate.weight", shape)]
    if parts[2:4] == ["mlp", "experts"] and len(parts) == 7:
        e, w = int(parts[4]), parts[5]
        legacy = Source(f"{base}block_sparse_moe.experts.{e}.{w}.weight", shape)
        return [legacy, fused_expert_source(m, base, e, w)]
    return []


def fused_expert_source(m: ModelKeys, base: str, e: int, w: str) -> Source:
    """Expert ``e``'s ``w`` (w1, w3, w2) in transformers 5's fused in-memory layout (Mixtral,
    Qwen3-MoE): ``mlp.experts.gate_up_proj`` (E, 2f, h), w1 rows ``[0, f)``, w3 rows
    ``[f, 2f)``; ``mlp.experts.down_proj`` (E, h, f)."""
    f, h, E = m.expert_ffn_hidden, m.hidden, m.experts
    if w == "w2":
        return Source(base + "mlp.experts.down_proj", (E, h, f), lead=(e,))
    return Source(base + "mlp.experts.gate_up_proj", (E, 2 * f, h), lead=(e,), offset=0 if w == "w1" else f)


def qwen3_moe_sources(m: ModelKeys, name: str, shape: tuple[int, ...]) -> list[Source]:
    """Llama's names, with Qwen3-MoE's router and experts (module docstring): saved
    per-expert tensors first (what is written), the fused 3-D layout second."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "layers":
        base = f"model.layers.{parts[1]}."
        if ".".join(parts[2:]) == "mlp.router.weight":
            return [Source(base + "mlp.gate.weight", shape)]
        if parts[2:4] == ["mlp", "experts"] and len(parts) == 7:
            e, w = int(parts[4]), parts[5]
            return [Source(f"{base}mlp.experts.{e}.{GATED_MLP[w]}.weight", shape), fused_expert_source(m, base, e, w)]
    return llama_sources(m, name, shape)


# --------------------------------------------------------------------------- consistency


def _problems(model_type: str, m: ModelKeys) -> list[str]:
    """Why ``model_type`` of this family cannot run ``m`` (beyond other families' keys)."""
    out = llama_like_problems(m)
    if model_type == "llama" and m.qkv_bias != m.bias:
        out.append("biases on q, k, v only (Llama has none or biases on every linear layer)")
    if model_type in ("mistral", "mixtral", "qwen3", "qwen3_moe") and (m.bias or m.qkv_bias):
        out.append("biases")
    if model_type == "qwen2" and (m.bias or not m.qkv_bias):
        out.append("biases other than on q, k, v")
    if model_type == "llama" and m.sliding_window:
        out.append("sliding_window")
    if model_type in ("mixtral", "qwen3_moe"):
        if m.experts <= 0:
            out.append("no experts")
        if m.shared_experts:
            out.append(f"shared_experts = {m.shared_experts}")
        if model_type == "mixtral" and m.dense_layers:
            out.append(f"dense_layers = {m.dense_layers}")
        if model_type == "mixtral" and not m.norm_topk_prob and m.top_k > 1:
            out.append("norm_topk_prob = false (Mixtral renormalises the top_k weights)")
    elif m.experts:
        out.append(f"experts = {m.experts}")
    return out


def _family(model_type: str, architecture: str, rank: int, matches, sources=llama_sources,
            qk_norm: bool = False) -> Family:
    return Family(model_type, architecture, keys=partial(_keys, model_type), config=partial(_config, model_type),
                  sources=sources, problems=partial(_problems, model_type), matches=matches, rank=rank,
                  features=frozenset({"qk_norm"} if qk_norm else ()))


FAMILIES = (
    _family("qwen3", "Qwen3ForCausalLM", 60, lambda m: bool(m.qk_norm) and m.experts <= 0, qk_norm=True),
    _family("qwen3_moe", "Qwen3MoeForCausalLM", 61, lambda m: bool(m.qk_norm) and m.experts > 0,
            sources=qwen3_moe_sources, qk_norm=True),
    _family("mixtral", "MixtralForCausalLM", 70, lambda m: m.experts > 0 and m.activation == "swiglu"),
    _family("qwen2", "Qwen2ForCausalLM", 80, lambda m: bool(m.qkv_bias) and not m.bias),
    _family("mistral", "MistralForCausalLM", 90, lambda m: m.sliding_window > 0),
    _family("llama", "LlamaForCausalLM", 100, lambda m: True),
)


# --------------------------------------------------------------------------- presets


# pre-RMSNorm, SwiGLU MLP, RoPE, no biases, untied embeddings (the family, and the
# presets of other families that share it)
LLAMA_STYLE: dict[str, Any] = {
    "norm": "rmsnorm",
    "activation": "swiglu",
    "position": "rope",
    "bias": False,
    "tie_embeddings": False,
}


def llama_style(**values: Any) -> dict[str, Any]:
    """:data:`LLAMA_STYLE` with ``values``."""
    return {**LLAMA_STYLE, **values}


PRESETS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-2-7b-hf config.json (6,738,415,616 parameters)
    "llama2-7b": llama_style(
        layers=32, hidden=4096, ffn_hidden=11008, heads=32, kv_heads=32, vocab=32000,
        seq_len=4096, norm_eps=1e-5, rope_theta=10000.0,
    ),
    # meta-llama/Llama-2-13b-hf config.json
    "llama2-13b": llama_style(
        layers=40, hidden=5120, ffn_hidden=13824, heads=40, kv_heads=40, vocab=32000,
        seq_len=4096, norm_eps=1e-5, rope_theta=10000.0,
    ),
    # meta-llama/Llama-2-70b-hf config.json (GQA, 8 kv heads)
    "llama2-70b": llama_style(
        layers=80, hidden=8192, ffn_hidden=28672, heads=64, kv_heads=8, vocab=32000,
        seq_len=4096, norm_eps=1e-5, rope_theta=10000.0,
    ),
    # meta-llama/Meta-Llama-3-8B config.json (8,030,261,248 parameters)
    "llama3-8b": llama_style(
        layers=32, hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, vocab=128256,
        seq_len=8192, norm_eps=1e-5, rope_theta=500000.0,
    ),
    # meta-llama/Meta-Llama-3-70B config.json
    "llama3-70b": llama_style(
        layers=80, hidden=8192, ffn_hidden=28672, heads=64, kv_heads=8, vocab=128256,
        seq_len=8192, norm_eps=1e-5, rope_theta=500000.0,
    ),
    # meta-llama/Llama-3.1-405B config.json (its llama3 rope_scaling is not modelled)
    "llama3.1-405b": llama_style(
        layers=126, hidden=16384, ffn_hidden=53248, heads=128, kv_heads=8, vocab=128256,
        seq_len=131072, norm_eps=1e-5, rope_theta=500000.0,
    ),
    # mistralai/Mistral-7B-v0.1 config.json (sliding window 4096)
    "mistral-7b": llama_style(
        layers=32, hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, vocab=32000,
        seq_len=32768, norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
    ),
    # mistralai/Mixtral-8x7B-v0.1 config.json (num_local_experts 8, num_experts_per_tok 2)
    "mixtral-8x7b": llama_style(
        layers=32, hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, vocab=32000,
        seq_len=32768, norm_eps=1e-5, rope_theta=1e6, experts=8, top_k=2,
    ),
    # mistralai/Mixtral-8x22B-v0.1 config.json
    "mixtral-8x22b": llama_style(
        layers=56, hidden=6144, ffn_hidden=16384, heads=48, kv_heads=8, vocab=32768,
        seq_len=65536, norm_eps=1e-5, rope_theta=1e6, experts=8, top_k=2,
    ),
    # Qwen/Qwen2-7B config.json (QKV bias; use_sliding_window false)
    "qwen2-7b": llama_style(
        layers=28, hidden=3584, ffn_hidden=18944, heads=28, kv_heads=4, vocab=152064,
        seq_len=32768, norm_eps=1e-6, rope_theta=1e6, qkv_bias=True,
    ),
    # Qwen/Qwen2-72B config.json (QKV bias; use_sliding_window false)
    "qwen2-72b": llama_style(
        layers=80, hidden=8192, ffn_hidden=29568, heads=64, kv_heads=8, vocab=152064,
        seq_len=32768, norm_eps=1e-6, rope_theta=1e6, qkv_bias=True,
    ),
    # Qwen/Qwen3-8B config.json (qk-norm, head_dim 128, no biases; use_sliding_window false;
    # 8,190,735,360 parameters)
    "qwen3-8b": llama_style(
        layers=36, hidden=4096, ffn_hidden=12288, heads=32, kv_heads=8, head_dim=128, vocab=151936,
        seq_len=40960, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
    ),
    # Qwen/Qwen3-30B-A3B config.json (qwen3_moe: 128 experts top-8, moe_intermediate_size 768,
    # norm_topk_prob true, decoder_sparse_step 1, mlp_only_layers [], router_aux_loss_coef
    # 0.001; intermediate_size 6144 is the dense width no layer uses; 30,532,122,624 parameters)
    "qwen3-30b-a3b": llama_style(
        layers=48, hidden=2048, ffn_hidden=6144, heads=32, kv_heads=4, head_dim=128, vocab=151936,
        seq_len=40960, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, experts=128, top_k=8,
        expert_ffn_hidden=768, norm_topk_prob=True, router_aux_loss=0.001,
    ),
    # Qwen/Qwen3-235B-A22B config.json (qwen3_moe as above, moe_intermediate_size 1536,
    # 64 heads, 4 kv heads; 235,093,634,560 parameters)
    "qwen3-235b-a22b": llama_style(
        layers=94, hidden=4096, ffn_hidden=12288, heads=64, kv_heads=4, head_dim=128, vocab=151936,
        seq_len=40960, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, experts=128, top_k=8,
        expert_ffn_hidden=1536, norm_topk_prob=True, router_aux_loss=0.001,
    ),
}

