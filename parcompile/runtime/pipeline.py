"""The pipeline schedule executor: runs one pipeline rank's action list from plan.json.

Actions (docs/internals.md): ``forward``, ``backward``, ``backward_input`` and
``backward_weight`` (zero-bubble: the backward split into input and weight gradients,
see :mod:`parcompile.runtime.wgrad`), ``recv_forward``, ``send_forward``,
``recv_backward``, ``send_backward``, each with a ``microbatch`` and a local ``chunk``.
Local chunk ``c`` of pipeline rank ``r`` is model chunk ``c * pp + r`` (Megatron-Core's
interleaved assignment; with one virtual stage, chunk 0 is stage r). Sends are
asynchronous and waited for at the end of the step; receives block. A tag per
(micro-batch, receiving chunk, direction) pairs each send with its receive, so any
action list the plan's simulator accepted runs without deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from parcompile.runtime.comm import isend, recv
from parcompile.runtime.context import ParallelContext
from parcompile.runtime.context_parallel import split_microbatch
from parcompile.runtime.dataset import local_rows
from parcompile.runtime.train import reduce_loss
from parcompile.runtime.wgrad import STORE

FORWARD, BACKWARD = 0, 1


@dataclass
class StepResult:
    """What one step returns on this rank: the sum of its micro-batches' losses as
    ``loss_fn`` returned them (already normalised by the step's unmasked target count;
    None off the last model chunk), and the actions as they ran."""

    loss: torch.Tensor | None
    executed: list[tuple[str, int, int]]  # (op, microbatch, chunk) in the order they ran


def _tag(microbatch: int, chunk: int, direction: int, num_chunks: int) -> int:
    return (microbatch * num_chunks + chunk) * 2 + direction


def run_schedule(
    actions: list[dict],
    ctx: ParallelContext,
    forward_chunk: Callable[[int, torch.Tensor], torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    microbatches: list[tuple[torch.Tensor, torch.Tensor]],
    num_chunks: int,
    activation_shape: tuple[int, ...],
    activation_dtype: torch.dtype,
    loss_scale: float = 1.0,
    grad_sync=None,
) -> StepResult:
    """Execute ``actions`` for one optimizer step; gradients accumulate into ``.grad``.

    Args:
        actions: this pipeline rank's ordered actions.
        forward_chunk: ``(chunk, x) -> y``; x is token ids (b, t) on the model's first
            chunk, else hidden states (b, t, h); y is logits on the last chunk.
        loss_fn: ``(logits, targets) -> loss`` of one micro-batch, normalised so that the
            micro-batches of all data-parallel ranks add up to the step's loss (the sum of
            token losses over the unmasked targets of the global batch divided by their
            count, times the data-parallel size the gradient average divides by again).
        microbatches: m pairs (inputs, targets) of token ids, (b, t) each.
        num_chunks: virtual stages per pipeline rank.
        activation_shape: (b, t, h), what crosses a stage boundary.
        loss_scale: the fp16 loss scale the last chunk's loss is multiplied by before its
            backward (so every gradient, the ones sent between stages too, is scaled).
        grad_sync: the optimizer's :class:`parcompile.runtime.buckets.GradSync`, told
            around every backward action (the last one of a chunk makes its gradients
            final, and their buckets' data-parallel reduction starts during it); None:
            the optimizer reduces after the step.

    Raises:
        RuntimeError: an action refers to a tensor the schedule has not produced (a bug in
            the plan's schedule, which its simulator should have caught).
    """
    pp = ctx.pp
    p, r = pp.size, pp.index
    last_model_chunk = p * num_chunks - 1
    received: dict[tuple[int, int, int], torch.Tensor] = {}
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    input_grads: dict[tuple[int, int], torch.Tensor] = {}
    pending = []
    loss_sum = None
    STORE.enabled = any(a["op"] == "backward_input" for a in actions)
    device = ctx.device

    def model_chunk(c: int) -> int:
        return c * p + r

    executed: list[tuple[str, int, int]] = []
    if grad_sync is not None:
        grad_sync.start(actions)
    for i, a in enumerate(actions):
        op, mb, c = a["op"], a["microbatch"], a["chunk"]
        executed.append((op, mb, c))
        k = model_chunk(c)
        if op == "recv_forward":
            received[(mb, c, FORWARD)] = recv(activation_shape, activation_dtype, device, pp, (r - 1) % p,
                                              _tag(mb, c, FORWARD, num_chunks))
        elif op == "forward":
            if k == 0:
                x = microbatches[mb][0].to(device)
            else:
                x = received.pop((mb, c, FORWARD)).requires_grad_()
            y = forward_chunk(c, x)
            inputs[(mb, c)] = x
            if k == last_model_chunk:
                loss = loss_fn(y, microbatches[mb][1].to(device))
                del y   # the 16-bit logits: the loss keeps its fp32 copy (never alive with a recomputed layer)
                outputs[(mb, c)] = loss
                loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            else:
                outputs[(mb, c)] = y
        elif op == "send_forward":
            peer_chunk = (k + 1) // p
            pending.append(isend(outputs[(mb, c)].detach(), pp, (r + 1) % p,
                                 _tag(mb, peer_chunk, FORWARD, num_chunks)))
        elif op == "recv_backward":
            received[(mb, c, BACKWARD)] = recv(activation_shape, activation_dtype, device, pp, (r + 1) % p,
                                               _tag(mb, c, BACKWARD, num_chunks))
        elif op in ("backward", "backward_input"):
            out = outputs.pop((mb, c))
            grad = None if k == last_model_chunk else received.pop((mb, c, BACKWARD))
            if grad is None and loss_scale != 1.0:
                out = out * loss_scale                          # fp16: scaled loss, scaled gradients
            if grad_sync is not None:
                grad_sync.begin(i)
            if op == "backward_input":
                with STORE.collecting((mb, c)):
                    torch.autograd.backward(out, grad)
            else:
                torch.autograd.backward(out, grad)
            if grad_sync is not None:
                grad_sync.end(i)
            x = inputs.pop((mb, c))
            if k != 0:
                input_grads[(mb, c)] = x.grad
        elif op == "backward_weight":
            if grad_sync is not None:
                grad_sync.begin(i)
            STORE.flush((mb, c))
            if grad_sync is not None:
                grad_sync.end(i)
        elif op == "send_backward":
            peer_chunk = (k - 1) // p
            pending.append(isend(input_grads.pop((mb, c)), pp, (r - 1) % p,
                                 _tag(mb, peer_chunk, BACKWARD, num_chunks)))
        else:
            raise RuntimeError(f"unknown pipeline action {op!r}")
    for w in pending:
        w.wait()
    if outputs or received or input_grads or STORE.pending:
        raise RuntimeError(
            f"schedule left work undone on pipeline rank {r}: outputs {sorted(outputs)}, "
            f"received {sorted(received)}, input grads {sorted(input_grads)}, "
            f"weight gradients {sorted(STORE.pending)}"
        )
    STORE.enabled = False   # the step's deferral ends with it (an eval or another program runs after)
    return StepResult(loss_sum, executed)


@torch.no_grad()
def run_forward(ctx: ParallelContext, forward_chunk: Callable[[int, torch.Tensor], torch.Tensor],
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                microbatches: list[tuple[torch.Tensor, torch.Tensor]], num_chunks: int,
                activation_shape: tuple[int, ...], activation_dtype: torch.dtype) -> torch.Tensor | None:
    """Forward only (evaluation): every micro-batch through this rank's chunks in model
    order, hidden states received from the previous pipeline rank and sent to the next
    (blocking receives, asynchronous sends: each receive waits for a send that comes
    earlier in model order, so no rank waits on a later one). Returns the sum of
    ``loss_fn`` over the micro-batches on the rank holding the last model chunk, else None.
    """
    pp = ctx.pp
    p, r = pp.size, pp.index
    last = p * num_chunks - 1
    total, pending = None, []
    for mb, (x_ids, targets) in enumerate(microbatches):
        for c in range(num_chunks):
            k = c * p + r
            if k == 0:
                x = x_ids.to(ctx.device)
            else:
                x = recv(activation_shape, activation_dtype, ctx.device, pp, (r - 1) % p,
                         _tag(mb, c, FORWARD, num_chunks))
            y = forward_chunk(c, x)
            if k == last:
                loss = loss_fn(y, targets.to(ctx.device)).detach()
                total = loss if total is None else total + loss
            else:
                y = y.contiguous()
                pending.append((y, isend(y, pp, (r + 1) % p, _tag(mb, (k + 1) // p, FORWARD, num_chunks))))
    for _, w in pending:
        w.wait()
    return total


def loss_normaliser(targets: torch.Tensor, ctx: ParallelContext) -> tuple[float, int]:
    """(factor, count) for a global batch's targets (n, T), -100 where masked: ``count`` is
    its unmasked targets and ``factor = dp_cp / count``, what a micro-batch's summed token
    losses are multiplied by so that the data-parallel gradient average (which divides by
    dp_cp again) and the loss average over dp_cp give sum / count (SPEC: the loss of a step
    is the sum of token losses over the global batch divided by its unmasked targets; so
    every layout and micro-batch split gives the same loss and gradients)."""
    count = int((targets != -100).sum())
    return ctx.axes["dp_cp"].size / max(count, 1), count


def evaluate(batches, ctx: ParallelContext, model, micro_batch: int, num_chunks: int,
             activation_shape: tuple[int, ...], activation_dtype: torch.dtype) -> tuple[float | None, int]:
    """Mean cross-entropy over every unmasked target of ``batches`` (global batches of
    (tokens, targets), in order), forward only with the model in eval mode (no dropout, no
    router loss). Returns (loss on the ranks of the last model chunk, else None; the count
    of targets it averages)."""
    batches = [batches.batch(b) for b in range(len(batches))] if hasattr(batches, "batch") else list(batches)
    count = sum(int((t != -100).sum()) for _, t in batches)
    factor = ctx.axes["dp_cp"].size / max(count, 1)
    was = model.training
    model.eval()
    total = None
    try:
        for tokens, targets in batches:
            mbs = [split_microbatch(x, ctx.axes["cp"], y)
                   for x, y in local_rows(tokens, targets, ctx.dp.index, ctx.dp.size, micro_batch)]
            part = run_forward(ctx, model.forward_chunk, lambda y, t: model.loss(y, t) * factor, mbs,
                               num_chunks, activation_shape, activation_dtype)
            if part is not None:
                total = part if total is None else total + part
    finally:
        model.train(was)
    return reduce_loss(total, ctx), count
