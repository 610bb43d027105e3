"""The pipeline schedule executor: runs one pipeline rank's action list from plan.json.

Actions (docs/internals.md): ``forward``, ``backward``, ``backward_input`` and
``backward_weight`` (zero-bubble: the backward split into input and weight gradients,
see :mod:`parcompile.runtime.train.wgrad`), ``recv_forward``, ``send_forward``,
``recv_backward``, ``send_backward``, each with a ``microbatch`` and a local ``chunk``.
Which model chunk a local chunk is, and which rank holds the chunk before and after it, is
the plan's placement (``ctx.placement``, :class:`parcompile.core.schedule.Placement`; ``loop``:
local chunk ``c`` of pipeline rank ``r`` is model chunk ``c * pp + r``, Megatron-Core's
interleaved assignment). Sends are
asynchronous and waited for at the end of the step; receives block. A tag per
(micro-batch, receiving chunk, direction) pairs each send with its receive, so any
action list the plan's simulator accepted runs without deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from parcompile.runtime.distributed.comm import isend, recv
from parcompile.runtime.distributed.context import ParallelContext
from parcompile.runtime.distributed.context_parallel import split_microbatch
from parcompile.runtime.data.dataset import local_rows
from parcompile.runtime.train.step import reduce_loss
from parcompile.runtime.train.wgrad import STORE

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


class _Step:
    """One step's tensors on this pipeline rank, keyed by (micro-batch, local chunk): what
    was received, each chunk's input and output, the input gradients to send back, the
    sends in flight and the summed loss. Peers come from the plan's placement
    (``ctx.placement``, :class:`parcompile.core.schedule.Placement`): model chunk ``k + 1``'s
    rank gets the activation model chunk ``k`` sends, and its gradient comes back."""

    def __init__(self, ctx: ParallelContext, num_chunks: int, activation_shape: tuple[int, ...],
                 activation_dtype: torch.dtype):
        self.ctx, self.group, self.device = ctx, ctx.pp, ctx.device
        self.p, self.r, self.v = ctx.pp.size, ctx.pp.index, num_chunks
        self.place = ctx.placement
        self.last = self.p * num_chunks - 1
        self.shape, self.dtype = activation_shape, activation_dtype
        self.received: dict[tuple[int, int, int], torch.Tensor] = {}
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.pending: list = []
        self.loss_sum: torch.Tensor | None = None

    def model_chunk(self, c: int) -> int:
        return self.place.chunk(self.r, c, self.p)

    def recv(self, mb: int, c: int, direction: int) -> None:
        """Receive micro-batch ``mb``'s activation (forward) or output gradient (backward) of
        local chunk ``c`` from the rank of the model chunk before (after) it."""
        k = self.model_chunk(c) + (-1 if direction == FORWARD else 1)
        self.received[(mb, c, direction)] = recv(self.shape, self.dtype, self.device, self.group,
                                                 self.place.rank(k, self.p), _tag(mb, c, direction, self.v))

    def send(self, tensor: torch.Tensor, mb: int, c: int, direction: int) -> None:
        """Send ``tensor`` to the rank of the model chunk after (forward) or before (backward)
        local chunk ``c``'s, tagged with that chunk's local index there."""
        k = self.model_chunk(c) + (1 if direction == FORWARD else -1)
        self.pending.append(isend(tensor, self.group, self.place.rank(k, self.p),
                                  _tag(mb, self.place.local(k, self.p), direction, self.v)))

    def forward(self, mb: int, c: int, forward_chunk, loss_fn, microbatches) -> None:
        """Run local chunk ``c`` on micro-batch ``mb``; on the last model chunk, its loss."""
        k = self.model_chunk(c)
        x = microbatches[mb][0].to(self.device) if k == 0 else self.received.pop((mb, c, FORWARD)).requires_grad_()
        y = forward_chunk(c, x)
        self.inputs[(mb, c)] = x
        if k == self.last:
            loss = loss_fn(y, microbatches[mb][1].to(self.device))
            del y   # the 16-bit logits: the loss keeps its fp32 copy (never alive with a recomputed layer)
            self.outputs[(mb, c)] = loss
            self.loss_sum = loss.detach() if self.loss_sum is None else self.loss_sum + loss.detach()
        else:
            self.outputs[(mb, c)] = y

    def backward(self, mb: int, c: int, split: bool, loss_scale: float) -> None:
        """Backward of local chunk ``c`` on micro-batch ``mb`` (``split``: its input gradient
        only, the weight gradients deferred, :mod:`parcompile.runtime.train.wgrad`)."""
        k = self.model_chunk(c)
        out = self.outputs.pop((mb, c))
        grad = None if k == self.last else self.received.pop((mb, c, BACKWARD))
        if grad is None and loss_scale != 1.0:
            out = out * loss_scale                          # fp16: scaled loss, scaled gradients
        if split:
            with STORE.collecting((mb, c)):
                torch.autograd.backward(out, grad)
        else:
            torch.autograd.backward(out, grad)
        x = self.inputs.pop((mb, c))
        if k != 0:
            self.input_grads[(mb, c)] = x.grad

    def finish(self) -> None:
        """Wait for the sends; raise RuntimeError when the actions left a tensor behind."""
        for w in self.pending:
            w.wait()
        if self.outputs or self.received or self.input_grads or STORE.pending:
            raise RuntimeError(
                f"schedule left work undone on pipeline rank {self.r}: outputs {sorted(self.outputs)}, "
                f"received {sorted(self.received)}, input grads {sorted(self.input_grads)}, "
                f"weight gradients {sorted(STORE.pending)}"
            )


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
        grad_sync: the optimizer's :class:`parcompile.runtime.train.buckets.GradSync`, told
            around every backward action (the last one of a chunk makes its gradients
            final, and their buckets' data-parallel reduction starts during it); None:
            the optimizer reduces after the step.

    Raises:
        RuntimeError: an action refers to a tensor the schedule has not produced (a bug in
            the plan's schedule, which its simulator should have caught).
    """
    st = _Step(ctx, num_chunks, activation_shape, activation_dtype)
    STORE.enabled = any(a["op"] == "backward_input" for a in actions)
    executed: list[tuple[str, int, int]] = []
    if grad_sync is not None:
        grad_sync.start(actions)
    for i, a in enumerate(actions):
        op, mb, c = a["op"], a["microbatch"], a["chunk"]
        executed.append((op, mb, c))
        if op == "recv_forward" or op == "recv_backward":
            st.recv(mb, c, FORWARD if op == "recv_forward" else BACKWARD)
        elif op == "forward":
            st.forward(mb, c, forward_chunk, loss_fn, microbatches)
        elif op == "send_forward":
            st.send(st.outputs[(mb, c)].detach(), mb, c, FORWARD)
        elif op == "send_backward":
            st.send(st.input_grads.pop((mb, c)), mb, c, BACKWARD)
        elif op in ("backward", "backward_input", "backward_weight"):
            if grad_sync is not None:
                grad_sync.begin(i)
            if op == "backward_weight":
                STORE.flush((mb, c))
            else:
                st.backward(mb, c, op == "backward_input", loss_scale)
            if grad_sync is not None:
                grad_sync.end(i)
        else:
            raise RuntimeError(f"unknown pipeline action {op!r}")
    st.finish()
    STORE.enabled = False   # the step's deferral ends with it (an eval or another program runs after)
    return StepResult(st.loss_sum, executed)


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
    st = _Step(ctx, num_chunks, activation_shape, activation_dtype)   # its peers and tags: the training step's
    total = None
    for mb, (x_ids, targets) in enumerate(microbatches):
        for c in range(num_chunks):
            k = st.model_chunk(c)
            if k == 0:
                x = x_ids.to(ctx.device)
            else:
                st.recv(mb, c, FORWARD)
                x = st.received.pop((mb, c, FORWARD))
            y = forward_chunk(c, x)
            if k == st.last:
                loss = loss_fn(y, targets.to(ctx.device)).detach()
                total = loss if total is None else total + loss
            else:
                st.send(y, mb, c, FORWARD)
    st.finish()
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
