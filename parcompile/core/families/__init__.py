"""Model families: one module per Hugging Face family, and the registry every reader of a
family asks (the front end's ``model NAME from "config.json"``: :mod:`parcompile.core.hf`;
the weight maps, config.json writer and checks: :mod:`parcompile.core.hf_weights`; the
model presets: :mod:`parcompile.config.presets`).

A family module declares ``FAMILIES`` (one :class:`~parcompile.core.families.base.Family`
per ``model_type``: its HF architecture, config.json -> keys, keys -> config.json, weight
sources, consistency problems and the rank of its guess) and ``PRESETS`` (published models
of the family, `model` keys). Adding a family is one module and one line of
:data:`MODULES`. The lowering reads no family: :func:`parcompile.ir.lower.select_rules`
chooses its rules from the model keys the family's config.json maps to (core never
imports ir), so families of one structure share them.

=========  ==========================================================================
module     model types
=========  ==========================================================================
llama      llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
deepseek_v3  deepseek_v3
gemma2     gemma2
gemma3     gemma3_text
llama4     llama4_text
gpt_oss    gpt_oss
gpt2       gpt2
gpt_neox   gpt_neox
=========  ==========================================================================
"""

from __future__ import annotations

from typing import Any

from parcompile.core.families import base, deepseek_v3, gemma2, gemma3, gpt2, gpt_neox, gpt_oss, llama, llama4
from parcompile.core.families.base import Family
from parcompile.core.model import ModelKeys

#: the family modules; presets are listed in this order
MODULES = (llama, deepseek_v3, gemma2, gemma3, llama4, gpt_oss, gpt2, gpt_neox)

_BY_TYPE: dict[str, Family] = {f.model_type: f for mod in MODULES for f in mod.FAMILIES}
#: every model_type parcompile reads and writes, sorted
MODEL_TYPES: tuple[str, ...] = tuple(sorted(_BY_TYPE))
#: model_type -> transformers' architecture class
ARCHITECTURES: dict[str, str] = {t: _BY_TYPE[t].architecture for t in MODEL_TYPES}
#: the keys only some families have, by feature (:data:`parcompile.core.families.base.FEATURES`,
#: then each family's own :attr:`~parcompile.core.families.base.Family.owns`)
FEATURES: dict = {**base.FEATURES, **{k: v for f in _BY_TYPE.values() for k, v in f.owns.items()}}
_GUESS_ORDER: tuple[Family, ...] = tuple(sorted(_BY_TYPE.values(), key=lambda f: (f.rank, f.model_type)))

#: the help of a model no family expresses
FAMILIES_HELP = ("families: gpt2 (learned positions, LayerNorm, biases), gpt_neox (LayerNorm, RoPE, biases), "
                 "llama/mistral/qwen2 (RMSNorm, SwiGLU, RoPE), qwen3 (the same with qk_norm), mixtral (the "
                 "same with routed experts), qwen3_moe (qwen3 with routed experts, leading dense layers), "
                 "gemma2 (Gemma 3 without qk_norm, with attention and final logit soft-capping), gemma3_text (sandwich (1 + w) RMSNorms, GeGLU, qk_norm, scaled embeddings, local and "
                 "global layers), deepseek_v3 (multi-head latent attention, sigmoid group-limited "
                 "router, shared experts), llama4_text (RoPE and NoPE layers, chunked attention, L2 qk-norm, "
                 "interleaved MoE layers with a shared expert)")


def get(model_type: str) -> Family | None:
    """The family of ``model_type`` (a config.json's), None when parcompile has none."""
    return _BY_TYPE.get(model_type)


def for_model(model: ModelKeys) -> Family:
    """The family ``model`` looks like: the first by rank whose ``matches`` holds (Llama's
    always does). It may still be unable to express the model
    (:func:`parcompile.core.hf_weights.family_problems`)."""
    return next(f for f in _GUESS_ORDER if f.matches(model))


def model_presets() -> dict[str, dict[str, Any]]:
    """Every family's presets, name -> `model` keys, in :data:`MODULES` order."""
    return {name: keys for mod in MODULES for name, keys in mod.PRESETS.items()}


__all__ = ["ARCHITECTURES", "FAMILIES_HELP", "FEATURES", "MODEL_TYPES", "MODULES", "Family", "for_model", "get", "model_presets"]
