"""Lower bounds on a layout's step time and memory peak, each cheaper than the costing it
bounds (:class:`Floors`, a base class of :class:`~parcompile.layout_search.coster.Coster`, made of
:class:`StepFloors`, :class:`FamilyFloors` and :class:`MemoryFloors`; the
module docstring of :mod:`parcompile.layout_search`)."""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction
from typing import Iterable

from parcompile.analysis.buckets import reshard_after_forward
from parcompile.analysis.comm import CommReport
from parcompile.analysis.estimate import (ChunkTimes, closed_form_span, dp_exposed, chunk_times, engine,
                                          grad_element_bytes, optimizer_time, step_sums)
from parcompile.analysis.lora import is_lora
from parcompile.analysis.memory import buffer_total, closed_form_in_flight, state_bytes
from parcompile.analysis.offload import kept_on_gpu
from parcompile.analysis.params import StageParams
from parcompile.config.schema import ParallelConfig, SpecConfig
from parcompile.core.data_parallel import DataParallelSharding, data_parallel_sharding
from parcompile.core.schedule import Schedule as PipelineSchedule, build_actions
from parcompile.ir.ops import COUNTS_BYTES
from parcompile.passes.base import parallel_degrees
from parcompile.passes.insert_collectives import STEP_AXES, step_entries
from parcompile.layout_search.probe import (Probe, chunk_units, compose, probe_parallel, quad_times, rank_layers, stage_bufs,
                                     total_of_chunks)
from parcompile.layout_search.space import RowLayout, with_parallel


def mean_span(work: float, pp: int, v: int, m: int) -> float:
    """A lower bound on :func:`~parcompile.analysis.estimate.closed_form_span` from the
    ranks' ``work`` summed (whatever its spread over the ranks: ``max >= mean``),
    ``(m + (pp - 1) / v) * work / pp``, reduced by a relative 1e-9 for rounding (the
    estimate sums in another order)."""
    return (m + (pp - 1) / v) * work / pp * (1 - 1e-9)


def first_rank_layers(splits: list[tuple[int, ...]], pp: int) -> int:
    """The fewest layers any of ``splits`` gives the first pipeline rank."""
    return min(sum(c[0::pp]) for c in splits)


def step_degrees(deg: dict) -> tuple:
    """The degrees :func:`~parcompile.passes.insert_collectives.step_collectives` reads."""
    return tuple(deg[a] for a in ("dp_cp", "expert_dp", "tp", "ep", "expert_tp", "pp", "dp_shard", "dp_replicate"))


def scaled_comm(comm: CommReport, r: float, pp: bool, experts: int = 0, fixed_r: float = 1.0) -> CommReport:
    """The per-micro-batch collectives of ``comm`` (its ``raw``, what
    :func:`~parcompile.analysis.estimate.chunk_times` reads) of the pipeline axis (``pp``) or
    of every other axis, their bytes times ``r`` (:meth:`Coster._family_work`), as a report
    of those only (no per-step rows). The MoE dispatch's
    exchanges of token counts (``experts`` int64 per rank over ep, gathered over expert_tp:
    :func:`~parcompile.ir.ops.moe_collectives`) do not grow with the tokens: times
    ``fixed_r`` instead (``cp0 / cp``: at most 1 and at most ``r``, whatever the
    micro-batch, so a collective of another kind that happens to have their size is
    under-counted, which a lower bound allows, and the line of :meth:`Coster._base_work`
    holds). The FLOPs of the GEMMs a tensor-parallel collective overlaps
    (``Collective.gemm_flops``) scale by ``r`` as well."""
    def scale(c) -> float:
        fixed = (experts and not c.bytes_per_row and c.axis in ("ep", "expert_tp")
                 and c.bytes % (experts * COUNTS_BYTES) == 0 and c.bytes // (experts * COUNTS_BYTES) <= 64)
        return fixed_r if fixed else r

    # the FLOPs of the GEMMs a tp collective overlaps (cluster.tp_comm_overlap) grow with the tokens too
    return CommReport((), {}, tuple((s, k, replace(c, bytes=c.bytes * scale(c),
                                                   gemm_flops=tuple(x * r for x in c.gemm_flops)))
                                     for s, k, c in comm.raw if (c.axis == "pp") == pp))


class StepFloors:
    """Lower bounds on a training layout's step time from the layout's own probe (a part
    of :class:`Floors`): the pipeline's makespan whatever the split (:meth:`span_floor`),
    what the data-parallel step and the optimizer add (:meth:`step_floor`, from a mean
    stage), both (:meth:`layout_floor`), and per split, closed form or simulated
    (:meth:`_split_floors`, :meth:`_dp_floor`, :meth:`_sim_floor`). Fills the coster's
    ``step_floor_parts``, ``step_floor_memo`` and ``dp_groups`` caches."""

    def span_floor(self, par: ParallelConfig) -> float:
        """A lower bound on the estimated step time of layout ``par``, whatever its split: the
        closed-form makespan
        (:func:`~parcompile.analysis.estimate._closed_form_makespan`, ``m * max(work) +
        (pp - 1) / v * mean(work)``, where ``work`` is a rank's forward and backward of one
        micro-batch through its chunks, transfers included) is at least ``(m + (pp - 1) / v)
        * mean(work)``, and the ranks' work summed over all chunks does not depend on the
        split: ``layers * middle + (first - middle) + (last - middle)`` of the probe's chunks
        (:func:`total_of_chunks`: :func:`compose` summed; dense layers count the dense middle), plus a transfer each way between adjacent chunks; the
        step adds the (non-negative) exposed data-parallel time and optimizer step. Reduced by a
        relative 1e-9 for rounding (the estimate sums in another order)."""
        pr = self.probe(par)
        ct3, _links, _key = self._chunk_times3(pr, par)
        pp, v, m, layers = par.pp, par.virtual_stages, par.num_microbatches, self.cfg.model.layers
        work = total_of_chunks([ct3.fwd(k) + ct3.bwd(k) for k in range(4)], layers, self.dense)
        if pp > 1:
            work += 2 * (pp * v - 1) * ct3.p2p
        return mean_span(work, pp, v, m)

    def layout_floor(self, par: ParallelConfig) -> float:
        """A lower bound on the estimated step time of layout ``par``, whatever its split:
        :meth:`span_floor` (the pipeline) plus :meth:`step_floor` (what the step adds), from
        the layout's own probe."""
        pr = self.probe(par)
        ct3, links, _key = self._chunk_times3(pr, par)
        layers = self.cfg.model.layers
        f = total_of_chunks([ct3.fwd(k) for k in range(4)], layers, self.dense)
        b = total_of_chunks([ct3.bwd(k) for k in range(4)], layers, self.dense)
        return self.span_floor(par) + self.step_floor(par, f, b, links, pr)

    def step_floor(self, par: ParallelConfig, fwd: float, bwd: float, links: dict, pr: Probe) -> float:
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
        key = (self._params_key(pr), pp, par.zero, par.schedule, par.dp * par.cp, par.dp_replicate, par.expert_dp,
               par.tp, par.ep, par.expert_tp, par.sequence_parallel, par.bucket_size, par.reduce_dtype,
               tuple(links.get(a) for a in STEP_AXES))
        got = self.step_floor_parts.get(key)
        if got is None:
            got = self.step_floor_parts[key] = self._mean_stage(par, pr, links)
        mkey = (key, fwd, bwd)
        out = self.step_floor_memo.get(mkey)
        if out is None:
            cfg, deg, sums, opt = got
            # one stage of one chunk (chunk 0 is all dp_exposed reads of it): fwd / pp, bwd / pp
            ct = ChunkTimes((0.0,), (0.0,), (bwd / pp,), {"tp": (fwd / pp,)}, {}, 0.0)
            dp = sum(k * dp_exposed(cfg, deg, links, None, ct, None, [t]) for t, k in sums) / pp
            out = self.step_floor_memo[mkey] = (dp + opt) * (1 - 1e-9)
        return out

    def _mean_stage(self, par: ParallelConfig, pr: Probe, links: dict) -> tuple:
        """:meth:`step_floor`'s mean stage of layout ``par`` (``pr``: a probe with its
        parameters, ``links`` its links): ``(config of one chunk per rank, degrees, ((step
        sums, how many stages have them), ...), optimizer seconds)``: ``pp`` stages of ``1/pp`` of the
        model's parameters each, rounded down to a multiple of the shard count, one gradient
        bucket each."""
        pp = par.pp
        model = self.cfg.model
        deg = parallel_degrees(par)
        cfg = with_parallel(self.cfg, par.model_copy(update={"virtual_stages": 1}))
        if is_lora(cfg):   # the adapters' step: not bounded (0 is a lower bound; it is small)
            return cfg, deg, (), 0.0
        ps = pr.qparams
        first, dmid, mid, last = ps
        tied, pp1 = model.tie_embeddings, pp == 1
        nd = self.dense
        # the whole model's elements: in the gradient units, and in the stages' parameters
        layer = next(u for u in mid.units if u.name.startswith("layers."))
        dlayer = next(u for u in dmid.units if u.name.startswith("layers."))
        ends = chunk_units(ps, True, False, 0, pp1, tied) + chunk_units(ps, False, True, 0, pp1, tied)
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
        for grads, params, other, _copies in step_sums(cfg, deg, links, step_entries(cfg, deg, stages)):
            # FSDP2's buffer copies (eager, ZeRO-3) count per micro-batch: left out of the floor
            if data_parallel_sharding(par).shards_parameters and reshard_after_forward(pp):
                params = 0.0   # gathered per micro-batch, some buckets fewer times: counted as none
            sums[(grads, params, other, 0.0)] = sums.get((grads, params, other, 0.0), 0) + 1
        opt = optimizer_time(cfg, deg, [StageParams(0, fake_params[0], fake_params[1], 0, 0)])
        return cfg, deg, tuple(sums.items()), opt

    def _split_floors(self, par: ParallelConfig, splits: list[tuple[int, ...]], simulate: bool) -> list[float]:
        """Per split of layout ``par``, a lower bound on :meth:`cost`'s step time (the step
        adds the non-negative exposed data-parallel time and optimizer step to the
        pipeline's makespan), from the probe's chunk times composed (:func:`compose`) over the
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
        zb = par.pipeline_schedule.split_backward
        mine = [par.rank_chunks(r) for r in range(pp)]
        nd = self.dense
        out = []

        for counts in splits:
            fb = list(compose(fb4, counts, nd))
            if pp > 1:
                for k in range(n):
                    fb[k] += p2p * ((k < n - 1) + (k > 0))
            work = [sum(fb[k] for k in mine[r]) for r in range(pp)]
            if not sim:
                out.append(closed_form_span(work, pp, v, m) * (1 - 1e-9))
                continue
            if zb:
                f = compose(f4, counts, nd)
                lead = [x + (p2p if k < n - 1 else 0.0) for k, x in enumerate(f)]
            else:
                lead = fb
            before, best = 0.0, 0.0
            for r in range(pp):
                best = max(best, before + m * work[r])
                before += lead[r]
            out.append(best * (1 - 1e-9))
        return out

    def _dp_floor(self, cfg: SpecConfig, pr: Probe, counts: tuple[int, ...], ct: ChunkTimes, links: dict,
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
        dps = data_parallel_sharding(par)
        jit = dps.shards_parameters and reshard_after_forward(par.pp)
        key = (self._params_key(pr), counts, par.pp, par.pipeline_schedule.placement, par.zero, dps.per_microbatch,
               par.num_microbatches if jit else 0, step_degrees(deg), par.bucket_size,
               par.reduce_dtype, par.sequence_parallel)
        got = self.dp_groups.get(key)
        if got is None:
            got = self.dp_groups[key] = (cfg, self._steps(cfg, deg, self._trained_params(pr, counts, par),
                                                          self._frozen_params(pr, counts, par)), {})
        cfg0, steps, sums = got
        lkey = (tuple(links.get(a) for a in STEP_AXES), deg["embedding"])
        got = sums.get(lkey)
        if got is None:
            # FSDP2's buffer copies (eager, ZeRO-3) count per micro-batch, which this group
            # does not fix: left out of the floor (they are not negative)
            got = sums[lkey] = [(g, p, o, 0.0) for g, p, o, _c in step_sums(cfg0, deg, links, steps)]
        return dp_exposed(cfg0, deg, links, None, ct, None, got) * (1 - 1e-9)

    def _sim_floor(self, cfg: SpecConfig, floor: float) -> float:
        """A lower bound on the simulated step time of ``cfg`` (a layout with its split)
        from ``floor``, one on its simulated pipeline (:meth:`_split_floors`): plus the
        exposed data-parallel time and the optimizer step, exactly (:meth:`_data_parallel`)."""
        par, model = cfg.parallel, cfg.model
        pr = self.probe(par)
        counts = par.layers_per_chunk(model.layers)
        ct3, links, tkey = self._chunk_times3(pr, par)
        ct, _span, _parts = self._pipeline(cfg, pr, ct3, tkey, counts)
        deg = parallel_degrees(par)
        dp_comm, opt = self._data_parallel(cfg, pr, ct, links, deg,
                                           self._trained_params(pr, counts, par))
        return floor + dp_comm + opt


class FamilyFloors:
    """Lower bounds on the step time of a whole probe family (one ``tp, cp,
    sequence_parallel, micro_batch, ep, expert_tp``) without building its probe (a part of
    :class:`Floors`): the probe at micro-batch 1 and ``cp0 = min(cp, 2)``, its work scaled
    to the family's (:meth:`_family_work`, :meth:`_scaled_base`, :meth:`_base_work`), bounds
    the family's groups (:meth:`family_floor`) and, with :meth:`StepFloors.step_floor`, one
    layout (:meth:`family_layout_floor`). Fills the coster's ``family_works``,
    ``comm_axes``, ``base_p2p``, ``scaled_comms``, ``scaled_bases`` and ``base_works``
    caches; ``direct_works`` (tests) times every micro-batch instead of the line."""

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
            out[(pp, v, m, rc)] = mean_span(f + b + transfers, pp, v, m)
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
        return mean_span(f + b + transfers, pp, v, m) + self.step_floor(par, f, b, links, base)

    def _family_work(self, par: ParallelConfig, rc: str) -> tuple[float, float, float, Probe, dict]:
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
        * the weights the GEMMs read and the MoE layers' local experts
          (``ComputeReport.chunk_weight_traffic``, ``chunk_moe_experts``) do not
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
                pp_raw = self.scaled_comms[(id(base), rc, cp, mb, True)] = scaled_comm(
                    base.comm[rc], mb * min(cp, 2) / cp, True, self.cfg.model.experts, min(cp, 2) / cp)
            p2p = self.base_p2p[pkey] = chunk_times(tcfg, degrees, None, scaled, pp_raw, links).p2p
        got = self.family_works[wkey] = (fb[0], fb[1], p2p, base, links)
        return got

    def _scaled_base(self, base: Probe, rc: str, cp: int, mb: int, par: ParallelConfig) -> tuple:
        """``(compute report, config, degrees)`` of :meth:`_family_work`'s scaled probe: ``base``'s
        FLOPs and bytes moved times ``mb * cp0 / cp``, its layout with ``par``'s ``cp`` and
        micro-batch ``mb``. Cached, whatever the links."""
        skey = (id(base), rc, cp, mb)
        got = self.scaled_bases.get(skey)
        if got is None:
            r = mb * min(cp, 2) / cp
            comp = base.compute[rc]
            # what grows with the tokens (ComputeReport.PER_TOKEN); the weights read are the same
            scaled = comp.scaled(r)
            tcfg = base.pcfg.model_copy(update={"parallel": probe_parallel(
                par.tp, cp, par.sequence_parallel, mb, par.ep, par.expert_tp, recompute=rc)})
            got = self.scaled_bases[skey] = (scaled, tcfg, dict(base.degrees, cp=cp))
        return got

    def _base_work(self, base: Probe, rc: str, cp: int, mb: int, par: ParallelConfig, lkey: tuple,
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
        def times(p: Probe) -> ChunkTimes:
            scaled, tcfg, degrees = self._scaled_base(p, rc, cp, mb, par)
            raw = self.scaled_comms.get((id(p), rc, cp, mb, False))
            if raw is None:   # the transfers (ChunkTimes.p2p) read the pp and tp links only: timed apart
                raw = self.scaled_comms[(id(p), rc, cp, mb, False)] = scaled_comm(
                    p.comm[rc], mb * min(cp, 2) / cp, False, self.cfg.model.experts, min(cp, 2) / cp)
            return chunk_times(tcfg, degrees, None, scaled, raw, links)

        d = base.dense_probe
        ct = quad_times(times(base), times(d) if d is not None else None)
        layers = self.cfg.model.layers
        got = self.base_works[key] = (total_of_chunks([ct.fwd(k) for k in range(4)], layers, self.dense),
                                      total_of_chunks([ct.bwd(k) for k in range(4)], layers, self.dense))
        return got


class MemoryFloors:
    """Lower bounds on a training layout's memory peak (a part of :class:`Floors`):
    from the model states alone, whatever the split, micro-batch or schedule
    (:meth:`state_floor`), and the first pipeline rank's states, activations and buffers
    when it holds the fewest layers any split gives it, from the layout's probe or its
    family's scaled one (:meth:`memory_floor`). Fills the coster's ``state_floors``,
    ``param_probes``, ``buf_sums``, ``state_parts`` and ``in_flight_firsts`` caches."""

    def state_floor(self, par: ParallelConfig | RowLayout) -> int:
        """A lower bound on the memory peak of training layout ``par`` from its model states
        alone (parameters, fp32 gradients and optimizer states; :meth:`peak`'s
        ``states``), whatever its split, micro-batch, schedule or recomputation: every
        other term of a stage's total is a byte count, so the peak is at least the largest
        stage's states, hence their mean over the ``pp`` stages. Summed over the stages the
        parameters are the probe's ``layers * middle + first + last - 2 middle`` (:func:`total_of_chunks`;
        dense layers count the dense middle; a tied
        head read by the embedding on one rank counted once), and each stage's sharded
        elements (``sum ceil(n_b / d)`` over its buckets) are at least ``n / d``, so the
        sum is at least the table of :mod:`parcompile.analysis.memory` applied to the whole
        model's elements with exact division. Needs only the parameters of a probe with
        the same ``tp, ep, expert_tp`` (they depend on nothing else). Cached."""
        model = self.cfg.model
        d, ed, z, pp = par.dp_shard * par.cp, par.expert_dp, par.zero, par.pp   # HSDP: over dp_shard only
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
                dps = self._sharding(z, dd)
                n = total_of_chunks([getattr(x, kind) for x in ps], model.layers, self.dense)
                if kind == "dense" and model.tie_embeddings and pp == 1:
                    n -= last.embedding
                # the memory table with exact division: each rank shards at least n / d
                total += self._states(n, dps, dd, Fraction(n, dd))
            got = self.state_floors[key] = math.ceil(total / pp)
        return got

    def memory_floor(self, par: ParallelConfig | RowLayout, first_layers: int, base: bool = False,
                     build: bool = True) -> float:
        """A lower bound on :meth:`peak` of training layout ``par`` over its splits, from a
        probe without composing any split: the first pipeline rank's total when it holds
        ``first_layers`` (the fewest any of its splits gives it, :func:`first_rank_layers`).
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
        pp, v, m, z, rc = par.pp, par.virtual_stages, par.num_microbatches, par.zero, par.recompute
        d, ed, n = par.dp_shard * par.cp, par.expert_dp, first_layers   # HSDP: over dp_shard only
        if base:
            cp0 = min(par.cp, 2)
            key = (par.tp, cp0, par.sequence_parallel, 1, par.ep, par.expert_tp)
            pr = self.probe_of(key)
            scale = cp0 / par.cp
        else:
            pr = self.probe(par)
            scale = 1.0
        states = self._first_rank_states(pr, pp, n, z, d, ed)
        body, bufs = self._first_rank_bytes(pr, rc, pp, n)
        key2 = key[:3] + (2,) + key[4:] if base and par.micro_batch > 1 else None
        if key2 is not None and (build or key2 in self.probes):   # the line through micro-batches 1 and 2
            body2, bufs2 = self._first_rank_bytes(self.probe_of(key2), rc, pp, n)
            k = par.micro_batch - 1
            body, bufs = body + k * (body2 - body), bufs + k * (bufs2 - bufs)
        inf = self._in_flight_first(par.pipeline_schedule, pp, v, m, self._unlike_chunks(par))
        acts = max(0.0, inf.numerator * body * scale / inf.denominator - 1)
        return (states + acts + bufs * scale) * (1 - 1e-12)

    def _buffer_sums(self, pr: Probe, rc: str, pp: int) -> tuple[int, int, int]:
        """Total buffer bytes of a first, middle and last pipeline rank (as :meth:`cost`
        composes them; :func:`parcompile.analysis.memory.buffer_total`: the logits and the
        recomputation's working set are never alive at once), and of the only rank when
        pp = 1 (returned as the first).

        With dense and MoE layers (:attr:`Probe.dense_probe`) the first rank's is that of
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
                    out.append(buffer_total(stage_bufs(pq, first and mixed, not (first and mixed), first, last, False)))
            else:
                out.append(buffer_total(stage_bufs(pq, mixed, True, True, True, True)))
            got = self.buf_sums[key] = tuple(out) if pp > 1 else (out[0], out[0], out[0])
        return got

    def _sharding(self, z: int, d: int) -> DataParallelSharding:
        """The data-parallel sharding of ZeRO stage ``z`` over ``d`` ranks, on this search's
        schedule (what :func:`~parcompile.analysis.memory.state_bytes` and the gradient
        buffers' bytes read)."""
        return replace(data_parallel_sharding(self.cfg.parallel, stage=z), shard=max(1, d))

    def _states(self, n, dps: DataParallelSharding, dd: int, shard) -> float:
        """A lower bound on the GPU's bytes of model states for ``n`` parameter elements
        sharded ``shard`` per rank over ``dd`` ranks: the table of
        :func:`~parcompile.analysis.memory.stage_state_bytes` (:func:`state_bytes`) with exact
        division. With LoRA (:func:`~parcompile.analysis.lora.frozen_param_bytes`) the frozen
        weights alone (the adapters' states are not negative); with ``offload``
        (:func:`~parcompile.analysis.offload.kept_on_gpu`) without what goes to host memory
        (the optimizer states; with ``params`` the parameters too, LoRA's frozen ones kept)."""
        cfg = self.cfg
        if is_lora(cfg):
            params, grads, opt = cfg.model.dtype_bytes * (shard if dps.shards_parameters else n), 0, 0
        else:
            params, grads, opt = state_bytes(n, cfg.model.dtype_bytes, dps, cfg.train.optimizer, shard=shard,
                                             fsdp2=engine(cfg.cluster).fsdp2_state_bytes,
                                             grad_bytes=grad_element_bytes(cfg, dps))
        return sum(kept_on_gpu(cfg.parallel.offload, (params, grads, opt), params if is_lora(cfg) else 0))

    def _first_rank_states(self, pr: Probe, pp: int, n: int, z: int, d: int, ed: int) -> float:
        """The model states (bytes) of the first pipeline rank holding ``n`` layers, of
        :meth:`memory_floor`: its dense and expert parameters from the probe's per-stage
        counts (``pr.qparams``; with ``pp = 1`` the last stage's too, a tied embedding once),
        through :func:`~parcompile.analysis.memory.state_bytes` at ZeRO level ``z`` over
        ``d`` (dense) and ``ed`` (expert) data-parallel ranks, with exact division; cached
        per (parameter counts, pp, n, z, d, ed) in ``state_parts``."""
        model = self.cfg.model
        skey = (self._params_key(pr), pp, n, z, d, ed)
        states = self.state_parts.get(skey)
        if states is None:
            first, dmid, mid, last = pr.qparams
            states = 0.0
            for kind, dd in (("dense", d), ("expert", ed)):
                dps = self._sharding(z, dd)
                x = rank_layers(n, self.dense, getattr(dmid, kind), getattr(mid, kind)) \
                    + getattr(first, kind) - getattr(dmid, kind)
                if pp == 1:
                    x += getattr(last, kind) - getattr(mid, kind)
                    if kind == "dense" and model.tie_embeddings:
                        x -= last.embedding
                states += self._states(x, dps, dd, x / dd)
            self.state_parts[skey] = states
        return states

    def _first_rank_bytes(self, pr: Probe, rc: str, pp: int, n: int) -> tuple[int, int]:
        """``(body, buffers)`` of :meth:`memory_floor`: the bytes one micro-batch saves on a
        first pipeline rank of ``n`` layers outside the output layer (``n * middle + first
        - middle``, plus ``last - middle`` with ``pp = 1``, of the probe's
        ``per_chunk - output_layer``; with dense and MoE layers, :meth:`Probe.quad`'s and
        :func:`rank_layers`' ``n`` layers: at most the rank's own), and its buffers
        (:meth:`_buffer_sums`)."""
        (pa, pd, pb, pc), (oa, od, ob, oc) = (pr.quad(lambda p: p.saved[rc].per_chunk),
                                              pr.quad(lambda p: p.saved[rc].output_layer))
        body = rank_layers(n, self.dense, pd - od, pb - ob) + (pa - oa) - (pd - od)
        if pp == 1:
            body += (pc - oc) - (pb - ob)
        return body, self._buffer_sums(pr, rc, pp)[0]

    def _unlike_chunks(self, par: ParallelConfig | RowLayout) -> bool:
        """Whether the memory of layout ``par`` may count its micro-batches in flight by
        their chunks' bytes (:func:`~parcompile.analysis.memory.unlike_chunk_bytes`: some
        rank's chunks hold unlike numbers of layers): with ``virtual_stages > 1``, its split
        (``stage_layers``) is uneven on a rank, or it has none and the layers do not divide
        into the chunks (some candidate split is uneven)."""
        pp, v = par.pp, par.virtual_stages
        if v == 1:
            return False
        counts = getattr(par, "stage_layers", None)
        if counts is None:
            return self.cfg.model.layers % (pp * v) != 0
        return any(len({counts[k] for k in par.rank_chunks(r)}) > 1 for r in range(pp))

    def _in_flight_first(self, schedule: PipelineSchedule, pp: int, v: int, m: int, unlike: bool = False) -> Fraction:
        """The first stage's micro-batches in flight,
        :func:`~parcompile.analysis.memory.closed_form_in_flight`'s, cached. ``unlike``
        (chunks of unlike bytes, :meth:`_unlike_chunks`): a lower bound on the weighted count
        instead, the fewest forwards of one of its chunks in flight at its first backward.
        The weighted peak (:func:`~parcompile.core.schedule.in_flight`) is at least what the
        forwards then in flight keep, ``sum_c f_c b_c >= min_c f_c * sum_c b_c``; the
        closed form, their mean ``sum_c f_c / v``, is not a bound when the chunks with the
        most in flight (the first ones) are the lighter (a layer-less first chunk)."""
        key = (schedule, pp, v, m, unlike)
        got = self.in_flight_firsts.get(key)
        if got is None:
            if unlike:
                counts = [0] * v
                for a in build_actions(schedule, pp, m, v)[0]:
                    if a["op"] in ("backward", "backward_input"):
                        break
                    if a["op"] == "forward":
                        counts[a["chunk"]] += 1
                got = Fraction(min(counts))
            else:
                got = closed_form_in_flight(schedule, pp, v, m)[0]
            self.in_flight_firsts[key] = got
        return got


class Floors(StepFloors, FamilyFloors, MemoryFloors):
    """The lower bounds :class:`~parcompile.layout_search.coster.Coster` ranks layouts by (the module
    docstring): a base class of the coster, reading its probes, caches and costing. Step
    time from a layout's own probe (:class:`StepFloors`), from its family's scaled probe
    (:class:`FamilyFloors`), and memory (:class:`MemoryFloors`)."""
