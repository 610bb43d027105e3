"""Tensor-parallel building blocks of generated programs (Megatron-LM's `tensor_parallel`
layers: column/row-parallel linear, vocab-parallel embedding and cross-entropy).

Initialisation does not depend on the plan: every parameter is drawn as its *global*
tensor from a generator seeded by ``(seed, parameter name)`` and then sliced to this
rank's shard, so any two layouts of one spec start from the same global weights.
Padded vocabulary rows (SPEC: Megatron's padding rule) start at zero and stay out of the
loss, so they stay zero.
"""

from __future__ import annotations

import contextlib
import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from parcompile.core.model import yarn_mscale
from parcompile.runtime.distributed.comm import all_reduce, copy_to_tp, leave_tp, reduce_from_tp
from parcompile.runtime.distributed.context import Axis
from parcompile.runtime.model.fp8 import fp8_linear
from parcompile.runtime.train.wgrad import linear

INIT_STD = 0.02  # GPT-2 / Megatron-LM `init_method_std`


def global_init(name: str, shape: tuple[int, ...], seed: int, std: float | None,
                valid_rows: int | None = None) -> torch.Tensor:
    """The global fp32 initial value of parameter ``name`` (shape ``shape``).

    ``std=None`` means ones (norm weights); ``std=0`` zeros (biases); otherwise
    N(0, std^2) from a CPU generator seeded by ``seed`` and the CRC32 of ``name``.
    Rows at and past ``valid_rows`` (vocabulary padding) are zero.
    """
    if std is None:
        return torch.ones(shape)
    if std == 0:
        return torch.zeros(shape)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1))
    t = torch.empty(shape).normal_(0.0, std, generator=g)
    if valid_rows is not None:
        t[valid_rows:] = 0
    return t


_INIT = {"skip": False}


@contextlib.contextmanager
def no_init():
    """Inside this block :func:`make_param` allocates each shard uninitialised (no global
    tensor is drawn): for weights that are about to be loaded from a checkpoint."""
    old = _INIT["skip"]
    _INIT["skip"] = True
    try:
        yield
    finally:
        _INIT["skip"] = old


def shard_part(full: torch.Tensor, dim: int | None, index: int, parts: int) -> torch.Tensor:
    """Part ``index`` of ``parts`` equal contiguous slices of ``full`` along ``dim``.

    Raises:
        ValueError: the dimension does not divide by ``parts``.
    """
    if dim is None or parts == 1:
        return full.clone()
    n = full.shape[dim]
    if n % parts:
        raise ValueError(f"dimension {dim} of size {n} does not divide into {parts} parts")
    step = n // parts
    return full.narrow(dim, index * step, step).clone()


def shard(full: torch.Tensor, dim: int | None, axis: Axis) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim`` over ``axis``: :func:`shard_part` at the
    axis's index and size (None: replicated).

    Raises:
        ValueError: the dimension does not divide by the axis size.
    """
    return shard_part(full, dim, axis.index, axis.size)


def make_param(name: str, shape: tuple[int, ...], seed: int, std: float | None, axis: Axis,
               dim: int | None, valid_rows: int | None = None, *, shard_index: int | None = None,
               num_shards: int | None = None, local: tuple[int, ...] | None = None) -> nn.Parameter:
    """A parameter holding this rank's shard of the global initial value.

    The shard is part ``axis.index`` of ``axis.size`` along ``dim``, or part
    ``shard_index`` of ``num_shards`` when those are given (a kv head replicated on several
    tp ranks: ``num_shards = kv_heads``, ``shard_index = tp.index // replicas``). The layout
    is recorded on the tensor (``global_name``, ``global_shape``, ``shard_dim``,
    ``shard_index``, ``num_shards``, ``valid_rows``) so that checkpoints, loaders and
    ``verify`` can reassemble or cut the global tensor.

    ``local``: the per-rank shape the generated program read off the sharded graph; the
    shard must have it (the program states local sizes, the runtime only checks them).

    Raises:
        ValueError: the dimension does not divide, or the shard's shape is not ``local``.
    """
    index = axis.index if shard_index is None else shard_index
    parts = axis.size if num_shards is None else num_shards
    if dim is None or parts == 1:
        local_shape = tuple(shape)
    else:
        if shape[dim] % parts:
            raise ValueError(f"dimension {dim} of {name} ({shape[dim]}) does not divide into {parts} parts")
        local_shape = tuple(n // parts if i == dim else n for i, n in enumerate(shape))
    if local is not None and tuple(local) != local_shape:
        raise ValueError(f"{name}: the program expects a shard of shape {tuple(local)}, the layout gives "
                         f"{local_shape} (part {index} of {parts} along dim {dim} of {tuple(shape)})")
    if _INIT["skip"]:
        p = nn.Parameter(torch.empty(local_shape))
    else:
        p = nn.Parameter(shard_part(global_init(name, shape, seed, std, valid_rows), dim, index, parts))
    p.global_name = name
    p.shard_dim = dim if parts > 1 else None
    p.shard_index = index if parts > 1 else 0
    p.num_shards = parts
    p.global_shape = tuple(shape)
    p.valid_rows = valid_rows
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W (out, in) split on ``out`` over tp: (..., in) -> (..., out/tp).

    The input must already be in the tensor-parallel region (see :func:`copy_to_tp`).
    ``local``: the weight's per-rank shape ``(out/tp, in)`` as the program read it off the
    sharded graph (checked against the shard, :func:`make_param`). ``fp8``: the FP8 recipe
    its GEMMs run with (:func:`parcompile.runtime.model.fp8.fp8_linear`; None: 16-bit GEMMs).
    """

    def __init__(self, name: str, in_features: int, out_features: int, bias: bool, tp: Axis,
                 seed: int, std: float = INIT_STD, valid_rows: int | None = None, *,
                 shard_index: int | None = None, num_shards: int | None = None,
                 local: tuple[int, int] | None = None, fp8: str | None = None):
        super().__init__()
        self.tp, self.fp8 = tp, fp8
        # shard_index / num_shards: a part other than tp's own (replicated kv heads, serving)
        kw = dict(shard_index=shard_index, num_shards=num_shards)
        self.weight = make_param(f"{name}.weight", (out_features, in_features), seed, std, tp, 0, valid_rows,
                                 local=local, **kw)
        self.bias = make_param(f"{name}.bias", (out_features,), seed, 0, tp, 0, **kw) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            return fp8_linear(x, self.weight, self.bias, self.fp8, self.tp, "column")
        lora = getattr(self, "lora", None)   # a LoRA adapter (runtime/model/lora.py add_lora)
        y = linear(x, self.weight, self.bias)
        return y if lora is None else y + lora(x)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b with W (out, in) split on ``in`` over tp:
    (B, T, in/tp) -> (B, T, out), replicated; with ``sequence_parallel`` the partial sums
    are reduce-scattered along the sequence instead: -> (B, T/tp, out). The bias is added
    once, after the reduction.

    ``reduce`` (what a generated program passes: the collective of the conversion the
    sharded graph puts after the layer) says it instead of ``sequence_parallel``:
    ``"all_reduce"``, ``"reduce_scatter"`` (along the sequence) or None (none: tp = 1, or
    a partial sum the graph reduces later, after other partial sums are added to it, as a
    served MoE layer's shared experts; the bias is then added by tp rank 0 only, so the
    sum holds it once).
    ``local``: the weight's per-rank shape ``(out, in/tp)``, checked against the shard.
    ``fp8``: :class:`ColumnParallelLinear`'s.
    """

    REDUCTIONS = (None, "all_reduce", "reduce_scatter")

    def __init__(self, name: str, in_features: int, out_features: int, bias: bool, tp: Axis,
                 seed: int, std: float = INIT_STD, sequence_parallel: bool = False, *,
                 reduce: str | None | bool = False, local: tuple[int, int] | None = None,
                 fp8: str | None = None):
        super().__init__()
        self.fp8 = fp8
        if reduce is not False and reduce not in self.REDUCTIONS:
            raise ValueError(f"{name}: reduce must be one of {self.REDUCTIONS}, not {reduce!r}")
        if reduce is not False and reduce is not None and tp.size == 1:
            raise ValueError(f"{name}: reduce={reduce!r} over a tp axis of one rank")
        self.tp = tp
        self.sequence_parallel = sequence_parallel if reduce is False else reduce == "reduce_scatter"
        self.partial = reduce is None   # the output stays a partial sum over tp
        self.weight = make_param(f"{name}.weight", (out_features, in_features), seed, std, tp, 1, local=local)
        self.bias = make_param(f"{name}.bias", (out_features,), seed, 0, tp, None) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x, self.weight, None, self.fp8, self.tp, "row") if self.fp8 else linear(x, self.weight)
        if not self.partial:
            y = leave_tp(y, self.tp, self.sequence_parallel)
        elif self.tp.index != 0:   # a partial sum: the bias once, on rank 0
            return y
        lora = getattr(self, "lora", None)   # a LoRA adapter, added after the reduction (runtime/model/lora.py)
        y = y if lora is None else y + lora(x)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with rows (padded vocabulary V') split over tp:
    ids (B, T) -> (B, T, h). Each rank looks up the ids in its row range; an all-reduce
    sums, or with ``sequence_parallel`` a reduce-scatter along the sequence -> (B, T/tp, h).
    """

    def __init__(self, name: str, padded_vocab: int, vocab: int, hidden: int, tp: Axis, seed: int,
                 sequence_parallel: bool = False, scale: float | None = None, *,
                 local: tuple[int, int] | None = None):
        super().__init__()
        self.tp = tp
        self.scale = scale   # Gemma: the output times sqrt(hidden), the factor rounded to the weight's dtype
        self.sequence_parallel = sequence_parallel
        # local: the program's (V'/tp, h), read off the sharded graph (checked against the shard)
        self.weight = make_param(f"{name}.weight", (padded_vocab, hidden), seed, INIT_STD, tp, 0, vocab, local=local)
        self.rows = self.weight.shape[0]                  # this rank's rows of the padded vocabulary
        self.start = tp.index * self.rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._scaled(F.embedding(ids, self.weight))
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self._scaled(leave_tp(out, self.tp, self.sequence_parallel))

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return out
        return out * torch.tensor(self.scale, dtype=self.weight.dtype, device=out.device)


IGNORE_INDEX = -100  # targets equal to it (prompt tokens, padding) add no loss and no gradient


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split on the vocabulary (Megatron-LM's
    `vocab_parallel_cross_entropy`): three fp32 all-reduces of (N,) over tp.
    Columns at and past ``vocab`` (padding) are masked to -inf. Targets equal to
    :data:`IGNORE_INDEX` get a loss of 0 and no gradient. Keeps the fp32 softmax (N, V'/tp)
    for backward (overwritten in place there: the backward runs once).
    """

    @staticmethod
    def forward(ctx, logits, target, tp: Axis, start: int, vocab: int):
        cols = logits.shape[-1]
        x = logits.float()
        if start + cols > vocab:                                  # padded columns on this rank
            col_ids = torch.arange(start, start + cols, device=logits.device)
            x = x.masked_fill(col_ids >= vocab, float("-inf"))
        peak = x.max(dim=-1).values
        all_reduce(peak, tp, "max")
        # in place on a copy of ours; fp32 logits unpadded are the input itself: a new tensor
        x = x - peak.unsqueeze(-1) if x is logits else x.sub_(peak.unsqueeze(-1))
        ignored = target == IGNORE_INDEX
        local_t = target - start
        inside = (local_t >= 0) & (local_t < cols)
        local_t = local_t.masked_fill(~inside, 0)
        picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill_(~inside, 0.0)
        all_reduce(picked, tp, "sum")
        exp = x.exp_()
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, tp, "sum")
        loss = (torch.log(sum_exp) - picked).masked_fill_(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, inside, ignored)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, inside, ignored = ctx.saved_tensors
        g = grad_loss.to(softmax.dtype).masked_fill(ignored, 0.0).unsqueeze(-1)   # (N, 1)
        grad = softmax.mul_(g)                                    # d loss / d logits = (softmax - onehot) * g
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(g * inside.unsqueeze(-1)))
        return grad.to(ctx.in_dtype), None, None, None, None


def _cross_entropy_one_rank(logits: torch.Tensor, target: torch.Tensor, vocab: int) -> torch.Tensor:
    """tp = 1: ``F.cross_entropy`` per token (log-softmax in fp32 over the first ``vocab``
    columns, so padded columns take no probability and get no gradient; targets equal to
    :data:`IGNORE_INDEX` give 0 and no gradient). Keeps the fp32 log-softmax (N, vocab)."""
    x = logits if logits.shape[-1] == vocab else logits[..., :vocab]
    return F.cross_entropy(wide(x), target, ignore_index=IGNORE_INDEX, reduction="none")


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: Axis, vocab: int) -> torch.Tensor:
    """Per-token loss (N,) from local logits (N, V'/tp) and global target ids (N,); a target
    of -100 (:data:`IGNORE_INDEX`) is ignored: loss 0, no gradient."""
    if tp.size == 1:
        return _cross_entropy_one_rank(logits, target, vocab)
    start = tp.index * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, tp, start, vocab)


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least fp32 (16-bit tensors are computed in fp32; fp64 stays fp64)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()   # fp32: itself, without a dispatch


def _rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """The reciprocal rms of each row of the wide input ``xf`` (..., dim) -> (..., 1):
    ``rsqrt(mean(xf^2) + eps)`` (Llama's, transformers' ``LlamaRMSNorm``)."""
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _rms_scaled(x: torch.Tensor, n: torch.Tensor, weight: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    """RMSNorm's output from the wide normalised input ``n = xf * rstd`` (..., dim): cast to
    ``x``'s dtype, then times ``weight``; ``zero_centered`` (Gemma): ``n * (1 + w)`` all in
    fp32, then cast."""
    if zero_centered:
        return (n * (1.0 + wide(weight))).to(x.dtype)
    return weight * n.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """RMSNorm of x (..., dim) by ``weight`` (dim,) -> (..., dim) (:class:`RMSNorm`'s rule).
    With gradients enabled it is :class:`_RMSNormFunction` (its lean backward); without
    (serving, evaluation) the same formula without the autograd node: on CPU as aten's
    ``rms_norm``, whose CPU kernel is the composite of the same ops in the same order
    (pow, mean, add eps, rsqrt, mul; tests/test_activations.py pins it bitwise to the
    autograd path), elsewhere spelt out as :func:`_rstd` and :func:`_rms_scaled` (a fused
    GPU kernel may round differently)."""
    if torch.is_grad_enabled():
        return _RMSNormFunction.apply(x, weight, eps, zero_centered)
    xf = wide(x)
    if xf.device.type != "cpu":
        return _rms_scaled(x, xf * _rstd(xf, eps), weight, zero_centered)
    if not zero_centered and x.dtype == xf.dtype == weight.dtype:   # one kernel: (xf * rstd) * w == w * (xf * rstd)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _rms_scaled(x, F.rms_norm(xf, (x.shape[-1],), None, eps), weight, zero_centered)


class _RMSNormFunction(torch.autograd.Function):
    """``weight * (x / rms(x))`` normalised in fp32 and cast back, as Llama computes it,
    keeping only the input and the fp32 reciprocal rms per token for backward (what
    fused RMSNorm kernels keep: Apex/Megatron-LM ``FusedRMSNorm``); torch's composite
    version would also keep the fp32 copy and the normalised tensor."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, zero_centered: bool = False):
        xf = wide(x)
        rstd = _rstd(xf, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered = zero_centered
        return _rms_scaled(x, xf * rstd, weight, zero_centered)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        n = wide(x) * rstd                                      # normalised input, fp32
        grad_w = (grad_out * n.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gn = wide(grad_out) * (1.0 + wide(weight)) if ctx.zero_centered else wide(grad_out * weight)
        grad_x = rstd * (gn - n * (gn * n).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None, None


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) as Llama computes it: in fp32, then scaled.
    (..., dim) -> (..., dim); keeps the input and one fp32 scalar per token for backward.
    ``zero_centered``: scaled by ``1 + weight``, the weight starting at 0, all in fp32
    (Gemma's RMSNorm; Megatron-Core's ``layernorm_zero_centered_gamma``)."""

    def __init__(self, name: str, dim: int, eps: float, seed: int, tp: Axis, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = make_param(f"{name}.weight", (dim,), seed, 0 if zero_centered else None, tp, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered)


class QKNorm(nn.Module):
    """RMSNorm over ``head_dim`` of q or k, each head alone, before RoPE (Qwen3, Gemma 3;
    transformers' ``q_norm``/``k_norm``): (B, T, heads/tp, head_dim) -> same.

    One ``(head_dim,)`` weight serves every head, so it is replicated over tp while the
    heads are split: each rank's gradient sums over its own heads only. The weight is
    marked ``tp_partial_grad`` and the optimizer all-reduces it over tp each step
    (:func:`parcompile.runtime.train.optim.tp_partial_grads`; the plan's ``tp_partial_grads``,
    or ``sp_norm_grads`` with sequence parallelism). Keeps its input and one fp32 scalar
    per token and head for backward."""

    def __init__(self, name: str, head_dim: int, eps: float, seed: int, tp: Axis, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = make_param(f"{name}.weight", (head_dim,), seed, 0 if zero_centered else None, tp, None)
        self.weight.tp_partial_grad = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered)


class LayerNorm(nn.Module):
    """LayerNorm (Ba et al. 2016) with weight and bias."""

    def __init__(self, name: str, dim: int, eps: float, seed: int, tp: Axis):
        super().__init__()
        self.eps = eps
        self.weight = make_param(f"{name}.weight", (dim,), seed, None, tp, None)
        self.bias = make_param(f"{name}.bias", (dim,), seed, 0, tp, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def rope_inv_freq(rot_dim: int, theta: float, scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies (rot_dim / 2,) fp32 and the factor cos and sin are scaled
    by, for ``scaling`` None (Su et al. 2021) or a dict of the model's rope keys:
    ``rope_type`` ``linear`` (positions / factor), ``yarn`` (Peng et al. 2023, "YaRN":
    interpolated and extrapolated frequencies blended over a ramp between the dims of
    ``beta_fast`` and ``beta_slow`` rotations at ``original_max_position_embeddings``; cos/sin times
    ``0.1 ln(factor) + 1``) or ``llama3`` (Llama 3.1: low frequencies / factor, a smooth
    ramp between ``low_freq_factor`` and ``high_freq_factor``). The formulas and their fp32
    arithmetic are transformers' ``modeling_rope_utils`` (``_compute_*_parameters``)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    old = scaling["original_max_position_embeddings"]
    if kind == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind != "yarn":
        raise ValueError(f"unknown rope_type {kind!r}")

    def correction_dim(rotations: float) -> float:
        return (rot_dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rot_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(rot_dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    pos_freqs = theta ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    attention_factor = scaling.get("attention_factor")
    if not attention_factor and scaling.get("mscale") and scaling.get("mscale_all_dim"):   # DeepSeek-V3
        attention_factor = yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])
    attention_factor = attention_factor or yarn_mscale(factor)
    return inv, float(attention_factor)


def rope_tables(seq_len: int, rot_dim: int, theta: float, device=None,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (T, rot_dim) for rotary embeddings (Su et al. 2021), Llama/NeoX
    layout, with the model's RoPE scaling (:func:`rope_inv_freq`; None: none)."""
    inv_freq, attention_factor = rope_inv_freq(rot_dim, theta, scaling)
    freqs = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * attention_factor).to(device), (emb.sin() * attention_factor).to(device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on the first ``rot`` dims of each head (the rest
    pass through), as one multiply and two fused multiply-adds on the halves."""
    rot = cos.shape[-1]
    half = rot // 2
    c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    if rot == x.shape[-1]:
        out = x * c
        xr = x
    else:                                   # partial rotary: the dims past rot are copied
        out = x.clone()
        out[..., :rot].mul_(c)
        xr = x[..., :rot]
    o = out[..., :rot]
    o[..., :half].addcmul_(xr[..., half:], s[..., :half], value=-1.0)    # x1 c - x2 s
    o[..., half:].addcmul_(xr[..., :half], s[..., half:])                # x2 c + x1 s
    return out


class _RopeFunction(torch.autograd.Function):
    """A rotation whose backward is the rotation by minus the angle: nothing is kept for
    backward but the (shared) cos/sin tables, as Megatron-LM's fused RoPE kernel does."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.tables = (cos, sin)      # module buffers shared by every layer, not activations
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin = ctx.tables
        return _rotate(grad_out, cos, -sin), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rot_dim`` dims of each head of x (B, T, H, D) ("rotate half");
    cos/sin are (T, rot_dim) (:func:`rope_tables`)."""
    return _RopeFunction.apply(x, cos, sin)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's forward, ``silu(gate) * up`` (:func:`swiglu`)."""
    return F.silu(gate).mul_(up)


def _gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GeGLU's forward, ``gelu_tanh(gate) * up`` (:func:`geglu`)."""
    return F.gelu(gate, approximate="tanh").mul_(up)


class _SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up``, keeping only ``gate`` and ``up`` for backward and recomputing
    the SiLU there (Megatron-LM's ``bias_swiglu`` fusion); autograd would keep a third
    ffn-wide tensor."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        g = wide(gate)                                           # 16-bit: computed in fp32
        grad_up = F.silu(g).mul_(grad_out)                        # silu(gate) * dy
        t = wide(grad_out) * up                                  # dy * up, a new tensor
        # aten's fused SiLU derivative: t * sig * (1 + gate * (1 - sig)), written into t
        grad_gate = torch.ops.aten.silu_backward.grad_input(t, g, grad_input=t)
        return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): ``silu(gate) * up``, (..., f) x (..., f) -> (..., f); without
    gradients (serving) the forward's formula without the autograd node."""
    if not torch.is_grad_enabled():
        return _silu_mul(gate, up)
    return _SwiGLUFunction.apply(gate, up)


class _GeGLUFunction(torch.autograd.Function):
    """``gelu_tanh(gate) * up``, keeping only ``gate`` and ``up`` (as :class:`_SwiGLUFunction`)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _gelu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        g = wide(gate)
        grad_up = F.gelu(g, approximate="tanh").mul_(grad_out)
        t = wide(grad_out) * up
        grad_gate = torch.ops.aten.gelu_backward(t, g, approximate="tanh")
        return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Shazeer 2020) with the tanh GELU, as Gemma: ``gelu_tanh(gate) * up``,
    (..., f) x (..., f) -> (..., f)."""
    if not torch.is_grad_enabled():   # the forward's formula without the autograd node
        return _gelu_mul(gate, up)
    return _GeGLUFunction.apply(gate, up)


class _ClampedSwiGLUFunction(torch.autograd.Function):
    """gpt-oss's SwiGLU: ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
    ``(u + 1) * g * sigmoid(alpha * g)`` (transformers' ``GptOssExperts._apply_gate``),
    keeping only ``gate`` and ``up``; the backward runs the forward again under autograd."""

    @staticmethod
    def _f(gate, up, alpha: float, limit: float):
        g = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * alpha))

    @staticmethod
    def forward(ctx, gate, up, alpha: float, limit: float):
        ctx.save_for_backward(gate, up)
        ctx.alpha, ctx.limit = alpha, limit
        return _ClampedSwiGLUFunction._f(gate, up, alpha, limit)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        with torch.enable_grad():
            g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
            out = _ClampedSwiGLUFunction._f(g, u, ctx.alpha, ctx.limit)
            dg, du = torch.autograd.grad(out, (g, u), grad_out)
        return dg, du, None, None


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU (:class:`_ClampedSwiGLUFunction`): (..., f) x (..., f) -> (..., f)."""
    if not torch.is_grad_enabled():   # the forward's formula without the autograd node
        return _ClampedSwiGLUFunction._f(gate, up, alpha, limit)
    return _ClampedSwiGLUFunction.apply(gate, up, alpha, limit)


#: the gated MLP activations by model key (``activation``)
GATED = {"swiglu": swiglu, "geglu": geglu}


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., r) interleaved pairs -> (..., r) halves: [x0, x2, ..., x1, x3, ...]."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def rope_tail(x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
              interleave: bool = False) -> torch.Tensor:
    """RoPE on the dims of each head from ``start`` on, the first ``start`` left as they
    are (MLA's query: [nope, rope] per head): x (B, T, H, start + r) -> same.
    ``interleave``: the rotary dims arrive as interleaved pairs (DeepSeek's; Llama 4's, start 0)."""
    tail = x[..., start:]
    return torch.cat([x[..., :start], apply_rope(deinterleave(tail) if interleave else tail, cos, sin)], dim=-1)


def rope_key(x: torch.Tensor, rope_dim: int, cos: torch.Tensor, sin: torch.Tensor,
             interleave: bool = False) -> torch.Tensor:
    """MLA's shared RoPE key: the last ``rope_dim`` features of ``x`` (B, T, c + r) as one
    head, rotated: -> (B, T, 1, r)."""
    tail = x[..., x.shape[-1] - rope_dim:]
    return apply_rope((deinterleave(tail) if interleave else tail).unsqueeze(-2), cos, sin)


def mla_key(kv: torch.Tensor, k_rope: torch.Tensor, nope: int) -> torch.Tensor:
    """MLA's keys: each head's first ``nope`` features of ``kv`` (B, T, H, n + v) and the
    shared RoPE key (B, T, 1, r) -> (B, T, H, n + r)."""
    return torch.cat([kv[..., :nope], k_rope.expand(*kv.shape[:-1], k_rope.shape[-1])], dim=-1)


def whole_grad(module: nn.Module) -> nn.Module:
    """Mark ``module``'s parameters ``tp_whole_grad``: replicated and run on the whole
    (gathered) sequence, their gradient is whole on every tp rank, so sequence parallelism's
    step all-reduce of replicated gradients leaves them out (MLA's down projections and
    latent norms: the op table's ``replicated`` style). Returns ``module``."""
    for p in module.parameters():
        p.tp_whole_grad = True
    return module


def recompute(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` keeping only its inputs; the backward runs it again
    (torch.utils.checkpoint, non-reentrant; RNG state is replayed, so dropout masks match).
    Collectives inside ``fn`` run again in the backward, as the plan counts them."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    from parcompile.runtime.machine.memory import METER

    if METER.active:   # the checkpoint keeps its inputs by reference, outside saved-tensor hooks
        METER.hold(*args, *kwargs.values())
    # no early stop: the whole forward runs again, collectives included (Megatron-LM's
    # recomputation; torch would otherwise stop once the saved tensors are rebuilt)
    with set_checkpoint_early_stop(False):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)


def checkpointed(module: nn.Module) -> nn.Module:
    """``module`` with its forward run under :func:`recompute` (it keeps its inputs only;
    the backward runs it again): Megatron-Core's ``mlp``, ``moe`` and ``shared_experts``
    recompute modules (``parallel.recompute = [moe]``, NVIDIA/Megatron-LM d98e8a6
    ``transformer_layer.py`` ``recompute_mlp``, ``moe/moe_layer.py`` ``moe_layer_recompute``,
    ``moe/shared_experts.py``). The module itself is unchanged (its parameters' names too).
    Returns ``module``."""
    forward = module.forward
    module.forward = lambda *args, **kwargs: recompute(forward, *args, **kwargs)
    return module


ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "RMSNorm", "QKNorm", "LayerNorm",
    "vocab_parallel_cross_entropy", "rope_tables", "rope_inv_freq", "apply_rope", "deinterleave", "rope_tail", "rope_key", "mla_key", "whole_grad", "swiglu", "geglu", "clamped_swiglu", "GATED", "copy_to_tp",
    "reduce_from_tp", "global_init", "make_param", "shard", "shard_part", "no_init", "recompute", "checkpointed",
    "ACTIVATIONS",
]
