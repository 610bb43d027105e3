"""The bookkeeping of a training step: the learning-rate schedule, the loss averaged over
data-parallel ranks, the parameter count and the metrics and state files ``verify``
reads. The optimizer family (gradient reduction, clipping, the update, ZeRO, experts) is
:mod:`parcompile.runtime.optim`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

from parcompile.runtime.comm import all_reduce
from parcompile.runtime.context import ParallelContext


def lr_at(step: int, train: dict) -> float:
    """Learning rate for ``step`` (0-based): linear warm-up over ``warmup_steps``, then
    constant, cosine or linear decay to ``min_lr`` at the last step."""
    lr, warm, steps, min_lr = train["lr"], train["warmup_steps"], train["steps"], train["min_lr"]
    if warm and step < warm:
        return lr * (step + 1) / warm
    kind = train["lr_schedule"]
    if kind == "constant":
        return lr
    span = max(steps - warm - 1, 1)
    frac = min(max((step - warm) / span, 0.0), 1.0)
    if kind == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * frac))
    return lr + (min_lr - lr) * frac


def reduce_loss(loss: torch.Tensor | None, ctx: ParallelContext) -> float | None:
    """The step's loss averaged over data-parallel ranks (on the last stage; None elsewhere)."""
    if loss is None:
        return None
    t = loss.detach().float().reshape(1).clone()
    dp = ctx.axes["dp_cp"]
    all_reduce(t, dp)
    return float(t[0]) / dp.size


def local_param_count(model: nn.Module) -> int:
    """Parameters held by this rank (elements), padded vocabulary included."""
    return sum(p.numel() for p in model.parameters())


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_metrics(out_dir: str | os.PathLike, ctx: ParallelContext, record: dict) -> None:
    """Write ``rank{r}.json`` (losses, collectives of one step, parameter count) atomically."""
    path = Path(out_dir) / f"rank{ctx.rank}.json"
    text = json.dumps(record, indent=1, sort_keys=True)
    _atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def write_state(out_dir: str | os.PathLike, ctx: ParallelContext, state: dict) -> None:
    """Write ``rank{r}.pt`` (parameter and gradient shards) atomically."""
    _atomic_write(Path(out_dir) / f"rank{ctx.rank}.pt", lambda tmp: torch.save(state, tmp))


__all__ = ["lr_at", "reduce_loss", "local_param_count", "write_metrics", "write_state"]
