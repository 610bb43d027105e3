"""Import a Hugging Face ``config.json`` as `model` keys (`model NAME from "x.json"`).

Supported ``model_type`` values: ``llama``, ``mistral``, ``mixtral``, ``qwen2`` (the
Llama family: RMSNorm, gated MLP, RoPE), ``qwen3`` (the same with qk-norm, its own
``head_dim`` and no QKV bias: ``qk_norm = true``), ``gpt2`` (LayerNorm, GELU, learned positions,
biases, tied embeddings) and ``gpt_neox`` (LayerNorm, RoPE on ``rotary_pct`` of each head,
parallel residual). ``max_position_embeddings`` (GPT-2: ``n_positions``) becomes
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

SUPPORTED_MODEL_TYPES = ("gpt2", "gpt_neox", "llama", "mistral", "mixtral", "qwen2", "qwen3")
_LLAMA_FAMILY = ("llama", "mistral", "mixtral", "qwen2", "qwen3")
#: transformers' default `max_window_layers` of Qwen2Config and Qwen3Config
QWEN_MAX_WINDOW_LAYERS = 28

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


def _float(cfg: dict, key: str, default: Any = None) -> float | None:
    value = _get(cfg, key, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number", default)
    return float(value) if value is not None else None


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
            "layers": _int(cfg, "n_layer"),
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
        "layers": _int(cfg, "num_hidden_layers"),
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

    # the Llama family
    sliding = _int(cfg, "sliding_window")
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
    return _drop_none({
        **base,
        "kv_heads": _int(cfg, "num_key_value_heads"),
        "head_dim": _int(cfg, "head_dim"),
        "norm": "rmsnorm",
        "norm_eps": _float(cfg, "rms_norm_eps"),
        "activation": _activation(_str(cfg, "hidden_act", "silu"), gated=True),
        "position": "rope",
        "rope_theta": _rope_theta(cfg),
        "bias": bool(_bool(cfg, "attention_bias", False) and _bool(cfg, "mlp_bias", False)),
        "qkv_bias": True if model_type == "qwen2" else _bool(cfg, "attention_bias"),
        "sliding_window": sliding,
        "qk_norm": True if model_type == "qwen3" else None,
        "experts": _int(cfg, "num_local_experts"),
        "top_k": _int(cfg, "num_experts_per_tok"),
    })


def load_hf_config(path: Path) -> dict[str, Any]:
    """Read ``path`` (a ``config.json``) and return its `model` keys in SI units.

    Raises :class:`HFConfigError` when the file cannot be read, is not JSON, has an
    unsupported ``model_type`` or a field of the wrong type.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HFConfigError(f"cannot read `{path}`: no such file",
                            help="a `.json` source is resolved relative to the spec file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise HFConfigError(f"cannot read `{path}`: {e}") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise HFConfigError(f"`{path}` is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"`{path}` is not a Hugging Face config (expected a JSON object)")
    return from_hf_dict(cfg)
