"""GPT-2 (``gpt2``): learned positions and LayerNorm, biases everywhere, tied embeddings.

Weights: q, k, v fused in ``c_attn`` and every linear a ``Conv1D`` (weight stored (in,
out)); hub GPT-2 files predate the ``transformer.`` prefix, so both names are read.
"""

from __future__ import annotations

from typing import Any

from parcompile.core.families.base import (HF_ACTIVATIONS, Family, Source, activation, drop_none, read_bool,
                                           read_float, read_int, read_layers, read_str)
from parcompile.core.model import ModelKeys


def _keys(cfg: dict, common: dict[str, Any]) -> dict[str, Any]:
    """`model` keys of a ``gpt2`` config.json (GPT2Config's names: ``n_embd``, ``n_layer``,
    ``n_head``, ``n_inner`` (None: 4 hidden), ``n_positions``)."""
    hidden = read_int(cfg, "n_embd")
    return drop_none({
        **common,
        "layers": read_layers(cfg, "n_layer"),
        "hidden": hidden,
        "heads": read_int(cfg, "n_head"),
        "ffn_hidden": read_int(cfg, "n_inner"),       # None: 4 * hidden, the default
        "seq_len": read_int(cfg, "n_positions"),
        "max_positions": read_int(cfg, "n_positions"),
        "norm": "layernorm",
        "norm_eps": read_float(cfg, "layer_norm_epsilon"),
        "activation": activation(read_str(cfg, "activation_function", "gelu_new"), gated=False),
        "position": "learned",
        "bias": True,
        "tie_embeddings": read_bool(cfg, "tie_word_embeddings", True),
    })


def _config(m: ModelKeys, common: dict) -> dict:
    """GPT2Config of ``m``."""
    return {**common, "n_embd": m.hidden, "n_layer": m.layers, "n_head": m.heads, "n_inner": m.ffn_hidden,
            "n_positions": m.max_positions, "layer_norm_epsilon": m.norm_eps,
            "activation_function": HF_ACTIVATIONS[m.activation], "resid_pdrop": m.dropout, "embd_pdrop": m.dropout,
            "attn_pdrop": m.dropout, "initializer_range": 0.02, "scale_attn_weights": True}


def _sources(m: ModelKeys, name: str, shape: tuple[int, ...]) -> list[Source]:
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


def gpt_problems(m: ModelKeys, family: str) -> list[str]:
    """What a LayerNorm decoder with biases everywhere and no GQA (GPT-2, GPT-NeoX) cannot
    have, each a phrase; ``family``: ``gpt2`` (learned positions, sequential residual) or
    ``gpt_neox`` (RoPE)."""
    out = []
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
    return out


FAMILIES = (Family("gpt2", "GPT2LMHeadModel", keys=_keys, config=_config, sources=_sources,
                   problems=lambda m: gpt_problems(m, "gpt2"), rank=40,
                   matches=lambda m: m.position == "learned" and m.norm == "layernorm", title="GPT-2"),)

PRESETS: dict[str, dict[str, Any]] = {
    # GPT-3 175B: Brown et al. 2020, Table 2.1 (96 layers, d_model 12288, 96 heads,
    # context 2048), GPT-2 architecture (pre-LayerNorm, GELU, learned positions, biases,
    # tied embeddings, d_ff = 4 d_model); vocab 51200 is GPT-2's 50257 padded as in
    # Megatron-LM's GPT-3 runs (Narayanan et al. 2021).
    "gpt3-175b": {
        "layers": 96, "hidden": 12288, "ffn_hidden": 4 * 12288, "heads": 96, "kv_heads": 96,
        "vocab": 51200, "seq_len": 2048, "norm": "layernorm", "activation": "gelu",
        "position": "learned", "bias": True, "tie_embeddings": True, "norm_eps": 1e-5,
    },
}
