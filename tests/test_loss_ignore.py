"""Per-token cross-entropy with ignored targets (-100): the tp = 1 fast path and the
vocab-parallel path (tp = 2 over gloo) both equal ``F.cross_entropy(ignore_index=-100,
reduction="none")``, losses and gradients, with padded vocabulary columns kept out."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from parcompile.runtime.distributed.context import Axis
from parcompile.runtime.model.layers import IGNORE_INDEX, vocab_parallel_cross_entropy

ONE = Axis("tp", [0], 0)
VOCAB, PADDED, N = 13, 16, 12


def _case(dtype=torch.float32, seed=0):
    """Global logits (N, PADDED) (padded columns random: they must not matter), targets
    with a few ignored, a random upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(N, PADDED, generator=g)).to(dtype)
    target = torch.randint(0, VOCAB, (N,), generator=g)
    target[[1, 4, 5, 11]] = IGNORE_INDEX
    grad = torch.randn(N, generator=g)
    return logits, target, grad


def _reference(logits, target, grad):
    x = logits[:, :VOCAB].float().detach().requires_grad_()
    loss = F.cross_entropy(x, target, ignore_index=-100, reduction="none")
    loss.backward(grad)
    full = torch.zeros(logits.shape)
    full[:, :VOCAB] = x.grad
    return loss.detach(), full


@pytest.mark.parametrize("padded", [PADDED, VOCAB])
def test_one_rank_equals_torch_with_ignored_targets(padded):
    logits, target, grad = _case()
    logits = logits[:, :padded].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, target, ONE, VOCAB)
    assert loss.shape == (N,)
    ref_loss, ref_grad = _reference(logits, target, grad)
    torch.testing.assert_close(loss, ref_loss)
    loss.backward(grad)
    torch.testing.assert_close(logits.grad, ref_grad[:, :padded])
    ignored = target == IGNORE_INDEX
    assert torch.all(loss[ignored] == 0) and torch.all(logits.grad[ignored] == 0)
    assert torch.all(logits.grad[:, VOCAB:] == 0)      # padded columns get no gradient


def test_one_rank_bf16_logits_are_computed_in_fp32():
    logits, target, grad = _case(torch.bfloat16)
    logits.requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, target, ONE, VOCAB)
    assert loss.dtype == torch.float32
    ref_loss, ref_grad = _reference(logits, target, grad)
    torch.testing.assert_close(loss, ref_loss)
    loss.backward(grad)
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), ref_grad, atol=1e-2, rtol=1e-2)
    assert torch.all(logits.grad[target == IGNORE_INDEX] == 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        tp = Axis("tp", list(range(world)), rank, dist.group.WORLD)
        for dtype in (torch.float32, torch.bfloat16):
            logits, target, grad = _case(dtype, seed=1)
            cols = PADDED // world
            local = logits[:, rank * cols:(rank + 1) * cols].clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(local, target, tp, VOCAB)
            ref_loss, ref_grad = _reference(logits, target, grad)
            torch.testing.assert_close(loss, ref_loss)
            loss.backward(grad)
            tol = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
            torch.testing.assert_close(local.grad.float(), ref_grad[:, rank * cols:(rank + 1) * cols], **tol)
            ignored = target == IGNORE_INDEX
            assert torch.all(loss[ignored] == 0) and torch.all(local.grad[ignored] == 0)
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_tp2_equals_torch_with_ignored_targets():
    mp.spawn(_tp_worker, args=(2, _free_port()), nprocs=2, join=True)
