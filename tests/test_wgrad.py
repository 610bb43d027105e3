"""Deferred weight gradients (zero-bubble B/W split) equal autograd's."""

from __future__ import annotations

import torch

from parcompile.runtime.train.wgrad import STORE, linear


def test_deferred_linear_matches_autograd_and_waits_for_flush():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 4, requires_grad=True)
    w = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    g = torch.randn(2, 5, 3)
    torch.nn.functional.linear(x, w, b).backward(g)
    ref = (x.grad.clone(), w.grad.clone(), b.grad.clone())
    x.grad = w.grad = b.grad = None
    STORE.enabled = True
    try:
        y = linear(x, w, b)
        with STORE.collecting((0, 0)):
            y.backward(g)
        assert w.grad is None                      # B ran: input and bias gradients only
        torch.testing.assert_close(x.grad, ref[0])
        torch.testing.assert_close(b.grad, ref[2])
        assert STORE.flush((0, 0)) == 1            # W
        torch.testing.assert_close(w.grad, ref[1])
        assert STORE.flush((0, 0)) == 0 and not STORE.pending
    finally:
        STORE.enabled = False


def test_without_a_collecting_backward_nothing_is_deferred():
    STORE.enabled = True
    try:
        w = torch.randn(3, 4, requires_grad=True)
        linear(torch.randn(2, 4), w).sum().backward()
        assert w.grad is not None and not STORE.pending
    finally:
        STORE.enabled = False
