"""FLOPs from the graph (matmuls only; see :mod:`parcompile.ir.ops`).

* ``model_flops_per_step``: forward + backward (3x forward) of every matmul of the model
  for the whole global batch, unpadded vocabulary, attention without causal halving and
  without recomputation. For a GPT layer (MHA, ffn = 4h) this is Korthikanti et al.
  (2022), eq. in section 6: ``72 B s L h^2 (1 + s/(6h) + V/(12hL))``; computed from the
  graph, it generalises to GQA, SwiGLU and sliding windows.
* ``hardware_flops_per_step``: the same with the padded vocabulary, plus the forward
  FLOPs recomputed in backward (``recompute = full``: every layer op; ``selective``: the
  attention core).
* per model chunk: the forward FLOPs of one micro-batch on one rank, and the bytes its
  non-matmul kernels move (``OpSpec.traffic``; the cost model's inputs), with the part of
  each that recomputation runs again.
* per model chunk, what the time model (:mod:`parcompile.analysis.estimate`) reads beyond
  the FLOPs: the fused attention kernels' FLOPs and the work they run (a causal kernel
  skips the masked blocks, :func:`causal_share`), the bytes the matmuls' operands and
  results move (proportional to the tokens) and the weights they read (the same whatever
  the tokens: the expert weights a grouped GEMM reads once per micro-batch), each with its
  recomputed part. Which kernel each attention core runs, fused or not, at what relative
  speed and over which score blocks, is :mod:`parcompile.core.attention`'s table, read for
  the engine's row (``kernels``: :func:`parcompile.core.attention.attention_engine`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Mapping

from parcompile.core.recompute import is_module_list, modules_of
from parcompile.ir.recompute import node_modules
from parcompile.ir.fp8 import is_fp8_gemm
from parcompile.analysis.efficiency import DEFAULT_ENGINE, ENGINES
from parcompile.analysis.fp8 import cast_elements, cast_input
from parcompile.core.attention import with_kernel
from parcompile.core.model import GATED_ACTIVATIONS
from parcompile.ir.graph import Graph, Node
from parcompile.ir.ops import Trait, spec


BACKWARD_FACTOR = 2  # backward FLOPs = 2 x forward


def op_fwd_flops(graph: Graph, nd: Node, degrees: Mapping[str, int] | None = None) -> int:
    """Forward matmul FLOPs of one op for one micro-batch: global when ``degrees`` is None,
    else on one rank (local types)."""
    s = spec(nd.kind)
    ins = graph.input_types(nd.name)
    if degrees is None:
        return s.fwd_flops(nd.op.attr_map, ins, nd.type)
    local_in = [r.local_type(t, degrees) for r, t in zip(nd.requires, ins)]
    return s.fwd_flops(nd.op.attr_map, local_in, nd.sharding.local_type(nd.type, degrees))


def op_fwd_traffic(graph: Graph, nd: Node, degrees: Mapping[str, int]) -> int:
    """Bytes the op's non-matmul kernels move in the forward of one micro-batch on one rank."""
    s = spec(nd.kind)
    local_in = [r.local_type(t, degrees) for r, t in zip(nd.requires, graph.input_types(nd.name))]
    return s.traffic(nd.op.attr_map, local_in, nd.sharding.local_type(nd.type, degrees))


def causal_share(attrs: Mapping) -> float:
    """The share of an attention core's ``s x s_kv`` score blocks a causal fused kernel
    computes (FlashAttention skips the blocks above the diagonal): ``(S + 1) / 2S`` for full
    attention over ``S = seq_len`` positions, ``1 - (w - 1) / 2S`` for a sliding window of
    ``w`` (the first ``w`` queries see fewer keys). Context parallelism balances the
    causal work over its ranks (Megatron-Core's zig-zag split), so the share is the same."""
    seq = attrs["seq_len"]
    w = attrs.get("window") or 0
    if 0 < w < seq:
        return 1 - (w - 1) / (2 * seq)
    return (seq + 1) / (2 * seq)


def gemm_bytes(graph: Graph, nd: Node, degrees: Mapping[str, int]) -> tuple[int, int]:
    """(operand bytes, weight bytes) one forward of a matmul op (``Trait.GEMM``: ``attention`` is costed as its own kernel) moves
    on one rank: each matrix reads its ``M x K`` input and writes its ``M x N`` output
    (proportional to the tokens), and reads its ``K x N`` weight once (the op's local
    parameters: a grouped GEMM reads each local expert's weights once per micro-batch).
    0, 0 for other ops."""
    if not nd.has_trait(Trait.GEMM):
        return 0, 0
    local_in = [r.local_type(t, degrees) for r, t in zip(nd.requires, graph.input_types(nd.name))]
    out = nd.sharding.local_type(nd.type, degrees)
    weights = sum(p.sharding.local_type(p.type, degrees).nbytes for p in nd.params)
    x = local_in[0]
    if nd.kind == "experts":
        a = nd.op.attr_map
        rows, h = x.numel // x.dims[-1].size, x.dims[-1].size
        mats = 3 if a["activation"] in GATED_ACTIVATIONS else 2
        return rows * (h + a["ffn"]) * mats * x.itemsize, weights
    return x.nbytes + out.nbytes, weights


#: the engines whose ``recompute = selective`` is torchtitan's op-level policy: those whose
#: ``Engine.sac`` is ``"op"`` in :data:`parcompile.analysis.efficiency.ENGINES` (tests/test_analysis.py
#: pins the two equal)
OP_SAC_ENGINES = frozenset({"eager", "compile", "automodel"})


def op_sac(graph: Graph, recompute: str, engine: str = "megatron", fp8: bool = False) -> frozenset[str] | None:
    """``recompute = selective`` under an engine whose ``Engine.sac`` is ``"op"`` (``eager``,
    ``compile``, ``automodel``: :data:`parcompile.analysis.efficiency.ENGINES`) is torchtitan's op-level
    selective activation checkpointing (``selective_ac_option = "op"``,
    ``torchtitan/models/llama3/infra/parallelize.py``: the outputs of the matmuls and of
    the attention kernel are saved, every other matmul of a layer, counted in forward
    order, and every other op are recomputed): the names of the recomputed linears (the
    2nd, 4th, ... of each layer). None for every other recompute mode and engine
    (``selective`` is then Megatron-LM's: the attention core, Korthikanti et al. 2022).

    With ``fp8`` (``precision = fp8``) every FP8 linear is recomputed and the count runs over
    the others: the policy saves the outputs of ``aten.mm`` and not those of
    ``aten._scaled_mm``, which Float8Linear calls (its ``_save_list``, torchtitan
    ``torchtitan/models/llama3/parallelize_llama.py`` at 820504e: ``aten.mm``, the SDPA
    kernels, ``reduce_scatter_tensor`` and ``max``: the version of the FP8 calibration rows)."""
    if recompute != "selective" or (engine or "megatron") not in OP_SAC_ENGINES:
        return None
    count: dict[int, int] = {}
    out = set()
    for nd in graph.nodes():
        if nd.op.layer is None or nd.kind != "linear":
            continue
        if fp8 and is_fp8_gemm(nd, graph):
            out.add(nd.name)
            continue
        k = count[nd.op.layer] = count.get(nd.op.layer, 0) + 1
        if k % 2 == 0:
            out.add(nd.name)
    return frozenset(out)


def gemm_shapes(graph: Graph, nd: Node, degrees: Mapping[str, int]) -> list[tuple[int, int, int, int]]:
    """The GEMMs one forward of op ``nd`` runs on one rank, as ``(m, n, k, batch)``
    (:mod:`parcompile.analysis.gemm`; ``m`` the rows, which grow with the tokens): a ``linear``
    or ``router``, its rows by its local ``(in, out)`` widths; an ``experts`` op, each weight
    matrix as a grouped GEMM over the local experts with the rows each receives under
    balanced routing (its local routed rows over the local experts: ``tokens * top_k /
    experts`` of the tokens its ep group dispatches; dropless, no capacity factor: the
    routing runtime/model/moe.py runs); SwiGLU's gate and up as one ``2 ffn`` wide GEMM
    (Megatron-Core's and Transformer Engine's fused fc1); an unfused attention core, its
    ``Q K^T`` and ``A V`` batched over the local heads; any other op with matmul FLOPs, one
    cube of its FLOPs (``m = n = k``). Empty for ops without
    matmuls and for fused attention cores (timed as their kernel)."""
    flops = op_fwd_flops(graph, nd, degrees)
    if not flops:
        return []
    local_in = [r.local_type(t, degrees) for r, t in zip(nd.requires, graph.input_types(nd.name))]
    x = local_in[0]
    a = nd.op.attr_map
    if nd.kind in ("linear", "router"):
        k = x.dims[-1].size
        out = nd.sharding.local_type(nd.type, degrees)
        n = out.dims[-1].size
        return [(out.numel // n, n, k, 1)]
    if nd.kind == "experts":
        weights = [p.sharding.local_type(p.type, degrees) for p in nd.params if p.name.endswith(".weight")]
        local = weights[0].dims[0].size if weights and len(weights[0].dims) == 3 else 1
        h = x.dims[-1].size
        rows = -(-(x.numel // h) // local)
        ffn = flops // (2 * (x.numel // h) * h * (3 if a["activation"] in GATED_ACTIVATIONS else 2))
        first = 2 * ffn if a["activation"] in GATED_ACTIVATIONS else ffn
        return [(rows, first, h, local), (rows, h, ffn, local)]
    if nd.has_trait(Trait.ATTENTION):
        b, s = x.shape[0], x.shape[1]
        d = a["head_dim"]
        heads = x.dims[-1].size // d
        s_kv = min(a["seq_len"], a["window"]) if a.get("window") else a["seq_len"]
        dv = a.get("v_head_dim", d)
        return [(s, s_kv, d, b * heads), (s, dv, s_kv, b * heads)]
    side = max(1, round((flops / 2) ** (1 / 3)))
    return [(side, side, side, 1)]


def gemm_seconds(graph: Graph, nd: Node, degrees: Mapping[str, int], gemm, fp8: bool) -> tuple[float, float, float]:
    """``(t, base, slope)``: seconds ``t`` of op ``nd``'s GEMMs (:func:`gemm_shapes`) on one rank
    by ``gemm`` (a :class:`~parcompile.analysis.gemm.GemmPricer`, its training mean of each
    GEMM's three; an ``experts`` op's as the engine's grouped GEMM schedules its local experts,
    :func:`parcompile.analysis.gemm.grouped_gemm_seconds`), FP8 where ``fp8`` and the op runs FP8
    GEMMs (:func:`parcompile.ir.fp8.is_fp8_gemm`); and a line below ``t(r)``, the seconds at ``r`` times the tokens (rows, or attention's
    batch), which tiles, waves and fixed times keep from being affine: ``slope`` the least of
    the chords ``(t(2r) - t(r)) / r`` over ``r = 1 .. 32``, ``base`` the least of ``t(r) - r
    slope`` over ``r = 1/8 .. 64`` (the search scales the line, :meth:`ComputeReport.scaled`)."""
    shapes = gemm_shapes(graph, nd, degrees)
    if not shapes:
        return 0.0, 0.0, 0.0
    return _gemm_line(gemm, tuple(shapes), fp8 and is_fp8_gemm(nd, graph), nd.has_trait(Trait.ATTENTION),
                      nd.kind == "experts")


@lru_cache(maxsize=1 << 14)
def _gemm_line(gemm, shapes: tuple, f8: bool, attn: bool, grouped: bool = False) -> tuple[float, float, float]:
    """:func:`gemm_seconds` of ``shapes``, cached; ``grouped``: an ``experts`` op's grouped GEMMs
    (:func:`parcompile.analysis.gemm.grouped_gemm_seconds`)."""
    def t(r: float) -> float:
        return sum(gemm.train_seconds(m, n, k, max(1, round(b * r)), f8) if attn
                   else gemm.train_seconds(max(1, round(m * r)), n, k, b, f8, grouped) for m, n, k, b in shapes)
    slope = min((t(2.0 ** (j + 1)) - t(2.0 ** j)) / 2.0 ** j for j in range(6))
    base = min(t(2.0 ** j) - 2.0 ** j * slope for j in range(-3, 7))
    return t(1), base, slope


def recomputed(nd: Node, recompute: str, sac: frozenset[str] | None = None) -> bool:
    """Whether ``recompute`` (a mode or a list of modules) re-runs this op's forward during backward; ``sac``: the
    recomputed linears of torchtitan's op-level policy (:func:`op_sac`), which recomputes
    every op of a layer but the other matmuls and the attention core."""
    if recompute == "full":
        return nd.op.layer is not None and not nd.has_trait(Trait.NOT_AN_OP)
    if is_module_list(recompute):
        # Megatron-Core's modules (core/recompute.py): their ops' forward runs again; moe_act
        # reruns only the experts' activation, part of the experts op (:func:`reruns_activation`)
        return bool(node_modules(nd) & (modules_of(recompute) - {"moe_act"})) and not nd.has_trait(Trait.NOT_AN_OP)
    if recompute == "selective":
        if sac is not None:
            if nd.op.layer is None or nd.has_trait(Trait.NOT_AN_OP):
                return False
            if nd.kind == "linear":
                return nd.name in sac
            return not (spec(nd.kind).selective_recompute or nd.has_trait(Trait.GEMM))
        return spec(nd.kind).selective_recompute
    return False


def reruns_activation(nd: Node, recompute: str) -> bool:
    """Whether ``recompute`` re-runs only the activation of the ``experts`` op ``nd`` in
    backward (``moe_act`` without ``moe``): Megatron-Core's ``TEGroupedMLP`` runs
    ``bias_act_func`` again under ``CheckpointWithoutOutput`` (NVIDIA/Megatron-LM d98e8a6
    ``megatron/core/transformer/moe/experts.py``), not the grouped GEMMs. The activation is
    the experts op's non-matmul kernel: its forward's bytes are the op's ``OpSpec.traffic``
    (``ir/ops/moe.py``: gate and up read, their product written), which
    :func:`compute_report` counts again as it counts a recomputed op's (the same rule as its
    forward: bytes at the elementwise bandwidth, :func:`parcompile.analysis.estimate.chunk_times`)."""
    return (is_module_list(recompute) and nd.kind == "experts" and not recomputed(nd, recompute)
            and "moe_act" in node_modules(nd) & modules_of(recompute))


@dataclass(frozen=True)
class ComputeReport:
    """FLOPs per step (whole cluster) and per model chunk (one rank, one micro-batch)."""

    model_flops_per_step: int
    hardware_flops_per_step: int
    #: per model chunk: forward FLOPs, and recomputed forward FLOPs, one rank, one micro-batch
    chunk_fwd_flops: tuple[int, ...]
    chunk_recompute_flops: tuple[int, ...]
    #: per model chunk: forward bytes moved by non-matmul kernels, and the recomputed part
    chunk_fwd_traffic: tuple[int, ...] = ()
    chunk_recompute_traffic: tuple[int, ...] = ()
    #: per model chunk, one rank, one micro-batch (module docstring): fused attention cores'
    #: FLOPs (part of ``chunk_fwd_flops``) and the FLOPs their causal kernels run
    #: (:func:`causal_share`); matmul operand bytes; weight bytes; and the recomputed parts
    chunk_attn_flops: tuple[float, ...] = ()
    chunk_attn_work: tuple[float, ...] = ()
    #: per model chunk: ``chunk_attn_work`` over the head dim (4 x the score elements the
    #: kernels compute: one exponential each, :func:`parcompile.analysis.estimate.chunk_times`)
    chunk_attn_scores: tuple[float, ...] = ()
    chunk_gemm_traffic: tuple[int, ...] = ()
    chunk_weight_traffic: tuple[int, ...] = ()
    #: per model chunk: the local experts of its MoE layers, summed over the layers (each token
    #: dispatch's ``local_experts``): the experts' per-expert host work in one forward
    #: (:attr:`parcompile.analysis.efficiency.Engine.expert_host`), whatever the tokens
    chunk_moe_experts: tuple[int, ...] = ()
    chunk_recompute_attn_flops: tuple[float, ...] = ()
    chunk_recompute_attn_work: tuple[float, ...] = ()
    chunk_recompute_attn_scores: tuple[float, ...] = ()
    chunk_recompute_gemm_traffic: tuple[int, ...] = ()
    chunk_recompute_weight_traffic: tuple[int, ...] = ()
    chunk_recompute_moe_experts: tuple[int, ...] = ()
    #: per model chunk, one rank, one micro-batch: the graph ops the program runs in the
    #: forward (every node but inputs, pipeline transfers and step collectives: a
    #: ``redistribute`` is one op too, its collective timed apart), and those recomputation
    #: runs again; the time model charges each ``cluster.op_overhead`` (:func:`count_ops`)
    chunk_fwd_ops: tuple[int, ...] = ()
    chunk_recompute_ops: tuple[int, ...] = ()
    #: per model chunk, one rank, one micro-batch: the forward FLOPs of the GEMMs that run in
    #: FP8 under ``precision = fp8`` (:func:`parcompile.ir.fp8.is_fp8_gemm`; part of
    #: ``chunk_fwd_flops``), the elements of their inputs, outputs and weights (what their
    #: casts read: :func:`parcompile.analysis.fp8.cast_elements`), their count, and the
    #: recomputed parts. Counted whatever the precision; the time model reads them with FP8
    #: (``_tp``: the tp-sharded sizes, :func:`parcompile.analysis.fp8.cast_elements`; a
    #: tensor read by several FP8 GEMMs counted once, :func:`parcompile.analysis.fp8.cast_input`)
    chunk_fp8_flops: tuple[int, ...] = ()
    chunk_fp8_in: tuple[int, ...] = ()
    chunk_fp8_in_tp: tuple[int, ...] = ()
    chunk_fp8_out: tuple[int, ...] = ()
    chunk_fp8_out_tp: tuple[int, ...] = ()
    chunk_fp8_weight: tuple[int, ...] = ()
    chunk_fp8_gemms: tuple[int, ...] = ()
    #: per model chunk: the FP8 GEMM inputs a tp all-gather produced (counted once per
    #: tensor) and the FP8 GEMM outputs a tp reduce-scatter reads: tensorwise scales of
    #: sharded tensors (:class:`parcompile.analysis.fp8.Fp8Costs`)
    chunk_fp8_gathered: tuple[int, ...] = ()
    chunk_fp8_scattered: tuple[int, ...] = ()
    #: per model chunk: the input elements the FP8 GEMMs read, each GEMM its own (not shared
    #: as the casts are): read at 1 byte, as their weights (``chunk_fp8_weight``), not at the
    #: dtype's that ``chunk_gemm_traffic`` and ``chunk_weight_traffic`` count; and the recomputed part
    chunk_fp8_operands: tuple[int, ...] = ()
    chunk_recompute_fp8_operands: tuple[int, ...] = ()
    chunk_recompute_fp8_flops: tuple[int, ...] = ()
    chunk_recompute_fp8_in: tuple[int, ...] = ()
    chunk_recompute_fp8_in_tp: tuple[int, ...] = ()
    chunk_recompute_fp8_weight: tuple[int, ...] = ()
    #: per model chunk, one rank, one micro-batch: seconds of its GEMMs by the GEMM-rate model
    #: (:func:`gemm_seconds`: each the mean of its forward, input- and weight-gradient GEMMs),
    #: and below them, for the search's floors (:meth:`scaled`), a line in the tokens' scale
    #: ``r``: ``chunk_gemm_base + r chunk_gemm_slope``; and the recomputed parts. Empty: not timed
    chunk_gemm_seconds: tuple[float, ...] = ()
    chunk_gemm_base: tuple[float, ...] = ()
    chunk_gemm_slope: tuple[float, ...] = ()
    chunk_recompute_gemm_seconds: tuple[float, ...] = ()
    chunk_recompute_gemm_base: tuple[float, ...] = ()
    chunk_recompute_gemm_slope: tuple[float, ...] = ()

    def scaled(self, r: float) -> "ComputeReport":
        """This report at ``r`` times the tokens of a micro-batch, for the search's floors
        (``layout_search/bounds.py``): the fields of :attr:`PER_TOKEN` times ``r``, the weights
        read as they are, the GEMMs' seconds at their line below (:func:`gemm_seconds`), affine
        in ``r`` as the floors' line through micro-batches 1 and 2 needs."""
        out = {k: tuple(x * r for x in getattr(self, k)) for k in self.PER_TOKEN}
        for pre in ("chunk_", "chunk_recompute_"):
            base, slope = getattr(self, pre + "gemm_base"), getattr(self, pre + "gemm_slope")
            out[pre + "gemm_seconds"] = tuple(b + r * a for b, a in zip(base, slope))
        return replace(self, **out)

    #: the fields that grow with the tokens of a micro-batch (the search scales them)
    PER_TOKEN = ("chunk_fwd_flops", "chunk_recompute_flops", "chunk_fwd_traffic", "chunk_recompute_traffic",
                 "chunk_attn_flops", "chunk_attn_work", "chunk_attn_scores", "chunk_gemm_traffic",
                 "chunk_recompute_attn_flops", "chunk_recompute_attn_work", "chunk_recompute_attn_scores",
                 "chunk_recompute_gemm_traffic", "chunk_fp8_flops", "chunk_fp8_in", "chunk_fp8_in_tp",
                 "chunk_fp8_out", "chunk_fp8_out_tp", "chunk_recompute_fp8_flops", "chunk_recompute_fp8_in",
                 "chunk_recompute_fp8_in_tp", "chunk_fp8_operands", "chunk_recompute_fp8_operands")


def fused_attention_work(graph: Graph, nd: Node, a: Mapping, degrees: Mapping[str, int]) -> dict[str, float]:
    """A fused attention core's forward on one rank under ``degrees`` (``a``: its attributes,
    the kernel resolved, :func:`parcompile.core.attention.with_kernel`), for
    :func:`compute_report`: ``af`` its local FLOPs, ``aw`` the work its kernel runs (the
    causal blocks; a sliding window's only where the kernel skips the masked blocks, else
    every causal block of the full sequence) over the kernel's relative ``speed``, ``as``
    that work per head dim (the scores, whose exponentials the time model weighs)."""
    kernel = spec(nd.kind).kernel(a)   # the op's one decision (ir/ops/attention.py)
    local = op_fwd_flops(graph, nd, degrees)
    if kernel.skips_masked_blocks:
        work = local * causal_share(a)
    else:   # every causal block of the full sequence, the window only masked
        plain = {**a, "window": 0}
        full = replace(nd, op=replace(nd.op, attrs=tuple(plain.items())))
        work = op_fwd_flops(graph, full, degrees) * causal_share(plain)
    work /= kernel.speed
    return {"af": local, "aw": work, "as": work / a["head_dim"]}


def _count_fp8_casts(graph: Graph, nd: Node, degrees: Mapping[str, int], f8: dict[str, list], c: int,
                     again: bool, cast_seen: set[str]) -> None:
    """Add node ``nd``'s FP8 GEMM counters (:data:`F8_KEYS`, :func:`parcompile.analysis.fp8.cast_elements`)
    to chunk ``c`` of ``f8`` for :func:`compute_report` (``again``: it is recomputed);
    GEMMs that share an input count its cast once (``cast_seen``)."""
    x, xt, y, yt, w = cast_elements(graph, nd, degrees)
    if not x:
        return
    f8["op"][c] += x
    if again:
        f8["rop"][c] += x
    if cast_input(graph, nd) in cast_seen:   # one cast for the GEMMs that share an input
        x = xt = 0
    cast_seen.add(cast_input(graph, nd))
    f = op_fwd_flops(graph, nd, degrees)
    for k, v in (("f", f), ("i", x), ("it", xt), ("o", y), ("ot", yt), ("w", w), ("n", 1),
                 ("g", int(x != xt)), ("s", int(y != yt))):
        f8[k][c] += v
    if again:
        for k, v in (("rf", f), ("ri", x), ("rit", xt), ("rw", w)):
            f8[k][c] += v


def compute_report(graph: Graph, degrees: Mapping[str, int], num_chunks: int, vocab: int, padded_vocab: int,
                   num_microbatches: int, recompute: str, engine: str = "megatron",
                   kernels: str | None = None, fp8: bool = False, gemm=None) -> ComputeReport:
    """Build the :class:`ComputeReport`. The graph's batch dim is one micro-batch over all
    data-parallel ranks, so a step is ``num_microbatches`` graphs. ``engine``:
    ``cluster.engine`` (torchtitan's selective recomputation under ``eager``); ``kernels``:
    the row of the attention kernel table the cores run
    (:func:`parcompile.core.attention.attention_engine`; None: ``engine``). A fused core's
    work is the FLOPs its kernel runs (causal blocks; a sliding window's only where the
    kernel skips the masked blocks) over the kernel's relative ``speed``. ``fp8``: the spec
    trains in FP8 (:func:`op_sac`'s policy recomputes the FP8 linears). ``gemm``: the cluster's
    :class:`~parcompile.analysis.gemm.GemmPricer`, which times every GEMM of
    :func:`gemm_shapes` (``chunk_gemm_seconds``; None: not timed)."""
    model = hw = 0
    fwd = [0] * num_chunks
    rec = [0] * num_chunks
    traffic = [0] * num_chunks
    rec_traffic = [0] * num_chunks
    parts = {k: [0] * num_chunks for k in ("af", "aw", "as", "gt", "wt", "md", "gs", "gb", "ga")}
    rparts = {k: [0] * num_chunks for k in parts}
    ops = [0] * num_chunks
    rec_ops = [0] * num_chunks
    f8 = {k: [0] * num_chunks for k in F8_KEYS}
    cast_seen: set[str] = set()
    sac = op_sac(graph, recompute, engine, fp8)
    # a dispatcher that sends each token once per rank (DeepEP, Engine.dedup_dispatch) permutes the rows
    # once each way, not twice (ir/ops/moe.py)
    one_permutation = getattr(ENGINES.get(engine or DEFAULT_ENGINE), "dedup_dispatch", False)
    for nd in graph.nodes():
        c = nd.chunk or 0
        again = recomputed(nd, recompute, sac)
        if counts_as_op(nd):
            ops[c] += 1
            rec_ops[c] += again
        if nd.has_trait(Trait.ATTENTION):
            # the engine's kernel (core/attention.py): its memory and traffic rules read it
            a = with_kernel(nd.op.attr_map, kernels or engine)
            nd = replace(nd, op=replace(nd.op, attrs=tuple(a.items())))
        if nd.has_trait(Trait.ATTENTION) and spec(nd.kind).kernel(a).fused:
            for k, v in fused_attention_work(graph, nd, a, degrees).items():
                parts[k][c] += v
                if again:
                    rparts[k][c] += v
        else:
            gt, wt = gemm_bytes(graph, nd, degrees)
            md = nd.op.attr_map.get("local_experts", 1) if nd.kind == "moe_dispatch" else 0
            gs, gb, ga = gemm_seconds(graph, nd, degrees, gemm, fp8) if gemm is not None else (0.0, 0.0, 0.0)
            for k, v in (("gt", gt), ("wt", wt), ("md", md), ("gs", gs), ("gb", gb), ("ga", ga)):
                parts[k][c] += v
                if again:
                    rparts[k][c] += v
        if one_permutation and nd.kind in ("moe_dispatch", "moe_combine"):
            # DeepEP sends token rows and regroups them once on arrival (ir/ops/moe.py's traffic with one local expert)
            nd = replace(nd, op=replace(nd.op, attrs=tuple({**nd.op.attr_map, "local_experts": 1}.items())))
        moved = op_fwd_traffic(graph, nd, degrees)
        if moved:
            traffic[c] += moved
            if again or reruns_activation(nd, recompute):
                rec_traffic[c] += moved
        _count_fp8_casts(graph, nd, degrees, f8, c, again, cast_seen)
        g = op_fwd_flops(graph, nd)
        if g == 0:
            continue
        unpadded = g * vocab // padded_vocab if nd.type.has_dim("vocab") else g
        model += unpadded * (1 + BACKWARD_FACTOR)
        hw += g * (1 + BACKWARD_FACTOR) + (g if again else 0)
        local = op_fwd_flops(graph, nd, degrees)
        fwd[c] += local
        if again:
            rec[c] += local
    return ComputeReport(model * num_microbatches, hw * num_microbatches, tuple(fwd), tuple(rec),
                         tuple(traffic), tuple(rec_traffic),
                         *(tuple(parts[k]) for k in ("af", "aw", "as", "gt", "wt", "md")),
                         *(tuple(rparts[k]) for k in ("af", "aw", "as", "gt", "wt", "md")),
                         tuple(ops), tuple(rec_ops),
                         *(tuple(f8[k]) for k in F8_KEYS),
                         *(tuple(d[k]) if gemm is not None else () for d in (parts, rparts) for k in ("gs", "gb", "ga")))


#: the FP8 counters of :func:`compute_report`, in the order of ComputeReport's ``chunk_fp8_*`` fields
F8_KEYS = ("f", "i", "it", "o", "ot", "w", "n", "g", "s", "op", "rop", "rf", "ri", "rit", "rw")

def counts_as_op(nd: Node) -> bool:
    """Whether ``nd`` is one op of a micro-batch's forward for ``cluster.op_overhead``
    (``ComputeReport.chunk_fwd_ops``): every kind but those of ``Trait.NOT_AN_OP`` (the inputs, the
    pipeline's transfers, timed as ``pp_comm``, and the step's collectives)."""
    return not nd.has_trait(Trait.NOT_AN_OP)

