"""Probes: the three-layer graphs a layout is costed from, and how a candidate's chunks are
composed of a probe's (:mod:`parcompile.layout_search`, module docstring)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from parcompile.analysis.buckets import GradUnit
from parcompile.analysis.comm import comm_report
from parcompile.analysis.gemm import gemm_pricer
from parcompile.analysis.lora import (frozen_backward, frozen_saves, is_lora, lora_chunk_flops,
                                     with_adapter_activations, with_adapter_collectives)
from parcompile.analysis.compute import BACKWARD_FACTOR, compute_report, op_fwd_flops
from parcompile.analysis.estimate import ChunkTimes
from parcompile.ir.fp8 import GraphFp8, bf16_layers, graph_fp8
from parcompile.ir.fp8 import enabled as fp8_enabled
from parcompile.analysis.memory import SavedBytes, buffer_bytes, merge_buffers, saved_bytes
from parcompile.analysis.params import StageParams, stage_params
from parcompile.config.schema import ParallelConfig, SpecConfig
from parcompile.core.attention import attention_engine
from parcompile.core.schedule import LOOP, Placement
from parcompile.diagnostics import Diagnostic, SpecError
from parcompile.ir.lower import lower
from parcompile.passes.base import PassContext
from parcompile.passes.manager import PASSES, run_pass


class PerMode(dict):
    """``recompute mode -> value``, each computed the first time it is read."""

    def __init__(self, make: Callable[[str], Any]):
        super().__init__()
        self._make = make

    def __missing__(self, rc: str) -> Any:
        got = self[rc] = self._make(rc)
        return got


class Probe:
    """What one three-layer probe graph gives (module docstring). The graph is built and
    run through the passes once; each analysis runs the first time a layout reads it, per
    recompute mode (``compute``, ``comm``, ``saved``, ``bufs``: mappings ``rc -> report``),
    so a family of layouts the search bounds out early costs the passes and the reports it
    read only."""

    #: an MoE model's leading dense layers (``dense_layers``, fewer than its layers): the probe of
    #: the same key whose three layers are dense (the probe itself holds MoE layers), else None
    dense_probe: "Probe | None" = None

    def __init__(self, cfg: SpecConfig, tp: int, cp: int, sp: bool, mb: int, ep: int, expert_tp: int,
                 dense: bool = False, bf16: bool = False):
        pcfg = self.pcfg = probe_config(cfg, tp, cp, sp, mb, ep, expert_tp, dense)
        ctx = PassContext.of(pcfg)
        try:
            g = lower(pcfg.model, batch=mb, origin=cfg.span("model"))
        except NotImplementedError:
            raise SpecError([Diagnostic(
                "error", f"mixture-of-experts models (experts = {cfg.model.experts}) cannot be searched yet",
                cfg.span("model.experts"), help="set experts = 0 for a dense model",
                note="MoE layers are not lowered yet (issue 8)")]) from None
        g.fp8 = probe_fp8(cfg, bf16)
        for p in PASSES:
            if p.name == "schedule-pipeline":
                break
            run_pass(p, g, ctx, check=False)
        self.graph = g
        self.degrees: dict[str, int] = ctx.degrees
        self.params_of = (tp, ep, expert_tp)
        self.compute = PerMode(self._compute)
        self.comm = PerMode(self._comm)
        self.saved = PerMode(self._saved)
        self.bufs = PerMode(self._bufs)
        self.times: dict[tuple, ChunkTimes] = {}
        self._params: list[StageParams] | None = None
        self._qparams: tuple[StageParams, ...] | None = None
        self._model_flops: tuple | None = None

    def _compute(self, rc: str):
        m, tp = self.pcfg.model, self.pcfg.parallel.tp
        return compute_report(self.graph, self.degrees, 3, m.vocab, m.padded_vocab(tp), 1, rc, self.pcfg.cluster.engine,
                              attention_engine(self.pcfg.cluster), fp8=fp8_enabled(self.pcfg),
                              gemm=gemm_pricer(self.pcfg))

    def _comm(self, rc: str):
        """The probe's collectives of one micro-batch in recompute mode ``rc``, with LoRA's as the
        compiler has them (:func:`parcompile.analysis.cost.analyze`: the frozen start's backward
        collectives left out, :func:`~parcompile.analysis.lora.frozen_backward`; the adapters'
        added, :func:`~parcompile.analysis.lora.with_adapter_collectives`)."""
        if rc == "selective" and not is_lora(self.pcfg):   # the same collectives as without recomputation
            return self.comm["none"]
        comm = comm_report(self.graph, self.degrees, 1, rc, 3, *frozen_backward(self.pcfg, self.graph))
        return with_adapter_collectives(self._in_mode(rc), self.degrees, comm, 1, self.graph)

    def _saved(self, rc: str) -> SavedBytes:
        """What one micro-batch saves per probe chunk in mode ``rc``, LoRA's as the compiler counts
        it (:func:`parcompile.analysis.memory.memory_report`: the frozen weights' saves,
        :func:`~parcompile.analysis.lora.frozen_saves`, and the adapters',
        :func:`~parcompile.analysis.lora.with_adapter_activations`)."""
        saved = saved_bytes(self.graph, self.degrees, 3, rc, self.pcfg.model.dropout > 0, self.pcfg.cluster.engine,
                            attention_engine(self.pcfg.cluster), fp8=fp8_enabled(self.pcfg),
                            lora=frozen_saves(self.pcfg, self.graph))
        return with_adapter_activations(self._in_mode(rc), self.degrees, saved, self.graph)

    def _in_mode(self, rc: str) -> SpecConfig:
        """The probe's spec in recompute mode ``rc``."""
        pcfg = self.pcfg
        return pcfg.model_copy(update={"parallel": pcfg.parallel.model_copy(update={"recompute": rc})})

    def _bufs(self, rc: str) -> list[dict[str, int]]:
        return buffer_bytes(self.graph, self._in_mode(rc), self.degrees, self.saved[rc])

    def quad(self, get: Callable[["Probe"], Any]) -> tuple:
        """``(first, dense middle, middle, last)`` of a per-chunk value ``get(probe)`` (three
        values, one per probe chunk): the first chunk (embedding and a layer) and the middle
        layer of the dense probe (:attr:`dense_probe`), the middle layer and the last chunk
        (a layer and the output layer) of this one; without a dense probe, ``(first,
        middle, middle, last)`` of this one (:func:`compose`)."""
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
            g, m, tp = self.graph, self.pcfg.model, self.pcfg.parallel.tp
            chunk = [0, 0, 0]
            for nd in g.nodes():
                fl = op_fwd_flops(g, nd)
                if fl:
                    fl = fl * m.vocab // m.padded_vocab(tp) if nd.type.has_dim("vocab") else fl
                    chunk[nd.chunk or 0] += fl * (1 + BACKWARD_FACTOR)
            assert sum(chunk) == self.compute["none"].model_flops_per_step
            lora = lora_chunk_flops(self.pcfg, g)[0]   # LoRA's, as analysis/cost.py's lora_step_flops
            self._model_flops = tuple(c + x for c, x in zip(chunk, lora))
        return self._model_flops


def probe_config(cfg: SpecConfig, tp: int, cp: int, sp: bool, mb: int, ep: int, expert_tp: int,
                  dense: bool = False) -> SpecConfig:
    """The three-layer probe model of ``cfg`` (module docstring) with the given degrees; its
    layers dense (``dense``: an MoE model's ``dense_layers``) or all of the model's kind."""
    model = cfg.model.model_copy(update={"layers": 3, "dense_layers": 3 if dense else 0})
    par = probe_parallel(tp, cp, sp, mb, ep, expert_tp, order=cfg.parallel.order)
    return cfg.model_copy(update={"model": model, "parallel": par})


def probe_fp8(cfg: SpecConfig, bf16: bool = False) -> GraphFp8 | None:
    """``Graph.fp8`` of a probe of ``cfg`` (the compiler's rule, :func:`parcompile.analysis.fp8.
    graph_fp8`, on the probe's three layers): its layers' GEMMs in FP8, or (``bf16``: the
    probe of the layers ``cfg`` keeps in 16 bits, :func:`leading_layers`) in 16 bits. Not
    FP8-gathered: the probe serves every ZeRO level (the gathered weights' amaxes are not
    timed per micro-batch). None without FP8."""
    marks = graph_fp8(cfg)
    if marks is None:
        return None
    return GraphFp8(marks.recipe, frozenset(range(3)) if bf16 else frozenset())


def leading_layers(cfg: SpecConfig) -> int:
    """How many leading layers of ``cfg``'s model the search probes apart
    (:attr:`Probe.dense_probe`, :func:`compose`): an MoE model's leading dense layers
    (:func:`leading_dense_layers`), or the layers FP8 training keeps in 16 bits at the start
    (``train.fp8_bf16_layers_start``, :func:`parcompile.ir.fp8.bf16_layers`).

    Raises:
        SpecError: 16-bit layers at the end (``fp8_bf16_layers_end``), or at the start of an
            MoE model with leading dense layers: the probes compose one kind of leading layer
            only.
    """
    dense, kept = leading_dense_layers(cfg), bf16_layers(cfg)
    if not kept:
        return dense
    t, n = cfg.train, cfg.model.layers
    start = len([i for i in kept if i < t.fp8_bf16_layers_start])
    if len(kept) >= n:
        return 0   # every layer in 16 bits: probed so (build_probe)
    if len(kept) != start or dense:
        key = "fp8_bf16_layers_end" if len(kept) != start else "fp8_bf16_layers_start"
        raise SpecError([Diagnostic(
            "error", f"the search cannot cost `{key}` here: it composes a layout from one probe of the "
                     "leading layers and one of the rest" + (", and this model's leading layers are dense "
                                                            "ones before MoE" if dense else ""),
            cfg.span(f"train.{key}"),
            help="search (or fill `auto` layout keys) without it, then set it in the spec with every layout "
                 "degree given: `parcompile compile` plans it exactly; or keep the first layers in 16 bits with "
                 "`fp8_bf16_layers_start`" + (" in a model without dense_layers" if dense else ""),
            note="issue 32: Megatron-LM --first-last-layers-bf16")])
    return start


def probe_parallel(tp: int, cp: int, sp: bool, mb: int, ep: int, expert_tp: int, **more: Any) -> ParallelConfig:
    """A probe's layout (module docstring): one data-parallel rank, three pipeline ranks,
    one micro-batch of ``mb`` per step, the given degrees; ``more``: other fields (the
    recompute mode a probe is timed in, the spec's mesh ``order``)."""
    return ParallelConfig(dp=1, tp=tp, pp=3, cp=cp, ep=ep, expert_tp=expert_tp, sequence_parallel=sp,
                          micro_batch=mb, global_batch=mb, **more)


def leading_dense_layers(cfg: SpecConfig) -> int:
    """How many leading layers of ``cfg``'s model are dense when the others are MoE (its
    ``dense_layers``; 0 for a model of one kind of layer, all dense or all MoE)."""
    m = cfg.model
    return m.dense_layers if m.experts > 0 and 0 < m.dense_layers < m.layers else 0


def build_probe(cfg: SpecConfig, tp: int, cp: int, sp: bool, mb: int, ep: int, expert_tp: int) -> Probe:
    """The probe of ``cfg`` at these degrees; for a model of dense then MoE layers
    (:func:`leading_dense_layers`), or of 16-bit then FP8 layers (:func:`leading_layers`),
    with its :attr:`Probe.dense_probe`; a model whose every layer
    is dense (``dense_layers >= layers``) is probed with dense layers."""
    m = cfg.model
    dense = m.experts > 0 and m.dense_layers >= m.layers
    every = len(bf16_layers(cfg)) >= m.layers   # every layer kept in 16 bits
    pr = Probe(cfg, tp, cp, sp, mb, ep, expert_tp, dense=dense, bf16=every)
    if leading_dense_layers(cfg):
        pr.dense_probe = Probe(cfg, tp, cp, sp, mb, ep, expert_tp, dense=True)
    elif leading_layers(cfg):   # the first layers in 16 bits, probed apart as leading dense layers are
        pr.dense_probe = Probe(cfg, tp, cp, sp, mb, ep, expert_tp, dense=dense, bf16=True)
    return pr


def dense_counts(counts: tuple[int, ...], dense: int) -> list[int]:
    """Per model chunk of ``counts`` layers (in model order), how many of the first
    ``dense`` layers it holds."""
    out, start = [], 0
    for n in counts:
        out.append(min(max(dense - start, 0), n))
        start += n
    return out


def compose(probe4: tuple, counts: tuple[int, ...], dense: int = 0) -> tuple:
    """Per candidate chunk ``k`` with ``counts[k]`` layers, ``d_k`` of them among the first
    ``dense`` (dense layers of an MoE model): ``d_k * dense middle + (n_k - d_k) * middle
    + [k = 0] (first - dense middle) + [k = last] (last - middle)`` of a probe's
    :meth:`Probe.quad` (the first chunk holds the first layer, dense when ``dense > 0``;
    the last the last, of the probe's kind)."""
    a, b, m, c = probe4
    last = len(counts) - 1
    if not dense:
        return tuple(n * m + (a - b if k == 0 else 0) + (c - m if k == last else 0) for k, n in enumerate(counts))
    return tuple(nd * b + (n - nd) * m + (a - b if k == 0 else 0) + (c - m if k == last else 0)
                 for k, (n, nd) in enumerate(zip(counts, dense_counts(counts, dense))))


def quad_times(ct: ChunkTimes, dct: ChunkTimes | None) -> ChunkTimes:
    """The four chunk values of :meth:`Probe.quad` of a probe's chunk times ``ct`` (and of
    its dense probe's, ``dct``): a :class:`ChunkTimes` of four chunks that :func:`compose`
    composes field by field (the transfers, ``p2p``, are the probe's own)."""
    def q(x: tuple, y: tuple | None) -> tuple:
        return (x[0], x[1], x[1], x[2]) if y is None else (y[0], y[1], x[1], x[2])

    d = dct
    return ChunkTimes(q(ct.matmul_f, d and d.matmul_f), q(ct.memory_f, d and d.memory_f),
                      q(ct.recompute, d and d.recompute),
                      {f: q(v, d and d.comm_f[f]) for f, v in ct.comm_f.items()},
                      {f: q(v, d and d.comm_b[f]) for f, v in ct.comm_b.items()}, ct.p2p,
                      q(ct.weighted_f, d and d.weighted_f) if ct.weighted_f else (),
                      q(ct.overhead_f, d and d.overhead_f) if ct.overhead_f else (),
                      q(ct.frozen_f, d and d.frozen_f) if ct.frozen_f else ())


def stage_bufs(pq: tuple, dense: bool, moe: bool, first: bool, last: bool, pp1: bool) -> dict[str, int]:
    """A pipeline rank's buffers (name -> bytes, each the largest of its ops') from the
    probe's per-chunk buffers ``pq`` (:meth:`Probe.quad`): those of a middle layer of each
    kind it holds (``dense``; ``moe``: of the probe's own kind), and of the first and last
    chunks' when it holds them; with one pipeline rank (``pp1``), no receive buffer."""
    b = dict(pq[2]) if moe else {}
    for extra in ([pq[1]] if dense else []) + ([pq[0]] if first else []) + ([pq[3]] if last else []):
        merge_buffers(b, extra)
    if pp1:
        b.pop("p2p", None)
    return b


def rank_layers(n: int, dense: int, d, m):
    """A lower bound on the sum of a per-layer value (``d`` a dense layer's, ``m`` an MoE
    layer's) over a pipeline rank's ``n`` layers when the model's first ``dense`` layers
    are dense (``n * m`` when ``dense = 0``): the rank holds ``k <= min(dense, n)`` dense
    layers, and ``k d + (n - k) m >= K min(d, m) + (n - K) m`` for ``K = min(dense, n) >= k``
    (and it grows with ``n``, so a rank of ``n`` layers or more)."""
    if not dense:
        return n * m
    k = min(dense, n)
    return k * min(d, m) + (n - k) * m


def total_of_chunks(probe4: tuple, layers: int, dense: int = 0):
    """:func:`compose` summed over the chunks (whatever the split): ``dense * dense middle +
    (layers - dense) * middle + (first - dense middle) + (last - middle)``."""
    a, b, m, c = probe4
    if not dense:
        return layers * m + (a - b) + (c - m)
    return dense * b + (layers - dense) * m + (a - b) + (c - m)


def chunk_units(ps: tuple[StageParams, ...], first: bool, last: bool, n: int, pp1: bool, tied: bool,
                 chunk: int = 0, start: int = 0, dense: int = 0) -> tuple[GradUnit, ...]:
    """The gradient units (:mod:`parcompile.analysis.buckets`) of one model chunk holding
    ``n`` layers (ids ``start``..), in ready order, from the probe's stages
    (:meth:`Probe.quad`): the output units of its last, a copy of its middle layer per
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
        out.append(replace(u, chunk=chunk, name=f"layers.{start + j}"))   # its FP8 weights too
    if first:
        emb = [u for u in pf if not u.name.startswith("layers.")]
        if pp1 and tied:   # the tied embedding joins the embedding unit
            out.append(GradUnit(chunk, "embedding", sum(u.dense for u in emb), sum(u.expert for u in emb)))
        else:
            out += [replace(u, chunk=chunk) for u in emb]
    return tuple(out)


def compose_params(ps: tuple[StageParams, ...], counts: tuple[int, ...], pp: int, tied: bool,
                    dense: int = 0, place: Placement = LOOP) -> list[StageParams]:
    """Per pipeline rank, the parameters of a layout of ``counts`` layers per model chunk
    from the probe's stages (:meth:`Probe.quad`; ``dense``: the model's leading dense
    layers, :func:`compose`; ``place``: which rank holds each model chunk, the schedule's
    placement)."""
    first, dmid, mid, last = ps
    out = []
    nchunks = len(counts)
    starts = [sum(counts[:k]) for k in range(nchunks)]
    dcounts = dense_counts(counts, dense)
    for s in range(pp):
        acc = {"dense": 0, "expert": 0, "norm": 0, "tp_partial": 0, "fp8": 0, "fp8_weights": 0}
        emb = 0
        units: list[GradUnit] = []
        mine = place.chunks(s, pp, nchunks // pp)
        for k in reversed(mine):
            units += chunk_units(ps, k == 0, k == nchunks - 1, counts[k], pp == 1, tied, place.local(k, pp),
                                  starts[k], dense)
        for k in mine:
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
                               tp_partial=acc["tp_partial"], fp8=acc["fp8"], fp8_weights=acc["fp8_weights"]))
    return out
