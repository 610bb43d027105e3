"""Context parallelism: the sequence split over the `cp` group, with causal load balancing.

The sequence is cut into ``2 cp`` equal chunks; cp rank ``i`` holds chunks ``i`` and
``2 cp - 1 - i`` (Megatron-Core's and Llama 3's load balancing: every rank then has the
same share of the causal attention's work). Attention all-gathers keys and values over
the cp group (Llama 3 training's choice), only the kv heads, never repeated for GQA; the
backward reduce-scatters their gradients. Each rank computes the loss of its own tokens;
gradients are averaged over dp x cp.

With sequence parallelism as well (Megatron-Core's SP x CP), a cp rank's T / cp tokens
(its two chunks, in this order) are split again, contiguously, over tp outside the tensor-
parallel regions: the embedding reduce-scatters them to T / (cp * tp) per rank, the
column-parallel regions all-gather them back to T / cp, so attention, RoPE and the loss
always see this rank's :func:`chunk_positions`, and learned positions are sliced to the tp
rank's part of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parcompile.runtime.distributed.comm import gather_along
from parcompile.runtime.distributed.context import Axis


@dataclass
class Positions:
    """Where a rank's tokens sit in the sequence, for attention.

    ``rope``: (cos, sin) tables at those positions, or None without RoPE; ``q``/``k``: the
    positions of the queries and of the (gathered) keys, or None when they are simply
    0..T-1 (no context parallelism).
    """

    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None


def chunk_positions(seq_len: int, index: int, size: int) -> torch.Tensor:
    """Global positions (T / cp,) held by cp rank ``index`` of ``size``: chunks i and 2cp-1-i."""
    if size == 1:
        return torch.arange(seq_len)
    c = seq_len // (2 * size)
    first = torch.arange(index * c, (index + 1) * c)
    second = torch.arange((2 * size - 1 - index) * c, (2 * size - index) * c)
    return torch.cat([first, second])


def gathered_positions(seq_len: int, size: int) -> torch.Tensor:
    """Positions of the keys after the all-gather (rank order): (T,)."""
    return torch.cat([chunk_positions(seq_len, i, size) for i in range(size)])


def split_microbatch(tokens: torch.Tensor, cp: Axis, targets: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (b, T / cp) of this cp rank from a micro-batch of tokens
    (b, T + 1); ``targets`` (b, T), with -100 where the loss is masked, default
    ``tokens[:, 1:]``."""
    x, y = tokens[:, :-1], (tokens[:, 1:] if targets is None else targets)
    if cp.size == 1:
        return x, y
    pos = chunk_positions(x.shape[1], cp.index, cp.size)
    return x[:, pos], y[:, pos]


def gather_kv(x: torch.Tensor, cp: Axis) -> torch.Tensor:
    """Keys or values (B, Hkv, T / cp, D) of every cp rank -> (B, Hkv, T, D), in cp rank
    order; backward: reduce-scatter."""
    return gather_along(x, cp, 2)
