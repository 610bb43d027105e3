"""FP8 training's policy (``train.precision = fp8``): which GEMMs run in FP8 and in which
recipe (:data:`RECIPES`, :func:`is_fp8_gemm`, the graph's marks :class:`GraphFp8`), whether
the weights are all-gathered in FP8 (:func:`gathers_fp8`) and which amax collectives the
casts need (:func:`amax_collectives`). A fact of the plan, set on the graph by the passes
(:func:`graph_fp8`) and read alike by the cost model (:mod:`parcompile.analysis.fp8`
prices it), codegen, the exports and the search.

**Which GEMMs.** The linear layers of the decoder layers (attention projections, MLP and
expert matrices, MLA's projections): the ops of kind ``linear`` and ``experts`` that
belong to a layer. Not the embedding (a lookup), the LM head, the MoE router (fp32), nor
the attention core (its two matmuls run in the 16-bit fused kernel): torchao's
``convert_to_float8_training`` swaps the ``nn.Linear`` modules a ``module_filter_fn``
keeps, and torchtitan's float8 configuration keeps every linear but ``output`` (the LM
head: ``filter_fqns = ["output"]``, ``torchtitan/models/llama3/train_configs/
llama3_{8b,70b}.toml`` at pytorch/torchtitan 820504e, the commit of the asyncTP benchmark
runs); the router is a separate module in Megatron-Core that Transformer Engine's
``fp8_autocast`` does not cast. Every layer runs FP8 by default, as Megatron-LM's
``--first-last-layers-bf16`` is off by default; ``train.fp8_bf16_layers_start`` / ``_end`` keep
the first / last layers' GEMMs in 16 bits as that flag with ``--num-layers-at-start-in-bf16`` /
``--num-layers-at-end-in-bf16`` does (:func:`bf16_layers`; ``Graph.fp8``, :class:`GraphFp8`):
those layers' GEMMs count at the 16-bit peak, with no casts, FP8 weight copies, scales, FP8
all-gather or amax collectives.

**Routed experts** (the ``experts`` op: every local expert's w1 [w3] and w2 GEMMs on its group
of routed rows, a grouped GEMM) run in FP8 as the linears do, the router in fp32: torchao's FP8
MoE training (``torchao/prototype/moe_training/fp8_grouped_mm.py``, ``_Float8GroupedMM`` at
pytorch/ao 36027d82, rowwise only: the routed rows A per row, the expert weights per expert and
output column, both again for the input gradient, and per expert group and column for the
weight gradient, all E4M3 with power-of-two scales; it saves the 16-bit A and weights) and
Transformer Engine's ``GroupedLinear`` (Megatron-Core's TEGroupedMLP; tensorwise: per-expert
scales; under ``MXFP8BlockScaling`` 32-element blocks, as the program's mxfp8 experts). So their FLOPs run at the FP8 peak and their casts are priced per routed row like a
linear's (:func:`cast_elements`); the scales are a few fp32 per expert and row, not counted in
memory. The token all-to-alls stay 16-bit: the FP8 grouped GEMM casts after the dispatch (not
modelled: torchao's MXFP8 dispatch, ``ep/a2a_dispatch.py`` ``_A2ADispatchMXFP8FwdHPBwd`` at the
same commit, moves MXFP8 rows forward and 16-bit gradients back).

**Amax collectives** (tensorwise only: a row's or a 32-block's scale is local): with tensor
parallelism the scale of a tp-sharded tensor is its global amax, one all-reduce of a scalar
over tp per cast of a sharded operand (torchtitan ``docs/float8.md`` at 820504e: "For TP ...
The overhead is communicating max(abs) across ranks. For sharded weights, we communicate
max(abs) as well"): one per sequence-parallel input gathered in FP8 (forward) and per output
gradient before its FP8 all-gather (backward), and, under torchao, one per FP8 GEMM's
tp-sharded weight in each (Transformer Engine scales each weight shard on its own and casts
the weights once per step). With FP8 all-gather the shards' amaxes are all-reduced over dp
once per step, one all-reduce for all weights (torchtitan's
``precompute_float8_dynamic_scale_for_fsdp``). What the generated program all-reduces (its own
pattern: runtime/model/fp8.py casts the local operand and all-reduces its amax, scalar or per row)
is listed among the plan's collectives (:func:`amax_collectives`, ``where`` ``fp8_amax_tp``) so
verify compares it call for call; so are the routed experts' over expert_tp, the per-row ones
of a group's routed rows as the MoE token traffic is (``routed``, their balanced estimate,
checked per row and summed over the ranks); the time model keeps pricing the pattern above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from parcompile.core.data_parallel import data_parallel_sharding
from parcompile.core.model import GATED_ACTIVATIONS
from parcompile.ir.graph import Graph, Node
from parcompile.ir.ops import Collective, Trait


@dataclass(frozen=True)
class Recipe:
    """One FP8 scaling recipe (``train.fp8_recipe``; module docstring): ``fwd_casts`` and
    ``bwd_casts`` as (input, weight, output) tensors cast per GEMM; ``cast_bytes`` bytes
    read and written per element cast; ``amax``: one scale per tensor, so a tp-sharded
    tensor's scale needs an all-reduce of its amax over tp; ``scale_bytes``: scale bytes per
    FP8 element stored; ``gathers_fp8``: whether FP8 all-gather is possible."""

    name: str
    fwd_casts: tuple[int, int, int]
    bwd_casts: tuple[int, int, int]
    cast_bytes: float
    amax: bool
    scale_bytes: float
    gathers_fp8: bool
    source: str
    #: the tensor-parallel all-gathers of a layer (sequence parallelism: the inputs of the
    #: column-parallel GEMMs, forward and regathered in backward, and the output gradients of
    #: the row-parallel ones) move FP8 (torchao's Float8ColwiseParallel / Float8RowwiseParallel /
    #: PrepareFloat8ModuleInput cast before they redistribute, torchao/float8/float8_tensor_parallel.py
    #: at 6243040; torchtitan docs/float8.md: "for TP (by default for Float8Linear)")
    tp_gather_fp8: bool = False


RECIPES: dict[str, Recipe] = {
    "tensorwise": Recipe(
        "tensorwise", (1, 1, 0), (1, 1, 1), 5.0, True, 0.0, True,
        "torchao Float8LinearConfig() / recipe 'tensorwise' (E4M3 everywhere, one dynamic scale per tensor); "
        "Transformer Engine's Float8CurrentScaling (Megatron --fp8-recipe tensorwise)", tp_gather_fp8=True),
    "rowwise": Recipe(
        "rowwise", (1, 1, 0), (1, 1, 2), 3.0, False, 0.0, False,
        "torchao recipe 'rowwise' (axiswise scales, power-of-2, all communication in 16 bits)"),
    "mxfp8": Recipe(
        "mxfp8", (1, 1, 0), (1, 1, 2), 3.0 + 1 / 32, False, 1 / 32, True,
        "OCP MX: one E8M0 scale per 32 elements (torchao MXLinear recipe 'mxfp8', Transformer Engine's "
        "MXFP8BlockScaling, Megatron --fp8-recipe mxfp8)"),
}


@dataclass(frozen=True)
class GraphFp8:
    """What a compiled graph's FP8 GEMMs run with (``Graph.fp8``, set by the pass manager from
    the spec: :func:`graph_fp8`): the recipe, the decoder layers kept in 16 bits
    (:func:`bf16_layers`) and whether ZeRO-3's FP8 all-gather hands the GEMMs their E4M3
    weights (:func:`gathers_fp8`: no weight cast, no weight amax, in the program)."""

    recipe: str
    bf16_layers: frozenset[int] = frozenset()
    gathered: bool = False


def bf16_layers(cfg) -> frozenset[int]:
    """The decoder layers (global indices) whose GEMMs stay in 16 bits under ``precision =
    fp8``: the first ``train.fp8_bf16_layers_start`` and the last ``train.fp8_bf16_layers_end``
    of ``model.layers``, as Megatron-Core's ``is_first_last_bf16_layer``
    (``megatron/core/fp8_utils.py`` lines 673-684 at core_v0.19.0, NVIDIA/Megatron-LM 5be9626: ``layer_no <
    num_layers_at_start_in_bf16`` or ``layer_no >= num_layers - num_layers_at_end_in_bf16``,
    global layer numbers, so every pipeline stage agrees). Empty without FP8."""
    if not enabled(cfg):
        return frozenset()
    n, t = cfg.model.layers, cfg.train
    start, end = getattr(t, "fp8_bf16_layers_start", 0), getattr(t, "fp8_bf16_layers_end", 0)
    return frozenset(i for i in range(n) if i < start or i >= n - end)


def graph_fp8(cfg) -> GraphFp8 | None:
    """``Graph.fp8`` for ``cfg`` (None without FP8 training)."""
    if not enabled(cfg):
        return None
    return GraphFp8(cfg.train.fp8_recipe, bf16_layers(cfg), gathers_fp8(cfg))


def fp8_kind(nd: Node) -> bool:
    """Whether op ``nd`` is of the GEMMs FP8 training casts: an op of a kind of ``Trait.FP8_GEMM``
    (``linear``, ``experts``) of a decoder layer (module docstring); :func:`is_fp8_gemm` adds the layers kept in 16 bits."""
    return nd.op.layer is not None and nd.has_trait(Trait.FP8_GEMM)


def is_fp8_gemm(nd: Node, graph: Graph) -> bool:
    """Whether op ``nd`` of ``graph`` runs its GEMMs in FP8 under ``precision = fp8``: a
    ``linear`` or ``experts`` op of a decoder layer (module docstring): not the LM head, the
    router or the attention core, nor a layer the spec keeps in 16 bits (``graph.fp8``'s
    :attr:`GraphFp8.bf16_layers`: its GEMMs at the 16-bit peak, no casts, no FP8 copies or
    scales, no amax collectives)."""
    if not fp8_kind(nd):
        return False
    marks = getattr(graph, "fp8", None)
    return marks is None or nd.op.layer not in marks.bf16_layers


def amax_collectives(graph: Graph, nd: Node, degrees: Mapping[str, int]) -> list[tuple[str, str, int, str, int]]:
    """The amax all-reduces (max) over tp that the generated program runs for FP8 linear op
    ``nd`` in one micro-batch (runtime/model/fp8.py ``_Fp8Linear``, ``_max_over``), and over
    expert_tp for FP8 routed experts op ``nd`` (runtime/model/moe.py ``expert_linear``), as ``(op,
    axis, bytes, phase, bytes_per_row)``; [] for other ops, one tp (expert_tp) rank, mxfp8
    (block scales are local) and replicated (MLA) linears. What a ``column`` (weight split on
    N) or ``row`` (split on K) linear all-reduces, per GEMM operand cast:

    - tensorwise (one fp32 each): forward the weight (column, row) and the row-parallel
      input; backward, for the input gradient, the column-parallel output gradient and the
      weight, and for the weight gradient the column-parallel output gradient and the
      row-parallel input. With ZeRO-3 FP8 all-gather (``GraphFp8.gathered``) the weight comes
      cast with its step scale: no weight all-reduce (its amax went over tp once per step,
      the step collective ``fp8_amax_tp``).
    - rowwise (one fp32 per row or column along the GEMM's reduction dimension, only where
      that dimension is split): forward, row-parallel, the input's M rows and the weight's N
      rows; backward, column-parallel, the output gradient's M rows and the weight's K
      columns.

    M is the GEMM's input rows (tokens of the micro-batch on this rank), N and K the layer's
    whole output and input features; ``bytes_per_row`` is 0 (the size is fixed).

    Routed experts: each local expert (``experts / ep``) runs its w1 [and w3] as a column- and
    its w2 as a row-parallel linear over expert_tp on its group of routed rows, with the
    same rules (tensorwise: per-expert scalars, never FP8-gathered; rowwise: the weights'
    ``h`` rows or columns, and the group's M rows). A group's M is what the router sent it:
    those all-reduces carry ``bytes_per_row`` 4 (verify checks them per row and their sum over
    the ranks, :func:`parcompile.verification.check_routed`) and ``bytes`` their balanced estimate,
    the ``expert_tp * A`` rows a rank's experts receive under balanced routing (A = ``b *
    s_local * top_k``, the rows it sends, as :func:`parcompile.ir.ops.moe_collectives`),
    divided over the local experts (the first ``(expert_tp * A) % experts_local`` one row
    more, so the balanced sum is exact). A program runs an expert only on a non-empty group
    (runtime/model/moe.py ``MoELayer.forward``): the counts assume every local expert receives rows.

    These are listed among the plan's collectives
    (:func:`parcompile.analysis.comm.comm_report`, ``where`` ``fp8_amax_tp``); the time
    model prices the recipe's amaxes separately (:func:`fp8_costs`: torchao's pattern,
    calibrated)."""
    marks = getattr(graph, "fp8", None)
    if marks is None or marks.recipe not in ("tensorwise", "rowwise") or not is_fp8_gemm(nd, graph):
        return []
    x = next(r.local_type(t, degrees) for r, t in zip(nd.requires, graph.input_types(nd.name)))
    rows = x.numel // x.dims[-1].size
    if nd.kind == "experts":
        return _expert_amax_collectives(nd, marks.recipe, rows, x.dims[-1].size, degrees)
    tp = degrees.get("tp", 1)
    split = nd.op.attr_map.get("tp")
    if tp <= 1 or split not in ("column", "row"):
        return []
    w = next(pr for pr in nd.params if pr.name.endswith("weight"))
    n_out, k_in = (d.size for d in w.type.dims)
    return _linear_amax(marks.recipe, split, "tp", [rows], n_out, k_in, 0 if marks.gathered else 1)


def _linear_amax(recipe: str, split: str, axis: str, groups: list[int], n_out: int, k_in: int, weight: int,
                 per_row: int = 0) -> list[tuple[str, str, int, str, int]]:
    """:func:`amax_collectives` of one FP8 linear split ``split`` over ``axis``, run on each of
    ``groups`` (its input rows M per run: one for a dense linear, one per local expert), its
    whole weight ``n_out x k_in``; ``weight`` 0: the weight comes cast (FP8 all-gather);
    ``per_row``: the ``bytes_per_row`` of the M-row all-reduces (4 where the router sets M)."""
    out: list[tuple[str, str, int, str, int]] = []

    def add(nbytes: int, phase: str, bpr: int = 0) -> None:
        out.append(("all_reduce", axis, int(nbytes), phase, bpr))

    for m_rows in groups:
        if recipe == "tensorwise":
            w = [4] * weight
            for b in w + ([4] if split == "row" else []):
                add(b, "forward")
            for b in ([4] if split == "column" else []) + w + [4]:
                add(b, "backward")   # input gradient: g (column), W; weight gradient: g (column) or x (row)
        elif split == "row":
            add(4 * m_rows, "forward", per_row)
            add(4 * n_out, "forward")
        else:
            add(4 * m_rows, "backward", per_row)
            add(4 * k_in, "backward")
    return out


def _expert_amax_collectives(nd: Node, recipe: str, rows: int, h: int, degrees: Mapping[str, int]
                             ) -> list[tuple[str, str, int, str, int]]:
    """:func:`amax_collectives` of routed experts op ``nd`` (``rows``: the A routed rows a rank
    sends, ``h`` wide): w1 [w3] column-, w2 row-parallel over expert_tp, per local expert."""
    etp = degrees.get("expert_tp", 1)
    if etp <= 1:
        return []
    w = next(pr for pr in nd.params if pr.name.endswith("w1.weight"))
    local = w.sharding.local_type(w.type, degrees).dims[0].size
    ffn = nd.op.attr_map["ffn"]
    q, r = divmod(etp * rows, local)
    groups = [q + 1] * r + [q] * (local - r)
    ups = 2 if nd.op.attr_map["activation"] in GATED_ACTIVATIONS else 1
    out = []
    for _ in range(ups):
        out += _linear_amax(recipe, "column", "expert_tp", groups, ffn, h, 1, 4)
    return out + _linear_amax(recipe, "row", "expert_tp", groups, h, ffn, 1, 4)


def moved_bytes(graph: Graph, nd: Node, c: Collective) -> int:
    """The bytes collective ``c`` of op ``nd`` moves on one rank: the one rule that sizes a
    collective for ``comm.collectives``, the report's table, the per-step totals and the time
    estimate (:func:`parcompile.analysis.comm.comm_report` applies it to every collective).

    Under a recipe that gathers FP8 over tensor parallelism (:attr:`Recipe.tp_gather_fp8`,
    tensorwise: torchao's Float8ColwiseParallel / Float8RowwiseParallel /
    PrepareFloat8ModuleInput cast before they redistribute,
    ``torchao/float8/float8_tensor_parallel.py`` at pytorch/ao 6243040; Transformer Engine's
    ``_Linear.forward`` likewise casts the input (``cast_to_fp8``) before
    ``gather_along_first_dim`` under sequence parallelism,
    ``transformer_engine/pytorch/module/linear.py`` at NVIDIA/TransformerEngine 3ec8787), a decoder layer's
    all-gather over ``tp`` (sequence parallelism: a column-parallel GEMM's input forward and
    regathered in backward, a row-parallel GEMM's output gradient in backward) of a layer whose
    GEMMs run in FP8 (not :func:`bf16_layers`) moves 1 byte per element plus the recipe's
    scale bytes per element (:attr:`Recipe.scale_bytes`; tensorwise: 0, its one fp32 scale
    comes from the amax all-reduce); ``c.bytes`` is the 16-bit size (elements x
    ``nd.type.itemsize``). Every other collective (the LM head's gather, the MoE token
    traffic over ep and expert_tp, which stays 16-bit: module docstring) moves ``c.bytes``.
    The generated program gathers these in 16 bits and casts after (runtime/model/fp8.py): the
    plan's row keeps that size as ``program_bytes``, what ``verify`` measures."""
    marks = getattr(graph, "fp8", None)
    if (marks is None or not RECIPES[marks.recipe].tp_gather_fp8 or c.op != "all_gather" or c.axis != "tp"
            or c.per != "microbatch" or not nd.has_trait(Trait.CONVERSION) or nd.op.layer is None
            or nd.op.layer in marks.bf16_layers):
        return c.bytes
    elements = c.bytes // nd.type.itemsize
    return int(round(elements * (1 + RECIPES[marks.recipe].scale_bytes)))


def enabled(cfg) -> bool:
    """Whether ``cfg`` (a SpecConfig) trains with FP8 GEMMs."""
    return cfg.workload == "train" and getattr(cfg.train, "precision", "model") == "fp8"


def gathers_fp8(cfg, par=None) -> bool:
    """Whether ZeRO-3's parameter all-gathers move FP8 weights (``fp8_all_gather`` with a
    recipe that allows it, and parameters sharded:
    :attr:`~parcompile.core.data_parallel.DataParallelSharding.shards_parameters`); ``par``:
    this layout instead of ``cfg.parallel`` (the search's layouts, costed on a probe of
    another)."""
    return enabled(cfg) and cfg.train.fp8_all_gather and RECIPES[cfg.train.fp8_recipe].gathers_fp8 \
        and data_parallel_sharding(cfg.parallel if par is None else par).shards_parameters


__all__ = ["Recipe", "RECIPES", "GraphFp8", "bf16_layers", "graph_fp8", "fp8_kind", "is_fp8_gemm", "amax_collectives", "moved_bytes", "enabled", "gathers_fp8"]
