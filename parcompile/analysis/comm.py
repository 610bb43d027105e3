"""Communication per step: the collectives each rank of a stage runs, and the bytes the
busiest rank of each axis sends (SPEC 3 `comm`; docs/internals.md's table).

Entries ``{op, axis, bytes, count, where, stage, phase}``: ``bytes`` is the size of the
tensor the collective produces on one rank, ``count`` how often it runs per step on one
rank of ``stage``. Per-micro-batch collectives run ``m`` times (twice with
``recompute = full`` for the forward collectives of layers, which the recomputed forward
runs again).

Bytes sent per rank under ring algorithms, group of ``n`` ranks: all-reduce
``2 (n-1)/n * bytes``; all-gather ``(n-1)/n * bytes`` (bytes = gathered output);
reduce-scatter ``(n-1) * bytes`` (= ``(n-1)/n`` of the full input); all-to-all
``(n-1)/n * bytes``; send ``bytes``; recv nothing.

MoE token all-to-alls (and their all-gathers / reduce-scatters over expert_tp) assume
balanced routing: every rank receives as many (token, expert) rows as it sends,
``b * s_local * top_k``; such entries carry ``routed`` and ``bytes_per_row``. ``per_step`` maps each SPEC axis
(``tp dp pp cp ep``) to the largest, over stages, of those sums; group axes fold into
them: ``dp_cp``/``expert_dp`` -> dp, ``embedding`` -> pp, ``expert_tp`` -> tp.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping, NamedTuple

from parcompile.analysis.compute import recomputed as recomputed_op
from parcompile.core.recompute import is_module_list
from parcompile.analysis.compute import op_fwd_flops
from parcompile.ir.fp8 import amax_collectives, is_fp8_gemm, moved_bytes
from parcompile.core.axes import AXIS_FAMILY, DEGREE_AXES
from parcompile.ir.graph import Graph
from parcompile.ir.ops import Collective, Trait, op_collectives


class CollectiveEntry(NamedTuple):
    """One row of ``comm.collectives`` (module docstring). A named tuple: the search
    builds these rows for every layout it costs
    (:func:`parcompile.passes.insert_collectives.step_entries`), and a tuple builds faster."""

    op: str
    axis: str
    bytes: int
    count: int
    where: str
    stage: int
    phase: str
    #: > 0 for MoE token traffic whose size depends on the router: ``bytes`` is the balanced
    #: estimate, ``bytes_per_row`` what one routed token row adds (``verify`` recomputes the
    #: size from the rows the router actually sent)
    bytes_per_row: int = 0
    #: > 0 where the generated program moves another size than ``bytes`` (the FP8 tp
    #: all-gathers of :func:`parcompile.ir.fp8.moved_bytes`, which the program runs in 16 bits
    #: and casts after): that size, what ``verify`` measures
    program_bytes: int = 0

    def to_dict(self) -> dict:
        d = {"op": self.op, "axis": self.axis, "bytes": self.bytes, "count": self.count,
             "where": self.where, "stage": self.stage, "phase": self.phase}
        if self.bytes_per_row:
            d["routed"] = True
            d["bytes_per_row"] = self.bytes_per_row
        if self.program_bytes:
            d["program_bytes"] = self.program_bytes
        return d


@dataclass(frozen=True)
class CommReport:
    """``collectives`` in stage then graph order; ``per_step`` bytes sent per SPEC axis;
    ``raw``: per model chunk, the per-micro-batch collectives (for the time estimate)."""

    collectives: tuple[CollectiveEntry, ...]
    per_step: dict[str, int]
    raw: tuple[tuple[int, int, Collective], ...]   # (stage, chunk, collective)


def sent_bytes(op: str, nbytes: int, n: int) -> Fraction:
    """Bytes one rank sends for one collective of ``nbytes`` in a group of ``n`` (ring)."""
    if n <= 1:
        return Fraction(0)
    if op == "all_reduce":
        return Fraction(2 * (n - 1) * nbytes, n)
    if op in ("all_gather", "all_to_all"):
        return Fraction((n - 1) * nbytes, n)
    if op == "reduce_scatter":
        return Fraction((n - 1) * nbytes)
    if op == "send":
        return Fraction(nbytes)
    return Fraction(0)


def _in_layer(graph: Graph, name: str) -> bool:
    """Whether a collective runs again when its layer is recomputed: the tensor it converts
    is produced inside a decoder layer (the embedding's reduction feeds layer 0 but is not
    part of it, so a layer's recomputation does not repeat it)."""
    ins = graph.inputs(name)
    producer = graph.node(ins[0]) if ins else graph.node(name)
    return producer.op.layer is not None


def overlapped_gemm_flops(graph: Graph, nd, degrees: Mapping[str, int]) -> tuple[int, int]:
    """The forward FLOPs on one rank, ``(FP8-eligible, other)``
    (:func:`parcompile.ir.fp8.is_fp8_gemm`), of the GEMMs a tensor-parallel
    ``redistribute`` op ``nd`` feeds or drains: the linears reading an all-gather's output
    (sequence parallelism's column-parallel inputs: q, k and v; gate and up), the linear whose
    output a reduce-scatter sums (the row-parallel output and down projections), in a decoder
    layer (Transformer Engine's linears; Megatron-Core's output layer is its own
    ``ColumnParallelLinear``, whose forward all-gather blocks); ``(0, 0)`` for other ops. Its backward collectives pair with the same GEMMs' backward ones (the
    input gradient's GEMM and the weight gradient's, each as many FLOPs as the forward):
    Transformer Engine's userbuffers overlap each collective with one of them
    (:func:`parcompile.analysis.estimate.tp_exposed`)."""
    a = nd.op.attr_map
    fwd = {k for k, axis in a.get("fwd", ()) if axis == "tp"}
    if not nd.has_trait(Trait.CONVERSION) or not fwd & {"all_gather", "reduce_scatter"}:
        return 0, 0
    if "all_gather" in fwd:
        gemms = [graph.node(u) for u, _ in graph.users(nd.name)]
    else:
        gemms = [graph.node(u) for u in graph.inputs(nd.name)[:1]]
    f8 = f16 = 0
    for g in gemms:
        if g.kind != "linear" or g.op.layer is None:
            continue   # the LM head is Megatron's own ColumnParallelLinear, not a userbuffers one
        f = op_fwd_flops(graph, g, degrees)
        if is_fp8_gemm(g, graph):
            f8 += f
        else:
            f16 += f
    return f8, f16


def _add_fp8_amax(graph: Graph, nd, degrees: Mapping[str, int], m: int, recompute: str, counts: dict,
                  order: dict) -> None:
    """The FP8 amax all-reduces over tp (expert_tp for routed experts) op ``nd`` runs
    (:func:`parcompile.ir.fp8.amax_collectives`; the experts' row-dependent ones marked
    ``routed`` with their ``bytes_per_row``), ``m`` per step and again in a fully recomputed forward, as rows of
    ``comm.collectives`` (``where`` ``fp8_amax_tp``). Not in ``raw``: the time model prices
    the recipe's amaxes itself (:func:`parcompile.analysis.fp8.fp8_costs`)."""
    coll = amax_collectives(graph, nd, degrees)
    if not coll:
        return
    stage = nd.stage or 0
    again = recompute == "full"   # every FP8 linear is in a layer: its forward runs again
    for op, axis, nbytes, phase, per_row in coll:
        for ph in (phase, "recompute") if again and phase == "forward" else (phase,):
            key = (op, axis, nbytes, "fp8_amax_tp", stage, ph, per_row)
            counts[key] = counts.get(key, 0) + m
            order.setdefault(key, len(order))


def comm_report(graph: Graph, degrees: Mapping[str, int], num_microbatches: int, recompute: str,
                pp: int, no_backward: frozenset[str] = frozenset(),
                no_regather: frozenset[str] = frozenset()) -> CommReport:
    """Collect every op's collectives (:func:`parcompile.ir.ops.op_collectives`) at the bytes
    they move (:func:`parcompile.ir.fp8.moved_bytes`: FP8 tp all-gathers at 1 byte per element
    plus scales), read alike by ``comm.collectives``, ``per_step`` and the time model (``raw``); a
    tensor-parallel all-gather's or reduce-scatter's carry the FLOPs of the GEMMs they
    overlap under ``cluster.tp_comm_overlap`` (:func:`overlapped_gemm_flops`). ``no_backward``:
    the ops no gradient reaches, whose backward collectives do not run; ``no_regather``: the
    sequence-parallel conversions marked ``regather`` whose input no layer keeps for a weight
    gradient (both LoRA's frozen weights: :func:`parcompile.analysis.lora.frozen_backward`)."""
    m = num_microbatches
    counts: dict[tuple, int] = {}
    program: dict[tuple, int] = {}   # (op, axis, bytes, where): the program's own size where it differs
    order: dict[tuple, int] = {}
    raw = []
    for nd in graph.nodes():
        ins = graph.inputs(nd.name)
        local_in = [r.local_type(graph.node(u).type, degrees) for r, u in zip(nd.requires, ins)]
        local_out = nd.sharding.local_type(nd.type, degrees)
        pair = overlapped_gemm_flops(graph, nd, degrees) if nd.has_trait(Trait.CONVERSION) else (0, 0)
        for c in op_collectives(nd, degrees, local_in, local_out):
            if c.phase == "backward" and nd.name in no_backward:
                continue
            nbytes = moved_bytes(graph, nd, c)
            if nbytes != c.bytes:
                program[(c.op, c.axis, nbytes, c.where)] = c.bytes
                c = dataclasses.replace(c, bytes=nbytes)
            if pair != (0, 0) and c.axis == "tp":
                c = dataclasses.replace(c, gemm_flops=pair)
            stage = c.stage if c.stage is not None else (nd.stage or 0)
            if c.per == "microbatch":
                raw.append((stage, nd.chunk or 0, c))
            n = m if c.per == "microbatch" else c.count
            phases = [(c.phase, n)]
            recomputed = (recompute == "full" and not nd.has_trait(Trait.STAGE_TRANSFER) and _in_layer(graph, nd.name)
                          or is_module_list(recompute) and recomputed_op(nd, recompute))
            if recomputed and c.phase == "forward":
                phases.append(("recompute", n))
            if nd.op.attr("regather") and c.phase == "forward" and not recomputed and nd.name not in no_regather:
                # sequence parallelism: the kept split input is all-gathered again in backward
                phases.append(("backward", n))
                raw.append((stage, nd.chunk or 0, dataclasses.replace(c, phase="backward")))
            for phase, cnt in phases:
                key = (c.op, c.axis, c.bytes, c.where, stage, phase, c.bytes_per_row)
                counts[key] = counts.get(key, 0) + cnt
                order.setdefault(key, len(order))
        _add_fp8_amax(graph, nd, degrees, m, recompute, counts, order)
    entries = sorted(counts, key=lambda k: (k[4], order[k]))
    colls = tuple(CollectiveEntry(op, axis, b, counts[(op, axis, b, w, s, ph, r)], w, s, ph, r,
                                  program.get((op, axis, b, w), 0))
                  for (op, axis, b, w, s, ph, r) in entries)
    return CommReport(colls, per_step_sent(colls, degrees, pp), tuple(raw))


def per_step_sent(colls, degrees: Mapping[str, int], pp: int) -> dict[str, int]:
    """``comm.per_step``: per SPEC axis, the bytes the busiest stage's rank sends in a step
    for the collectives ``colls`` (:class:`CollectiveEntry` rows, ring algorithms)."""
    per_stage = [{a: Fraction(0) for a in DEGREE_AXES} for _ in range(pp)]
    for e in colls:
        fam = AXIS_FAMILY.get(e.axis, e.axis)
        per_stage[e.stage][fam] += sent_bytes(e.op, e.bytes, degrees.get(e.axis, 1)) * e.count
    return {a: int(round(max(st[a] for st in per_stage))) for a in DEGREE_AXES}
