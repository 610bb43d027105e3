"""The bookkeeping of a training step: the learning-rate schedule, the loss averaged over
data-parallel ranks, the parameter count and the metrics and state files ``verify``
reads, and the errors that end a run on every rank at once (:class:`TrainError`: a
loss that is not finite, a checkpoint that cannot be saved), reported in one line. The
optimizer family (gradient reduction, clipping, the update, ZeRO, experts) is
:mod:`parcompile.runtime.train.optim`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from parcompile.runtime.distributed.comm import all_reduce
from parcompile.runtime.distributed.context import ParallelContext


class TrainError(Exception):
    """A run that cannot go on (a loss that is not finite, a checkpoint or an output that
    cannot be written): every rank raises it together (:func:`fail_together`), the
    program prints ``message`` once (rank 0) in one line and exits 1. ``help``: a fix."""

    def __init__(self, message: str, help: str | None = None, rank: int = 0):
        super().__init__(message)
        self.message, self.help, self.rank = message, help, rank

    def __str__(self) -> str:
        return self.message + (f" ({self.help})" if self.help else "")


def fail_together(ctx: ParallelContext, message: str | None, help: str | None = None) -> None:
    """Raise :class:`TrainError` on every rank when any rank passes a ``message`` (the
    lowest such rank's, with its ``help``); return on every rank otherwise. A collective
    over all ranks (every rank must call it at the same point), so no rank is left
    waiting in a later collective for one that stopped."""
    if ctx.distributed:
        got: list = [None] * ctx.world_size
        dist.all_gather_object(got, (message, help) if message else None)
        first = next((g for g in got if g), None)
        message, help = first if first else (None, None)
    if message:
        raise TrainError(message, help, ctx.rank)


def _stop(what: str, value: float, step: int, ctx: ParallelContext, last_checkpoint) -> TrainError:
    kept = (f"the newest checkpoint, {os.path.normpath(last_checkpoint)}, is kept" if last_checkpoint
            else "no checkpoint was saved")
    resume = ("resume from the kept checkpoint: run again with the same checkpoint_dir" if last_checkpoint
              else "set checkpoint_dir and checkpoint_every to keep checkpoints a run can resume from")
    return TrainError(f"step {step}: the {what} is {value}; training stopped before saving anything of this "
                      f"step ({kept})",
                      f"lower lr, lower grad_clip or use bf16 instead of fp16; {resume}", ctx.rank)


def check_grad_norm(norm: float, step: int, ctx: ParallelContext, last_checkpoint=None) -> None:
    """End the run when the gradient norm of ``step`` (1-based, as logged) is NaN or
    infinite, before the optimizer would write it into the weights. The norm is the
    global one every rank computed alike (:meth:`grad_norm` reduces over all ranks), so
    every rank stops together without a collective. (fp16 skips such a step instead: its
    loss scaler's overflow check runs first.)

    Raises:
        TrainError: naming the step, the value and the newest checkpoint kept.
    """
    if not math.isfinite(norm):
        raise _stop("gradient norm", norm, step, ctx, last_checkpoint)


def check_loss(loss: float | None, step: int, ctx: ParallelContext, last_checkpoint=None) -> None:
    """End the run on every rank when the loss of ``step`` (1-based, as logged) is NaN or
    infinite on the last stage (None elsewhere): one all-reduce of a flag over all ranks,
    before anything of the step is saved.

    Raises:
        TrainError: naming the step, the value and the newest checkpoint kept.
    """
    bad = 0.0 if loss is None or math.isfinite(loss) else (2.0 if math.isinf(loss) else 1.0)
    if ctx.distributed:
        flag = torch.tensor([bad])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = float(flag[0])
    if bad:
        raise _stop("loss", float("inf") if bad == 2 else float("nan"), step, ctx, last_checkpoint)


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


__all__ = ["TrainError", "fail_together", "check_loss", "check_grad_norm", "lr_at", "reduce_loss", "local_param_count", "write_metrics", "write_state"]
