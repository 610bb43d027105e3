"""What every model family module builds on (standard library only, like all of
:mod:`parcompile.core`): the :class:`Family` record a family module declares, the typed
readers of a ``config.json`` (:class:`HFConfigError` on a wrong type), the tensor
:class:`Source` of the weight maps, the ``config.json`` fields every decoder writes, and
the checks of the keys only some families have (:func:`foreign_problems`).

A model is anything with the attributes of :class:`parcompile.core.model.ModelKeys` (a
ModelKeys, or the compiler's :class:`parcompile.config.schema.ModelConfig`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from parcompile.core.model import MAX_LAYERS, ROUTER_DEFAULTS, ModelKeys, rope_scaling, rotary_dim


class HFConfigError(Exception):
    """A ``config.json`` that cannot be imported: ``message`` and an optional ``help``."""

    def __init__(self, message: str, help: str | None = None):
        super().__init__(message)
        self.message = message
        self.help = help


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint or a model: ``message`` and an optional ``help``."""

    message: str
    help: str | None = None


class HFWeightsError(Exception):
    """A model no Hugging Face family expresses, or a directory that is not a checkpoint:
    ``message`` and an optional ``help`` (like :class:`HFConfigError`)."""

    def __init__(self, message: str, help: str | None = None):
        super().__init__(message)
        self.message = message
        self.help = help

    @property
    def problem(self) -> Problem:
        return Problem(self.message, self.help)


# --------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class Family:
    """One Hugging Face ``model_type`` as parcompile reads and writes it.

    ``keys(cfg, common)``: the `model` keys of a parsed config.json (``common``: ``dtype``
    and ``vocab``, read the same for every family); raises :class:`HFConfigError`.
    ``config(m, common)``: the config.json of model ``m`` (``common``: the fields every
    family writes, :func:`parcompile.core.hf_weights.hf_config`). ``sources(m, name,
    shape)``: where our global tensor ``name`` (not the head) sits in the checkpoint.
    ``problems(m)``: why the family cannot run ``m`` beyond the keys of other families
    (:func:`foreign_problems`), each a phrase. ``matches(m)``: whether ``m`` looks like this
    family; :func:`parcompile.core.families.for_model` asks the families by ascending
    ``rank`` (the first that matches). ``features``: the keys owned by a few families that
    this one has (:data:`FEATURES`). ``title``: its name in messages (``"Gemma 3"``).
    ``head``: the HF names of the LM head, preferred first.
    """

    model_type: str
    architecture: str
    keys: Callable[[dict, dict], dict]
    config: Callable[[ModelKeys, dict], dict]
    sources: Callable[[ModelKeys, str, tuple], list]
    problems: Callable[[ModelKeys], list[str]]
    matches: Callable[[ModelKeys], bool]
    rank: int
    features: frozenset = field(default_factory=frozenset)
    title: str = ""
    head: tuple[str, ...] = ("lm_head.weight",)
    owns: dict = field(default_factory=dict)

    def has(self, feature: str) -> bool:
        """Whether this family has ``feature`` (:attr:`features` or :attr:`owns`)."""
        return feature in self.features or feature in self.owns


# --------------------------------------------------------------------------- config.json -> keys


def _get(cfg: dict, key: str, kind: Callable[[Any], bool], what: str, default: Any = None) -> Any:
    value = cfg.get(key, default)
    if value is None or kind(value):
        return value
    raise HFConfigError(f"`{key}` in the config.json should be {what}, got {json.dumps(value)}",
                        help=f"write `{key}` as {what} in the config.json, as transformers saves it")


def read_int(cfg: dict, key: str, default: Any = None) -> int | None:
    """``cfg[key]`` (else ``default``), an integer or None. Raises HFConfigError."""
    return _get(cfg, key, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer", default)


def read_layers(cfg: dict, key: str) -> int | None:
    """The layer count ``cfg[key]``: an integer of at most :data:`MAX_LAYERS` (per-layer
    lists are built from it, so a huge count would never finish). Raises HFConfigError."""
    layers = read_int(cfg, key)
    if layers is not None and layers > MAX_LAYERS:
        shown = str(layers) if layers < 10**12 else f"an integer of {len(str(layers))} digits"
        raise HFConfigError(f"`{key}` in the config.json is {shown}: more layers than parcompile plans "
                            f"(at most {MAX_LAYERS})", help="a config.json of a model of at most that many layers")
    return layers


def read_float(cfg: dict, key: str, default: Any = None) -> float | None:
    """``cfg[key]`` (else ``default``) as a float, or None. Raises HFConfigError."""
    value = _get(cfg, key, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number", default)
    try:
        return float(value) if value is not None else None
    except OverflowError:   # an integer beyond any float (10**400)
        raise HFConfigError(f"`{key}` in the config.json should be a number a float can hold, got an integer of "
                            f"{len(str(abs(value)))} digits") from None


def read_bool(cfg: dict, key: str, default: Any = None) -> bool | None:
    """``cfg[key]`` (else ``default``), true, false or None. Raises HFConfigError."""
    return _get(cfg, key, lambda v: isinstance(v, bool), "true or false", default)


def read_str(cfg: dict, key: str, default: Any = None) -> str | None:
    """``cfg[key]`` (else ``default``), a string or None. Raises HFConfigError."""
    return _get(cfg, key, lambda v: isinstance(v, str), "a string", default)


def read_dict(cfg: dict, key: str) -> dict | None:
    """``cfg[key]``, a JSON object, or None (absent or null). Raises HFConfigError for
    another type (``rope_parameters = "llama3"`` is not silently read as no scaling)."""
    return _get(cfg, key, lambda v: isinstance(v, dict), "an object", None)


def read_list(cfg: dict, key: str) -> list | None:
    """``cfg[key]``, a JSON array, or None (absent or null). Raises HFConfigError for
    another type."""
    return _get(cfg, key, lambda v: isinstance(v, list), "a list", None)


def rope_dict(cfg: dict) -> dict | None:
    """RoPE's settings: transformers 5's ``rope_parameters``, else transformers 4's
    ``rope_scaling`` (each an object or null). Raises HFConfigError for another type."""
    return read_dict(cfg, "rope_parameters") or read_dict(cfg, "rope_scaling")


_GELU = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python", "quick_gelu")


def activation(act: str | None, gated: bool) -> str | None:
    """Our activation for transformers' ``act`` in a gated MLP or not. Raises HFConfigError."""
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


def rope_param(cfg: dict, key: str) -> float | None:
    """``rope_parameters[key]``: where transformers 5 keeps RoPE's settings (None: absent)."""
    params = read_dict(cfg, "rope_parameters")
    return read_float(params, key) if params is not None else None


def rope_theta(cfg: dict) -> float | None:
    """The RoPE base: ``rope_theta`` (transformers 4), or ``rope_parameters.rope_theta``
    (transformers 5 moved it there)."""
    theta = rope_param(cfg, "rope_theta")
    return theta if theta is not None else read_float(cfg, "rope_theta")


#: transformers' RoPE scaling parameters -> our keys
_ROPE_KEYS = {"factor": "rope_scaling_factor", "original_max_position_embeddings": "rope_original_max_positions",
              "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "truncate": "rope_truncate",
              "low_freq_factor": "rope_low_freq_factor", "high_freq_factor": "rope_high_freq_factor"}


def rope_scaling_keys(params: dict | None, mscale: bool = False) -> dict[str, Any]:
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
        read = read_bool if hf_key == "truncate" else read_int if ours == "rope_original_max_positions" else read_float
        value = read(params, hf_key)
        if value is not None:
            out[ours] = value
    for key in modelled:
        out[f"rope_{key}"] = read_float(params, key, 0.0) or 0.0
    return out


def window_pattern(kinds: list, what: str) -> int:
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


def drop_none(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` without the keys whose value is None (left to their defaults)."""
    return {k: v for k, v in values.items() if v is not None}


def decoder_keys(cfg: dict, common: dict[str, Any]) -> dict[str, Any]:
    """The keys every transformers decoder config but GPT-2's names alike
    (``num_hidden_layers``, ``hidden_size``, ``intermediate_size``,
    ``num_attention_heads``, ``max_position_embeddings`` (``seq_len`` and
    ``max_positions``), ``tie_word_embeddings``, default false), beside ``common``."""
    return {
        **common,
        "layers": read_layers(cfg, "num_hidden_layers"),
        "hidden": read_int(cfg, "hidden_size"),
        "ffn_hidden": read_int(cfg, "intermediate_size"),
        "heads": read_int(cfg, "num_attention_heads"),
        "seq_len": read_int(cfg, "max_position_embeddings"),
        "max_positions": read_int(cfg, "max_position_embeddings"),
        "tie_embeddings": read_bool(cfg, "tie_word_embeddings", False),
    }


# --------------------------------------------------------------------------- keys -> config.json


#: our activation -> transformers' ``hidden_act``
HF_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "swiglu": "silu", "geglu": "gelu_pytorch_tanh"}


def whole(x: float) -> float | int:
    """``x`` as an int when it is whole (config fields transformers types ``int``)."""
    return int(x) if float(x).is_integer() else x


def rope_parameters(m: ModelKeys, partial: bool = False) -> dict:
    """transformers 5's ``rope_parameters`` of ``m``: the base and its scaling;
    ``partial``: with ``partial_rotary_factor`` (GPT-NeoX)."""
    params = {"rope_type": "default", "rope_theta": float(m.rope_theta)}
    scaling = rope_scaling(m)
    if scaling is not None:   # transformers' names already (core/hf.py reads them back)
        params.update(scaling)
        if params.get("truncate") is True:
            del params["truncate"]   # transformers' default (DeepSeek-V3's config.json has none)
    if partial:
        params["partial_rotary_factor"] = rotary_dim(m) / m.head_dim
    return params


def decoder_config(m: ModelKeys, common: dict, partial_rope: bool = False) -> dict:
    """The config.json fields every decoder but GPT-2 writes alike, beside ``common``
    (the inverse of :func:`decoder_keys`)."""
    return {**common, "hidden_size": m.hidden, "intermediate_size": m.ffn_hidden, "num_hidden_layers": m.layers,
            "num_attention_heads": m.heads, "max_position_embeddings": m.max_positions,
            "hidden_act": HF_ACTIVATIONS[m.activation], "rope_parameters": rope_parameters(m, partial_rope),
            "initializer_range": 0.02}


def llama_config(m: ModelKeys, common: dict) -> dict:
    """:func:`decoder_config` with what the Llama-derived configs add (kv heads,
    ``head_dim``, RMSNorm eps, transformers 4's ``rope_theta``, attention dropout)."""
    return {**decoder_config(m, common), "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim,
            "rms_norm_eps": m.norm_eps, "rope_theta": float(m.rope_theta), "attention_dropout": m.dropout}


def layer_types(m: ModelKeys) -> list[str]:
    """transformers' ``layer_types`` of ``m``: each layer sliding or full attention."""
    return ["sliding_attention" if w else "full_attention" for w in m.layer_windows]


# --------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class Source:
    """Where one of our global tensors (orientation ``(out, in)`` or ``(n,)``) sits in an
    HF tensor.

    ``name``/``shape``: the HF tensor and its whole shape (HF orientation). ``lead``:
    fixed leading indices (a fused expert tensor: ``(e,)``). ``transpose``: HF stores our
    2-D tensor as ``(in, out)`` (GPT-2 ``Conv1D``), so our rows are its columns. Our row
    ``r`` (dim 0) is the HF row (after ``lead``; column when transposed)
    ``(r // block) * stride + offset + r % block``; ``block = 0`` means one block
    (``offset + r``). Our columns are the HF columns (rows when transposed), unchanged.
    ``ours``: our tensor's global shape (vocabulary unpadded) under the model the map was
    made for.
    """

    name: str
    shape: tuple[int, ...]
    lead: tuple[int, ...] = ()
    transpose: bool = False
    block: int = 0
    stride: int = 0
    offset: int = 0
    ours: tuple[int, ...] = ()

    def runs(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Our rows ``[start, stop)`` as contiguous HF runs ``(our_row, hf_row, length)``."""
        if stop <= start:
            return []
        if not self.block:
            return [(start, self.offset + start, stop - start)]
        out = []
        r = start
        while r < stop:
            k, within = divmod(r, self.block)
            n = min(self.block - within, stop - r)
            out.append((r, k * self.stride + self.offset + within, n))
            r += n
        return out


# --------------------------------------------------------------------------- consistency


def router(m: ModelKeys, key: str):
    """``m``'s router key ``key`` (its default where the model has no such key)."""
    return getattr(m, key, ROUTER_DEFAULTS[key])


def _yes(value) -> str:
    return "true" if value is True else str(value)


#: the keys only Gemma has, with the value it has (the feature ``gemma``)
GEMMA_KEYS = {"zero_centered_gamma": True, "sandwich_norm": True, "scale_embeddings": True, "activation": "geglu"}


def _gemma(m: ModelKeys, family: Family) -> list[str]:
    has = family.has("gemma")
    return [f"{key} = {_yes(value)}" if not has else f"{key} = {getattr(m, key)} ({family.title} has {_yes(value)})"
            for key, value in GEMMA_KEYS.items() if (getattr(m, key) == value) != has]


def _window_pattern(m: ModelKeys, family: Family) -> list[str]:
    return [f"sliding_window_pattern = {m.sliding_window_pattern}"] if m.sliding_window_pattern else []


def _local_rope(m: ModelKeys, family: Family) -> list[str]:
    return ["rope_local_base_freq"] if m.rope_local_base_freq is not None else []


def _qk_norm(m: ModelKeys, family: Family) -> list[str]:
    has = family.has("qk_norm")
    if has and not m.qk_norm:
        return ["qk_norm = false (it has q_norm and k_norm)"]
    return ["qk_norm = true"] if m.qk_norm and not has else []


def _oss(m: ModelKeys, family: Family) -> list[str]:
    out = [f"{key} = true" for key in ("attention_sinks", "router_bias") if getattr(m, key)]
    if m.swiglu_limit is not None or m.swiglu_alpha is not None:
        out.append("swiglu_alpha / swiglu_limit")
    return out


def _mla(m: ModelKeys, family: Family) -> list[str]:
    return [f"kv_lora_rank = {m.kv_lora_rank} (multi-head latent attention: deepseek_v3)"] if m.kv_lora_rank > 0 else []


def _rope_pairs(m: ModelKeys, family: Family) -> list[str]:
    return ["rope_interleave = true"] if m.rope_interleave else []


def _router(m: ModelKeys, family: Family) -> list[str]:
    return [f"{k} = {router(m, k)} (DeepSeek's router: deepseek_v3)" for k, v in ROUTER_DEFAULTS.items()
            if m.experts and router(m, k) != v]


#: the keys only a few families have, by feature: (what a family without the feature says
#: about ``m``, whether a family with it checks it here too). A family lists its features
#: in :attr:`Family.features`; the rest of what it needs is its own ``problems``. A new
#: family's own keys are its :attr:`Family.owns` (the registry's
#: :data:`parcompile.core.families.FEATURES` adds them after these).
FEATURES: dict[str, tuple[Callable[[ModelKeys, Family], list[str]], bool]] = {
    "gemma": (_gemma, True),                  # (1 + w) sandwich RMSNorms, scaled embeddings, GeGLU
    "window_pattern": (_window_pattern, False),   # local and global layers (sliding_window_pattern)
    "local_rope": (_local_rope, False),       # a RoPE base of the local layers (rope_local_base_freq)
    "qk_norm": (_qk_norm, True),              # RMSNorm of q and k per head
    "oss": (_oss, False),                     # attention sinks, a biased router, the clamped SwiGLU
    "mla": (_mla, False),                     # multi-head latent attention (kv_lora_rank)
    "rope_pairs": (_rope_pairs, False),       # RoPE on interleaved pairs (DeepSeek-V3, Llama 4)
    "router": (_router, False),               # DeepSeek's router keys (sigmoid scores: also Llama 4's)
}


def foreign_problems(m: ModelKeys, family: Family, features: dict | None = None) -> list[str]:
    """What ``m`` has of the keys only some families have (``features``, default
    :data:`FEATURES`; the registry's table has every family's :attr:`Family.owns` too) that
    ``family`` lacks, or lacks of those ``family`` requires, each a phrase."""
    out: list[str] = []
    for feature, (check, symmetric) in (FEATURES if features is None else features).items():
        if symmetric or not family.has(feature):
            out += check(m, family)
    return out


def llama_like_problems(m: ModelKeys) -> list[str]:
    """What a pre-norm RMSNorm, SwiGLU, whole-head RoPE decoder (the Llama family) cannot
    have, each a phrase."""
    out = []
    if m.norm != "rmsnorm":
        out.append(f"norm = {m.norm} (it has RMSNorm)")
    if m.activation != "swiglu":
        out.append(f"activation = {m.activation} (it has SwiGLU)")
    if m.position != "rope":
        out.append(f"position = {m.position} (it has RoPE)")
    elif rotary_dim(m) != m.head_dim:
        out.append(f"rotary_fraction = {m.rotary_fraction} (it rotates the whole head)")
    if m.parallel_residual:
        out.append("parallel_residual = true")
    return out


__all__ = ["FEATURES", "Family", "GEMMA_KEYS", "HF_ACTIVATIONS", "HFConfigError", "HFWeightsError", "Problem",
           "Source", "activation", "decoder_config", "decoder_keys", "drop_none", "foreign_problems", "layer_types",
           "llama_config", "llama_like_problems", "read_bool", "read_dict", "read_float", "read_int", "read_layers",
           "read_list", "read_str", "rope_dict", "rope_param", "rope_parameters", "rope_scaling_keys", "rope_theta",
           "router", "whole", "window_pattern"]
