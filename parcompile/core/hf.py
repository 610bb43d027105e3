"""Import a Hugging Face ``config.json`` as `model` keys (`model NAME from "x.json"`).

Supported ``model_type`` values: those of :mod:`parcompile.core.families` (one module per
family holds its mapping: ``llama``, ``mistral``, ``mixtral``, ``qwen2``, ``qwen3`` and
``qwen3_moe`` in :mod:`~parcompile.core.families.llama`, ``gemma3_text``, ``gpt_oss``,
``deepseek_v3`` (its multi-token-prediction layers left out), ``gpt2`` and ``gpt_neox``).
``max_position_embeddings`` (GPT-2: ``n_positions``) becomes ``max_positions`` (the rows
of a learned position table) and the default ``seq_len``. Keys written in the block
override what the file gives.

Standard library only (:mod:`parcompile.core`): the front end
(:mod:`parcompile.frontend.build`) and the runtime (a checkpoint's layout,
:func:`parcompile.core.hf_weights.model_from_checkpoint_config`) read config.json alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from parcompile.core import families
from parcompile.core.dtypes import TORCH_NAMES
from parcompile.core.families.base import HFConfigError, read_int, read_str
from parcompile.core.files import MAX_JSON_BYTES, FileReadError, json_loads, read_text

SUPPORTED_MODEL_TYPES = families.MODEL_TYPES

_DTYPES = {v: k for k, v in TORCH_NAMES.items()}  # config.json's torch_dtype -> ours


def from_hf_dict(cfg: dict) -> dict[str, Any]:
    """`model` keys from a parsed ``config.json``: ``dtype`` (``torch_dtype``, transformers
    5's ``dtype``) and ``vocab`` here, the rest by its family
    (:func:`parcompile.core.families.get`). Raises :class:`HFConfigError`."""
    model_type = cfg.get("model_type")
    family = families.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        text = cfg.get("text_config")
        inner = text.get("model_type") if isinstance(text, dict) else None
        if isinstance(inner, str) and families.get(inner) is not None:   # a multimodal model's language model
            raise HFConfigError(
                f"unsupported Hugging Face model_type {json.dumps(model_type)}: a multimodal config; its "
                f"`text_config` is a `{inner}` model, which parcompile imports",
                help=f"save the `text_config` object on its own as a config.json (model_type `{inner}`) and import "
                     "that file")
        raise HFConfigError(
            f"unsupported Hugging Face model_type {json.dumps(model_type)}",
            help="supported: " + ", ".join(SUPPORTED_MODEL_TYPES),
        )
    dtype = read_str(cfg, "torch_dtype") or read_str(cfg, "dtype")   # transformers 5 writes `dtype`
    # a name torch's float32/bfloat16/float16 do not match stays as written: the front end refuses it at the
    # `from` (an invalid dtype, fixed in the file or in the block), instead of planning another dtype
    common = {"dtype": _DTYPES.get(dtype, dtype) if dtype else None, "vocab": read_int(cfg, "vocab_size")}
    return family.keys(cfg, common)


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


__all__ = ["SUPPORTED_MODEL_TYPES", "HFConfigError", "from_hf_dict", "load_hf_config"]
