"""Import a Hugging Face ``config.json`` as `model` keys (`model NAME from "x.json"`).

The mapping is :mod:`parcompile.core.hf` (standard library only: the runtime reads a
checkpoint's config.json with it too); this module re-exports it for the front end.
"""

from __future__ import annotations

from parcompile.core.hf import SUPPORTED_MODEL_TYPES, HFConfigError, from_hf_dict, load_hf_config

__all__ = ["SUPPORTED_MODEL_TYPES", "HFConfigError", "from_hf_dict", "load_hf_config"]
