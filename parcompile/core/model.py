"""A model block as plain data, for the parts that must not import pydantic (the runtime,
generated programs): :class:`ModelKeys`, the one declaration of SPEC 1's `model` keys
(names, order, defaults, the values each takes), with the derived defaults written once
(:func:`derived_defaults`) and the padded vocabulary (:func:`padded_vocab`). The
compiler's validated model :class:`parcompile.config.schema.ModelConfig` is built from
its fields and fills its derived defaults with :func:`derived_defaults`; the front end's
key table reads :data:`MODEL_KEY_CHECKS`.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
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


#: bytes of the buffer in which a serve engine's leader broadcasts each step's plan to its
#: replica's other ranks (runtime/serve/paged.py ``broadcast_plan``: one broadcast while the
#: plan's JSON text and its 8-byte length fit, a second for the rest; analysis/serve.py
#: times it). A size chosen, not measured from a source: the compact JSON of a decode step
#: (32-hex request ids, one token, a 16-block table per row) is 4,300 bytes at 32 rows,
#: 8,524 at 64 and 16,972 at 128 (json.dumps, measured on this machine), so decode steps
#: up to about 120 sequences take one broadcast; a prefill chunk's token ids take a second
STEP_PLAN_BYTES = 16384


def cached_tokens(window: int, tokens: int) -> int:
    """Tokens a layer of attention window ``window`` (0: full causal) keeps in its KV cache
    of a ``tokens``-long sequence: a sliding-window layer at most its window (vLLM,
    transformers' sliding-window cache). The plan (:mod:`parcompile.analysis.kv`) and the
    serve program's cache (:class:`parcompile.runtime.serve.generate.KVCache`) size by it."""
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


def rope_layer(keys, i: int) -> bool:
    """Whether layer ``i`` of a model (ModelKeys or ModelConfig) applies RoPE: ``position =
    rope`` and not one of every ``nope_layer_interval`` (transformers' Llama4TextConfig
    ``no_rope_layers``: 0 at (i + 1) % no_rope_layer_interval == 0)."""
    n = keys.nope_layer_interval
    return keys.position == "rope" and not (n and (i + 1) % n == 0)


def moe_layer(keys, i: int) -> bool:
    """Whether layer ``i`` of a model is a mixture-of-experts layer: it has experts, and
    from ``dense_layers`` on every ``interleave_moe_layer_step``-th ((i + 1) % step == 0,
    transformers' Llama4TextConfig ``moe_layers``)."""
    return keys.experts > 0 and i >= keys.dense_layers and (i + 1) % keys.interleave_moe_layer_step == 0


def padded_vocab(vocab: int, vocab_multiple: int, tp: int) -> int:
    """Megatron-LM's rule: ``ceil(vocab / (vocab_multiple * tp)) * vocab_multiple * tp``
    rows of the embedding and LM head, so that every tp rank holds the same number."""
    m = vocab_multiple * tp
    return int(math.ceil(vocab / m) * m)


@dataclass(frozen=True)
class KeyCheck:
    """What values a model key takes (the front end's ``KeyType`` of it, same field names):
    ``kind`` int, float, bool, enum (one of ``choices``) or fraction; numbers within
    ``low``/``high``, open when ``*_open``."""

    kind: str
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    high_open: bool = False
    choices: tuple = ()


COUNT = KeyCheck("int", low=1)
#: A context length in tokens: at most 2**24 (16,777,216; the longest published context,
#: Llama 4 Scout's, is 10,485,760), so that a typo such as 10**12 is an error at the key
#: and not a rank that dies allocating its position tables.
CONTEXT = KeyCheck("int", low=1, high=2**24)
NONNEG_INT = KeyCheck("int", low=0)
POSITIVE = KeyCheck("float", low=0, low_open=True)
NONNEG = KeyCheck("float", low=0)
BOOL = KeyCheck("bool")


def enum(*choices: str) -> KeyCheck:
    """A key that takes one of ``choices``."""
    return KeyCheck("enum", choices=choices)


def key(default: Any = MISSING, check: KeyCheck | None = None):
    """A field of :class:`ModelKeys`: its default (none: required) and its :class:`KeyCheck`
    (None: not a key of the block, the block's name)."""
    return field(default=default, metadata={"check": check})


@dataclass(frozen=True, kw_only=True)
class ModelKeys:
    """The keys of a model block (SPEC 1, `model`), their defaults and the values each
    takes, declared once: the compiler's validated
    :class:`parcompile.config.schema.ModelConfig` is built from these fields (same
    names, order, defaults and derived defaults; enums as ``Literal``), and the front
    end's key table (:data:`parcompile.frontend.build.KEYS`) from their checks.
    Unvalidated: what the runtime reads a model's layout from (a generated program's
    ``MODEL_KEYS``, a checkpoint's config.json). Widths are counts, not bytes.

    Raises:
        TypeError: an unknown key, or a required one (layers, hidden, heads, vocab,
            seq_len) missing.
    """

    name: str = key("model")
    layers: int = key(check=COUNT)
    hidden: int = key(check=COUNT)
    heads: int = key(check=COUNT)
    kv_heads: Optional[int] = key(None, COUNT)
    head_dim: Optional[int] = key(None, COUNT)
    ffn_hidden: Optional[int] = key(None, COUNT)
    vocab: int = key(check=COUNT)
    seq_len: int = key(check=CONTEXT)
    max_positions: Optional[int] = key(None, CONTEXT)
    norm: str = key("rmsnorm", enum("layernorm", "rmsnorm"))
    activation: str = key("swiglu", enum("gelu", "relu", "swiglu", "geglu"))
    position: str = key("rope", enum("rope", "learned", "none"))
    bias: bool = key(False, BOOL)
    qkv_bias: Optional[bool] = key(None, BOOL)
    norm_eps: float = key(1e-5, POSITIVE)
    rope_theta: float = key(10000.0, POSITIVE)
    rotary_fraction: float = key(1.0, KeyCheck("fraction", low=0, low_open=True, high=1))
    parallel_residual: bool = key(False, BOOL)
    sliding_window: int = key(0, NONNEG_INT)
    #: RMSNorm over head_dim on q and k, per head, before RoPE (Qwen3, Gemma 3): `layers.i.attn.q_norm`
    qk_norm: bool = key(False, BOOL)
    #: every Nth layer attends to the whole context, the others within `sliding_window`
    #: (Gemma 2/3 6, gpt-oss 2; HF `sliding_window_pattern` / `layer_types`); 0: every layer alike
    sliding_window_pattern: int = key(0, NONNEG_INT)
    #: the RoPE base of the sliding-window layers (Gemma 3: HF `rope_local_base_freq`); None: rope_theta
    rope_local_base_freq: Optional[float] = key(None, POSITIVE)
    #: RoPE scaling of the layers that take rope_theta (HF `rope_parameters.rope_type`):
    #: linear (Gemma 3 4B-27B: factor 8 on the global layers), yarn (gpt-oss, DeepSeek-V3),
    #: llama3 (Llama 3.1); the parameters are HF's, `rope_` before each
    rope_type: str = key("default", enum("default", "linear", "yarn", "llama3"))
    rope_scaling_factor: float = key(1.0, KeyCheck("float", low=1))
    #: the context the model was pretrained with (HF `original_max_position_embeddings`): yarn, llama3
    rope_original_max_positions: Optional[int] = key(None, CONTEXT)
    rope_beta_fast: float = key(32.0, POSITIVE)
    rope_beta_slow: float = key(1.0, POSITIVE)
    rope_truncate: bool = key(True, BOOL)
    rope_low_freq_factor: float = key(1.0, POSITIVE)
    rope_high_freq_factor: float = key(4.0, POSITIVE)
    #: YaRN's attention factor from HF `mscale` / `mscale_all_dim` (DeepSeek-V3): cos and sin
    #: times mscale(factor, rope_mscale) / mscale(factor, rope_mscale_all_dim), and MLA's
    #: softmax scale times mscale(factor, rope_mscale_all_dim) ** 2; 0: absent (the paper's
    #: 0.1 ln(factor) + 1 on cos and sin)
    rope_mscale: float = key(0.0, NONNEG)
    rope_mscale_all_dim: float = key(0.0, NONNEG)
    #: multi-head latent attention (DeepSeek-V2/V3; HF names): keys and values are one
    #: `kv_lora_rank`-wide latent per token (plus a `qk_rope_head_dim` RoPE key shared by the
    #: heads), up-projected per head; queries through a `q_lora_rank` latent (0: one
    #: projection). `kv_lora_rank` 0: not MLA. With MLA `head_dim` is qk_nope + qk_rope
    q_lora_rank: int = key(0, NONNEG_INT)
    kv_lora_rank: int = key(0, NONNEG_INT)
    qk_nope_head_dim: int = key(0, NONNEG_INT)
    qk_rope_head_dim: int = key(0, NONNEG_INT)
    v_head_dim: int = key(0, NONNEG_INT)
    #: MLA's RoPE dims are interleaved pairs (x0, x1), (x2, x3), ... (HF `rope_interleave`,
    #: DeepSeek's checkpoints); false: the halves (x_j, x_{j + d/2}), as Llama
    rope_interleave: bool = key(False, BOOL)
    #: RMSNorm scales by (1 + weight), the weight starting at 0 (Gemma; Megatron-Core's
    #: `layernorm_zero_centered_gamma`)
    zero_centered_gamma: bool = key(False, BOOL)
    #: a norm on each sub-layer's output before its residual add (Gemma 2/3's
    #: post_attention_layernorm, post_feedforward_layernorm): `layers.i.attn_post_norm`, `mlp_post_norm`
    sandwich_norm: bool = key(False, BOOL)
    #: the embedding's output times sqrt(hidden), rounded to the model dtype (Gemma)
    scale_embeddings: bool = key(False, BOOL)
    #: attention scores scaled by query_pre_attn_scalar ** -0.5 (Gemma; HF field); None: head_dim
    query_pre_attn_scalar: Optional[float] = key(None, POSITIVE)
    #: one learned logit per query head joins each softmax's denominator (gpt-oss's `sinks`):
    #: `layers.i.attn.sinks`, split over tp with the heads
    attention_sinks: bool = key(False, BOOL)
    #: Gemma 2's logit soft-capping (HF names), ``cap * tanh(x / cap)``: of the attention
    #: scores, after their scale and before the mask and softmax; of the LM head's logits,
    #: before the loss. None: no cap
    attn_logit_softcapping: Optional[float] = key(None, POSITIVE)
    final_logit_softcapping: Optional[float] = key(None, POSITIVE)
    attention: str = key("flash", enum("flash", "unfused"))
    dropout: float = key(0.0, KeyCheck("fraction", low=0, high=1, high_open=True))
    tie_embeddings: bool = key(False, BOOL)
    dtype: str = key("bf16", enum("fp32", "bf16", "fp16"))
    experts: int = key(0, NONNEG_INT)
    top_k: Optional[int] = key(None, COUNT)
    expert_ffn_hidden: Optional[int] = key(None, COUNT)
    shared_experts: int = key(0, NONNEG_INT)
    dense_layers: int = key(0, NONNEG_INT)
    #: coefficient of the router's load-balancing loss (Switch Transformer, Fedus et al. 2021)
    router_aux_loss: float = key(0.01, NONNEG)
    #: renormalise the top_k router weights to sum to 1 (Mixtral; HF `norm_topk_prob`); false: the
    #: softmax probabilities themselves (Qwen3-MoE's transformers default)
    norm_topk_prob: bool = key(True, BOOL)
    #: the router's logits have a bias (gpt-oss: `mlp.router.bias`)
    router_bias: bool = key(False, BOOL)
    #: DeepSeek-V3's router (HF names): scores softmax or sigmoid of the logits;
    #: `noaux_tc`: experts chosen on the scores plus a per-expert `e_score_correction_bias`
    #: (a fixed fp32 buffer), within the `topk_group` of `n_group` groups whose two best
    #: corrected scores sum highest; weights from the uncorrected scores, times
    #: `routed_scaling_factor` (runtime/model/moe.py: route)
    scoring_func: str = key("softmax", enum("softmax", "sigmoid"))
    topk_method: str = key("greedy", enum("greedy", "noaux_tc"))
    n_group: int = key(1, COUNT)
    topk_group: int = key(1, COUNT)
    routed_scaling_factor: float = key(1.0, POSITIVE)
    #: gpt-oss's clamped SwiGLU (HF `swiglu_alpha`, `swiglu_limit`): gate <= limit, |up| <= limit,
    #: (up + 1) * gate * sigmoid(alpha * gate); None: silu(gate) * up
    swiglu_alpha: Optional[float] = key(None, POSITIVE)
    swiglu_limit: Optional[float] = key(None, POSITIVE)
    vocab_multiple: int = key(128, COUNT)
    #: Llama 4 (HF Llama4TextConfig's names, transformers 5.25 modeling_llama4.py). Every
    #: `nope_layer_interval`-th layer, (i + 1) % N == 0, has no RoPE (HF `no_rope_layers`,
    #: `no_rope_layer_interval`); 0: RoPE on every layer
    nope_layer_interval: int = key(0, NONNEG_INT)
    #: the RoPE layers attend within chunks: query i attends key j <= i when i // c == j // c
    #: (HF `attention_chunk_size`, `chunked_attention` layers); 0: none
    attention_chunk_size: int = key(0, NONNEG_INT)
    #: the NoPE layers scale the query at position p by log1p(floor((p + 1) / floor_scale))
    #: * attn_scale + 1 (HF `attn_temperature_tuning`; Nakanishi 2025, arXiv 2501.19399)
    attn_temperature_tuning: bool = key(False, BOOL)
    floor_scale: float = key(8192.0, POSITIVE)
    attn_scale: float = key(0.1, NONNEG)
    #: q and k of the RoPE layers divided by their root mean square over head_dim after RoPE,
    #: no weight (HF Llama 4 `use_qk_norm`: Llama4TextL2Norm)
    qk_l2_norm: bool = key(False, BOOL)
    #: of the layers from dense_layers on, layer i is MoE when (i + 1) % N == 0, the others
    #: dense MLPs of ffn_hidden (HF Llama 4 `interleave_moe_layer_step`)
    interleave_moe_layer_step: int = key(1, COUNT)
    #: the router's weights scale each token's input to its experts, not their outputs
    #: (Llama4TextMoe; Megatron-Core's `moe_apply_probs_on_input`)
    moe_apply_probs_on_input: bool = key(False, BOOL)


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
#: set otherwise (runtime/model/moe.py: route)
ROUTER_DEFAULTS = {f.name: f.default for f in fields(ModelKeys)
                   if f.name in ("scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor")}

#: the keys only Llama 4 sets and their ModelKeys defaults (its NoPE, chunked, temperature-tuned
#: and L2-normed attention, its interleaved MoE layers): the family's feature
#: (core/families/llama4.py), and what the serve program does not run yet (codegen/emit.py)
LLAMA4_KEYS = {f.name: f.default for f in fields(ModelKeys)
               if f.name in ("nope_layer_interval", "attention_chunk_size", "attn_temperature_tuning", "qk_l2_norm",
                             "interleave_moe_layer_step", "moe_apply_probs_on_input")}

#: every key of a model block in the declared order, the name aside, -> its :class:`KeyCheck`
MODEL_KEY_CHECKS: dict[str, KeyCheck] = {f.name: f.metadata["check"] for f in fields(ModelKeys)
                                         if f.metadata.get("check") is not None}
#: the model keys without a default (a preset or config.json may supply them)
REQUIRED_MODEL_KEYS: tuple[str, ...] = tuple(f.name for f in fields(ModelKeys) if f.default is MISSING)


__all__ = ["BOOL", "COUNT", "GATED_ACTIVATIONS", "KeyCheck", "LLAMA4_KEYS", "MODEL_KEY_CHECKS", "ModelKeys", "NONNEG", "NONNEG_INT",
           "POSITIVE", "REQUIRED_MODEL_KEYS", "enum", "key", "ROUTER_DEFAULTS", "attention_scale", "cached_tokens", "rotary_dim", "yarn_mscale", "rope_scaling", "derived_defaults", "layer_windows", "moe_layer", "padded_vocab",
           "rope_layer"]
