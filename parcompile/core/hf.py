"""Import a Hugging Face ``config.json`` as `model` keys (`model NAME from "x.json"`).

Supported ``model_type`` values: ``llama``, ``mistral``, ``mixtral``, ``qwen2`` (the
Llama family: RMSNorm, gated MLP, RoPE), ``qwen3`` (the same with qk-norm, its own
``head_dim`` and no QKV bias: ``qk_norm = true``), ``qwen3_moe`` (Qwen3 with routed
experts, :func:`_qwen3_moe_keys`), ``gpt2`` (LayerNorm, GELU, learned positions,
biases, tied embeddings) and ``gpt_neox`` (LayerNorm, RoPE on ``rotary_pct`` of each head,
parallel residual), ``gemma3_text`` (:func:`_gemma3_keys`), ``gpt_oss`` (:func:`_gpt_oss_keys`)
and ``deepseek_v3`` (multi-head latent attention and DeepSeek's sigmoid group-limited
router, :func:`_deepseek_v3_keys`; its multi-token-prediction layers are left out).
``max_position_embeddings`` (GPT-2: ``n_positions``) becomes
``max_positions`` (the rows of a learned position table) and the default ``seq_len``.
Keys written in the block override what the file gives.

Standard library only (:mod:`parcompile.core`): the front end (:mod:`parcompile.config.hf`
re-exports it) and the runtime (a checkpoint's layout,
:func:`parcompile.core.hf_weights.model_from_checkpoint_config`) read config.json alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from parcompile.core.dtypes import TORCH_NAMES
from parcompile.core.files import MAX_JSON_BYTES, FileReadError, json_loads, read_text
from parcompile.core.model import MAX_LAYERS

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "gemma3_text", "gpt2", "gpt_neox", "gpt_oss", "llama", "mistral", "mixtral",
                         "qwen2", "qwen3", "qwen3_moe")
_LLAMA_FAMILY = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")
#: transformers' default `max_window_layers` of Qwen2Config and Qwen3Config
QWEN_MAX_WINDOW_LAYERS = 28
#: transformers 5.24's Qwen3MoeConfig defaults of the MoE fields (what it loads when a
#: config.json leaves one out); `num_experts` is also written `num_local_experts`
QWEN3_MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1,
                      "mlp_only_layers": []}

_DTYPES = {v: k for k, v in TORCH_NAMES.items()}  # config.json's torch_dtype -> ours
_GELU = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python", "quick_gelu")


class HFConfigError(Exception):
    """A ``config.json`` that cannot be imported: ``message`` and an optional ``help``."""

    def __init__(self, message: str, help: str | None = None):
        super().__init__(message)
        self.message = message
        self.help = help


def _get(cfg: dict, key: str, kind: Callable[[Any], bool], what: str, default: Any = None) -> Any:
    value = cfg.get(key, default)
    if value is None or kind(value):
        return value
    raise HFConfigError(f"`{key}` in the config.json should be {what}, got {json.dumps(value)}")


def _int(cfg: dict, key: str, default: Any = None) -> int | None:
    return _get(cfg, key, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer", default)


def _layers(cfg: dict, key: str) -> int | None:
    """The layer count ``cfg[key]``: an integer of at most :data:`MAX_LAYERS` (per-layer
    lists are built from it, so a huge count would never finish). Raises HFConfigError."""
    layers = _int(cfg, key)
    if layers is not None and layers > MAX_LAYERS:
        shown = str(layers) if layers < 10**12 else f"an integer of {len(str(layers))} digits"
        raise HFConfigError(f"`{key}` in the config.json is {shown}: more layers than parcompile plans "
                            f"(at most {MAX_LAYERS})", help="a config.json of a model of at most that many layers")
    return layers


def _float(cfg: dict, key: str, default: Any = None) -> float | None:
    value = _get(cfg, key, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number", default)
    try:
        return float(value) if value is not None else None
    except OverflowError:   # an integer beyond any float (10**400)
        raise HFConfigError(f"`{key}` in the config.json should be a number a float can hold, got an integer of "
                            f"{len(str(abs(value)))} digits") from None


def _bool(cfg: dict, key: str, default: Any = None) -> bool | None:
    return _get(cfg, key, lambda v: isinstance(v, bool), "true or false", default)


def _str(cfg: dict, key: str, default: Any = None) -> str | None:
    return _get(cfg, key, lambda v: isinstance(v, str), "a string", default)


def _activation(act: str | None, gated: bool) -> str | None:
    if act is None:
        return None
    if act in ("silu", "swish") and gated:
        return "swiglu"
    if act in _GELU:
        return "gelu"
    if act == "relu":
        return "relu"
    raise HFConfigError(f"unsupported activation `{act}` in the config.json",
                        help="parcompile models gelu, relu and swiglu (silu in a gated MLP)")


def _rope_param(cfg: dict, key: str) -> float | None:
    """``rope_parameters[key]``: where transformers 5 keeps RoPE's settings (None: absent)."""
    params = cfg.get("rope_parameters")
    return _float(params, key) if isinstance(params, dict) else None


def _rope_theta(cfg: dict) -> float | None:
    """The RoPE base: ``rope_theta`` (transformers 4), or ``rope_parameters.rope_theta``
    (transformers 5 moved it there)."""
    theta = _rope_param(cfg, "rope_theta")
    return theta if theta is not None else _float(cfg, "rope_theta")


#: transformers' RoPE scaling parameters -> our keys
_ROPE_KEYS = {"factor": "rope_scaling_factor", "original_max_position_embeddings": "rope_original_max_positions",
              "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "truncate": "rope_truncate",
              "low_freq_factor": "rope_low_freq_factor", "high_freq_factor": "rope_high_freq_factor"}


def _rope_scaling_keys(params: dict | None, mscale: bool = False) -> dict[str, Any]:
    """Our RoPE scaling keys from transformers' ``rope_parameters`` (or transformers 4's
    ``rope_scaling``) dict: ``rope_type`` default, linear, yarn or llama3 and their
    parameters (:data:`_ROPE_KEYS`). ``mscale`` (DeepSeek-V3, whose YaRN sets them): YaRN's
    ``mscale`` / ``mscale_all_dim`` become ``rope_mscale`` / ``rope_mscale_all_dim`` (absent:
    0), as transformers' ``_compute_yarn_parameters`` and DeepseekV3Attention read them.
    Raises :class:`HFConfigError` for another type (dynamic, longrope), a YaRN
    ``attention_factor``, or (``mscale`` false, or a type other than yarn) an ``mscale`` /
    ``mscale_all_dim`` parcompile does not model."""
    if not isinstance(params, dict):
        return {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return {}
    if kind not in ("linear", "yarn", "llama3"):
        raise HFConfigError(f"RoPE scaling `{kind}` is not modelled",
                            help="parcompile models rope_type default, linear, yarn and llama3")
    modelled = ("mscale", "mscale_all_dim") if mscale and kind == "yarn" else ()
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if key not in modelled and params.get(key) not in (None, 1, 1.0, 0):
            raise HFConfigError(f"YaRN `{key}` = {json.dumps(params[key])} is not modelled",
                                help="parcompile's yarn scales cos and sin by 0.1 ln(factor) + 1 (the paper's)")
    out: dict[str, Any] = {"rope_type": kind}
    for hf_key, ours in _ROPE_KEYS.items():   # typed as transformers reads them (HFConfigError otherwise)
        read = _bool if hf_key == "truncate" else _int if ours == "rope_original_max_positions" else _float
        value = read(params, hf_key)
        if value is not None:
            out[ours] = value
    for key in modelled:
        out[f"rope_{key}"] = _float(params, key, 0.0) or 0.0
    return out


def _qwen3_moe_keys(cfg: dict, layers: int | None) -> dict[str, Any]:
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
    experts = _int(cfg, "num_experts", _int(cfg, "num_local_experts", d["num_experts"]))
    step = _int(cfg, "decoder_sparse_step", d["decoder_sparse_step"])
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
        "top_k": _int(cfg, "num_experts_per_tok", d["num_experts_per_tok"]),
        "expert_ffn_hidden": _int(cfg, "moe_intermediate_size", d["moe_intermediate_size"]),
        "norm_topk_prob": _bool(cfg, "norm_topk_prob", d["norm_topk_prob"]),
        "router_aux_loss": _float(cfg, "router_aux_loss_coef", d["router_aux_loss_coef"]),
        "dense_layers": dense_layers,
    }


#: transformers 5.24's Gemma3TextConfig defaults of the fields that shape the model
GEMMA3_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
                   "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "rms_norm_eps": 1e-6,
                   "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}


def _window_pattern(kinds: list, what: str) -> int:
    """``sliding_window_pattern`` N of a ``layer_types`` list (layer i full when ``(i + 1) %
    N == 0``, :func:`parcompile.core.model.layer_windows`); 0 when every layer is a
    sliding one. Raises :class:`HFConfigError` for another arrangement."""
    full = [i for i, k in enumerate(kinds) if k == "full_attention"]
    if any(k not in ("full_attention", "sliding_attention") for k in kinds):
        raise HFConfigError(f"`layer_types` in the config.json should hold \"full_attention\" and "
                            f"\"sliding_attention\", got {json.dumps(sorted(set(map(str, kinds))))}")
    if not full:
        return 0
    n = full[0] + 1
    if n >= 2 and all((k == "full_attention") == ((i + 1) % n == 0) for i, k in enumerate(kinds)):
        return n
    raise HFConfigError(
        f"{what}: `layer_types` puts full attention on layers {', '.join(map(str, full[:8]))}"
        f"{' ...' if len(full) > 8 else ''}, not on every Nth layer",
        help="parcompile's `sliding_window_pattern` = N makes layers N-1, 2N-1, ... full attention; "
             "write the block's keys by hand for another arrangement")


def _gemma3_keys(cfg: dict, base: dict[str, Any]) -> dict[str, Any]:
    """`model` keys of a ``gemma3_text`` config.json (transformers' Gemma3TextConfig;
    absent fields take its defaults, :data:`GEMMA3_DEFAULTS`): RMSNorm scaled by ``1 +
    w`` (``zero_centered_gamma``) before and after each sub-layer (``sandwich_norm``),
    embeddings times sqrt(hidden), GeGLU (``gelu_pytorch_tanh``), qk-norm, scores scaled by
    ``query_pre_attn_scalar ** -0.5``, local (``sliding_attention``) and global layers
    (``layer_types`` or ``sliding_window_pattern``) with their own RoPE bases
    (``rope_parameters.sliding_attention`` / ``full_attention``, or ``rope_local_base_freq``
    / ``rope_theta``); linear RoPE scaling of the global layers (``rope_type = linear``).
    """
    d = GEMMA3_DEFAULTS
    act = _str(cfg, "hidden_activation", _str(cfg, "hidden_act", d["hidden_activation"]))
    if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        raise HFConfigError(f"unsupported activation `{act}` in a gemma3_text config.json",
                            help="parcompile models Gemma's GeGLU with the tanh GELU (gelu_pytorch_tanh)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise HFConfigError(f"`{key}` = {json.dumps(cfg[key])}: logit soft-capping is not modelled",
                                help=f"set `{key}` to null in a copy of the config.json (Gemma 3 has none)")
    if _bool(cfg, "use_bidirectional_attention", False):
        raise HFConfigError("`use_bidirectional_attention` = true: parcompile models causal decoders only")
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list):
        pattern = _window_pattern(kinds, "gemma3_text")
    else:
        pattern = _int(cfg, "sliding_window_pattern", d["sliding_window_pattern"])
    window = _int(cfg, "sliding_window", d["sliding_window"])
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    full = params.get("full_attention") if isinstance(params.get("full_attention"), dict) else {}
    local = params.get("sliding_attention") if isinstance(params.get("sliding_attention"), dict) else {}
    scaling = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else {}
    full = {**scaling, **full}
    if local.get("rope_type", "default") != "default":
        raise HFConfigError(f"RoPE scaling `{local.get('rope_type')}` of the sliding-window layers is not modelled")
    theta = _float(full, "rope_theta", _float(cfg, "rope_theta", d["rope_theta"]))
    local_theta = _float(local, "rope_theta", _float(cfg, "rope_local_base_freq", d["rope_local_base_freq"]))
    has_local = bool(window)           # some layer attends within the window
    return _drop_none({
        **base,
        "tie_embeddings": _bool(cfg, "tie_word_embeddings", d["tie_word_embeddings"]),
        "kv_heads": _int(cfg, "num_key_value_heads"),
        "head_dim": _int(cfg, "head_dim", d["head_dim"]),
        "norm": "rmsnorm",
        "norm_eps": _float(cfg, "rms_norm_eps", d["rms_norm_eps"]),
        "zero_centered_gamma": True,
        "sandwich_norm": True,
        "scale_embeddings": True,
        "activation": "geglu",
        "position": "rope",
        "rope_theta": theta,
        "rope_local_base_freq": local_theta if has_local else None,
        **_rope_scaling_keys(full),
        "qk_norm": True,
        "query_pre_attn_scalar": _float(cfg, "query_pre_attn_scalar", d["query_pre_attn_scalar"]),
        "sliding_window": window or 0,
        "sliding_window_pattern": pattern if window and pattern else None,
        "bias": False,
        "qkv_bias": _bool(cfg, "attention_bias", False),
    })


#: transformers 5.24's GptOssConfig defaults of the fields that shape the model
GPT_OSS_DEFAULTS = {"num_local_experts": 128, "num_experts_per_tok": 4, "head_dim": 64, "sliding_window": 128,
                    "rms_norm_eps": 1e-5, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001,
                    "attention_bias": True,
                    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "truncate": False, "original_max_position_embeddings": 4096,
                                        "rope_theta": 150000.0}}


def _gpt_oss_keys(cfg: dict, base: dict[str, Any]) -> dict[str, Any]:
    """`model` keys of a ``gpt_oss`` config.json (transformers' GptOssConfig; absent fields
    take its defaults, :data:`GPT_OSS_DEFAULTS`): every layer a MoE layer of
    ``num_local_experts`` experts of width ``intermediate_size``, top ``num_experts_per_tok``
    by a biased router (softmax over the top-k logits: ``norm_topk_prob``), experts with
    biases and the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``), biases on q, k, v, o,
    attention sinks, sliding-window and full layers alternating (``layer_types``), YaRN RoPE."""
    d = GPT_OSS_DEFAULTS
    kinds = cfg.get("layer_types")
    pattern = _window_pattern(kinds, "gpt_oss") if isinstance(kinds, list) else 2
    window = _int(cfg, "sliding_window", d["sliding_window"])
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else d["rope_parameters"]
    theta = _float(rope, "rope_theta", _float(cfg, "rope_theta", 150000.0))
    if not _bool(cfg, "attention_bias", d["attention_bias"]):
        raise HFConfigError("`attention_bias` = false in a gpt_oss config.json cannot be mapped: its experts have "
                            "biases, and parcompile's `bias` puts them on every linear layer")
    ffn = _int(cfg, "intermediate_size")
    return _drop_none({
        **base,
        "kv_heads": _int(cfg, "num_key_value_heads"),
        "head_dim": _int(cfg, "head_dim", d["head_dim"]),
        "norm": "rmsnorm",
        "norm_eps": _float(cfg, "rms_norm_eps", d["rms_norm_eps"]),
        "activation": "swiglu",
        "swiglu_alpha": _float(cfg, "swiglu_alpha", d["swiglu_alpha"]),
        "swiglu_limit": _float(cfg, "swiglu_limit", d["swiglu_limit"]),
        "position": "rope",
        "rope_theta": theta,
        **_rope_scaling_keys(rope),
        "bias": True,
        "qkv_bias": True,
        "attention_sinks": True,
        "sliding_window": window or 0,
        "sliding_window_pattern": pattern if window and pattern else None,
        "experts": _int(cfg, "num_local_experts", d["num_local_experts"]),
        "top_k": _int(cfg, "num_experts_per_tok", d["num_experts_per_tok"]),
        "expert_ffn_hidden": ffn,
        "ffn_hidden": ffn,
        "router_bias": True,
        "norm_topk_prob": True,
        "router_aux_loss": _float(cfg, "router_aux_loss_coef", d["router_aux_loss_coef"]),
    })


#: transformers 5.24's DeepseekV3Config defaults of the fields that shape the model (what it
#: loads when a config.json leaves one out); `n_routed_experts` is also written
#: `num_local_experts`, `num_nextn_predict_layers` also `num_mtp_layers`
DEEPSEEK_V3_DEFAULTS = {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                        "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
                        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
                        "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                        "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
                        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                        "rope_interleave": True, "attention_bias": False, "rope_theta": 10000.0}
#: what transformers' DeepseekV3TopkRouter always does, whatever the config.json says
#: (these fields come from DeepSeek's own modelling code, which transformers ignores)
_DEEPSEEK_ROUTER = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def _deepseek_v3_keys(cfg: dict, common: dict[str, Any]) -> dict[str, Any]:
    """`model` keys of a ``deepseek_v3`` config.json (transformers' DeepseekV3Config; absent
    fields take its defaults, :data:`DEEPSEEK_V3_DEFAULTS`).

    Multi-head latent attention: ``q_lora_rank`` (null: one query projection, our 0),
    ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
    ``rope_interleave``; our ``head_dim`` is ``qk_nope_head_dim + qk_rope_head_dim``
    (derived: the file's ``head_dim`` is transformers' RoPE width, ``qk_rope_head_dim``).
    ``num_key_value_heads`` must equal the heads (DeepseekV3Attention up-projects a key and a
    value per head). YaRN RoPE with ``mscale`` / ``mscale_all_dim`` (:func:`_rope_scaling_keys`).

    Mixture of experts: the first ``first_k_dense_replace`` layers dense (``dense_layers``;
    all of them: ``experts = 0``), then ``n_routed_experts`` experts of width
    ``moe_intermediate_size``, top ``num_experts_per_tok``, ``n_shared_experts`` shared
    experts of that width, and DeepseekV3TopkRouter's sigmoid scores with the per-expert
    ``e_score_correction_bias`` for choosing (``scoring_func = "sigmoid"``,
    ``topk_method = "noaux_tc"``; a config.json naming another is refused: transformers does
    not run it), ``n_group`` / ``topk_group``, ``norm_topk_prob``,
    ``routed_scaling_factor``. ``router_aux_loss`` is DeepSeek's ``aux_loss_alpha`` (the
    published config.json's 0.001, the weight of its complementary balance loss), 0 when the
    file has none: transformers' DeepseekV3 computes no auxiliary loss (DeepSeek-V3 balances
    by the bias).

    Left out: the multi-token-prediction layers (``num_nextn_predict_layers``, or
    ``num_mtp_layers``; DeepSeek-V3's checkpoint holds one, ``model.layers.61.*``), which
    transformers' DeepseekV3ForCausalLM does not run either: the field is ignored.

    Raises :class:`HFConfigError`: ``attention_bias`` true (biases on q_a_proj,
    kv_a_proj_with_mqa and o_proj only), ``num_key_value_heads`` != heads, an activation
    other than silu, another ``scoring_func`` / ``topk_method``.
    """
    c = {**DEEPSEEK_V3_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k == "q_lora_rank"}}
    if "n_routed_experts" not in cfg and cfg.get("num_local_experts") is not None:
        c["n_routed_experts"] = cfg["num_local_experts"]
    heads = _int(c, "num_attention_heads")
    kv_heads = _int(c, "num_key_value_heads", heads)
    if kv_heads != heads:
        raise HFConfigError(f"`num_key_value_heads` = {kv_heads} with {heads} heads in a deepseek_v3 config.json "
                            "cannot be mapped: multi-head latent attention up-projects a key and a value for "
                            "every head", help="set `num_key_value_heads` to `num_attention_heads` (or remove it)")
    if _bool(c, "attention_bias"):
        raise HFConfigError("`attention_bias` = true in a deepseek_v3 config.json cannot be mapped: it puts biases "
                            "on q_a_proj, kv_a_proj_with_mqa and o_proj only",
                            help="parcompile models biases on the QKV projections only (`qkv_bias = true`) or "
                                 "on every linear layer (`bias = true`)")
    for key, value in _DEEPSEEK_ROUTER.items():
        got = _str(c, key, value)
        if got != value:
            raise HFConfigError(f"`{key}` = {json.dumps(got)} in a deepseek_v3 config.json: transformers' "
                                f"DeepseekV3 router always runs `{key}` = \"{value}\"",
                                help=f"remove `{key}` from a copy of the config.json to import the model as "
                                     "transformers runs it")
    layers = _layers(c, "num_hidden_layers")
    dense = _int(c, "first_k_dense_replace")
    experts = _int(c, "n_routed_experts")
    moe = bool(experts) and (layers is None or dense is None or dense < layers)
    q_lora = _int(c, "q_lora_rank")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    theta = _rope_theta(cfg)
    max_pos = _int(c, "max_position_embeddings")
    return _drop_none({
        **common,
        "vocab": _int(c, "vocab_size"),
        "layers": layers,
        "hidden": _int(c, "hidden_size"),
        "ffn_hidden": _int(c, "intermediate_size"),
        "heads": heads,
        "kv_heads": kv_heads,
        "seq_len": max_pos,
        "max_positions": max_pos,
        "tie_embeddings": _bool(c, "tie_word_embeddings"),
        "norm": "rmsnorm",
        "norm_eps": _float(c, "rms_norm_eps"),
        "activation": _activation(_str(c, "hidden_act"), gated=True),
        "position": "rope",
        "rope_theta": theta if theta is not None else DEEPSEEK_V3_DEFAULTS["rope_theta"],
        **_rope_scaling_keys(rope, mscale=True),
        "bias": False,
        "qkv_bias": False,
        "q_lora_rank": q_lora or 0,
        "kv_lora_rank": _int(c, "kv_lora_rank"),
        "qk_nope_head_dim": _int(c, "qk_nope_head_dim"),
        "qk_rope_head_dim": _int(c, "qk_rope_head_dim"),
        "v_head_dim": _int(c, "v_head_dim"),
        "rope_interleave": _bool(c, "rope_interleave"),
        **({
            "experts": experts,
            "top_k": _int(c, "num_experts_per_tok"),
            "expert_ffn_hidden": _int(c, "moe_intermediate_size"),
            "shared_experts": _int(c, "n_shared_experts"),
            "dense_layers": dense,
            "norm_topk_prob": _bool(c, "norm_topk_prob"),
            "router_aux_loss": _float(cfg, "aux_loss_alpha", 0.0) or 0.0,
            **_DEEPSEEK_ROUTER,
            "n_group": _int(c, "n_group"),
            "topk_group": _int(c, "topk_group"),
            "routed_scaling_factor": _float(c, "routed_scaling_factor"),
        } if moe else {"experts": 0}),
    })


def _drop_none(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def from_hf_dict(cfg: dict) -> dict[str, Any]:
    """`model` keys from a parsed ``config.json``. Raises :class:`HFConfigError`."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFConfigError(
            f"unsupported Hugging Face model_type {json.dumps(model_type)}",
            help="supported: " + ", ".join(SUPPORTED_MODEL_TYPES),
        )
    dtype = _str(cfg, "torch_dtype") or _str(cfg, "dtype")   # transformers 5 writes `dtype`
    common = {"dtype": _DTYPES.get(dtype) if dtype else None, "vocab": _int(cfg, "vocab_size")}

    if model_type == "gpt2":
        hidden = _int(cfg, "n_embd")
        return _drop_none({
            **common,
            "layers": _layers(cfg, "n_layer"),
            "hidden": hidden,
            "heads": _int(cfg, "n_head"),
            "ffn_hidden": _int(cfg, "n_inner"),       # None: 4 * hidden, the default
            "seq_len": _int(cfg, "n_positions"),
            "max_positions": _int(cfg, "n_positions"),
            "norm": "layernorm",
            "norm_eps": _float(cfg, "layer_norm_epsilon"),
            "activation": _activation(_str(cfg, "activation_function", "gelu_new"), gated=False),
            "position": "learned",
            "bias": True,
            "tie_embeddings": _bool(cfg, "tie_word_embeddings", True),
        })

    base = {
        **common,
        "layers": _layers(cfg, "num_hidden_layers"),
        "hidden": _int(cfg, "hidden_size"),
        "ffn_hidden": _int(cfg, "intermediate_size"),
        "heads": _int(cfg, "num_attention_heads"),
        "seq_len": _int(cfg, "max_position_embeddings"),
        "max_positions": _int(cfg, "max_position_embeddings"),
        "tie_embeddings": _bool(cfg, "tie_word_embeddings", False),
    }
    if model_type == "gpt_neox":
        return _drop_none({
            **base,
            "norm": "layernorm",
            "norm_eps": _float(cfg, "layer_norm_eps"),
            "activation": _activation(_str(cfg, "hidden_act", "gelu"), gated=False),
            "position": "rope",
            "rotary_fraction": _float(cfg, "rotary_pct", _rope_param(cfg, "partial_rotary_factor")),
            "rope_theta": _float(cfg, "rotary_emb_base", _rope_theta(cfg)),
            "parallel_residual": _bool(cfg, "use_parallel_residual", True),
            "bias": True,
        })
    if model_type == "gemma3_text":
        return _gemma3_keys(cfg, base)
    if model_type == "gpt_oss":
        return _gpt_oss_keys(cfg, base)
    if model_type == "deepseek_v3":
        return _deepseek_v3_keys(cfg, {"dtype": common["dtype"]})

    # the Llama family
    sliding = _int(cfg, "sliding_window")
    if model_type == "qwen3_moe" and not _bool(cfg, "use_sliding_window", False):
        sliding = None   # Qwen3MoeConfig: the window (on every layer) only with `use_sliding_window`
    if model_type in ("qwen2", "qwen3"):
        # transformers (Qwen2Config / Qwen3Config): the window is on only with
        # `use_sliding_window`, and then only for the layers in `layer_types` marked
        # "sliding_attention"; without `layer_types`, the layers i >= `max_window_layers`
        # (default 28), so a model of at most 28 layers has none
        layers = base["layers"]
        kinds = cfg.get("layer_types")
        window_layers = _int(cfg, "max_window_layers")
        if window_layers is None:
            window_layers = QWEN_MAX_WINDOW_LAYERS
        if not isinstance(kinds, list) and layers is not None:
            kinds = ["sliding_attention" if i >= window_layers else "full_attention" for i in range(layers)]
        sliding_layers = sum(k == "sliding_attention" for k in kinds) if isinstance(kinds, list) else None
        if not _bool(cfg, "use_sliding_window", False) or sliding_layers == 0:
            sliding = None
        elif sliding_layers is not None and sliding_layers < len(kinds):
            raise HFConfigError(
                f"`use_sliding_window` with the window on {sliding_layers} of {len(kinds)} layers "
                f"(`max_window_layers` = {window_layers}) cannot be mapped: parcompile uses one attention "
                "window for every layer",
                help="set `sliding_window` in the block (0: full attention) after importing a copy "
                     "of the config.json without `use_sliding_window`")
    attention_bias = _bool(cfg, "attention_bias", False)
    mlp_bias = _bool(cfg, "mlp_bias", False)
    if model_type != "qwen2" and attention_bias and not mlp_bias:
        raise HFConfigError(
            "`attention_bias` = true with `mlp_bias` = false cannot be mapped: it puts biases on the "
            "q, k, v and output projections",
            help="parcompile models biases on the QKV projection only (`qkv_bias = true`) or on every "
                 "linear layer (`bias = true`)")
    moe = _qwen3_moe_keys(cfg, base["layers"]) if model_type == "qwen3_moe" else {
        "experts": _int(cfg, "num_local_experts"), "top_k": _int(cfg, "num_experts_per_tok")}
    return _drop_none({
        **base,
        "kv_heads": _int(cfg, "num_key_value_heads"),
        "head_dim": _int(cfg, "head_dim"),
        "norm": "rmsnorm",
        "norm_eps": _float(cfg, "rms_norm_eps"),
        "activation": _activation(_str(cfg, "hidden_act", "silu"), gated=True),
        "position": "rope",
        "rope_theta": _rope_theta(cfg),
        **_rope_scaling_keys(cfg.get("rope_parameters") or cfg.get("rope_scaling")),
        "bias": bool(_bool(cfg, "attention_bias", False) and _bool(cfg, "mlp_bias", False)),
        "qkv_bias": True if model_type == "qwen2" else _bool(cfg, "attention_bias"),
        "sliding_window": sliding,
        "qk_norm": True if model_type in ("qwen3", "qwen3_moe") else None,
        **moe,
    })


def load_hf_config(path: Path) -> dict[str, Any]:
    """Read ``path`` (a ``config.json``) and return its `model` keys in SI units.

    Raises :class:`HFConfigError` when the file cannot be read, is not JSON, has an
    unsupported ``model_type`` or a field of the wrong type.
    """
    try:
        text = read_text(path, MAX_JSON_BYTES)   # a regular file only, size-limited
    except FileNotFoundError:
        raise HFConfigError(f"cannot read `{path}`: no such file",
                            help="a `.json` source is resolved relative to the spec file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise HFConfigError(f"cannot read `{path}`: it {e.strerror}" if isinstance(e, FileReadError) else
                            f"cannot read `{path}`: {e}",
                            help="give the `config.json` file of a Hugging Face checkpoint") from None
    try:
        cfg = json_loads(text)
    except json.JSONDecodeError as e:
        raise HFConfigError(f"`{path}` is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"`{path}` is not a Hugging Face config (expected a JSON object)")
    return from_hf_dict(cfg)
