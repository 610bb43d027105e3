"""Quantized weights on a serving rank (``serve.weight_dtype``; the formats, the tensors a
checkpoint stores each weight as, and which weights a plan holds quantized are
:mod:`parcompile.core.quant`'s): read from a Hugging Face checkpoint as published, each rank
its own shard; held quantized (FP8 bytes and their scales, MXFP4 blocks and exponents, int4
words with their zero points and scales), so a
rank's memory is the quantized bytes the plan prices; dequantized to the compute dtype
inside the layer's forward, one weight at a time (on a CPU dequantize-then-matmul; a GPU
path may call ``torch._scaled_mm`` instead).

How (:func:`hold`): the dense parameter is removed from its module (a
``ColumnParallelLinear``, ``RowParallelLinear``, ``ReplicatedLinear``, or one expert of a
``GroupedExperts``) and a :class:`QuantizedWeight` sits beside it as ``{attr}_q``; the
module's class becomes a subclass whose ``{attr}`` is a property returning the dequantized
weight, so every reader of ``module.weight`` (the layer's forward, MLA's absorbed query)
runs unchanged and the dense tensor lives only while the GEMM runs. Where the checkpoint's
scheme quantizes the activations too (compressed-tensors' ``input_activations``), the
subclass's forward first fake-quantizes its input as compressed-tensors does (below).

Each format's arithmetic is the one transformers 5.25.0 runs on a CPU for the same
checkpoint, so the greedy tokens are transformers':

* ``fp8-block`` (``quant_method: "fp8"``): ``(float32(w) * float32(scale_inv)).to(dtype)``
  blockwise (``transformers/integrations/finegrained_fp8.py`` ``Fp8Dequantize._dequantize_one``;
  without a GPU ``quantizers/quantizer_finegrained_fp8.py`` sets ``dequantize = True`` and the
  model runs dense: weight-only, the activations unquantized);
* ``fp8-tensor``, ``fp8-channel`` (``compressed-tensors``): ``(w.to(s.dtype) * s).to(dtype)``,
  the scale in the compute dtype (compressed-tensors 0.20.1
  ``quantization/lifecycle/forward_helpers.py`` ``_dequantize``); transformers decompresses
  the weights on the first forward and keeps compressed-tensors' wrapped forward
  (``quantization/lifecycle/forward.py`` ``set_forward_quantized``), which fake-quantizes each
  linear layer's input per the checkpoint's ``input_activations``: ``dynamic`` per token
  (``utils/helpers.py`` ``compute_dynamic_scales_and_zp``: scale = amax|x| over the last dim /
  448) or static per tensor (``input_scale``), then ``clamp(x / s, -448, 448)`` cast to
  E4M3 and back, times ``s`` (``_quantize_dequantize``); :func:`fake_quantize_fp8` does the
  same. Under tp a row-parallel layer's dynamic scale is its rank's part of the row (vLLM's
  per-rank quantization), so tp > 1 may round activations differently from one process;
  experts (``GroupedExperts``) of such a checkpoint are weight-only;
* ``mxfp4`` (gpt-oss): the E2M1 table in ``dtype``, the even element in the low nibble, then
  ``ldexp`` by ``scale - 127`` (``integrations/mxfp4.py`` ``_convert_moe_packed_tensors``;
  without Triton ``quantizers/quantizer_mxfp4.py`` sets ``dequantize = True``): weight-only;
* ``int4-awq``, ``int4-gptq`` (4 bits, groups of 128; transformers loads them only through
  gptqmodel, a GPU library, so the rule is the formats' own): ``(q - z) * s`` in the scales'
  dtype, AWQ's nibbles in AutoAWQ's GEMM order (``awq/utils/packing_utils.py``
  ``dequantize_gemm``), GPTQ's in order, its v1 zero points plus one (:func:`zero_offset`);
  weight-only.

Shards that do not align with the scale blocks (a row-parallel weight whose ``in / tp`` is
not a multiple of the block, a kv head inside a block): the rank reads the blocks of scales
(MXFP4: the 32-value groups) that cover its rows and columns and keeps, per local row and
column, the index of its block (FP8), or the offset into its first group (MXFP4), so its
values are exactly the global tensor's. A rank may so hold a few scales (MXFP4 values) of
its neighbours' shard: at most one block row and column per weight.

``weight_dtype = fp8`` without a checkpoint quantized so (a 16-bit one: vLLM's
``--quantization fp8_per_tensor``; the seeded initialisation; a training program's DCP checkpoint):
:func:`quantize_on_load` quantizes each weight the plan holds quantized, after loading, to
E4M3 with one fp32 scale (``amax / 448``) per block of the program's format over the global
tensor (``fp8-tensor``, which the front end sets for a 16-bit checkpoint: one per tensor;
``fp8-block``: 128 x 128 blocks), the amaxes all-reduced over the ranks that hold its shards,
so every layout holds the same values (vLLM's per-tensor scale is its rank's shard's);
weight-only. The dense tensors are loaded first, so a rank's memory peaks at the dense
weights during the load.

Hostile checkpoints: every tensor is checked against :func:`parcompile.core.quant.stored_tensors`
(dtype, shape) before it is read, and a GPTQ ``g_idx`` must name groups the checkpoint has; a wrong
one is a :class:`parcompile.runtime.state.weights.WeightsError` naming the file and the tensor. Scale values are not checked: a huge exponent gives
non-finite logits, which the engine answers per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from parcompile.core.families.base import Source
from parcompile.core.quant import QuantFormat, StoredTensor, stored_tensors, weight_key
from parcompile.runtime.distributed.comm import all_reduce
from parcompile.runtime.distributed.context import Axis
from parcompile.runtime.serve.generate import ServeError

#: the largest E4M3 value (``torch.finfo(torch.float8_e4m3fn).max``)
FP8_MAX = 448.0
FP8 = torch.float8_e4m3fn
#: the 16 E2M1 values by their 4-bit code (sign in bit 3): OCP Microscaling Formats v1.0, 5.3.3;
#: transformers' ``integrations/mxfp4.py`` ``FP4_VALUES``
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: the bias of an E8M0 exponent (a scale of ``2 ** (byte - 127)``)
E8M0_BIAS = 127
#: values per MXFP4 block (one exponent each)
MX_BLOCK = 32


class QuantError(ServeError):
    """A quantized tensor parcompile cannot read: ``message`` and an optional ``help``
    (:func:`parcompile.runtime.state.weights.load_hf` reports it as a ``WeightsError``)."""

    def __init__(self, message: str, help: str | None = None):
        super().__init__(message)
        self.message = message
        self.help = help


# --------------------------------------------------------------------------- arithmetic


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 ``data`` (out, in) times ``scale`` (broadcast to it) in the scale's dtype, then
    cast to ``dtype``: transformers' ``Fp8Dequantize`` with fp32 scales, compressed-tensors'
    ``_dequantize`` with scales in the compute dtype (module docstring)."""
    return (data.to(scale.dtype) * scale).to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 ``blocks`` (rows, G, 16) uint8 and ``scales`` (rows, G) uint8 -> (rows, 32 G)
    in ``dtype``: each byte two E2M1 values (low nibble first) from :data:`E2M1_VALUES` in
    ``dtype``, each block of 32 times ``2 ** (scale - 127)`` by ``torch.ldexp``, as
    transformers' ``_convert_moe_packed_tensors`` (``integrations/mxfp4.py``)."""
    rows, groups, width = blocks.shape
    lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    flat = blocks.reshape(rows * groups, width)
    out = torch.empty(rows * groups, 2 * width, dtype=dtype, device=blocks.device)
    out[:, 0::2] = lut[(flat & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(flat >> 4).to(torch.int)]
    torch.ldexp(out, (scales.to(torch.int32) - E8M0_BIAS).reshape(rows * groups, 1), out=out)
    return out.view(rows, groups * 2 * width)


#: AutoAWQ's GEMM packing: nibble ``i`` of an int32 holds element ``AWQ_ORDER[i]`` of its 8
#: (``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear``); reading back, element ``j`` is
#: nibble ``AWQ_REVERSE_ORDER[j]`` (``awq/utils/packing_utils.py`` ``reverse_awq_order``; vLLM's
#: ``awq_dequantize_torch`` in its kernel tests)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 ``packed``, eight 4-bit values each (nibble ``i`` at bits ``4i``), unpacked along
    ``dim`` (eight times as long there): element ``8k + j`` is nibble ``order[j]`` of word
    ``k`` (``order`` None: nibble ``j``, GPTQ's sequential packing; :data:`AWQ_REVERSE_ORDER`:
    AWQ's). Values 0..15, int32."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    if order is not None:
        shifts = shifts[list(order)]
    x = packed.movedim(dim, -1)
    v = torch.bitwise_and(torch.bitwise_right_shift(x.unsqueeze(-1), shifts), 0xF)
    return v.reshape(*x.shape[:-1], x.shape[-1] * 8).movedim(-1, dim)


def dequantize_int4(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """4-bit ``q`` (in, out) with each element's ``zeros`` and ``scales`` (broadcast, the
    group's): ``(q - z) * s`` in the scales' dtype (AutoAWQ's ``dequantize_gemm``, gptqmodel's
    torch kernel ``scales[g_idx] * (weight - zeros[g_idx])``), then cast to ``dtype``."""
    return ((q - zeros).to(scales.dtype) * scales).to(dtype)


def fp8_scales(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales ``amax / 448`` of blocks whose largest magnitude is ``amax`` (1 where a
    block is all zero): a block divided by its scale fills E4M3's range."""
    scale = amax.float() / FP8_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight`` divided by ``scale`` (broadcast to it), clamped to +-448 and rounded to
    E4M3 (vLLM's ``scaled_fp8_quant``); ``dequantize_fp8(values, scale, dtype)`` gives the
    weight again to within E4M3's rounding."""
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (..., K) through E4M3 and back, as compressed-tensors fake-quantizes a linear
    layer's input (module docstring): with ``scale`` (one element, static) or per token
    (``amax|x|`` over the last dim / 448, a zero scale made fp32's eps:
    ``calculate_qparams``); ``clamp(x / s, -448, 448)`` to E4M3, back to ``x``'s dtype,
    times ``s``."""
    if scale is None:
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = amax / FP8_MAX
        scale = torch.where(scale == 0, torch.tensor(torch.finfo(scale.dtype).eps, dtype=scale.dtype,
                                                        device=scale.device), scale)
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype)
    return q.to(scale.dtype) * scale


# --------------------------------------------------------------------------- held weights


#: the layout attributes a parameter carries (:func:`parcompile.runtime.model.layers.make_param`)
LAYOUT = ("global_name", "global_shape", "shard_dim", "shard_index", "num_shards", "valid_rows")


class QuantizedWeight(nn.Module):
    """One weight held quantized on this rank: its shard ``shape`` (out, in) and the layout of
    the parameter it replaces (:data:`LAYOUT`); :meth:`dequantize` gives the (out, in)
    weight in ``dtype``. ``fmt``: its :class:`~parcompile.core.quant.QuantFormat` name.
    ``input``: None, ``"token"`` or ``"static"``: how the layer's input is fake-quantized
    (compressed-tensors' ``input_activations``; ``input_scale`` for static)."""

    def __init__(self, like: torch.Tensor, shape: tuple[int, int], fmt: str, dtype: torch.dtype):
        super().__init__()
        for k in LAYOUT:
            setattr(self, k, getattr(like, k, None))
        self.shape = tuple(shape)
        self.fmt, self.dtype = fmt, dtype
        self.input: str | None = None
        self.input_scale: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's input as the checkpoint's scheme quantizes it (:attr:`input`)."""
        if self.input is None:
            return x
        return fake_quantize_fp8(x, self.input_scale if self.input == "static" else None)

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds for the weight: its buffers (values, scales, indices)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.global_name}, {self.fmt}, shard {self.shape}, {self.nbytes} bytes"


class FP8Weight(QuantizedWeight):
    """E4M3 ``data`` (out, in) and its scales: ``scale`` (R, C), this rank's covering blocks
    (``fp8-block``: fp32), one element (``fp8-tensor``) or one per row (``fp8-channel``, (out,
    1)), in the compute dtype for compressed-tensors' formats; ``rows`` (out,) and ``cols``
    (in,) the block of each local row and column (``fp8-block`` only; int32)."""

    def __init__(self, like, fmt: str, dtype, data: torch.Tensor, scale: torch.Tensor,
                 rows: torch.Tensor | None = None, cols: torch.Tensor | None = None):
        super().__init__(like, tuple(data.shape), fmt, dtype)
        self.register_buffer("data", data)
        self.register_buffer("scale", scale)
        self.register_buffer("rows", rows)
        self.register_buffer("cols", cols)

    def dequantize(self) -> torch.Tensor:
        s = self.scale
        if self.rows is not None:
            s = s.index_select(0, self.rows).index_select(1, self.cols)
        return dequantize_fp8(self.data, s, self.dtype)


class MXFP4Weight(QuantizedWeight):
    """MXFP4 ``blocks`` (out, G, 16) and ``scales`` (out, G) covering this rank's columns
    ``[offset, offset + in)`` of the G blocks' 32 G values."""

    def __init__(self, like, fmt: str, dtype, blocks: torch.Tensor, scales: torch.Tensor, offset: int, cols: int):
        super().__init__(like, (blocks.shape[0], cols), fmt, dtype)
        self.register_buffer("blocks", blocks)
        self.register_buffer("scales", scales)
        self.offset = offset

    def dequantize(self) -> torch.Tensor:
        w = dequantize_mxfp4(self.blocks, self.scales, self.dtype)
        if self.offset == 0 and w.shape[1] == self.shape[1]:
            return w
        return w[:, self.offset:self.offset + self.shape[1]]


class Int4Weight(QuantizedWeight):
    """4-bit integers with a scale and a zero point per group of 128 inputs (``int4-awq``,
    ``int4-gptq``), the checkpoint's packed words covering this rank's (out, in) shard:
    ``qweight`` (AWQ: (in, P) packed along out; GPTQ: (P', out) packed along in), ``qzeros``
    (G, P) packed along out, ``scales`` (G, 8 P for AWQ, out for GPTQ); ``groups`` (in,) each
    local input's group; ``out_offset`` / ``in_offset`` where the shard starts in the first
    packed word; ``zero_add``: 1 for GPTQ's v1 checkpoints (they store ``zero - 1``)."""

    def __init__(self, like, fmt: str, dtype, shape: tuple[int, int], qweight, qzeros, scales, groups,
                 out_offset: int, in_offset: int = 0, zero_add: int = 0):
        super().__init__(like, shape, fmt, dtype)
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)
        self.register_buffer("groups", groups)
        self.out_offset, self.in_offset, self.zero_add = out_offset, in_offset, zero_add

    def dequantize(self) -> torch.Tensor:
        out, inp = self.shape
        awq = self.fmt == "int4-awq"
        zeros = unpack_int4(self.qzeros, 1, AWQ_REVERSE_ORDER if awq else None) + self.zero_add
        if awq:   # (in, 8 P): the words' columns, the shard inside them
            q = unpack_int4(self.qweight, 1, AWQ_REVERSE_ORDER)
            w = dequantize_int4(q, zeros.index_select(0, self.groups), self.scales.index_select(0, self.groups),
                                self.dtype)[:, self.out_offset:self.out_offset + out]
        else:     # (8 P', out): the words' rows, the shard inside them
            q = unpack_int4(self.qweight, 0)[self.in_offset:self.in_offset + inp]
            z = zeros[:, self.out_offset:self.out_offset + out]
            w = dequantize_int4(q, z.index_select(0, self.groups), self.scales.index_select(0, self.groups), self.dtype)
        return w.t()


def _dequantized(attr: str) -> property:
    def get(self):
        return self._modules[f"{attr}_q"].dequantize()
    return property(get, doc=f"``{attr}`` dequantized from ``{attr}_q`` (runtime/model/quant.py)")


def _quantizing_forward(base: type) -> Callable:
    def forward(self, x, *args, **kwargs):
        return base.forward(self, self._modules["weight_q"].quantize_input(x), *args, **kwargs)
    return forward


_CLASSES: dict[tuple, type] = {}


def _holding_class(cls: type, attrs: Iterable[str], quantize_input: bool) -> type:
    """``cls`` (or the class it was made from) with a :func:`_dequantized` property per
    quantized attribute, and with ``quantize_input`` a forward fake-quantizing its input."""
    base = cls.__dict__.get("_unquantized", cls)
    attrs = tuple(sorted(set(cls.__dict__.get("_quantized_attrs", ())) | set(attrs)))
    quantize_input = quantize_input or cls.__dict__.get("_quantizes_input", False)
    key = (base, attrs, quantize_input)
    if key not in _CLASSES:
        ns: dict[str, Any] = {a: _dequantized(a) for a in attrs}
        ns.update(_unquantized=base, _quantized_attrs=attrs, _quantizes_input=quantize_input,
                  __doc__=f"{base.__name__} holding {', '.join(attrs)} quantized (parcompile/runtime/model/quant.py)")
        if quantize_input:
            ns["forward"] = _quantizing_forward(base)
        _CLASSES[key] = type(f"Quantized{base.__name__}", (base,), ns)
    return _CLASSES[key]


def hold(owner: nn.Module, attr: str, q: QuantizedWeight) -> None:
    """Hold ``owner.{attr}`` as ``q`` (module docstring): the parameter removed, ``q``
    registered as ``{attr}_q``, ``owner.{attr}`` from then on ``q.dequantize()``."""
    owner._parameters.pop(attr, None)
    owner.add_module(f"{attr}_q", q)
    owner.__class__ = _holding_class(type(owner), (attr,), q.input is not None and attr == "weight")


def held(model: nn.Module) -> list[QuantizedWeight]:
    """Every weight ``model`` holds quantized."""
    return [m for m in model.modules() if isinstance(m, QuantizedWeight)]


@dataclass(frozen=True)
class Holding:
    """What a serve program holds quantized (its constants ``WEIGHT_FORMAT`` and
    ``QUANTIZED_WEIGHTS``): the format, the weights by :func:`parcompile.core.quant.weight_key`,
    the compute dtype and the device."""

    fmt: QuantFormat
    keys: frozenset[str]
    dtype: torch.dtype
    device: torch.device | str = "cpu"

    def holds(self, name: str) -> bool:
        """Whether the global weight ``name`` is held quantized."""
        return weight_key(name) in self.keys


def owners(model: nn.Module) -> dict[int, tuple[nn.Module, str, Axis | None]]:
    """id(parameter) -> (its module, its attribute, the axis its shards are split over:
    ``tp`` of a tensor-parallel linear layer, ``expert_tp`` of an expert's; None)."""
    from parcompile.runtime.model.moe import GroupedExperts

    out: dict[int, tuple[nn.Module, str, Axis | None]] = {}
    for mod in model.modules():
        axis = mod.tp if isinstance(getattr(mod, "tp", None), Axis) else None
        if isinstance(mod, GroupedExperts):
            for child in mod.children():
                for attr, t in child._parameters.items():
                    if t is not None:
                        out[id(t)] = (child, attr, mod.axes.expert_tp)
        for attr, t in mod._parameters.items():
            if t is not None:
                out.setdefault(id(t), (mod, attr, axis))
    return out


# --------------------------------------------------------------------------- reading shards


def input_scheme(qc: Any) -> str | None:
    """How compressed-tensors' ``quantization_config`` quantizes a layer's input: None,
    ``"token"`` (dynamic per token) or ``"static"`` (one ``input_scale``). Raises
    :class:`QuantError` for another scheme."""
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return None
    (group,) = qc["config_groups"].values()
    a = group.get("input_activations")
    if not a:
        return None
    if not isinstance(a, dict):
        raise QuantError("compressed-tensors input_activations is not a JSON object")
    dynamic, strategy = a.get("dynamic"), a.get("strategy")
    if a.get("type") == "float" and a.get("num_bits") == 8:
        if dynamic is True and strategy == "token":
            return "token"
        if dynamic is False and strategy == "tensor":
            return "static"
    raise QuantError(f"compressed-tensors input_activations {dict(a)} are not served",
                     "served: FP8 activations dynamic per token, or static per tensor")


def zero_offset(qc: Any) -> int:
    """What a GPTQ checkpoint's stored zero points lack: 1 for the hub's ``checkpoint_format``
    ``gptq`` (v1: AutoGPTQ stored ``zero - 1``; gptqmodel's ``convert_gptq_v1_to_v2_format``
    adds it back), 0 for ``gptq_v2`` and every other format. Added per 4-bit value, as
    AutoGPTQ's kernels do (a v1 checkpoint cannot hold a zero point of 0: its -1 overflows the
    word when packed)."""
    if not isinstance(qc, dict) or qc.get("quant_method") != "gptq":
        return 0
    return 0 if qc.get("checkpoint_format", "gptq") == "gptq_v2" else 1


def _rows(src: Source, r0: int, r1: int) -> list[int]:
    """The checkpoint rows (after ``src.lead``; ``out`` indices) of our rows ``[r0, r1)``."""
    return [h + k for _, h, n in src.runs(r0, r1) for k in range(n)]


def _read_rows(sl, lead: tuple[int, ...], rows: list[int], rest: tuple[slice, ...]) -> torch.Tensor:
    """``sl[lead + (rows,) + rest]``: one read of the span of ``rows``, then those rows."""
    lo, hi = min(rows), max(rows) + 1
    t = sl[lead + (slice(lo, hi),) + rest]
    if rows == list(range(lo, hi)):
        return t
    return t.index_select(0, torch.tensor(rows, dtype=torch.long) - lo)


class Reader:
    """What :func:`read` needs of a checkpoint: ``slice_of(name)`` (safetensors' ``get_slice``)
    and ``files`` (tensor name -> its file, for messages)."""

    def __init__(self, slice_of: Callable[[str], Any], files: dict[str, Path]):
        self.slice_of, self.files = slice_of, files

    def checked(self, t: StoredTensor, weight: str):
        """The slice of ``t``, its dtype and shape checked (:class:`QuantError` naming the
        file, the tensor, what it needs and what it holds)."""
        if t.name not in self.files:
            raise QuantError(f"the checkpoint has no `{t.name}` ({t.wanted()}) for `{weight}`",
                             "the checkpoint is incomplete, or of another format than its config.json says")
        sl = self.slice_of(t.name)
        dtype, shape = str(sl.get_dtype()), tuple(sl.get_shape())
        if not t.fits(dtype, shape):
            raise QuantError(f"{self.files[t.name]}: `{t.name}` is {dtype} {shape}; `{weight}` needs {t.wanted()}",
                             "the checkpoint is damaged, or of another model or quantization")
        return sl


def read(reader: Reader, src: Source, p: torch.Tensor, fmt: QuantFormat, rows: tuple[int, int],
         cols: tuple[int, int], dtype: torch.dtype, device, input_mode: str | None = None,
         zero_add: int = 0) -> QuantizedWeight:
    """Our rows ``[rows)`` and columns ``[cols)`` of the parameter ``p`` (global (out, in)),
    stored quantized at ``src`` in format ``fmt``, as a :class:`QuantizedWeight` that
    dequantizes to ``dtype`` (module docstring: the covering blocks of a shard that does not
    align). ``input_mode``: :func:`input_scheme`'s, for compressed-tensors' formats;
    ``zero_add``: :func:`zero_offset`'s, for GPTQ's.

    Raises:
        QuantError: a tensor is missing or of another dtype or shape; a layout this format
            is not read in (an fp8 tensor stored (in, out)).
    """
    tensors = {t.role: t for t in stored_tensors(fmt, src.name, tuple(src.shape), src.transpose)}
    hf_rows = _rows(src, *rows)
    if not hf_rows or cols[1] <= cols[0]:
        raise QuantError(f"`{src.name}`: an empty shard of `{p.global_name}` cannot be read quantized")
    c0, c1 = cols
    if fmt.family == "fp8":
        if src.transpose:
            raise QuantError(f"`{src.name}` is stored as {fmt.description}, which parcompile reads only for "
                             "tensors stored (out, in)")
        data = _read_rows(reader.checked(tensors["weight"], p.global_name), src.lead, hf_rows, (slice(c0, c1),))
        ssl = reader.checked(tensors["scale"], p.global_name)
        if fmt.name.startswith("fp8-block"):
            b0, b1 = fmt.block
            brow = torch.tensor(hf_rows, dtype=torch.long) // b0
            bcol = torch.arange(c0, c1) // b1
            lo, clo = int(brow.min()), int(bcol[0])
            scale = ssl[src.lead + (slice(lo, int(brow.max()) + 1), slice(clo, int(bcol[-1]) + 1))].float()
            q = FP8Weight(p, fmt.name, dtype, data.to(device), scale.to(device), (brow - lo).to(device, torch.int32),
                          (bcol - clo).to(device, torch.int32))
        else:
            if fmt.block == (0, 0):
                scale = ssl[()].reshape(1, 1)   # one element, stored () or (1,)
            else:
                scale = _read_rows(ssl, src.lead, hf_rows, (slice(0, 1),))
            q = FP8Weight(p, fmt.name, dtype, data.to(device), scale.to(device, dtype))
            if input_mode is not None:
                q.input = input_mode
                if input_mode == "static":
                    isl = reader.checked(tensors["input_scale"], p.global_name)
                    q.input_scale = isl[()].reshape(1).to(device, dtype)
        return q
    if fmt.family == "mxfp4":
        g0, g1 = c0 // MX_BLOCK, -(-c1 // MX_BLOCK)
        blocks = _read_rows(reader.checked(tensors["blocks"], p.global_name), src.lead, hf_rows, (slice(g0, g1),))
        scales = _read_rows(reader.checked(tensors["scales"], p.global_name), src.lead, hf_rows, (slice(g0, g1),))
        return MXFP4Weight(p, fmt.name, dtype, blocks.contiguous().to(device), scales.contiguous().to(device),
                           c0 - g0 * MX_BLOCK, c1 - c0)
    if fmt.family == "int4":
        return _read_int4(reader, src, p, fmt, tensors, hf_rows, c0, c1, dtype, device, zero_add)
    raise QuantError(f"`{src.name}` is stored as {fmt.description}, which parcompile does not read",
                     "serve an FP8, MXFP4 or 4-bit AWQ / GPTQ checkpoint, or the 16-bit one")


def _read_int4(reader: Reader, src: Source, p: torch.Tensor, fmt: QuantFormat, tensors: dict[str, StoredTensor],
               hf_rows: list[int], c0: int, c1: int, dtype, device, zero_add: int) -> Int4Weight:
    """:func:`read` of an ``int4-awq`` / ``int4-gptq`` weight: the packed words, zero points and
    scales of the groups and words covering the shard (:class:`Int4Weight`)."""
    r0, r1 = hf_rows[0], hf_rows[-1] + 1
    if src.transpose or src.lead or hf_rows != list(range(r0, r1)):
        raise QuantError(f"`{src.name}` is stored as {fmt.description}, which parcompile reads only for a tensor "
                         "of its own (not a fused or transposed one)")
    w0, w1 = r0 // 8, -(-r1 // 8)   # the words of the out range
    group = 128
    if fmt.name == "int4-gptq" and tensors["g_idx"].name in reader.files:
        g = reader.checked(tensors["g_idx"], p.global_name)[c0:c1].long()
        where, groups = f"{reader.files[tensors['g_idx'].name]}: `{tensors['g_idx'].name}`", tensors["qzeros"].shape[-2]
        if bool((g[1:] < g[:-1]).any()):
            raise QuantError(f"{where} is not ascending: act-order (desc_act) GPTQ is not served")
        if int(g[0]) < 0 or int(g[-1]) >= groups:   # ascending: its ends are its extremes
            raise QuantError(f"{where} holds group {int(g[0]) if int(g[0]) < 0 else int(g[-1])}, outside the "
                             f"{groups} groups of `{tensors['qzeros'].name}`",
                             "the checkpoint is damaged, or of another model or quantization")
    else:
        g = torch.arange(c0, c1) // group
    g0, g1 = int(g.min()), int(g.max()) + 1
    zeros = reader.checked(tensors["qzeros"], p.global_name)[g0:g1, w0:w1]
    scale_sl = reader.checked(tensors["scales"], p.global_name)
    if fmt.name == "int4-awq":
        qweight = reader.checked(tensors["qweight"], p.global_name)[c0:c1, w0:w1]
        scales = scale_sl[g0:g1, 8 * w0:min(8 * w1, tensors["scales"].shape[-1])]
        if scales.shape[1] < 8 * (w1 - w0):   # out not a multiple of 8: the last word's padding
            scales = torch.cat([scales, scales.new_ones(scales.shape[0], 8 * (w1 - w0) - scales.shape[1])], 1)
        return Int4Weight(p, fmt.name, dtype, (r1 - r0, c1 - c0), qweight.to(device), zeros.to(device),
                          scales.to(device), (g - g0).to(device, torch.int32), r0 - 8 * w0)
    i0, i1 = c0 // 8, -(-c1 // 8)
    qweight = reader.checked(tensors["qweight"], p.global_name)[i0:i1, r0:r1]
    scales = scale_sl[g0:g1, r0:r1]
    return Int4Weight(p, fmt.name, dtype, (r1 - r0, c1 - c0), qweight.to(device), zeros.to(device),
                      scales.to(device), (g - g0).to(device, torch.int32), r0 - 8 * w0, c0 - 8 * i0, zero_add)


# --------------------------------------------------------------------------- quantized on load


def shard_ranges(p: torch.Tensor) -> tuple[tuple[int, int], tuple[int, int]]:
    """The global rows and columns ``[start, stop)`` of a 2-D parameter's shard (its layout
    attributes, :func:`parcompile.runtime.model.layers.make_param`)."""
    out = []
    for dim in (0, 1):
        size = p.global_shape[dim]
        if p.shard_dim != dim:
            out.append((0, size))
        else:
            n = size // p.num_shards
            out.append((p.shard_index * n, (p.shard_index + 1) * n))
    return out[0], out[1]


def quantize_on_load(model: nn.Module, holding: Holding) -> int:
    """Quantize, in place, each dense weight of ``model`` that ``holding`` holds, to E4M3 with
    one fp32 scale per block of ``holding.fmt`` over the global tensor (``fp8-block``: its
    blocks; ``fp8-tensor``: the tensor; ``fp8-channel``: a row), so every layout holds the
    same values: a rank takes the amax of the blocks its shard covers, the grid of block
    amaxes is max-all-reduced over the shard's axis (one small all-reduce per weight; every
    rank of a shard group calls this alike), and the rank keeps the scales of its covering
    blocks (module docstring). Returns how many weights it quantized."""
    fmt = holding.fmt
    if fmt.family != "fp8":
        raise QuantError(f"weights of {fmt.description} are not made on load: it needs a checkpoint quantized so",
                         "serve the published quantized checkpoint")
    count = 0
    with torch.no_grad():
        table = owners(model)
        for p in [p for p in model.parameters() if hasattr(p, "global_name") and holding.holds(p.global_name)]:
            owner, attr, axis = table[id(p)]
            (r0, r1), (c0, c1) = shard_ranges(p)
            out, inp = p.global_shape
            b0, b1 = min(fmt.block[0] or out, out), min(fmt.block[1] or inp, inp)   # a block past a side: the side
            brow, bcol = torch.arange(r0, r1) // b0, torch.arange(c0, c1) // b1
            lo, clo = int(brow[0]), int(bcol[0])
            rows, cols = brow - lo, bcol - clo
            w = p.detach().float()
            nr, nc = int(rows[-1]) + 1, int(cols[-1]) + 1   # the blocks the shard covers, whole
            padded = torch.zeros(nr * b0, nc * b1)
            padded[r0 - lo * b0:r1 - lo * b0, c0 - clo * b1:c1 - clo * b1] = w.abs()
            local = padded.view(nr, b0, nc, b1).amax(dim=(1, 3))
            grid = torch.zeros(-(-out // b0), -(-inp // b1))
            grid[lo:lo + local.shape[0], clo:clo + local.shape[1]] = local
            if axis is not None and p.shard_dim is not None:
                all_reduce(grid, axis, "max")
            scale = fp8_scales(grid[lo:lo + local.shape[0], clo:clo + local.shape[1]])
            data = quantize_fp8(w, scale.index_select(0, rows).index_select(1, cols))
            if scale.shape == (1, 1) or (b0 == 1 and b1 == inp):   # a scale per tensor or row: broadcast
                q = FP8Weight(p, fmt.name, holding.dtype, data.to(holding.device), scale.to(holding.device))
            else:
                q = FP8Weight(p, fmt.name, holding.dtype, data.to(holding.device), scale.to(holding.device),
                              rows.to(holding.device, torch.int32), cols.to(holding.device, torch.int32))
            hold(owner, attr, q)   # fp32 scales, as vLLM's
            count += 1
    return count


__all__ = ["AWQ_ORDER", "AWQ_REVERSE_ORDER", "E2M1_VALUES", "FP8Weight", "Int4Weight", "FP8_MAX", "Holding", "MXFP4Weight", "QuantError", "QuantizedWeight", "Reader",
           "dequantize_fp8", "dequantize_mxfp4", "fake_quantize_fp8", "fp8_scales", "held", "hold", "input_scheme",
           "owners", "quantize_fp8", "quantize_on_load", "read", "shard_ranges", "dequantize_int4", "unpack_int4",
           "zero_offset"]
