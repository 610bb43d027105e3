"""The search's layer-less end chunks (issue 48): layouts whose first model chunk holds only
the embedding and whose last holds only the output layer and the loss (Megatron-Core's
``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``,
Meta's Llama 3.1 405B split) are candidates, so a search with Meta's degrees fixed ranks a
layout at least as fast as Meta's own (examples/llama3_405b_meta_16k_h100.par) first."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

import parcompile
from parcompile.frontend import load_spec
from parcompile.layout_search import search
from parcompile.layout_search.space import fills_with_end_chunks, virtual_stage_counts
from parcompile.passes.split_pipeline_stages import candidate_splits

META = pathlib.Path(__file__).parent.parent / "examples" / "llama3_405b_meta_16k_h100.par"

#: Meta's degrees (Llama 3 paper, Table 4: tp 8, pp 16, cp 1, dp 128 on 16,384 H100s) set on
#: benchmarks/search.py's all-auto 405B spec (one copy of it; the rest stays `auto`)
META_DEGREES = {"parallel.tp": 8, "parallel.pp": 16, "parallel.cp": 1, "parallel.dp": 128}


def _bench_auto() -> str:
    spec = importlib.util.spec_from_file_location("bench_search", META.parents[1] / "benchmarks" / "search.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.AUTO


def test_search_with_metas_degrees_ranks_first_a_layout_as_fast_as_metas():
    """The done-when of issue 48's search item: the example planned, the search with its
    degrees fixed, the top candidate's estimated step time compared (the search's re-timed
    estimate is the compiler's: tests/test_search.py holds the costing to the compiler's)."""
    plan = parcompile.compile(META.read_text())
    assert plan.data["memory"]["fits"]
    meta = plan.data["estimate"]["step_time"]
    cfg, _ = load_spec(_bench_auto(), overrides=META_DEGREES)
    res = search(cfg)
    best = res.best
    assert best.fits and best.simulated
    assert (best.parallel.tp, best.parallel.pp, best.parallel.cp, best.parallel.dp) == (8, 16, 1, 128)
    assert best.step_time <= meta * (1 + 1e-9), (best.degrees_text(), best.step_time, meta)
    # Meta's own layout is among the candidates, with the plan's estimate
    metas = [c for c in res.candidates if c.parallel.virtual_stages == 8 and c.parallel.zero == 2
             and c.parallel.recompute == "none" and c.parallel.sequence_parallel and c.parallel.micro_batch == 1]
    assert metas and metas[0].parallel.stage_layers == (0,) + (1,) * 126 + (0,)
    assert metas[0].step_time == pytest.approx(meta, rel=1e-9)


@pytest.mark.parametrize("layers,chunks,want", [
    (126, 128, [(0,) + (1,) * 126 + (0,)]),
    (126, 127, [(0,) + (1,) * 126, (1,) * 126 + (0,)]),
    (3, 4, [(0, 1, 1, 1), (1, 1, 1, 0)]),
    (125, 128, []),
])
def test_layer_less_end_chunks_where_the_layers_fill_the_chunks(layers, chunks, want):
    """Megatron-Core's accounted split, one layer a chunk: layers + 2 (embedding and loss)
    or layers + 1 (either) chunks; fewer layers cannot fill the middle chunks."""
    got = candidate_splits(layers, chunks)
    assert sorted(got) == sorted(want)
    assert fills_with_end_chunks(layers, chunks) == bool(want)


def test_virtual_stage_counts_add_the_end_chunk_counts():
    # 126 layers on 16 ranks: 8 chunks each (128 = 126 + 2); on 2 ranks: 64 (and 63: 126 = 2 * 63)
    assert virtual_stage_counts(126, 16) == [1, 2, 4, 8]
    assert 64 in virtual_stage_counts(126, 2) and 63 in virtual_stage_counts(126, 2)
    assert virtual_stage_counts(126, 1) == [1]
    # 80 layers: 82 = 2 * 41 chunks with both end chunks layer-less
    assert 41 in virtual_stage_counts(80, 2) and 41 not in virtual_stage_counts(80, 4)
    for pp in (2, 4, 8, 16, 32, 64, 128):
        for v in virtual_stage_counts(126, pp):
            assert candidate_splits(126, pp * v), (pp, v)


def test_search_schedules_come_from_the_schedule_table():
    """The schedules the search tries and its tie order are read off core/schedule.py's
    Schedule values (issue 46): every schedule once, 1F1B first (the plain one), the
    interleaved one the only one with rounds (several chunks per rank)."""
    from parcompile.core.schedule import SCHEDULES
    from parcompile.layout_search.candidate import _SCHEDULE_RANK
    from parcompile.layout_search.space import SCHEDULE_ORDER

    assert sorted(s.name for s in SCHEDULE_ORDER) == sorted(SCHEDULES)
    assert SCHEDULE_ORDER[0] is SCHEDULES["1f1b"] and [s.name for s in SCHEDULE_ORDER if s.rounds] == ["interleaved_1f1b"]
    # the tie order the search kept before (simpler first)
    assert _SCHEDULE_RANK == {"1f1b": 0, "interleaved_1f1b": 1, "zero_bubble": 2, "gpipe": 3}


def test_group_sizes_are_the_ones_megatron_runs():
    from parcompile.core.schedule import group_error
    from parcompile.layout_search.coster import group_sizes, searched_group_sizes

    for pp, m in ((4, 16), (16, 16), (4, 10), (8, 64)):
        got = group_sizes(pp, m)
        assert all(group_error(pp, m, n) is None and n > pp for n in got)
        assert sorted(set(got)) == got and len(got) == sum(group_error(pp, m, n) is None for n in range(pp + 1, m + 1))
    assert group_sizes(4, 16) == [6, 8, 9, 10, 11, 12, 16] and group_sizes(16, 16) == []
    assert searched_group_sizes(4, 16) == [8, 16] and searched_group_sizes(4, 24) == [8, 12, 24]


def test_search_chooses_the_group_size_and_its_layout_passes_the_checker():
    """microbatch_group_size is searched where it matters (interleaved 1F1B, m > pp): each
    candidate keeps the default unless another size is strictly faster, simulated, and
    fits; a chosen size passes the checker with the spec's `auto` keys (the search's last
    filter), and the candidate's figures are those of costing its layout directly."""
    from parcompile.layout_search import Coster, check_layout, with_parallel

    cfg, _ = load_spec(_bench_auto(), overrides={**META_DEGREES, "parallel.global_batch": 8192})
    res = search(cfg, top=24)
    coster = Coster(cfg)
    inter = [c for c in res.candidates[:24] if c.parallel.schedule == "interleaved_1f1b"]
    assert inter
    for c in inter:
        par = c.parallel
        default = coster.cost(with_parallel(cfg, par.model_copy(update={"microbatch_group_size": None})),
                              simulate=True, with_memory=True)
        assert c.fits and round(c.step_time, 9) <= round(default.step_time, 9)
        if par.microbatch_group_size is not None:
            assert round(c.step_time, 9) < round(default.step_time, 9)
            assert not [d for d in check_layout(with_parallel(cfg, par)) if d.severity == "error"]
    # a spec that writes the group size with `auto` keys is still refused
    bad = {**META_DEGREES, "parallel.microbatch_group_size": 16, "parallel.virtual_stages": 4,
           "parallel.schedule": "interleaved_1f1b"}
    try:
        errors = [d.message for d in check_layout(load_spec(_bench_auto(), overrides=bad)[0])
                  if d.severity == "error"]
    except parcompile.SpecError as e:
        errors = [d.message for d in e.diagnostics if d.severity == "error"]
    assert errors == [e for e in errors if "microbatch_group_size = 16 with `auto`" in e and "the search chooses it" in e]
    assert errors
