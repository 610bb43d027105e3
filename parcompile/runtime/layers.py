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

from parcompile.runtime.comm import all_reduce, copy_to_tp, leave_tp, reduce_from_tp
from parcompile.runtime.context import Axis
from parcompile.runtime.wgrad import linear

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
               num_shards: int | None = None) -> nn.Parameter:
    """A parameter holding this rank's shard of the global initial value.

    The shard is part ``axis.index`` of ``axis.size`` along ``dim``, or part
    ``shard_index`` of ``num_shards`` when those are given (a kv head replicated on several
    tp ranks: ``num_shards = kv_heads``, ``shard_index = tp.index // replicas``). The layout
    is recorded on the tensor (``global_name``, ``global_shape``, ``shard_dim``,
    ``shard_index``, ``num_shards``, ``valid_rows``) so that checkpoints, loaders and
    ``verify`` can reassemble or cut the global tensor.
    """
    index = axis.index if shard_index is None else shard_index
    parts = axis.size if num_shards is None else num_shards
    if dim is None or parts == 1:
        local = tuple(shape)
    else:
        if shape[dim] % parts:
            raise ValueError(f"dimension {dim} of {name} ({shape[dim]}) does not divide into {parts} parts")
        local = tuple(n // parts if i == dim else n for i, n in enumerate(shape))
    if _INIT["skip"]:
        p = nn.Parameter(torch.empty(local))
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
    """

    def __init__(self, name: str, in_features: int, out_features: int, bias: bool, tp: Axis,
                 seed: int, std: float = INIT_STD, valid_rows: int | None = None, *,
                 shard_index: int | None = None, num_shards: int | None = None):
        super().__init__()
        # shard_index / num_shards: a part other than tp's own (replicated kv heads, serving)
        kw = dict(shard_index=shard_index, num_shards=num_shards)
        self.weight = make_param(f"{name}.weight", (out_features, in_features), seed, std, tp, 0, valid_rows, **kw)
        self.bias = make_param(f"{name}.bias", (out_features,), seed, 0, tp, 0, **kw) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b with W (out, in) split on ``in`` over tp:
    (B, T, in/tp) -> (B, T, out), replicated; with ``sequence_parallel`` the partial sums
    are reduce-scattered along the sequence instead: -> (B, T/tp, out). The bias is added
    once, after the reduction.
    """

    def __init__(self, name: str, in_features: int, out_features: int, bias: bool, tp: Axis,
                 seed: int, std: float = INIT_STD, sequence_parallel: bool = False):
        super().__init__()
        self.tp = tp
        self.sequence_parallel = sequence_parallel
        self.weight = make_param(f"{name}.weight", (out_features, in_features), seed, std, tp, 1)
        self.bias = make_param(f"{name}.bias", (out_features,), seed, 0, tp, None) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = leave_tp(linear(x, self.weight), self.tp, self.sequence_parallel)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with rows (padded vocabulary V') split over tp:
    ids (B, T) -> (B, T, h). Each rank looks up the ids in its row range; an all-reduce
    sums, or with ``sequence_parallel`` a reduce-scatter along the sequence -> (B, T/tp, h).
    """

    def __init__(self, name: str, padded_vocab: int, vocab: int, hidden: int, tp: Axis, seed: int,
                 sequence_parallel: bool = False):
        super().__init__()
        self.tp = tp
        self.sequence_parallel = sequence_parallel
        self.weight = make_param(f"{name}.weight", (padded_vocab, hidden), seed, INIT_STD, tp, 0, vocab)
        self.start = tp.index * (padded_vocab // tp.size)
        self.rows = padded_vocab // tp.size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tp(out, self.tp, self.sequence_parallel)


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
    return F.cross_entropy(_wide(x), target, ignore_index=IGNORE_INDEX, reduction="none")


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: Axis, vocab: int) -> torch.Tensor:
    """Per-token loss (N,) from local logits (N, V'/tp) and global target ids (N,); a target
    of -100 (:data:`IGNORE_INDEX`) is ignored: loss 0, no gradient."""
    if tp.size == 1:
        return _cross_entropy_one_rank(logits, target, vocab)
    start = tp.index * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, tp, start, vocab)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least fp32 (16-bit tensors are computed in fp32; fp64 stays fp64)."""
    return t if t.dtype == torch.float64 else t.float()


class _RMSNormFunction(torch.autograd.Function):
    """``weight * (x / rms(x))`` normalised in fp32 and cast back, as Llama computes it,
    keeping only the input and the fp32 reciprocal rms per token for backward (what
    fused RMSNorm kernels keep: Apex/Megatron-LM ``FusedRMSNorm``); torch's composite
    version would also keep the fp32 copy and the normalised tensor."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = _wide(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        n = _wide(x) * rstd                                      # normalised input, fp32
        grad_w = (grad_out * n.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gn = _wide(grad_out * weight)
        grad_x = rstd * (gn - n * (gn * n).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) as Llama computes it: in fp32, then scaled.
    (..., dim) -> (..., dim); keeps the input and one fp32 scalar per token for backward."""

    def __init__(self, name: str, dim: int, eps: float, seed: int, tp: Axis):
        super().__init__()
        self.eps = eps
        self.weight = make_param(f"{name}.weight", (dim,), seed, None, tp, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


class QKNorm(nn.Module):
    """RMSNorm over ``head_dim`` of q or k, each head alone, before RoPE (Qwen3, Gemma 3;
    transformers' ``q_norm``/``k_norm``): (B, T, heads/tp, head_dim) -> same.

    One ``(head_dim,)`` weight serves every head, so it is replicated over tp while the
    heads are split: each rank's gradient sums over its own heads only. The weight is
    marked ``tp_partial_grad`` and the optimizer all-reduces it over tp each step
    (:func:`parcompile.runtime.optim.tp_partial_grads`; the plan's ``tp_partial_grads``,
    or ``sp_norm_grads`` with sequence parallelism). Keeps its input and one fp32 scalar
    per token and head for backward."""

    def __init__(self, name: str, head_dim: int, eps: float, seed: int, tp: Axis):
        super().__init__()
        self.eps = eps
        self.weight = make_param(f"{name}.weight", (head_dim,), seed, None, tp, None)
        self.weight.tp_partial_grad = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm (Ba et al. 2016) with weight and bias."""

    def __init__(self, name: str, dim: int, eps: float, seed: int, tp: Axis):
        super().__init__()
        self.eps = eps
        self.weight = make_param(f"{name}.weight", (dim,), seed, None, tp, None)
        self.bias = make_param(f"{name}.bias", (dim,), seed, 0, tp, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def rope_tables(seq_len: int, rot_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (T, rot_dim) for rotary embeddings (Su et al. 2021), Llama/NeoX layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


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


class _SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up``, keeping only ``gate`` and ``up`` for backward and recomputing
    the SiLU there (Megatron-LM's ``bias_swiglu`` fusion); autograd would keep a third
    ffn-wide tensor."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        g = _wide(gate)                                           # 16-bit: computed in fp32
        grad_up = F.silu(g).mul_(grad_out)                        # silu(gate) * dy
        t = _wide(grad_out) * up                                  # dy * up, a new tensor
        # aten's fused SiLU derivative: t * sig * (1 + gate * (1 - sig)), written into t
        grad_gate = torch.ops.aten.silu_backward.grad_input(t, g, grad_input=t)
        return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): ``silu(gate) * up``, (..., f) x (..., f) -> (..., f)."""
    return _SwiGLUFunction.apply(gate, up)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean (Tq, Tk) mask, True where a query at position i may attend a key at j:
    j <= i, and i - j < window when a sliding window is set."""
    i, j = q_pos[:, None], k_pos[None, :]
    keep = j <= i
    if window:
        keep &= (i - j) < window
    return keep


class _Softmax(torch.autograd.Function):
    """Softmax over the last dim computed in fp32, returned and kept for backward in the
    input's dtype (Megatron-LM's fused scale-mask-softmax keeps 16-bit probabilities)."""

    @staticmethod
    def forward(ctx, scores):
        probs = torch.softmax(_wide(scores), dim=-1).to(scores.dtype)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad_out):
        (probs,) = ctx.saved_tensors
        p, g = _wide(probs), _wide(grad_out)
        return (p * (g - (g * p).sum(-1, keepdim=True))).to(probs.dtype)


def attention_core(q, k, v, fused: bool, dropout: float, training: bool, window: int,
                   q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v, causal. q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D) -> (B, Hq, Tq, D).

    GQA: each group of Hq/Hkv query heads shares one kv head; k and v are never expanded
    to Hq heads (the fused kernel's ``enable_gqa``; the unfused path multiplies each kv head
    with its group of query heads at once), so backward keeps them at their own size.
    ``q_pos``/``k_pos`` are the tokens' positions in the sequence when they are not 0..T-1
    (context parallelism). ``fused`` uses torch's ``scaled_dot_product_attention`` (flash
    kernels: it keeps q, k, v, its output and an fp32 log-sum-exp per query and head);
    otherwise the softmax is spelt out and its (B, Hq, Tq, Tk) probabilities are kept, as
    Megatron-LM 2021-22 did.
    """
    hq, hkv = q.shape[1], k.shape[1]
    rep = hq // hkv
    p = dropout if training else 0.0
    plain = q_pos is None and (not window or window >= q.shape[2])
    if q_pos is None:
        q_pos = torch.arange(q.shape[2], device=q.device)
        k_pos = torch.arange(k.shape[2], device=q.device)
    gqa = {"enable_gqa": True} if rep > 1 else {}
    if fused:
        if plain:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, **gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q_pos, k_pos, window),
                                              dropout_p=p, **gqa)
    B, _, Tq, D = q.shape
    Tk = k.shape[2]
    qg = q.reshape(B, hkv, rep * Tq, D)                          # query heads grouped by kv head
    scores = (qg @ k.transpose(-2, -1)).view(B, hkv, rep, Tq, Tk) / math.sqrt(D)
    bias = torch.zeros((Tq, Tk), dtype=scores.dtype, device=q.device)
    bias = bias.masked_fill(~causal_mask(q_pos, k_pos, window), float("-inf"))
    probs = F.dropout(_Softmax.apply(scores + bias), p, training)          # (B, Hkv, rep, Tq, Tk)
    return (probs.view(B, hkv, rep * Tq, Tk) @ v).view(B, hq, Tq, D)


def recompute(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` keeping only its inputs; the backward runs it again
    (torch.utils.checkpoint, non-reentrant; RNG state is replayed, so dropout masks match).
    Collectives inside ``fn`` run again in the backward, as the plan counts them."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    from parcompile.runtime.memory import METER

    if METER.active:   # the checkpoint keeps its inputs by reference, outside saved-tensor hooks
        METER.hold(*args, *kwargs.values())
    # no early stop: the whole forward runs again, collectives included (Megatron-LM's
    # recomputation; torch would otherwise stop once the saved tensors are rebuilt)
    with set_checkpoint_early_stop(False):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)


ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "RMSNorm", "QKNorm", "LayerNorm",
    "vocab_parallel_cross_entropy", "rope_tables", "apply_rope", "attention_core", "swiglu", "copy_to_tp",
    "reduce_from_tp", "global_init", "make_param", "shard", "shard_part", "no_init", "ACTIVATIONS",
]
