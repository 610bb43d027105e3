"""The records of the IR's ops (:class:`Param`, :class:`Op`, :class:`Collective`), how a
generated program runs an op (:class:`Code`), the definition of one op kind
(:class:`OpSpec`) and its traits (:class:`Trait`). The kinds themselves are defined in the
package's other modules, one definition each (:mod:`parcompile.ir.ops`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from parcompile.ir.types import Sharding, TensorType

#: the collectives a conversion or an op may run (:func:`parcompile.ir.ops.comm.convert`'s
#: kinds that move data; ``split`` is local)
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

#: bytes of an int64 token / row index (the router's choices, the dispatch's rows)
INDEX_BYTES = 8

# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Param:
    """A trainable parameter held by an op.

    ``type`` is the global type as stored (vocabulary padded); ``logical_numel`` the count
    the model function has (unpadded; None: ``type.numel``). ``tied_to`` names the
    parameter this one is a synchronised copy of (the LM head of a tied model on the last
    pipeline stage). ``expert`` marks MoE expert weights (reduced over ``expert_dp``).
    """

    name: str
    type: TensorType
    sharding: Sharding = Sharding()
    logical_numel: int | None = None
    tied_to: str | None = None
    expert: bool = False
    #: mesh axes over which the gradient is a partial sum though the value is replicated
    #: (a qk-norm weight under tp: each rank sums it over its own heads); set by the
    #: tensor-parallel pass from :attr:`parcompile.ir.tp.TpRule.param_grad_partial`
    grad_partial: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        """The unpadded (model) element count."""
        return self.type.numel if self.logical_numel is None else self.logical_numel


@dataclass(frozen=True)
class Op:
    """An operation: a stable hierarchical ``name`` (``layers.3.attn.wq``), a ``kind`` of
    the table below, hashable ``attrs`` (sorted key/value pairs), the decoder ``layer`` it
    belongs to (None outside layers) and the spec ``origin`` (a Span) that caused it."""

    name: str
    kind: str
    attrs: tuple[tuple[str, Any], ...] = ()
    layer: int | None = None
    origin: Any = None

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def attr_map(self) -> dict[str, Any]:
        return dict(self.attrs)

    @property
    def module(self) -> str:
        """The module the op belongs to: ``layers.3.attn`` for ``layers.3.attn.wq``,
        ``layers.3.attn_norm`` for itself, ``embedding`` for ``embedding.pos_add``."""
        parts = self.name.split(".")
        if parts[0] == "layers" and len(parts) >= 3:
            return ".".join(parts[:3])
        return parts[0]


@dataclass(frozen=True)
class Collective:
    """One collective an op runs per micro-batch (``per = "microbatch"``) or per step.

    ``bytes`` is the size of the tensor the collective produces on one rank (the gathered
    output for an all-gather, the shard for a reduce-scatter). ``phase`` is
    ``forward``, ``backward`` or ``step``. ``stage`` overrides the op's stage (a
    send/recv pair runs on two stages).
    """

    op: str
    axis: str
    bytes: int
    phase: str
    where: str
    per: str = "microbatch"
    stage: int | None = None
    #: > 0: the size depends on the router's choices (MoE token dispatch); ``bytes`` is the
    #: balanced estimate and ``bytes_per_row`` the bytes of one routed token (h * e)
    bytes_per_row: int = 0
    #: runs per step of a ``per = "step"`` collective (ZeRO-3 regathers a layer bucket 2 m times)
    count: int = 1
    #: a tensor-parallel all-gather's or reduce-scatter's GEMMs (the linears it feeds or
    #: drains): their forward FLOPs on one rank, ``(FP8-eligible, other)``, what it overlaps
    #: under ``cluster.tp_comm_overlap`` (:func:`parcompile.analysis.comm.comm_report` sets
    #: it; :func:`parcompile.analysis.estimate.chunk_times` reads it)
    gemm_flops: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class Code:
    """How a generated program runs one op of this kind: what codegen writes for it
    (:mod:`parcompile.codegen.blocks`), with no code of its own per kind.

    ``build`` is the constructor expression of the module the op's class builds in its
    ``__init__`` as ``self.<attr> = <build>`` (``<attr>``: the op's name in its module,
    ``w1``), or None (a plain function). Its fields are the op's facts, read off the
    sharded graph: ``{name}`` the parameter prefix (``f"layers.{i}.mlp.w1"``),
    ``{in_features}``/``{out_features}`` the global sizes of ``in_dim``/``out_dim`` (as the
    program's constants), ``{dim}`` the global size of the output's last dim, ``{bias}``,
    ``{local}`` the per-rank shape of the op's first parameter (the runtime checks it
    against the shard it makes), ``{reduce}`` the collective of the conversion after the
    op that it runs itself (``fold_after``), ``{a[key]}`` an op attribute, ``{fp8}`` the
    keyword of an FP8 GEMM's recipe (``, fp8="tensorwise"``; empty for a 16-bit one:
    ``OpData.fp8``), ``{param}`` the first parameter's name (quoted), ``{attr}`` the
    module's attribute, ``{scatter}`` whether the conversion it runs after it
    reduce-scatters (sequence parallelism). A row may also read the graph facts
    :func:`parcompile.codegen.blocks.program_attrs` adds to the attributes (``_gathers``,
    ``_seq_split``, ``_split_dim``, ``_tied_to``, ``_tied_by``, ``_out_local``,
    ``_axes``, ``_bias``; ``_each_layer``: each merged layer's own attributes where some differ
    between them), ``{op}`` the op's own name (``f"layers.{i}.mlp.experts"``),
    ``{top_k}`` the program's constant for a router's top-k.

    ``call`` is the forward expression: ``{self}`` the built module (``self.w1``), ``{0}``,
    ``{1}``, ... (and ``{x}``: ``{0}``) the operands, ``{a[key]}`` an attribute;
    ``serve_call`` the serving program's (None: the same; its operands ``pos``: the step's
    :class:`~parcompile.runtime.serve.generate.LayerStep`, the cache and the RoPE tables at the
    tokens' positions). ``serve_init``: the serving program's ``init`` (None: the same).
    ``comment`` says what it does.
    ``inline``: its value may be written inside its consumer's expression (False: a
    statement of its own, where the shape comment goes). ``operands``: names for the
    variables holding its operands (``gate``, ``up``). ``var``: the name of its own value.
    ``init``: lines its class's ``__init__`` needs once (``self.drop = nn.Dropout(DROPOUT)``;
    ``{t[key]}``: the program's per-layer expression of a fact that is no attribute,
    ``LAYER_FP8[i]``). An attribute its kind declares per-layer (``OpSpec.per_layer``) that
    differs between layers is written ``self.<attribute>``, set from the program's table
    (codegen/blocks.py ``LayerValue``): a row writes ``{a[key]!r}`` and never decides on it.
    ``var = ""``: its value keeps its operand's name (``q = rt.apply_rope(q, ...)``).
    ``fold_after``: the op runs the conversion after it itself (a row-parallel linear's
    reduction, before its bias). ``keep_split``: the op may run inside the
    ``keep_split_input`` block of a sequence-parallel conversion marked ``regather``.

    ``module``/``args`` (per-head ops of the attention: qk-norm) name the runtime class and
    the attributes passed by keyword; codegen writes ``rt.<module>(name, <arg>=..., seed=SEED,
    tp=tp)`` for them.
    """

    module: str | None = None
    args: tuple[str, ...] = ()
    call: str = "{self}({x})"
    serve_call: str | None = None
    comment: str = ""
    build: str | None = None
    inline: bool = True
    operands: tuple[str, ...] = ()
    var: str = "h"
    init: tuple[str, ...] = ()
    fold_after: bool = False
    keep_split: bool = False
    #: the op transforms one per-head tensor (q, k or v) between the projections and the core
    per_head: bool = False
    #: its operands are per-head (B, T, heads, head_dim) tensors: a flat projection output
    #: feeding it is unflattened by its head size (the dim's unit); ``heads_out``: so is its value
    heads_in: bool = False
    heads_out: bool = False
    #: more format fields from the op's attributes (and ``_gathers``: the axes it all-gathers
    #: operands over itself, from its collectives; ``_out_local``: its output's per-rank
    #: shape; ``_axes``: every axis its collectives cross; ``_bias``: it has a bias
    #: parameter), ``init`` lines and comment ``notes`` of its own
    facts: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    serve_init: tuple[str, ...] | None = None


class Trait(enum.Enum):
    """What an op kind is, declared on its definition (:attr:`OpSpec.traits`) and asked of a
    kind with :func:`parcompile.ir.ops.has_trait` instead of a list of kind names (the
    op-definition traits of xDSL, xdslproject/xdsl ``xdsl/irdl/operations.py``
    ``traits_def``, and MLIR's ``OpTrait``)."""

    #: a matmul whose operands and weight the time model's GEMM roofline reads
    #: (:func:`parcompile.analysis.compute.gemm_bytes`); the attention core is its own kernel
    GEMM = "gemm"
    #: a GEMM that runs in FP8 under an FP8 recipe (inside a decoder layer:
    #: :func:`parcompile.ir.fp8.is_fp8_gemm`)
    FP8_GEMM = "fp8_gemm"
    #: the serve program passes its operand, when it is the only reader, as a temporary of
    #: one expression or rebinds it (``q = rope(q)``): the operand dies with it
    #: (:func:`parcompile.analysis.serve_memory.serve_workspace`); any other reader runs inside a
    #: module's ``forward`` that holds its operands until it returns
    EXPRESSION = "expression"
    #: not one op of a micro-batch's forward (the inputs, the pipeline's transfers, the step's
    #: collectives): no ``cluster.op_overhead``, no FLOPs, no row in a decoder layer's class
    NOT_AN_OP = "not_an_op"
    #: rotary position embedding at the tokens' positions: the program needs the RoPE tables
    ROTARY = "rotary"
    #: a change of layout between two ops (:func:`parcompile.ir.ops.comm.convert`'s
    #: collectives), inserted by the ``insert-collectives`` pass
    CONVERSION = "conversion"
    #: a pipeline stage boundary (send / recv between stages)
    STAGE_TRANSFER = "stage_transfer"
    #: a collective of the step, outside the micro-batches (gradient reduction, ZeRO's gathers)
    STEP_COLLECTIVE = "step_collective"
    #: the attention core (its kernel: :func:`parcompile.ir.ops.attention.attention_kernel_for`)
    ATTENTION = "attention"
    #: the token embedding (and GPT-2's learned position embedding)
    EMBEDDING = "embedding"
    #: the loss over the logits
    LOSS = "loss"


@dataclass(frozen=True)
class OpSpec:
    """The definition of one op kind: its output type rule (``infer``), its cost (FLOPs,
    bytes saved for backward, traffic, serve scratch: the cost rules of
    :mod:`parcompile.ir.ops`' docstring), the collectives it runs inside itself, its program
    row, its traits and the attributes that may differ from layer to layer. Each kind is
    one ``OpSpec`` in the ``DEFINITIONS`` of one module of :mod:`parcompile.ir.ops`."""

    kind: str
    infer: Callable[[Mapping[str, Any], Sequence[TensorType]], TensorType]
    fwd_flops: Callable[[Mapping[str, Any], Sequence[TensorType], TensorType], int] = lambda a, i, o: 0
    saves: Callable[[Mapping[str, Any]], tuple[int, ...]] = lambda a: ()
    saved_extra: Callable[[Mapping[str, Any], Sequence[TensorType], TensorType], int] = lambda a, i, o: 0
    #: bytes the op keeps in copies of its operands all-gathered inside it (context-parallel
    #: k and v, expert_tp rows), beyond the local operands: ``(attrs, local inputs,
    #: degrees)``; kept under selective recomputation too (the checkpoint holds them)
    saved_gathered: Callable[[Mapping[str, Any], Sequence[TensorType], Mapping[str, int]], int] = \
        lambda a, i, d: 0
    #: number of operands (None: any)
    arity: int | None = None
    #: selective recomputation drops ``saved_extra`` and recomputes this op's forward
    selective_recompute: bool = False
    #: the op keeps its own output for backward (counted once with its consumers' saves)
    saves_output: Callable[[Mapping[str, Any]], bool] = lambda a: False
    #: bytes read + written by the op's non-matmul kernels in the forward (module docstring)
    traffic: Callable[[Mapping[str, Any], Sequence[TensorType], TensorType], int] = lambda a, i, o: 0
    #: how a generated program runs it (:class:`Code`, or a function of the attributes
    #: giving one: :func:`parcompile.ir.ops.code_of`); None: outside decoder layers (the
    #: templates' skeleton: the loss)
    code: Code | Callable[[Mapping[str, Any]], Code] | None = None
    #: bytes of the temporaries the op holds beside its operands and its output while its
    #: forward runs in the serve program (no autograd), at local types; an attention core's
    #: ``seq_len`` is the keys it attends (:func:`parcompile.analysis.serve_memory.serve_workspace`)
    scratch: Callable[[Mapping[str, Any], Sequence[TensorType], TensorType], int] = lambda a, i, o: 0
    #: the attributes whose value may differ from one decoder layer to the next (a sliding
    #: window, a score scale, a RoPE base). Codegen writes one class for many layers: each of
    #: these that differs becomes a per-layer table the class reads; any other attribute
    #: that differs is an internal error (:func:`parcompile.codegen.program_data.layer_tables`)
    per_layer: tuple[str, ...] = ()
    #: what the kind is (:class:`Trait`), asked with :func:`parcompile.ir.ops.has_trait`
    traits: frozenset[Trait] = frozenset()
    #: the collectives one op of the kind runs inside itself (:class:`Collective`):
    #: ``(node, degrees, local inputs, local output)``, ``node`` a graph Node
    collectives: Callable[[Any, Mapping[str, int], Sequence[TensorType], TensorType], list[Collective]] = \
        lambda node, d, i, o: []
    #: the kernel an op of the kind runs, by engine (``(attrs, engine)``): the one decision the
    #: cost model, the programs and the exports read (the attention core's
    #: :func:`parcompile.ir.ops.attention.attention_kernel_for`); None: one kernel everywhere
    kernel: Callable[[Mapping[str, Any], str | None], Any] | None = None
    #: the tensor-parallel styles of the kind's own (``attrs["tp"]`` names one): style ->
    #: ``(attrs, in_types, out, sequence_parallel) -> TpRule``; the styles many kinds share
    #: are :func:`parcompile.ir.tp.tp_rule`'s
    tp_styles: Mapping[str, Callable[..., Any]] = field(default_factory=dict)


def same_type(a, ins):
    """The output type rule of an op whose output has its first operand's type."""
    return ins[0]


def elementwise_traffic(a, ins, out):
    """Read every operand, write the output (plus a 1-byte mask with dropout)."""
    mask = out.numel if a.get("dropout", 0) > 0 else 0
    return sum(t.nbytes for t in ins) + out.nbytes + mask


def copy_traffic(a, ins, out):
    """Bytes of a copy: read the first operand, write the output."""
    return ins[0].nbytes + out.nbytes


def linear_flops(a, ins, out):
    """Forward FLOPs of a matmul ``(..., k) -> (..., n)``: ``2 m n k``."""
    # 2 * (elements of the output) * (contracted dim): 2 m n k
    return 2 * out.numel * ins[0].dims[-1].size


def heads_facts(a) -> dict:
    """``{heads}``: the heads this rank holds, read off the op's local output (``_out_local``,
    the sharded graph's) by its per-head width (MLA's absorbed serving ops and core, which
    the runtime checks against the weights)."""
    unit = (a.get("latent_dim") or a["out_dim"]).unit
    return {"heads": a["_out_local"][-1] // unit}


#: rows that run one op on each per-head tensor (q, k or v) between the projections and the core
PER_HEAD = dict(per_head=True, inline=False, var="", heads_in=True, heads_out=True)
