"""Issue 16, second item: layers that do not divide into ``pp * virtual_stages`` model chunks.

The compiler splits them itself (``parcompile.layout_search.settle_split``): among the candidate
splits (``candidate_splits``), the smallest estimated step time, ties within 1% broken by
the smaller memory peak, and says so in a ``note:`` at ``pp``; ``stage_layers`` overrides it.
Expected splits here come from outside the code under test: the Llama 3 paper's split of
Llama 3.1 405B, and the compiler's own figures of each candidate compiled explicitly.
"""

from __future__ import annotations

import pytest

import parcompile
from parcompile.config.text import even_split
from parcompile.frontend import load_spec
from parcompile.passes.split_pipeline_stages import candidate_splits
from parcompile.layout_search import search
from tests.verify_batch import result_of, verify_fixture

LLAMA_405B = """
model m from "llama3.1-405b" { seq_len = 8192 }
cluster c from "h100-sxm" { nodes = 2048 }
parallel {
    tp = 8
    pp = 16
    dp = auto
    global_batch = 2048
}
train { optimizer = adamw }
"""

THIRTY = """
model deep {
    layers   = 30
    hidden   = 4096
    heads    = 32
    vocab    = 32000
    seq_len  = 4096
}
cluster node from "h100-sxm" { nodes = 1 }
parallel {
    tp = 2
    pp = 4
    global_batch = 64
}
"""


def _layers_per_stage(plan) -> list[int]:
    return [len(c) for s in plan.data["stages"] for c in s["chunks"]]


def _notes(plan):
    return [d for d in plan.warnings if d.severity == "note"]


@pytest.mark.parametrize("layers,chunks", [(126, 16), (30, 4), (7, 4), (5, 2), (81, 8), (9, 8), (100, 3)])
def test_candidate_splits_are_splits(layers, chunks):
    cands = candidate_splits(layers, chunks)
    assert cands[0] == tuple(even_split(layers, chunks))
    assert len(set(cands)) == len(cands)
    for c in cands:
        assert len(c) == chunks and sum(c) == layers and min(c) >= 1, c   # no layer-less end chunk here


def test_candidate_splits_hold_metas_405b_split():
    # Llama 3 paper, section 3.3.2: 126 layers on 16 stages, one layer fewer on the first and last
    assert (7,) + (8,) * 14 + (7,) in candidate_splits(126, 16)
    # fewer layers than chunks: only with a layer-less first or last chunk (Megatron-Core's
    # accounted splits, tests/test_search_end_chunks.py), none when the middle ones cannot be filled
    assert candidate_splits(2, 5) == []


def test_405b_tp8_pp16_plans_metas_split_with_a_note():
    """The issue's case: `layers = 126` with `pp = 16` used to be refused."""
    plan = parcompile.compile(LLAMA_405B, filename="405b.par")
    assert plan.data["degrees"]["dp"] == 128 and plan.data["degrees"]["pp"] == 16
    assert _layers_per_stage(plan) == [7] + [8] * 14 + [7]
    notes = _notes(plan)
    assert len(notes) == 1
    n = notes[0]
    lines = LLAMA_405B.splitlines()
    assert lines[n.span.line - 1].strip() == "pp = 16"
    assert "layers = 126" in n.message and "[7, 8 (14 chunks), 7]" in n.message
    assert "stage_layers" in n.help
    assert "405b.par:6:10: note:" in n.render(LLAMA_405B)


def test_default_split_follows_its_rule_over_explicit_compiles():
    """Each candidate compiled with its own `stage_layers`: the automatic split is the one
    the rule picks from those plans' own estimates (fastest; within 1% the smaller peak)."""
    auto = parcompile.compile(THIRTY)
    figures = []
    for c in candidate_splits(30, 4):
        p = parcompile.compile(THIRTY.replace("global_batch = 64", f"global_batch = 64\n stage_layers = {list(c)}"))
        assert not _notes(p)
        figures.append((p.data["estimate"]["step_time"], p.data["memory"]["peak"], c, p.data["memory"]["fits"]))
    fitting = [f for f in figures if f[3]]
    fastest = min(f[0] for f in fitting)
    want = min((f for f in fitting if f[0] <= fastest * 1.01), key=lambda f: f[1])
    assert tuple(_layers_per_stage(auto)) == want[2]
    assert auto.data["estimate"]["step_time"] == pytest.approx(want[0], rel=1e-12)
    assert auto.data["memory"]["peak"] == want[1]
    # the first stage of 1F1B holds the most micro-batches in flight: not the fuller one
    assert want[2][0] < max(want[2])


def test_stage_layers_overrides_and_even_layouts_have_no_note():
    given = parcompile.compile(THIRTY.replace("global_batch = 64", "global_batch = 64\n stage_layers = [9, 7, 7, 7]"))
    assert _layers_per_stage(given) == [9, 7, 7, 7] and not _notes(given)
    even = parcompile.compile(THIRTY.replace("layers   = 30", "layers   = 32"))
    assert _layers_per_stage(even) == [8, 8, 8, 8] and not _notes(even)


def test_check_accepts_an_uneven_layout_and_refuses_too_few_layers():
    cfg, warnings = load_spec(THIRTY)
    assert not [d for d in warnings if d.severity == "error"]
    with pytest.raises(parcompile.SpecError) as e:
        parcompile.compile(THIRTY.replace("layers   = 30", "layers   = 3"))
    assert "layers = 3 cannot fill pp(4) * virtual_stages(1) = 4 model chunks" in str(e.value.diagnostics[0].message)


def test_search_considers_uneven_splits_and_costs_them_as_the_compiler_does():
    """pp = 4 does not divide 30 layers: the search still ranks it, with a split, and the
    candidate's figures are those of compiling it."""
    cfg, _ = load_spec(THIRTY.replace("pp = 4", "pp = auto\n    dp = auto\n    zero = auto"))
    res = search(cfg, top=50)
    uneven = [c for c in res.candidates if c.parallel.pp == 4]
    assert uneven, [c.degrees_text() for c in res.candidates]
    c = uneven[0]
    assert sum(c.parallel.stage_layers) == 30 and len(set(c.parallel.stage_layers)) > 1
    assert "split=" in c.degrees_text()
    src = THIRTY.replace("global_batch = 64", f"global_batch = 64\n zero = {c.parallel.zero}\n "
                         f"stage_layers = {list(c.parallel.stage_layers)}")
    src = src.replace("tp = 2", f"tp = {c.parallel.tp}\n    dp = {c.parallel.dp}\n micro_batch = {c.parallel.micro_batch}"
                      f"\n recompute = {c.parallel.recompute}\n schedule = {c.parallel.schedule}"
                      f"\n sequence_parallel = {str(c.parallel.sequence_parallel).lower()}")
    plan = parcompile.compile(src)
    assert plan.data["memory"]["peak"] == c.peak
    if c.simulated:
        assert plan.data["estimate"]["step_time"] == pytest.approx(c.step_time, rel=1e-9)


SEVEN_LAYERS = """
model tiny {
    layers = 7, hidden = 64, heads = 4, kv_heads = 2, ffn_hidden = 128, vocab = 256
    seq_len = 16, dtype = fp32
}
cluster local from "cpu" { nodes = 1, gpus_per_node = 4 }
parallel {
    dp = 1, tp = 2, pp = 2
    virtual_stages = 2
    schedule = interleaved_1f1b
    micro_batch = 1
    global_batch = 4
}
train { optimizer = adamw, steps = 3, lr = 1e-2 }
"""


def _build(test: str, case: str) -> tuple:
    assert case == "7_layers_pp2_v2"
    return parcompile.compile(SEVEN_LAYERS).config, "fp32"


verified = verify_fixture(__name__, _build)   # one launch with the other verify cases of 4 ranks


@pytest.mark.torchrun
@pytest.mark.parametrize("case", ["7_layers_pp2_v2"])
def test_verify_passes_with_an_automatic_uneven_split(case, verified, request):
    """The issue's case: 7 layers, pp 2, virtual stages 2 (4 model chunks), no stage_layers."""
    plan = parcompile.compile(SEVEN_LAYERS)
    split = plan.config.parallel.stage_layers          # model order
    assert sum(split) == 7 and len(split) == 4 and len(_notes(plan)) == 1
    result = result_of(verified, request, case)
    print(result.table())
    assert result.ok, result.table()
    assert result.mini.model.layers == 7   # 1 layer for the smallest chunk, 2 for the others
    assert result.mini.parallel.stage_layers == tuple(1 if x == min(split) else 2 for x in split)


def test_80_layers_on_16_ranks_with_2_virtual_stages_plan_with_a_split():
    """Once refused (tests/errors/layers_80_pp_16_vs_2): 5 layers per rank do not make two
    equal chunks; the compiler cuts 32 chunks of 2 or 3 layers."""
    src = """
model llama from "llama2-70b" { seq_len = 4096 }
cluster pod from "h100-sxm" { nodes = 16 }
parallel {
    tp = 8
    pp = 16
    schedule       = interleaved_1f1b
    virtual_stages = 2
    global_batch   = 1024
}
"""
    plan = parcompile.compile(src)
    chunks = [len(c) for s in plan.data["stages"] for c in s["chunks"]]
    model_order = [0] * 32
    for s in plan.data["stages"]:
        for c, layers in enumerate(s["chunks"]):
            model_order[c * 16 + s["index"]] = len(layers)
    assert sum(chunks) == 80 and min(chunks) >= 1
    assert tuple(model_order) in candidate_splits(80, 32)
    assert len(_notes(plan)) == 1 and "pp(16) * virtual_stages(2) = 32" in _notes(plan)[0].message


# -- issue 29: layer-less end chunks (Llama 3 paper section 3.3.2) ---------------------------


def test_metas_405b_layout_with_layer_less_end_chunks_fits():
    """examples/llama3_405b_meta_16k_h100.par: Llama 3 paper Table 4 (tp 8, pp 16, dp 128 on
    16,384 H100 80GB, seq 8192, sequence parallel, interleaved 1F1B, no recomputation) with
    section 3.3.2's zero = 2 and its 128 one-layer chunk slots, an embedding-only first
    chunk and an output-only last one. The layout ran on 80 GB GPUs, so it must plan as
    fitting with the default memory_reserve."""
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / "llama3_405b_meta_16k_h100.par"
    plan = parcompile.compile(path.read_text(), filename=str(path))
    cfg = plan.config
    assert "memory_reserve" not in path.read_text()          # the default reserve
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.cp) == (8, 16, 128, 1)
    assert cfg.parallel.zero == 2 and cfg.parallel.recompute == "none" and cfg.parallel.sequence_parallel
    per_stage = [[len(c) for c in s["chunks"]] for s in plan.data["stages"]]
    model_order = [per_stage[k % 16][k // 16] for k in range(128)]
    assert model_order == [0] + [1] * 126 + [0], per_stage
    mem = plan.data["memory"]
    usable = cfg.cluster.memory * (1 - cfg.cluster.memory_reserve)
    assert mem["fits"] and 0 < mem["peak"] <= usable
    assert max(s["total"] for s in mem["per_stage"]) == mem["peak"]
    assert not [d for d in plan.warnings if d.severity == "warning" and "memory" in d.message.lower()]


def test_the_all_auto_405b_search_ranks_first_a_layout_at_least_as_fast_as_metas():
    """Issue 29: the all-auto search for Llama 3.1 405B on 16,384 H100s (seq 8192, global
    batch 2048) ranks first a fitting layout whose estimated step time is at most that of
    Meta's own layout (the example above, costed by the same estimate)."""
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / "llama3_405b_meta_16k_h100.par"
    meta = parcompile.compile(path.read_text(), filename=str(path))
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_search", path.parents[1] / "benchmarks" / "search.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)   # the benchmark's all-auto spec: one copy of it
    auto = bench.AUTO
    cfg, _ = load_spec(auto)
    best = search(cfg, top=1).best
    assert meta.data["memory"]["fits"] and best.fits
    assert best.step_time <= meta.data["estimate"]["step_time"], (best.degrees_text(), best.step_time)
