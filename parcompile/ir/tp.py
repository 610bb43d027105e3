"""Tensor-parallel layouts (:class:`TpRule`): where tensor parallelism splits an op of each
``tp`` style, read by the ``shard-tensor-parallel`` pass
(:mod:`parcompile.passes.shard_tensor_parallel`). An op's attribute ``tp`` names its style
(:mod:`parcompile.ir.lower` sets it). A style of one op kind (Megatron-LM's column- and
row-parallel linear layers, the vocab-parallel embedding and loss, qk-norm's per-head
weight, MLA's) is in that kind's definition (``OpSpec.tp_styles``, :mod:`parcompile.ir.ops`);
the styles many kinds share (``shard_last``, ``residual``, ``replicated``) are here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from parcompile.ir.types import TensorType

@dataclass(frozen=True)
class TpRule:
    """Where tensor parallelism splits an op. Dim names, or None for replicated.

    ``out_split``: dim of the output split over tp; ``out_partial``: output holds partial
    sums over tp; ``in_split``: per operand, the dim it must arrive split on;
    ``grad_partial``: per operand, whether the gradient the op returns for it is a partial
    sum over tp (column-parallel inputs); ``param_split``: param suffix -> dim.
    """

    out_split: str | None = None
    out_partial: bool = False
    in_split: tuple[str | None, ...] = ()
    grad_partial: tuple[bool, ...] = ()
    param_split: Mapping[str, str | None] = field(default_factory=dict)
    #: param suffixes whose gradient is a partial sum over tp although the param is
    #: replicated (a weight shared by the heads tp splits: qk-norm)
    param_grad_partial: tuple[str, ...] = ()


def _shard_last(attrs, in_types, out, sequence_parallel) -> TpRule:
    """Every tensor split on its last dim; attention sinks (gpt-oss) with the heads."""
    n = len(in_types)
    # attention sinks (gpt-oss): one logit per query head, split with the heads
    return TpRule(out_split=out.dims[-1].name, in_split=tuple(t.dims[-1].name for t in in_types),
                  grad_partial=(False,) * n, param_split={"sinks": "heads"} if attrs.get("sinks") else {})


def _residual(attrs, in_types, out, sequence_parallel) -> TpRule:
    """Replicated, or split on ``seq`` with sequence parallelism."""
    n = len(in_types)
    if sequence_parallel:
        return TpRule(out_split="seq", in_split=("seq",) * n, grad_partial=(False,) * n,
                      param_split={"weight": None, "bias": None})
    return TpRule(in_split=(None,) * n, grad_partial=(False,) * n)


def _replicated(attrs, in_types, out, sequence_parallel) -> TpRule:
    """Nothing changes."""
    n = len(in_types)
    return TpRule(in_split=(None,) * n, grad_partial=(False,) * n)


#: the styles many op kinds share
_SHARED = {"shard_last": _shard_last, "residual": _residual, "replicated": _replicated}


def tp_rule(style: str, attrs: Mapping[str, Any], in_types: Sequence[TensorType], out: TensorType,
            sequence_parallel: bool, own: Mapping[str, Callable[..., TpRule]] | None = None) -> TpRule:
    """The Megatron-LM layout of an op under tensor parallelism, by its ``tp`` style: one of
    the op kind's own styles (``own``: its definition's ``OpSpec.tp_styles``, in
    :mod:`parcompile.ir.ops`: ``column`` and ``row`` of a linear layer, ``vocab_embedding``,
    ``vocab_loss``, qk-norm's ``per_head``, MLA's ``mla_key``, ``mla_absorb`` and
    ``latent_core``), else a style many kinds share:

    * ``shard_last`` (rope, attention core, activations): every tensor split on its last
      dim (heads or ffn), no communication.
    * ``residual`` (norms, residual adds): replicated, or split on ``seq`` with sequence
      parallelism.
    * ``replicated``: nothing changes.

    Raises:
        ValueError: a style neither the kind nor this module defines.
    """
    rule = (own or {}).get(style) or _SHARED.get(style)
    if rule is None:
        raise ValueError(f"unknown tensor-parallel style {style!r}")
    return rule(attrs, in_types, out, sequence_parallel)


__all__ = ["TpRule", "tp_rule"]
