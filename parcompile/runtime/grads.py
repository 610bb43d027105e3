"""fp32 gradients for 16-bit parameters (Megatron-LM's `main_grad`).

Mixed precision keeps parameters and activations in bf16/fp16 but accumulates their
gradients in fp32 over the micro-batches of a step (SPEC accounting: 4 bytes per
parameter of gradients). For a 16-bit parameter a post-accumulate hook adds each new
``p.grad`` into ``p.main_grad`` (fp32) and frees ``p.grad``; for an fp32 parameter the
gradient simply is ``p.grad``. Everything on the optimizer side reads and writes
gradients through :func:`main_grad` and :func:`set_main_grad`.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def is_mixed(p: torch.Tensor) -> bool:
    """True for a 16-bit parameter whose gradient is kept in fp32."""
    return p.dtype in (torch.bfloat16, torch.float16)


def main_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The fp32 gradient of ``p`` accumulated so far (None before any)."""
    return getattr(p, "main_grad", None) if is_mixed(p) else p.grad


def set_main_grad(p: torch.Tensor, g: torch.Tensor | None) -> None:
    """Replace the gradient of ``p`` (fp32 for 16-bit parameters)."""
    if is_mixed(p):
        p.main_grad = g
    else:
        p.grad = g


def accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    """Add ``g`` to the gradient of ``p`` (in fp32 for 16-bit parameters)."""
    cur = main_grad(p)
    if cur is None:
        set_main_grad(p, g.float() if is_mixed(p) else g.to(p.dtype))
    else:
        cur.add_(g.to(cur.dtype))


def _hook(p: torch.Tensor) -> None:
    g, p.grad = p.grad, None
    accumulate(p, g)


def enable_main_grads(model: nn.Module) -> None:
    """Route the gradients of the model's 16-bit parameters into fp32 ``main_grad``."""
    for p in model.parameters():
        if is_mixed(p) and not getattr(p, "_main_grad_hooked", False):
            p.register_post_accumulate_grad_hook(_hook)
            p._main_grad_hooked = True
            p.main_grad = None
