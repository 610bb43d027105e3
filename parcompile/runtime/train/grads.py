"""fp32 gradients for 16-bit parameters (Megatron-LM's `main_grad`).

Mixed precision keeps parameters and activations in bf16/fp16 but accumulates their
gradients in fp32 over the micro-batches of a step (SPEC accounting: 4 bytes per
parameter of gradients). For a 16-bit parameter a post-accumulate hook adds each new
``p.grad`` into ``p.main_grad`` (fp32) and frees ``p.grad``; for an fp32 parameter the
gradient simply is ``p.grad``. Everything on the optimizer side reads and writes
gradients through :func:`main_grad` and :func:`set_main_grad`.

Every gradient that reaches a parameter is announced to the parameter's
``_grad_listener`` (set by :class:`parcompile.runtime.train.buckets.GradBuckets`, which launches
a bucket's reduction once the last of its gradients has arrived): from the
post-accumulate hook for gradients autograd accumulates, and from :func:`accumulate` for
the weight gradients a zero-bubble schedule computes later (:mod:`parcompile.runtime.train.wgrad`).
Autograd also runs the hook of a weight whose deferred backward returned no gradient;
the listener is told all the same and decides (it knows which weights have gradients
still pending).

Before a gradient is added to a parameter, the parameter's ``_grad_prepare`` (if any) is
called with it: from a tensor hook, which autograd runs before it accumulates, and from
:func:`accumulate`. :class:`parcompile.runtime.train.buckets.GradBuckets` uses it under ZeRO 2/3
to allocate a bucket's buffer only when the micro-batch's first gradient reaches it
(the parameter's gradient then is a view of that buffer, so autograd adds into it). That
buffer is in the reduce dtype (``parallel.reduce_dtype``): fp32, or with a 16-bit reduce
dtype the parameter's own dtype, so that during the micro-batch ``main_grad`` is a
16-bit view holding that micro-batch's gradient; the step's fp32 sum is the bucket's
shard (:class:`parcompile.runtime.train.buckets.GradBuckets`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn


#: the dtype of a 16-bit parameter's accumulated gradient (``parallel.grad_dtype``): fp32, or bf16 as
#: Megatron-Core's ``--grad-reduce-in-bf16`` (its grad buffer in the parameters' dtype; the optimizer
#: reads an fp32 copy: :func:`optimizer_grad`); the program sets it once (:func:`set_grad_dtype`)
_GRAD_DTYPE = [torch.float32]


def set_grad_dtype(dtype: str) -> None:
    """Accumulate 16-bit parameters' gradients in ``dtype`` (``parallel.grad_dtype``: ``"fp32"``
    or ``"bf16"``); each program's ``main`` sets it (several programs may run in one process)."""
    from parcompile.runtime.machine.dtypes import TORCH_DTYPES

    _GRAD_DTYPE[0] = TORCH_DTYPES[dtype]


def grad_dtype() -> torch.dtype:
    """The dtype 16-bit parameters' gradients accumulate in (:func:`set_grad_dtype`)."""
    return _GRAD_DTYPE[0]


def optimizer_grad(g: torch.Tensor) -> torch.Tensor:
    """A gradient as the fp32 master weights take it: fp32 as it is, a bf16 one (``grad_dtype =
    bf16``) cast (Megatron-Core's distributed optimizer copies its bf16 grad shard to fp32
    ``main_grad`` before the step)."""
    return g if g.dtype == torch.float32 else g.float()


def is_mixed(p: torch.Tensor) -> bool:
    """True for a 16-bit parameter whose gradient is kept in fp32."""
    return p.dtype in (torch.bfloat16, torch.float16)


def main_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient of ``p`` accumulated so far (None before any): fp32, but a view of a
    16-bit bucket during a micro-batch under ZeRO 2/3 with a 16-bit reduce dtype (module
    docstring)."""
    return getattr(p, "main_grad", None) if is_mixed(p) else p.grad


def set_main_grad(p: torch.Tensor, g: torch.Tensor | None) -> None:
    """Replace the gradient of ``p`` (fp32 for 16-bit parameters)."""
    if is_mixed(p):
        p.main_grad = g
    else:
        p.grad = g


def set_segment_grad(seg: torch.Tensor, g: torch.Tensor | None) -> None:
    """Give an optimizer segment (a ZeRO slice the optimizer steps) its fp32 gradient ``g``
    (a view of the device's reduce-scattered shard), or none. A segment whose values live in
    host memory (``parallel.offload``: :mod:`parcompile.runtime.train.offload`) keeps a
    device gradient beside ``.grad`` (torch requires ``.grad`` on the tensor's device); the
    host optimizer copies it down after the clipping. On the CPU both are ``.grad``."""
    if g is not None and g.device != seg.device:
        seg.grad, seg.device_grad = None, g
    else:
        seg.grad, seg.device_grad = g, None


def segment_grad(seg: torch.Tensor) -> torch.Tensor | None:
    """The gradient :func:`set_segment_grad` gave ``seg`` (None before any)."""
    return seg.grad if seg.grad is not None else getattr(seg, "device_grad", None)


def accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    """Add ``g`` to the gradient of ``p`` (in fp32 for 16-bit parameters), and tell the
    parameter's listener (module docstring)."""
    _prepare(p)
    cur = main_grad(p)
    if cur is None:
        set_main_grad(p, g.to(grad_dtype()) if is_mixed(p) else g.to(p.dtype))
    else:
        cur.add_(g.to(cur.dtype))
    _announce(p)


def _prepare(p: torch.Tensor) -> None:
    prepare = getattr(p, "_grad_prepare", None)
    if prepare is not None:
        prepare(p)


def _prepare_hook(p: torch.Tensor, grad: torch.Tensor) -> None:
    """Tensor hook: a gradient of ``p`` is about to be accumulated (module docstring)."""
    _prepare(p)


def _announce(p: torch.Tensor) -> None:
    listener = getattr(p, "_grad_listener", None)
    if listener is not None:
        listener(p)


def _hook(p: torch.Tensor) -> None:
    """16-bit parameters: move the new ``p.grad`` into ``main_grad`` (none when a deferred
    backward returned no weight gradient)."""
    g, p.grad = p.grad, None
    if g is None:
        _announce(p)
    else:
        accumulate(p, g)


def enable_main_grads(model: nn.Module) -> None:
    """Route the gradients of the model's 16-bit parameters into fp32 ``main_grad``, and
    announce every parameter's gradients to its listener (module docstring)."""
    for p in model.parameters():
        if getattr(p, "_main_grad_hooked", False):
            continue
        p._main_grad_hooked = True
        p.register_hook(functools.partial(_prepare_hook, p))
        if is_mixed(p):
            p.register_post_accumulate_grad_hook(_hook)
            p.main_grad = None
        else:
            p.register_post_accumulate_grad_hook(_announce)
