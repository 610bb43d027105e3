"""Quantized weights for serving (``serve.weight_dtype``): the formats, the bytes a weight
takes in each, which weights a format quantizes, and how a Hugging Face checkpoint's
``quantization_config`` names them. Standard library only: the compiler's front end and
analyses and the runtime's loader read the same records.

Formats (:data:`FORMATS`, by name):

* ``fp8-block``: E4M3 weights with one fp32 scale per 128 x 128 block
  (``quant_method: "fp8"``, ``weight_block_size: [128, 128]``: transformers'
  ``FineGrainedFP8Config``, DeepSeek-V3's and Qwen3-*-FP8's checkpoints; tensors ``weight``
  float8_e4m3fn and ``weight_scale_inv`` fp32 ``[ceil(out/128), ceil(in/128)]``; the real
  weight is ``weight * weight_scale_inv`` blockwise);
* ``fp8-tensor``: E4M3 weights with one fp32 scale per tensor (``compressed-tensors``'
  ``float-quantized`` format with ``strategy: "tensor"``, as RedHatAI's ``*-FP8`` Llama
  checkpoints; ``weight_scale`` of one element; vLLM's ``--quantization fp8`` of a 16-bit
  checkpoint makes the same on load);
* ``fp8-channel``: E4M3 weights with one fp32 scale per output row (``compressed-tensors``
  ``strategy: "channel"``, RedHatAI's ``*-FP8-dynamic``; ``weight_scale`` ``[out, 1]``);
* ``mxfp4``: OCP MX FP4 (E2M1 values, one E8M0 scale per 32 values along the input
  dimension; OCP Microscaling Formats v1.0, section 5): gpt-oss as published
  (``quant_method: "mxfp4"``): the experts' ``*_blocks`` (uint8, two values a byte) and
  ``*_scales`` (uint8 exponents, bias 127); attention, router, embedding and head in 16 bits;
* ``int4-awq``, ``int4-gptq``: 4-bit integer weights with a 16-bit scale and a 4-bit zero
  point per group of 128 input elements (AutoAWQ's GEMM packing: ``qweight`` int32
  ``[in, out/8]``, ``qzeros`` int32 ``[in/128, out/8]``, ``scales`` fp16 ``[in/128, out]``;
  GPTQ: ``qweight`` ``[in/8, out]``, ``qzeros`` ``[in/128, out/8]``, ``scales``
  ``[in/128, out]``, ``g_idx`` int32 ``[in]``).

``serve.weight_dtype`` names the family (:data:`WEIGHT_DTYPES`: ``model``, ``fp8``,
``mxfp4``, ``int4``); a checkpoint's ``quantization_config`` names the format
(:func:`from_quantization_config`); without a checkpoint each family plans as its
:data:`DEFAULT_FORMAT`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

#: ``serve.weight_dtype``'s values: ``model`` (the model's dtype), then the quantized families
WEIGHT_DTYPES = ("model", "fp8", "mxfp4", "int4")


class QuantConfigError(Exception):
    """A ``quantization_config`` parcompile cannot serve: ``message`` and an optional ``help``."""

    def __init__(self, message: str, help: str | None = None):
        super().__init__(message)
        self.message = message
        self.help = help


@dataclass(frozen=True)
class QuantFormat:
    """One stored weight format.

    ``name``: :data:`FORMATS`' key; ``family``: its ``serve.weight_dtype``; ``bits``: bits
    per weight value; ``block``: the elements one scale covers, ``(rows, cols)`` of the
    ``(out, in)`` matrix (``(0, 0)``: the whole tensor; ``(1, 0)``: a whole row);
    ``scale_bytes``: bytes per scale; ``zero_bits``: bits of a zero point per block (0:
    symmetric); ``experts_only``: only the experts' weights are quantized (gpt-oss's
    MXFP4); ``w8a8``: the GEMMs run in FP8 on a part with FP8 tensor cores (activations
    cast per token or per tensor: vLLM's ``cutlass_scaled_mm``), else weight-only (the
    weights dequantized to 16 bits inside the kernel: Marlin, ``matmul_ogs``), at the
    16-bit rate."""

    name: str
    family: str
    bits: int
    block: tuple[int, int]
    scale_bytes: int
    zero_bits: int = 0
    experts_only: bool = False
    w8a8: bool = False
    description: str = ""

    def weight_bytes(self, dims: tuple[int, ...]) -> int:
        """Bytes of one weight of ``dims`` (``(..., out, in)``: leading dims are experts)
        stored in this format: the values, their scales and zero points (per 2-D slice,
        blocks cut at the edges counting whole).

        >>> FORMATS["fp8-block"].weight_bytes((256, 256))
        65552
        >>> FORMATS["mxfp4"].weight_bytes((2, 64, 64))
        4352
        """
        if len(dims) < 2:
            raise ValueError(f"a quantized weight has at least 2 dims, got {dims}")
        *lead, rows, cols = dims
        n = 1
        for d in lead:
            n *= d
        values = -(-rows * cols * self.bits // 8)
        br, bc = self.block
        if br == 0 and bc == 0:
            blocks = 1
        else:
            blocks = (rows if br <= 1 else -(-rows // br)) * (1 if bc == 0 else -(-cols // bc))
        return n * (values + blocks * self.scale_bytes + -(-blocks * self.zero_bits // 8))


#: every stored format, by name (module docstring)
FORMATS: dict[str, QuantFormat] = {
    "fp8-block": QuantFormat("fp8-block", "fp8", 8, (128, 128), 4, w8a8=True,
                             description="FP8 E4M3, one fp32 scale per 128 x 128 block"),
    "fp8-tensor": QuantFormat("fp8-tensor", "fp8", 8, (0, 0), 4, w8a8=True,
                              description="FP8 E4M3, one fp32 scale per tensor"),
    "fp8-channel": QuantFormat("fp8-channel", "fp8", 8, (1, 0), 4, w8a8=True,
                               description="FP8 E4M3, one fp32 scale per output channel"),
    "mxfp4": QuantFormat("mxfp4", "mxfp4", 4, (1, 32), 1, experts_only=True,
                         description="MXFP4: E2M1 values, one E8M0 scale per 32 (the experts)"),
    "int4-awq": QuantFormat("int4-awq", "int4", 4, (1, 128), 2, zero_bits=4,
                            description="INT4 weight-only (AWQ), fp16 scale and 4-bit zero per 128"),
    "int4-gptq": QuantFormat("int4-gptq", "int4", 4, (1, 128), 2, zero_bits=4,
                             description="INT4 weight-only (GPTQ), fp16 scale and 4-bit zero per 128"),
}

#: the format a ``serve.weight_dtype`` plans as when no checkpoint says otherwise: fp8 as
#: the FP8 checkpoints published with the 2025-26 models (Qwen3, DeepSeek-V3: 128 x 128
#: blocks), int4 as AWQ (the commoner on the hub)
DEFAULT_FORMAT = {"fp8": "fp8-block", "mxfp4": "mxfp4", "int4": "int4-awq"}


def weight_format(weight_dtype: str, name: str | None = None) -> QuantFormat | None:
    """The :class:`QuantFormat` of ``serve.weight_dtype`` (``name``: a checkpoint's format,
    :func:`from_quantization_config`), None for ``model``. Raises KeyError for an unknown
    name."""
    if weight_dtype == "model":
        return None
    return FORMATS[name or DEFAULT_FORMAT[weight_dtype]]


def quantized_param(kind: str, module: str, param: str, ndim: int, fmt: QuantFormat | None) -> bool:
    """Whether ``fmt`` stores the parameter ``param`` of a graph node of ``kind`` in
    ``module``: the weights (2-D, or 3-D experts) of the decoder layers' linear layers and
    experts; never the embedding, the LM head, a router, norms or biases (the published
    checkpoints' ``modules_to_not_convert`` / ``ignore``: ``lm_head``); with
    ``experts_only`` the experts alone."""
    if fmt is None or ndim < 2 or not param.endswith("weight") and kind != "experts":
        return False
    if kind == "experts":
        return True
    if fmt.experts_only or kind != "linear":
        return False
    return module.startswith("layers.")


def _read_block(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        return int(value[0]), int(value[1])
    raise QuantConfigError(f"quantization_config.weight_block_size must be two positive integers, got {value!r}")


def from_quantization_config(qc: Any) -> QuantFormat:
    """The :class:`QuantFormat` a Hugging Face ``quantization_config`` (config.json)
    describes. Raises :class:`QuantConfigError` for a method or a variant parcompile does
    not serve (its message names the field)."""
    if not isinstance(qc, Mapping):
        raise QuantConfigError("quantization_config is not a JSON object")
    method = qc.get("quant_method")
    if method == "fp8":
        block = _read_block(qc.get("weight_block_size"))
        if block is None:
            return FORMATS["fp8-tensor"]
        if block != (128, 128):
            return QuantFormat(f"fp8-block{block[0]}x{block[1]}", "fp8", 8, block, 4, w8a8=True,
                               description=f"FP8 E4M3, one fp32 scale per {block[0]} x {block[1]} block")
        return FORMATS["fp8-block"]
    if method == "mxfp4":
        return FORMATS["mxfp4"]
    if method in ("awq", "gptq"):
        bits, group = qc.get("bits", 4), qc.get("group_size", 128)
        if bits != 4:
            raise QuantConfigError(f"quantization_config.bits = {bits!r}: only 4-bit {method.upper()} is served",
                                   help="use a 4-bit checkpoint (weight_dtype = int4)")
        if group != 128:
            raise QuantConfigError(f"quantization_config.group_size = {group!r}: only groups of 128 are served",
                                   help="use a checkpoint quantized with group_size 128")
        if method == "gptq" and qc.get("desc_act"):
            raise QuantConfigError("quantization_config.desc_act = true (GPTQ act-order) is not served",
                                   help="use a checkpoint quantized with desc_act = false")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise QuantConfigError(f"quantization_config.version = {qc.get('version')!r}: only AWQ's GEMM packing "
                                   "is served")
        return FORMATS["int4-awq" if method == "awq" else "int4-gptq"]
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise QuantConfigError(f"quantization_config.quant_method = {method!r} is not served",
                           help="served: fp8 (block or per-tensor), compressed-tensors FP8, mxfp4, awq and gptq "
                                "(4-bit, group 128)")


def _compressed_tensors(qc: Mapping) -> QuantFormat:
    """compressed-tensors' ``float-quantized`` FP8 weights (``config_groups`` with one group
    whose ``weights`` are 8-bit ``float`` with ``strategy`` tensor or channel)."""
    fmt = qc.get("format") or qc.get("quantization_status")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise QuantConfigError("quantization_config.config_groups: only one group of quantized weights is served")
    (group,) = groups.values()
    w = group.get("weights") if isinstance(group, Mapping) else None
    if not isinstance(w, Mapping) or w.get("type") != "float" or w.get("num_bits") != 8:
        raise QuantConfigError("compressed-tensors: only FP8 (type float, num_bits 8) weights are served",
                               help="use an FP8 checkpoint, or an AWQ / GPTQ one for int4")
    strategy = w.get("strategy")
    if strategy not in ("tensor", "channel"):
        raise QuantConfigError(f"compressed-tensors weights strategy = {strategy!r}: tensor and channel are served")
    if qc.get("format") not in (None, "float-quantized", "naive-quantized"):
        raise QuantConfigError(f"compressed-tensors format = {fmt!r}: only float-quantized is served")
    return FORMATS["fp8-tensor" if strategy == "tensor" else "fp8-channel"]


def checkpoint_format(config: Mapping) -> QuantFormat | None:
    """The format of a checkpoint's ``config.json`` (parsed): None when it has no
    ``quantization_config``. Raises :class:`QuantConfigError`."""
    qc = config.get("quantization_config")
    return None if qc is None else from_quantization_config(qc)


__all__ = ["DEFAULT_FORMAT", "FORMATS", "QuantConfigError", "QuantFormat", "WEIGHT_DTYPES",
           "checkpoint_format", "from_quantization_config", "quantized_param", "weight_format"]
