"""Tensor-parallel styles: where tensor parallelism splits an op of each ``tp`` style
(Megatron-LM's column- and row-parallel layers, the vocab-parallel embedding and loss, the
per-head and MLA styles), read by the ``shard-tensor-parallel`` pass
(:mod:`parcompile.passes.shard_tensor_parallel`). An op's attribute ``tp`` names its style
(:mod:`parcompile.ir.lower` sets it); the op table (:mod:`parcompile.ir.ops`) keeps the rest
of what an op kind is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

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


def tp_rule(style: str, attrs: Mapping[str, Any], in_types: Sequence[TensorType], out: TensorType,
            sequence_parallel: bool) -> TpRule:
    """The Megatron-LM layout of an op under tensor parallelism, by its ``tp`` style.

    * ``column`` (wq, wk, wv, w1, w3, lm_head): input replicated, its gradient partial;
      output and weight split on the out dim.
    * ``row`` (wo, w2): input split on the in dim; output ``partial(tp)``; bias replicated.
    * ``vocab_embedding``: weight split on vocab; output ``partial(tp)``.
    * ``shard_last`` (rope, attention core, activations): every tensor split on its last
      dim (heads or ffn), no communication.
    * ``mla_key`` (MLA's keys): the per-head part split on its heads, the shared RoPE key
      replicated with its gradient partial over tp.
    * ``mla_absorb``, ``latent_core`` (MLA's absorbed serving form): the heads split, wkv_b's
      rows with them; the latent and the RoPE key replicated.
    * ``per_head`` (qk-norm): ``shard_last`` with a weight shared by every head, so
      replicated, and its gradient (summed over this rank's heads) a partial sum over tp,
      all-reduced with the step (Megatron-Core all-reduces ``q_layernorm`` and
      ``k_layernorm`` gradients over tp in ``finalize_model_grads``).
    * ``residual`` (norms, residual adds): replicated, or split on ``seq`` with sequence
      parallelism.
    * ``vocab_loss``: logits arrive split on vocab (vocab-parallel cross-entropy).
    * ``replicated``: nothing changes.
    """
    n = len(in_types)
    if style == "column":
        od = attrs["out_dim"].name
        return TpRule(out_split=od, in_split=(None,), grad_partial=(True,),
                      param_split={"weight": od, "bias": od})
    if style == "row":
        idim = attrs["in_dim"].name
        return TpRule(out_partial=True, in_split=(idim,), grad_partial=(False,),
                      param_split={"weight": idim, "bias": None})
    if style == "vocab_embedding":
        return TpRule(out_partial=True, in_split=(None,), grad_partial=(False,),
                      param_split={"weight": "vocab"})
    if style == "shard_last":
        # attention sinks (gpt-oss): one logit per query head, split with the heads
        return TpRule(out_split=out.dims[-1].name, in_split=tuple(t.dims[-1].name for t in in_types),
                      grad_partial=(False,) * n, param_split={"sinks": "heads"} if attrs.get("sinks") else {})
    if style == "mla_key":
        # MLA's per-head keys: k_nope split with the heads, the RoPE key shared by all of them
        # (replicated, so its gradient, summed over this rank's heads, is a partial sum)
        return TpRule(out_split=out.dims[-1].name, in_split=(in_types[0].dims[-1].name, None),
                      grad_partial=(False, True))
    if style == "mla_absorb":
        # MLA's absorbed query: this rank's heads of q in, of [q_nope W_uk, q_rope] out, with
        # their rows of wkv_b (split by heads like the column-parallel wkv_b of training)
        return TpRule(out_split=attrs["latent_dim"].name, in_split=(attrs["q_dim"].name,), grad_partial=(False,),
                      param_split={"weight": attrs["out_dim"].name})
    if style == "latent_core":
        # MLA's absorbed core: the queries split with their heads, the latent and the RoPE key
        # (one "kv head" shared by all) replicated
        return TpRule(out_split=out.dims[-1].name, in_split=(in_types[0].dims[-1].name, None, None),
                      grad_partial=(False, True, True))
    if style == "per_head":
        return TpRule(out_split=out.dims[-1].name, in_split=tuple(t.dims[-1].name for t in in_types),
                      grad_partial=(False,) * n, param_split={"weight": None}, param_grad_partial=("weight",))
    if style == "residual":
        if sequence_parallel:
            return TpRule(out_split="seq", in_split=("seq",) * n, grad_partial=(False,) * n,
                          param_split={"weight": None, "bias": None})
        return TpRule(in_split=(None,) * n, grad_partial=(False,) * n)
    if style == "vocab_loss":
        return TpRule(in_split=("vocab", None), grad_partial=(False, False))
    if style == "replicated":
        return TpRule(in_split=(None,) * n, grad_partial=(False,) * n)
    raise ValueError(f"unknown tensor-parallel style {style!r}")


__all__ = ["TpRule", "tp_rule"]
