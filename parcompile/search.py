"""Automatic planning: fill every ``auto`` of a spec by searching the layouts.

:func:`search` enumerates the layouts the spec leaves open (``dp tp pp cp ep
virtual_stages micro_batch zero recompute schedule sequence_parallel``), keeps those the
checker accepts (:func:`parcompile.config.checks.check_config`, the same rules as for a
hand-written spec), drops those that do not fit memory and ranks the rest by estimated
step time.

A candidate is costed without building its graph. Decoder layers are alike, so one
*probe* graph per (tp, cp, sequence_parallel, micro_batch) is built and run through the
real passes up to ``insert-collectives``: a three-layer model on three pipeline ranks,
whose first chunk is the embedding plus one layer, the middle one one layer and the last
one a layer plus the output layer. The analyses of :mod:`parcompile.analysis` run on it
(FLOPs, traffic, collectives, saved activations, buffers, parameters), and a candidate's
chunk ``k`` holding ``n_k`` layers costs ``n_k * layer + [k = 0] embedding + [k = last]
output``; memory and time are then the same functions the compiler uses
(:func:`~parcompile.analysis.memory.memory_from_parts`,
:func:`~parcompile.analysis.estimate.step_time_parts`, the closed-form pipeline), and
whether an axis's groups cross nodes comes from
:func:`~parcompile.passes.groups.axis_inside_node`. Nothing per candidate grows with the
world size; probes are cached. The best few candidates are then re-timed with their
simulated schedules (action lists), which is what separates zero-bubble from 1F1B.

``parcompile.compile`` uses :func:`resolve` on a spec with ``auto`` keys: the best
candidate's layout, compiled as if the user had written it.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from parcompile.analysis.comm import CollectiveEntry, comm_report
from parcompile.analysis.compute import compute_report
from parcompile.analysis.estimate import (ChunkTimes, _dp_exposed, chunk_times, efficiency, links_inside,
                                          optimizer_time, pipeline_parts, step_time_parts)
from parcompile.analysis.memory import (OPTIMIZER_STATES, MemoryReport, SavedBytes, buffer_bytes, memory_from_parts,
                                        saved_bytes)
from parcompile.analysis.calibration import cost_without_schedule
from parcompile.analysis.buckets import (GradUnit, buckets_in_flight, partition, reduces_per_microbatch,
                                        reshard_after_forward, shard_elements, zero3_gathered)
from parcompile.analysis.params import StageParams, stage_params
from parcompile.config.checks import CheckContext, check_config
from parcompile.config.schema import ParallelConfig, SpecConfig
from parcompile.config.text import divisors
from parcompile.diagnostics import Diagnostic, DiagnosticBag, SpecError
from parcompile.passes.groups import axis_inside_node

#: keys `auto` may stand for (SPEC 1 `parallel`, extended)
SEARCH_KEYS = ("dp", "tp", "pp", "cp", "ep", "virtual_stages", "micro_batch", "zero", "recompute",
               "schedule", "sequence_parallel")
#: largest micro-batch the search tries
MAX_MICRO_BATCH = 16
#: candidates re-timed with their simulated schedule
RETIME = 24
#: the order ties are broken in (simpler first)
_SCHEDULE_RANK = {"1f1b": 0, "interleaved_1f1b": 1, "zero_bubble": 2, "gpipe": 3}
_RECOMPUTE_RANK = {"none": 0, "selective": 1, "full": 2}
_AXES = ("tp", "cp", "dp", "pp", "dp_cp", "ep", "expert_tp", "expert_dp", "embedding")


def needs_search(cfg: SpecConfig) -> bool:
    """True when the spec leaves a layout choice to the compiler (``auto`` on a key other
    than ``dp``, which alone is fixed by the world size)."""
    return any(k != "dp" for k in cfg.parallel.auto)


# --------------------------------------------------------------------------------------
# Costing one layout from a probe


@dataclass
class _Probe:
    """What one three-layer probe graph gives, per recompute mode (module docstring)."""

    compute: dict[str, Any]
    comm: Any
    saved: dict[str, SavedBytes]
    bufs: dict[str, list[dict[str, int]]]
    params: list[StageParams]
    model_flops: tuple       # per probe chunk: one micro-batch, dp = 1 (global, unpadded)
    hw_flops: dict[str, int]
    degrees: dict[str, int]
    times: dict[tuple, ChunkTimes] = field(default_factory=dict)


def _probe_config(cfg: SpecConfig, tp: int, cp: int, sp: bool, mb: int, ep: int, expert_tp: int) -> SpecConfig:
    model = cfg.model.model_copy(update={"layers": 3, "dense_layers": min(cfg.model.dense_layers, 0)})
    par = ParallelConfig(dp=1, tp=tp, pp=3, cp=cp, ep=ep, expert_tp=expert_tp, sequence_parallel=sp,
                         micro_batch=mb, global_batch=mb, order=cfg.parallel.order)
    return cfg.model_copy(update={"model": model, "parallel": par})


def _build_probe(cfg: SpecConfig, tp: int, cp: int, sp: bool, mb: int, ep: int, expert_tp: int) -> _Probe:
    from parcompile.driver import PASSES, run_pass
    from parcompile.ir.lower import lower
    from parcompile.passes.base import PassContext

    pcfg = _probe_config(cfg, tp, cp, sp, mb, ep, expert_tp)
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
    deg = ctx.degrees
    m = pcfg.model
    comp, saved, bufs = {}, {}, {}
    for rc in ("none", "selective", "full"):
        comp[rc] = compute_report(g, deg, 3, m.vocab, m.padded_vocab(tp), 1, rc)
        saved[rc] = saved_bytes(g, deg, 3, rc, m.dropout > 0)
        rcfg = pcfg.model_copy(update={"parallel": pcfg.parallel.model_copy(update={"recompute": rc})})
        bufs[rc] = buffer_bytes(g, rcfg, deg, saved[rc])
    from parcompile.analysis.compute import BACKWARD_FACTOR, op_fwd_flops
    model_chunk = [0, 0, 0]
    for nd in g.nodes():
        fl = op_fwd_flops(g, nd)
        if fl:
            fl = fl * m.vocab // m.padded_vocab(tp) if nd.type.has_dim("vocab") else fl
            model_chunk[nd.chunk or 0] += fl * (1 + BACKWARD_FACTOR)
    comm = comm_report(g, deg, 1, "none", 3)
    comm_full = comm_report(g, deg, 1, "full", 3)
    params = stage_params(g, deg, 3, m.tie_embeddings)
    assert sum(model_chunk) == comp["none"].model_flops_per_step
    return _Probe(comp, {"none": comm, "selective": comm, "full": comm_full}, saved, bufs, params,
                  tuple(model_chunk), {rc: c.hardware_flops_per_step for rc, c in comp.items()},
                  deg)


def _compose(probe3: tuple, counts: tuple[int, ...]) -> tuple:
    """Per candidate chunk ``k`` with ``counts[k]`` layers: ``n_k * middle + [k = 0]
    (first - middle) + [k = last] (last - middle)`` of the probe's three chunk values."""
    a, b, c = probe3
    last = len(counts) - 1
    return tuple(n * b + (a - b if k == 0 else 0) + (c - b if k == last else 0) for k, n in enumerate(counts))


def _chunk_units(ps: list[StageParams], first: bool, last: bool, n: int, pp1: bool, tied: bool,
                 chunk: int = 0, start: int = 0) -> tuple[GradUnit, ...]:
    """The gradient units (:mod:`parcompile.analysis.buckets`) of one model chunk holding
    ``n`` layers (ids ``start``..), in ready order, from the probe's three stages: the
    output units of its last, ``n`` copies of its middle layer, the embedding units of its
    first. With ``pp1`` (one pipeline rank) a tied embedding is one unit with the other
    embedding parameters and its head is the embedding itself (no copy)."""
    pf, pm, pl = (p.units for p in ps)
    layer = next(u for u in pm if u.name.startswith("layers."))
    out: list[GradUnit] = []
    if last:
        out += [replace(u, chunk=chunk) for u in pl if not u.name.startswith("layers.")
                and not (pp1 and tied and u.name == "tied_head")]
    out += [GradUnit(chunk, f"layers.{start + j}", layer.dense, layer.expert) for j in reversed(range(n))]
    if first:
        emb = [u for u in pf if not u.name.startswith("layers.")]
        if pp1 and tied:   # the tied embedding joins the embedding unit
            out.append(GradUnit(chunk, "embedding", sum(u.dense for u in emb), sum(u.expert for u in emb)))
        else:
            out += [replace(u, chunk=chunk) for u in emb]
    return tuple(out)


def _compose_params(ps: list[StageParams], counts: tuple[int, ...], pp: int, tied: bool) -> list[StageParams]:
    first, mid, last = ps
    out = []
    nchunks = len(counts)
    starts = [sum(counts[:k]) for k in range(nchunks)]
    for s in range(pp):
        acc = {"dense": 0, "expert": 0, "norm": 0}
        emb = 0
        units: list[GradUnit] = []
        for k in reversed(range(s, nchunks, pp)):
            units += _chunk_units(ps, k == 0, k == nchunks - 1, counts[k], pp == 1, tied, k // pp, starts[k])
        for k in range(s, nchunks, pp):
            for f in acc:
                acc[f] += counts[k] * getattr(mid, f)
                if k == 0:
                    acc[f] += getattr(first, f) - getattr(mid, f)
                if k == nchunks - 1:
                    acc[f] += getattr(last, f) - getattr(mid, f)
            if tied and k == 0:
                emb = first.embedding
            if tied and k == nchunks - 1:
                if pp == 1:   # one rank holds the embedding and reads it as the head
                    acc["dense"] -= last.embedding
                else:
                    emb = last.embedding
        out.append(StageParams(s, acc["dense"], acc["expert"], acc["norm"], emb, tuple(units)))
    return out


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
        """``tp 8 pp 4 dp 32 ...``: the layout in one line (only what differs from defaults)."""
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
        self.inside: dict[tuple, dict[str, bool]] = {}
        self.pipes: dict[tuple, tuple[float, dict]] = {}
        self.stage_layer_sums: dict[tuple, tuple[int, ...]] = {}
        self.buf_sums: dict[tuple, tuple[int, int, int]] = {}
        self.shard_sums: dict[tuple, tuple] = {}

    @property
    def unlike_layers(self) -> bool:
        """Layers of two kinds (an MoE model's leading ``dense_layers``): the one-layer probe
        does not describe them, so such specs are costed from their whole graph."""
        return self.cfg.model.experts > 0 and self.cfg.model.dense_layers > 0

    def _cost_exactly(self, cfg: SpecConfig, simulate: bool, with_memory: bool) -> Candidate:
        """The compiler's own figures for ``cfg``: the whole graph, with the closed-form
        pipeline, or, with ``simulate``, the full compile and its simulated schedule."""
        if simulate:
            from parcompile.driver import compile_config

            d = compile_config(cfg).data
            mem, est = d["memory"], d["estimate"]
            return Candidate(cfg.parallel, est["step_time"], est["mfu"], est["tflops_per_gpu"], mem["peak"],
                             mem["capacity"], d["schedule"]["bubble_fraction"], dict(est["breakdown"]),
                             None, True)
        rep = cost_without_schedule(cfg)
        t = rep.time
        return Candidate(cfg.parallel, t.step_time, t.mfu, t.tflops_per_gpu, rep.memory.peak, rep.memory.capacity,
                         t.bubble_fraction, dict(t.breakdown), rep.memory if with_memory else None, False)

    def probe(self, par: ParallelConfig) -> _Probe:
        key = (par.tp, par.cp, par.sequence_parallel, par.micro_batch, par.ep, par.expert_tp)
        got = self.probes.get(key)
        if got is None:
            got = self.probes[key] = _build_probe(self.cfg, *key)
        return got

    def _inside(self, par: ParallelConfig) -> dict[str, bool]:
        key = (par.tp, par.cp, par.dp, par.pp, par.ep, par.expert_tp, par.order)
        got = self.inside.get(key)
        if got is None:
            gpn = self.cfg.cluster.gpus_per_node
            got = self.inside[key] = {a: axis_inside_node(par, a, gpn) for a in _AXES}
        return got

    def _stage_layers(self, counts: tuple[int, ...], pp: int) -> tuple[int, ...]:
        """Layers per pipeline rank: the sum of ``counts`` over the rank's chunks."""
        key = (counts, pp)
        got = self.stage_layer_sums.get(key)
        if got is None:
            got = self.stage_layer_sums[key] = tuple(sum(counts[s::pp]) for s in range(pp))
        return got

    def _buffer_sums(self, pr: _Probe, rc: str, pp: int) -> tuple[int, int, int]:
        """Total buffer bytes of a first, middle and last pipeline rank (as :meth:`cost`
        composes them), and of the only rank when pp = 1 (returned as the first)."""
        key = (id(pr), rc, pp == 1)
        got = self.buf_sums.get(key)
        if got is None:
            pb = pr.bufs[rc]
            out = []
            for extras in ([pb[0]], [], [pb[2]]) if pp > 1 else ([pb[0], pb[2]],):
                b = dict(pb[1])
                for extra in extras:
                    for k2, x in extra.items():
                        b[k2] = max(b.get(k2, 0), x)
                if pp == 1:
                    b.pop("p2p", None)
                out.append(sum(b.values()))
            got = self.buf_sums[key] = tuple(out) if pp > 1 else (out[0], out[0], out[0])
        return got

    def _chunk_shards(self, pr: _Probe, first: bool, last: bool, n: int, pp1: bool, tied: bool,
                      bucket_size: int, d: int, ed: int) -> tuple[int, int, tuple[int, int], tuple[int, int]]:
        """(dense, expert, zero3, in_flight) for one model chunk of ``n`` layers on one rank:
        elements of sharded state (the sum over its gradient buckets of ``ceil(n_b / d)``),
        the ZeRO-3 gathered elements ``(step_long, just_in_time)`` of
        :func:`parcompile.analysis.buckets.zero3_gathered`, and the full gradient elements
        in flight ``(dense, expert)`` of :func:`parcompile.analysis.buckets.buckets_in_flight`
        (buckets close at chunk ends, so a stage's is the largest of its chunks')."""
        key = (id(pr), first, last, n, pp1, tied, bucket_size, d, ed)
        got = self.shard_sums.get(key)
        if got is None:
            units = _chunk_units(pr.params, first, last, n, pp1, tied)
            dense, expert = partition(units, bucket_size, "dense"), partition(units, bucket_size, "expert")
            got = self.shard_sums[key] = (shard_elements(dense, d), shard_elements(expert, ed),
                                          zero3_gathered([(dense, d), (expert, ed)], reshard_after_forward(1 if pp1 else 2)),
                                          (buckets_in_flight(dense, d), buckets_in_flight(expert, ed)))
        return got

    def peak(self, cfg: SpecConfig, pr: _Probe, counts: tuple[int, ...]) -> tuple[int, int]:
        """``(peak, capacity)`` of a training layout: exactly what
        :func:`memory_from_parts` finds for the parts :meth:`cost` composes, in integer
        arithmetic and time linear in pp (no per-stage reports; most layouts are dropped
        on this alone)."""
        par, model = cfg.parallel, cfg.model
        pp, v, m = par.pp, par.virtual_stages, par.num_microbatches
        e, z = model.dtype_bytes, par.zero
        opt_per = 4 * OPTIMIZER_STATES[cfg.train.optimizer] + (4 if e < 4 else 0)

        def states(n: int, shard: int, dd: int) -> int:   # memory.state_bytes
            return (e * (shard if z >= 3 else n) + 4 * (shard if z >= 2 else shard * dd if z == 1 and dd > 1 else n)
                    + opt_per * (shard if z >= 1 else n))

        first, mid, last = pr.params
        tied = model.tie_embeddings
        sv = pr.saved[par.recompute]
        (pa, pb_, pc), (oa, ob, oc) = sv.per_chunk, sv.output_layer
        ba, bb, bc = pa - oa, pb_ - ob, pc - oc
        nl = self._stage_layers(counts, pp)
        bufs = self._buffer_sums(pr, par.recompute, pp)
        d, ed = par.dp * par.cp, par.expert_dp
        sched = par.schedule
        n_out = m if sched == "gpipe" else 1
        per_mb = reduces_per_microbatch(z, sched)
        nchunks = len(counts)
        peak = None
        for s in range(pp):
            shard, eshard = 0, 0   # ZeRO: sharded per gradient bucket; buckets close at chunk ends
            step_long, jit = 0, 0  # ZeRO-3: gathered buckets (analysis/buckets.zero3_gathered)
            fly, efly = 0, 0       # ZeRO 2, 3 per micro-batch: full buckets in flight (buckets_in_flight)
            for k in range(s, nchunks, pp):
                a, b, (g_step, g_jit), (f_d, f_e) = self._chunk_shards(pr, k == 0, k == nchunks - 1, counts[k],
                                                                       pp == 1, tied, par.bucket_size, d, ed)
                shard += a
                eshard += b
                step_long += g_step
                jit = max(jit, g_jit)
                fly, efly = max(fly, f_d), max(efly, f_e)
            n = nl[s]
            dense = n * mid.dense
            expert = n * mid.expert
            body = n * bb
            outl = n * ob
            if s == 0:
                dense += first.dense - mid.dense
                expert += first.expert - mid.expert
                body += ba - bb
                outl += oa - ob
            if s == pp - 1:
                dense += last.dense - mid.dense
                expert += last.expert - mid.expert
                body += bc - bb
                outl += oc - ob
                if tied and pp == 1:
                    dense -= last.embedding
            if sched == "gpipe":
                num, den = m, 1
            elif sched == "interleaved_1f1b" and v > 1:
                num, den = min(2 * (pp - s - 1) + (v - 1) * pp + 1, m * v), v
            else:
                num, den = min(pp - s, m), 1
            q = num * body
            acts = (q // den if q >= 0 else -(-q // den)) + n_out * outl
            gathered = e * (step_long + jit) if z >= 3 else 0
            # ZeRO 2, 3: the full gradient buffers during the step (memory.full_grad_bytes): the
            # buckets in flight when reduced per micro-batch, else all of them
            if z < 2:
                full_grads = 0
            elif per_mb:
                full_grads = 4 * (fly + efly)
            else:
                full_grads = 4 * ((shard * d if d > 1 else 0) + (eshard * ed if ed > 1 else 0))
            total = (states(dense, shard, d) + states(expert, eshard, ed) + acts + gathered + full_grads
                     + (bufs[0] if s == 0 else bufs[2] if s == pp - 1 else bufs[1]))
            if peak is None or total > peak:
                peak = total
        return peak, int(cfg.cluster.memory * (1 - cfg.cluster.memory_reserve))

    def cost(self, cfg: SpecConfig, simulate: bool = False, with_memory: bool = False) -> Candidate:
        """Cost ``cfg`` (a spec with every degree given): memory peak, step time, MFU."""
        if self.unlike_layers:
            return self._cost_exactly(cfg, simulate, with_memory)
        par, model, cl = cfg.parallel, cfg.model, cfg.cluster
        pr = self.probe(par)
        rc = par.recompute
        pp, v = par.pp, par.virtual_stages
        counts = par.layers_per_chunk(model.layers)
        if not with_memory and cfg.workload != "serve":
            peak, cap = self.peak(cfg, pr, counts)
            if peak > cap:   # not timed: it will be dropped
                return Candidate(par, math.inf, 0.0, 0.0, peak, cap, 0.0, {})
        deg = {"dp": par.dp, "tp": par.tp, "pp": pp, "cp": par.cp, "ep": par.ep, "expert_tp": par.expert_tp,
               "expert_dp": par.expert_dp, "dp_cp": par.dp * par.cp, "embedding": 2 if pp > 1 else 1}
        # memory
        sv = pr.saved[rc]
        saved = SavedBytes(_compose(sv.per_chunk, counts), {}, {}, _compose(sv.output_layer, counts))
        pb = pr.bufs[rc]
        bufs = []
        for s in range(pp):
            b = dict(pb[1])
            for extra in ([pb[0]] if s == 0 else []) + ([pb[2]] if s == pp - 1 else []):
                for k2, x in extra.items():
                    b[k2] = max(b.get(k2, 0), x)
            if pp == 1:
                b.pop("p2p", None)
            bufs.append(b)
        sps = _compose_params(pr.params, counts, pp, model.tie_embeddings)
        mem = memory_from_parts(cfg, deg, sps, saved, bufs)
        if not mem.fits and not with_memory:   # not timed: it will be dropped
            return Candidate(par, math.inf, 0.0, 0.0, mem.peak, mem.capacity, 0.0, {})
        # time
        inside = self._inside(par)
        links = links_inside(cl, inside, self.eff)
        tkey = (rc, tuple(sorted(inside.items())))
        ct3 = pr.times.get(tkey)
        if ct3 is None:
            ct3 = pr.times[tkey] = chunk_times(_probe_config(cfg, par.tp, par.cp, par.sequence_parallel,
                                                             par.micro_batch, par.ep, par.expert_tp)
                                               .model_copy(update={"parallel": ParallelConfig(
                                                   dp=1, tp=par.tp, pp=3, cp=par.cp, ep=par.ep,
                                                   expert_tp=par.expert_tp, micro_batch=par.micro_batch,
                                                   global_batch=par.micro_batch, recompute=rc,
                                                   sequence_parallel=par.sequence_parallel)}),
                                               pr.degrees, None, pr.compute[rc], pr.comm[rc], links)
        fams = ("tp", "cp", "ep")
        ct = ChunkTimes(_compose(ct3.matmul_f, counts), _compose(ct3.memory_f, counts),
                        _compose(ct3.recompute, counts),
                        {f: _compose(ct3.comm_f[f], counts) for f in fams},
                        {f: _compose(ct3.comm_b[f], counts) for f in fams}, ct3.p2p)
        from parcompile.passes.insert_collectives import step_collectives
        steps = [CollectiveEntry(op, axis, nb, count, where, s, "step")
                 for s, _key, op, axis, nb, where, count in step_collectives(cfg, deg, sps)]
        m = par.num_microbatches
        actions = None
        if simulate and pp > 1:
            from parcompile.passes.schedule_pipeline import build_actions
            f = [ct.fwd(k) for k in range(pp * v)]
            b = [ct.bwd(k) for k in range(pp * v)]
            w = [ct.wgrad(k) for k in range(pp * v)]
            actions = build_actions(par.schedule, pp, m, v, times=(f, [bi - wi for bi, wi in zip(b, w)], w))
        if actions is None:
            pkey = (id(pr), tkey, pp, v, par.schedule, m, counts)
            got = self.pipes.get(pkey)
            if got is None:
                got = self.pipes[pkey] = pipeline_parts(cfg, ct, m)
            span, parts = got
            parts = dict(parts)
            dp_comm = _dp_exposed(cfg, deg, links, steps, ct, sps)
            opt = optimizer_time(cfg, deg, sps)
            parts.update({"dp_comm": dp_comm, "optimizer": opt})
            step = span + dp_comm + opt
        else:
            step, parts = step_time_parts(cfg, deg, links, ct, m, steps, sps, actions)
        flops = sum(_compose(pr.model_flops, counts)) * par.dp * m
        tflops = flops / (step * par.world_size) / 1e12 if step > 0 else 0.0
        return Candidate(par, step, tflops * 1e12 / cl.peak_flops, tflops, mem.peak, mem.capacity,
                         parts.pop("bubble_fraction"), parts, mem if with_memory else None, actions is not None)


# --------------------------------------------------------------------------------------
# Enumerating layouts


def _values(cfg: SpecConfig, key: str, auto: set[str], choices: list) -> list:
    return choices if key in auto else [getattr(cfg.parallel, key)]


def layouts(cfg: SpecConfig, cross_node_tp: bool = False) -> Iterator[ParallelConfig]:
    """Every layout the spec's ``auto`` keys allow, before the checker: degrees whose
    product is the world size, tp inside a node (unless ``cross_node_tp`` or tp is
    given), the rest from their natural ranges. Candidates the checker rejects are
    filtered by :func:`search`, not here."""
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
    sps = _values(cfg, "sequence_parallel", auto, [False, True])
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
                    vs = [x for x in divisors(m.layers // pp) if pp > 1 or x == 1] if m.layers % pp == 0 else [1]
                else:
                    vs = [p.virtual_stages]
                for v in vs:
                    if "schedule" in auto:
                        scheds = ["interleaved_1f1b"] if v > 1 else (
                            ["1f1b"] if pp == 1 else ["1f1b", "zero_bubble", "gpipe"])
                    else:
                        scheds = [p.schedule]
                    for sched in scheds:
                        for ep in eps:
                            for mb in mbs:
                                for sp in sps:
                                    if sp and (tp == 1 or cp > 1) and "sequence_parallel" in auto:
                                        continue
                                    for z in (zeros if dp * cp > 1 else zeros[:1] if "zero" in auto else zeros):
                                        for rc in recs:
                                            yield ParallelConfig(
                                                dp=dp, tp=tp, pp=pp, cp=cp, ep=ep,
                                                expert_tp=(p.expert_tp if "parallel.expert_tp" in cfg.spans else tp),
                                                sequence_parallel=sp, zero=z, micro_batch=mb,
                                                global_batch=p.global_batch if gb_given else mb * dp,
                                                schedule=sched, virtual_stages=v,
                                                stage_layers=p.stage_layers, recompute=rc, order=p.order,
                                                auto=p.auto)


def with_parallel(cfg: SpecConfig, par: ParallelConfig) -> SpecConfig:
    """``cfg`` with its layout replaced by ``par``."""
    return cfg.model_copy(update={"parallel": par})


def check_layout(cfg: SpecConfig) -> list[Diagnostic]:
    """The checker's diagnostics for ``cfg`` (every rule of
    :func:`parcompile.config.checks.check_config`), plus the layouts the compiler
    rejects after the checker (sequence parallelism with cp > 1)."""
    bag = DiagnosticBag()
    provided = {k for k in cfg.spans}
    m = cfg.model
    if m.heads and m.head_dim != m.hidden // m.heads:
        provided.add("model.head_dim")
    ctx = CheckContext(bag=bag, filename=cfg.filename, spans=dict(cfg.spans), provided=provided)
    check_config(cfg, ctx)
    p = cfg.parallel
    if p.sequence_parallel and p.tp > 1 and p.cp > 1:
        bag.error("sequence_parallel with cp > 1 is not supported yet", cfg.span("parallel.sequence_parallel"))
    return bag.items


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
    from parcompile.driver import paused_gc

    with paused_gc():
        return _search(cfg, top, cross_node_tp, progress)


def _search(cfg: SpecConfig, top: int, cross_node_tp: bool,
            progress: Callable[[int, int], None] | None) -> SearchResult:
    t0 = time.perf_counter()
    coster = Coster(cfg)
    all_layouts = list(layouts(cfg, cross_node_tp))
    total = len(all_layouts)
    checked: dict[tuple, bool] = {}
    scored: list[Candidate] = []
    closest: Candidate | None = None
    valid = pruned = 0
    fitted: set[tuple] = set()
    for i, par in enumerate(all_layouts):
        if progress is not None and i % 256 == 0:
            progress(i, total)
        # zero and recompute have no cross-field rules: check a layout once for all of them
        ck = (par.tp, par.pp, par.dp, par.cp, par.ep, par.micro_batch, par.virtual_stages, par.schedule,
              par.sequence_parallel, par.global_batch)
        ok = checked.get(ck)
        if ok is None:
            ok = checked[ck] = not any(d.severity == "error" for d in check_layout(with_parallel(cfg, par)))
        if not ok:
            continue
        valid += 1
        # recomputation only adds time: once a layout fits with less of it, more is dominated
        nr = (ck, par.zero)
        if nr in fitted:
            pruned += 1
            continue
        c = coster.cost(with_parallel(cfg, par))
        if c.fits:
            scored.append(c)
            fitted.add(nr)
        elif closest is None or c.peak < closest.peak:
            closest = c
    if progress is not None:
        progress(total, total)
    scored.sort(key=Candidate.key)
    # re-time the best with their simulated schedules, then confirm each with the full checker
    head = [coster.cost(with_parallel(cfg, c.parallel), simulate=True, with_memory=True)
            for c in scored[:max(RETIME, top)]]
    head.sort(key=Candidate.key)
    final = [c for c in head if not any(d.severity == "error" for d in check_layout(with_parallel(cfg, c.parallel)))]
    rest = scored[max(RETIME, top):]
    result = SearchResult(cfg, final + rest, total, valid, len(scored), time.perf_counter() - t0, closest,
                          pruned=pruned)
    if not needs_search(cfg) or _user_layout_complete(cfg):
        try:
            if not any(d.severity == "error" for d in check_layout(cfg)):
                result.user = coster.cost(cfg, simulate=True, with_memory=True)
        except SpecError:
            pass
    return result


def _user_layout_complete(cfg: SpecConfig) -> bool:
    return not needs_search(cfg)


def resolve(cfg: SpecConfig) -> tuple[SpecConfig, SearchResult]:
    """The spec with its ``auto`` keys filled by the best candidate, and the search.

    Raises :class:`SpecError` (code ``does-not-fit``) when no candidate fits memory."""
    res = search(cfg, top=1)
    if not res.candidates:
        raise SpecError([no_fit_diagnostic(res)])
    return res.config(0), res


def no_fit_diagnostic(res: SearchResult) -> Diagnostic:
    """The error when no candidate fits (SPEC: ``search`` exits 1)."""
    from parcompile.plan import _gb

    cfg = res.cfg
    if res.closest is not None:
        c = res.closest
        help = (f"the smallest peak, {_gb(c.peak)} per GPU ({c.degrees_text()}), exceeds the "
                f"{_gb(c.capacity)} available; use more GPUs, GPUs with more memory, or a smaller global_batch")
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
    from parcompile.plan import _gb

    rows = [("#", "layout", "peak mem", "step", "MFU", "bubble", "vs best")]
    best = res.candidates[0] if res.candidates else None
    for i, c in enumerate(res.candidates[:top]):
        why = "best" if i == 0 else f"+{(c.step_time / best.step_time - 1) * 100:.1f}%: {_why(best, c)}"
        rows.append((str(i + 1), c.degrees_text(), _gb(c.peak), f"{c.step_time:.3f} s", f"{c.mfu * 100:.1f}%",
                     f"{c.bubble_fraction * 100:.1f}%", why))
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]) - 1)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    head = (f"{res.cfg.name}: {res.enumerated} layouts enumerated, {res.valid} pass the checks, "
            f"{res.fitting} fit memory, {res.pruned} dominated by less recomputation ({res.seconds:.2f} s)")
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
