"""A model block as plain data, for the parts that must not import pydantic (the runtime,
generated programs): :class:`ModelKeys`, with the derived defaults of SPEC 1's `model`
block written once (:func:`derived_defaults`) and the padded vocabulary
(:func:`padded_vocab`). The compiler's validated model is
:class:`parcompile.config.schema.ModelConfig`, which fills its derived defaults with
:func:`derived_defaults` and pads with :func:`padded_vocab`; ``tests/test_core.py`` pins
:class:`ModelKeys`' fields and defaults to ``ModelConfig``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from parcompile.core.dtypes import DTYPE_BYTES

#: the most layers parcompile plans (the largest published dense models have under 200):
#: beyond it the graph and the schedule would take minutes to build; a spec's `layers` and an
#: imported config.json's layer count are both held to it
MAX_LAYERS = 512


def derived_defaults(keys: Mapping[str, Any]) -> dict[str, Any]:
    """The model keys left None that follow from the others (SPEC 1, `model`):
    ``kv_heads = heads``, ``head_dim = hidden // heads`` (MLA, ``kv_lora_rank > 0``:
    ``qk_nope_head_dim + qk_rope_head_dim``), ``ffn_hidden = 4 hidden``,
    ``qkv_bias = bias``, ``max_positions = seq_len``, ``top_k = 2`` with experts (else 0),
    ``expert_ffn_hidden = ffn_hidden``. Returns only the keys it fills."""
    out: dict[str, Any] = {}

    def get(k: str) -> Any:
        return out[k] if k in out else keys.get(k)

    if get("kv_heads") is None:
        out["kv_heads"] = keys["heads"]
    if get("head_dim") is None and keys.get("kv_lora_rank"):   # MLA: q and k heads are nope + rope wide
        out["head_dim"] = keys.get("qk_nope_head_dim", 0) + keys.get("qk_rope_head_dim", 0)
    if get("head_dim") is None and keys["heads"] > 0:
        out["head_dim"] = keys["hidden"] // keys["heads"]
    if get("ffn_hidden") is None:
        out["ffn_hidden"] = 4 * keys["hidden"]
    if get("qkv_bias") is None:
        out["qkv_bias"] = keys.get("bias", False)
    if get("max_positions") is None:
        out["max_positions"] = keys["seq_len"]
    if get("top_k") is None:
        out["top_k"] = 2 if keys.get("experts", 0) > 0 else 0
    if get("expert_ffn_hidden") is None:
        out["expert_ffn_hidden"] = get("ffn_hidden")
    return out


#: activations whose MLP is gated, act(x W1) * (x W3): three matrices (w1 gate, w3 up, w2 down)
GATED_ACTIVATIONS = ("swiglu", "geglu")


def rope_scaling(keys) -> dict | None:
    """The RoPE scaling of a model (``rope_type`` and its parameters, transformers' names)
    as the runtime's ``rope_tables`` takes it; None for ``rope_type = default``."""
    kind = keys.rope_type
    if kind == "default":
        return None
    out = {"rope_type": kind, "factor": float(keys.rope_scaling_factor)}
    if kind == "yarn":
        out.update(original_max_position_embeddings=keys.rope_original_max_positions, beta_fast=float(keys.rope_beta_fast),
                   beta_slow=float(keys.rope_beta_slow), truncate=bool(keys.rope_truncate))
        if keys.rope_mscale or keys.rope_mscale_all_dim:   # DeepSeek-V3's (absent elsewhere)
            out.update(mscale=float(keys.rope_mscale), mscale_all_dim=float(keys.rope_mscale_all_dim))
    elif kind == "llama3":
        out.update(original_max_position_embeddings=keys.rope_original_max_positions,
                   low_freq_factor=float(keys.rope_low_freq_factor), high_freq_factor=float(keys.rope_high_freq_factor))
    return out


def rotary_dim(keys) -> int:
    """Rotary dims per head: MLA's ``qk_rope_head_dim``, else ``head_dim * rotary_fraction``
    rounded down to even (GPT-NeoX's ``rotary_pct``). The width of the programs' RoPE tables."""
    if keys.kv_lora_rank:
        return keys.qk_rope_head_dim
    return int(keys.head_dim * keys.rotary_fraction) // 2 * 2


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 mscale ln(factor) + 1`` (1 for factor <= 1): Peng et
    al. 2023, eq. 4 (sqrt(1/t)); DeepSeek-V2/V3's ``yarn_get_mscale``, transformers'
    ``get_mscale``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_scale(keys) -> float | None:
    """The softmax scale of the attention scores when it is not ``1 / sqrt(head_dim)``
    (None then): Gemma's ``query_pre_attn_scalar ** -0.5``; MLA's ``(qk_nope + qk_rope) **
    -0.5``, times ``yarn_mscale(factor, rope_mscale_all_dim) ** 2`` under YaRN with
    ``rope_mscale_all_dim`` (transformers' DeepseekV3Attention ``yarn_apply_mscale``)."""
    if keys.query_pre_attn_scalar is not None:
        return keys.query_pre_attn_scalar ** -0.5
    if keys.kv_lora_rank and keys.rope_type != "default" and keys.rope_mscale_all_dim:
        m = yarn_mscale(keys.rope_scaling_factor, keys.rope_mscale_all_dim)
        return (keys.qk_nope_head_dim + keys.qk_rope_head_dim) ** -0.5 * m * m
    return None


def cached_tokens(window: int, tokens: int) -> int:
    """Tokens a layer of attention window ``window`` (0: full causal) keeps in its KV cache
    of a ``tokens``-long sequence: a sliding-window layer at most its window (vLLM,
    transformers' sliding-window cache). The plan (:mod:`parcompile.analysis.kv`) and the
    serve program's cache (:class:`parcompile.runtime.generate.KVCache`) size by it."""
    return min(window, tokens) if window else tokens


def layer_windows(layers: int, sliding_window: int, pattern: int) -> tuple[int, ...]:
    """The attention window of each decoder layer, in tokens (0: the whole causal context).

    ``pattern`` 0: every layer uses ``sliding_window``; ``pattern`` N >= 2: layer i (from 0)
    attends to the whole context when ``(i + 1) % N == 0`` and within the window otherwise,
    transformers' rule for Gemma 2/3 (``sliding_window_pattern``; 6: five local layers,
    then one global) and gpt-oss (2: local and global alternate, from a local one)."""
    if pattern < 2 or not sliding_window:
        return (sliding_window,) * layers
    return tuple(0 if (i + 1) % pattern == 0 else sliding_window for i in range(layers))


def padded_vocab(vocab: int, vocab_multiple: int, tp: int) -> int:
    """Megatron-LM's rule: ``ceil(vocab / (vocab_multiple * tp)) * vocab_multiple * tp``
    rows of the embedding and LM head, so that every tp rank holds the same number."""
    m = vocab_multiple * tp
    return int(math.ceil(vocab / m) * m)


@dataclass(frozen=True)
class ModelKeys:
    """The keys of a model block (SPEC 1, `model`; the fields of
    :class:`parcompile.config.schema.ModelConfig`, same names, defaults and derived
    defaults), unvalidated: what the runtime reads a model's layout from (a generated
    program's ``MODEL_KEYS``, a checkpoint's config.json). Widths are counts, not bytes.

    Raises:
        TypeError: an unknown key, or a required one (layers, hidden, heads, vocab,
            seq_len) missing.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    name: str = "model"
    kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    ffn_hidden: Optional[int] = None
    max_positions: Optional[int] = None
    norm: str = "rmsnorm"
    activation: str = "swiglu"
    position: str = "rope"
    bias: bool = False
    qkv_bias: Optional[bool] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rotary_fraction: float = 1.0
    parallel_residual: bool = False
    sliding_window: int = 0
    qk_norm: bool = False
    sliding_window_pattern: int = 0
    rope_local_base_freq: Optional[float] = None
    rope_type: str = "default"
    rope_scaling_factor: float = 1.0
    rope_original_max_positions: Optional[int] = None
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    zero_centered_gamma: bool = False
    sandwich_norm: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: Optional[float] = None
    attention_sinks: bool = False
    attention: str = "flash"
    dropout: float = 0.0
    tie_embeddings: bool = False
    dtype: str = "bf16"
    experts: int = 0
    top_k: Optional[int] = None
    expert_ffn_hidden: Optional[int] = None
    shared_experts: int = 0
    dense_layers: int = 0
    router_aux_loss: float = 0.01
    norm_topk_prob: bool = True
    router_bias: bool = False
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    swiglu_alpha: Optional[float] = None
    swiglu_limit: Optional[float] = None
    vocab_multiple: int = 128

    def __post_init__(self) -> None:
        for k, v in derived_defaults(self.as_dict()).items():
            object.__setattr__(self, k, v)   # frozen: filled once, as ModelConfig does

    def as_dict(self) -> dict[str, Any]:
        """Every key and its value."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def padded_vocab(self, tp: int) -> int:
        """:func:`padded_vocab` of this model for ``tp``."""
        return padded_vocab(self.vocab, self.vocab_multiple, tp)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the model's dtype."""
        return DTYPE_BYTES[self.dtype]

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's attention window in tokens, 0: full (:func:`layer_windows`)."""
        return layer_windows(self.layers, self.sliding_window, self.sliding_window_pattern)


#: DeepSeek-V3's router keys and their defaults (ModelKeys'), the softmax top-k every other
#: family has: the plan's router op and the programs' MoE constructors carry only the keys
#: set otherwise (runtime/moe.py: route)
ROUTER_DEFAULTS = {f.name: f.default for f in fields(ModelKeys)
                   if f.name in ("scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor")}


__all__ = ["GATED_ACTIVATIONS", "ModelKeys", "ROUTER_DEFAULTS", "attention_scale", "cached_tokens", "rotary_dim", "yarn_mscale", "rope_scaling", "derived_defaults", "layer_windows", "padded_vocab"]
