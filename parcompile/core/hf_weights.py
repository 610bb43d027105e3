"""Where our parameters live in a Hugging Face checkpoint, standard library only: the
compiler's checks (:mod:`parcompile.config.hf_weights` re-exports this module) and the
runtime's loader and exporter (:mod:`parcompile.runtime.weights`,
:mod:`parcompile.runtime.hf_export`) read the same tables.

A model is written as one Hugging Face ``model_type`` (:func:`hf_family`):

=========  ==========================================================================
family     our models it expresses
=========  ==========================================================================
gpt2       learned positions + LayerNorm; biases everywhere; q, k, v fused in
           ``c_attn`` and every linear a ``Conv1D`` (weight stored (in, out))
gpt_neox   LayerNorm + RoPE (``rotary_fraction``; parallel residual or not); biases;
           ``query_key_value`` interleaves q, k, v per head: rows
           ``[q_0 k_0 v_0 q_1 k_1 v_1 ...]``, ``head_dim`` rows each
mixtral    routed experts (SwiGLU, no shared experts, no dense layers). Written as
           ``save_pretrained`` of transformers 5.24 writes it (and vLLM reads it):
           ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``, ``block_sparse_moe.gate``;
           transformers' own fused layout (``mlp.experts.gate_up_proj`` (E, 2f, h):
           w1 rows ``[0, f)``, w3 rows ``[f, 2f)``; ``mlp.experts.down_proj`` (E, h, f);
           ``mlp.gate``) is read too
qwen2      Llama with biases on q, k, v only (``qkv_bias`` and not ``bias``)
qwen3      Llama with qk-norm (``qk_norm``: ``self_attn.q_norm``/``k_norm``, one
           ``(head_dim,)`` weight each), no biases
qwen3_moe  qwen3 with routed experts (no shared experts; the first ``dense_layers``
           layers dense: ``mlp_only_layers`` = [0, ..., dense_layers - 1]; top-k
           weights renormalised or not: ``norm_topk_prob``). Written as ``save_pretrained``
           of transformers 5.24 writes it: ``mlp.experts.{e}.gate_proj/up_proj/down_proj
           .weight``, router ``mlp.gate.weight``; the fused in-memory layout
           (``mlp.experts.gate_up_proj`` (E, 2f, h), ``mlp.experts.down_proj`` (E, h, f),
           as mixtral's) is read too
mistral    Llama with a sliding attention window
gpt_oss    every layer MoE: biased router (``mlp.router.weight``/``bias``), experts with
           biases and the clamped SwiGLU in transformers' fused layout, stored (in, out):
           ``mlp.experts.gate_up_proj`` (E, h, 2f), gate and up interleaved (columns
           0, 2, 4, ... are w1's rows, 1, 3, 5, ... w3's), ``gate_up_proj_bias`` (E, 2f),
           ``down_proj`` (E, f, h), ``down_proj_bias`` (E, h); q, k, v, o with biases;
           attention sinks ``self_attn.sinks`` (heads,)
gemma3_text  RMSNorm (1 + w) before and after each sub-layer, GeGLU, qk-norm, scaled
           embeddings, local and global layers (``sliding_window_pattern``):
           ``input_layernorm`` (our ``attn_norm``), ``post_attention_layernorm``
           (``attn_post_norm``), ``pre_feedforward_layernorm`` (``mlp_norm``),
           ``post_feedforward_layernorm`` (``mlp_post_norm``)
deepseek_v3  multi-head latent attention (``kv_lora_rank > 0``) and DeepSeek's router
           (sigmoid scores, ``e_score_correction_bias``, groups), shared experts, the
           first ``dense_layers`` layers dense. ``self_attn.q_a_proj`` (our ``attn.wq_a``),
           ``q_a_layernorm`` (``attn.q_a_norm``), ``q_b_proj`` (``attn.wq_b``) or, with
           ``q_lora_rank`` 0 (HF null), ``q_proj`` (``attn.wq``); ``kv_a_proj_with_mqa``
           (``attn.wkv_a``: the latent rows, then the RoPE key's), ``kv_a_layernorm``
           (``attn.kv_a_norm``), ``kv_b_proj`` (``attn.wkv_b``: per head nope then v rows),
           ``o_proj`` (``attn.wo``), all one to one (the RoPE rows are not permuted: the
           runtime rotates interleaved pairs when ``rope_interleave``); router
           ``mlp.gate.weight`` and the buffer ``mlp.gate.e_score_correction_bias``
           (``mlp.router.e_score_correction_bias``, fp32); experts as qwen3_moe's (saved
           ``mlp.experts.{e}.gate_proj/up_proj/down_proj``, fused layout read too); shared
           experts ``mlp.shared_experts.gate_proj/up_proj/down_proj`` (``mlp.shared.w1/w3/w2``).
           The multi-token-prediction layers (``model.layers.{layers}.*`` on) are not read
llama      RMSNorm, SwiGLU, RoPE; no biases or biases on every linear layer
=========  ==========================================================================

:func:`tensor_map` gives, for every global parameter name of ours
(``layers.3.attn.wq.weight``), the :class:`Source` s it can be read from: an HF tensor
name, that tensor's shape, and how our tensor's rows sit in it (fused tensors: offsets
and strides; Conv1D: transposed), so that each rank reads its shard as a few slices of
the HF tensor (``safetensors``' ``get_slice``) and an exporter can assemble the HF
tensors from our global ones. :func:`hf_config` is the ``config.json`` transformers
loads into the same function. :func:`check_checkpoint` validates a checkpoint directory
by reading only the safetensors headers (8-byte little-endian length + JSON).

Shapes here are global and, for the vocabulary (``embedding.weight``, ``lm_head.weight``),
unpadded: ``(vocab, hidden)``; the padded rows of a plan are zeros that HF files never hold.

A model is anything with the attributes of :class:`parcompile.core.model.ModelKeys`: a
ModelKeys (the runtime) or the compiler's :class:`parcompile.config.schema.ModelConfig`.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from parcompile.core.dtypes import TORCH_NAMES
from parcompile.core.files import json_loads
from parcompile.core.hf import SUPPORTED_MODEL_TYPES, HFConfigError, from_hf_dict
from parcompile.core.model import GATED_ACTIVATIONS, ROUTER_DEFAULTS, ModelKeys, rope_scaling, rotary_dim

FAMILIES = ("deepseek_v3", "gemma3_text", "gpt2", "gpt_neox", "gpt_oss", "llama", "mistral", "mixtral", "qwen2",
            "qwen3", "qwen3_moe")

ARCHITECTURES = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gpt_neox": "GPTNeoXForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

#: our dtype names -> the config.json / safetensors names
HF_DTYPES = TORCH_NAMES  # config.json's torch_dtype is torch's name
#: bytes per element of the safetensors dtypes
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
                     "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}

#: every dtype name a safetensors header may hold (safetensors' ``Dtype``; sub-byte ones have no width above)
SAFETENSORS_DTYPES = frozenset(SAFETENSORS_BYTES) | {"F4", "F6_E2M3", "F6_E3M2", "F8_E8M0", "F8_E4M3FNUZ",
                                                     "F8_E5M2FNUZ", "U16", "U32", "U64", "C64"}

#: parameters whose rows are the (padded) vocabulary
VOCAB_PARAMS = ("embedding.weight", "lm_head.weight")

TRANSFORMERS_VERSION = "5.24.0"   # the version the written files were checked against

#: persistent buffers a checkpoint holds beside the parameters, by the last part of our
#: name: not parameters (no gradient; transformers' ``parameters()`` and every parameter
#: count leave them out), listed by :func:`expected_shapes` only with ``buffers=True``.
#: DeepSeek's router bias for choosing experts, (experts,) fp32 in HF files
BUFFERS = ("e_score_correction_bias",)


def is_buffer(name: str) -> bool:
    """Whether our global tensor ``name`` is a buffer (:data:`BUFFERS`), not a parameter."""
    return name.rpartition(".")[2] in BUFFERS


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint or a model: ``message`` and an optional ``help``."""

    message: str
    help: str | None = None


class HFWeightsError(Exception):
    """A model no Hugging Face family expresses, or a directory that is not a checkpoint:
    ``message`` and an optional ``help`` (like :class:`parcompile.config.hf.HFConfigError`)."""

    def __init__(self, message: str, help: str | None = None):
        super().__init__(message)
        self.message = message
        self.help = help

    @property
    def problem(self) -> Problem:
        return Problem(self.message, self.help)


# --------------------------------------------------------------------------- families


#: the keys only Gemma 3 sets, with the value it has
_GEMMA_KEYS = {"zero_centered_gamma": True, "sandwich_norm": True, "scale_embeddings": True, "activation": "geglu"}


#: the router keys of DeepSeek-V3 (the ROUTER keys of ModelKeys) and the value every other
#: family has (a router those families' transformers classes run)
_ROUTER_DEFAULTS = ROUTER_DEFAULTS
#: what transformers' DeepseekV3TopkRouter runs
_DEEPSEEK_ROUTER = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def _router(m: ModelKeys, key: str):
    """``m``'s router key ``key`` (its default where the model has no such key)."""
    return getattr(m, key, _ROUTER_DEFAULTS[key])


def _family_guess(m: ModelKeys) -> str:
    if m.kv_lora_rank > 0:
        return "deepseek_v3"
    if m.attention_sinks or m.router_bias or m.swiglu_limit is not None:
        return "gpt_oss"
    if any(getattr(m, k) == v for k, v in _GEMMA_KEYS.items()):
        return "gemma3_text"
    if m.position == "learned" and m.norm == "layernorm":
        return "gpt2"
    if m.norm == "layernorm" and m.position == "rope":
        return "gpt_neox"
    if m.qk_norm:
        return "qwen3_moe" if m.experts > 0 else "qwen3"
    if m.experts > 0 and m.activation == "swiglu":
        return "mixtral"
    if m.qkv_bias and not m.bias:
        return "qwen2"
    if m.sliding_window > 0:
        return "mistral"
    return "llama"


def rope_dim(m: ModelKeys) -> int:
    """Rotary dims per head, as the generated program computes them (:func:`parcompile.core.model.rotary_dim`)."""
    return rotary_dim(m)


def family_problems(m: ModelKeys, family: str) -> list[Problem]:
    """Why ``family`` cannot express ``m`` (empty: it can)."""
    out: list[str] = []
    if family not in FAMILIES:
        return [Problem(f"unknown Hugging Face family `{family}`", "families: " + ", ".join(FAMILIES))]
    llama_like = family in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")
    qk_family = family in ("qwen3", "qwen3_moe", "gemma3_text")
    gemma = family == "gemma3_text"
    for key, value in _GEMMA_KEYS.items():
        if (getattr(m, key) == value) != gemma:
            out.append(f"{key} = {'true' if value is True else value}" if not gemma
                       else f"{key} = {getattr(m, key)} (Gemma 3 has {'true' if value is True else value})")
    if family not in ("gemma3_text", "gpt_oss") and m.sliding_window_pattern:
        out.append(f"sliding_window_pattern = {m.sliding_window_pattern}")
    if not gemma and m.rope_local_base_freq is not None:
        out.append("rope_local_base_freq")
    if gemma:
        if m.norm != "rmsnorm" or m.position != "rope" or rope_dim(m) != m.head_dim:
            out.append("a norm or position other than RMSNorm and RoPE on the whole head")
        if m.bias or m.parallel_residual or m.experts:
            out.append("biases, parallel_residual or experts")
        if m.sliding_window_pattern == 0 and m.sliding_window:
            out.append("sliding_window on every layer (Gemma 3 alternates: sliding_window_pattern)")
    if qk_family and not m.qk_norm:
        out.append("qk_norm = false (it has q_norm and k_norm)")
    elif not qk_family and m.qk_norm:
        out.append("qk_norm = true")
    oss = family == "gpt_oss"
    deepseek = family == "deepseek_v3"
    if not oss:
        for key in ("attention_sinks", "router_bias"):
            if getattr(m, key):
                out.append(f"{key} = true")
        if m.swiglu_limit is not None or m.swiglu_alpha is not None:
            out.append("swiglu_alpha / swiglu_limit")
    if not deepseek:
        if m.kv_lora_rank > 0:
            out.append(f"kv_lora_rank = {m.kv_lora_rank} (multi-head latent attention: deepseek_v3)")
        if m.rope_interleave:
            out.append("rope_interleave = true")
        out += [f"{k} = {_router(m, k)} (DeepSeek's router: deepseek_v3)" for k, v in _ROUTER_DEFAULTS.items()
                if m.experts and _router(m, k) != v]
    if gemma:
        pass
    elif deepseek:
        out += _deepseek_v3_problems(m)
    elif oss:
        want = {"attention_sinks": True, "router_bias": True, "bias": True, "qkv_bias": True, "norm": "rmsnorm",
                "activation": "swiglu", "position": "rope", "qk_norm": False, "parallel_residual": False,
                "shared_experts": 0, "dense_layers": 0, "norm_topk_prob": True}
        out += [f"{k} = {getattr(m, k)} (gpt-oss has {v})" for k, v in want.items() if getattr(m, k) != v]
        if m.experts <= 0:
            out.append("no experts (every gpt-oss layer is a MoE layer)")
        if m.swiglu_limit is None or m.swiglu_alpha is None:
            out.append("no swiglu_alpha / swiglu_limit (gpt-oss clamps its SwiGLU)")
        if m.sliding_window and m.sliding_window_pattern == 0:
            out.append("sliding_window on every layer (gpt-oss alternates: sliding_window_pattern = 2)")
    elif llama_like:
        if m.norm != "rmsnorm":
            out.append(f"norm = {m.norm} (it has RMSNorm)")
        if m.activation != "swiglu":
            out.append(f"activation = {m.activation} (it has SwiGLU)")
        if m.position != "rope":
            out.append(f"position = {m.position} (it has RoPE)")
        elif rope_dim(m) != m.head_dim:
            out.append(f"rotary_fraction = {m.rotary_fraction} (it rotates the whole head)")
        if m.parallel_residual:
            out.append("parallel_residual = true")
        if family == "llama" and m.qkv_bias != m.bias:
            out.append("biases on q, k, v only (Llama has none or biases on every linear layer)")
        if family in ("mistral", "mixtral", "qwen3", "qwen3_moe") and (m.bias or m.qkv_bias):
            out.append("biases")
        if family == "qwen2" and (m.bias or not m.qkv_bias):
            out.append("biases other than on q, k, v")
        if family == "llama" and m.sliding_window:
            out.append("sliding_window")
        if family in ("mixtral", "qwen3_moe"):
            if m.experts <= 0:
                out.append("no experts")
            if m.shared_experts:
                out.append(f"shared_experts = {m.shared_experts}")
            if family == "mixtral" and m.dense_layers:
                out.append(f"dense_layers = {m.dense_layers}")
            if family == "mixtral" and not m.norm_topk_prob and m.top_k > 1:
                out.append("norm_topk_prob = false (Mixtral renormalises the top_k weights)")
        elif m.experts:
            out.append(f"experts = {m.experts}")
    else:
        if m.norm != "layernorm":
            out.append(f"norm = {m.norm} (it has LayerNorm)")
        if m.activation not in ("gelu", "relu"):
            out.append(f"activation = {m.activation}")
        if family == "gpt2" and m.position != "learned":
            out.append(f"position = {m.position} (it has learned positions)")
        if family == "gpt_neox" and m.position != "rope":
            out.append(f"position = {m.position} (it has RoPE)")
        if family == "gpt2" and m.parallel_residual:
            out.append("parallel_residual = true")
        if not m.bias or not m.qkv_bias:
            out.append("no biases (it has biases on every linear layer)")
        if m.kv_heads != m.heads:
            out.append(f"kv_heads = {m.kv_heads} != heads (it has no GQA)")
        if m.head_dim * m.heads != m.hidden:
            out.append(f"head_dim = {m.head_dim} != hidden / heads")
        if m.sliding_window:
            out.append("sliding_window")
        if m.experts:
            out.append(f"experts = {m.experts}")
    if not out:
        return []
    return [Problem(f"the model cannot be written as a Hugging Face `{family}` checkpoint: " + "; ".join(out),
                    "families: gpt2 (learned positions, LayerNorm, biases), gpt_neox (LayerNorm, RoPE, biases), "
                    "llama/mistral/qwen2 (RMSNorm, SwiGLU, RoPE), qwen3 (the same with qk_norm), mixtral (the "
                    "same with routed experts), qwen3_moe (qwen3 with routed experts, leading dense layers), "
                    "gemma3_text (sandwich (1 + w) RMSNorms, GeGLU, qk_norm, scaled embeddings, local and "
                    "global layers), deepseek_v3 (multi-head latent attention, sigmoid group-limited "
                    "router, shared experts)")]


def _deepseek_v3_problems(m: ModelKeys) -> list[str]:
    """Why transformers' DeepseekV3ForCausalLM cannot run ``m`` (family_problems' part)."""
    out: list[str] = []
    if m.kv_lora_rank <= 0:
        out.append("kv_lora_rank = 0 (it has multi-head latent attention)")
    want = {"norm": "rmsnorm", "activation": "swiglu", "position": "rope", "bias": False, "qkv_bias": False,
            "parallel_residual": False, "sliding_window": 0, "rotary_fraction": 1.0}   # qk_norm: family_problems
    out += [f"{k} = {getattr(m, k)} (DeepSeek-V3 has {v})" for k, v in want.items() if getattr(m, k) != v]
    if m.kv_heads != m.heads:
        out.append(f"kv_heads = {m.kv_heads} != heads (multi-head latent attention has a key and value per head)")
    if m.kv_lora_rank > 0 and m.head_dim != m.qk_nope_head_dim + m.qk_rope_head_dim:
        out.append(f"head_dim = {m.head_dim} != qk_nope_head_dim + qk_rope_head_dim")
    if m.kv_lora_rank > 0 and (m.v_head_dim <= 0 or m.qk_rope_head_dim <= 0):
        out.append("v_head_dim or qk_rope_head_dim 0")
    if m.experts:
        out += [f"{k} = {_router(m, k)} (transformers' DeepSeek-V3 router has {v})"
                for k, v in _DEEPSEEK_ROUTER.items() if _router(m, k) != v]
        if m.dense_layers >= m.layers:
            out.append(f"dense_layers = {m.dense_layers} with experts (no mixture-of-experts layer)")
    return out


def hf_family(model: ModelKeys) -> str:
    """The Hugging Face ``model_type`` to write ``model`` as (module docstring).

    Raises:
        HFWeightsError: no family expresses the model (e.g. RMSNorm with GELU, shared
            experts, LayerNorm without biases); the message lists what does not fit.
    """
    family = _family_guess(model)
    problems = family_problems(model, family)
    if problems:
        raise HFWeightsError(problems[0].message, problems[0].help)
    return family


# --------------------------------------------------------------------------- tensor layout


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


def _layer_mlp_is_moe(m: ModelKeys, i: int) -> bool:
    return m.experts > 0 and i >= m.dense_layers


def expected_shapes(model: ModelKeys, tp: int | None = None, buffers: bool = False) -> dict[str, tuple[int, ...]]:
    """Our global parameter names -> global shapes, in layer order, as a training program
    of ``model`` holds them: the vocabulary unpadded (``tp = None``) or padded for ``tp``
    (``model.padded_vocab(tp)`` rows). A tied model has no ``lm_head.weight``.

    ``buffers``: also the persistent buffers a checkpoint holds (:data:`BUFFERS`: the
    DeepSeek router's ``layers.{i}.mlp.router.e_score_correction_bias`` (experts,) with
    ``topk_method = "noaux_tc"``). Without it the shapes are the parameters alone, whose
    elements add up to transformers' ``sum(p.numel() for p in model.parameters())``.

    Multi-head latent attention (``kv_lora_rank > 0``; H heads, ``nope``, ``rope``, ``v``
    the qk_nope, qk_rope and v head dims): ``attn.wq_a`` (q_lora_rank, hidden),
    ``attn.q_a_norm`` (q_lora_rank,), ``attn.wq_b`` (H (nope + rope), q_lora_rank), or
    ``attn.wq`` (H (nope + rope), hidden) when ``q_lora_rank`` is 0; ``attn.wkv_a``
    (kv_lora_rank + rope, hidden), ``attn.kv_a_norm`` (kv_lora_rank,), ``attn.wkv_b``
    (H (nope + v), kv_lora_rank), ``attn.wo`` (hidden, H v)."""
    m = model
    h, v = m.hidden, m.vocab if tp is None else m.padded_vocab(tp)
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    out: dict[str, tuple[int, ...]] = {"embedding.weight": (v, h)}
    if m.position == "learned":
        out["pos_embedding.weight"] = (m.max_positions, h)

    def norm(name: str) -> None:
        out[f"{name}.weight"] = (h,)
        if m.norm == "layernorm":
            out[f"{name}.bias"] = (h,)

    def linear(name: str, o: int, i: int, bias: bool) -> None:
        out[f"{name}.weight"] = (o, i)
        if bias:
            out[f"{name}.bias"] = (o,)

    def mlp(prefix: str, f: int) -> None:
        linear(f"{prefix}.w1", f, h, m.bias)
        if m.activation in GATED_ACTIVATIONS:
            linear(f"{prefix}.w3", f, h, m.bias)
        out[f"{prefix}.w2.weight"] = (h, f)
        if m.bias:
            out[f"{prefix}.w2.bias"] = (h,)

    def mla(p: str) -> None:   # biases as ir/lower.py's mla(): qkv_bias on the down projections
        heads, nope, rd, vd = m.heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        if m.q_lora_rank:
            linear(f"{p}.attn.wq_a", m.q_lora_rank, h, m.qkv_bias)
            out[f"{p}.attn.q_a_norm.weight"] = (m.q_lora_rank,)
            linear(f"{p}.attn.wq_b", heads * (nope + rd), m.q_lora_rank, False)
        else:
            linear(f"{p}.attn.wq", heads * (nope + rd), h, False)
        linear(f"{p}.attn.wkv_a", m.kv_lora_rank + rd, h, m.qkv_bias)
        out[f"{p}.attn.kv_a_norm.weight"] = (m.kv_lora_rank,)
        linear(f"{p}.attn.wkv_b", heads * (nope + vd), m.kv_lora_rank, False)
        linear(f"{p}.attn.wo", h, heads * vd, m.bias)

    for i in range(m.layers):
        p = f"layers.{i}"
        norm(f"{p}.attn_norm")
        if m.kv_lora_rank:
            mla(p)
        else:
            linear(f"{p}.attn.wq", q, h, m.qkv_bias)
            linear(f"{p}.attn.wk", kv, h, m.qkv_bias)
            linear(f"{p}.attn.wv", kv, h, m.qkv_bias)
            if m.qk_norm:
                out[f"{p}.attn.q_norm.weight"] = (m.head_dim,)
                out[f"{p}.attn.k_norm.weight"] = (m.head_dim,)
            out[f"{p}.attn.wo.weight"] = (h, q)
            if m.bias:
                out[f"{p}.attn.wo.bias"] = (h,)
        if m.attention_sinks:
            out[f"{p}.attn.sinks"] = (m.heads,)
        if m.sandwich_norm:
            norm(f"{p}.attn_post_norm")
        norm(f"{p}.mlp_norm")
        if _layer_mlp_is_moe(m, i):
            f = m.expert_ffn_hidden
            out[f"{p}.mlp.router.weight"] = (m.experts, h)
            if m.router_bias:
                out[f"{p}.mlp.router.bias"] = (m.experts,)
            if buffers and _router(m, "topk_method") == "noaux_tc":
                out[f"{p}.mlp.router.e_score_correction_bias"] = (m.experts,)
            for e in range(m.experts):
                out[f"{p}.mlp.experts.{e}.w1.weight"] = (f, h)
                if m.activation in GATED_ACTIVATIONS:
                    out[f"{p}.mlp.experts.{e}.w3.weight"] = (f, h)
                out[f"{p}.mlp.experts.{e}.w2.weight"] = (h, f)
                if m.bias:
                    out[f"{p}.mlp.experts.{e}.w1.bias"] = (f,)
                    if m.activation in GATED_ACTIVATIONS:
                        out[f"{p}.mlp.experts.{e}.w3.bias"] = (f,)
                    out[f"{p}.mlp.experts.{e}.w2.bias"] = (h,)
            if m.shared_experts:
                mlp(f"{p}.mlp.shared", m.shared_experts * f)
        else:
            mlp(f"{p}.mlp", m.ffn_hidden)
        if m.sandwich_norm:
            norm(f"{p}.mlp_post_norm")
    norm("final_norm")
    if not m.tie_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


def _llama_sources(m: ModelKeys, name: str, shape: tuple[int, ...]) -> list[Source]:
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
        return [legacy, _fused_expert_source(m, base, e, w)]
    return []


def _gemma3_sources(m: ModelKeys, name: str, shape: tuple[int, ...]) -> list[Source]:
    """Llama's names, with Gemma's four norms per layer (module docstring)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "layers":
        base = f"model.layers.{parts[1]}."
        norms = {"attn_norm.weight": "input_layernorm.weight", "attn_post_norm.weight": "post_attention_layernorm.weight",
                 "mlp_norm.weight": "pre_feedforward_layernorm.weight",
                 "mlp_post_norm.weight": "post_feedforward_layernorm.weight"}
        rest = ".".join(parts[2:])
        if rest in norms:
            return [Source(base + norms[rest], shape)]
    return _llama_sources(m, name, shape)


def _gpt_oss_sources(m: ModelKeys, name: str, shape: tuple[int, ...]) -> list[Source]:
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
    return _llama_sources(m, name, shape)


def _fused_expert_source(m: ModelKeys, base: str, e: int, w: str) -> Source:
    """Expert ``e``'s ``w`` (w1, w3, w2) in transformers 5's fused in-memory layout (Mixtral,
    Qwen3-MoE): ``mlp.experts.gate_up_proj`` (E, 2f, h), w1 rows ``[0, f)``, w3 rows
    ``[f, 2f)``; ``mlp.experts.down_proj`` (E, h, f)."""
    f, h, E = m.expert_ffn_hidden, m.hidden, m.experts
    if w == "w2":
        return Source(base + "mlp.experts.down_proj", (E, h, f), lead=(e,))
    return Source(base + "mlp.experts.gate_up_proj", (E, 2 * f, h), lead=(e,), offset=0 if w == "w1" else f)


def _qwen3_moe_sources(m: ModelKeys, name: str, shape: tuple[int, ...]) -> list[Source]:
    """Llama's names, with Qwen3-MoE's router and experts (module docstring): saved
    per-expert tensors first (what is written), the fused 3-D layout second."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "layers":
        base = f"model.layers.{parts[1]}."
        if ".".join(parts[2:]) == "mlp.router.weight":
            return [Source(base + "mlp.gate.weight", shape)]
        if parts[2:4] == ["mlp", "experts"] and len(parts) == 7:
            e, w = int(parts[4]), parts[5]
            hf = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[w]
            return [Source(f"{base}mlp.experts.{e}.{hf}.weight", shape), _fused_expert_source(m, base, e, w)]
    return _llama_sources(m, name, shape)


#: our MLA names (after ``layers.{i}.attn.``) -> DeepseekV3Attention's (after ``self_attn.``)
_MLA_NAMES = {"wq_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "wq_b": "q_b_proj", "wq": "q_proj",
              "wkv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
_GATED_MLP = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _deepseek_v3_sources(m: ModelKeys, name: str, shape: tuple[int, ...]) -> list[Source]:
    """DeepseekV3ForCausalLM's names (module docstring): MLA one to one, the router and its
    bias buffer, shared experts; routed experts as Qwen3-MoE's (saved per expert first, the
    fused 3-D layout second)."""
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "layers":
        base = f"model.layers.{parts[1]}."
        if parts[2] == "attn" and len(parts) == 5 and parts[3] in _MLA_NAMES:
            return [Source(f"{base}self_attn.{_MLA_NAMES[parts[3]]}.{parts[4]}", shape)]
        if parts[2:4] == ["mlp", "router"] and len(parts) == 5:
            return [Source(f"{base}mlp.gate.{parts[4]}", shape)]
        if parts[2:4] == ["mlp", "shared"] and len(parts) == 6 and parts[4] in _GATED_MLP:
            return [Source(f"{base}mlp.shared_experts.{_GATED_MLP[parts[4]]}.{parts[5]}", shape)]
    return _qwen3_moe_sources(m, name, shape)


def _gpt2_sources(m: ModelKeys, name: str, shape: tuple[int, ...]) -> list[Source]:
    def both(hf: str, **kw) -> list[Source]:   # hub GPT-2 files predate the `transformer.` prefix
        sh = kw.pop("shape", shape)
        return [Source("transformer." + hf, sh, **kw), Source(hf, sh, **kw)]

    h = m.hidden
    simple = {"embedding.weight": "wte.weight", "pos_embedding.weight": "wpe.weight",
              "final_norm.weight": "ln_f.weight", "final_norm.bias": "ln_f.bias"}
    if name in simple:
        return both(simple[name])
    parts = name.split(".")
    i, rest = parts[1], ".".join(parts[2:])
    base = f"h.{i}."
    norms = {"attn_norm": "ln_1", "mlp_norm": "ln_2"}
    stem, _, kind = rest.rpartition(".")
    if stem in norms:
        return both(f"{base}{norms[stem]}.{kind}")
    if stem in ("attn.wq", "attn.wk", "attn.wv"):
        j = ("attn.wq", "attn.wk", "attn.wv").index(stem)
        if kind == "weight":
            return both(base + "attn.c_attn.weight", shape=(h, 3 * h), transpose=True, offset=j * h)
        return both(base + "attn.c_attn.bias", shape=(3 * h,), offset=j * h)
    convs = {"attn.wo": "attn.c_proj", "mlp.w1": "mlp.c_fc", "mlp.w2": "mlp.c_proj"}
    if stem in convs:
        if kind == "weight":
            return both(f"{base}{convs[stem]}.weight", shape=(shape[1], shape[0]), transpose=True)
        return both(f"{base}{convs[stem]}.bias")
    return []


def _neox_sources(m: ModelKeys, name: str, shape: tuple[int, ...]) -> list[Source]:
    simple = {"embedding.weight": "gpt_neox.embed_in.weight",
              "final_norm.weight": "gpt_neox.final_layer_norm.weight",
              "final_norm.bias": "gpt_neox.final_layer_norm.bias"}
    if name in simple:
        return [Source(simple[name], shape)]
    parts = name.split(".")
    i, rest = parts[1], ".".join(parts[2:])
    base = f"gpt_neox.layers.{i}."
    stem, _, kind = rest.rpartition(".")
    d, H = m.head_dim, m.heads
    renames = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "attn.wo": "attention.dense",
               "mlp.w1": "mlp.dense_h_to_4h", "mlp.w2": "mlp.dense_4h_to_h"}
    if stem in renames:
        return [Source(f"{base}{renames[stem]}.{kind}", shape)]
    if stem in ("attn.wq", "attn.wk", "attn.wv"):
        j = ("attn.wq", "attn.wk", "attn.wv").index(stem)
        full = (3 * H * d,) + tuple(shape[1:])
        return [Source(f"{base}attention.query_key_value.{kind}", full, block=d, stride=3 * d, offset=j * d)]
    return []


def tensor_map(model: ModelKeys, family: str, tied: bool | None = None) -> dict[str, list[Source]]:
    """Our global parameter name -> the :class:`Source` s it can be read from, preferred
    first (the first is what :mod:`parcompile.runtime.hf_export` writes). Covers every
    name of :func:`expected_shapes` with its buffers (``buffers=True``) and always
    ``lm_head.weight``. The embedding tensor is the head's last source only when the
    checkpoint ties them (``tied``, default ``model.tie_embeddings``: a checkpoint of
    ``tie_word_embeddings: true`` holds no head tensor); an untied checkpoint without its
    head tensor lacks ``lm_head.weight`` (transformers would draw it at random).

    Raises:
        HFWeightsError: ``family`` is not one of :data:`FAMILIES`.
    """
    if family not in FAMILIES:
        raise HFWeightsError(f"unsupported Hugging Face model_type `{family}`",
                             "supported: " + ", ".join(FAMILIES))
    fn = {"gpt2": _gpt2_sources, "gpt_neox": _neox_sources, "qwen3_moe": _qwen3_moe_sources,
          "gemma3_text": _gemma3_sources, "gpt_oss": _gpt_oss_sources,
          "deepseek_v3": _deepseek_v3_sources}.get(family, _llama_sources)
    shapes = expected_shapes(model, buffers=True)
    v, h = model.vocab, model.hidden
    shapes.setdefault("lm_head.weight", (v, h))
    out: dict[str, list[Source]] = {}
    for name, shape in shapes.items():
        if name == "lm_head.weight":
            head = {"gpt2": ["lm_head.weight"], "gpt_neox": ["embed_out.weight", "lm_head.weight"]}.get(
                family, ["lm_head.weight"])
            tie = bool(model.tie_embeddings) if tied is None else tied
            srcs = [Source(n, shape) for n in head] + (out["embedding.weight"] if tie else [])
        else:
            srcs = fn(model, name, shape)
        if srcs:
            out[name] = [replace(s, ours=tuple(shape)) for s in srcs]
    return out


# --------------------------------------------------------------------------- config.json


def _whole(x: float) -> float | int:
    """``x`` as an int when it is whole (config fields transformers types ``int``)."""
    return int(x) if float(x).is_integer() else x


def _rope(m: ModelKeys, family: str) -> dict:
    params = {"rope_type": "default", "rope_theta": float(m.rope_theta)}
    scaling = rope_scaling(m)
    if scaling is not None:   # transformers' names already (core/hf.py reads them back)
        params.update(scaling)
        if params.get("truncate") is True:
            del params["truncate"]   # transformers' default (DeepSeek-V3's config.json has none)
    if family == "gpt_neox":
        params["partial_rotary_factor"] = rope_dim(m) / m.head_dim
    return params


def hf_config(model: ModelKeys, family: str | None = None, dtype: str | None = None,
              tokens: dict | None = None) -> dict:
    """The ``config.json`` (a dict) of ``model`` as a Hugging Face ``family`` (default:
    :func:`hf_family`) that transformers 5 loads into the same function: vocabulary
    unpadded, ``tie_word_embeddings``, ``rope_parameters`` (and the transformers 4 keys
    ``rope_theta``/``rotary_pct``/``rotary_emb_base`` beside it), norm eps, ``head_dim``,
    biases, ``dtype`` (and ``torch_dtype``; ``dtype``: our name, default the model's),
    ``max_position_embeddings`` = ``max_positions``, ``architectures``; ``tokens``: the
    ``bos_token_id``/``eos_token_id``/``pad_token_id`` to write (default null, not the
    family's defaults, which may lie outside a small vocabulary).

    Raises:
        HFWeightsError: the family cannot express the model (:func:`family_problems`).
    """
    m = model
    family = family or hf_family(m)
    problems = family_problems(m, family)
    if problems:
        raise HFWeightsError(problems[0].message, problems[0].help)
    hf_dtype = HF_DTYPES[dtype or m.dtype]
    common = {"architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": m.vocab,
              "tie_word_embeddings": bool(m.tie_embeddings), "dtype": hf_dtype, "torch_dtype": hf_dtype,
              "use_cache": True, "transformers_version": TRANSFORMERS_VERSION,
              "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    common.update({k: v for k, v in (tokens or {}).items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    act = {"gelu": "gelu", "relu": "relu", "swiglu": "silu", "geglu": "gelu_pytorch_tanh"}[m.activation]
    if family == "gpt2":
        return {**common, "n_embd": m.hidden, "n_layer": m.layers, "n_head": m.heads, "n_inner": m.ffn_hidden,
                "n_positions": m.max_positions, "layer_norm_epsilon": m.norm_eps, "activation_function": act,
                "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout,
                "initializer_range": 0.02, "scale_attn_weights": True}
    base = {**common, "hidden_size": m.hidden, "intermediate_size": m.ffn_hidden, "num_hidden_layers": m.layers,
            "num_attention_heads": m.heads, "max_position_embeddings": m.max_positions, "hidden_act": act,
            "rope_parameters": _rope(m, family), "initializer_range": 0.02}
    if family == "gpt_neox":
        return {**base, "layer_norm_eps": m.norm_eps, "use_parallel_residual": bool(m.parallel_residual),
                "attention_bias": True, "rotary_pct": rope_dim(m) / m.head_dim,
                "rotary_emb_base": float(m.rope_theta), "attention_dropout": m.dropout,
                "hidden_dropout": m.dropout}
    cfg = {**base, "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim, "rms_norm_eps": m.norm_eps,
           "rope_theta": float(m.rope_theta), "attention_dropout": m.dropout}
    if family == "gemma3_text":
        windows = m.layer_windows
        global_rope = _rope(m, family)
        local = m.rope_local_base_freq if m.rope_local_base_freq is not None else m.rope_theta
        cfg.update(hidden_activation=act, attention_bias=bool(m.qkv_bias),
                   query_pre_attn_scalar=_whole(m.query_pre_attn_scalar if m.query_pre_attn_scalar is not None
                                                else m.head_dim),   # Gemma3TextConfig types it int
                   sliding_window=m.sliding_window or None,
                   layer_types=["sliding_attention" if w else "full_attention" for w in windows],
                   rope_parameters={"full_attention": global_rope,
                                    "sliding_attention": {"rope_type": "default", "rope_theta": float(local)}},
                   final_logit_softcapping=None, attn_logit_softcapping=None)
        cfg.pop("hidden_act")
        cfg.pop("rope_theta")
    elif family == "gpt_oss":
        cfg.update(attention_bias=True, intermediate_size=m.expert_ffn_hidden, num_local_experts=m.experts,
                   num_experts_per_tok=m.top_k, router_aux_loss_coef=m.router_aux_loss,
                   swiglu_alpha=m.swiglu_alpha, swiglu_limit=m.swiglu_limit, sliding_window=m.sliding_window or None,
                   layer_types=["sliding_attention" if w else "full_attention" for w in m.layer_windows],
                   output_router_logits=False)
        cfg.pop("hidden_act")
        cfg.pop("rope_theta")
    elif family == "llama":
        cfg.update(attention_bias=bool(m.bias), mlp_bias=bool(m.bias))
    elif family == "mistral":
        cfg.update(sliding_window=m.sliding_window or None)
    elif family in ("qwen2", "qwen3"):
        window = m.sliding_window
        if family == "qwen3":
            cfg.update(attention_bias=False)
        cfg.update(use_sliding_window=bool(window), sliding_window=window or None,
                   max_window_layers=0 if window else m.layers)
    elif family == "qwen3_moe":
        cfg.update(attention_bias=False, use_sliding_window=bool(m.sliding_window),
                   sliding_window=m.sliding_window or None, moe_intermediate_size=m.expert_ffn_hidden,
                   num_experts=m.experts, num_experts_per_tok=m.top_k, norm_topk_prob=bool(m.norm_topk_prob),
                   router_aux_loss_coef=m.router_aux_loss, decoder_sparse_step=1,
                   mlp_only_layers=list(range(m.dense_layers)), output_router_logits=False)
    elif family == "mixtral":
        cfg.update(intermediate_size=m.expert_ffn_hidden, num_local_experts=m.experts,
                   num_experts_per_tok=m.top_k, router_aux_loss_coef=m.router_aux_loss,
                   sliding_window=m.sliding_window or None, output_router_logits=False)
    elif family == "deepseek_v3":
        cfg.update(_deepseek_v3_config(m))
    return cfg


def _deepseek_v3_config(m: ModelKeys) -> dict:
    """hf_config's DeepseekV3Config fields: ``head_dim`` is transformers' RoPE width
    (``qk_rope_head_dim``), ``q_lora_rank`` null for 0, no multi-token-prediction layers
    (``num_nextn_predict_layers`` 0); a model without experts has every layer dense
    (``first_k_dense_replace`` = layers), which imports back as ``experts = 0``;
    ``router_aux_loss`` as DeepSeek's ``aux_loss_alpha`` (transformers keeps it unused)."""
    moe = m.experts > 0
    return dict(
        head_dim=m.qk_rope_head_dim, q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
        rope_interleave=bool(m.rope_interleave), attention_bias=False,
        n_routed_experts=m.experts, num_experts_per_tok=m.top_k if moe else 0,
        moe_intermediate_size=m.expert_ffn_hidden, n_shared_experts=m.shared_experts,
        first_k_dense_replace=m.dense_layers if moe else m.layers, norm_topk_prob=bool(m.norm_topk_prob),
        routed_scaling_factor=float(_router(m, "routed_scaling_factor")), n_group=_router(m, "n_group"),
        topk_group=_router(m, "topk_group"), num_nextn_predict_layers=0, output_router_logits=False,
        aux_loss_alpha=float(m.router_aux_loss) if moe else 0.0)


# --------------------------------------------------------------------------- checkpoints


def init_from_kind(directory: str | os.PathLike) -> str:
    """``"hf"`` (``*.safetensors`` files, or a ``model.safetensors.index.json``) or
    ``"dcp"`` (a ``torch.distributed.checkpoint``: ``.metadata``, or a training program's
    checkpoint root holding ``step_NNNNNNNN/.metadata``) for an ``init_from`` directory.

    Raises:
        HFWeightsError: the directory does not exist or holds neither.
    """
    d = Path(directory)
    if not d.is_dir():
        raise HFWeightsError(f"`{directory}` is not a directory",
                             "init_from is a Hugging Face checkpoint directory (config.json + *.safetensors) "
                             "or a checkpoint directory a training program wrote")
    if (d / ".metadata").is_file() or any((p / ".metadata").is_file() for p in d.glob("step_*")
                                          if p.is_dir() and not p.name.endswith(".partial")):
        return "dcp"
    if (d / "model.safetensors.index.json").is_file() or any(d.glob("*.safetensors")):
        return "hf"
    found = sorted(p.name for p in d.iterdir())[:6]
    bins = any(d.glob("*.bin")) or any(d.glob("*.pt"))
    raise HFWeightsError(
        f"`{directory}` holds neither *.safetensors files nor a torch.distributed.checkpoint "
        f"(.metadata or step_*/.metadata)" + (f"; it has: {', '.join(found)}" if found else "; it is empty"),
        "convert PyTorch .bin weights with `save_pretrained(dir, safe_serialization=True)`" if bins else
        "give a Hugging Face checkpoint directory or a training program's checkpoint_dir")


def read_header(path: str | os.PathLike) -> tuple[dict[str, tuple[str, tuple[int, ...]]], list[Problem]]:
    """The tensors of one safetensors file, name -> (dtype, shape), from its header alone,
    and the problems found (a truncated header or data, a header that is not JSON)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return {}, [Problem(f"`{p}` is truncated: {size} bytes, not even the 8-byte header length",
                                    "download or copy the file again")]
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                return {}, [Problem(f"`{p}` is truncated: its header needs {8 + n} bytes but the file has {size}",
                                    "download or copy the file again")]
            raw = fh.read(n)
    except OSError as e:
        return {}, [Problem(f"cannot read `{p}`: {e.strerror or e}")]
    try:
        header = json_loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (UnicodeDecodeError, ValueError) as e:
        return {}, [Problem(f"`{p}` is not a safetensors file: its header is not JSON ({e})")]
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        try:
            shape = tuple(int(x) for x in info["shape"])
            start, stop = (int(x) for x in info["data_offsets"])
            dtype = str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            return tensors, [Problem(f"`{p}` has a malformed header entry for `{name}`")]
        width = SAFETENSORS_BYTES.get(dtype)
        if dtype not in SAFETENSORS_DTYPES:
            return tensors, [Problem(f"`{p}` has a malformed header: `{name}` has dtype {dtype!r}, which safetensors "
                                     "does not know", "download or copy the file again")]
        count = 1
        for x in shape:
            count *= x
        if stop < start or (width is not None and stop - start != count * width):
            return tensors, [Problem(f"`{p}` has a malformed header: `{name}` {dtype} {shape} spans bytes "
                                     f"[{start}, {stop})", "download or copy the file again")]
        tensors[name] = (dtype, shape)
        end = max(end, stop)
    if 8 + n + end > size:
        return tensors, [Problem(f"`{p}` is truncated: its tensors need {8 + n + end} bytes but the file has {size}",
                                 "download or copy the file again")]
    spans = sorted((int(info["data_offsets"][0]), int(info["data_offsets"][1])) for k, info in header.items()
                   if k != "__metadata__" and isinstance(info, dict))
    at = 0
    for start, stop in spans:   # safetensors' own rule: the tensors tile the data, no gap, no overlap
        if start != at:
            return tensors, [Problem(f"`{p}` has a malformed header: its tensors leave a gap or overlap at byte "
                                     f"{min(start, at)} of the data", "download or copy the file again")]
        at = stop
    if 8 + n + at != size:
        return tensors, [Problem(f"`{p}` has {size - 8 - n - at} bytes after its last tensor, which safetensors "
                                 "refuses", "download or copy the file again")]
    return tensors, []


def scan_checkpoint(directory: str | os.PathLike) -> tuple[dict[str, str], dict[str, tuple[str, tuple[int, ...]]],
                                                        list[Problem], bool]:
    """What a Hugging Face directory holds, from ``model.safetensors.index.json`` (when
    there is one: its files must exist) and the safetensors headers: (HF tensor name ->
    file name, HF tensor name -> (dtype, shape), problems, whether every header was read)."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    problems: list[Problem] = []
    names: dict[str, str] = {}
    if index.is_file():
        try:
            wm = json_loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(wm, dict):
                raise ValueError("weight_map is not an object")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            return {}, {}, [Problem(f"cannot read `{index}`: {e}")], False
        names = {str(k): str(v) for k, v in wm.items()}
        files = sorted(set(names.values()))
        for f in files:
            if not (d / f).is_file():
                problems.append(Problem(f"`{index}` names `{f}`, which is not in `{d}`",
                                        "the download is incomplete: fetch every file the index lists"))
    else:
        files = sorted(f.name for f in d.glob("*.safetensors"))
        if not files:
            return {}, {}, [Problem(f"`{d}` has no *.safetensors file")], False
    headers: dict[str, tuple[str, tuple[int, ...]]] = {}
    complete = not problems
    for f in files:
        if not (d / f).is_file():
            continue
        tensors, file_problems = read_header(d / f)
        problems += file_problems
        complete = complete and not (file_problems and not tensors)
        headers.update(tensors)
        for k in tensors:
            names.setdefault(k, f)
    return names, headers, problems, complete


def checkpoint_files(directory: str | os.PathLike) -> tuple[dict[str, str], list[Problem]]:
    """HF tensor name -> file name (relative to ``directory``) and the problems found
    (:func:`scan_checkpoint`)."""
    names, _, problems, _ = scan_checkpoint(directory)
    return names, problems


def read_config(directory: str | os.PathLike) -> tuple[dict | None, list[Problem]]:
    """The parsed ``config.json`` of a checkpoint directory (None when absent) and the
    problems found (not JSON, a ``model_type`` we do not import)."""
    f = Path(directory) / "config.json"
    if not f.is_file():
        return None, []
    try:
        cfg = json_loads(f.read_text(encoding="utf-8"))
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, [Problem(f"cannot read `{f}`: {e}")]
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        return cfg, [Problem(f"`{f}` has model_type {json.dumps(mt)}, which parcompile does not import",
                             "supported: " + ", ".join(SUPPORTED_MODEL_TYPES))]
    return cfg, []


def _cap(problems: list[Problem], limit: int, what: str) -> list[Problem]:
    if len(problems) <= limit:
        return problems
    return problems[:limit] + [Problem(f"... and {len(problems) - limit} more {what}")]


def check_checkpoint(directory: str | os.PathLike, expected: dict[str, tuple[int, ...]],
                     model: ModelKeys) -> list[Problem]:
    """Whether ``directory`` can initialise a model of ``model`` with global parameters
    ``expected`` (our name -> global shape, vocabulary unpadded), reading only headers.

    A DCP directory (:func:`init_from_kind`) is accepted here: its metadata is a pickle
    that needs torch, and :func:`parcompile.frontend.checks._check_init_from` checks its
    shapes. For a Hugging Face directory the problems are: a ``config.json``
    whose ``model_type`` we do not import; an index naming a missing file; a truncated
    safetensors file (header or data past the end: the file and both sizes); a tensor
    missing (the HF name and ours); a shape that differs (the HF tensor, the shape it
    needs for our tensor and the checkpoint's). The layout is the family of the
    ``config.json`` (else :func:`hf_family` of ``model``). The model's buffers
    (:data:`BUFFERS`, e.g. DeepSeek's ``e_score_correction_bias``) are checked beside
    ``expected``; tensors the model does not read (DeepSeek-V3's multi-token-prediction
    layers, ``model.layers.61.*``) are not reported.
    """
    try:
        if init_from_kind(directory) == "dcp":
            return []
    except HFWeightsError as e:
        return [e.problem]
    d = Path(directory)
    cfg, problems = read_config(d)
    if problems:
        return problems
    family = cfg.get("model_type") if cfg else None
    if family is None:
        try:
            family = hf_family(model)
        except HFWeightsError as e:
            return [e.problem]
    names, headers, problems, complete = scan_checkpoint(d)
    tmap = tensor_map(model, family, tied=_checkpoint_tied(cfg, model))
    missing: list[Problem] = []
    shapes: list[Problem] = []
    reported: set[str] = set()
    buffers = {k: v for k, v in expected_shapes(model, buffers=True).items() if is_buffer(k)}
    for name, ours in {**expected, **buffers}.items():
        srcs = tmap.get(name)
        if not srcs:
            missing.append(Problem(f"a Hugging Face `{family}` checkpoint has no tensor for `{name}`",
                                   "the spec's model has a parameter this family does not hold"))
            continue
        src = next((s for s in srcs if s.name in names or s.name in headers), None)
        if src is None and complete:
            missing.append(Problem(f"`{d}` has no tensor `{srcs[0].name}` (for this model's `{name}` {tuple(ours)})",
                                   UNTIED_HEAD_HELP if name == "lm_head.weight" else
                                   "was the checkpoint written for another model? the spec's model must match "
                                   "its config.json"))
            continue
        if src is None:
            continue
        if src.name not in headers:
            if complete:   # the index names a file that lacks it
                missing.append(Problem(f"`{d / names[src.name]}` has no tensor `{src.name}` (for this model's "
                                       f"`{name}`), though model.safetensors.index.json says so",
                                       "the download is incomplete or the index is of another checkpoint"))
            continue   # else in a missing or unreadable file: reported above
        dtype, got = headers[src.name]
        if dtype not in ("F64", "F32", "BF16", "F16"):
            shapes.append(Problem(f"`{src.name}` is stored as {dtype}; parcompile loads float32, bfloat16 or "
                                  "float16 weights", "dequantize the checkpoint first"))
            continue
        if tuple(got) != tuple(src.shape) and src.name not in reported:   # once per fused tensor
            reported.add(src.name)
            shapes.append(Problem(
                f"`{src.name}` has shape {tuple(got)} in the checkpoint; this model's `{name}` "
                f"{tuple(ours)} needs {tuple(src.shape)}",
                "the spec's model differs from the checkpoint's config.json (hidden, heads, kv_heads, "
                "ffn_hidden, vocab?)"))
    return problems + _cap(missing, 8, "missing tensors") + _cap(shapes, 8, "shape mismatches")


#: the fix for an untied checkpoint without its head tensor
UNTIED_HEAD_HELP = ("the checkpoint does not tie its head to the embedding (tie_word_embeddings is false or its "
                    "family's default), so the head is a tensor of its own: copy the complete checkpoint, or set "
                    "\"tie_word_embeddings\": true in its config.json if the head is the embedding")


def _checkpoint_tied(cfg: dict | None, model: ModelKeys) -> bool:
    """Whether a checkpoint of config.json ``cfg`` ties its head to the embedding
    (``tie_word_embeddings``, else its family's default: :func:`parcompile.core.hf.from_hf_dict`);
    ``model``'s own when there is no readable config.json."""
    if cfg is None:
        return bool(model.tie_embeddings)
    try:
        return bool(from_hf_dict(cfg).get("tie_embeddings", False))
    except (HFConfigError, TypeError, ValueError, AttributeError):
        return bool(model.tie_embeddings)


def model_from_checkpoint_config(cfg: dict, **overrides) -> ModelKeys:
    """The :class:`~parcompile.core.model.ModelKeys` of a checkpoint's parsed
    ``config.json`` (through :func:`parcompile.core.hf.from_hf_dict`), for reading its
    tensor layout.

    Raises:
        parcompile.core.hf.HFConfigError: the config cannot be imported.
        TypeError: it lacks a key every model has (layers, hidden, heads, vocab).
    """
    keys = from_hf_dict(cfg)
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):   # transformers 5 keeps NeoX's rotary fraction here
        if cfg.get("model_type") == "gpt_neox" and "rotary_pct" not in cfg and isinstance(
                rp.get("partial_rotary_factor"), (int, float)):
            keys["rotary_fraction"] = float(rp["partial_rotary_factor"])
    keys.setdefault("seq_len", keys.get("max_positions") or 2048)
    keys = {k: v for k, v in keys.items() if v is not None}
    keys.update(overrides)
    keys.setdefault("dtype", "fp32")
    return ModelKeys(**keys)


__all__ = [
    "FAMILIES", "Problem", "HFWeightsError", "Source", "hf_family", "family_problems", "tensor_map",
    "expected_shapes", "hf_config", "init_from_kind", "check_checkpoint", "read_header", "scan_checkpoint", "checkpoint_files",
    "read_config", "model_from_checkpoint_config", "rope_dim", "VOCAB_PARAMS", "HF_DTYPES", "BUFFERS", "is_buffer",
    "UNTIED_HEAD_HELP",
]
