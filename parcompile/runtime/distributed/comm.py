"""Collectives that count themselves, and their differentiable forms (Megatron-LM's
`mappings.py` shapes: copy-to / reduce-from the tensor-parallel region).

Every collective a generated program runs goes through this module, which records
``(op, axis, bytes)`` per call in :data:`COUNTER`. ``bytes`` is the size of the tensor the
collective produces (the plan's convention, SPEC section 3). ``verify`` compares the counts
of one training step with the plan's ``comm.collectives``.

A collective over an axis of size one is skipped and not counted.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist

from parcompile.runtime.distributed.context import Axis
from parcompile.runtime.machine.memory import METER


class CommCounter:
    """Counts collectives by ``(op, axis, bytes)``; ``snapshot()`` returns a sorted list.

    MoE token traffic, whose size the router decides, is recorded with ``rows`` (the
    (token, expert) rows the collective produced); its snapshot entries carry ``rows`` and
    stay apart from same-sized fixed collectives, so ``verify`` can recompute the plan's
    size for the rows the router actually sent.
    """

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.enabled = True

    def record(self, op: str, axis: str, nbytes: int, rows: int | None = None) -> None:
        if self.enabled:
            self.counts[(op, axis, int(nbytes), -1 if rows is None else int(rows))] += 1

    def reset(self) -> None:
        self.counts.clear()

    def snapshot(self) -> list[dict]:
        out = []
        for (op, axis, b, rows), c in sorted(self.counts.items()):
            e = {"op": op, "axis": axis, "bytes": b, "count": c}
            if rows >= 0:
                e["rows"] = rows
            out.append(e)
        return out


COUNTER = CommCounter()

# torch >= 2.10 names the single-tensor collectives `*_single` and deprecates the old names
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (what the counter records for a collective of ``t``)."""
    return t.numel() * t.element_size()


def all_reduce(t: torch.Tensor, axis: Axis, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of ``t`` over ``axis`` (``op``: sum or max); returns ``t``."""
    if axis.size == 1 or axis.group is None:
        return t
    COUNTER.record("all_reduce", axis.name, nbytes(t))
    rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    dist.all_reduce(t, op=rop, group=axis.group)
    return t


def all_reduce_async(t: torch.Tensor, axis: Axis):
    """Start an in-place sum of ``t`` over ``axis`` (counted now); returns the work to
    ``wait()`` on, or None when there is nothing to do (an axis of one rank)."""
    if axis.size == 1 or axis.group is None:
        return None
    COUNTER.record("all_reduce", axis.name, nbytes(t))
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=axis.group, async_op=True)


def reduce_scatter_async(out: torch.Tensor, t: torch.Tensor, axis: Axis):
    """Start a reduce-scatter of ``t`` (``axis.size`` equal slices, summed) into ``out``,
    this rank's slice (counted now, by the size of ``out``); returns the work, or None on
    an axis of one rank (``out`` is then ``t`` copied)."""
    if axis.size == 1 or axis.group is None:
        out.copy_(t)
        return None
    COUNTER.record("reduce_scatter", axis.name, nbytes(out))
    return reduce_scatter_single(out, t, group=axis.group, async_op=True)


def all_gather_dim(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order): size n along ``dim`` -> n * size."""
    xt = x.movedim(dim, 0).contiguous()
    out = torch.empty((xt.shape[0] * axis.size,) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
    COUNTER.record("all_gather", axis.name, nbytes(out))
    all_gather_single(out, xt, group=axis.group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter_dim(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's 1/n slice of ``dim``."""
    xt = x.movedim(dim, 0).contiguous()
    out = torch.empty((xt.shape[0] // axis.size,) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
    COUNTER.record("reduce_scatter", axis.name, nbytes(out))
    reduce_scatter_single(out, xt, group=axis.group)
    return out.movedim(0, dim).contiguous()


def isend(t: torch.Tensor, axis: Axis, peer_index: int, tag: int):
    """Asynchronous send of ``t`` to the rank at ``peer_index`` of ``axis``; returns the work."""
    COUNTER.record("send", axis.name, nbytes(t))
    return dist.isend(t.contiguous(), dst=axis.ranks[peer_index], tag=tag)


def recv(shape: tuple[int, ...], dtype: torch.dtype, device, axis: Axis, peer_index: int, tag: int) -> torch.Tensor:
    """Blocking receive of a tensor of ``shape`` from the rank at ``peer_index`` of ``axis``."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    COUNTER.record("recv", axis.name, nbytes(buf))
    dist.irecv(buf, src=axis.ranks[peer_index], tag=tag).wait()
    return buf


class _CopyToRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce the gradient over the axis."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous().clone(), ctx.axis), None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: all-reduce over the axis. Backward: identity."""

    @staticmethod
    def forward(ctx, x, axis):
        return all_reduce(x.contiguous().clone(), axis)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherDim(torch.autograd.Function):
    """Forward: all-gather along ``dim``. Backward: reduce-scatter the gradient along it."""

    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return all_gather_dim(x, axis, dim)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_dim(g, ctx.axis, ctx.dim), None, None


class _ReduceScatterDim(torch.autograd.Function):
    """Forward: reduce-scatter a partial sum along ``dim``. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return reduce_scatter_dim(x, axis, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim(g, ctx.axis, ctx.dim), None, None


def gather_along(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """Differentiable all-gather of ``x`` along ``dim`` over ``axis`` (backward:
    reduce-scatter); identity on an axis of one rank."""
    return x if axis.size == 1 else _GatherDim.apply(x, axis, dim)


def enter_tp(x: torch.Tensor, axis: Axis, sequence_parallel: bool) -> torch.Tensor:
    """Enter a tensor-parallel region before column-parallel layers.

    Without sequence parallelism ``x`` (B, T, h) is replicated and only its gradient is
    all-reduced; with it, ``x`` (B, T/tp, h) is all-gathered along the sequence and its
    gradient reduce-scattered (Korthikanti et al. 2022, the `g` operator).
    """
    if axis.size == 1:
        return x
    return _GatherDim.apply(x, axis, 1) if sequence_parallel else _CopyToRegion.apply(x, axis)


class _GatherSplitBack(torch.autograd.Function):
    """Forward: all-gather along ``dim``. Backward: this rank's slice of the (whole) gradient."""

    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return all_gather_dim(x, axis, dim)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.axis.size, dim=ctx.dim)[ctx.axis.index].contiguous(), None, None


def gather_keep_slice(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """All-gather ``x`` along ``dim`` over ``axis``; the backward keeps this rank's slice of
    the whole gradient (Megatron-Core's ``gather_from_tensor_model_parallel_region``)."""
    return _GatherSplitBack.apply(x, axis, dim)


def gather_replicated(x: torch.Tensor, axis: Axis, sequence_parallel: bool) -> torch.Tensor:
    """Enter a replicated computation (MLA's down projections): with sequence parallelism
    ``x`` (B, T/tp, h) is all-gathered along the sequence and, its gradient being whole on
    every rank, the backward keeps this rank's slice (no collective); otherwise identity."""
    if axis.size == 1 or not sequence_parallel:
        return x
    return _GatherSplitBack.apply(x, axis, 1)


def keep_split_input(split: torch.Tensor, full: torch.Tensor, axis: Axis, dim: int = 1):
    """Within this block, layers that save ``full`` (the all-gather of ``split`` along
    ``dim`` over ``axis``, made by :func:`enter_tp` with sequence parallelism) for
    backward keep ``split`` instead, and the backward all-gathers it again, once for all
    of them (Megatron-LM's sequence-parallel column-parallel linear; Korthikanti et al.
    2022, section 4.2.2): activation memory of a column-parallel input drops by ``tp``
    for one more all-gather per micro-batch. A no-op on an axis of one rank.

    Use it around the column-parallel linears only: saved-tensor hooks do not nest, so
    other tensors saved inside are handed to :data:`parcompile.runtime.machine.memory.METER`.
    """
    if axis.size == 1 or full is split:
        return contextlib.nullcontext()
    ptr = full.untyped_storage().data_ptr()
    state = {"full": None, "left": 0}

    def pack(t):
        if t.untyped_storage().data_ptr() == ptr:
            if METER.active and not state["left"]:
                METER.hold(split)   # kept (by this closure) only if a layer saves ``full``
            state["left"] += 1
            return ("regather", tuple(t.shape), t.stride(), t.storage_offset())
        if METER.active:
            METER.saved(t)
        return t

    def unpack(obj):
        if not isinstance(obj, tuple):
            return obj
        if state["full"] is None:
            with torch.no_grad():
                state["full"] = all_gather_dim(split.detach(), axis, dim)
        out = state["full"].as_strided(obj[1], obj[2], obj[3])
        state["left"] -= 1
        if state["left"] == 0:
            state["full"] = None
        return out

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def leave_tp(x: torch.Tensor, axis: Axis, sequence_parallel: bool) -> torch.Tensor:
    """Leave a tensor-parallel region after row-parallel layers: ``x`` is a partial sum;
    all-reduce it, or reduce-scatter it along the sequence with sequence parallelism
    (the `g-bar` operator)."""
    if axis.size == 1:
        return x
    return _ReduceScatterDim.apply(x, axis, 1) if sequence_parallel else _ReduceFromRegion.apply(x, axis)


def copy_to_tp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Enter a tensor-parallel region: ``x`` replicated; its gradient is partial, so all-reduce it."""
    if axis.size == 1:
        return x
    return _CopyToRegion.apply(x, axis)


def reduce_from_tp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Leave a tensor-parallel region: ``x`` is a partial sum over ``axis``; all-reduce it."""
    if axis.size == 1:
        return x
    return _ReduceFromRegion.apply(x, axis)
