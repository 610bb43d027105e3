"""`auto` and `parcompile search` (issue 9): candidates are valid, fit, and are costed
exactly as the compiler costs them."""

from __future__ import annotations

import itertools
import pathlib

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import parcompile
from parcompile.analysis.calibration import cost_without_schedule
from parcompile.cli import main
from parcompile.driver import compile_config
from parcompile.frontend import load_spec
from parcompile.search import Coster, check_layout, search, with_parallel

EXAMPLES = sorted(pathlib.Path(__file__).parent.parent.glob("examples/*.par"))
TRAIN = [p for p in EXAMPLES if "serve" not in p.stem]
# DeepSeek-style MoE (leading dense_layers) has layers of two kinds, which the one-layer
# probe does not describe: search costs such specs from their whole graph instead
# (Coster.unlike_layers), so the probe's exactness is tested on the others
PROBED = [p for p in TRAIN if "deepseek" not in p.stem]


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
    res = search(cfg, top=3)
    best = res.best.parallel
    assert (best.tp, best.pp) == (8, 8)   # Megatron-LM's choice: tp fills a node, pp across
    assert cfg.cluster.gpus_per_node == 8   # tp = 8 fills a node; pp crosses them


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
