"""torch's dtype objects by the spec's names, built from :mod:`parcompile.core.dtypes`."""

from __future__ import annotations

import torch

from parcompile.core.dtypes import FP8_TORCH_NAME, TORCH_NAMES

#: ``model.dtype`` / ``parallel.reduce_dtype`` -> torch dtype
TORCH_DTYPES: dict[str, torch.dtype] = {k: getattr(torch, v) for k, v in TORCH_NAMES.items()}

#: ``serve.kv_dtype`` -> torch dtype: the model dtypes and ``fp8`` (fp16 where torch lacks it)
KV_TORCH_DTYPES: dict[str, torch.dtype] = {**TORCH_DTYPES, "fp8": getattr(torch, FP8_TORCH_NAME, torch.float16)}

__all__ = ["TORCH_DTYPES", "KV_TORCH_DTYPES"]
