"""Collectives that count themselves, and their differentiable forms (Megatron-LM's
`mappings.py` shapes: copy-to / reduce-from the tensor-parallel region).

Every collective a generated program runs goes through this module, which records
``(op, axis, bytes)`` per call in :data:`COUNTER`. ``bytes`` is the size of the tensor the
collective produces (the plan's convention, SPEC section 3). ``verify`` compares the counts
of one training step with the plan's ``comm.collectives``.

A collective over an axis of size one is skipped and not counted.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from parcompile.runtime.context import Axis


class CommCounter:
    """Counts collectives by ``(op, axis, bytes)``; ``snapshot()`` returns a sorted list."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.enabled = True

    def record(self, op: str, axis: str, nbytes: int) -> None:
        if self.enabled:
            self.counts[(op, axis, int(nbytes))] += 1

    def reset(self) -> None:
        self.counts.clear()

    def snapshot(self) -> list[dict]:
        return [
            {"op": op, "axis": axis, "bytes": b, "count": c}
            for (op, axis, b), c in sorted(self.counts.items())
        ]


COUNTER = CommCounter()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(t: torch.Tensor, axis: Axis, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of ``t`` over ``axis`` (``op``: sum or max); returns ``t``."""
    if axis.size == 1 or axis.group is None:
        return t
    COUNTER.record("all_reduce", axis.name, _nbytes(t))
    rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    dist.all_reduce(t, op=rop, group=axis.group)
    return t


def isend(t: torch.Tensor, axis: Axis, peer_index: int, tag: int):
    """Asynchronous send of ``t`` to the rank at ``peer_index`` of ``axis``; returns the work."""
    COUNTER.record("send", axis.name, _nbytes(t))
    return dist.isend(t.contiguous(), dst=axis.ranks[peer_index], tag=tag)


def recv(shape: tuple[int, ...], dtype: torch.dtype, device, axis: Axis, peer_index: int, tag: int) -> torch.Tensor:
    """Blocking receive of a tensor of ``shape`` from the rank at ``peer_index`` of ``axis``."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    COUNTER.record("recv", axis.name, _nbytes(buf))
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
