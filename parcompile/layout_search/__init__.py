"""Automatic planning: fill every ``auto`` of a spec by searching the layouts.

:func:`search` enumerates the layouts the spec leaves open (``dp tp pp cp ep
virtual_stages micro_batch zero recompute schedule sequence_parallel``, and HSDP's
``dp_replicate`` for ZeRO-3 layouts whose data-parallel groups span nodes,
:func:`~parcompile.layout_search.space.hsdp_replicas`; ``offload = auto`` searches again with
offload only when nothing fits, :func:`offload_tries`), keeps those the
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
``domains`` nodes) comes from :func:`~parcompile.core.groups.axis_placement`. Nothing per candidate grows with the
world size; probes are cached, and each of their analyses runs when a layout first needs
it. The best few candidates are then re-timed with their simulated schedules (action
lists), which is what separates zero-bubble from 1F1B, and the best ``top`` of them, when
interleaved with more micro-batches than pipeline ranks, try larger micro-batch groups
(``microbatch_group_size``, :meth:`Coster.choose_group`). Layers that do not divide into a
layout's chunks are split by :meth:`Coster.choose_split` among
:func:`~parcompile.passes.split_pipeline_stages.candidate_splits`, Megatron-Core's embedding-
and loss-accounted splits among them: with ``layers + 1`` or ``+ 2`` one-layer chunks a
layer-less first or last chunk (Meta's Llama 3.1 405B layout).

Only those best few (``max(RETIME, top)``) must be exact, so the layouts are costed best
first by branch and bound (:func:`_rank`): lower bounds on a layout's step time and memory
peak, each cheaper than the costing it bounds and each proven below what it bounds
(:meth:`Coster.family_floor` and :meth:`Coster.family_layout_floor` from a few probes for
whole families of layouts, :meth:`Coster.layout_floor` and :meth:`Coster._split_floors` from
the layout's own probe, :meth:`Coster.step_floor` and :meth:`Coster._dp_floor` for what the
step adds to the pipeline (the data-parallel time, the optimizer), :meth:`Coster.state_floor`
and :meth:`Coster.memory_floor` for memory) skip the layouts that cannot fit or
cannot be among the best (``tests/test_search.py`` holds each bound against what it bounds,
and the search against costing every layout, :data:`BOUNDS` off). A layout costed there that
does not fit is dropped, so its memory is added up only until a stage exceeds the capacity
(:attr:`Coster.exact_peaks` off; exact again when nothing fits, for the closest layout). The best few, their
figures and their order are those of costing every layout; the ranking past them holds
the layouts costed, and :class:`SearchResult` counts the rest by the rule that skipped
them. On Llama 3.1 405B on 16,384 H100s with every key ``auto`` (``benchmarks/search.py``)
about 220 of 133,000 valid layouts are costed and 52 probes built; on Llama-3 70B on 1,024
H100s, 390 of 93,000 and 38 probes (52 before :meth:`Coster.memory_floor` bounded the
larger micro-batches from the probes of micro-batch 1 and 2); on DeepSeek-V3 (3 dense then 58
MoE layers) on 2,048 H100s, 615 of 35,000 and 64 probes (each with its dense probe).

``parcompile.compile`` uses :func:`resolve` on a spec with ``auto`` keys: the best
candidate's layout, compiled as if the user had written it.

The package, bottom up: :mod:`~parcompile.layout_search.space` (the layouts as rows, the checks
they pass), :mod:`~parcompile.layout_search.probe` (probes and composing a candidate's chunks from
them), :mod:`~parcompile.layout_search.candidate`, :mod:`~parcompile.layout_search.bounds` (the lower
bounds, :class:`~parcompile.layout_search.bounds.Floors`), :mod:`~parcompile.layout_search.coster`
(:class:`Coster`: costing one layout, choosing a split), :mod:`~parcompile.layout_search.rank`
(branch and bound over the rows), :mod:`~parcompile.layout_search.report` (tables, explanations);
this module runs them (:func:`search`, :func:`resolve`, :func:`settle_split`).
"""

from __future__ import annotations

import time
from typing import Callable

from parcompile.config.schema import ParallelConfig, SpecConfig
from parcompile.diagnostics import Diagnostic, SpecError
from parcompile.passes.manager import paused_gc
from parcompile.layout_search.candidate import Candidate, split_text
from parcompile.layout_search.coster import Coster, SPLIT_TIME_TIE
from parcompile.layout_search.rank import RETIME, SearchResult, family_key, rank_rows
from parcompile.layout_search.report import no_fit_diagnostic
from parcompile.layout_search.space import LayoutChecker, check_key, check_layout, layout_blocks, needs_search, with_parallel
from parcompile.layout_search.report import explain, stderr_progress, table
from parcompile.layout_search.space import MAX_MICRO_BATCH, SEARCH_KEYS, layouts, searches_sequence_parallel

#: the package's names (``parcompile.layout_search.*``: the CLI's, the API's, the driver's)
__all__ = ["BOUNDS", "Candidate", "Coster", "MAX_MICRO_BATCH", "OFFLOAD_ORDER", "RETIME", "SEARCH_KEYS",
           "SPLIT_TIME_TIE", "SearchResult",
           "check_layout", "explain", "layouts", "needs_search", "no_fit_diagnostic", "resolve", "search",
           "searches_sequence_parallel", "settle_split", "split_text", "stderr_progress", "table", "with_parallel"]


#: rank by branch and bound (:func:`rank_rows`); off, every layout is costed (the same best
#: ``max(RETIME, top)`` candidates, in the same order: ``tests/test_search.py``)
BOUNDS = True


def search(cfg: SpecConfig, top: int = 10, cross_node_tp: bool = False,
           progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """Enumerate, check, cost and rank the layouts of ``cfg`` (module docstring).

    ``progress(done, total)`` is called now and then. With ``offload = auto`` the layouts
    are searched without offload first, then with each offload of :data:`OFFLOAD_ORDER`
    only while none fits (:func:`offload_tries`); when none fits with any, the result is
    the last try the checker let any layout through (its ``closest`` names the smallest
    peak), not an offload the spec's own keys refuse (as ``params`` beside ``zero = 0``).
    Raises :class:`SpecError` for a model the compiler cannot lower (MoE, for now).
    """

    with paused_gc():
        shown = None
        for tried in offload_tries(cfg):
            res = _search(tried, top, cross_node_tp, progress)
            if res.candidates:
                return res
            if res.valid or shown is None:
                shown = res
        return shown


#: what ``offload = auto`` tries, in order (SPEC `parallel.offload`): each only when no layout
#: fits with the one before, since moving states to host memory adds PCIe traffic and a CPU
#: optimizer step (:mod:`parcompile.analysis.offload`) to a layout that would fit without it
OFFLOAD_ORDER = ("none", "optimizer", "params")


def offload_tries(cfg: SpecConfig) -> list[SpecConfig]:
    """The specs :func:`search` searches in turn: ``cfg`` itself, or with ``offload = auto``
    ``cfg`` with each of :data:`OFFLOAD_ORDER` (the layouts that need ``zero`` 1 or 3 for it
    are the checker's to keep)."""
    if "offload" not in cfg.parallel.auto or cfg.workload != "train":
        return [cfg]
    return [with_parallel(cfg, cfg.parallel.model_copy(update={"offload": o})) for o in OFFLOAD_ORDER]


def _search(cfg: SpecConfig, top: int, cross_node_tp: bool,
            progress: Callable[[int, int], None] | None) -> SearchResult:
    t0 = time.perf_counter()
    coster = Coster(cfg)
    blocks = list(layout_blocks(cfg, cross_node_tp))
    rows = [r for block in blocks for r in block]
    total = len(rows)
    valid, families = _valid_families(cfg, blocks, progress, total)
    keep = max(RETIME, top)
    bounds = BOUNDS and cfg.workload == "train"
    coster.exact_peaks = not bounds   # the layouts that do not fit are dropped: their peaks need not be exact
    ranked = rank_rows(cfg, coster, rows, families, keep, bounds, progress, total)
    coster.exact_peaks = True
    if not ranked.scored and bounds:
        # none fits: the closest layout may be one the state bound dropped, and its peak is
        # wanted exact; rank them all
        ranked = rank_rows(cfg, coster, rows, families, keep, False, progress, total)
    if progress is not None:
        progress(total, total)
    scored = [c for c, _i in sorted(ranked.scored, key=lambda x: (x[0].key(), x[1]))]
    # re-time the best with their simulated schedules, then confirm each with the full checker
    head = [coster.cost(with_parallel(cfg, _own_split(cfg, c.parallel)), simulate=True, with_memory=True)
            for c in scored[:keep]]
    head.sort(key=Candidate.key)
    # the micro-batch group size, for the best `top` (each a simulation per size tried)
    head[:top] = [coster.choose_group(cfg, c) for c in head[:top]]
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


def _valid_families(cfg: SpecConfig, blocks: list[list[tuple]], progress: Callable[[int, int], None] | None,
                    total: int) -> tuple[int, dict[tuple, list[int]]]:
    """The rows of ``blocks`` (:func:`layout_blocks`) the checker accepts: how many, and their
    indices per family (:func:`family_key`). The checker runs once per layout up to zero and
    recompute, once per block of rows, each check once per value of what it reads: those keys
    have no cross-field rules but with ``offload`` or HSDP (``dp_replicate > 1``), which need
    ``zero`` >= 1 (then once per zero stage of a block)."""
    checker = LayoutChecker(cfg)
    per_zero = cfg.parallel.offload != "none" or cfg.parallel.dp_replicate > 1
    checked: dict[tuple, bool] = {}
    families: dict[tuple, list[int]] = {}
    valid = i = 0
    for block in blocks:
        if progress is not None and i % 4096 < len(block):
            progress(i // 2, total)
        r = block[0]
        fam = families.get(family_key(r))
        if fam is None:
            fam = families[family_key(r)] = []
        for j, r in enumerate(block if per_zero else block[:1]):
            ck = check_key(r) + ((r[7],) if per_zero else ())
            ok = checked.get(ck)
            if ok is None:
                ok = checked[ck] = checker.ok(r)
            if ok:
                got = [i + j] if per_zero else range(i, i + len(block))
                valid += len(got)
                fam.extend(got)
        i += len(block)
    return valid, {k: v for k, v in families.items() if v}


def _own_split(cfg: SpecConfig, par: ParallelConfig) -> ParallelConfig:
    """``par`` without the split the closed-form pass chose for it (re-chosen with the
    simulated schedule when re-timed); a split the spec gives is kept."""
    if "parallel.stage_layers" in cfg.spans or par.stage_layers is None:
        return par
    return par.model_copy(update={"stage_layers": None})


def _user_layout_complete(cfg: SpecConfig) -> bool:
    return not needs_search(cfg)


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
