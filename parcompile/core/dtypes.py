"""Element types by name: bytes per element, the bytes of gradients, torch's names.

Names are the spec's (``fp32``, ``bf16``, ``fp16``; ``fp8`` only for a serving KV cache)
plus the IR's integer and mask types. The torch objects live in
:mod:`parcompile.runtime.machine.dtypes`, built from :data:`TORCH_NAMES`.
"""

from __future__ import annotations

#: bytes per element of every dtype a tensor, a parameter or a KV cache may have
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int64": 8, "bool": 1}

#: bytes per element of gradients and their data-parallel reductions (fp32 main grads,
#: Megatron-LM's grad buffer, whatever the model dtype; ``reduce_dtype`` may narrow the
#: ZeRO 2/3 per-micro-batch buffers: ``core/buckets.py: bucket_element_bytes``)
GRAD_BYTES = 4

#: fp32 states the optimizer keeps per parameter (Adam's two moments; SGD none), beside the
#: fp32 master weights of a 16-bit model: the memory analysis and a checkpoint's size
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 0}

#: the model dtypes (``model.dtype``, ``parallel.reduce_dtype``) -> torch's names, which are
#: also Hugging Face's ``torch_dtype`` in config.json
TORCH_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

#: torch's name of the KV cache's ``fp8`` (OCP E4M3, vLLM's ``kv_cache_dtype = "fp8"``);
#: torch builds without it fall back to fp16 (:mod:`parcompile.runtime.machine.dtypes`)
FP8_TORCH_NAME = "float8_e4m3fn"

__all__ = ["DTYPE_BYTES", "GRAD_BYTES", "OPTIMIZER_STATES", "TORCH_NAMES", "FP8_TORCH_NAME"]
