"""Costing one layout from its probe (:class:`Coster`): chunk times and the pipeline
(:class:`ChunkCosts`), memory (:class:`MemoryCosts`), the split of layers that do not divide
into the chunks (:class:`SplitChoice`), the data-parallel step and the step time
(:class:`Coster` itself)."""

from __future__ import annotations

import heapq
import math
from fractions import Fraction

from parcompile.analysis.comm import CollectiveEntry, CommReport
from parcompile.analysis.lora import is_lora, trainable
from parcompile.analysis.estimate import (ChunkTimes, dp_exposed, chunk_times, efficiency, links_of, optimizer_time,
                                          pipeline_parts)
from parcompile.ir.fp8 import gathers_fp8
from parcompile.analysis.memory import MemoryReport, SavedBytes, memory_from_parts, usable_memory
from parcompile.analysis.params import StageParams
from parcompile.config.schema import ParallelConfig, SpecConfig
from parcompile.core.axes import GROUP_AXES
from parcompile.core.schedule import build_actions, group_error
from parcompile.passes.base import parallel_degrees
from parcompile.core.groups import axis_placement
from parcompile.passes.insert_collectives import step_entries
from parcompile.passes.split_pipeline_stages import candidate_splits
from parcompile.layout_search.bounds import Floors, first_rank_layers, step_degrees
from parcompile.layout_search.candidate import Candidate
from parcompile.layout_search.probe import (Probe, build_probe, compose, compose_params, dense_counts, leading_layers,
                                     probe_parallel, quad_times, stage_bufs)
from parcompile.layout_search.space import RowLayout, with_parallel


#: step times within this fraction of the fastest split's count as ties (Coster.choose_split):
#: below the estimate's own resolution
SPLIT_TIME_TIE = 0.01


class ChunkCosts:
    """A layout's probe and its times (a part of :class:`Coster`): the probes, built once per
    ``tp, cp, sequence_parallel, micro_batch, ep, expert_tp`` (:meth:`probe`, :meth:`probe_of`),
    where each axis's groups of a layout sit and the links that gives (:meth:`_inside`,
    :meth:`_inside_links`), the probe's chunk times under those links (:meth:`_chunk_times3`)
    and the closed-form pipeline of a split (:meth:`_pipeline`). Fills the coster's
    ``probes``, ``inside``, ``comm_axes`` (with :class:`~parcompile.layout_search.bounds.FamilyFloors`)
    and ``pipes`` caches, and each probe's ``times``."""

    def probe(self, par: ParallelConfig | RowLayout) -> Probe:
        return self.probe_of((par.tp, par.cp, par.sequence_parallel, par.micro_batch, par.ep, par.expert_tp))

    def probe_of(self, key: tuple) -> Probe:
        """The probe of ``(tp, cp, sequence_parallel, micro_batch, ep, expert_tp)``, built once."""
        got = self.probes.get(key)
        if got is None:
            got = self.probes[key] = build_probe(self.cfg, *key)
        return got

    def _inside(self, par: ParallelConfig) -> dict[str, tuple[int, int]]:
        """Where each axis's groups of layout ``par`` sit: ``(k, domains)``
        (:func:`~parcompile.core.groups.axis_placement`; inside a node iff ``domains == 1``), cached."""
        return self._inside_links(par)[0]

    def _inside_links(self, par: ParallelConfig) -> tuple[dict[str, tuple[int, int]], dict]:
        """:meth:`_inside` and the links it gives (:func:`~parcompile.analysis.estimate.links_of`), cached."""
        key = (par.tp, par.cp, par.dp, par.pp, par.ep, par.expert_tp, par.order, par.dp_replicate)
        got = self.inside.get(key)
        if got is None:
            domain = self.cfg.cluster.domain_size
            inside = {a: axis_placement(par, a, domain) for a in GROUP_AXES}
            got = self.inside[key] = (inside, links_of(self.cfg.cluster, inside, self.eff))
        return got

    def _chunk_times3(self, pr: Probe, par: ParallelConfig) -> tuple[ChunkTimes, dict, tuple]:
        """The probe's chunk times under ``par``'s links (where each axis's groups sit: the
        network model's ranks per node and nodes), its recompute mode's, as the four chunks of
        :meth:`Probe.quad` (:func:`quad_times`), with the links and the cache key: the
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
        # FP8 all-gather (analysis/fp8.py fp8_costs): the weights are cast on their 1/(dp cp)
        # shards before the gathers, once, so the casts' time depends on zero and dp * cp
        g8 = par.dp * par.cp if gathers_fp8(self.cfg, par) else 0
        key = (rc, tuple((a, inside.get(a, (1, 1))) for a in axes), g8)
        ct3 = pr.times.get(key)
        if ct3 is None:
            def times(p: Probe) -> ChunkTimes:
                more = {"zero": par.zero} if g8 else {}
                tcfg = p.pcfg.model_copy(update={"parallel": probe_parallel(
                    par.tp, par.cp, par.sequence_parallel, par.micro_batch, par.ep, par.expert_tp, recompute=rc,
                    **more)})
                deg = {**p.degrees, "dp_cp": g8} if g8 else p.degrees
                return chunk_times(tcfg, deg, None, p.compute[rc], p.comm[rc], links)

            d = pr.dense_probe
            ct3 = pr.times[key] = quad_times(times(pr), times(d) if d is not None else None)
        return ct3, links, key

    def _pipeline(self, cfg: SpecConfig, pr: Probe, ct3: ChunkTimes, tkey: tuple,
                  counts: tuple[int, ...]) -> tuple[ChunkTimes, float, dict]:
        """The candidate's chunk times (the probe's composed over ``counts``, :func:`compose`) and
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
            ct = ChunkTimes(compose(ct3.matmul_f, counts, d), compose(ct3.memory_f, counts, d),
                            compose(ct3.recompute, counts, d),
                            {f: compose(ct3.comm_f[f], counts, d) for f in fams},
                            {f: compose(ct3.comm_b[f], counts, d) for f in fams}, ct3.p2p,
                            compose(ct3.weighted_f, counts, d) if ct3.weighted_f else (),
                            compose(ct3.overhead_f, counts, d) if ct3.overhead_f else (),
                            compose(ct3.frozen_f, counts, d) if ct3.frozen_f else ())
            span, parts = pipeline_parts(cfg, ct, m)
            got = self.pipes[key] = (ct, span, parts)
        return got


class MemoryCosts:
    """A training layout's memory (a part of :class:`Coster`): its report, composed from the
    probe's stage parameters, saved activations and buffers (:meth:`memory`, :meth:`peak`),
    whether it fits, over its candidate splits when it needs one (:meth:`fits`), and the
    stage parameters the memory and the data-parallel step read, shared by the probes whose
    parameters are sharded alike (:meth:`_params_key`, :meth:`_stage_params`). Fills the
    coster's ``memories``, ``params_keys``, ``param_owner`` and ``stage_param_sets`` caches."""

    def memory(self, cfg: SpecConfig, pr: Probe, counts: tuple[int, ...], exact: bool = True):
        """The memory report of a layout from its probe: the analysis's own
        :func:`memory_from_parts` on the stage parameters, saved activations and buffers that
        :meth:`cost` composes (one rule: no copy of the memory analysis here). Cached per
        layout (``cfg`` is the spec's with a layout). Not ``exact`` (the search's costing,
        which drops a layout that does not fit): the stages after the first above the
        capacity are not added up (``memory_from_parts``' ``stop_above``), so the report of a
        layout that does not fit may hold fewer stages and a peak that is only a lower bound;
        an exact report replaces such a one when asked for."""
        mkey = (cfg.parallel, id(pr), counts)
        got = self.memories.get(mkey)
        if got is not None and (not exact or len(got[0].per_stage) == cfg.parallel.pp):
            return got
        pp, rc = cfg.parallel.pp, cfg.parallel.recompute
        sps = self._stage_params(pr, counts, cfg.parallel)
        nd = self.dense
        saved = SavedBytes(compose(pr.quad(lambda p: p.saved[rc].per_chunk), counts, nd), {}, {},
                           compose(pr.quad(lambda p: p.saved[rc].output_layer), counts, nd))
        pq = pr.quad(lambda p: p.bufs[rc])
        dcounts = dense_counts(counts, nd)
        bufs = []
        for s in range(pp):
            ks = range(s, len(counts), pp)
            bufs.append(stage_bufs(pq, any(dcounts[k] for k in ks), any(counts[k] > dcounts[k] for k in ks),
                                    s == 0, s == pp - 1, pp == 1))
        got = self.memories[mkey] = (memory_from_parts(cfg, parallel_degrees(cfg.parallel), sps, saved, bufs,
                                                       stop_above=None if exact else usable_memory(cfg.cluster)), sps)
        return got

    def peak(self, cfg: SpecConfig, pr: Probe, counts: tuple[int, ...]) -> tuple[int, int]:
        """``(peak, capacity)`` of a training layout (:meth:`memory`)."""
        mem, _ = self.memory(cfg, pr, counts)
        return mem.peak, mem.capacity

    def fits(self, cfg: SpecConfig) -> bool:
        """Whether layout ``cfg`` fits memory, untimed (:meth:`peak`): with layers that do
        not divide into its chunks and no split given, whether one of its candidate splits
        does (:meth:`choose_split` takes a fitting one when there is one)."""
        par = cfg.parallel
        if cfg.workload == "serve":
            return self.cost(cfg).fits
        splits = self.splits(cfg)
        cap = usable_memory(cfg.cluster)
        if self.memory_floor(par, first_rank_layers(splits, par.pp)) > cap:
            return False
        pr = self.probe(par)
        # a split whose first rank's floor exceeds the memory does not fit: not composed
        return any(p <= c for p, c in (self.peak(cfg, pr, counts) for counts in splits
                                       if self.memory_floor(par, sum(counts[0::par.pp])) <= cap))

    def _params_key(self, pr: Probe) -> tuple:
        """What the probe's parameters are keyed by in the caches: its ``tp, ep,
        expert_tp`` when they equal the first probe's of those (parameters are sharded by
        those degrees only), else the probe itself. Cached per probe."""
        got = self.params_keys.get(id(pr))
        if got is None:
            key = pr.params_of
            owner = self.param_owner.setdefault(key, pr)
            got = self.params_keys[id(pr)] = key if owner is pr or owner.qparams == pr.qparams else (id(pr),)
        return got

    def _stage_params(self, pr: Probe, counts: tuple[int, ...], par: ParallelConfig) -> list[StageParams]:
        """:func:`compose_params` of the probe over ``counts`` on ``par``'s pipeline ranks (by its
        schedule's placement), cached (the layouts of one split that differ in anything else
        but the probe share them)."""
        place = par.pipeline_schedule.placement
        key = (self._params_key(pr), counts, par.pp, place)
        got = self.stage_param_sets.get(key)
        if got is None:
            got = self.stage_param_sets[key] = compose_params(pr.qparams, counts, par.pp, self.cfg.model.tie_embeddings,
                                                               self.dense, place)
        return got


    def _trained_params(self, pr: Probe, counts: tuple[int, ...], par: ParallelConfig) -> list[StageParams]:
        """:meth:`_stage_params` as the step's collectives, gradient buckets and optimizer see
        them (:func:`~parcompile.analysis.lora.trainable`: with LoRA the adapters only, as
        :func:`~parcompile.analysis.cost.analyze` passes them to the estimate), cached."""
        sps = self._stage_params(pr, counts, par)
        if not is_lora(self.cfg):
            return sps
        key = ("trained", id(sps), par.tp)
        got = self.stage_param_sets.get(key)
        if got is None:
            got = self.stage_param_sets[key] = [trainable(self.cfg, {"tp": par.tp}, sp) for sp in sps]
        return got


class SplitChoice:
    """The split of a layout's layers into its model chunks (a part of :class:`Coster`): the
    splits it may get (:meth:`splits`) and, when the layers do not divide into the chunks,
    the default uneven one, timed in the order of the splits' lower bounds
    (:meth:`choose_split`, :meth:`_choose_split`, :func:`_pick_split`). Reads the coster's
    floors (:class:`~parcompile.layout_search.bounds.StepFloors`) and :meth:`Coster.cost`; fills no
    cache of its own."""

    def splits(self, cfg: SpecConfig) -> list[tuple[int, ...]]:
        """The layers per model chunk ``cfg`` may get: its split, or, when the layers do
        not divide into its chunks and it gives none, every candidate split."""
        par = cfg.parallel
        layers, chunks = cfg.model.layers, par.pp * par.virtual_stages
        if par.stage_layers is None and layers % chunks:
            return candidate_splits(layers, chunks)
        return [par.layers_per_chunk(layers)]

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
        cap = usable_memory(cfg.cluster) if cfg.workload == "train" else None
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
        return _pick_split(costed, cands, complete, simulate, bound)


class Coster(ChunkCosts, MemoryCosts, SplitChoice, Floors):
    """Costs layouts of one spec from cached probes (module docstring): holds the caches its
    parts fill (:class:`ChunkCosts`, :class:`MemoryCosts`, :class:`SplitChoice` and the lower
    bounds of :class:`~parcompile.layout_search.bounds.Floors`) and owns the step time
    (:meth:`cost`: the pipeline, simulated or closed form, the exposed data-parallel time and
    the optimizer step, :meth:`_data_parallel`, :meth:`_steps`)."""

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.eff = efficiency(cfg.cluster)
        self.probes: dict[tuple, Probe] = {}
        self.inside: dict[tuple, tuple] = {}
        self.pipes: dict[tuple, tuple[ChunkTimes, float, dict]] = {}
        self.buf_sums: dict[tuple, tuple[int, int, int]] = {}
        self.state_floors: dict[tuple, int] = {}
        self.param_probes: dict[tuple, Probe] = {}
        self.base_works: dict[tuple, float] = {}
        self.sims: dict[tuple, tuple[float, dict]] = {}
        self.action_lists: dict[tuple, list] = {}
        self.exposed: dict[ParallelConfig, tuple[float, float]] = {}
        self.stage_param_sets: dict[tuple, list[StageParams]] = {}
        self.step_sets: dict[tuple, list[CollectiveEntry]] = {}
        self.dp_groups: dict[tuple, tuple[SpecConfig, list[CollectiveEntry]]] = {}
        self.param_owner: dict[tuple, Probe] = {}
        self.state_parts: dict[tuple, float] = {}
        self.step_floor_parts: dict[tuple, tuple] = {}
        self.family_works: dict[tuple, tuple] = {}
        self.comm_axes: dict[tuple, list[str]] = {}
        self.base_p2p: dict[tuple, float] = {}
        self.step_floor_memo: dict[tuple, float] = {}
        self.in_flight_firsts: dict[tuple, Fraction] = {}
        self.scaled_bases: dict[tuple, tuple] = {}
        self.scaled_comms: dict[tuple, CommReport] = {}
        #: time every micro-batch's scaled probe (:meth:`_base_work`), not the line (tests)
        self.direct_works = False
        self.params_keys: dict[int, tuple] = {}
        self.memories: dict[tuple, tuple[MemoryReport, list[StageParams]]] = {}
        #: the peaks of layouts that do not fit exact (:meth:`memory`); the search's bounded
        #: ranking, which drops them, turns it off
        self.exact_peaks = True
        #: the model's leading layers probed apart: dense ones before MoE ones, or those FP8
        #: training keeps in 16 bits (:func:`leading_layers`)
        self.dense = leading_layers(cfg)

    def choose_group(self, cfg: SpecConfig, c: Candidate) -> Candidate:
        """``c`` (a simulated candidate of a spec that leaves ``microbatch_group_size`` unset),
        or the same layout with another micro-batch group size (:func:`group_sizes`) when
        that is strictly faster, simulated, and fits: the search's axis where it matters,
        interleaved 1F1B with more micro-batches than pipeline ranks. The sizes are
        :func:`searched_group_sizes`, timed smallest first until one is not faster (a larger
        group keeps more micro-batches in flight and blocks on more warm-up transfers: what
        it can gain, filling the bubbles of unlike chunks, shows at the smallest first). A
        group's step time is at least the split's simulated floor plus the data-parallel
        time and the optimizer (:meth:`_split_floors`, :meth:`_sim_floor`: whatever the
        order of the actions), so none is timed once that floor is not below the best time
        found; Megatron-Core's depth-first default (``pp``) wins ties."""
        par = c.parallel
        if cfg.parallel.microbatch_group_size is not None or not c.fits or not c.simulated \
                or not par.pipeline_schedule.rounds or par.virtual_stages == 1:
            return c
        sizes = searched_group_sizes(par.pp, par.num_microbatches)
        if not sizes:
            return c
        sub = with_parallel(cfg, par)
        floor = self._sim_floor(sub, self._split_floors(par, [par.layers_per_chunk(cfg.model.layers)], True)[0])
        best = c
        for n in sizes:
            if floor >= round(best.step_time, 9):
                break
            got = self.cost(with_parallel(cfg, par.model_copy(update={"microbatch_group_size": n})), simulate=True,
                            with_memory=True)
            if not (got.fits and round(got.step_time, 9) < round(best.step_time, 9)):
                break
            best = got
        return best

    def _steps(self, cfg: SpecConfig, deg: dict, sps: list[StageParams],
               frozen: list[StageParams] | None = None) -> list[CollectiveEntry]:
        """:func:`~parcompile.passes.insert_collectives.step_entries`, cached by what
        :func:`~parcompile.passes.insert_collectives.step_collectives` reads: the stage
        parameters (``sps`` trained; ``frozen``, LoRA's whole ones, :meth:`_frozen_params`),
        the degrees and the layout's ZeRO stage, schedule, micro-batches, bucket size,
        reduce dtype and sequence parallelism (the model is the spec's)."""
        par = cfg.parallel
        key = (id(sps), id(frozen), step_degrees(deg), par.zero, par.schedule, par.num_microbatches, par.pp,
               par.bucket_size, par.reduce_dtype, par.sequence_parallel)
        got = self.step_sets.get(key)
        if got is None:
            got = self.step_sets[key] = step_entries(cfg, deg, sps, frozen)
        return got

    def _frozen_params(self, pr: Probe, counts: tuple[int, ...], par: ParallelConfig) -> list[StageParams] | None:
        """With LoRA the stages' whole parameters, whose frozen weights ZeRO-3 gathers
        (:func:`~parcompile.analysis.lora.frozen_gathers`, as the pass passes them to
        :func:`~parcompile.passes.insert_collectives.step_collectives`); None without."""
        return self._stage_params(pr, counts, par) if is_lora(self.cfg) else None

    def _data_parallel(self, cfg: SpecConfig, pr: Probe, ct: ChunkTimes, links: dict, deg: dict,
                       sps: list[StageParams]) -> tuple[float, float]:
        """(exposed data-parallel seconds, optimizer seconds) of layout ``cfg``
        (:func:`~parcompile.analysis.estimate.dp_exposed`, :func:`~parcompile.analysis.estimate.optimizer_time`):
        what :func:`~parcompile.analysis.estimate.step_time_parts` adds to the pipeline,
        which needs no schedule. Cached per layout."""
        key = cfg.parallel
        got = self.exposed.get(key)
        if got is None:
            frozen = self._frozen_params(pr, cfg.parallel.layers_per_chunk(cfg.model.layers), cfg.parallel)
            got = self.exposed[key] = (dp_exposed(cfg, deg, links, self._steps(cfg, deg, sps, frozen), ct, sps),
                                       optimizer_time(cfg, deg, sps))
        return got

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
        deg = parallel_degrees(par)
        bounded = bound is not None and not simulate
        if bounded:   # time: the pipeline, the optimizer step, a floor on the data-parallel time
            ct3, links, tkey = self._chunk_times3(pr, par)
            ct, span, parts = self._pipeline(cfg, pr, ct3, tkey, counts)
            if span > bound:
                return None   # slower than the bound whatever its data-parallel time
            sps = self._trained_params(pr, counts, par)
            opt = optimizer_time(cfg, deg, sps)
            if span + opt > bound:
                return None   # slower than the bound whatever its data-parallel time
            if span + self._dp_floor(cfg, pr, counts, ct, links, deg) + opt > bound:
                return None
        mem, _ = self.memory(cfg, pr, counts, exact=with_memory or self.exact_peaks)
        sps = self._trained_params(pr, counts, par)
        peak, cap = mem.peak, mem.capacity
        if not mem.fits and not with_memory:   # not timed: it will be dropped
            return Candidate(par, math.inf, 0.0, 0.0, peak, cap, 0.0, {})
        if bounded:   # what _data_parallel gives (and keeps, for the re-timing)
            dp_comm = dp_exposed(cfg, deg, links, self._steps(cfg, deg, sps, self._frozen_params(pr, counts, par)),
                                 ct, sps)
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
            skey = (id(pr), tkey, pp, v, m, counts, par.schedule, par.microbatch_group_size)
            got = self.sims.get(skey)
            if got is None:
                group = par.microbatch_group_size
                sched = par.pipeline_schedule
                akey = (sched, pp, m, v, group)   # only zero-bubble orders its actions by the times
                actions = self.action_lists.get(akey)
                if actions is None:
                    f = [ct.fwd(k) for k in range(pp * v)]
                    b = [ct.bwd(k) for k in range(pp * v)]
                    w = [ct.wgrad(k) for k in range(pp * v)]
                    actions = build_actions(sched, pp, m, v, times=(f, [bi - wi for bi, wi in zip(b, w)], w),
                                            group=group)
                    if not sched.split_backward:
                        self.action_lists[akey] = actions
                got = self.sims[skey] = pipeline_parts(cfg, ct, m, actions)
            span, parts = got
        # step_time_parts: the pipeline, the exposed data-parallel time, the optimizer step
        parts = dict(parts)
        parts.update({"dp_comm": dp_comm, "optimizer": opt})
        step = span + dp_comm + opt
        flops = sum(compose(pr.quad(lambda p: p.model_flops), counts, self.dense)) * par.dp * m
        tflops = flops / (step * par.world_size) / 1e12 if step > 0 else 0.0
        return Candidate(par, step, tflops * 1e12 / cl.peak_flops, tflops, peak, cap,
                         parts.pop("bubble_fraction"), parts, mem if with_memory else None, simulated)


def group_sizes(pp: int, m: int) -> list[int]:
    """The micro-batch group sizes (``microbatch_group_size``) other than the default ``pp``
    that Megatron-Core runs interleaved 1F1B with on ``pp`` ranks and ``m`` micro-batches
    (:func:`~parcompile.core.schedule.group_error`), smallest first."""
    return [n for n in range(pp + 1, m + 1) if group_error(pp, m, n) is None]


def searched_group_sizes(pp: int, m: int) -> list[int]:
    """The group sizes the search times (:meth:`Coster.choose_group`): those of
    :func:`group_sizes` made of whole rounds of ``pp`` that divide the micro-batches
    (``2 pp``, ``4 pp``, ... up to ``m``), smallest first."""
    return [n for n in group_sizes(pp, m) if n % pp == 0 and m % n == 0]


def _pick_split(costed: list[tuple[Candidate, int, tuple[int, ...]]], cands: list[tuple[int, ...]], complete: bool,
                simulate: bool, bound: float | None) -> tuple[tuple[int, ...], int, Candidate | None]:
    """:meth:`Coster._choose_split`'s choice among the splits ``costed`` (``(candidate,
    index in cands, split)``; ``complete``: every split was costed): the fastest that fits,
    ties within :data:`SPLIT_TIME_TIE` to the smaller peak then the earlier split; when none
    fits, the smallest peak (the search drops the layout) or the first split (when some were
    not costed: every split that fits is slower than ``bound``); the candidate None when it
    is slower than ``bound``."""
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
