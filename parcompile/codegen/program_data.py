"""The sharded graph as plain data per pipeline stage: what the program templates format.

After the passes, every op of the graph has its global type, its layout (``Sharding``)
and its pipeline stage and chunk, and ``insert-collectives`` has put a ``redistribute``
op on every edge whose layouts differ (named by the plan: ``layers.3.attn.all_gather``).
:func:`program_data` reads that graph and nothing else:

* per stage, per decoder layer in model order, the layer's ops in graph order
  (:class:`OpData`): kind, module, local shape with its dim symbols, layout, and the
  collectives it runs (a conversion's forward and backward collectives by the plan's
  name for it; the ones an op runs inside itself: vocab-parallel cross-entropy, the
  context-parallel gather of K and V, the MoE token all-to-alls);
* the local sizes the program's shape comments and constructors show
  (:class:`LocalSizes`), each read off one op's local type;
* what differs between the layers one generated class serves (:func:`layer_tables`): the
  attributes their op kinds declare per-layer (``OpSpec.per_layer``), as per-layer tables
  (:class:`LayerTable`); any other difference is an internal error
  (:class:`LayerAttributeError`), never a layer computed with another layer's value.

No degree arithmetic happens here: a local size is ``Sharding.local_type`` of the op
the number describes (:mod:`parcompile.ir.types`), and which collectives run is
``op_collectives`` (:mod:`parcompile.ir.ops`), the rule the plan's ``comm`` uses too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from parcompile.ir.fp8 import fp8_kind, is_fp8_gemm
from parcompile.ir.graph import Graph, Node
from parcompile.ir.ops import Trait, has_trait, op_collectives, spec
from parcompile.ir.types import TensorType, split_axes

#: the symbol a shape comment shows for each dim of the graph (``ir/lower.py``'s names)
SYMBOLS = {"batch": "B", "seq": "T", "hidden": "h", "q": "q", "kv": "kv", "ffn": "f", "vocab": "V'",
           "experts": "E", "topk": "k", "expert_ffn": "fe", "shared_ffn": "fs", "position": "P"}


@dataclass(frozen=True)
class CollectiveCall:
    """One collective an op runs per micro-batch: ``op`` over ``axis`` in ``phase``
    (forward or backward), the plan's ``where`` and the name of the op running it
    (``layers.3.attn.all_gather`` for a conversion insert-collectives placed)."""

    name: str
    op: str
    axis: str
    phase: str
    where: str

    def describe(self) -> str:
        """``backward all_reduce(tp)``."""
        return f"{self.phase} {self.op}({self.axis})"


@dataclass(frozen=True)
class OpData:
    """One op of the sharded graph as the program sees it."""

    name: str
    kind: str
    module: str
    #: per-rank shape and the dims' names (``Sharding.local_type``)
    local_shape: tuple[int, ...]
    dims: tuple[str, ...]
    #: the dims' split axes, outermost first (``("cp", "tp")`` for ``seq: cp*tp``), degree > 1 only
    splits: tuple[tuple[str, ...], ...]
    sharding: str
    collectives: tuple[CollectiveCall, ...] = ()
    #: the ops it reads, in operand order
    inputs: tuple[str, ...] = ()
    #: a conversion into the tensor-parallel region whose split input column-parallel
    #: layers keep, all-gathering it again in backward (insert-collectives' ``regather``)
    regather: bool = False
    #: the op's attributes (``Op.attrs``): what a :class:`~parcompile.ir.ops.Code` row passes on
    attrs: tuple[tuple[str, object], ...] = ()
    #: mesh axes over which a parameter's gradient is a partial sum though its value is
    #: replicated (``Param.grad_partial``; a qk-norm weight under tp), per parameter
    grad_partial: tuple[tuple[str, ...], ...] = ()
    #: the op's parameters' global names, in order
    param_names: tuple[str, ...] = ()
    #: the op's parameters' per-rank shapes, in order (``Sharding.local_type`` of each)
    param_local: tuple[tuple[int, ...], ...] = ()
    #: the op's output's global shape
    global_shape: tuple[int, ...] = ()
    #: the FP8 recipe its GEMMs run with (``train.precision = fp8`` and
    #: :func:`parcompile.ir.fp8.fp8_kind`) in a layer that runs FP8
    #: (:attr:`ProgramData.layer_fp8`); None: 16-bit in every layer
    fp8: str | None = None
    #: the parameter each of the op's parameters is tied to (``Param.tied_to``: a tied LM
    #: head reads ``embedding.weight``), None where untied
    param_tied: tuple[str | None, ...] = ()

    def attr(self, key: str, default=KeyError):
        """The op attribute ``key``; ``default`` when the op has none (KeyError if not given)."""
        for k, v in self.attrs:
            if k == key:
                return v
        if default is KeyError:
            raise KeyError(f"{self.name} has no attribute {key!r}")
        return default

    def size(self, dim: str) -> int:
        """The local size of ``dim``."""
        return self.local_shape[self.dims.index(dim)]

    def shape_comment(self, skip: tuple[str, ...] = ()) -> str:
        """``(B=2, T/tp=8, h=64)``: each dim's symbol, the axes splitting it, its local size."""
        parts = []
        for d, n, axes in zip(self.dims, self.local_shape, self.splits):
            if d in skip:
                continue
            sym = SYMBOLS.get(d, d) + "".join(f"/{a}" for a in axes if a != "dp")
            parts.append("B" if d == "batch" else f"{sym}={n}")
        return "(" + ", ".join(parts) + ")"


@dataclass(frozen=True)
class LayerData:
    """One decoder layer: its ops in graph order (conversions included)."""

    index: int
    stage: int
    chunk: int
    ops: tuple[OpData, ...]

    def op(self, suffix: str) -> OpData | None:
        """The op named ``layers.<index>.<suffix>``, or None."""
        name = f"layers.{self.index}.{suffix}"
        return next((o for o in self.ops if o.name == name), None)

    def conversion_into(self, suffix: str) -> OpData | None:
        """The conversion insert-collectives put on the input edge of ``layers.<index>.<suffix>``."""
        op = self.op(suffix)
        got = [o for o in self.ops if op is not None and o.name in op.inputs and has_trait(o.kind, Trait.CONVERSION)]
        return got[0] if got else None

    def conversion_after(self, suffix: str) -> OpData | None:
        """The conversion insert-collectives put on the output edge of ``layers.<index>.<suffix>``."""
        name = f"layers.{self.index}.{suffix}"
        return next((o for o in self.ops if has_trait(o.kind, Trait.CONVERSION) and name in o.inputs), None)

    @property
    def collectives(self) -> tuple[CollectiveCall, ...]:
        """Every collective the layer's ops run per micro-batch, in graph order."""
        return tuple(c for o in self.ops for c in o.collectives)

    @property
    def moe(self) -> bool:
        return any(o.kind == "experts" for o in self.ops)

    def signature(self) -> tuple:
        """What the program's classes must do alike for every layer of one kind: each op's
        name inside the layer, kind, local shape, layout, collectives and attributes, but
        those its kind declares per-layer (``OpSpec.per_layer``: the classes read them from
        per-layer tables, :func:`layer_tables`)."""
        prefix = f"layers.{self.index}."
        return tuple((o.name.removeprefix(prefix), o.kind, o.local_shape, o.sharding,
                      tuple((c.op, c.axis, c.phase) for c in o.collectives),
                      tuple((k, v) for k, v in layer_attrs(o, self.index).items()
                            if k not in spec(o.kind).per_layer)) for o in self.ops)


class LayerAttributeError(ValueError):
    """An internal error: the decoder layers that one generated class is written for differ
    in an attribute their op kind does not declare per-layer (``OpSpec.per_layer``), or in
    a declared one that nothing in the program reads per layer; the program would compute
    every layer with the representative layer's value."""


@dataclass(frozen=True)
class LayerTable:
    """A declared per-layer attribute (``OpSpec.per_layer``) that differs between the decoder
    layers one class is written for: each layer's value of op ``layers.<i>.<op>``'s ``attr``,
    as the program's constant :attr:`name` holds them (indexed by layer id)."""

    op: str                                  # the op's name inside its layer: ``attn.core``
    kind: str
    attr: str
    #: (layer id, value) in layer order; None where the layer's op has no such attribute
    values: tuple[tuple[int, Any], ...]

    @property
    def name(self) -> str:
        """The program's constant: ``ATTN_CORE_SCALE`` for ``attn.core``'s ``scale``."""
        return re.sub(r"\W", "_", f"{self.op}_{self.attr}").upper()

    def literal(self) -> str:
        """The constant's value: a tuple over every layer id, a dict where only some layers
        have the op (a MoE layer's)."""
        ids = [i for i, _ in self.values]
        if ids == list(range(len(ids))):
            return repr(tuple(v for _, v in self.values))
        return repr(dict(self.values))

    def row(self) -> tuple[str, str, str]:
        """``(NAME, value, comment)``: the program's constant line."""
        return (self.name, self.literal(), f"each layer's {self.attr} of layers.{{i}}.{self.op} (its op kind's "
                                           "per-layer attribute)")


def layer_attrs(op: OpData, layer: int) -> dict[str, Any]:
    """``op``'s attributes as alike layers have them: a string naming the op's own layer
    (a conversion's ``where``: ``layers.3.attn``) written with ``{i}``."""
    own = re.compile(rf"\blayers\.{layer}\b")
    return {k: own.sub("layers.{i}", v) if isinstance(v, str) else v for k, v in op.attrs}


def layer_tables(layers: tuple[LayerData, ...] | list[LayerData]) -> tuple[LayerTable, ...]:
    """Every attribute that differs between the ``layers`` (model order) whose ops one
    generated class writes: the ops of one name inside their layers and one kind, the
    ``mlp.*`` ones of dense and of MoE layers apart (the Attention class serves every layer,
    Block every layer, the MLP every dense layer, MoE every MoE one). A difference in an
    attribute the op kind declares per-layer (``OpSpec.per_layer``) is a :class:`LayerTable`;
    any other difference is refused.

    Raises:
        LayerAttributeError: an undeclared attribute differs (the op, the layers and the
            attribute named)."""
    ops: dict[tuple[str, str, bool], list[tuple[int, dict]]] = {}
    for x in layers:
        for o in x.ops:
            name = o.name.removeprefix(f"layers.{x.index}.")
            ops.setdefault((name, o.kind, x.moe and name.startswith("mlp.")), []).append(
                (x.index, layer_attrs(o, x.index)))
    tables: dict[tuple[str, str], LayerTable] = {}
    for (name, kind, _), got in ops.items():
        for key in sorted({k for _, a in got for k in a}):
            values = tuple((i, a.get(key)) for i, a in got)
            if all(v == values[0][1] for _, v in values):
                continue
            if key not in spec(kind).per_layer:
                raise LayerAttributeError(_undeclared(name, kind, key, values))
            # the dense and the MoE layers' op of one name: one table over both (their ids differ)
            before = tables[name, key].values if (name, key) in tables else ()
            tables[name, key] = LayerTable(name, kind, key, tuple(sorted(before + values, key=lambda iv: iv[0])))
    return tuple(tables.values())


def _undeclared(name: str, kind: str, key: str, values: tuple[tuple[int, Any], ...]) -> str:
    groups: dict[str, list[int]] = {}
    for i, v in values:
        groups.setdefault("unset" if v is None else repr(v), []).append(i)
    seen = "; ".join(f"layer{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}: {v}"
                     for v, ids in groups.items())
    return (f"internal error: op layers.{{i}}.{name} (kind {kind!r}) differs between layers in attribute {key!r} "
            f"({seen}), which op kind {kind!r} does not declare per-layer (OpSpec.per_layer, "
            "parcompile/ir/ops/); the program writes one class for these layers and would compute all of them "
            "with one layer's value")


@dataclass(frozen=True)
class StageData:
    """One pipeline rank: its decoder layers, model chunk by model chunk, and the ops
    outside layers it holds (embedding on the first chunk, final norm, head and loss on
    the last)."""

    index: int
    layers: tuple[LayerData, ...]
    outside: tuple[OpData, ...]


@dataclass(frozen=True)
class LocalSizes:
    """Per-rank sizes of one layer's tensors, each read off the op it describes; None
    where the model has no such op. ``t_*`` are tokens per sequence, ``*_heads`` whole
    heads, the rest elements."""

    t_residual: int          # the residual stream (a layer's input and output; what crosses stages)
    t_attn: int              # inside the tensor-parallel region (q, k, v)
    heads: int               # query heads (wq's output / head_dim)
    kv_heads: int            # kv heads (wk's output / head_dim)
    ffn: int | None          # a dense MLP's inner width (w1's output)
    vocab: int               # logit columns (the LM head's output)
    experts: int | None      # routed experts held (the experts' stacked weights)
    expert_ffn: int | None   # one expert's inner width held (expert_tp splits it)
    boundary: tuple[int, ...]    # the activation a stage sends or receives (B, T, h)


@dataclass(frozen=True)
class ProgramData:
    """The plain data of a whole program (module docstring)."""

    stages: tuple[StageData, ...]
    sizes: LocalSizes
    #: sequence parallelism: the residual stream is split on seq over tp
    sequence_parallel: bool
    #: representative layers the program's classes are written from: a dense one and a MoE one
    dense_layer: LayerData | None
    moe_layer: LayerData | None
    #: every op by name (decoder layers and the ops outside them)
    ops: Mapping[str, OpData]
    #: per decoder layer, the FP8 recipe its GEMMs run with, None for a layer kept in 16 bits
    #: (:func:`parcompile.ir.fp8.is_fp8_gemm`); () when every layer runs alike
    layer_fp8: tuple[str | None, ...] = ()
    #: the declared per-layer attributes that differ between layers (:func:`layer_tables`)
    layer_tables: tuple[LayerTable, ...] = ()

    def table(self, op: str, attr: str) -> LayerTable | None:
        """The per-layer table of ``layers.<i>.<op>``'s ``attr``, None where every layer has one value."""
        return next((x for x in self.layer_tables if x.op == op and x.attr == attr), None)

    @property
    def layers(self) -> tuple[LayerData, ...]:
        return tuple(layer for s in self.stages for layer in s.layers)

    def conversion_into(self, name: str) -> OpData | None:
        """The conversion on the (first) input edge of op ``name``, or None."""
        op = self.ops.get(name)
        if op is None or not op.inputs:
            return None
        src = self.ops.get(op.inputs[0])
        return src if src is not None and has_trait(src.kind, Trait.CONVERSION) else None

    def conversion_after(self, name: str) -> OpData | None:
        """The conversion on the output edge of op ``name``, or None."""
        return next((o for o in self.ops.values() if has_trait(o.kind, Trait.CONVERSION) and name in o.inputs), None)


def _op_data(graph: Graph, nd: Node, degrees: Mapping[str, int], fp8: str | None = None) -> OpData:
    local = nd.sharding.local_type(nd.type, degrees)
    shape = local.shape
    if nd.op.attr("kv_replicas"):
        # serving with tp above kv_heads: a replicated kv head is unsplit in the graph
        # (core/heads.py), each rank holds one whole head of it (the kv dim's unit)
        shape = tuple(d.unit if d.name == "kv" else n for d, n in zip(local.dims, local.shape))
    ins = graph.inputs(nd.name)
    local_in = [r.local_type(graph.node(u).type, degrees) for r, u in zip(nd.requires, ins)]
    calls = tuple(CollectiveCall(nd.name, c.op, c.axis, c.phase, c.where)
                  for c in op_collectives(nd, degrees, local_in, local)
                  if c.per == "microbatch" and not nd.has_trait(Trait.STAGE_TRANSFER))
    splits = tuple(tuple(a for a in split_axes(nd.sharding.axis_of(d.name)) if degrees.get(a, 1) > 1)
                   for d in nd.type.dims)
    return OpData(nd.name, nd.kind, nd.op.module, shape, tuple(d.name for d in local.dims), splits,
                  str(nd.sharding), calls, tuple(ins), bool(nd.op.attr("regather")), nd.op.attrs,
                  tuple(p.grad_partial for p in nd.params), tuple(p.name for p in nd.params),
                  tuple(p.sharding.local_type(p.type, degrees).shape for p in nd.params), nd.type.shape,
                  fp8 if fp8 and fp8_kind(nd) else None, tuple(p.tied_to for p in nd.params))


def _layer_of(nd: Node) -> int | None:
    """The decoder layer an op belongs to by its module (a conversion carries the module
    it is named after: ``embedding.all_reduce`` feeds layer 0 but is the embedding's)."""
    parts = nd.name.split(".")
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        return int(parts[1])
    return None


def _param_local(graph: Graph, op: str, param_suffix: str, dim: str, degrees: Mapping[str, int]) -> int | None:
    if op not in graph:
        return None
    for p in graph.node(op).params:
        if p.name.endswith(param_suffix):
            t: TensorType = p.sharding.local_type(p.type, degrees)
            return t.dim(dim).size
    return None


def program_data(graph: Graph, degrees: Mapping[str, int], fp8: str | None = None) -> ProgramData:
    """The sharded ``graph`` (after every pass) as :class:`ProgramData`; ``fp8``: the FP8
    recipe of a ``precision = fp8`` training spec (the GEMMs
    :func:`parcompile.ir.fp8.is_fp8_gemm` marks run with it: :attr:`OpData.fp8`, and
    per layer :attr:`ProgramData.layer_fp8`).

    Raises:
        KeyError: the graph lacks an op every decoder has (``layers.<i>.attn.wq``,
            ``lm_head``): a graph not lowered by :func:`parcompile.ir.lower.lower`.
        LayerAttributeError: two decoder layers differ in an attribute of an op that their
            op kind does not declare per-layer (:func:`layer_tables`).
        ValueError: two decoder layers of one kind (dense, MoE) differ in an op, a local
            shape, a layout or a collective (the program writes each kind's classes once).
    """
    by_layer: dict[int, list[OpData]] = {}
    where: dict[int, tuple[int, int]] = {}
    outside: dict[int, list[OpData]] = {}
    nodes = {}
    for nd in graph.nodes():
        if nd.has_trait(Trait.NOT_AN_OP) and not nd.has_trait(Trait.STAGE_TRANSFER):
            continue
        od = _op_data(graph, nd, degrees, fp8)
        nodes[nd.name] = od
        i = _layer_of(nd)
        if nd.has_trait(Trait.STAGE_TRANSFER):   # a stage boundary, not part of a layer
            continue
        if i is None:
            outside.setdefault(nd.stage or 0, []).append(od)
            continue
        by_layer.setdefault(i, []).append(od)
        if not nd.has_trait(Trait.CONVERSION):
            where.setdefault(i, (nd.stage or 0, nd.chunk or 0))
    layers = {i: LayerData(i, where[i][0], where[i][1], tuple(ops)) for i, ops in by_layer.items()}
    num_stages = 1 + max([s for s, _ in where.values()] + list(outside))
    stages = tuple(
        StageData(s, tuple(layers[i] for i in sorted(layers, key=lambda i: (layers[i].chunk, i))
                           if layers[i].stage == s), tuple(outside.get(s, ())))
        for s in range(num_stages))
    ordered = [layers[i] for i in sorted(layers)]
    dense = next((x for x in ordered if not x.moe), None)
    moe = next((x for x in ordered if x.moe), None)
    tables = layer_tables(ordered)
    for x in ordered:
        rep = moe if x.moe else dense
        if x.signature() != rep.signature():
            raise ValueError(f"layer {x.index} of the sharded graph differs from layer {rep.index}; the "
                             "program's classes are written once for every layer of a kind")
    first = ordered[0]
    norm = first.op("attn_norm")
    # MLA: the query heads leave wq_b (or wq), the per-head keys attn.key; in its absorbed
    # serving form the one latent "kv head" attn.kv_a_norm
    wq = first.op("attn.wq") or first.op("attn.wq_b")
    wk = first.op("attn.wk") or first.op("attn.key") or first.op("attn.kv_a_norm")
    kv_dim = "kv" if first.op("attn.wk") else "k" if first.op("attn.key") else "kv_lora"
    head = nodes["lm_head"]
    sends = [o for o in nodes.values() if has_trait(o.kind, Trait.STAGE_TRANSFER)]
    boundary = sends[0] if sends else ordered[-1].op("mlp_residual")
    w1 = dense.op("mlp.w1") if dense is not None else None
    moe_name = f"layers.{moe.index}.mlp.experts" if moe is not None else ""
    q_unit = graph.node(wq.name).type.dim("q").unit
    kv_unit = graph.node(wk.name).type.dim(kv_dim).unit
    sizes = LocalSizes(
        t_residual=norm.size("seq"),
        t_attn=wq.size("seq"),
        heads=wq.size("q") // q_unit,
        kv_heads=wk.size(kv_dim) // kv_unit,
        ffn=w1.size("ffn") if w1 is not None else None,
        vocab=head.size("vocab"),
        experts=_param_local(graph, moe_name, "w1.weight", "experts", degrees),
        expert_ffn=_param_local(graph, moe_name, "w1.weight", "expert_ffn", degrees),
        boundary=tuple(n for d, n in zip(boundary.dims, boundary.local_shape)),
    )
    sp = "tp" in norm.splits[norm.dims.index("seq")]
    return ProgramData(stages, sizes, sp, dense, moe, nodes, _layer_fp8(graph, ordered, fp8), tables)


def _layer_fp8(graph: Graph, ordered: list, fp8: str | None) -> tuple[str | None, ...]:
    """:attr:`ProgramData.layer_fp8`: per layer, ``fp8`` where its FP8-kind GEMMs run in FP8
    (:func:`parcompile.ir.fp8.is_fp8_gemm`), else None; () when all layers agree."""
    if not fp8:
        return ()
    got = []
    for x in ordered:
        nds = [graph.node(o.name) for o in x.ops if o.fp8]
        got.append(fp8 if any(is_fp8_gemm(nd, graph) for nd in nds) else None)
    return tuple(got) if len(set(got)) > 1 else ()


__all__ = ["CollectiveCall", "OpData", "LayerData", "LayerAttributeError", "LayerTable", "StageData", "LocalSizes",
           "ProgramData", "layer_attrs", "layer_tables", "program_data", "SYMBOLS"]
