"""The op kinds: each kind is one definition (:class:`OpSpec`) in one module of this package,
holding everything the compiler knows of it: its output type rule, FLOPs, bytes saved for
backward, traffic, serve scratch, the collectives it runs inside itself, its program row
(:class:`Code`), its traits (:class:`Trait`, asked with :func:`has_trait` instead of lists
of kind names) and the attributes that may differ from one decoder layer to the next
(``OpSpec.per_layer``). The attention core's kernel, per engine, is one decision
(:func:`parcompile.ir.ops.attention.attention_kernel_for`). The tensor-parallel layout of
each ``tp`` style is its definition's (``OpSpec.tp_styles``) or one of the shared styles of
:mod:`parcompile.ir.tp`.

Modules: :mod:`~parcompile.ir.ops.base` (the records, :class:`OpSpec`, :class:`Trait`),
:mod:`~parcompile.ir.ops.dense` (input, embedding, add, norm, linear, rope, qk_norm, the
activations, softcap, cross_entropy), :mod:`~parcompile.ir.ops.attention`,
:mod:`~parcompile.ir.ops.mla` (multi-head latent attention's parts),
:mod:`~parcompile.ir.ops.moe` (router, dispatch, experts, combine) and
:mod:`~parcompile.ir.ops.comm` (conversions, stage transfers, step collectives: what the
passes insert). A new kind is one ``OpSpec`` appended to a module's ``DEFINITIONS``.

Every rule works on *types*: global types for inference, local (per-rank) types for
cost. FLOPs count matmuls only (SPEC 3: model FLOPs are matmul FLOPs): a linear layer
``(..., k) -> (..., n)`` costs ``2 * m * n * k`` forward, attention ``4 * b * s * s_kv * d``
for ``Q K^T`` and ``A V`` (no causal halving). Backward costs twice forward (the
convention of Narayanan et al. 2021 and Korthikanti et al. 2022).

Bytes saved for backward follow Korthikanti et al. (2022), "Reducing Activation
Recomputation in Large Transformer Models", section 4: each op names which operands it
keeps (``saves``; a tensor kept by several ops is counted once), whether it keeps its own
output (``saves_output``: the fused attention kernel), plus the internal tensors it keeps
(``saved_extra``: softmax output, dropout masks, log-sum-exp). For a GPT layer
(layernorm, gelu, dropout, MHA, ffn 4h, unfused attention, 16-bit) this gives Table 2 of
the paper exactly, per layer: layer norms ``4sbh`` (their inputs), attention ``11sbh +
5as^2b`` (QKV input 2sbh, Q K V 6sbh, softmax 2as^2b, its dropout mask as^2b and output
2as^2b, projection input 2sbh, residual dropout mask sbh), MLP ``19sbh`` (fc1 input 2sbh,
gelu input 8sbh, fc2 input 8sbh, dropout mask sbh); tensor parallelism divides the
split tensors by t (``10 + 24/t``), sequence parallelism the rest (the analysis keeps the
sequence-split input of a column-parallel layer, as Megatron-LM does, and all-gathers it
again in backward).

``traffic`` is the bytes the op's non-matmul kernels read and write in the forward
(layer norms, activations, softmax, dropout, residual adds, the loss): what bounds those
kernels is memory bandwidth, not FLOPs. The cost model prices it at the GPU's memory
bandwidth; GEMM operands are not counted (their time is their FLOPs).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from parcompile.ir.ops import attention, comm, dense, mla, moe
from parcompile.ir.ops.base import COMM_KINDS, INDEX_BYTES, Code, Collective, Op, OpSpec, Param, Trait
from parcompile.ir.ops.comm import convert, dual
from parcompile.ir.ops.moe import COUNTS_BYTES, experts_keywords, moe_collectives, router_keywords
from parcompile.ir.types import TensorType


def _table(*modules) -> dict[str, OpSpec]:
    """The definitions of ``modules`` by kind; a kind defined twice is an error."""
    table: dict[str, OpSpec] = {}
    for m in modules:
        for s in m.DEFINITIONS:
            if s.kind in table:
                raise ValueError(f"op kind {s.kind!r} is defined twice (in {m.__name__} and before it)")
            table[s.kind] = s
    return table


#: every op kind's definition, by kind
OPS: dict[str, OpSpec] = _table(dense, attention, mla, moe, comm)


def spec(kind: str) -> OpSpec:
    """The definition of ``kind``; KeyError names the kind."""
    try:
        return OPS[kind]
    except KeyError:
        raise KeyError(f"unknown op kind {kind!r}") from None


def has_trait(kind: str, trait: Trait) -> bool:
    """Whether op kind ``kind`` declares ``trait``; KeyError names an unknown kind."""
    return trait in spec(kind).traits


def kinds_with(trait: Trait) -> frozenset[str]:
    """Every op kind that declares ``trait``."""
    return frozenset(k for k, s in OPS.items() if trait in s.traits)


def code_of(kind: str, attrs: Mapping[str, Any]) -> Code | None:
    """The :class:`Code` row of an op of ``kind`` with ``attrs`` (a row may depend on the
    op's tensor-parallel style or attributes); None: the kind runs outside generated classes.

    Raises:
        KeyError: unknown kind.
        ValueError: a conversion with no runtime call (``redistribute``'s row).
    """
    code = spec(kind).code
    return code(attrs) if callable(code) else code


def op_collectives(node, degrees: Mapping[str, int], local_in: Sequence[TensorType],
                   local_out: TensorType) -> list[Collective]:
    """The collectives one op runs (see :class:`Collective`), by its kind's definition
    (``OpSpec.collectives``); ``node`` is a graph Node."""
    return spec(node.op.kind).collectives(node, degrees, local_in, local_out)


__all__ = ["COMM_KINDS", "COUNTS_BYTES", "INDEX_BYTES", "OPS", "Code", "Collective", "Op", "OpSpec", "Param", "Trait",
           "code_of", "convert", "dual", "experts_keywords", "has_trait", "kinds_with", "moe_collectives",
           "op_collectives", "router_keywords", "spec"]
