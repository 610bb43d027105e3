"""Output-discarding recomputation: a function's output freed once its consumer has saved it
and rebuilt just before the consumer's backward (Megatron-Core's ``CheckpointWithoutOutput``,
NVIDIA/Megatron-LM d98e8a6 ``megatron/core/tensor_parallel/random.py``, which its ``moe_act``,
``layernorm`` and ``mla_up_proj`` recompute modules use; :mod:`parcompile.core.recompute`).

:func:`discarding` runs ``fn`` without a graph, keeps its inputs, and hands out the output;
after the consumer's forward, :meth:`Discarded.discard` frees the output's storage (the
consumer's saved reference to it then holds no bytes) and registers a hook on the consumer's
output: when its gradient arrives, ``fn`` runs again with a graph, its result is copied into the
freed storage (the consumer's backward reads it there), and the backward of the output goes
through that recomputed graph. A storage-level resize and copy do not bump the tensor's version,
so autograd accepts the refilled tensor (as Megatron-Core's does). ``fn`` may return a tuple
of tensors (MLA's query, key and value: :func:`discarding`), each freed and refilled alike.
"""

from __future__ import annotations

from typing import Callable

import torch


class _Discarding(torch.autograd.Function):
    """The output of a :class:`Discarded` function: forward without a graph, backward through
    the graph its recomputation built (module docstring)."""

    @staticmethod
    def forward(ctx, holder: "Discarded", *args):
        ctx.holder = holder
        with torch.no_grad():
            return holder.fn(*args)

    @staticmethod
    def backward(ctx, *grads):
        holder = ctx.holder
        args, out = holder.rebuilt
        holder.rebuilt = None
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) + tuple(a.grad if torch.is_tensor(a) and a.requires_grad else None for a in args)


class Discarded:
    """One output-discarding call (module docstring): ``fn`` and its inputs, its output ``out``
    (a tensor, or a tuple of tensors of their own storages)."""

    def __init__(self, fn: Callable, args: tuple):
        from parcompile.runtime.machine.memory import METER

        self.fn, self.args = fn, args
        self.rebuilt = None
        if torch.is_grad_enabled():
            if METER.active:   # the inputs are kept by reference, outside saved-tensor hooks
                METER.hold(*args)
            self.out = _Discarding.apply(self, *args)
        else:
            self.out = fn(*args)

    def discard(self, consumer_out: torch.Tensor) -> None:
        """Free the output once ``consumer_out`` (what the consumer computed from it) exists;
        rebuild it when ``consumer_out``'s gradient arrives."""
        if not consumer_out.requires_grad:
            return
        from parcompile.runtime.machine.memory import METER

        for out in self._outs(self.out):
            if METER.active:
                METER.release(out)
            out.untyped_storage().resize_(0)
        consumer_out.register_hook(self._rebuild)

    @staticmethod
    def _outs(out) -> tuple:
        return out if isinstance(out, tuple) else (out,)

    def _rebuild(self, grad):
        args = tuple(a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a for a in self.args)
        with torch.enable_grad():
            out = self.fn(*args)
        for kept, again in zip(self._outs(self.out), self._outs(out)):
            storage = kept.untyped_storage()
            storage.resize_(again.untyped_storage().nbytes())
            storage.copy_(again.untyped_storage())
        self.rebuilt = (args, out)
        return grad


def discard_between(norm: torch.nn.Module, consumer: torch.nn.Module) -> None:
    """Run ``norm``'s forward output-discarding, its output freed once ``consumer`` (the module
    its output feeds, called with it as its first argument) has run: Megatron-Core's
    ``layernorm`` recompute module (``transformer_layer.py`` ``recompute_input_layernorm``: the
    norm's output rebuilt before the attention's or the MLP's backward). Both modules are
    unchanged but for their ``forward``."""
    norm_forward, consumer_forward = norm.forward, consumer.forward

    def run_norm(x, *args, **kwargs):
        if not torch.is_grad_enabled():
            return norm_forward(x, *args, **kwargs)
        norm._discarded = discarding(lambda t: norm_forward(t, *args, **kwargs), x)
        return norm._discarded.out

    def run_consumer(h, *args, **kwargs):
        pending, norm._discarded = getattr(norm, "_discarded", None), None
        out = consumer_forward(h, *args, **kwargs)
        if pending is not None and h is pending.out:
            pending.discard(out)
        return out

    norm.forward, consumer.forward = run_norm, run_consumer


def discarding(fn: Callable, *args) -> Discarded:
    """``fn(*args)`` as an output-discarding call (module docstring): its output is
    ``.out`` (a tensor or a tuple of them, as ``fn`` returns); call
    ``.discard(consumer_out)`` after the consumer's forward. Megatron-Core's ``mla_up_proj``
    (NVIDIA/Megatron-LM 003b4ce ``megatron/core/transformer/multi_latent_attention.py``:
    ``qkv_up_proj_and_rope_apply`` under ``CheckpointWithoutOutput``, its query, key and value
    discarded once the attention core ran, ``discard_output_and_register_recompute``) is one
    such call in the generated program (codegen/blocks.py writes it)."""
    return Discarded(fn, args)


__all__ = ["Discarded", "discarding", "discard_between"]
