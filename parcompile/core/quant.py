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
  checkpoints; ``weight_scale`` of one element; vLLM's ``--quantization fp8_per_tensor`` of a 16-bit
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

How a checkpoint stores one quantized weight (:func:`stored_tensors`, :func:`stored_quantized`;
the checks of :func:`parcompile.core.hf_weights.check_checkpoint` and the serving ranks'
reader, :mod:`parcompile.runtime.model.quant`, read these records), each as transformers 5.25.0 reads
it on a CPU:

* ``fp8-block``: ``NAME`` F8_E4M3 (the weight's own name and shape) and ``STEM.weight_scale_inv``
  (``NAME + "_scale_inv"`` when ``NAME`` does not end in ``.weight``: transformers'
  ``integrations/finegrained_fp8.py`` ``Fp8Quantize._quantize_one``) of ``[..., ceil(out/b0),
  ceil(in/b1)]``, one float per block, the last blocks cut at the edge (DeepSeek-V3's
  ``kv_a_proj_with_mqa``: 576 rows, 5 block rows); weight = ``float32(w) * scale`` blockwise
  (``Fp8Dequantize._dequantize_one``; transformers dequantizes so on load without a GPU:
  ``quantizers/quantizer_finegrained_fp8.py`` ``validate_environment``);
* ``fp8-tensor``, ``fp8-channel`` (compressed-tensors ``float-quantized``): ``NAME`` F8_E4M3 and
  ``STEM.weight_scale`` of one element, or ``[out, 1]`` per channel; optionally
  ``STEM.input_scale`` (one element: a static activation scale); weight = ``w.to(scale.dtype) *
  scale`` (compressed-tensors 0.20 ``quantization/lifecycle/forward_helpers.py`` ``_dequantize``);
* ``mxfp4`` (gpt-oss): ``NAME_blocks`` U8 ``[..., out, ceil(in/32), 16]`` (two E2M1 values a
  byte, the even element in the low nibble) and ``NAME_scales`` U8 ``[..., out, ceil(in/32)]``
  (E8M0 exponents, bias 127), ``NAME`` being the dense tensor's name (``mlp.experts.gate_up_proj``,
  whose dense form is stored ``(in, out)``); transformers' ``integrations/mxfp4.py``
  ``_convert_moe_packed_tensors``;
* ``int4-awq``: ``STEM.qweight`` I32 ``[in, out/8]``, ``STEM.qzeros`` I32 ``[in/128, out/8]``,
  ``STEM.scales`` F16 ``[in/128, out]``; ``int4-gptq``: ``STEM.qweight`` I32 ``[in/8, out]``,
  ``STEM.qzeros``, ``STEM.scales`` as AWQ's, ``STEM.g_idx`` I32 ``[in]`` (optional).
"""

from __future__ import annotations

import re
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
    :func:`from_quantization_config`, :func:`format_named`), None for ``model``. Raises
    KeyError for an unknown name."""
    if weight_dtype == "model":
        return None
    return format_named(name or DEFAULT_FORMAT[weight_dtype])


def weight_key(name: str) -> str:
    """A weight's name without its layer and expert indices, the same for every layer that
    holds it (a serve program lists the weights it holds quantized by these keys):

    >>> weight_key("layers.3.mlp.experts.5.w1.weight"), weight_key("layers.0.attn.wq.weight")
    ('mlp.experts.w1.weight', 'attn.wq.weight')
    """
    return re.sub(r"\.experts\.\d+\.", ".experts.", re.sub(r"^layers\.\d+\.", "", name))


def quantized_param(kind: str, module: str, param: str, ndim: int, fmt: QuantFormat | None) -> bool:
    """Whether ``fmt`` stores the parameter ``param`` of a graph node of ``kind`` in
    ``module``: the weights (2-D, or 3-D experts) of the decoder layers' linear layers and
    experts; never the embedding, the LM head, a router, norms or biases (the published
    checkpoints' ``modules_to_not_convert`` / ``ignore``: ``lm_head``); with
    ``experts_only`` the experts alone."""
    if fmt is None or ndim < 2 or not param.endswith("weight"):   # (an expert's bias is 2-D: never quantized)
        return False
    if kind == "experts":
        return True
    if fmt.experts_only or kind != "linear":
        return False
    return module.startswith("layers.")


def format_named(name: str) -> QuantFormat:
    """The :class:`QuantFormat` of a ``serve.weight_format`` name: a :data:`FORMATS` key, or
    ``fp8-block{R}x{C}`` (:func:`from_quantization_config`'s name of a block size other than
    128 x 128). Raises KeyError for another name."""
    if name in FORMATS:
        return FORMATS[name]
    rows, _, cols = name.removeprefix("fp8-block").partition("x")
    if name.startswith("fp8-block") and rows.isdigit() and cols.isdigit() and int(rows) > 0 and int(cols) > 0:
        return from_quantization_config({"quant_method": "fp8", "weight_block_size": [int(rows), int(cols)]})
    raise KeyError(name)


#: safetensors dtype names of the float tensors a scale may be stored as
FLOAT_DTYPES = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class StoredTensor:
    """One tensor a checkpoint stores a quantized weight as: its ``role`` (``weight``,
    ``scale``, ``input_scale``, ``blocks``, ``scales``, ``qweight``, ``qzeros``, ``g_idx``),
    its ``name``, its ``shape`` (None: any shape of one element), the safetensors ``dtypes``
    it may have, and whether it may be absent (``optional``)."""

    role: str
    name: str
    shape: tuple[int, ...] | None
    dtypes: tuple[str, ...]
    optional: bool = False

    def fits(self, dtype: str, shape: tuple[int, ...]) -> bool:
        """Whether a header entry of ``dtype`` and ``shape`` is this tensor."""
        if dtype not in self.dtypes:
            return False
        if self.shape is None:
            n = 1
            for d in shape:
                n *= d
            return n == 1
        return tuple(shape) == self.shape

    def wanted(self) -> str:
        """The dtype(s) and shape it needs, for a message: ``F32 (4, 2)``."""
        shape = "one element" if self.shape is None else str(self.shape)
        return f"{' or '.join(self.dtypes)} {shape}"


def _stem(name: str, suffix: str) -> str:
    """``a.b.weight`` -> ``a.b.<suffix>``; a name not ending in ``.weight`` (a fused expert
    tensor) -> ``name_<suffix>`` (transformers' Fp8Quantize names its scales so)."""
    return name[:-len("weight")] + suffix if name.endswith(".weight") else f"{name}_{suffix}"


def stored_tensors(fmt: QuantFormat, name: str, shape: tuple[int, ...], transpose: bool = False
                   ) -> tuple[StoredTensor, ...]:
    """The tensors a checkpoint of format ``fmt`` stores the weight ``name`` as (module
    docstring), whose dense form has ``shape`` (the checkpoint's orientation: ``(..., out,
    in)``, or ``(..., in, out)`` with ``transpose``, as gpt-oss's fused experts). The first
    is the one whose presence says the weight is stored quantized (:func:`stored_quantized`).

    >>> [(t.name, t.shape) for t in stored_tensors(FORMATS["mxfp4"], "e.gate_up_proj", (2, 64, 96), True)]
    [('e.gate_up_proj_blocks', (2, 96, 2, 16)), ('e.gate_up_proj_scales', (2, 96, 2))]
    """
    *lead, r, c = shape
    out, inp = (c, r) if transpose else (r, c)
    lead = tuple(lead)
    if fmt.family == "fp8":
        weight = StoredTensor("weight", name, tuple(shape), ("F8_E4M3",))
        if fmt.name.startswith("fp8-block"):
            b0, b1 = fmt.block
            return weight, StoredTensor("scale", _stem(name, "weight_scale_inv"),
                                        lead + (-(-r // b0), -(-c // b1)), FLOAT_DTYPES)
        scale = (StoredTensor("scale", _stem(name, "weight_scale"), None, FLOAT_DTYPES) if fmt.block == (0, 0) else
                 StoredTensor("scale", _stem(name, "weight_scale"), lead + (out, 1), FLOAT_DTYPES))
        return weight, scale, StoredTensor("input_scale", _stem(name, "input_scale"), None, FLOAT_DTYPES, True)
    if fmt.family == "mxfp4":
        groups = -(-inp // 32)
        return (StoredTensor("blocks", f"{name}_blocks", lead + (out, groups, 16), ("U8",)),
                StoredTensor("scales", f"{name}_scales", lead + (out, groups), ("U8",)))
    stem = name.removesuffix(".weight")
    groups, packed = -(-inp // 128), -(-out // 8)
    zeros = StoredTensor("qzeros", f"{stem}.qzeros", lead + (groups, packed), ("I32",))
    scales = StoredTensor("scales", f"{stem}.scales", lead + (groups, out), ("F16", "BF16", "F32"))
    if fmt.name == "int4-awq":
        return StoredTensor("qweight", f"{stem}.qweight", lead + (inp, packed), ("I32",)), zeros, scales
    return (StoredTensor("qweight", f"{stem}.qweight", lead + (-(-inp // 8), out), ("I32",)), zeros, scales,
            StoredTensor("g_idx", f"{stem}.g_idx", lead + (inp,), ("I32",), True))


def stored_quantized(fmt: QuantFormat | None, name: str, dtypes: Mapping[str, str]) -> bool:
    """Whether a checkpoint holding tensors of ``dtypes`` (name -> safetensors dtype) stores
    the weight ``name`` in ``fmt``: fp8 as an F8_E4M3 ``name``; mxfp4 and int4 by their
    first tensor (``name_blocks``, ``STEM.qweight``). A weight a format leaves in 16 bits
    (``modules_to_not_convert``, ``ignore``) is stored dense under its own name."""
    if fmt is None:
        return False
    if fmt.family == "fp8":
        return dtypes.get(name) == "F8_E4M3"
    if fmt.family == "mxfp4":
        return f"{name}_blocks" in dtypes
    return f"{name.removesuffix('.weight')}.qweight" in dtypes


#: the longest side of an FP8 scale block: no weight is longer, and a rank holds its blocks'
#: indices as int32 (runtime/model/quant.py FP8Weight)
MAX_BLOCK = 2**31 - 1


def _read_block(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_BLOCK for v in value)):
        return int(value[0]), int(value[1])
    raise QuantConfigError(f"quantization_config.weight_block_size must be two positive integers of at most {MAX_BLOCK}, "
                           f"got {value!r}",
                           help="FP8 block-scaled checkpoints give e.g. [128, 128]; null means one scale per tensor")


def from_quantization_config(qc: Any) -> QuantFormat:
    """The :class:`QuantFormat` a Hugging Face ``quantization_config`` (config.json)
    describes. Raises :class:`QuantConfigError` for a method or a variant parcompile does
    not serve (its message names the field)."""
    if not isinstance(qc, Mapping):
        raise QuantConfigError("quantization_config is not a JSON object",
                               help="a quantized checkpoint's config.json holds an object with its quant_method")
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
        if method == "gptq" and qc.get("desc_act", False) is not False:
            raise QuantConfigError(f"quantization_config.desc_act = {qc.get('desc_act')!r} (GPTQ act-order) is not served",
                                   help="use a checkpoint quantized with desc_act = false")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise QuantConfigError(f"quantization_config.version = {qc.get('version')!r}: only AWQ's GEMM packing "
                                   "is served", help="use an AWQ checkpoint of the GEMM version (AutoAWQ's default)")
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
        raise QuantConfigError("quantization_config.config_groups: only one group of quantized weights is served",
                               help="serve a checkpoint whose weights share one FP8 scheme (RedHatAI's *-FP8, *-FP8-dynamic)")
    (group,) = groups.values()
    w = group.get("weights") if isinstance(group, Mapping) else None
    if not isinstance(w, Mapping) or w.get("type") != "float" or w.get("num_bits") != 8:
        raise QuantConfigError("compressed-tensors: only FP8 (type float, num_bits 8) weights are served",
                               help="use an FP8 checkpoint, or an AWQ / GPTQ one for int4")
    strategy = w.get("strategy")
    if strategy not in ("tensor", "channel"):
        raise QuantConfigError(f"compressed-tensors weights strategy = {strategy!r}: tensor and channel are served",
                               help="serve an FP8 checkpoint with one scale per tensor or per output channel")
    if qc.get("format") not in (None, "float-quantized", "naive-quantized"):
        raise QuantConfigError(f"compressed-tensors format = {fmt!r}: only float-quantized is served",
                               help="serve a compressed-tensors checkpoint saved as float-quantized (llm-compressor's FP8)")
    return FORMATS["fp8-tensor" if strategy == "tensor" else "fp8-channel"]


def checkpoint_format(config: Mapping) -> QuantFormat | None:
    """The format of a checkpoint's ``config.json`` (parsed): None when it has no
    ``quantization_config``. Raises :class:`QuantConfigError`."""
    qc = config.get("quantization_config")
    return None if qc is None else from_quantization_config(qc)


__all__ = ["DEFAULT_FORMAT", "FLOAT_DTYPES", "FORMATS", "QuantConfigError", "QuantFormat", "StoredTensor",
           "WEIGHT_DTYPES", "checkpoint_format", "format_named", "from_quantization_config", "quantized_param",
           "stored_quantized", "stored_tensors", "weight_format", "weight_key"]
