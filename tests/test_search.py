"""`auto` and `parcompile search` (issue 9): candidates are valid, fit, and are costed
exactly as the compiler costs them."""

from __future__ import annotations

import itertools
import pathlib

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import parcompile
from parcompile.cli import main
from parcompile.driver import compile_config
from parcompile.passes.base import parallel_degrees
from parcompile.passes.manager import cost_without_schedule
from parcompile.frontend import load_spec
from parcompile.layout_search import Coster, check_layout, search, with_parallel

EXAMPLES = sorted(pathlib.Path(__file__).parent.parent.glob("examples/*.par"))
TRAIN = [p for p in EXAMPLES if "serve" not in p.stem]
# DeepSeek-style MoE (leading dense_layers) has layers of two kinds: probed apart (a dense
# probe beside the MoE one, search.probe.Probe.dense_probe), tested like the others
PROBED = TRAIN


def _errors(cfg) -> list:
    return [d for d in check_layout(cfg) if d.severity == "error"]


def _auto(cfg, *keys):
    return cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"auto": tuple(sorted(keys))})})


@pytest.mark.parametrize("path", PROBED, ids=lambda p: p.stem)
def test_fast_cost_equals_the_compilers(path):
    """One probe layer, multiplied, gives exactly what the analyses of the whole graph give."""
    cfg, _ = load_spec(path)
    coster = Coster(cfg)
    p = cfg.parallel
    for z, rc in itertools.product([0, 1, 2, 3], ["none", "selective", "full"]):
        c = with_parallel(cfg, p.model_copy(update={"zero": z, "recompute": rc}))
        if _errors(c):
            continue
        fast, full = coster.cost(c, with_memory=True), cost_without_schedule(c)
        assert fast.peak == full.memory.peak
        # the integer fast path that drops layouts before timing them agrees
        counts = c.parallel.layers_per_chunk(c.model.layers)
        assert coster.peak(c, coster.probe(c.parallel), counts) == (full.memory.peak, full.memory.capacity)
        assert fast.step_time == pytest.approx(full.time.step_time, rel=1e-9)
        assert fast.mfu == pytest.approx(full.time.mfu, rel=1e-9)


def test_fast_cost_equals_the_compilers_with_dense_then_moe_layers():
    """Dense then MoE layers (DeepSeek's): the two probes composed give what the whole graph
    gives, with dense layers on one pipeline rank or spread over several, in chunks
    interleaved or not, closed form and simulated."""
    from parcompile.passes.manager import compile_graph

    cfg, _ = load_spec(MIXED.replace("%s", ""))
    coster = Coster(cfg)
    p = cfg.parallel
    for upd in ({"pp": 1, "dp": 8, "ep": 8},
                {"pp": 2, "dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True, "stage_layers": (1, 9),
                 "schedule": "zero_bubble", "recompute": "full"},
                {"pp": 4, "dp": 2, "ep": 2, "stage_layers": (3, 3, 2, 2), "zero": 3, "recompute": "selective"},
                {"pp": 2, "dp": 4, "ep": 4, "virtual_stages": 2, "schedule": "interleaved_1f1b",
                 "stage_layers": (1, 3, 3, 3)}):
        c = with_parallel(cfg, p.model_copy(update=upd))
        assert not _errors(c), upd
        fast, full = coster.cost(c, with_memory=True), cost_without_schedule(c)
        assert fast.peak == full.memory.peak
        assert fast.step_time == pytest.approx(full.time.step_time, rel=1e-9)
        assert fast.mfu == pytest.approx(full.time.mfu, rel=1e-9)
        sim, whole = coster.cost(c, simulate=True, with_memory=True), compile_graph(c).cost
        assert sim.peak == whole.memory.peak
        assert sim.step_time == pytest.approx(whole.time.step_time, rel=1e-9)


@pytest.mark.parametrize("path", TRAIN, ids=lambda p: p.stem)
def test_search_returns_a_valid_fitting_plan_for_every_example(path):
    cfg, _ = load_spec(path)
    res = search(_auto(cfg, "dp", "tp", "pp", "recompute"), top=3)
    assert res.candidates
    best = res.config(0)
    assert not _errors(best)
    plan = compile_config(best)
    assert plan.data["memory"]["fits"]
    assert res.best.peak == plan.data["memory"]["peak"]


def test_gpt3_175b_on_1024_a100s_picks_tp8_in_nodes_and_pipeline_across():
    text = pathlib.Path(EXAMPLES[0].parent / "gpt3_175b_megatron.par").read_text()
    text = text.replace("nodes         = 192", "nodes         = 128")
    for key in ("tp = 8", "pp = 8"):
        text = text.replace(key, key.split("=")[0] + "= auto")
    text = text.replace("recompute    = full", "recompute = auto\n    sequence_parallel = auto")
    cfg, _ = load_spec(text)
    res = search(cfg, top=10)
    best = res.best.parallel
    # tp stays inside a node, the pipeline crosses them (Megatron-LM's rule)
    assert cfg.cluster.gpus_per_node % best.tp == 0 and best.tp >= 4 and best.pp >= 8
    # Megatron-LM's own choice, tp 8 (a node) x pp 8, ranks within 2% of the best: since the
    # network model of issue 29, tp 4 x pp 16 (its data-parallel ring on 2 NICs per node) is
    # estimated 1% faster, inside the A100 rows' error (benchmarks/cost_model.py)
    megatron = [c for c in res.candidates if (c.parallel.tp, c.parallel.pp) == (8, 8)]
    assert megatron and megatron[0].step_time <= 1.02 * res.best.step_time, [c.degrees_text() for c in res.candidates]


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(keys=st.sets(st.sampled_from(["tp", "pp", "virtual_stages", "micro_batch", "zero", "recompute",
                                     "schedule", "sequence_parallel"]), min_size=1))
def test_search_never_returns_a_layout_the_checker_rejects(keys):
    cfg, _ = load_spec(EXAMPLES[0].parent / "tiny.par")
    cfg = _auto(cfg, "dp", *keys)
    res = search(cfg, top=5)
    for i in range(min(len(res.candidates), 8)):
        assert not _errors(res.config(i))
        assert res.candidates[i].fits


def test_compile_with_auto_uses_the_best_and_says_so(capsys):
    src = (EXAMPLES[0].parent / "llama3_8b_2x8_h100.par").read_text()
    import re
    src = re.sub(r"\n\s*tp\s*=\s*\d+", "\n    tp = auto", src, count=1)
    src = re.sub(r"\n\s*pp\s*=\s*\d+", "\n    pp = auto", src, count=1)
    plan = parcompile.compile(src)
    assert plan.search is not None
    assert plan.data["search"]["chosen"] == plan.search.best.degrees_text()
    assert plan.data["degrees"]["tp"] == plan.search.best.parallel.tp


def test_search_cli_table_and_no_fit(tmp_path, capsys):
    spec = tmp_path / "s.par"
    spec.write_text('model m from "llama3-8b" { }\ncluster c from "h100-sxm" { nodes = 1 }\n'
                    'parallel {\n    tp = auto\n    pp = auto\n    global_batch = 16\n}\n')
    assert main(["search", str(spec), "--top", "3", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "layouts enumerated" in out and "best:" in out
    spec.write_text('model m from "llama3-70b" { }\ncluster c from "h100-sxm" { nodes = 1, gpus_per_node = 1 }\n'
                    'parallel {\n    tp = auto\n    pp = auto\n    global_batch = 16\n}\n')
    assert main(["search", str(spec)]) == 1
    assert "no layout fits" in capsys.readouterr().err



def test_no_valid_layout_names_the_checkers_error_at_its_key(tmp_path):
    """Before: a fixed key no layout can meet (dp_replicate = 3 of dp 8) beside `auto` keys
    said "no layout fits: 0 valid of 6 enumerated, none fits memory" at `parallel`. Now the
    error is the checker's own for the layout written out, at its key."""
    spec = tmp_path / "s.par"
    head = 'model m from "llama3-8b" { }\ncluster c from "h100-sxm" { nodes = 1 }\n'
    spec.write_text(head + "parallel {\n    zero = 3\n    dp_replicate = 3\n    micro_batch = auto\n"
                           "    global_batch = 64\n}\n")
    with pytest.raises(parcompile.SpecError) as e:
        parcompile.search(spec)
    [d] = [d for d in e.value.diagnostics if d.severity == "error"]
    spec.write_text(head + "parallel {\n    zero = 3\n    dp_replicate = 3\n    micro_batch = 1\n"
                           "    global_batch = 64\n}\n")
    with pytest.raises(parcompile.SpecError) as ref:
        parcompile.compile(spec)
    [want] = [d for d in ref.value.diagnostics if d.severity == "error"]
    assert d.message.startswith("no layout passes the checks") and d.message.endswith(want.message)
    assert (d.span.line, d.span.column, d.help) == (want.span.line, want.span.column, want.help)


@pytest.mark.parametrize("auto", ["tp", "pp", "cp"])
def test_a_search_that_varies_dp_needs_global_batch(tmp_path, auto):
    """With dp left out, each layout's dp fills the world, so the default global batch
    (micro_batch * dp) would differ between the layouts the search ranks by step time (tp 8
    dp 2 ranked above tp 4 dp 4, which does twice the work): an error at the `auto` key, as
    for `dp = auto`. A given global_batch (or dp) makes the layouts comparable."""
    spec = tmp_path / "s.par"
    head = 'model m from "llama3-8b" { }\ncluster c from "h100-sxm" { nodes = 2 }\n'
    fixed = "tp = 8, " if auto == "cp" else ""   # llama3-8b fits 80 GB with cp only beside tp
    spec.write_text(head + f"parallel {{ {fixed}{auto} = auto }}\n")
    with pytest.raises(parcompile.SpecError) as e:
        parcompile.search(spec)
    [d] = [d for d in e.value.diagnostics if d.severity == "error"]
    assert d.message == f"{auto} = auto with dp left to fill the world needs `global_batch`"
    assert (d.span.line, d.span.column) == (3, 12 + len(fixed) + len(auto) + 3) and "global_batch = N" in d.help
    spec.write_text(head + f"parallel {{ {fixed}{auto} = auto, global_batch = 64 }}\n")
    rows = parcompile.search(spec, top=50).candidates
    assert len({r.parallel.dp for r in rows}) > 1 and {r.parallel.global_batch for r in rows} == {64}
    spec.write_text(head + f"parallel {{ {fixed}{auto} = auto, dp = 2 }}\n")
    assert parcompile.search(spec).best.parallel.dp == 2

# ------------------------------------------------------------------ the search's bounds (issue 16)
# The search costs layouts best first and skips those it proves cannot be among the best
# max(RETIME, top) or cannot fit (search.rank.rank_rows). Each bound is checked here against what
# it bounds, computed by the costing it skips, and the search against the search that
# costs every layout (search.BOUNDS off).

import parcompile.layout_search as search_module
from parcompile.layout_search import RETIME
from parcompile.layout_search.bounds import first_rank_layers
from parcompile.layout_search.rank import family_key
from parcompile.layout_search.space import check_key, layout_rows, row_parallel

_AUTO_KEYS = """    pp = auto
    virtual_stages = auto
    micro_batch = auto
    zero = auto
    recompute = auto
    schedule = auto
"""
# 30 layers: pp 4, 8 and 16 split them unevenly (Coster.choose_split)
THIRTY_AUTO = """model deep {
    layers   = 30
    hidden   = 1024
    heads    = 16
    vocab    = 32000
    seq_len  = 2048
}
cluster node from "h100-sxm" { nodes = 1 }
parallel {
    tp = auto
%s    global_batch = 32
}
""" % _AUTO_KEYS
# context and sequence parallelism, two nodes (links inside and across them)
EIGHT_B_AUTO = """model m from "llama3-8b" { }
cluster c from "h100-sxm" { nodes = 2 }
parallel {
    tp = auto
    cp = auto
    sequence_parallel = auto
%s    global_batch = 64
}
""" % _AUTO_KEYS

# dense then MoE layers (DeepSeek's; search.probe.Probe.dense_probe): 10 layers, pp 4 and 8 split unevenly
MIXED = """model moe {
    layers            = 10
    hidden            = 512
    heads             = 8
    ffn_hidden        = 2048
    vocab             = 32000
    seq_len           = 1024
    experts           = 8
    top_k             = 2
    expert_ffn_hidden = 512
    shared_experts    = 1
    dense_layers      = 2
}
cluster node from "h100-sxm" { nodes = 1 }
parallel {
    tp = auto
    ep = auto
    sequence_parallel = auto
%s    global_batch = 32
}
"""
MIXED_AUTO = MIXED % """    pp = auto
    micro_batch = auto
    recompute = auto
    schedule = auto
"""


def _figures(c) -> tuple:
    return (c.parallel, c.step_time, c.mfu, c.tflops_per_gpu, c.peak, c.capacity, c.bubble_fraction,
            tuple(sorted(c.breakdown.items())), c.simulated)


def _valid_rows(cfg, every: int = 1) -> list:
    rows, checked = [], {}
    for i, r in enumerate(layout_rows(cfg)):
        key = check_key(r) + (r[7],)   # zero: checked with offload, HSDP and LoRA
        if key not in checked:
            checked[key] = not _errors(with_parallel(cfg, row_parallel(cfg, r)))
        if checked[key] and i % every == 0:
            rows.append(r)
    return rows


@pytest.mark.parametrize("text,top,unfit", [(THIRTY_AUTO, 3, False), (EIGHT_B_AUTO, 30, True),
                                             (MIXED_AUTO, 29, False)],
                         ids=["thirty", "llama3-8b", "dense-then-moe"])
def test_bounded_search_ranks_the_best_as_costing_every_layout(text, top, unfit, monkeypatch):
    cfg, _ = load_spec(text)
    bounded = search(cfg, top=top)
    monkeypatch.setattr(search_module, "BOUNDS", False)
    full = search(cfg, top=top)
    assert bounded.bounded > 0 and (bounded.unfit > 0) == unfit   # the bounds did skip layouts
    assert full.bounded == full.unfit == 0
    assert (bounded.enumerated, bounded.valid) == (full.enumerated, full.valid)
    keep = max(RETIME, top)
    assert [_figures(c) for c in bounded.candidates[:keep]] == [_figures(c) for c in full.candidates[:keep]]
    # past those: the layouts costed, each with the figures costing every layout gives it
    everything = {_figures(c) for c in full.candidates}
    assert all(_figures(c) in everything for c in bounded.candidates[keep:])
    assert bounded.fitting <= full.fitting and bounded.probes < full.probes


@pytest.mark.parametrize("text,every,unfit", [(THIRTY_AUTO, 23, False), (EIGHT_B_AUTO, 211, True),
                                               (MIXED_AUTO, 29, False)],
                         ids=["thirty", "llama3-8b", "dense-then-moe"])
def test_each_bound_is_below_what_it_bounds(text, every, unfit):
    """Memory: the state floor and the first rank's floors are at most the peak of every
    split. Time: the row's, the family's and each split's floors are at most the step time
    of every split (closed form, and simulated for the simulated floors), the data-parallel
    floor at most the exposed data-parallel time; a bounded cost drops a layout only when
    its step time exceeds the bound."""
    cfg, _ = load_spec(text)
    coster = Coster(cfg)
    rows = _valid_rows(cfg, every)
    assert len(rows) > 15
    cap = int(cfg.cluster.memory * (1 - cfg.cluster.memory_reserve))
    fam_times: dict = {}
    for r in rows:
        rcfg = with_parallel(cfg, row_parallel(cfg, r))
        par = rcfg.parallel
        splits = coster.splits(rcfg)
        pr = coster.probe(par)
        peaks = [coster.peak(rcfg, pr, counts)[0] for counts in splits]
        assert coster.state_floor(par) <= min(peaks)
        first = first_rank_layers(splits, par.pp)
        assert coster.memory_floor(par, first) <= min(peaks)
        assert coster.memory_floor(par, first, base=True) <= min(peaks)   # from another family's probe
        closed = coster._split_floors(par, splits, False)
        sim = coster._split_floors(par, splits, True)
        span = coster.span_floor(par)
        layout = coster.layout_floor(par)   # the pipeline and what the step adds, whatever the split
        family = coster.family_layout_floor(par)   # the same from another family's probe
        assert span <= layout and family <= layout * (1 + 1e-9)
        for counts, fc, fs in zip(splits, closed, sim):
            sub = with_parallel(rcfg, par.model_copy(update={"stage_layers": counts}))
            exact = coster.cost(sub, with_memory=True)   # timed whether it fits or not
            simulated = coster.cost(sub, simulate=True, with_memory=True)
            assert span <= exact.step_time and fc <= exact.step_time and max(family, layout) <= exact.step_time
            ct3, links, tkey = coster._chunk_times3(pr, par)
            ct, _span, _parts = coster._pipeline(sub, pr, ct3, tkey, counts)
            deg = parallel_degrees(par)
            assert coster._dp_floor(sub, pr, counts, ct, links, deg) <= exact.breakdown["dp_comm"]
            assert fs <= simulated.step_time and coster._sim_floor(sub, fs) <= simulated.step_time
            fam_times.setdefault(family_key(r), []).append((r, exact.step_time))
            if exact.fits:   # a bound at its own step time keeps it, figures and all
                for b in (exact.step_time, exact.step_time * 1.01):
                    got = coster.cost(sub, bound=b)
                    assert got is not None and _figures(got) == _figures(coster.cost(sub))
        chosen = coster.cost(rcfg)
        if chosen.fits:   # the split a bound chooses is the one choosing among all gives
            got = coster.cost(rcfg, bound=chosen.step_time)
            assert got is not None and _figures(got) == _figures(chosen)
            # below it: dropped, or, when the bounds cannot tell, the same figures
            got = coster.cost(rcfg, bound=chosen.step_time * 0.999)
            assert got is None or _figures(got) == _figures(chosen)
    for fam, timed in fam_times.items():   # the family's bound, from another family's probe
        reps, groups = {}, {}
        for r, t in timed:
            dp, _tp, pp, _cp, _ep, _etp, _sp, _z, mb, gb, _sched, v, rc, _dpr = r
            reps.setdefault(pp, row_parallel(cfg, r))
            group = (pp, v, gb // (mb * dp), rc)
            groups[group] = min(t, groups.get(group, t))
        floors = coster.family_floor(reps, sorted(groups))
        assert all(floors[g] <= t for g, t in groups.items())
    if unfit is None:   # tests/test_search_finetune.py: the bounds of other specs, not which rows they sample
        return
    assert any(len(coster.splits(with_parallel(cfg, row_parallel(cfg, r)))) > 1 for r in rows) != unfit
    if unfit:   # some layouts the floors alone show do not fit
        assert any(coster.state_floor(row_parallel(cfg, r)) > cap for r in rows)
        assert any(coster.memory_floor(c.parallel, first_rank_layers(coster.splits(c), c.parallel.pp), base=True)
                   > cap >= coster.state_floor(c.parallel)
                   for c in (with_parallel(cfg, row_parallel(cfg, r)) for r in rows))


def test_probe_parameters_depend_on_tp_only():
    """The state floor and the caches share one probe's parameters among the probes of
    one tp (cp, sequence parallelism and the micro-batch do not shard parameters)."""
    cfg, _ = load_spec(EIGHT_B_AUTO)
    coster = Coster(cfg)
    for tp in (1, 2, 8):
        params = [coster.probe_of((tp, cp, sp, mb, 1, tp)).params
                  for cp in (1, 2, 4) for sp in ({False, tp > 1}) for mb in (1, 2)]
        assert all(p == params[0] for p in params)


def test_step_entries_are_the_comm_reports_step_rows():
    """The search costs a layout's step collectives from `insert_collectives.step_entries`
    (no graph): the same rows, bytes and counts the communication report reads from the
    compiled graph's `step_collective` ops (that report merges equal rows, summing their
    counts)."""
    from collections import Counter

    from parcompile.passes.insert_collectives import step_entries

    plan = parcompile.compile(
        'model m from "llama3-8b" { }\ncluster c from "h100-sxm" { nodes = 1 }\n'
        "parallel {\n tp = 2\n pp = 2\n dp = 2\n zero = 2\n global_batch = 16\n}\n")
    rows = step_entries(plan.config, plan.degrees, plan.passes.collectives.stage_params)

    def weighted(entries):
        c = Counter()
        for e in entries:
            c[(e["op"], e["axis"], e["bytes"], e["where"], e["stage"], e["phase"])] += e["count"]
        return c

    graph_rows = [e for e in plan.data["comm"]["collectives"] if e["phase"] == "step"]
    assert len(rows) >= 4 and {r.phase for r in rows} == {"step"}
    assert weighted(r.to_dict() for r in rows) == weighted(graph_rows)


def test_split_text_one_run_length_form_for_the_note_and_the_layout_line():
    """An uneven split prints as runs: in the note's words and, compact, in the one-line
    layout (`Candidate.degrees_text`), both from `split_text`."""
    from parcompile.config.schema import ParallelConfig
    from parcompile.layout_search import Candidate, split_text

    meta = (7,) + (8,) * 14 + (7,)
    assert split_text(meta) == "7, 8 (14 chunks), 7"
    assert split_text(meta, compact=True) == "7/8x14/7"
    assert split_text((2, 2, 2, 1), compact=True) == "2/2/2/1"   # runs of three or fewer stay written out
    par = ParallelConfig(tp=8, pp=16, dp=128, global_batch=2048, stage_layers=meta)
    text = Candidate(par, 1.0, 0.5, 100.0, 1, 2, 0.1, {}).degrees_text()
    assert text.split()[-1] == "split=7/8x14/7"


def test_memory_floor_line_through_micro_batches_1_and_2_is_a_lower_bound():
    """`Coster.memory_floor` with ``base`` bounds a layout of micro-batch ``b > 1`` from the
    probes at micro-batch 1 and 2 (of ``cp0 = min(cp, 2)``), along the line through them.

    The two facts it rests on, on the probes of every micro-batch: the bytes one micro-batch
    saves (``saved_bytes``, per chunk and for the output layer) are exactly that line, and
    the buffers (``buffer_bytes``, maxima of such byte counts) are at least it. Then the
    bound against the exact peak (the analysis's own memory functions: the probe's
    composition, itself pinned to the whole graph by
    `test_fast_cost_equals_the_compilers`, and the whole graph's for a few layouts) of
    every 37th valid layout of micro-batch > 1: at most the peak, and equal to it (within
    rounding) for some, so a bound inflated by even 1% would fail here."""
    from parcompile.layout_search.space import RowLayout

    cfg, _ = load_spec(EIGHT_B_AUTO)
    coster = Coster(cfg)
    for tp, cp, sp in ((1, 1, False), (2, 2, False), (8, 2, True)):
        for rc in ("none", "selective", "full"):
            p1, p2 = (coster.probe_of((tp, cp, sp, b, 1, tp)) for b in (1, 2))
            for b in (3, 4, 8):
                pb = coster.probe_of((tp, cp, sp, b, 1, tp))
                for field in ("per_chunk", "output_layer"):
                    one, two, got = (getattr(p.saved[rc], field) for p in (p1, p2, pb))
                    assert got == tuple(x + (b - 1) * (y - x) for x, y in zip(one, two))
                for pp in (1, 4):
                    one, two, got = (coster._buffer_sums(p, rc, pp) for p in (p1, p2, pb))
                    assert all(g >= x + (b - 1) * (y - x) for x, y, g in zip(one, two, got))
    rows = [r for r in _valid_rows(cfg) if r[8] > 1][::37]
    assert len(rows) > 100 and {r[8] for r in rows} >= {2, 4, 8, 16} and max(r[3] for r in rows) >= 4
    ratios = []
    weak = Coster(cfg)   # builds no micro-batch 2 probe: micro-batch 1's bytes stand for all
    for r in rows:
        rcfg = with_parallel(cfg, row_parallel(cfg, r))
        par = rcfg.parallel
        splits = coster.splits(rcfg)
        peak = min(coster.peak(rcfg, coster.probe(par), counts)[0] for counts in splits)
        first = first_rank_layers(splits, par.pp)
        bound = coster.memory_floor(par, first, base=True)
        assert bound == coster.memory_floor(RowLayout._make(r), first, base=True)   # the search's reading
        assert bound <= peak
        # the line is no weaker than micro-batch 1's bytes alone (no micro-batch 2 probe used)
        assert weak.memory_floor(par, first, base=True, build=False) <= bound
        ratios.append((bound / peak, r))
    assert max(x for x, _ in ratios) > 0.99
    # the whole graph's peak (no probe) for the tightest few and a context-parallel one
    whole = 0
    for _x, r in sorted(ratios)[-3:] + [next(x for x in ratios if x[1][3] >= 4)]:
        rcfg = with_parallel(cfg, row_parallel(cfg, r))
        if len(coster.splits(rcfg)) == 1:
            par = rcfg.parallel
            bound = coster.memory_floor(par, first_rank_layers(coster.splits(rcfg), par.pp), base=True)
            assert bound <= cost_without_schedule(rcfg).memory.peak
            whole += 1
    assert whole >= 2


def test_family_work_line_through_micro_batches_1_and_2_is_the_scaled_probes_own():
    """`Coster._base_work` gives the scaled probe's forward and backward seconds of a
    micro-batch above 2 by the line through micro-batches 1 and 2 (every term affine in
    the scale): pinned to timing that micro-batch's scaled probe itself (``direct_works``),
    for every 7th valid layout and each recompute mode, within rounding, and exactly at
    micro-batches 1 and 2."""
    cfg, _ = load_spec(EIGHT_B_AUTO)
    line, direct = Coster(cfg), Coster(cfg)
    direct.direct_works = True
    rows = _valid_rows(cfg, 7)
    assert {r[8] for r in rows} >= {1, 2, 4, 8, 16} and {r[3] for r in rows} >= {1, 2, 4}
    extrapolated = 0
    for r in rows:
        par = row_parallel(cfg, r)
        for rc in ("none", "selective", "full"):
            got, want = line._family_work(par, rc), direct._family_work(par, rc)
            assert got[2] == want[2]   # the transfer: timed, not extrapolated
            if par.micro_batch <= 2:
                assert got[:2] == want[:2]
            else:
                extrapolated += 1
                assert got[:2] == pytest.approx(want[:2], rel=1e-12, abs=0)
                assert got[:2] != pytest.approx((want[0] * 1.001, want[1]), rel=1e-6, abs=0)
    assert extrapolated > 100
    # and only the micro-batch 1 and 2 scaled probes were timed (but for their transfers)
    timed = {k[3] for k in line.scaled_comms if not k[4]}
    assert timed == {1, 2} < {k[3] for k in direct.scaled_comms if not k[4]}


# ------------------------------------------------------------------ sequence parallelism (issue 29)
_SP_SPEC = """model deep {
    layers   = 4
    hidden   = 1024
    heads    = 16
    vocab    = 32000
    seq_len  = 2048
}
cluster node from "h100-sxm" { nodes = 1 }
parallel {
    tp = %s
%s    global_batch = 32
}
"""


def test_search_tries_sequence_parallelism_when_the_spec_leaves_it_unset():
    """Unset, `sequence_parallel` is searched (both where tp > 1, never at tp = 1) and each
    candidate says which it took; written, it is kept."""
    res = search(load_spec(_SP_SPEC % ("auto", ""))[0], top=1000)
    seen = {(c.parallel.tp > 1, c.parallel.sequence_parallel) for c in res.candidates}
    assert seen == {(False, False), (True, False), (True, True)}
    for c in res.candidates:
        words = c.degrees_text().split()
        assert ("sp" in words) == c.parallel.sequence_parallel
        assert ("no-sp" in words) == (c.parallel.tp > 1 and not c.parallel.sequence_parallel)
    for written in (False, True):
        res = search(load_spec(_SP_SPEC % ("auto", f"    sequence_parallel = {str(written).lower()}\n"))[0],
                     top=1000)
        assert {c.parallel.sequence_parallel for c in res.candidates if c.parallel.tp > 1} == {written}
    # a serve spec keeps the default: sequence parallelism is a training layout
    from parcompile.layout_search import searches_sequence_parallel

    serve = next(p for p in EXAMPLES if "serve" in p.stem)
    assert not searches_sequence_parallel(load_spec(serve)[0])


def test_compile_keeps_sequence_parallel_false_by_default():
    """SPEC: `sequence_parallel` defaults to false for a spec compiled without a search."""
    plan = parcompile.compile(_SP_SPEC % ("4", ""))
    assert plan.data["degrees"]["tp"] == 4
    assert plan.config.parallel.sequence_parallel is False
    sp = parcompile.compile(_SP_SPEC % ("4", "    sequence_parallel = true\n"))
    assert sp.config.parallel.sequence_parallel is True
