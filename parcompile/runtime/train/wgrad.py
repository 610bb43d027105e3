"""Deferred weight gradients for zero-bubble pipeline schedules (Qi et al. 2023).

A zero-bubble schedule splits each backward into B (input gradients, on the critical
path of the pipeline) and W (weight gradients, run later to fill the bubble). Linear
layers route through :func:`linear`: while :data:`STORE` is collecting for a
(micro-batch, chunk), their backward returns only the input gradient and files a
closure that computes ``dW = dY^T X``; the schedule's ``backward_weight`` action runs
the closures of that micro-batch and chunk. Outside a collecting backward, :func:`linear`
is plain ``F.linear``. Biases, norms and embeddings keep their gradients in B (they are
cheap, as in the paper's implementation).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F

from parcompile.runtime.train.grads import accumulate


class WeightGradStore:
    """Closures computing weight gradients, filed per (micro-batch, chunk)."""

    def __init__(self) -> None:
        self.enabled = False
        self.current: tuple[int, int] | None = None
        self.pending: dict[tuple[int, int], list[tuple[int, Callable[[], None]]]] = defaultdict(list)
        #: per weight (``id``), closures filed and not run yet
        self.waiting: Counter = Counter()

    @contextmanager
    def collecting(self, key: tuple[int, int]):
        """Within this block, linear backward passes defer their weight gradients to ``key``."""
        self.current = key
        try:
            yield
        finally:
            self.current = None

    def file(self, fn: Callable[[], None], weight: torch.Tensor | None = None) -> None:
        """Run ``fn`` now, or, while collecting, file it under the current key (``weight``:
        the parameter whose gradient it computes)."""
        if self.current is None:
            fn()
        else:
            self.pending[self.current].append((id(weight), fn))
            self.waiting[id(weight)] += 1

    def has_pending(self, weight: torch.Tensor) -> bool:
        """Whether a weight-gradient closure of ``weight`` is filed and not run yet."""
        return self.waiting[id(weight)] > 0

    def flush(self, key: tuple[int, int]) -> int:
        """Run (and forget) the weight-gradient closures of ``key``; returns how many ran."""
        fns = self.pending.pop(key, [])
        with torch.no_grad():   # a gradient, not part of any graph
            for wid, fn in fns:
                self.waiting[wid] -= 1   # before it runs: its gradient then announces the last one
                fn()
        return len(fns)


STORE = WeightGradStore()


def _accumulate(weight: torch.Tensor, grad: torch.Tensor) -> None:
    accumulate(weight, grad)


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T + b; the backward returns dx (and db) and files dW with :data:`STORE`."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x)
        # the parameter itself, not a saved copy: under saved-tensor hooks (the activation
        # meter) ``saved_tensors`` hands back another tensor object, and the deferred
        # gradient must reach the parameter (and its bucket)
        ctx.weight = weight
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        (x,), weight = ctx.saved_tensors, ctx.weight
        grad_x = grad_out @ weight.to(grad_out.dtype)
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        go = grad_out.reshape(-1, grad_out.shape[-1])
        xi = x.reshape(-1, x.shape[-1])
        STORE.file(lambda: _accumulate(weight, go.t().to(xi.dtype) @ xi), weight)
        return grad_x, None, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, whose weight gradient a zero-bubble schedule may defer (see module doc)."""
    if STORE.enabled and torch.is_grad_enabled():
        return _DeferredLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)
