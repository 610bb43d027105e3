"""Automatic planning: fill every ``auto`` of a spec by searching the layouts.

:func:`search` enumerates the layouts the spec leaves open (``dp tp pp cp ep
virtual_stages micro_batch zero recompute schedule sequence_parallel``), keeps those the
checker accepts (:func:`parcompile.frontend.checks.check_config`, the same rules as for a
hand-written spec), drops those that do not fit memory and ranks the rest by estimated
step time.

A candidate is costed without building its graph. Decoder layers are alike, so one
*probe* graph per (tp, cp, sequence_parallel, micro_batch) is built and run through the
real passes up to ``insert-collectives``: a three-layer model on three pipeline ranks,
whose first chunk is the embedding plus one layer, the middle one one layer and the last
one a layer plus the output layer. The analyses of :mod:`parcompile.analysis` run on it
(FLOPs, traffic, collectives, saved activations, buffers, parameters), and a candidate's
chunk ``k`` holding ``n_k`` layers costs ``n_k * layer + [k = 0] embedding + [k = last]
output``. An MoE model whose first ``dense_layers`` layers are dense (DeepSeek's) has a
second probe of the same key whose three layers are dense (:attr:`_Probe.dense_probe`):
a chunk's first ``d_k`` layers among those count as the dense probe's middle layer, the
embedding as its first chunk less that layer (:meth:`_Probe.quad`, :func:`_compose`).
Memory and time are then the same functions the compiler uses
(:func:`~parcompile.analysis.memory.memory_from_parts`,
:func:`~parcompile.analysis.estimate.step_time_parts`, the closed-form pipeline), and
how an axis's groups fall on nodes (the network model's ``k`` ranks per node over
``domains`` nodes) comes from :func:`~parcompile.passes.groups.axis_placement`. Nothing per candidate grows with the
world size; probes are cached, and each of their analyses runs when a layout first needs
it. The best few candidates are then re-timed with their simulated schedules (action
lists), which is what separates zero-bubble from 1F1B.

Only those best few (``max(RETIME, top)``) must be exact, so the layouts are costed best
first by branch and bound (:func:`_rank`): lower bounds on a layout's step time and memory
peak, each cheaper than the costing it bounds and each proven below what it bounds
(:meth:`Coster.family_floor` and :meth:`Coster.family_layout_floor` from a few probes for
whole families of layouts, :meth:`Coster.layout_floor` and :meth:`Coster._split_floors` from
the layout's own probe, :meth:`Coster.step_floor` and :meth:`Coster._dp_floor` for what the
step adds to the pipeline (the data-parallel time, the optimizer), :meth:`Coster.state_floor`
and :meth:`Coster.memory_floor` for memory) skip the layouts that cannot fit or
cannot be among the best (``tests/test_search.py`` holds each bound against what it bounds,
and the search against costing every layout, :data:`BOUNDS` off). The best few, their
figures and their order are those of costing every layout; the ranking past them holds
the layouts costed, and :class:`SearchResult` counts the rest by the rule that skipped
them. On Llama 3.1 405B on 16,384 H100s with every key ``auto`` (``benchmarks/search.py``)
about 70 of 118,000 valid layouts are costed and 33 probes built; on Llama-3 70B on 1,024
H100s, 290 of 90,000 and 28 probes (52 before :meth:`Coster.memory_floor` bounded the
larger micro-batches from the probes of micro-batch 1 and 2); on DeepSeek-V3 (3 dense then 58
MoE layers) on 2,048 H100s, 446 of 34,000 and 60 probes (each with its dense probe).

``parcompile.compile`` uses :func:`resolve` on a spec with ``auto`` keys: the best
candidate's layout, compiled as if the user had written it.
"""

from __future__ import annotations

import heapq
import math
import operator
import sys
import time
from fractions import Fraction
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, NamedTuple

from parcompile.analysis.comm import comm_report
from parcompile.analysis.compute import compute_report
from parcompile.analysis.fp8 import enabled as fp8_enabled
from parcompile.analysis.estimate import (ChunkTimes, dp_exposed, chunk_times, efficiency, engine, links_of,
                                          optimizer_time, pipeline_parts, step_sums)
from parcompile.analysis.memory import (MemoryReport, SavedBytes, buffer_bytes, buffer_total,
                                        closed_form_in_flight, memory_from_parts, saved_bytes, state_bytes)
from parcompile.analysis.buckets import GradUnit, reduces_per_microbatch, reshard_after_forward
from parcompile.analysis.params import StageParams, stage_params
from parcompile.frontend.checks import CHECKS, LAYOUT_READS, CheckContext, check_config
from parcompile.config.schema import ParallelConfig, SpecConfig
from parcompile.config.text import divisors, plural
from parcompile.core.attention import attention_engine
from parcompile.core.axes import GROUP_AXES
from parcompile.diagnostics import Diagnostic, DiagnosticBag, SpecError
from parcompile.passes.manager import PASSES, paused_gc, run_pass
from parcompile.passes.groups import axis_placement
from parcompile.passes.split_pipeline_stages import candidate_splits

#: keys `auto` may stand for (SPEC 1 `parallel`, extended)
SEARCH_KEYS = ("dp", "tp", "pp", "cp", "ep", "virtual_stages", "micro_batch", "zero", "recompute",
               "schedule", "sequence_parallel")
#: largest micro-batch the search tries
MAX_MICRO_BATCH = 16
#: candidates re-timed with their simulated schedule
RETIME = 24
#: rank by branch and bound (:func:`_rank`); off, every layout is costed (the same best
#: ``max(RETIME, top)`` candidates, in the same order: ``tests/test_search.py``)
BOUNDS = True
#: step times within this fraction of the fastest split's count as ties (Coster.choose_split):
#: below the estimate's own resolution
SPLIT_TIME_TIE = 0.01
#: the order ties are broken in (simpler first)
_SCHEDULE_RANK = {"1f1b": 0, "interleaved_1f1b": 1, "zero_bubble": 2, "gpipe": 3}
_RECOMPUTE_RANK = {"none": 0, "selective": 1, "full": 2}


def needs_search(cfg: SpecConfig) -> bool:
    """True when the spec leaves a layout choice to the compiler (``auto`` on a key other
    than ``dp``, which alone is fixed by the world size)."""
    return any(k != "dp" for k in cfg.parallel.auto)


# --------------------------------------------------------------------------------------
# Costing one layout from a probe


class _PerMode(dict):
    """``recompute mode -> value``, each computed the first time it is read."""

    def __init__(self, make: Callable[[str], Any]):
        super().__init__()
        self._make = make

    def __missing__(self, rc: str) -> Any:
        got = self[rc] = self._make(rc)
        return got


class _Probe:
    """What one three-layer probe graph gives (module docstring). The graph is built and
    run through the passes once; each analysis runs the first time a layout reads it, per
    recompute mode (``compute``, ``comm``, ``saved``, ``bufs``: mappings ``rc -> report``),
    so a family of layouts the search bounds out early costs the passes and the reports it
    read only."""

    #: an MoE model's leading dense layers (``dense_layers``, fewer than its layers): the probe of
    #: the same key whose three layers are dense (the probe itself holds MoE layers), else None
    dense_probe: "_Probe | None" = None

    def __init__(self, cfg: SpecConfig, tp: int, cp: int, sp: bool, mb: int, ep: int, expert_tp: int,
                 dense: bool = False):
        from parcompile.ir.lower import lower
        from parcompile.passes.base import PassContext

        pcfg = self.pcfg = _probe_config(cfg, tp, cp, sp, mb, ep, expert_tp, dense)
        ctx = PassContext.of(pcfg)
        try:
            g = lower(pcfg.model, batch=mb, origin=cfg.span("model"))
        except NotImplementedError:
            raise SpecError([Diagnostic(
                "error", f"mixture-of-experts models (experts = {cfg.model.experts}) cannot be searched yet",
                cfg.span("model.experts"), help="set experts = 0 for a dense model",
                note="MoE layers are not lowered yet (issue 8)")]) from None
        for p in PASSES:
            if p.name == "schedule-pipeline":
                break
            run_pass(p, g, ctx, check=False)
        self.graph = g
        self.degrees: dict[str, int] = ctx.degrees
        self.params_of = (tp, ep, expert_tp)
        self.compute = _PerMode(self._compute)
        self.comm = _PerMode(self._comm)
        self.saved = _PerMode(self._saved)
        self.bufs = _PerMode(self._bufs)
        self.times: dict[tuple, ChunkTimes] = {}
        self._params: list[StageParams] | None = None
        self._qparams: tuple[StageParams, ...] | None = None
        self._model_flops: tuple | None = None

    def _compute(self, rc: str):
        m, tp = self.pcfg.model, self.pcfg.parallel.tp
        return compute_report(self.graph, self.degrees, 3, m.vocab, m.padded_vocab(tp), 1, rc, self.pcfg.cluster.engine,
                              attention_engine(self.pcfg.cluster), fp8=fp8_enabled(self.pcfg))

    def _comm(self, rc: str):
        if rc == "selective":   # the same collectives as without recomputation
            return self.comm["none"]
        return comm_report(self.graph, self.degrees, 1, rc, 3)

    def _saved(self, rc: str) -> SavedBytes:
        return saved_bytes(self.graph, self.degrees, 3, rc, self.pcfg.model.dropout > 0, self.pcfg.cluster.engine,
                           attention_engine(self.pcfg.cluster), fp8=fp8_enabled(self.pcfg))

    def _bufs(self, rc: str) -> list[dict[str, int]]:
        pcfg = self.pcfg
        rcfg = pcfg.model_copy(update={"parallel": pcfg.parallel.model_copy(update={"recompute": rc})})
        return buffer_bytes(self.graph, rcfg, self.degrees, self.saved[rc])

    def quad(self, get: Callable[["_Probe"], Any]) -> tuple:
        """``(first, dense middle, middle, last)`` of a per-chunk value ``get(probe)`` (three
        values, one per probe chunk): the first chunk (embedding and a layer) and the middle
        layer of the dense probe (:attr:`dense_probe`), the middle layer and the last chunk
        (a layer and the output layer) of this one; without a dense probe, ``(first,
        middle, middle, last)`` of this one (:func:`_compose`)."""
        a, b, c = get(self)
        d = self.dense_probe
        if d is None:
            return (a, b, b, c)
        da, db, _dc = get(d)
        return (da, db, b, c)

    @property
    def params(self) -> list[StageParams]:
        if self._params is None:
            self._params = stage_params(self.graph, self.degrees, 3, self.pcfg.model.tie_embeddings)
        return self._params

    @property
    def qparams(self) -> tuple[StageParams, ...]:
        """:meth:`quad` of the probe stages' parameters: ``(first, dense middle, middle, last)``."""
        if self._qparams is None:
            self._qparams = self.quad(lambda p: tuple(p.params))
        return self._qparams

    @property
    def model_flops(self) -> tuple:
        """Per probe chunk: model FLOPs of one micro-batch, dp = 1 (global, unpadded vocabulary)."""
        if self._model_flops is None:
            from parcompile.analysis.compute import BACKWARD_FACTOR, op_fwd_flops

            g, m, tp = self.graph, self.pcfg.model, self.pcfg.parallel.tp
            chunk = [0, 0, 0]
            for nd in g.nodes():
                fl = op_fwd_flops(g, nd)
                if fl:
                    fl = fl * m.vocab // m.padded_vocab(tp) if nd.type.has_dim("vocab") else fl
                    chunk[nd.chunk or 0] += fl * (1 + BACKWARD_FACTOR)
            assert sum(chunk) == self.compute["none"].model_flops_per_step
            self._model_flops = tuple(chunk)
        return self._model_flops


def _probe_config(cfg: SpecConfig, tp: int, cp: int, sp: bool, mb: int, ep: int, expert_tp: int,
                  dense: bool = False) -> SpecConfig:
    """The three-layer probe model of ``cfg`` (module docstring) with the given degrees; its
    layers dense (``dense``: an MoE model's ``dense_layers``) or all of the model's kind."""
    model = cfg.model.model_copy(update={"layers": 3, "dense_layers": 3 if dense else 0})
    par = ParallelConfig(dp=1, tp=tp, pp=3, cp=cp, ep=ep, expert_tp=expert_tp, sequence_parallel=sp,
                         micro_batch=mb, global_batch=mb, order=cfg.parallel.order)
    return cfg.model_copy(update={"model": model, "parallel": par})


def _dense_layers(cfg: SpecConfig) -> int:
    """How many leading layers of ``cfg``'s model are dense when the others are MoE (its
    ``dense_layers``; 0 for a model of one kind of layer, all dense or all MoE)."""
    m = cfg.model
    return m.dense_layers if m.experts > 0 and 0 < m.dense_layers < m.layers else 0


def _build_probe(cfg: SpecConfig, tp: int, cp: int, sp: bool, mb: int, ep: int, expert_tp: int) -> _Probe:
    """The probe of ``cfg`` at these degrees; for a model of dense then MoE layers
    (:func:`_dense_layers`), with its :attr:`_Probe.dense_probe`; a model whose every layer
    is dense (``dense_layers >= layers``) is probed with dense layers."""
    m = cfg.model
    pr = _Probe(cfg, tp, cp, sp, mb, ep, expert_tp, dense=m.experts > 0 and m.dense_layers >= m.layers)
    if _dense_layers(cfg):
        pr.dense_probe = _Probe(cfg, tp, cp, sp, mb, ep, expert_tp, dense=True)
    return pr


def _dense_counts(counts: tuple[int, ...], dense: int) -> list[int]:
    """Per model chunk of ``counts`` layers (in model order), how many of the first
    ``dense`` layers it holds."""
    out, start = [], 0
    for n in counts:
        out.append(min(max(dense - start, 0), n))
        start += n
    return out


def _compose(probe4: tuple, counts: tuple[int, ...], dense: int = 0) -> tuple:
    """Per candidate chunk ``k`` with ``counts[k]`` layers, ``d_k`` of them among the first
    ``dense`` (dense layers of an MoE model): ``d_k * dense middle + (n_k - d_k) * middle
    + [k = 0] (first - dense middle) + [k = last] (last - middle)`` of a probe's
    :meth:`_Probe.quad` (the first chunk holds the first layer, dense when ``dense > 0``;
    the last the last, of the probe's kind)."""
    a, b, m, c = probe4
    last = len(counts) - 1
    if not dense:
        return tuple(n * m + (a - b if k == 0 else 0) + (c - m if k == last else 0) for k, n in enumerate(counts))
    return tuple(nd * b + (n - nd) * m + (a - b if k == 0 else 0) + (c - m if k == last else 0)
                 for k, (n, nd) in enumerate(zip(counts, _dense_counts(counts, dense))))


def _quad_times(ct: ChunkTimes, dct: ChunkTimes | None) -> ChunkTimes:
    """The four chunk values of :meth:`_Probe.quad` of a probe's chunk times ``ct`` (and of
    its dense probe's, ``dct``): a :class:`ChunkTimes` of four chunks that :func:`_compose`
    composes field by field (the transfers, ``p2p``, are the probe's own)."""
    def q(x: tuple, y: tuple | None) -> tuple:
        return (x[0], x[1], x[1], x[2]) if y is None else (y[0], y[1], x[1], x[2])

    d = dct
    return ChunkTimes(q(ct.matmul_f, d and d.matmul_f), q(ct.memory_f, d and d.memory_f),
                      q(ct.recompute, d and d.recompute),
                      {f: q(v, d and d.comm_f[f]) for f, v in ct.comm_f.items()},
                      {f: q(v, d and d.comm_b[f]) for f, v in ct.comm_b.items()}, ct.p2p,
                      q(ct.weighted_f, d and d.weighted_f) if ct.weighted_f else (),
                      q(ct.overhead_f, d and d.overhead_f) if ct.overhead_f else ())


def _stage_bufs(pq: tuple, dense: bool, moe: bool, first: bool, last: bool, pp1: bool) -> dict[str, int]:
    """A pipeline rank's buffers (name -> bytes, each the largest of its ops') from the
    probe's per-chunk buffers ``pq`` (:meth:`_Probe.quad`): those of a middle layer of each
    kind it holds (``dense``; ``moe``: of the probe's own kind), and of the first and last
    chunks' when it holds them; with one pipeline rank (``pp1``), no receive buffer."""
    b = dict(pq[2]) if moe else {}
    for extra in ([pq[1]] if dense else []) + ([pq[0]] if first else []) + ([pq[3]] if last else []):
        for k2, x in extra.items():
            b[k2] = max(b.get(k2, 0), x)
    if pp1:
        b.pop("p2p", None)
    return b


def _rank_layers(n: int, dense: int, d, m):
    """A lower bound on the sum of a per-layer value (``d`` a dense layer's, ``m`` an MoE
    layer's) over a pipeline rank's ``n`` layers when the model's first ``dense`` layers
    are dense (``n * m`` when ``dense = 0``): the rank holds ``k <= min(dense, n)`` dense
    layers, and ``k d + (n - k) m >= K min(d, m) + (n - K) m`` for ``K = min(dense, n) >= k``
    (and it grows with ``n``, so a rank of ``n`` layers or more)."""
    if not dense:
        return n * m
    k = min(dense, n)
    return k * min(d, m) + (n - k) * m


def _total(probe4: tuple, layers: int, dense: int = 0):
    """:func:`_compose` summed over the chunks (whatever the split): ``dense * dense middle +
    (layers - dense) * middle + (first - dense middle) + (last - middle)``."""
    a, b, m, c = probe4
    if not dense:
        return layers * m + (a - b) + (c - m)
    return dense * b + (layers - dense) * m + (a - b) + (c - m)


def _chunk_units(ps: tuple[StageParams, ...], first: bool, last: bool, n: int, pp1: bool, tied: bool,
                 chunk: int = 0, start: int = 0, dense: int = 0) -> tuple[GradUnit, ...]:
    """The gradient units (:mod:`parcompile.analysis.buckets`) of one model chunk holding
    ``n`` layers (ids ``start``..), in ready order, from the probe's stages
    (:meth:`_Probe.quad`): the output units of its last, a copy of its middle layer per
    layer (of the dense middle layer for the first ``dense`` layers), the embedding units
    of its first. With ``pp1`` (one pipeline rank) a tied embedding is one unit with the
    other embedding parameters and its head is the embedding itself (no copy)."""
    pf, pd, pm, pl = (p.units for p in ps)
    layer = next(u for u in pm if u.name.startswith("layers."))
    dlayer = next(u for u in pd if u.name.startswith("layers."))
    out: list[GradUnit] = []
    if last:
        out += [replace(u, chunk=chunk) for u in pl if not u.name.startswith("layers.")
                and not (pp1 and tied and u.name == "tied_head")]
    for j in reversed(range(n)):
        u = dlayer if start + j < dense else layer
        out.append(GradUnit(chunk, f"layers.{start + j}", u.dense, u.expert))
    if first:
        emb = [u for u in pf if not u.name.startswith("layers.")]
        if pp1 and tied:   # the tied embedding joins the embedding unit
            out.append(GradUnit(chunk, "embedding", sum(u.dense for u in emb), sum(u.expert for u in emb)))
        else:
            out += [replace(u, chunk=chunk) for u in emb]
    return tuple(out)


def _compose_params(ps: tuple[StageParams, ...], counts: tuple[int, ...], pp: int, tied: bool,
                    dense: int = 0) -> list[StageParams]:
    """Per pipeline rank, the parameters of a layout of ``counts`` layers per model chunk
    from the probe's stages (:meth:`_Probe.quad`; ``dense``: the model's leading dense
    layers, :func:`_compose`)."""
    first, dmid, mid, last = ps
    out = []
    nchunks = len(counts)
    starts = [sum(counts[:k]) for k in range(nchunks)]
    dcounts = _dense_counts(counts, dense)
    for s in range(pp):
        acc = {"dense": 0, "expert": 0, "norm": 0, "tp_partial": 0, "fp8": 0}
        emb = 0
        units: list[GradUnit] = []
        for k in reversed(range(s, nchunks, pp)):
            units += _chunk_units(ps, k == 0, k == nchunks - 1, counts[k], pp == 1, tied, k // pp, starts[k],
                                  dense)
        for k in range(s, nchunks, pp):
            for f in acc:
                acc[f] += (counts[k] - dcounts[k]) * getattr(mid, f) + dcounts[k] * getattr(dmid, f)
                if k == 0:
                    acc[f] += getattr(first, f) - getattr(dmid, f)
                if k == nchunks - 1:
                    acc[f] += getattr(last, f) - getattr(mid, f)
            if tied and k == 0:
                emb = first.embedding
            if tied and k == nchunks - 1:
                if pp == 1:   # one rank holds the embedding and reads it as the head
                    acc["dense"] -= last.embedding
                else:
                    emb = last.embedding
        out.append(StageParams(s, acc["dense"], acc["expert"], acc["norm"], emb, tuple(units),
                               tp_partial=acc["tp_partial"], fp8=acc["fp8"]))
    return out


class _Step(NamedTuple):
    """A step collective as :func:`~parcompile.analysis.estimate.dp_exposed` reads it
    (the fields of :class:`~parcompile.analysis.comm.CollectiveEntry` it reads; a tuple
    builds faster)."""

    op: str
    axis: str
    bytes: int
    count: int
    where: str
    stage: int
    phase: str


def _step_entries(cfg: SpecConfig, deg: dict, sps: list[StageParams]) -> list[_Step]:
    """The step's collectives of layout ``cfg`` (:func:`~parcompile.passes.insert_collectives.step_collectives`)
    as the rows :func:`~parcompile.analysis.estimate.dp_exposed` reads."""
    from parcompile.passes.insert_collectives import step_collectives

    return [_Step(op, axis, nb, count, where, s, "step")
            for s, _key, op, axis, nb, where, count in step_collectives(cfg, deg, sps)]


#: the axes of the step collectives (:func:`~parcompile.passes.insert_collectives.step_collectives`)
_STEP_AXES = ("dp_cp", "expert_dp", "embedding", "tp", "pp", "ep", "expert_tp")


def _first_layers(splits: list[tuple[int, ...]], pp: int) -> int:
    """The fewest layers any of ``splits`` gives the first pipeline rank."""
    return min(sum(c[0::pp]) for c in splits)


def _degrees(par: ParallelConfig) -> dict[str, int]:
    """The group size of every mesh axis of layout ``par`` (the pass context's degrees)."""
    return {"dp": par.dp, "tp": par.tp, "pp": par.pp, "cp": par.cp, "ep": par.ep, "expert_tp": par.expert_tp,
            "expert_dp": par.expert_dp, "dp_cp": par.dp * par.cp, "embedding": 2 if par.pp > 1 else 1}


def _step_degrees(deg: dict) -> tuple:
    """The degrees :func:`~parcompile.passes.insert_collectives.step_collectives` reads."""
    return tuple(deg[a] for a in ("dp_cp", "expert_dp", "tp", "ep", "expert_tp", "pp"))


class _RowLayout(NamedTuple):
    """A row of :func:`_layout_rows` read as the :class:`ParallelConfig` fields the memory
    floors read (:meth:`Coster.state_floor`, :meth:`Coster.memory_floor`), without
    building one; ``num_microbatches`` and ``expert_dp`` are ParallelConfig's own."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    expert_tp: int
    sequence_parallel: bool
    zero: int
    micro_batch: int
    global_batch: int
    schedule: str
    virtual_stages: int
    recompute: str

    num_microbatches = property(ParallelConfig.num_microbatches.fget)
    expert_dp = property(ParallelConfig.expert_dp.fget)


class _Coll(NamedTuple):
    """A per-micro-batch collective as :func:`~parcompile.analysis.estimate.chunk_times`
    reads it (:class:`~parcompile.ir.ops.Collective`'s fields; :meth:`Coster.family_floor`
    scales its bytes)."""

    op: str
    axis: str
    bytes: float
    phase: str
    where: str = ""


@dataclass(frozen=True)
class _ScaledComm:
    """A :class:`~parcompile.analysis.comm.CommReport` reduced to what
    :func:`~parcompile.analysis.estimate.chunk_times` reads (:meth:`Coster.family_floor`)."""

    raw: tuple


def _scaled_comm(raw: tuple, r: float, pp: bool, experts: int = 0, fixed_r: float = 1.0) -> _ScaledComm:
    """The collectives ``raw`` (a CommReport's) of the pipeline axis (``pp``) or of every
    other axis, their bytes times ``r`` (:meth:`Coster._family_work`). The MoE dispatch's
    exchanges of token counts (``experts`` int64 per rank over ep, gathered over expert_tp:
    :func:`~parcompile.ir.ops.moe_collectives`) do not grow with the tokens: times
    ``fixed_r`` instead (``cp0 / cp``: at most 1 and at most ``r``, whatever the
    micro-batch, so a collective of another kind that happens to have their size is
    under-counted, which a lower bound allows, and the line of :meth:`Coster._base_work`
    holds)."""
    from parcompile.ir.ops import COUNTS_BYTES

    def scale(c) -> float:
        fixed = (experts and not c.bytes_per_row and c.axis in ("ep", "expert_tp")
                 and c.bytes % (experts * COUNTS_BYTES) == 0 and c.bytes // (experts * COUNTS_BYTES) <= 64)
        return fixed_r if fixed else r

    return _ScaledComm(tuple((s, k, _Coll(c.op, c.axis, c.bytes * scale(c), c.phase, c.where)) for s, k, c in raw
                             if (c.axis == "pp") == pp))


@dataclass(frozen=True)
class Candidate:
    """One costed layout: its :class:`ParallelConfig` and what the cost model says."""

    parallel: ParallelConfig
    step_time: float
    mfu: float
    tflops_per_gpu: float
    peak: int
    capacity: int
    bubble_fraction: float
    breakdown: dict
    memory: MemoryReport | None = None
    simulated: bool = False

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    def degrees_text(self) -> str:
        """``tp=8 pp=4 dp=32 ...``: the layout in one line (only what differs from defaults; an
        uneven split as :func:`split_text`'s compact form, ``split=7/8x14/7``)."""
        p = self.parallel
        parts = [f"tp={p.tp}", f"pp={p.pp}", f"dp={p.dp}"]
        if p.cp > 1:
            parts.append(f"cp={p.cp}")
        if p.ep > 1:
            parts.append(f"ep={p.ep}")
        if p.virtual_stages > 1:
            parts.append(f"v={p.virtual_stages}")
        parts += [f"mb={p.micro_batch}", f"zero={p.zero}", f"recompute={p.recompute}"]
        if p.pp > 1:
            parts.append(f"schedule={p.schedule}")
        if p.sequence_parallel:
            parts.append("sp")
        elif p.tp > 1:   # said either way where it applies: the search may have chosen it
            parts.append("no-sp")
        if p.stage_layers is not None and len(set(p.stage_layers)) > 1:
            parts.append("split=" + split_text(p.stage_layers, compact=True))
        return " ".join(parts)

    def key(self) -> tuple:
        """Ranking key: step time, then the simpler layout."""
        p = self.parallel
        return (round(self.step_time, 9), _SCHEDULE_RANK[p.schedule], p.virtual_stages, p.zero,
                _RECOMPUTE_RANK[p.recompute], p.tp, p.pp, p.cp, -p.micro_batch, int(p.sequence_parallel))


class Coster:
    """Costs layouts of one spec from cached probes (module docstring)."""

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.eff = efficiency(cfg.cluster)
        self.probes: dict[tuple, _Probe] = {}
        self.inside: dict[tuple, tuple] = {}
        self.pipes: dict[tuple, tuple[ChunkTimes, float, dict]] = {}
        self.buf_sums: dict[tuple, tuple[int, int, int]] = {}
        self.state_floors: dict[tuple, int] = {}
        self.param_probes: dict[tuple, _Probe] = {}
        self.base_works: dict[tuple, float] = {}
        self.sims: dict[tuple, tuple[float, dict]] = {}
        self.action_lists: dict[tuple, list] = {}
        self.exposed: dict[ParallelConfig, tuple[float, float]] = {}
        self.stage_param_sets: dict[tuple, list[StageParams]] = {}
        self.step_sets: dict[tuple, list[_Step]] = {}
        self.dp_groups: dict[tuple, tuple[SpecConfig, list[_Step]]] = {}
        self.param_owner: dict[tuple, _Probe] = {}
        self.state_parts: dict[tuple, float] = {}
        self.step_floor_parts: dict[tuple, tuple] = {}
        self.family_works: dict[tuple, tuple] = {}
        self.comm_axes: dict[tuple, list[str]] = {}
        self.base_p2p: dict[tuple, float] = {}
        self.step_floor_memo: dict[tuple, float] = {}
        self.in_flight_firsts: dict[tuple, Fraction] = {}
        self.scaled_bases: dict[tuple, tuple] = {}
        self.scaled_comms: dict[tuple, _ScaledComm] = {}
        #: time every micro-batch's scaled probe (:meth:`_base_work`), not the line (tests)
        self.direct_works = False
        self.params_keys: dict[int, tuple] = {}
        self.memories: dict[tuple, tuple[MemoryReport, list[StageParams]]] = {}
        #: the model's leading dense layers before MoE ones (:func:`_dense_layers`), probed apart
        self.dense = _dense_layers(cfg)

    def probe(self, par: ParallelConfig | _RowLayout) -> _Probe:
        return self.probe_of((par.tp, par.cp, par.sequence_parallel, par.micro_batch, par.ep, par.expert_tp))

    def probe_of(self, key: tuple) -> _Probe:
        """The probe of ``(tp, cp, sequence_parallel, micro_batch, ep, expert_tp)``, built once."""
        got = self.probes.get(key)
        if got is None:
            got = self.probes[key] = _build_probe(self.cfg, *key)
        return got

    def _inside(self, par: ParallelConfig) -> dict[str, tuple[int, int]]:
        """Where each axis's groups of layout ``par`` sit: ``(k, domains)``
        (:func:`~parcompile.core.groups.axis_placement`; inside a node iff ``domains == 1``), cached."""
        return self._inside_links(par)[0]

    def _inside_links(self, par: ParallelConfig) -> tuple[dict[str, tuple[int, int]], dict]:
        """:meth:`_inside` and the links it gives (:func:`~parcompile.analysis.estimate.links_of`), cached."""
        key = (par.tp, par.cp, par.dp, par.pp, par.ep, par.expert_tp, par.order)
        got = self.inside.get(key)
        if got is None:
            domain = self.cfg.cluster.domain_size
            inside = {a: axis_placement(par, a, domain) for a in GROUP_AXES}
            got = self.inside[key] = (inside, links_of(self.cfg.cluster, inside, self.eff))
        return got

    def _chunk_times3(self, pr: _Probe, par: ParallelConfig) -> tuple[ChunkTimes, dict, tuple]:
        """The probe's chunk times under ``par``'s links (where each axis's groups sit: the
        network model's ranks per node and nodes), its recompute mode's, as the four chunks of
        :meth:`_Probe.quad` (:func:`_quad_times`), with the links and the cache key: the
        placements of the axes the probe's (and its dense probe's) collectives use, and tp's,
        which the pipeline sends read."""
        inside, links = self._inside_links(par)
        rc = par.recompute
        akey = (id(pr), rc, "chunk")
        axes = self.comm_axes.get(akey)
        if axes is None:
            probes = (pr,) if pr.dense_probe is None else (pr, pr.dense_probe)
            axes = self.comm_axes[akey] = sorted({c.axis for p in probes for _s, _k, c in p.comm[rc].raw}
                                                 | {"tp", "pp"})
        key = (rc, tuple((a, inside.get(a, (1, 1))) for a in axes))
        ct3 = pr.times.get(key)
        if ct3 is None:
            def times(p: _Probe) -> ChunkTimes:
                tcfg = p.pcfg.model_copy(update={"parallel": ParallelConfig(
                    dp=1, tp=par.tp, pp=3, cp=par.cp, ep=par.ep, expert_tp=par.expert_tp,
                    micro_batch=par.micro_batch, global_batch=par.micro_batch, recompute=rc,
                    sequence_parallel=par.sequence_parallel)})
                return chunk_times(tcfg, p.degrees, None, p.compute[rc], p.comm[rc], links)

            d = pr.dense_probe
            ct3 = pr.times[key] = _quad_times(times(pr), times(d) if d is not None else None)
        return ct3, links, key

    def _pipeline(self, cfg: SpecConfig, pr: _Probe, ct3: ChunkTimes, tkey: tuple,
                  counts: tuple[int, ...]) -> tuple[ChunkTimes, float, dict]:
        """The candidate's chunk times (the probe's composed over ``counts``, :func:`_compose`) and
        its closed-form pipeline (:func:`~parcompile.analysis.estimate.pipeline_parts`:
        makespan with transfers, breakdown), cached: they depend on neither ZeRO nor the
        schedule."""
        par = cfg.parallel
        m = par.num_microbatches
        key = (id(pr), tkey, par.pp, par.virtual_stages, m, counts)
        got = self.pipes.get(key)
        if got is None:
            fams = ("tp", "cp", "ep")
            d = self.dense
            ct = ChunkTimes(_compose(ct3.matmul_f, counts, d), _compose(ct3.memory_f, counts, d),
                            _compose(ct3.recompute, counts, d),
                            {f: _compose(ct3.comm_f[f], counts, d) for f in fams},
                            {f: _compose(ct3.comm_b[f], counts, d) for f in fams}, ct3.p2p,
                            _compose(ct3.weighted_f, counts, d) if ct3.weighted_f else (),
                            _compose(ct3.overhead_f, counts, d) if ct3.overhead_f else ())
            span, parts = pipeline_parts(cfg, ct, m)
            got = self.pipes[key] = (ct, span, parts)
        return got

    def span_floor(self, par: ParallelConfig) -> float:
        """A lower bound on the estimated step time of layout ``par``, whatever its split: the
        closed-form makespan
        (:func:`~parcompile.analysis.estimate._closed_form_makespan`, ``m * max(work) +
        (pp - 1) / v * mean(work)``, where ``work`` is a rank's forward and backward of one
        micro-batch through its chunks, transfers included) is at least ``(m + (pp - 1) / v)
        * mean(work)``, and the ranks' work summed over all chunks does not depend on the
        split: ``layers * middle + (first - middle) + (last - middle)`` of the probe's chunks
        (:func:`_total`: :func:`_compose` summed; dense layers count the dense middle), plus a transfer each way between adjacent chunks; the
        step adds the (non-negative) exposed data-parallel time and optimizer step. Reduced by a
        relative 1e-9 for rounding (the estimate sums in another order)."""
        pr = self.probe(par)
        ct3, _links, _key = self._chunk_times3(pr, par)
        pp, v, m, layers = par.pp, par.virtual_stages, par.num_microbatches, self.cfg.model.layers
        work = _total([ct3.fwd(k) + ct3.bwd(k) for k in range(4)], layers, self.dense)
        if pp > 1:
            work += 2 * (pp * v - 1) * ct3.p2p
        return (m + (pp - 1) / v) * work / pp * (1 - 1e-9)

    def layout_floor(self, par: ParallelConfig) -> float:
        """A lower bound on the estimated step time of layout ``par``, whatever its split:
        :meth:`span_floor` (the pipeline) plus :meth:`step_floor` (what the step adds), from
        the layout's own probe."""
        pr = self.probe(par)
        ct3, links, _key = self._chunk_times3(pr, par)
        layers = self.cfg.model.layers
        f = _total([ct3.fwd(k) for k in range(4)], layers, self.dense)
        b = _total([ct3.bwd(k) for k in range(4)], layers, self.dense)
        return self.span_floor(par) + self.step_floor(par, f, b, links, pr)

    def step_floor(self, par: ParallelConfig, fwd: float, bwd: float, links: dict, pr: _Probe) -> float:
        """A lower bound on what the step adds to the pipeline of layout ``par`` (the exposed
        data-parallel time and the optimizer step, :func:`~parcompile.analysis.estimate.step_time_parts`),
        whatever its split; ``fwd`` and ``bwd``: a micro-batch's forward and backward through
        all model chunks, summed (at most the layout's own), ``links`` its links, ``pr`` a
        probe with its parameters (any of the same ``tp, ep, expert_tp``).

        Both terms are maxima over the stages, so at least their means. The mean stage:
        ``pp`` stages of ``1/pp`` of the model's parameters each, rounded down to a multiple
        of the shard count, one gradient bucket each, passed to the estimate's own
        :func:`~parcompile.passes.insert_collectives.step_collectives`,
        :func:`~parcompile.analysis.estimate.step_sums`,
        :func:`~parcompile.analysis.estimate.dp_exposed` (against ``fwd / pp`` and ``bwd /
        pp``) and :func:`~parcompile.analysis.estimate.optimizer_time`. This is a lower bound
        because:

        * a collective's time is affine in its bytes with non-negative coefficients
          (:func:`~parcompile.analysis.estimate.collective_time`) and every stage has a
          bucket at least (each holds a layer), so the mean over the stages of a stage's
          bucket times is at least the time of one bucket of the mean bytes, and the padded
          shards (``ceil(n / d)``) only add bytes; reductions run ``m`` or one times per
          bucket alike, and with ZeRO-3 at ``pp = 1`` (per micro-batch gathers, some
          buckets gathered fewer times) the all-gathers are counted as none;
        * the optimizer's bytes are linear in the stage's parameters (the shards rounded up);
        * a stage's exposed time is a sum of ``max(0, x)`` of its reductions less its
          backward and its gathers less its forward, plus its other step collectives (the
          bucket simulation exposes at least the reductions' sum less the backward:
          :meth:`_dp_floor`); ``max(0, x)`` is convex and increasing, so its mean over the
          stages is at least its value at the mean stage (Jensen), where the mean stage
          has no more bytes and the same ``fwd / pp``, ``bwd / pp``. The tied
          embedding's and sequence parallelism's all-reduces, which the mean stage lacks,
          are not negative.

        The mean stage is costed as a layout of one chunk per rank, and its step collectives
        are cached by what they depend on: not ``fwd``, ``bwd``, the virtual stages (which
        the step collectives do not read), nor the micro-batches (a reduction run per
        micro-batch counts ``m`` times and is set against the backward as one round, ``m``
        divided out again; ZeRO-3's per micro-batch gathers are counted as none), the bound
        by those and ``fwd``, ``bwd``. Reduced by a relative 1e-9 for rounding."""
        pp = par.pp
        key = (self._params_key(pr), pp, par.zero, par.schedule, par.dp * par.cp, par.expert_dp, par.tp, par.ep,
               par.expert_tp, par.sequence_parallel, par.bucket_size, par.reduce_dtype,
               tuple(links.get(a) for a in _STEP_AXES))
        got = self.step_floor_parts.get(key)
        if got is None:
            model = self.cfg.model
            deg = _degrees(par)
            cfg = with_parallel(self.cfg, par.model_copy(update={"virtual_stages": 1}))
            ps = pr.qparams
            first, dmid, mid, last = ps
            tied, pp1 = model.tie_embeddings, pp == 1
            nd = self.dense
            # the whole model's elements: in the gradient units, and in the stages' parameters
            layer = next(u for u in mid.units if u.name.startswith("layers."))
            dlayer = next(u for u in dmid.units if u.name.startswith("layers."))
            ends = _chunk_units(ps, True, False, 0, pp1, tied) + _chunk_units(ps, False, True, 0, pp1, tied)
            fake_units, fake_params = [], []
            for kind, dd in (("dense", deg["dp_cp"]), ("expert", deg["expert_dp"])):
                n_units = (model.layers - nd) * layer.size(kind) + nd * dlayer.size(kind) \
                    + sum(u.size(kind) for u in ends)
                n_params = (model.layers - nd) * getattr(mid, kind) + nd * getattr(dmid, kind) \
                    + getattr(first, kind) + getattr(last, kind) - getattr(dmid, kind) - getattr(mid, kind)
                if kind == "dense" and tied and pp1:
                    n_params -= last.embedding
                dd = max(dd, 1)
                fake_units.append(dd * (n_units // (pp * dd)))
                fake_params.append(dd * (n_params // (pp * dd)))
            stages = [StageParams(s, fake_units[0], fake_units[1], 0, 0) for s in range(pp)]
            sums: dict[tuple, int] = {}
            for grads, params, other, _copies in step_sums(cfg, deg, links, _step_entries(cfg, deg, stages)):
                # FSDP2's buffer copies (eager, ZeRO-3) count per micro-batch: left out of the floor
                if par.zero >= 3 and reshard_after_forward(pp):
                    params = 0.0   # gathered per micro-batch, some buckets fewer times: counted as none
                sums[(grads, params, other, 0.0)] = sums.get((grads, params, other, 0.0), 0) + 1
            opt = optimizer_time(cfg, deg, [StageParams(0, fake_params[0], fake_params[1], 0, 0)])
            got = self.step_floor_parts[key] = (cfg, deg, tuple(sums.items()), opt)
        mkey = (key, fwd, bwd)
        out = self.step_floor_memo.get(mkey)
        if out is None:
            cfg, deg, sums, opt = got
            # one stage of one chunk (chunk 0 is all dp_exposed reads of it): fwd / pp, bwd / pp
            ct = ChunkTimes((0.0,), (0.0,), (bwd / pp,), {"tp": (fwd / pp,)}, {}, 0.0)
            dp = sum(k * dp_exposed(cfg, deg, links, None, ct, None, [t]) for t, k in sums) / pp
            out = self.step_floor_memo[mkey] = (dp + opt) * (1 - 1e-9)
        return out

    def family_floor(self, reps: dict[int, ParallelConfig],
                     groups: Iterable[tuple[int, int, int, str]]) -> dict[tuple[int, int, int, str], float]:
        """Lower bounds on the closed-form step time of the layouts of one probe family (one
        ``tp, cp, sequence_parallel, micro_batch, ep, expert_tp``), without building that
        family's probe: per group ``(pp, virtual_stages, num_microbatches, recompute)`` of
        ``groups``, one bound for all its layouts (any ZeRO stage, schedule or split);
        ``reps``: a layout of the family per ``pp`` (for its links).

        From the probe of the same ``tp, sequence_parallel, ep, expert_tp`` at micro-batch 1
        and ``cp0 = min(cp, 2)``, whose FLOPs, bytes moved and collective sizes are scaled by
        ``micro_batch * cp0 / cp`` (:meth:`_family_work`): a micro-batch's forward ``F`` and
        backward ``B`` through all chunks and a transfer between chunks, at most the
        family's. The step is then at least :meth:`span_floor` of those.
        ``tests/test_search.py`` checks the bound against the families' own probes. Reduced
        by a relative 1e-9 for rounding."""
        out, works = {}, {}
        for pp, v, m, rc in groups:
            got = works.get((pp, rc))
            if got is None:
                got = works[(pp, rc)] = self._family_work(reps[pp], rc)
            f, b, p2p = got[:3]
            transfers = 2 * (pp * v - 1) * p2p if pp > 1 else 0.0
            out[(pp, v, m, rc)] = (m + (pp - 1) / v) * (f + b + transfers) / pp * (1 - 1e-9)
        return out

    def family_layout_floor(self, par: ParallelConfig) -> float:
        """A lower bound on the closed-form step time of layout ``par``, whatever its split,
        without building its own probe: :meth:`family_floor`'s bound plus :meth:`step_floor`
        of the scaled ``F`` and ``B`` (the parameters depend on ``tp, ep, expert_tp``
        only, so the scaled probe's are the layout's). The sum does not decrease with ``F``
        nor ``B`` (the pipeline grows by at least ``1 / pp`` of each, since ``m >= 1``; the
        step's exposed time falls by at most ``1 / pp`` of each), so ``F`` and ``B`` at
        most the layout's give a lower bound. ``tests/test_search.py`` checks it against
        the layouts' costs."""
        pp, v, m = par.pp, par.virtual_stages, par.num_microbatches
        f, b, p2p, base, links = self._family_work(par, par.recompute)
        transfers = 2 * (pp * v - 1) * p2p if pp > 1 else 0.0
        return (m + (pp - 1) / v) * (f + b + transfers) / pp * (1 - 1e-9) + self.step_floor(par, f, b, links, base)

    def _family_work(self, par: ParallelConfig, rc: str) -> tuple[float, float, float, _Probe, dict]:
        """``(F, B, p2p, probe, links)`` of :meth:`family_floor` for the family of layout
        ``par`` and recompute mode ``rc``: a micro-batch's forward and backward seconds
        through all chunks, and one transfer between adjacent chunks (``ChunkTimes.p2p``; 0 with
        ``pp = 1``, where the floors add none), of
        the probe of the same ``tp, sequence_parallel, ep, expert_tp`` at micro-batch 1 and
        ``cp0 = min(cp, 2)``, scaled by ``micro_batch * cp0 / cp``, with ``par``'s group sizes
        and links; that probe; the links. This rests on two facts of the probe graphs:

        * the passes do not read the micro-batch nor cp's value beyond ``cp > 1``: the
          graphs of one ``tp, sequence_parallel, ep, expert_tp`` and ``cp > 1`` have the
          same ops, shardings and collectives, and differ in the local sizes only;
        * each FLOP count, byte count and collective size of a chunk is a sum of products
          of local dims in which the batch dim (local size ``micro_batch``: the probe has
          ``dp = 1``) appears once in every term, and ``seq`` split over cp (local size
          ``seq / cp``) at most once; so each is ``micro_batch`` times its value at
          micro-batch 1, and at least ``cp0 / cp`` times its value at ``cp0``.
        * the weights the GEMMs read and the grouped GEMMs' per-expert rows
          (``ComputeReport.chunk_weight_traffic``, ``chunk_expert_row_flops``) do not
          depend on the tokens at all: they are the probe's, unscaled (the fields that grow
          with the tokens are ``ComputeReport.PER_TOKEN``).

        Collective times (:func:`~parcompile.analysis.estimate.collective_time`) do not
        decrease with the bytes or the group size, so the scaled probe's chunk times, with
        the family's own group sizes and links, are at most the family's. Cached."""
        tp, cp, mb, sp = par.tp, par.cp, par.micro_batch, par.sequence_parallel
        wkey = (tp, cp, sp, mb, par.ep, par.expert_tp, par.dp, par.pp, par.order, rc)
        got = self.family_works.get(wkey)
        if got is not None:
            return got
        cp0 = min(cp, 2)
        base = self.probe_of((tp, cp0, sp, 1, par.ep, par.expert_tp))
        inside, links = self._inside_links(par)
        akey = (id(base), rc)
        axes = self.comm_axes.get(akey)
        if axes is None:   # the probe's collectives' axes, for what their times read of the links
            axes = self.comm_axes[akey] = sorted({c.axis for p in (base, base.dense_probe) if p is not None
                                                  for _s, _k, c in p.comm[rc].raw} - {"pp"})
        lkey = tuple((a, inside.get(a, True)) for a in axes)
        fb = self._base_work(base, rc, cp, mb, par, lkey, links)
        pkey = (id(base), rc, cp, mb, inside.get("pp", True), inside.get("tp", True))
        p2p = self.base_p2p.get(pkey) if par.pp > 1 else 0.0   # one rank: no transfers
        if p2p is None:
            scaled, tcfg, degrees = self._scaled_base(base, rc, cp, mb, par)
            pp_raw = self.scaled_comms.get((id(base), rc, cp, mb, True))
            if pp_raw is None:
                pp_raw = self.scaled_comms[(id(base), rc, cp, mb, True)] = _scaled_comm(
                    base.comm[rc].raw, mb * min(cp, 2) / cp, True, self.cfg.model.experts, min(cp, 2) / cp)
            p2p = self.base_p2p[pkey] = chunk_times(tcfg, degrees, None, scaled, pp_raw, links).p2p
        got = self.family_works[wkey] = (fb[0], fb[1], p2p, base, links)
        return got

    def _scaled_base(self, base: _Probe, rc: str, cp: int, mb: int, par: ParallelConfig) -> tuple:
        """``(compute report, config, degrees)`` of :meth:`_family_work`'s scaled probe: ``base``'s
        FLOPs and bytes moved times ``mb * cp0 / cp``, its layout with ``par``'s ``cp`` and
        micro-batch ``mb``. Cached, whatever the links."""
        skey = (id(base), rc, cp, mb)
        got = self.scaled_bases.get(skey)
        if got is None:
            r = mb * min(cp, 2) / cp
            comp = base.compute[rc]
            # what grows with the tokens (ComputeReport.PER_TOKEN); the weights read are the same
            scaled = replace(comp, **{k: tuple(x * r for x in getattr(comp, k)) for k in comp.PER_TOKEN})
            tcfg = base.pcfg.model_copy(update={"parallel": ParallelConfig(
                dp=1, tp=par.tp, pp=3, cp=cp, ep=par.ep, expert_tp=par.expert_tp, micro_batch=mb,
                global_batch=mb, recompute=rc, sequence_parallel=par.sequence_parallel)})
            got = self.scaled_bases[skey] = (scaled, tcfg, dict(base.degrees, cp=cp))
        return got

    def _base_work(self, base: _Probe, rc: str, cp: int, mb: int, par: ParallelConfig, lkey: tuple,
                   links: dict) -> tuple[float, float]:
        """``(F, B)`` of :meth:`_family_work`: the scaled probe's (:meth:`_scaled_base`) forward
        and backward seconds of one micro-batch through all chunks, under ``links`` (``lkey``:
        the inside-a-node flags of the axes its collectives use), the transfers left out.
        Cached.

        For micro-batches above 2, the line through the values at micro-batches 1 and 2:
        every term of ``F`` and ``B`` is affine in the scale ``r = mb * cp0 / cp`` (a FLOP
        or byte count times ``r`` over a rate; a collective's latency plus its bytes times
        ``r`` over a bandwidth, :func:`~parcompile.analysis.estimate.collective_time`, with
        the group sizes of ``cp``), so in ``mb`` for a given ``cp``: the line gives them
        but for rounding, which the floors' relative 1e-9 covers
        (``tests/test_search.py`` holds the line against the scaled probes' own times)."""
        key = (id(base), rc, cp, mb, lkey)
        got = self.base_works.get(key)
        if got is not None:
            return got
        if mb > 2 and not self.direct_works:
            f1, b1 = self._base_work(base, rc, cp, 1, par, lkey, links)
            f2, b2 = self._base_work(base, rc, cp, 2, par, lkey, links)
            k = mb - 1
            got = self.base_works[key] = (f1 + k * (f2 - f1), b1 + k * (b2 - b1))
            return got
        def times(p: _Probe) -> ChunkTimes:
            scaled, tcfg, degrees = self._scaled_base(p, rc, cp, mb, par)
            raw = self.scaled_comms.get((id(p), rc, cp, mb, False))
            if raw is None:   # the transfers (ChunkTimes.p2p) read the pp and tp links only: timed apart
                raw = self.scaled_comms[(id(p), rc, cp, mb, False)] = _scaled_comm(
                    p.comm[rc].raw, mb * min(cp, 2) / cp, False, self.cfg.model.experts, min(cp, 2) / cp)
            return chunk_times(tcfg, degrees, None, scaled, raw, links)

        d = base.dense_probe
        ct = _quad_times(times(base), times(d) if d is not None else None)
        layers = self.cfg.model.layers
        got = self.base_works[key] = (_total([ct.fwd(k) for k in range(4)], layers, self.dense),
                                      _total([ct.bwd(k) for k in range(4)], layers, self.dense))
        return got

    def state_floor(self, par: ParallelConfig | _RowLayout) -> int:
        """A lower bound on the memory peak of training layout ``par`` from its model states
        alone (parameters, fp32 gradients and optimizer states; :meth:`peak`'s
        ``states``), whatever its split, micro-batch, schedule or recomputation: every
        other term of a stage's total is a byte count, so the peak is at least the largest
        stage's states, hence their mean over the ``pp`` stages. Summed over the stages the
        parameters are the probe's ``layers * middle + first + last - 2 middle`` (:func:`_total`;
        dense layers count the dense middle; a tied
        head read by the embedding on one rank counted once), and each stage's sharded
        elements (``sum ceil(n_b / d)`` over its buckets) are at least ``n / d``, so the
        sum is at least the table of :mod:`parcompile.analysis.memory` applied to the whole
        model's elements with exact division. Needs only the parameters of a probe with
        the same ``tp, ep, expert_tp`` (they depend on nothing else). Cached."""
        model = self.cfg.model
        d, ed, z, pp = par.dp * par.cp, par.expert_dp, par.zero, par.pp
        key = (par.tp, par.ep, par.expert_tp, pp, d, ed, z)
        got = self.state_floors.get(key)
        if got is None:
            pkey = (par.tp, par.ep, par.expert_tp)
            pr = self.param_probes.get(pkey)
            if pr is None:
                pr = self.param_probes[pkey] = next(
                    (p for k, p in self.probes.items() if (k[0], k[4], k[5]) == pkey), None) or self.probe(par)
            ps = pr.qparams
            last = ps[3]
            total = Fraction(0)
            for kind, dd in (("dense", d), ("expert", ed)):
                n = _total([getattr(x, kind) for x in ps], model.layers, self.dense)
                if kind == "dense" and model.tie_embeddings and pp == 1:
                    n -= last.embedding
                # the memory table with exact division: each rank shards at least n / d
                total += sum(state_bytes(n, model.dtype_bytes, z, dd, self.cfg.train.optimizer, shard=Fraction(n, dd),
                                         fsdp2=engine(self.cfg.cluster).fsdp2_state_bytes))
            got = self.state_floors[key] = math.ceil(total / pp)
        return got

    def _buffer_sums(self, pr: _Probe, rc: str, pp: int) -> tuple[int, int, int]:
        """Total buffer bytes of a first, middle and last pipeline rank (as :meth:`cost`
        composes them; :func:`parcompile.analysis.memory.buffer_total`: the logits and the
        recomputation's working set are never alive at once), and of the only rank when
        pp = 1 (returned as the first).

        With dense and MoE layers (:attr:`_Probe.dense_probe`) the first rank's is that of
        the first chunk (the embedding and dense layers), the middle and last ranks' of MoE
        layers: each at most the rank's own (buffers are maxima over the rank's ops).
        """
        key = (id(pr), rc, pp == 1)
        got = self.buf_sums.get(key)
        if got is None:
            pq = pr.quad(lambda p: p.bufs[rc])
            mixed = pr.dense_probe is not None
            out = []
            if pp > 1:
                for first, last in ((True, False), (False, False), (False, True)):
                    out.append(buffer_total(_stage_bufs(pq, first and mixed, not (first and mixed), first, last, False)))
            else:
                out.append(buffer_total(_stage_bufs(pq, mixed, True, True, True, True)))
            got = self.buf_sums[key] = tuple(out) if pp > 1 else (out[0], out[0], out[0])
        return got

    def memory(self, cfg: SpecConfig, pr: _Probe, counts: tuple[int, ...]):
        """The memory report of a layout from its probe: the analysis's own
        :func:`memory_from_parts` on the stage parameters, saved activations and buffers that
        :meth:`cost` composes (one rule: no copy of the memory analysis here). Cached per
        layout (``cfg`` is the spec's with a layout)."""
        mkey = (cfg.parallel, id(pr), counts)
        got = self.memories.get(mkey)
        if got is not None:
            return got
        pp, rc = cfg.parallel.pp, cfg.parallel.recompute
        sps = self._stage_params(pr, counts, pp)
        nd = self.dense
        saved = SavedBytes(_compose(pr.quad(lambda p: p.saved[rc].per_chunk), counts, nd), {}, {},
                           _compose(pr.quad(lambda p: p.saved[rc].output_layer), counts, nd))
        pq = pr.quad(lambda p: p.bufs[rc])
        dcounts = _dense_counts(counts, nd)
        bufs = []
        for s in range(pp):
            ks = range(s, len(counts), pp)
            bufs.append(_stage_bufs(pq, any(dcounts[k] for k in ks), any(counts[k] > dcounts[k] for k in ks),
                                    s == 0, s == pp - 1, pp == 1))
        got = self.memories[mkey] = (memory_from_parts(cfg, _degrees(cfg.parallel), sps, saved, bufs), sps)
        return got

    def peak(self, cfg: SpecConfig, pr: _Probe, counts: tuple[int, ...]) -> tuple[int, int]:
        """``(peak, capacity)`` of a training layout (:meth:`memory`)."""
        mem, _ = self.memory(cfg, pr, counts)
        return mem.peak, mem.capacity

    def memory_floor(self, par: ParallelConfig | _RowLayout, first_layers: int, base: bool = False,
                     build: bool = True) -> float:
        """A lower bound on :meth:`peak` of training layout ``par`` over its splits, from a
        probe without composing any split: the first pipeline rank's total when it holds
        ``first_layers`` (the fewest any of its splits gives it, :func:`_first_layers`).
        That total is, as :func:`memory_from_parts` adds it up, the model states of its parameters (at
        least the table of :mod:`parcompile.analysis.memory` with exact division, its
        sharded elements being at least ``n / d``), the activations of its in-flight
        micro-batches (``in_flight * body`` rounded down, at least ``in_flight * body - 1``;
        ``in_flight`` the first stage's of
        :func:`~parcompile.analysis.memory.closed_form_in_flight`), its buffers
        (:meth:`_buffer_sums`) and byte counts that are not negative (the output layer's
        activations, ZeRO-3's gathered parameters, gradient buckets in flight); each grows
        with the rank's layers.

        With ``base``, no probe of ``par``'s own family is needed: the activations and
        buffers come from the probes :meth:`family_floor` scales, at ``cp0 = min(cp, 2)``
        and micro-batch 1 (and 2, for ``micro_batch > 1``), times ``cp0 / cp``. By the two
        facts of :meth:`_family_work`, each byte count is at least ``cp0 / cp`` times its
        value at ``cp0``, and as a function of the micro-batch ``b``:

        * the bytes one micro-batch saves per chunk (``per_chunk``, ``output_layer`` of
          :class:`~parcompile.analysis.memory.SavedBytes`, so the rank's ``body``) are a
          sum, over the tensors and op extras of a fixed graph, of terms each either
          ``b`` times a constant (a tensor with the batch dim, a mask or log-sum-exp per
          token, the cp-gathered k and v) or independent of ``b`` (the ``(s, seq_len)``
          mask of a windowed or cp attention kernel): affine in ``b``, so the line through
          its values at ``b = 1`` and ``2`` gives it exactly;
        * the buffers (:func:`~parcompile.analysis.memory.buffer_bytes`) are maxima, per
          name, of such affine byte counts (the largest logits, all-gather, receive buffer
          or rebuilt layer), summed, with each group of
          :data:`~parcompile.analysis.memory.EXCLUSIVE_BUFFERS` counted by its largest
          (:func:`~parcompile.analysis.memory.buffer_total`): sums and maxima of affine
          functions, so convex in ``b``, and a convex function is at least, for ``b >=
          2``, the line through its values at 1 and 2 (its secant slopes do not decrease);
        * the micro-batches in flight are the layout's own (its ``num_microbatches``).

        So the bound extrapolates the probes' ``body`` and buffers along that line; without
        it (the micro-batch 1 values for every micro-batch) more than half the probes of
        the Llama-3 70B search were for micro-batches that then did not fit. Without
        ``build`` the micro-batch 2 probe is used only when it is built already; else the
        micro-batch 1 values stand for every micro-batch (no byte count shrinks with it).
        ``tests/test_search.py`` checks the extrapolated bytes against the probes of every
        micro-batch and the bound against :meth:`peak`. In floating point, reduced by a
        relative 1e-12."""
        model = self.cfg.model
        pp, v, m, z, rc = par.pp, par.virtual_stages, par.num_microbatches, par.zero, par.recompute
        d, ed, n = par.dp * par.cp, par.expert_dp, first_layers
        if base:
            cp0 = min(par.cp, 2)
            key = (par.tp, cp0, par.sequence_parallel, 1, par.ep, par.expert_tp)
            pr = self.probe_of(key)
            scale = cp0 / par.cp
        else:
            pr = self.probe(par)
            scale = 1.0
        skey = (self._params_key(pr), pp, n, z, d, ed)
        states = self.state_parts.get(skey)
        if states is None:
            first, dmid, mid, last = pr.qparams
            states = 0.0
            for kind, dd in (("dense", d), ("expert", ed)):
                x = _rank_layers(n, self.dense, getattr(dmid, kind), getattr(mid, kind)) \
                    + getattr(first, kind) - getattr(dmid, kind)
                if pp == 1:
                    x += getattr(last, kind) - getattr(mid, kind)
                    if kind == "dense" and model.tie_embeddings:
                        x -= last.embedding
                states += sum(state_bytes(x, model.dtype_bytes, z, dd, self.cfg.train.optimizer, shard=x / dd,
                                          fsdp2=engine(self.cfg.cluster).fsdp2_state_bytes))
            self.state_parts[skey] = states
        body, bufs = self._first_rank_bytes(pr, rc, pp, n)
        key2 = key[:3] + (2,) + key[4:] if base and par.micro_batch > 1 else None
        if key2 is not None and (build or key2 in self.probes):   # the line through micro-batches 1 and 2
            body2, bufs2 = self._first_rank_bytes(self.probe_of(key2), rc, pp, n)
            k = par.micro_batch - 1
            body, bufs = body + k * (body2 - body), bufs + k * (bufs2 - bufs)
        inf = self._in_flight_first(par.schedule, pp, v, m)
        acts = max(0.0, inf.numerator * body * scale / inf.denominator - 1)
        return (states + acts + bufs * scale) * (1 - 1e-12)

    def _first_rank_bytes(self, pr: _Probe, rc: str, pp: int, n: int) -> tuple[int, int]:
        """``(body, buffers)`` of :meth:`memory_floor`: the bytes one micro-batch saves on a
        first pipeline rank of ``n`` layers outside the output layer (``n * middle + first
        - middle``, plus ``last - middle`` with ``pp = 1``, of the probe's
        ``per_chunk - output_layer``; with dense and MoE layers, :meth:`_Probe.quad`'s and
        :func:`_rank_layers`' ``n`` layers: at most the rank's own), and its buffers
        (:meth:`_buffer_sums`)."""
        (pa, pd, pb, pc), (oa, od, ob, oc) = (pr.quad(lambda p: p.saved[rc].per_chunk),
                                              pr.quad(lambda p: p.saved[rc].output_layer))
        body = _rank_layers(n, self.dense, pd - od, pb - ob) + (pa - oa) - (pd - od)
        if pp == 1:
            body += (pc - oc) - (pb - ob)
        return body, self._buffer_sums(pr, rc, pp)[0]

    def _in_flight_first(self, schedule: str, pp: int, v: int, m: int) -> Fraction:
        """The first stage's micro-batches in flight,
        :func:`~parcompile.analysis.memory.closed_form_in_flight`'s, cached."""
        key = (schedule, pp, v, m)
        got = self.in_flight_firsts.get(key)
        if got is None:
            got = self.in_flight_firsts[key] = closed_form_in_flight(schedule, pp, v, m)[0]
        return got

    def splits(self, cfg: SpecConfig) -> list[tuple[int, ...]]:
        """The layers per model chunk ``cfg`` may get: its split, or, when the layers do
        not divide into its chunks and it gives none, every candidate split."""
        par = cfg.parallel
        layers, chunks = cfg.model.layers, par.pp * par.virtual_stages
        if par.stage_layers is None and layers % chunks:
            return candidate_splits(layers, chunks)
        return [par.layers_per_chunk(layers)]

    def fits(self, cfg: SpecConfig) -> bool:
        """Whether layout ``cfg`` fits memory, untimed (:meth:`peak`): with layers that do
        not divide into its chunks and no split given, whether one of its candidate splits
        does (:meth:`choose_split` takes a fitting one when there is one)."""
        par = cfg.parallel
        if cfg.workload == "serve":
            return self.cost(cfg).fits
        splits = self.splits(cfg)
        cap = int(cfg.cluster.memory * (1 - cfg.cluster.memory_reserve))
        if self.memory_floor(par, _first_layers(splits, par.pp)) > cap:
            return False
        pr = self.probe(par)
        # a split whose first rank's floor exceeds the memory does not fit: not composed
        return any(p <= c for p, c in (self.peak(cfg, pr, counts) for counts in splits
                                       if self.memory_floor(par, sum(counts[0::par.pp])) <= cap))

    def choose_split(self, cfg: SpecConfig, simulate: bool = False) -> tuple[tuple[int, ...], int]:
        """The default uneven split of ``cfg``'s layers into its ``pp * virtual_stages``
        model chunks (issue 16), and how many splits were compared.

        Among :func:`~parcompile.passes.split_pipeline_stages.candidate_splits`, those that
        fit memory (all of them when none does) are timed (:meth:`cost`: each chunk's
        layers, the embedding on the first chunk, the output layer and the loss on the
        last); the split with the smallest estimated step time wins, splits within
        :data:`SPLIT_TIME_TIE` of it counting as ties that the smaller memory peak breaks,
        then the earlier candidate (the plain even split first). A 1F1B pipeline's first
        stage holds the most micro-batches in flight, so among equally fast splits the one
        with a layer fewer there wins: Meta's Llama 3.1 405B split. ``simulate`` times the
        candidates with their simulated schedules (a compile, :func:`settle_split`);
        without it, with the closed-form pipeline (the search's first pass; it re-chooses
        with ``simulate`` for the layouts it re-times). A split whose step time cannot come
        within the tie window of one already timed is not timed (:meth:`_choose_split`).
        """
        counts, n, _ = self._choose_split(cfg, simulate)
        return counts, n

    def _choose_split(self, cfg: SpecConfig, simulate: bool = False,
                      bound: float | None = None) -> tuple[tuple[int, ...], int, Candidate | None]:
        """:meth:`choose_split`'s split, the number compared and the split's own candidate
        (:meth:`cost` with ``simulate`` and ``with_memory = simulate``).

        The same choice without timing every split: each split has a lower bound on its
        step time (:meth:`_split_floors`), and splits are timed in the order of their
        bounds; once one that fits is timed at ``t``, a split whose bound exceeds ``t *
        (1 + SPLIT_TIME_TIE)`` is slower than every split in the tie window of the fastest
        (which is at most ``t``), so it can neither be the fastest nor a tie. ``bound`` (the
        search, closed form only): the candidate is wanted only when its step time is at most
        ``bound``; a split that cannot be within ``bound * (1 + SPLIT_TIME_TIE)`` (its lower
        bound, or :meth:`cost`'s with that limit) is not timed either (if the chosen split is
        within ``bound``, every split of its tie window is within the limit, and none of
        those is skipped), and the candidate is None when the chosen split is slower than
        ``bound`` or when no split timed fits (a split not timed that fits is then slower
        than ``bound`` too). Simulated, a split's bound adds its exposed data-parallel time
        and optimizer step, which need no simulation (:meth:`_sim_floor`)."""
        par = cfg.parallel
        cands = candidate_splits(cfg.model.layers, par.pp * par.virtual_stages)
        if cfg.workload == "serve":
            floors = [0.0] * len(cands)
        else:
            floors = self._split_floors(par, cands, simulate)
        # simulated, the simulation is what costs: a split's bound then adds what needs none
        # (_sim_floor), worked out when the split's own bound comes up (it only grows)
        rough = simulate and par.pp > 1 and cfg.workload != "serve"
        window = 1 + SPLIT_TIME_TIE
        limit = None if bound is None else bound * window
        costed = []
        fastest = math.inf   # among the fitting splits timed
        complete = True      # every split costed (none skipped, none found slower than the limit)
        # splits whose first rank alone exceeds the memory (Coster.memory_floor) do not fit: they
        # matter only when no split fits (the smallest peak), and are costed then
        cap = int(cfg.cluster.memory * (1 - cfg.cluster.memory_reserve)) if cfg.workload == "train" else None
        unfit: list[int] = []
        queue = [(f, i, rough) for i, f in enumerate(floors)]
        heapq.heapify(queue)
        while queue:
            floor, i, unrefined = heapq.heappop(queue)
            if floor > min(fastest * window, math.inf if limit is None else limit):
                complete = False
                break   # the floors only grow from here
            sub = with_parallel(cfg, par.model_copy(update={"stage_layers": cands[i]}))
            if unrefined:
                heapq.heappush(queue, (self._sim_floor(sub, floor), i, False))
                continue
            if cap is not None and self.memory_floor(sub.parallel, sum(cands[i][0::par.pp])) > cap:
                unfit.append(i)
                continue
            # with a limit, a split slower than it is neither the fastest nor a tie of a
            # fastest split within the bound: None (it may fit), not timed
            c = self.cost(sub, simulate=simulate, with_memory=simulate, bound=limit)
            if c is None:
                complete = False
                continue
            costed.append((c, i, cands[i]))
            if c.fits:
                fastest = min(fastest, c.step_time)
        if unfit and not any(c.fits for c, _i, _s in costed):   # none fits: the smallest peak is wanted
            for i in unfit:
                sub = with_parallel(cfg, par.model_copy(update={"stage_layers": cands[i]}))
                c = self.cost(sub, simulate=simulate, with_memory=simulate, bound=limit)
                if c is None:
                    complete = False
                else:
                    costed.append((c, i, cands[i]))
        costed.sort(key=lambda x: x[1])
        fitting = [x for x in costed if x[0].fits]
        if not fitting and not complete:   # every split that fits is slower than the bound
            return cands[0], len(cands), None
        if not fitting and not simulate:   # the search drops this layout: report its smallest peak
            best = min(costed, key=lambda x: (x[0].peak, x[1]))
            return best[2], len(cands), best[0]
        pool = fitting or costed
        fastest = min(x[0].step_time for x in pool)
        ties = [x for x in pool if x[0].step_time <= fastest * (1 + SPLIT_TIME_TIE)]
        best = min(ties, key=lambda x: (x[0].peak, x[1]))
        if bound is not None and best[0].step_time > bound:
            return best[2], len(cands), None
        return best[2], len(cands), best[0]

    def _split_floors(self, par: ParallelConfig, splits: list[tuple[int, ...]], simulate: bool) -> list[float]:
        """Per split of layout ``par``, a lower bound on :meth:`cost`'s step time (the step
        adds the non-negative exposed data-parallel time and optimizer step to the
        pipeline's makespan), from the probe's chunk times composed (:func:`_compose`) over the
        split, with the transfers (:func:`~parcompile.analysis.estimate.pipeline_makespan`'s
        ``f`` and ``b``):

        * closed form: the makespan itself, ``m * max(work) + (pp - 1) / v * mean(work)``,
          ``work`` a rank's forward and backward of one micro-batch through its chunks;
        * simulated: for every rank ``r``, ``sum_{k < r} (f_k + b_k) + m * work_r``. Each of
          ``r``'s chunks is model chunk ``r`` or later, so its first forward waits for
          micro-batch 0's forwards through chunks ``0 .. r - 1``; it then runs its
          ``m * work_r`` seconds of actions one at a time; its last action is a backward
          (each forward's backward follows it on the same rank), after which that
          micro-batch's backwards through chunks below ``r`` follow one after another.
          Zero-bubble splits the backward and may end a rank on a weight gradient, which
          nothing waits for: there, ``sum_{k < r} f_k + m * work_r``.

        Each reduced by a relative 1e-9 for rounding (the estimate sums in another order)."""
        pr = self.probe(par)
        ct3, _links, _key = self._chunk_times3(pr, par)
        pp, v, m = par.pp, par.virtual_stages, par.num_microbatches
        n = pp * v
        p2p = ct3.p2p if pp > 1 else 0.0
        f4 = [ct3.fwd(k) for k in range(4)]
        fb4 = [ct3.fwd(k) + ct3.bwd(k) for k in range(4)]
        sim = simulate and pp > 1
        zb = par.schedule == "zero_bubble"
        nd = self.dense
        out = []

        def per_chunk(q: list[float], counts: tuple[int, ...]) -> list[float]:
            if nd:
                x = [d * q[1] + (c - d) * q[2] for c, d in zip(counts, _dense_counts(counts, nd))]
            else:
                x = [c * q[2] for c in counts]
            x[0] += q[0] - q[1]
            x[-1] += q[3] - q[2]
            return x

        for counts in splits:
            fb = per_chunk(fb4, counts)
            if pp > 1:
                for k in range(n):
                    fb[k] += p2p * ((k < n - 1) + (k > 0))
            work = [sum(fb[c * pp + r] for c in range(v)) for r in range(pp)]
            if not sim:
                out.append((m * max(work) + (pp - 1) / v * (sum(work) / pp)) * (1 - 1e-9))
                continue
            if zb:
                f = per_chunk(f4, counts)
                lead = [x + (p2p if k < n - 1 else 0.0) for k, x in enumerate(f)]
            else:
                lead = fb
            before, best = 0.0, 0.0
            for r in range(pp):
                best = max(best, before + m * work[r])
                before += lead[r]
            out.append(best * (1 - 1e-9))
        return out

    def _params_key(self, pr: _Probe) -> tuple:
        """What the probe's parameters are keyed by in the caches: its ``tp, ep,
        expert_tp`` when they equal the first probe's of those (parameters are sharded by
        those degrees only), else the probe itself. Cached per probe."""
        got = self.params_keys.get(id(pr))
        if got is None:
            key = pr.params_of
            owner = self.param_owner.setdefault(key, pr)
            got = self.params_keys[id(pr)] = key if owner is pr or owner.qparams == pr.qparams else (id(pr),)
        return got

    def _stage_params(self, pr: _Probe, counts: tuple[int, ...], pp: int) -> list[StageParams]:
        """:func:`_compose_params` of the probe over ``counts``, cached (the layouts of one
        split that differ in anything else but the probe share them)."""
        key = (self._params_key(pr), counts, pp)
        got = self.stage_param_sets.get(key)
        if got is None:
            got = self.stage_param_sets[key] = _compose_params(pr.qparams, counts, pp, self.cfg.model.tie_embeddings,
                                                               self.dense)
        return got

    def _steps(self, cfg: SpecConfig, deg: dict, sps: list[StageParams]) -> list[_Step]:
        """:func:`_step_entries`, cached by what
        :func:`~parcompile.passes.insert_collectives.step_collectives` reads: the stage
        parameters, the degrees and the layout's ZeRO stage, schedule, micro-batches,
        bucket size, reduce dtype and sequence parallelism (the model is the spec's)."""
        par = cfg.parallel
        key = (id(sps), _step_degrees(deg), par.zero, par.schedule, par.num_microbatches, par.pp,
               par.bucket_size, par.reduce_dtype, par.sequence_parallel)
        got = self.step_sets.get(key)
        if got is None:
            got = self.step_sets[key] = _step_entries(cfg, deg, sps)
        return got

    def _dp_floor(self, cfg: SpecConfig, pr: _Probe, counts: tuple[int, ...], ct: ChunkTimes, links: dict,
                  deg: dict) -> float:
        """A lower bound on the exposed data-parallel time of layout ``cfg`` (split
        ``counts``, chunk times ``ct``) that :meth:`cost` adds to the pipeline, without
        simulating its gradient buckets: :func:`~parcompile.analysis.estimate.dp_exposed`
        without the stage parameters, which counts each stage's gradient reductions against
        its last backward as one block. The bucket-by-bucket simulation
        (:func:`~parcompile.analysis.estimate.grad_overlap`) runs the same reductions on one
        stream, so its last one ends no earlier than their sum: it exposes at least as
        much; the parameter all-gathers and the other step collectives count alike.

        The step collectives are built once per group of layouts that differ in nothing
        they and this reading depend on but the number of micro-batches ``m``: a gradient
        reduced per micro-batch runs ``m`` times and is divided by ``m`` again (one round),
        others run once (ZeRO-3 regathering per micro-batch, ``pp = 1``, keeps ``m`` in the
        group). Reduced by a relative 1e-9 for rounding."""
        par = cfg.parallel
        jit = par.zero >= 3 and reshard_after_forward(par.pp)
        key = (self._params_key(pr), counts, par.pp, par.zero, reduces_per_microbatch(par.zero, par.schedule),
               par.num_microbatches if jit else 0, _step_degrees(deg), par.bucket_size,
               par.reduce_dtype, par.sequence_parallel)
        got = self.dp_groups.get(key)
        if got is None:
            got = self.dp_groups[key] = (cfg, self._steps(cfg, deg, self._stage_params(pr, counts, par.pp)), {})
        cfg0, steps, sums = got
        lkey = (tuple(links.get(a) for a in _STEP_AXES), deg["embedding"])
        got = sums.get(lkey)
        if got is None:
            # FSDP2's buffer copies (eager, ZeRO-3) count per micro-batch, which this group
            # does not fix: left out of the floor (they are not negative)
            got = sums[lkey] = [(g, p, o, 0.0) for g, p, o, _c in step_sums(cfg0, deg, links, steps)]
        return dp_exposed(cfg0, deg, links, None, ct, None, got) * (1 - 1e-9)

    def _data_parallel(self, cfg: SpecConfig, pr: _Probe, ct: ChunkTimes, links: dict, deg: dict,
                       sps: list[StageParams]) -> tuple[float, float]:
        """(exposed data-parallel seconds, optimizer seconds) of layout ``cfg``
        (:func:`~parcompile.analysis.estimate.dp_exposed`, :func:`~parcompile.analysis.estimate.optimizer_time`):
        what :func:`~parcompile.analysis.estimate.step_time_parts` adds to the pipeline,
        which needs no schedule. Cached per layout."""
        key = cfg.parallel
        got = self.exposed.get(key)
        if got is None:
            got = self.exposed[key] = (dp_exposed(cfg, deg, links, self._steps(cfg, deg, sps), ct, sps),
                                       optimizer_time(cfg, deg, sps))
        return got

    def _sim_floor(self, cfg: SpecConfig, floor: float) -> float:
        """A lower bound on the simulated step time of ``cfg`` (a layout with its split)
        from ``floor``, one on its simulated pipeline (:meth:`_split_floors`): plus the
        exposed data-parallel time and the optimizer step, exactly (:meth:`_data_parallel`)."""
        par, model = cfg.parallel, cfg.model
        pr = self.probe(par)
        counts = par.layers_per_chunk(model.layers)
        ct3, links, tkey = self._chunk_times3(pr, par)
        ct, _span, _parts = self._pipeline(cfg, pr, ct3, tkey, counts)
        pp = par.pp
        deg = _degrees(par)
        dp_comm, opt = self._data_parallel(cfg, pr, ct, links, deg,
                                           self._stage_params(pr, counts, pp))
        return floor + dp_comm + opt

    def cost(self, cfg: SpecConfig, simulate: bool = False, with_memory: bool = False,
             bound: float | None = None) -> Candidate | None:
        """Cost ``cfg`` (a spec with every degree given): memory peak, step time, MFU.
        Layers that do not divide into the model chunks, with no ``stage_layers``, are
        split by :meth:`choose_split` first; the candidate's layout carries the split.

        ``bound`` (the search, closed form): a candidate that fits memory is wanted only when
        its step time is at most ``bound``; None is returned instead when it is shown not to
        be (its pipeline, with the optimizer step and a lower bound on its exposed
        data-parallel time, :meth:`_dp_floor`, already takes longer; for a layout to split,
        :meth:`_choose_split`), whether it fits or not (those bounds come first: they cost
        less than the memory report); else the candidate, whatever its time. A layout that
        does not fit is returned untimed (step time inf)."""
        par = cfg.parallel
        if par.stage_layers is None and cfg.model.layers % (par.pp * par.virtual_stages):
            if not (simulate or with_memory):   # the search: the chosen split's own figures
                return self._choose_split(cfg, bound=bound)[2]
            counts, _ = self.choose_split(cfg, simulate=simulate)
            cfg = with_parallel(cfg, par.model_copy(update={"stage_layers": counts}))
        par, model, cl = cfg.parallel, cfg.model, cfg.cluster
        pr = self.probe(par)
        pp, v = par.pp, par.virtual_stages
        counts = par.layers_per_chunk(model.layers)
        deg = _degrees(par)
        bounded = bound is not None and not simulate
        if bounded:   # time: the pipeline, the optimizer step, a floor on the data-parallel time
            ct3, links, tkey = self._chunk_times3(pr, par)
            ct, span, parts = self._pipeline(cfg, pr, ct3, tkey, counts)
            if span > bound:
                return None   # slower than the bound whatever its data-parallel time
            sps = self._stage_params(pr, counts, pp)
            opt = optimizer_time(cfg, deg, sps)
            if span + opt > bound:
                return None   # slower than the bound whatever its data-parallel time
            if span + self._dp_floor(cfg, pr, counts, ct, links, deg) + opt > bound:
                return None
        mem, sps = self.memory(cfg, pr, counts)
        peak, cap = mem.peak, mem.capacity
        if not mem.fits and not with_memory:   # not timed: it will be dropped
            return Candidate(par, math.inf, 0.0, 0.0, peak, cap, 0.0, {})
        if bounded:   # what _data_parallel gives (and keeps, for the re-timing)
            dp_comm = dp_exposed(cfg, deg, links, self._steps(cfg, deg, sps), ct, sps)
            self.exposed.setdefault(par, (dp_comm, opt))
        else:
            ct3, links, tkey = self._chunk_times3(pr, par)
            ct, span, parts = self._pipeline(cfg, pr, ct3, tkey, counts)
            dp_comm, opt = self._data_parallel(cfg, pr, ct, links, deg, sps)
        m = par.num_microbatches
        simulated = simulate and pp > 1
        if simulated:
            # the simulated pipeline (step_time_parts's), shared by the layouts that differ in
            # ZeRO only: the same chunk times, schedule and micro-batches
            skey = (id(pr), tkey, pp, v, m, counts, par.schedule)
            got = self.sims.get(skey)
            if got is None:
                from parcompile.passes.schedule_pipeline import build_actions
                akey = (par.schedule, pp, m, v)   # only zero-bubble orders its actions by the times
                actions = self.action_lists.get(akey)
                if actions is None:
                    f = [ct.fwd(k) for k in range(pp * v)]
                    b = [ct.bwd(k) for k in range(pp * v)]
                    w = [ct.wgrad(k) for k in range(pp * v)]
                    actions = build_actions(par.schedule, pp, m, v, times=(f, [bi - wi for bi, wi in zip(b, w)], w))
                    if par.schedule != "zero_bubble":
                        self.action_lists[akey] = actions
                got = self.sims[skey] = pipeline_parts(cfg, ct, m, actions)
            span, parts = got
        # step_time_parts: the pipeline, the exposed data-parallel time, the optimizer step
        parts = dict(parts)
        parts.update({"dp_comm": dp_comm, "optimizer": opt})
        step = span + dp_comm + opt
        flops = sum(_compose(pr.quad(lambda p: p.model_flops), counts, self.dense)) * par.dp * m
        tflops = flops / (step * par.world_size) / 1e12 if step > 0 else 0.0
        return Candidate(par, step, tflops * 1e12 / cl.peak_flops, tflops, peak, cap,
                         parts.pop("bubble_fraction"), parts, mem if with_memory else None, simulated)


# --------------------------------------------------------------------------------------
# Enumerating layouts


def _values(cfg: SpecConfig, key: str, auto: set[str], choices: list) -> list:
    return choices if key in auto else [getattr(cfg.parallel, key)]


def layouts(cfg: SpecConfig, cross_node_tp: bool = False) -> Iterator[ParallelConfig]:
    """Every layout the spec's ``auto`` keys allow, before the checker: degrees whose
    product is the world size, tp inside a node (unless ``cross_node_tp`` or tp is
    given), the rest from their natural ranges. Candidates the checker rejects are
    filtered by :func:`search`, not here."""
    for r in _layout_rows(cfg, cross_node_tp):
        yield _row_parallel(cfg, r)


def _row_parallel(cfg: SpecConfig, r: tuple) -> ParallelConfig:
    """The :class:`ParallelConfig` of a row of :func:`_layout_rows` (the spec's own values
    for every key the search does not vary)."""
    p = cfg.parallel
    dp, tp, pp, cp, ep, etp, sp, z, mb, gb, sched, v, rc = r
    return ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=etp, sequence_parallel=sp, zero=z,
                          micro_batch=mb, global_batch=gb, schedule=sched, virtual_stages=v,
                          stage_layers=p.stage_layers, recompute=rc, order=p.order, bucket_size=p.bucket_size,
                          reduce_dtype=p.reduce_dtype, auto=p.auto)


def _layout_rows(cfg: SpecConfig, cross_node_tp: bool = False) -> Iterator[tuple]:
    """:func:`layouts` as plain tuples ``(dp, tp, pp, cp, ep, expert_tp, sequence_parallel,
    zero, micro_batch, global_batch, schedule, virtual_stages, recompute)``, in the same
    order (the search builds a :class:`ParallelConfig` only for the rows it costs)."""
    for block in _layout_blocks(cfg, cross_node_tp):
        yield from block


def _layout_blocks(cfg: SpecConfig, cross_node_tp: bool = False) -> Iterator[list[tuple]]:
    """:func:`_layout_rows` in blocks of consecutive rows that differ in ZeRO stage and
    recomputation only, so share their :func:`_check_key` and :func:`_family` (the search
    checks a block once)."""
    p, m, cl = cfg.parallel, cfg.model, cfg.cluster
    auto = set(p.auto)
    world = cl.world_size
    gb_given = "parallel.global_batch" in cfg.spans
    tps = [t for t in divisors(world) if cross_node_tp or t <= cl.gpus_per_node] if "tp" in auto else [p.tp]
    cps = divisors(world) if "cp" in auto else [p.cp]
    pps = divisors(world) if "pp" in auto else [p.pp]
    eps = [e for e in divisors(m.experts) if e <= world] if ("ep" in auto and m.experts) else [p.ep]
    zeros = _values(cfg, "zero", auto, [0, 1, 2, 3])
    recs = _values(cfg, "recompute", auto, ["none", "selective", "full"])
    sp_open = searches_sequence_parallel(cfg)
    sps = [False, True] if sp_open else [p.sequence_parallel]
    etp_given = "parallel.expert_tp" in cfg.spans
    for tp in tps:
        for cp in cps:
            if world % (tp * cp):
                continue
            for pp in pps:
                if world % (tp * cp * pp) or pp > m.layers:
                    continue
                dp = world // (tp * cp * pp)
                if "dp" not in auto and dp != p.dp:
                    continue
                if gb_given:
                    mbs = [b for b in divisors(p.global_batch // dp) if b <= MAX_MICRO_BATCH] \
                        if ("micro_batch" in auto and p.global_batch % dp == 0) else [p.micro_batch]
                else:
                    mbs = [p.micro_batch] if "micro_batch" not in auto else [1]
                if "virtual_stages" in auto:
                    # chunks per rank: divisors of the layers per rank (rounded up when they
                    # do not divide: an uneven split, Coster.choose_split), each chunk a layer at least
                    vs = [x for x in divisors(-(-m.layers // pp)) if (pp > 1 or x == 1) and pp * x <= m.layers]
                else:
                    vs = [p.virtual_stages]
                zs = zeros if dp * cp > 1 else zeros[:1] if "zero" in auto else zeros
                etp = p.expert_tp if etp_given else tp
                for v in vs:
                    if "schedule" in auto:
                        scheds = ["interleaved_1f1b"] if v > 1 else (
                            ["1f1b"] if pp == 1 else ["1f1b", "zero_bubble", "gpipe"])
                    else:
                        scheds = [p.schedule]
                    for sched in scheds:
                        for ep in eps:
                            for mb in mbs:
                                gb = p.global_batch if gb_given else mb * dp
                                for sp in sps:
                                    if sp and tp == 1 and sp_open:
                                        continue
                                    yield [(dp, tp, pp, cp, ep, etp, sp, z, mb, gb, sched, v, rc)
                                           for z in zs for rc in recs]


def searches_sequence_parallel(cfg: SpecConfig) -> bool:
    """Whether the search tries layouts both with and without sequence parallelism (where
    tp > 1): ``sequence_parallel = auto``, or left unset. Megatron-Bridge's recipes and
    torchtitan pair tensor parallelism with sequence parallelism, so a search that kept
    the unset key at its compile default (``false``, SPEC) would skip the layouts they run
    (issue 29: Meta's Llama 3.1 405B layout). A spec compiled without a search keeps the
    default, and so does a serve spec (sequence parallelism is a training layout)."""
    return "sequence_parallel" in cfg.parallel.auto or (
        "parallel.sequence_parallel" not in cfg.spans and cfg.workload == "train")


def with_parallel(cfg: SpecConfig, par: ParallelConfig) -> SpecConfig:
    """``cfg`` with its layout replaced by ``par``."""
    return cfg.model_copy(update={"parallel": par})


def check_layout(cfg: SpecConfig) -> list[Diagnostic]:
    """The checker's diagnostics for ``cfg`` (every rule of
    :func:`parcompile.frontend.checks.check_config`)."""
    ctx = _check_context(cfg)
    check_config(cfg, ctx)
    return ctx.bag.items


def _check_context(cfg: SpecConfig) -> CheckContext:
    """A fresh checker context for ``cfg`` (its spans; nothing reported wrong yet)."""
    provided = {k for k in cfg.spans}
    m = cfg.model
    if m.heads and m.head_dim != m.hidden // m.heads:
        provided.add("model.head_dim")
    return CheckContext(bag=DiagnosticBag(), filename=cfg.filename, spans=dict(cfg.spans), provided=provided)


#: the fields of a layout row (:func:`_layout_rows`), in order
_ROW_FIELDS = ("dp", "tp", "pp", "cp", "ep", "expert_tp", "sequence_parallel", "zero", "micro_batch",
               "global_batch", "schedule", "virtual_stages", "recompute")


class _LayoutChecker:
    """Whether the checker accepts the layouts of one spec, given as rows of
    :func:`_layout_rows`: :func:`check_layout`'s verdict (no error), with each check of
    :data:`~parcompile.frontend.checks.CHECKS` run once per distinct value of the row fields
    it reads (:data:`~parcompile.frontend.checks.LAYOUT_READS`; the other fields of the
    layout are the spec's, the same in every row), a check without an entry once per
    :func:`_check_key`. Each check runs with a context of its own: no check reads a key
    another marks bad (``tests/test_search_checks.py`` holds that, the table against the
    checks' source, and this verdict against :func:`check_layout`'s). ``runs``: the checks
    run so far."""

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        #: per check: its number, the check, what picks its fields out of a row
        self.plan: list[tuple[int, Callable, Callable[[tuple], Any]]] = []
        for n, check in enumerate(CHECKS):
            reads = LAYOUT_READS.get(check)
            idx = None if reads is None else [_ROW_FIELDS.index(f) for f in reads if f in _ROW_FIELDS]
            pick = _check_key if idx is None else (lambda r: ()) if not idx else operator.itemgetter(*idx)
            self.plan.append((n, check, pick))
        self.failed: dict[tuple, bool] = {}   # (check number, the fields it reads) -> it reports an error
        self.runs = 0

    def ok(self, r: tuple) -> bool:
        """True when no check reports an error for the layout of row ``r``."""
        failed = self.failed
        todo = []
        for n, check, pick in self.plan:
            key = (n, pick(r))
            got = failed.get(key)
            if got is None:
                todo.append((key, check))
            elif got:
                return False
        if not todo:
            return True
        rcfg = with_parallel(self.cfg, _row_parallel(self.cfg, r))
        ok = True
        for key, check in todo:
            ctx = _check_context(rcfg)
            check(rcfg, ctx)
            self.runs += 1
            bad = failed[key] = any(d.severity == "error" for d in ctx.bag.items)
            ok = ok and not bad
        return ok


# --------------------------------------------------------------------------------------
# The search


@dataclass
class SearchResult:
    """The ranked, fitting, checker-approved candidates (best first) and the counts."""

    cfg: SpecConfig
    candidates: list[Candidate]
    enumerated: int
    valid: int
    fitting: int
    seconds: float
    #: the smallest memory peak among valid layouts that do not fit (for the message when none fits)
    closest: Candidate | None = None
    #: the user's own layout, when the spec gives every degree
    user: Candidate | None = None
    #: valid layouts not costed: the same layout fits with less recomputation (dominated)
    pruned: int = 0
    #: valid layouts not costed: their model states alone exceed the memory (they do not fit)
    unfit: int = 0
    #: valid layouts not costed: provably slower than the best ``max(RETIME, top)``
    #: (:func:`_rank`); ``candidates`` past those holds only the layouts costed
    bounded: int = 0
    #: valid layouts costed (:meth:`Coster.cost`; a bound may still have dropped them there)
    costed: int = 0
    #: probe graphs built (module docstring)
    probes: int = 0

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def config(self, i: int = 0) -> SpecConfig:
        """The spec with candidate ``i``'s layout."""
        return with_parallel(self.cfg, self.candidates[i].parallel)


def search(cfg: SpecConfig, top: int = 10, cross_node_tp: bool = False,
           progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """Enumerate, check, cost and rank the layouts of ``cfg`` (module docstring).

    ``progress(done, total)`` is called now and then. Raises :class:`SpecError` for a
    model the compiler cannot lower (MoE, for now).
    """

    with paused_gc():
        return _search(cfg, top, cross_node_tp, progress)


def _search(cfg: SpecConfig, top: int, cross_node_tp: bool,
            progress: Callable[[int, int], None] | None) -> SearchResult:
    t0 = time.perf_counter()
    coster = Coster(cfg)
    blocks = list(_layout_blocks(cfg, cross_node_tp))
    rows = [r for block in blocks for r in block]
    total = len(rows)
    # the checker, once per layout up to zero and recompute (they have no cross-field rules):
    # once per block of rows (_layout_blocks), each check once per value of what it reads
    checker = _LayoutChecker(cfg)
    checked: dict[tuple, bool] = {}
    families: dict[tuple, list[int]] = {}
    valid = i = 0
    for block in blocks:
        if progress is not None and i % 4096 < len(block):
            progress(i // 2, total)
        r = block[0]
        ck = _check_key(r)
        ok = checked.get(ck)
        if ok is None:
            ok = checked[ck] = checker.ok(r)
        if ok:
            valid += len(block)
            fam = families.get(_family(r))
            if fam is None:
                fam = families[_family(r)] = []
            fam.extend(range(i, i + len(block)))
        i += len(block)
    keep = max(RETIME, top)
    bounds = BOUNDS and cfg.workload == "train"
    ranked = _rank(cfg, coster, rows, families, keep, bounds, progress, total)
    if not ranked.scored and ranked.unfit:
        # none fits: the closest layout may be one the state bound dropped; rank them all
        ranked = _rank(cfg, coster, rows, families, keep, False, progress, total)
    if progress is not None:
        progress(total, total)
    scored = [c for c, _i in sorted(ranked.scored, key=lambda x: (x[0].key(), x[1]))]
    # re-time the best with their simulated schedules, then confirm each with the full checker
    head = [coster.cost(with_parallel(cfg, _own_split(cfg, c.parallel)), simulate=True, with_memory=True)
            for c in scored[:keep]]
    head.sort(key=Candidate.key)
    final = [c for c in head if not any(d.severity == "error" for d in check_layout(with_parallel(cfg, c.parallel)))]
    rest = scored[keep:]
    result = SearchResult(cfg, final + rest, total, valid, len(scored), time.perf_counter() - t0,
                          ranked.closest[1] if ranked.closest else None, pruned=ranked.pruned,
                          unfit=ranked.unfit, bounded=ranked.bounded, costed=ranked.costed, probes=len(coster.probes))
    if not needs_search(cfg) or _user_layout_complete(cfg):
        try:
            if not any(d.severity == "error" for d in check_layout(cfg)):
                result.user = coster.cost(cfg, simulate=True, with_memory=True)
        except SpecError:
            pass
    return result


#: a layout row of :func:`_layout_rows`: the fields of :class:`ParallelConfig` the search varies
_Row = tuple   # (dp, tp, pp, cp, ep, expert_tp, sequence_parallel, zero, micro_batch, global_batch,
#                 schedule, virtual_stages, recompute)


def _check_key(r: _Row) -> tuple:
    dp, tp, pp, cp, ep, _etp, sp, _z, mb, gb, sched, v, _rc = r
    return (tp, pp, dp, cp, ep, mb, v, sched, sp, gb)


def _family(r: _Row) -> tuple:
    """The probe a row is costed from (:meth:`Coster.probe`'s key)."""
    _dp, tp, _pp, cp, ep, etp, sp, _z, mb, _gb, _sched, _v, _rc = r
    return (tp, cp, sp, mb, ep, etp)


@dataclass
class _Ranked:
    """What :func:`_rank` found: the fitting candidates costed (with their row index), the
    closest one that does not fit (``(peak, row)``, candidate) and the counts."""

    scored: list = field(default_factory=list)
    closest: tuple | None = None
    pruned: int = 0
    unfit: int = 0
    bounded: int = 0
    costed: int = 0


def _rank(cfg: SpecConfig, coster: Coster, rows: list, families: dict[tuple, list[int]], keep: int,
          bounds: bool, progress: Callable[[int, int], None] | None, total: int) -> _Ranked:
    """Cost the valid rows (``families``: probe key -> row indices), best first, by branch
    and bound.

    Every row the unbounded search would cost is costed but for these, each proven not to
    change the ``keep`` best candidates nor their order:

    * ``pruned`` (dominated): the same layout with less recomputation fits, as before;
    * ``unfit``: its model states alone exceed the memory (:meth:`Coster.state_floor`);
    * ``bounded``: once ``keep`` candidates fit, a row whose step time is provably above
      the ``keep``-th smallest cannot be among the ``keep`` best, and is not costed (the
      ranking past the ``keep`` best holds the rows costed only).

    With ``bounds``, a priority queue holds the families (keyed by
    :meth:`Coster.family_floor`, no probe of their own needed) and the rows of the families
    opened so far, each keyed by the largest bound worked out for it so far: its group's
    family floor, then :meth:`Coster.family_layout_floor` (with what the step adds; still no
    probe of its own), then :meth:`Coster.layout_floor` (its own probe). A row the
    family's probes already show not to fit (:meth:`Coster.memory_floor` with ``base``) is
    dropped before its first bound of its own. The lowest comes out first: a family opens into its rows, a row gets its next
    bound and goes back, or, with all of them, is costed (with the bound of the moment,
    :meth:`Coster.cost`). Once the lowest key exceeds the bound, every entry
    left is bounded. The dominance rule reads whether the rows with less recomputation fit,
    working it out (:meth:`Coster.fits`) for those not costed yet. Ties are broken by
    enumeration order, as before. Without ``bounds`` (a spec costed from its whole graph,
    serving, or when no layout fits and the closest is wanted) every row is costed."""
    out = _Ranked()
    worst: list[float] = []   # max-heap (negated) of the `keep` smallest rounded step times
    fit_row: dict[int, bool] = {}            # row -> it fits (costed, or worked out for dominance)
    same: dict[tuple, list[int]] = {}        # (check key, zero) -> its rows, less recomputation first
    floors: dict[tuple, float] = {}
    states: dict[tuple, int] = {}
    cap = int(cfg.cluster.memory * (1 - cfg.cluster.memory_reserve))
    done = total - sum(len(v) for v in families.values())

    def state_floor(fam: tuple, i: int) -> int:
        if not bounds:
            return 0
        r = rows[i]
        skey = (fam, r[2], r[7])   # pp, zero
        sf = states.get(skey)
        if sf is None:
            sf = states[skey] = coster.state_floor(_RowLayout._make(r))
        return sf

    def row_fits(j: int) -> bool:
        got = fit_row.get(j)
        if got is None:
            got = fit_row[j] = (state_floor(_family(rows[j]), j) <= cap
                                and coster.fits(with_parallel(cfg, _row_parallel(cfg, rows[j]))))
        return got

    firsts: dict[tuple, int] = {}

    def first_layers(r: tuple) -> int:   # the fewest layers a split of row r gives the first rank
        key = (r[2], r[11])   # pp, virtual_stages
        got = firsts.get(key)
        if got is None:
            got = firsts[key] = _first_layers(coster.splits(with_parallel(cfg, _row_parallel(cfg, r))), r[2])
        return got

    # entries (key, kind, row, family): kind 0 a family, 1 a row keyed by its family's bound
    # for its group, 2 by its family's bound for the layout (Coster.family_layout_floor), 3 by
    # its own probe's bound as well (Coster.layout_floor; then costed)
    heap: list[tuple] = []
    group_floors: dict[tuple, dict] = {}
    unfit_rows: set[int] = set()   # the model states alone exceed the memory
    for fam, idxs in families.items():
        floor = 0.0
        if bounds:   # the family's own probe not needed (Coster.family_floor)
            groups, reps, fam_states = set(), {}, {}
            for i in idxs:
                dp, _tp, pp, _cp, _ep, _etp, _sp, z, mb, gb, _sched, v, rc = rows[i]
                sf = fam_states.get((pp, z))
                if sf is None:
                    sf = fam_states[(pp, z)] = state_floor(fam, i)
                if sf > cap:
                    unfit_rows.add(i)
                    continue
                groups.add((pp, v, gb // (mb * dp), rc))
                reps.setdefault(pp, i)
            got = group_floors[fam] = coster.family_floor({pp: _row_parallel(cfg, rows[i]) for pp, i in reps.items()},
                                                          sorted(groups)) if groups else {}
            floor = min(got.values(), default=math.inf)
        heapq.heappush(heap, (floor, 0, idxs[0], fam))
    while heap:
        floor, kind, i, fam = heapq.heappop(heap)
        tau = _bound(worst, keep) if bounds else None
        if tau is not None and floor > tau:   # so is every entry left
            heapq.heappush(heap, (floor, kind, i, fam))
            break
        if kind == 0:   # a family: its rows, each with its group's bound
            for j in families[fam]:
                r = rows[j]
                dp, tp, pp, cp, ep, etp, sp, z, mb, gb, sched, v, rc = r
                same.setdefault((_check_key(r), z), []).append(j)
                if j in unfit_rows:
                    fit_row[j] = False
                    out.unfit += 1
                    done += 1
                    continue
                lb = group_floors[fam][(pp, v, gb // (mb * dp), rc)] if bounds else 0.0
                heapq.heappush(heap, (lb, 1, j, fam))
            continue
        if kind < 3 and bounds:   # a bound of the row's own (kind 1: the family's probe; 2: its own), then back
            r = rows[i]
            # shown not to fit without its own probe: before its first bound of its own with
            # the probes built (kind 1), before building its own with one more (kind 2)
            if (kind == 1 or fam not in coster.probes) and coster.memory_floor(
                    _RowLayout._make(r), first_layers(r), base=True, build=kind == 2) > cap:
                fit_row[i] = False
                out.unfit += 1
                done += 1
                continue
            fkey = (kind, fam, r[2], r[11], r[9], r[12], r[7], r[10])   # pp, v, global_batch, recompute, zero, schedule
            lb = floors.get(fkey)
            if lb is None:
                par = _row_parallel(cfg, r)
                lb = floors[fkey] = coster.family_layout_floor(par) if kind == 1 else coster.layout_floor(par)
            heapq.heappush(heap, (max(floor, lb), kind + 1, i, fam))
            continue
        done += 1
        if progress is not None and done % 1024 == 0:
            progress(total // 2 + done // 2, total)
        r = rows[i]
        nr = (_check_key(r), r[7])
        # dominance: the same layout with less recomputation fits
        if any(row_fits(j) for j in same[nr] if j < i):
            out.pruned += 1
            continue
        rcfg = with_parallel(cfg, _row_parallel(cfg, r))
        if bounds and coster.memory_floor(_RowLayout._make(r), first_layers(r)) > cap:
            fit_row[i] = False
            out.unfit += 1
            continue
        out.costed += 1
        c = coster.cost(rcfg, bound=tau)
        if c is None:   # its pipeline alone is slower than the bound
            out.bounded += 1
            continue
        fit_row[i] = c.fits
        if c.fits:
            out.scored.append((c, i))
            t = round(c.step_time, 9)
            if len(worst) < keep:
                heapq.heappush(worst, -t)
            elif t < -worst[0]:
                heapq.heapreplace(worst, -t)
        elif out.closest is None or (c.peak, i) < out.closest[0]:
            out.closest = ((c.peak, i), c)
    for floor, kind, i, fam in heap:   # bounded, without being costed
        if kind > 0:
            out.bounded += 1
        else:
            for j in families[fam]:
                if j in unfit_rows:
                    out.unfit += 1
                else:
                    out.bounded += 1
    return out


def _bound(worst: list[float], keep: int) -> float | None:
    """With ``keep`` candidates costed, a step time above which a candidate cannot be among
    the ``keep`` best (its rounded key would exceed the ``keep``-th smallest); None before."""
    if len(worst) < keep:
        return None
    return -worst[0] + 1e-9


def _own_split(cfg: SpecConfig, par: ParallelConfig) -> ParallelConfig:
    """``par`` without the split the closed-form pass chose for it (re-chosen with the
    simulated schedule when re-timed); a split the spec gives is kept."""
    if "parallel.stage_layers" in cfg.spans or par.stage_layers is None:
        return par
    return par.model_copy(update={"stage_layers": None})


def _user_layout_complete(cfg: SpecConfig) -> bool:
    return not needs_search(cfg)


def split_text(counts, compact: bool = False) -> str:
    """Layers per model chunk, a run of more than three equal counts shortened:
    ``(7, 8, 8, 8, 8, 7)`` -> ``"7, 8 (4 chunks), 7"``, ``(2, 2, 2, 1)`` -> ``"2, 2, 2, 1"``;
    ``compact`` (one word, :meth:`Candidate.degrees_text`): ``"7/8x4/7"``, ``"2/2/2/1"``."""
    runs: list[list[int]] = []
    for c in counts:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    sep, run = ("/", "{c}x{n}") if compact else (", ", "{c} ({n} chunks)")
    return sep.join(run.format(c=c, n=n) if n > 3 else sep.join([str(c)] * n) for c, n in runs)


def settle_split(cfg: SpecConfig, coster: Coster | None = None) -> tuple[SpecConfig, Diagnostic | None]:
    """``cfg`` with the split of an uneven layout fixed, and the ``note`` that says so.

    When ``layers`` does not divide into ``pp * virtual_stages`` model chunks and the spec
    gives no ``stage_layers``, the split is :meth:`Coster.choose_split`'s (the smallest
    estimated step time; the search's candidates carry theirs already). The note is at
    ``pp``, gives the split and how to override it. A layout that divides, or a spec's own
    ``stage_layers``, is returned as it is, with no note."""
    par, layers = cfg.parallel, cfg.model.layers
    chunks = par.pp * par.virtual_stages
    if "parallel.stage_layers" in cfg.spans or layers < chunks or layers % chunks == 0:
        return cfg, None
    compared = None
    if par.stage_layers is None:
        counts, compared = (coster or Coster(cfg)).choose_split(cfg, simulate=True)
        cfg = with_parallel(cfg, par.model_copy(update={"stage_layers": counts}))
    counts = cfg.parallel.stage_layers
    words = f"pp({par.pp})" + (f" * virtual_stages({par.virtual_stages})" if par.virtual_stages > 1 else "")
    among = f" of {compared} splits compared" if compared else ""
    return cfg, Diagnostic(
        "note", f"layers = {layers} do not divide into {words} = {chunks} model chunks: "
                f"split [{split_text(counts)}] in model order, the smallest estimated step time{among} "
                f"(within {SPLIT_TIME_TIE:.0%}: then the smallest memory peak)",
        cfg.span("parallel.pp"),
        help="give `stage_layers` to choose another split",
        note="the first chunk also holds the embedding, the last the output layer and the loss")


def resolve(cfg: SpecConfig) -> tuple[SpecConfig, SearchResult]:
    """The spec with its ``auto`` keys filled by the best candidate, and the search.

    Raises :class:`SpecError` (code ``does-not-fit``) when no candidate fits memory."""
    res = search(cfg, top=1)
    if not res.candidates:
        raise SpecError([no_fit_diagnostic(res)])
    return res.config(0), res


def no_fit_diagnostic(res: SearchResult) -> Diagnostic:
    """The error when no candidate fits (SPEC: ``search`` exits 1)."""
    from parcompile.core.units import bytes_text

    cfg = res.cfg
    if res.closest is not None:
        c = res.closest
        help = (f"the smallest peak, {bytes_text(c.peak)} per GPU ({c.degrees_text()}), exceeds the "
                f"{bytes_text(c.capacity)} available; use more GPUs, GPUs with more memory, or a smaller global_batch")
    else:
        help = "no layout passes the checks; give more of the degrees explicitly to see why"
    return Diagnostic("error", f"no layout fits: {res.valid} valid of {res.enumerated} enumerated, none fits memory",
                      cfg.span("parallel"), help=help, code="does-not-fit")


# --------------------------------------------------------------------------------------
# Reports


def _why(best: Candidate, other: Candidate) -> str:
    """The breakdown terms that differ most between two candidates, in words."""
    diffs = []
    for k in sorted(set(best.breakdown) | set(other.breakdown)):
        d = other.breakdown.get(k, 0.0) - best.breakdown.get(k, 0.0)
        if abs(d) > 1e-4 * max(best.step_time, 1e-9):
            diffs.append((d, k))
    diffs.sort(key=lambda x: -abs(x[0]))
    words = []
    for d, k in diffs[:3]:
        words.append(f"{k} {'+' if d > 0 else '-'}{abs(d) * 1e3:.1f} ms")
    return ", ".join(words) if words else "same estimate; simpler layout"


def table(res: SearchResult, top: int = 10) -> str:
    """The ranked candidates as a text table."""
    from parcompile.core.units import bytes_text

    rows = [("#", "layout", "peak mem", "step", "MFU", "bubble", "vs best")]
    best = res.candidates[0] if res.candidates else None
    for i, c in enumerate(res.candidates[:top]):
        why = "best" if i == 0 else f"+{(c.step_time / best.step_time - 1) * 100:.1f}%: {_why(best, c)}"
        rows.append((str(i + 1), c.degrees_text(), bytes_text(c.peak), f"{c.step_time:.3f} s", f"{c.mfu * 100:.1f}%",
                     f"{c.bubble_fraction * 100:.1f}%", why))
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]) - 1)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    skipped = ""
    if res.unfit or res.bounded:
        skipped = (f"; not costed: {res.unfit} shown not to fit memory, {res.bounded} shown slower than the "
                   f"{max(RETIME, top)} best (the candidates re-timed with their simulated schedules)")
    head = (f"{res.cfg.name}: {plural(res.enumerated, 'layout')} enumerated, {res.valid} pass the checks, "
            f"{res.fitting} fit memory, {res.pruned} dominated by less recomputation{skipped} ({res.seconds:.2f} s)")
    return "\n".join([head, ""] + lines)


def explain(res: SearchResult) -> str:
    """Why the best beats the runner-up, and how far the user's own layout is from it."""
    if not res.candidates:
        return ""
    best = res.candidates[0]
    out = [f"best: {best.degrees_text()}: {best.step_time:.3f} s per step, MFU {best.mfu * 100:.1f}%, "
           f"peak {best.peak / 2**30:.1f} GiB of {best.capacity / 2**30:.1f} GiB"]
    bd = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best.breakdown.items() if v > 0)
    out.append(f"  breakdown: {bd}")
    if len(res.candidates) > 1:
        ru = res.candidates[1]
        out.append(f"runner-up: {ru.degrees_text()}: {ru.step_time:.3f} s "
                   f"(+{(ru.step_time / best.step_time - 1) * 100:.2f}%): {_why(best, ru)}")
    if res.user is not None:
        u = res.user
        if u.parallel == best.parallel or abs(u.step_time - best.step_time) < 1e-12:
            out.append("your layout is the best one found")
        else:
            rank = next((i + 1 for i, c in enumerate(res.candidates) if c.parallel == u.parallel), None)
            fit = "" if u.fits else f"; it does not fit memory (peak {u.peak / 2**30:.1f} GiB)"
            where = f"ranked {rank} of {len(res.candidates)}" if rank else "not among the ranked candidates"
            out.append(f"your layout: {u.degrees_text()}: {u.step_time:.3f} s "
                       f"(+{(u.step_time / best.step_time - 1) * 100:.1f}% vs best, {where}){fit}: "
                       f"{_why(best, u)}")
    return "\n".join(out)


def stderr_progress(min_seconds: float = 1.0) -> Callable[[int, int], None]:
    """A progress callback that draws a bar on stderr when it is a terminal, or after
    ``min_seconds`` (a long search), and stays silent otherwise."""
    t0 = time.perf_counter()
    tty = sys.stderr.isatty()
    shown = [False]

    last = [-1]

    def report(done: int, total: int) -> None:
        if not (tty or time.perf_counter() - t0 > min_seconds or shown[0]):
            return
        shown[0] = True
        n = 30 * done // max(total, 1)
        if tty:
            end = "\n" if done >= total else ""
            print(f"\rsearching [{'#' * n}{'.' * (30 - n)}] {done}/{total}", end=end, file=sys.stderr, flush=True)
        elif n // 6 != last[0]:   # a log, not a terminal: a line every fifth of the way
            last[0] = n // 6
            print(f"searching: {done}/{total} layouts", file=sys.stderr, flush=True)

    return report
