"""Where our parameters live in a Hugging Face checkpoint: :mod:`parcompile.core.hf_weights`
(standard library only, shared with the runtime), re-exported for the compiler's checks
and export. Its functions take the compiler's :class:`~parcompile.config.schema.ModelConfig`
or the runtime's :class:`~parcompile.core.model.ModelKeys` alike.
"""

from __future__ import annotations

from parcompile.core.hf_weights import (ARCHITECTURES, FAMILIES, HF_DTYPES, SAFETENSORS_BYTES, TRANSFORMERS_VERSION,
                                        VOCAB_PARAMS, HFWeightsError, Problem, Source, check_checkpoint,
                                        checkpoint_files, expected_shapes, family_problems, hf_config, hf_family,
                                        init_from_kind, model_from_checkpoint_config, read_config, read_header,
                                        rope_dim, scan_checkpoint, tensor_map)

__all__ = [
    "FAMILIES", "Problem", "HFWeightsError", "Source", "hf_family", "family_problems", "tensor_map",
    "expected_shapes", "hf_config", "init_from_kind", "check_checkpoint", "read_header", "scan_checkpoint", "checkpoint_files",
    "read_config", "model_from_checkpoint_config", "rope_dim", "VOCAB_PARAMS", "HF_DTYPES", "ARCHITECTURES",
    "SAFETENSORS_BYTES", "TRANSFORMERS_VERSION",
]
