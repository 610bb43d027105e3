"""FP8 training (``train.precision = fp8``): which GEMMs run in FP8, and what each scaling
recipe costs beyond its GEMMs. The one place these rules live: the compute report counts
the FP8 GEMMs' FLOPs and the elements their casts read (:func:`is_fp8_gemm`,
:func:`cast_elements`), the time model prices them (:func:`fp8_costs`), the step
collectives gather FP8 weights (:func:`gathers_fp8`; each bucket's two all-gathers sized by
:func:`parcompile.core.buckets.fp8_gather_elements`), the memory model keeps
their FP8 copies (:func:`weight_copy_bytes`), plan.json says what was assumed
(:func:`assumptions`).

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

**The casts** (torchao ``torchao/float8/float8_linear.py``, ``matmul_with_hp_or_float8_args``
at pytorch/ao 6243040, the torchao commit of the torchtitan runs): a linear ``y = x W`` with
``x`` of ``M x K``, ``W`` of ``K x N`` casts ``x`` and ``W`` in the forward and, in the
backward, the output gradient (``M x N``) for the input gradient, ``W`` again, and ``x``
again for the weight gradient (it saves the 16-bit ``x`` and ``W``, ``ctx.save_for_backward(
input_hp, weight_hp_t)``, not their FP8 casts: the saved activations are the 16-bit ones the
memory model already counts; not modelled: under torchao's Float8 TP plan the GEMM's input is
already the all-gathered FP8 tensor, and that, the whole sequence at 1 byte, is what it saves;
Transformer Engine saves its FP8 casts, 1 byte per element: :func:`saves_fp8_inputs`).
Rowwise scales along the other dimension for the weight
gradient, so it casts the output gradient twice (along rows and along columns); MXFP8 too
(32-element blocks along each GEMM's reduction dimension). Each cast reads the 16-bit tensor
and writes the FP8 one (3 bytes per element); tensorwise first reads the whole tensor for
its amax (2 more: the scale must be known before the first element is cast). Casts are
memory-bound kernels at the memory rate. With ``fp8_all_gather`` the weight casts run on the
ZeRO-3 shard before the all-gather (``1/d`` of the elements) and the gathered FP8 weight is
not cast again.

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

**Engines.** Transformer Engine (``engine = megatron``) caches a step's FP8 weights from the
first micro-batch (``is_first_microbatch``): their casts run once per step (in the optimizer
step's time, :func:`weight_cast_bytes`) and their copies stay for the step
(:func:`weight_copy_bytes`); torchao (the FSDP2 engines) casts in every GEMM.

**Rates.** The FP8 GEMMs run at the preset's FP8 (``fp8_flops``) or MXFP8 peak
(``mxfp8_flops``; :func:`parcompile.config.presets.fp8_peak`), scaled like ``peak_flops`` where
a cluster overrides it (a power-limited part), times an achievable fraction
(:attr:`parcompile.analysis.estimate.Efficiency.fp8` for tensorwise and MXFP8,
``fp8_rowwise`` for rowwise) fitted to the FP8 rows of :mod:`parcompile.analysis.calibration`
(and only to them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from parcompile.config.presets import CLUSTER_PRESETS, fp8_peak
from parcompile.core.data_parallel import data_parallel_sharding
from parcompile.core.model import GATED_ACTIVATIONS
from parcompile.ir.graph import Graph, Node
from parcompile.ir.ops import Trait



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


def _tp_redistribute(graph: Graph, name: str, op: str) -> Node | None:
    """The tensor-parallel ``redistribute`` op ``name`` is, when its forward is ``op``
    (``all_gather``, ``reduce_scatter``) over tp; else None."""
    nd = graph.node(name)
    if nd.has_trait(Trait.CONVERSION) and (op, "tp") in tuple(nd.op.attr_map.get("fwd", ())):
        return nd
    return None


def cast_elements(graph: Graph, nd: Node, degrees: Mapping[str, int]) -> tuple[int, int, int, int, int]:
    """What the casts of FP8 GEMM op ``nd`` read in one forward on one rank (local types; all
    0 for other ops): ``(input, input_tp, output, output_tp, weight)`` elements. ``input`` as
    the GEMM reads it; ``input_tp`` the same, but for an input a tensor-parallel all-gather
    produced (sequence parallelism), the gather's local input: a recipe that gathers FP8
    (:attr:`Recipe.tp_gather_fp8`) casts before it gathers. ``output`` and ``output_tp``
    likewise for the output gradient, sharded before a reduce-scatter's backward all-gather.
    A grouped expert GEMM (``experts``): every routed row through each of its matrices
    (inputs ``h`` or ``ffn`` wide, outputs the other), the local experts' weights."""
    if not is_fp8_gemm(nd, graph):
        return 0, 0, 0, 0, 0
    ins = graph.inputs(nd.name)
    local_in = [r.local_type(t, degrees) for r, t in zip(nd.requires, graph.input_types(nd.name))]
    weights = sum(p.sharding.local_type(p.type, degrees).numel for p in nd.params if p.name.endswith("weight"))
    x = local_in[0]
    if nd.kind == "experts":
        a = nd.op.attr_map
        rows, h = x.numel // x.dims[-1].size, x.dims[-1].size
        up = 2 if a["activation"] in GATED_ACTIVATIONS else 1
        xi, yo = rows * (up * h + a["ffn"]), rows * (up * a["ffn"] + h)
        return xi, xi, yo, yo, weights
    xi = x.numel
    gather = _tp_redistribute(graph, ins[0], "all_gather")
    xt = graph.node(graph.inputs(gather.name)[0]).sharding.local_type(
        graph.node(graph.inputs(gather.name)[0]).type, degrees).numel if gather is not None else xi
    yo = nd.sharding.local_type(nd.type, degrees).numel
    users = graph.users(nd.name)
    scatter = _tp_redistribute(graph, users[0][0], "reduce_scatter") if len(users) == 1 else None
    yt = scatter.sharding.local_type(scatter.type, degrees).numel if scatter is not None else yo
    return xi, xt, yo, yt, weights


def cast_input(graph: Graph, nd: Node) -> str:
    """The tensor whose cast FP8 GEMM op ``nd`` reads (its first input): GEMMs that read the
    same tensor (q, k and v; gate and up) share one cast (torchao's PrepareFloat8ModuleInput
    casts a module's input once under tensor parallelism; Inductor merges equal casts in a
    compiled block; Transformer Engine's LayerNormLinear runs q, k, v as one GEMM)."""
    return graph.inputs(nd.name)[0]


def fp8_rate(cfg, fraction: float) -> float:
    """FLOP/s of the FP8 GEMMs of ``cfg`` (a SpecConfig with ``precision = fp8``) on one GPU:
    the preset's FP8 / MXFP8 peak (:func:`parcompile.config.presets.fp8_peak`) times
    ``cluster.peak_flops`` over the preset's own peak for the model dtype (a cluster that
    lowers ``peak_flops``, a power-limited part, lowers its FP8 peak alike) times ``fraction``
    (the achievable share, :attr:`parcompile.analysis.estimate.Efficiency.fp8`).

    Raises:
        ValueError: the cluster has no such peak (the checks refuse that spec first).
    """
    cl = cfg.cluster
    peak = fp8_peak(cl.preset, cfg.train.fp8_recipe)
    if peak is None:
        raise ValueError(f"cluster {cl.preset!r} has no {cfg.train.fp8_recipe} FP8 peak")
    own = CLUSTER_PRESETS[cl.preset].peak_flops[cfg.model.dtype]
    return peak * (cl.peak_flops / own) * fraction


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


def weight_cast_bytes(cfg, stage_fp8: int, engine_name: str) -> float:
    """Bytes the once-per-step weight casts of Transformer Engine move on a rank (``engine =
    megatron``: the stage's FP8 weights cast in both orientations at the first micro-batch,
    ``is_first_microbatch``, each cast reading and writing :attr:`Recipe.cast_bytes` per
    element); 0 for the other engines, whose casts run in every GEMM (:func:`fp8_costs`)."""
    if not enabled(cfg) or engine_name != "megatron":
        return 0.0
    return 2.0 * stage_fp8 * RECIPES[cfg.train.fp8_recipe].cast_bytes


def saves_fp8_inputs(fp8: bool, engine_name: str) -> bool:
    """Whether an FP8 GEMM (:func:`is_fp8_gemm`) keeps its input for the backward in FP8
    (1 byte per element; the memory model's saved activations,
    :func:`parcompile.analysis.memory.saved_bytes`): under Transformer Engine (``engine =
    megatron``) the linear saves the FP8 cast of its input for the weight gradient's GEMM
    (``transformer_engine/pytorch/module/linear.py`` and ``layernorm_linear.py`` save the
    quantized ``inputmat`` / ``ln_out``, with sequence parallelism the local shard, gathered
    again in backward), so a norm feeding a ``LayerNormLinear`` keeps no 16-bit output and an
    input other ops keep in 16 bits (the attention kernel's output) is kept twice, in 16 bits
    and in FP8; torchao (the FSDP2 engines) saves the 16-bit input (module docstring), and so
    does the generated program (``engine_name`` ``"program"``). ``fp8``: the spec trains in
    FP8. Not applied to grouped expert GEMMs (their routed rows are counted as before)."""
    return fp8 and engine_name == "megatron"


def weight_copy_bytes(cfg, stage_fp8: int, engine_name: str) -> int:
    """Bytes of FP8 weight copies a rank keeps across a step's micro-batches: under
    Megatron-Core with Transformer Engine (``engine = megatron``) the FP8 casts of the stage's
    FP8 weights are cached from the first micro-batch of a step to the last
    (``is_first_microbatch``), in both orientations on Hopper (the forward's and the input
    gradient's GEMM read ``W`` and its transpose: 2 bytes per element) plus scales; torchao
    (the FSDP2 engines) casts the weights in each GEMM and keeps nothing (0)."""
    if not enabled(cfg) or engine_name != "megatron":
        return 0
    return int(stage_fp8 * 2 * (1 + RECIPES[cfg.train.fp8_recipe].scale_bytes))


@dataclass(frozen=True)
class Fp8Costs:
    """What :func:`parcompile.analysis.estimate.chunk_times` reads of the FP8 recipe: the FP8
    GEMMs' rate (FLOP/s), seconds of casts per element of GEMM input, output and weight
    over a forward and backward (``per_in``, ``per_out``, ``per_weight``) and over a
    recomputed forward (``rec_in``, ``rec_weight``), and which scalar amax all-reduces run over
    tp: one per tp-gathered input (forward) and tp-scattered output gradient (backward) with
    ``amax``, one per FP8 GEMM's sharded weight in each with ``amax_weights``."""

    rate: float
    per_in: float
    per_out: float
    per_weight: float
    rec_in: float
    rec_weight: float
    amax: bool
    amax_weights: bool
    #: bytes per byte of a layer's tensor-parallel all-gathers (:attr:`Recipe.tp_gather_fp8`:
    #: FP8 over the model dtype; 1 otherwise)
    tp_gather: float = 1.0
    #: whether the casts read a tp all-gather's local input and a reduce-scatter's local
    #: output gradient (:func:`cast_elements`' ``input_tp``, ``output_tp``)
    sharded_casts: bool = False

    def collective_bytes(self, op: str, family: str, where: str, nbytes: float) -> float:
        """The bytes a per-micro-batch collective moves under FP8: a layer's tp all-gather
        (``where`` a ``layers.`` op) times :attr:`tp_gather`; every other collective its own."""
        if self.tp_gather != 1.0 and family == "tp" and op == "all_gather" and where.startswith("layers."):
            return nbytes * self.tp_gather
        return nbytes


def fp8_costs(cfg, fraction: float, bandwidth: float, degrees: Mapping[str, int],
              cached_weights: bool = False) -> Fp8Costs | None:
    """The :class:`Fp8Costs` of ``cfg`` (None without FP8): its recipe's casts at
    ``bandwidth`` (bytes/s, the memory-bound rate), the GEMMs at :func:`fp8_rate` with
    ``fraction``; weight casts on ``1/dp_cp`` shards with FP8 all-gather, none per micro-batch
    with ``cached_weights`` (Transformer Engine casts a step's weights once:
    :func:`weight_cast_bytes`, and keeps per-shard weight scales: no weight amax over tp),
    and no amax all-reduce over tp of one rank."""
    if not enabled(cfg):
        return None
    r = RECIPES[cfg.train.fp8_recipe]
    tp_casts = r.tp_gather_fp8 and degrees.get("tp", 1) > 1
    per = r.cast_bytes / bandwidth
    (fx, fw, _), (bx, bw, bg) = r.fwd_casts, r.bwd_casts
    wshare = 1 / max(1, degrees.get("dp_cp", 1)) if gathers_fp8(cfg) else 1.0
    w_fwd, w_bwd = fw * wshare, (0 if gathers_fp8(cfg) else bw)
    if cached_weights:
        w_fwd = w_bwd = 0
    tp = degrees.get("tp", 1)
    return Fp8Costs(fp8_rate(cfg, fraction), (fx + bx) * per, bg * per, (w_fwd + w_bwd) * per, fx * per,
                    w_fwd * per, r.amax and tp > 1, r.amax and tp > 1 and not cached_weights,
                    (1 + r.scale_bytes) / cfg.model.dtype_bytes if r.tp_gather_fp8 else 1.0, tp_casts)


def _bf16_layers_text(cfg) -> str:
    """The layers :func:`bf16_layers` keeps in 16 bits, for :func:`assumptions`."""
    t = cfg.train
    if not bf16_layers(cfg):
        return ""
    return (f"; every GEMM of the first {t.fp8_bf16_layers_start} and last {t.fp8_bf16_layers_end} decoder layers "
            "(Megatron-LM --first-last-layers-bf16)")


def assumptions(cfg, fraction: float, source: str = "") -> dict[str, object]:
    """plan.json ``estimate.assumptions.fp8`` for ``cfg`` with ``precision = fp8`` (module
    docstring): the recipe, which GEMMs run in FP8 and which stay 16-bit, the rate, the
    casts, the amax collectives, FP8 all-gather and the weight copies."""
    r = RECIPES[cfg.train.fp8_recipe]
    te = cfg.cluster.engine == "megatron"
    return {
        "recipe": r.name,
        "recipe_source": r.source,
        "fp8_gemms": "the linear layers of every decoder layer: attention projections (q, k, v, output; MLA's "
                     "down and up projections), MLP and expert matrices",
        "bf16_gemms": "embedding (a lookup), LM head, MoE router (fp32), the attention core (fused 16-bit "
                      "kernel); norms are not GEMMs" + _bf16_layers_text(cfg),
        "bf16_layers": sorted(bf16_layers(cfg)),
        "fp8_peak": fp8_rate(cfg, 1.0),
        "fp8_matmul_efficiency": fraction,
        "fp8_efficiency_source": source,
        "casts": f"per FP8 GEMM, forward: input and weight; backward: output gradient x {r.bwd_casts[2]}, weight, "
                 f"input; {r.cast_bytes:g} bytes read and written per element, at the memory rate "
                 "(spread over forward and backward as the GEMMs are: 1 : 2); an input several GEMMs read "
                 "(q, k, v; gate, up) cast once" + ("; tp-gathered inputs and tp-scattered output gradients cast "
                                                   "on their shards" if r.tp_gather_fp8 else "")
                 + ("; weights cast once per step (Transformer Engine's cache), in the optimizer step's time"
                    if te else ""),
        "amax_all_reduces_tp": ("one scalar all-reduce per tp-gathered GEMM input (forward) and per tp-scattered "
                                "output gradient (backward)" + (", and per FP8 GEMM's tp-sharded weight in each"
                                                                 if not te else "")) if r.amax and cfg.parallel.tp > 1
                               else "none",
        "fp8_all_gather": gathers_fp8(cfg),
        "tp_all_gathers": "FP8 (a layer's sequence-parallel all-gathers of GEMM inputs and output gradients)"
                          if r.tp_gather_fp8 else "16-bit",
        "saved_activations": ("the FP8 GEMMs' inputs in FP8 (Transformer Engine saves its casts; the attention "
                              "kernel's output kept in 16 bits as well)" if te else
                              "16-bit, as without FP8 (torchao saves the 16-bit input and weight and casts again "
                              "in backward; not modelled: the gathered FP8 inputs torchao's Float8 TP plan saves)"),
        "weight_copies": "engine megatron: Transformer Engine's cached FP8 weights, both orientations (2 bytes "
                         "per FP8 weight element, buffer fp8_weights); FSDP2 engines (torchao): none",
    }
