"""What FP8 training (``train.precision = fp8``) costs beyond its GEMMs, each scaling recipe's
casts, copies and rates; which GEMMs run in FP8 and the amax collectives are the plan's
policy, :mod:`parcompile.ir.fp8`. The one place these costs live: the compute report counts
the FP8 GEMMs' FLOPs and the elements their casts read (:func:`is_fp8_gemm`,
:func:`cast_elements`), the time model prices them (:func:`fp8_costs`), the step
collectives gather FP8 weights (:func:`gathers_fp8`; each bucket's two all-gathers sized by
:func:`parcompile.core.buckets.fp8_gather_elements`), a layer's tp all-gathers move FP8 under
tensorwise (:func:`parcompile.ir.fp8.moved_bytes`, read by the report and the time model), the memory model keeps
their FP8 copies (:func:`weight_copy_bytes`), plan.json says what was assumed
(:func:`assumptions`).

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
from parcompile.core.model import GATED_ACTIVATIONS
from parcompile.ir.graph import Graph, Node
from parcompile.ir.fp8 import RECIPES, bf16_layers, enabled, gathers_fp8, is_fp8_gemm
from parcompile.ir.ops import Trait


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
    #: whether the casts read a tp all-gather's local input and a reduce-scatter's local
    #: output gradient (:func:`cast_elements`' ``input_tp``, ``output_tp``)
    sharded_casts: bool = False


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
                    w_fwd * per, r.amax and tp > 1, r.amax and tp > 1 and not cached_weights, tp_casts)


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
