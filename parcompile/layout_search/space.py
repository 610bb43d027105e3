"""The layouts a spec's ``auto`` keys allow, enumerated as rows, and the checks a row must pass
(:func:`parcompile.frontend.checks.check_config`, run once per value of what each check reads)."""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterator, NamedTuple

from parcompile.config.schema import ParallelConfig, SpecConfig
from parcompile.config.text import divisors
from parcompile.core.groups import axis_placement
from parcompile.core.schedule import SCHEDULES
from parcompile.diagnostics import Diagnostic, DiagnosticBag
from parcompile.frontend.checks import CHECKS, LAYOUT_READS, CheckContext, check_config
from parcompile.passes.split_pipeline_stages import candidate_splits


#: keys `auto` may stand for (SPEC 1 `parallel`, extended)
SEARCH_KEYS = ("dp", "tp", "pp", "cp", "ep", "virtual_stages", "micro_batch", "zero", "recompute",
               "schedule", "sequence_parallel", "dp_replicate", "offload")


#: largest micro-batch the search tries
MAX_MICRO_BATCH = 16


#: the pipeline schedules (:data:`parcompile.core.schedule.SCHEDULES`), simpler first: the fewest
#: departures from 1F1B (interleaved rounds, then a split backward, then every forward first).
#: The search tries those with rounds for several chunks per rank, the others for one
#: (1F1B alone on one pipeline rank, where they all run alike); ties rank in this order
#: (:meth:`~parcompile.layout_search.candidate.Candidate.key`)
SCHEDULE_ORDER = tuple(sorted(SCHEDULES.values(), key=lambda s: (s.forwards_first, s.split_backward, s.rounds)))


def needs_search(cfg: SpecConfig) -> bool:
    """True when a training spec leaves a layout choice to the compiler (``auto`` on a key
    other than ``dp``, which alone is fixed by the world size); a serve spec's are the sizing
    search's (:func:`parcompile.layout_search.serve.needs_serve_search`)."""
    return cfg.workload != "serve" and any(k != "dp" for k in cfg.parallel.auto)


class RowLayout(NamedTuple):
    """A row of :func:`layout_rows` read as the :class:`ParallelConfig` fields the memory
    floors read (:meth:`Coster.state_floor`, :meth:`Coster.memory_floor`), without
    building one; ``num_microbatches``, ``expert_dp``, ``pipeline_schedule`` and
    ``rank_chunks`` are ParallelConfig's own."""

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
    dp_replicate: int

    num_microbatches = property(ParallelConfig.num_microbatches.fget)
    expert_dp = property(ParallelConfig.expert_dp.fget)
    pipeline_schedule = property(ParallelConfig.pipeline_schedule.fget)
    dp_shard = property(ParallelConfig.dp_shard.fget)
    rank_chunks = ParallelConfig.rank_chunks


def _values(cfg: SpecConfig, key: str, auto: set[str], choices: list) -> list:
    return choices if key in auto else [getattr(cfg.parallel, key)]


def layouts(cfg: SpecConfig, cross_node_tp: bool = False) -> Iterator[ParallelConfig]:
    """Every layout the spec's ``auto`` keys allow, before the checker: degrees whose
    product is the world size, tp inside a node (unless ``cross_node_tp`` or tp is
    given), the rest from their natural ranges. Candidates the checker rejects are
    filtered by :func:`search`, not here."""
    for r in layout_rows(cfg, cross_node_tp):
        yield row_parallel(cfg, r)


def row_parallel(cfg: SpecConfig, r: tuple) -> ParallelConfig:
    """The :class:`ParallelConfig` of a row of :func:`layout_rows` (the spec's own values
    for every key the search does not vary)."""
    p = cfg.parallel
    dp, tp, pp, cp, ep, etp, sp, z, mb, gb, sched, v, rc, dpr = r
    return ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=etp, sequence_parallel=sp, zero=z,
                          micro_batch=mb, global_batch=gb, schedule=sched, virtual_stages=v,
                          stage_layers=p.stage_layers, recompute=rc, order=p.order, bucket_size=p.bucket_size,
                          reduce_dtype=p.reduce_dtype, microbatch_group_size=p.microbatch_group_size, auto=p.auto,
                          dp_replicate=dpr, offload=p.offload)


def layout_rows(cfg: SpecConfig, cross_node_tp: bool = False) -> Iterator[tuple]:
    """:func:`layouts` as plain tuples ``(dp, tp, pp, cp, ep, expert_tp, sequence_parallel,
    zero, micro_batch, global_batch, schedule, virtual_stages, recompute, dp_replicate)``, in the same
    order (the search builds a :class:`ParallelConfig` only for the rows it costs)."""
    for block in layout_blocks(cfg, cross_node_tp):
        yield from block


def layout_blocks(cfg: SpecConfig, cross_node_tp: bool = False) -> Iterator[list[tuple]]:
    """:func:`layout_rows` in blocks of consecutive rows that differ in ZeRO stage and
    recomputation only, so share their :func:`check_key` and :func:`family_key` (the search
    checks a block once). With ``dp_replicate = auto`` each layout's ZeRO-3 rows come again
    as HSDP, once per replicate degree of :func:`hsdp_replicas`, in blocks of their own."""
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
    hsdp = "dp_replicate" in auto and 3 in zeros
    dpr = 1 if "dp_replicate" in auto else p.dp_replicate
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
                    vs = virtual_stage_counts(m.layers, pp)
                else:
                    vs = [p.virtual_stages]
                zs = zeros if dp * cp > 1 else zeros[:1] if "zero" in auto else zeros
                reps = hsdp_replicas(cfg, tp, cp, dp, pp) if hsdp and 3 in zs else ()
                etp = p.expert_tp if etp_given else tp
                for v in vs:
                    if "schedule" in auto:
                        scheds = [s.name for s in SCHEDULE_ORDER if s.rounds] if v > 1 else (
                            [SCHEDULE_ORDER[0].name] if pp == 1 else [s.name for s in SCHEDULE_ORDER if not s.rounds])
                    else:
                        scheds = [p.schedule]
                    for sched in scheds:
                        for ep in eps:
                            for mb in mbs:
                                gb = p.global_batch if gb_given else mb * dp
                                for sp in sps:
                                    if sp and tp == 1 and sp_open:
                                        continue
                                    yield [(dp, tp, pp, cp, ep, etp, sp, z, mb, gb, sched, v, rc, dpr)
                                           for z in zs for rc in recs]
                                    for n in reps:
                                        yield [(dp, tp, pp, cp, ep, etp, sp, 3, mb, gb, sched, v, rc, n)
                                               for rc in recs]


def hsdp_replicas(cfg: SpecConfig, tp: int, cp: int, dp: int, pp: int) -> list[int]:
    """The HSDP replicate degrees (``dp_replicate``, issue 49) the search tries for a ZeRO-3
    layout of these degrees: none when the data-parallel groups (``dp_cp``) lie inside one
    NVLink domain (``cluster.domain_size``: a node, or the preset's NVLink domain), where
    sharding over all of them already gathers on NVLink; else ``dp / dp_shard`` for each
    shard degree ``1 < dp_shard < dp`` dividing dp whose shard groups stay inside a domain
    (:func:`~parcompile.core.groups.axis_placement` of ``dp_shard``), so that ZeRO-3's
    gathers and reduce-scatters run on NVLink and only the replicas' all-reduce crosses
    nodes (torchtitan's ``data_parallel_shard_degree`` = GPUs per node,
    ``data_parallel_replicate_degree`` = nodes). Largest shard first."""
    domain, order = cfg.cluster.domain_size, cfg.parallel.order
    base = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, order=order, zero=3, micro_batch=1, global_batch=dp)
    if axis_placement(base, "dp_cp", domain)[1] <= 1:
        return []
    out = []
    for shard in sorted(divisors(dp), reverse=True):
        if 1 < shard < dp and shard * cp <= domain and shard_domains(base, shard, domain) == 1:
            out.append(dp // shard)
    return out


def shard_domains(par: ParallelConfig, shard: int, domain: int) -> int:
    """How many domains of ``domain`` ranks an HSDP shard group of layout ``par`` with
    ``dp_shard = shard`` spans (:func:`~parcompile.core.groups.axis_placement` of ``dp_shard``).
    Where ``cp`` comes before ``dp`` and ``pp`` right after it in the mesh order (the default,
    ``tp-cp-ep-dp-pp``) without building the groups: a shard group is ``shard * cp`` consecutive
    members of a ``dp_cp`` group, the shard index the fastest part of dp (torchtitan's mesh,
    :func:`~parcompile.core.groups.hsdp_groups`), so the ranks map as in the layout of ``dp =
    shard`` and ``pp * dp_replicate`` pipeline ranks, whose ``dp_cp`` groups are the shard
    groups (``tests/test_search_finetune.py`` holds the two ways equal)."""
    axes = [a for a in par.order.split("-") if a != "ep"]   # ep folds onto the dense ranks
    rep = par.dp // shard
    d = axes.index("dp")
    if axes.index("cp") < d and d + 1 < len(axes) and axes[d + 1] == "pp":
        folded = par.model_copy(update={"dp": shard, "pp": par.pp * rep, "global_batch": shard})
        return axis_placement(folded, "dp_cp", domain)[1]
    return axis_placement(par.model_copy(update={"dp_replicate": rep}), "dp_shard", domain)[1]


def virtual_stage_counts(layers: int, pp: int) -> list[int]:
    """The model chunks per pipeline rank the search tries on ``pp`` ranks: the divisors of
    the layers per rank (rounded up when they do not divide: an uneven split,
    :meth:`~parcompile.layout_search.coster.Coster.choose_split`), each chunk a layer at least,
    and with ``pp > 1`` the counts whose chunks the layers fill only with a layer-less first
    chunk, last chunk or both (``pp * v = layers + 1`` or ``layers + 2``: Megatron-Core's
    embedding and loss accounted in the split, one layer per chunk; Meta's Llama 3.1 405B,
    126 layers on 16 ranks of 8 chunks, :func:`~parcompile.passes.split_pipeline_stages.
    candidate_splits`). One chunk per rank with ``pp = 1``."""
    if pp == 1:
        return [1]
    ends = {(layers + e) // pp for e in (1, 2) if (layers + e) % pp == 0}
    return sorted({x for x in divisors(-(-layers // pp)) if pp * x <= layers + 2} | ends)


def fills_with_end_chunks(layers: int, chunks: int) -> bool:
    """Whether ``layers`` fill ``chunks`` model chunks only with a layer-less first or last
    chunk (``chunks - 2 <= layers < chunks``): the checker refuses such a layout without a
    ``stage_layers``, the search costs it with its splits
    (:func:`~parcompile.passes.split_pipeline_stages.candidate_splits`)."""
    return chunks > 1 and chunks - 2 <= layers < chunks


def checked_parallel(cfg: SpecConfig, r: tuple) -> ParallelConfig:
    """The layout the checker judges row ``r`` of :func:`layout_rows` by: :func:`row_parallel`,
    and where its layers fill its chunks only with a layer-less end chunk
    (:func:`fills_with_end_chunks`) and the spec gives no split, with the first such split
    (the checker refuses the layout without one; the coster chooses among them, and the
    search checks the chosen one again)."""
    par = row_parallel(cfg, r)
    layers, chunks = cfg.model.layers, par.pp * par.virtual_stages
    if par.stage_layers is None and fills_with_end_chunks(layers, chunks):
        par = par.model_copy(update={"stage_layers": candidate_splits(layers, chunks)[0]})
    return par


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


#: the fields of a layout row (:func:`layout_rows`), in order
_ROW_FIELDS = ("dp", "tp", "pp", "cp", "ep", "expert_tp", "sequence_parallel", "zero", "micro_batch",
               "global_batch", "schedule", "virtual_stages", "recompute", "dp_replicate")


class LayoutChecker:
    """Whether the checker accepts the layouts of one spec, given as rows of
    :func:`layout_rows`: :func:`check_layout`'s verdict (no error), with each check of
    :data:`~parcompile.frontend.checks.CHECKS` run once per distinct value of the row fields
    it reads (:data:`~parcompile.frontend.checks.LAYOUT_READS`; the other fields of the
    layout are the spec's, the same in every row), a check without an entry once per
    :func:`check_key`. Each check runs with a context of its own: no check reads a key
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
            pick = check_key if idx is None else (lambda r: ()) if not idx else operator.itemgetter(*idx)
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
        rcfg = with_parallel(self.cfg, checked_parallel(self.cfg, r))
        ok = True
        for key, check in todo:
            ctx = _check_context(rcfg)
            check(rcfg, ctx)
            self.runs += 1
            bad = failed[key] = any(d.severity == "error" for d in ctx.bag.items)
            ok = ok and not bad
        return ok


#: a layout row of :func:`layout_rows`: the fields of :class:`ParallelConfig` the search varies
Row = tuple   # (dp, tp, pp, cp, ep, expert_tp, sequence_parallel, zero, micro_batch, global_batch,
#               schedule, virtual_stages, recompute, dp_replicate)


def check_key(r: Row) -> tuple:
    dp, tp, pp, cp, ep, _etp, sp, _z, mb, gb, sched, v, _rc, dpr = r
    return (tp, pp, dp, cp, ep, mb, v, sched, sp, gb, dpr)
