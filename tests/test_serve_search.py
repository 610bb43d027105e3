"""Sizing a deployment (issue 45): `parcompile search` of a serve spec with latency targets
ranks the deployments that carry its workload, says the fewest GPUs, prints the Pareto
front, and its figures are those `parcompile plan` gives each deployment written out.
Bad targets and workloads are one-line diagnostics with the nearest feasible point."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import parcompile
from parcompile.cli import main
from parcompile.diagnostics import SpecError
from parcompile.frontend import load_spec
from parcompile.layout_search.serve import search_serve

#: issue 45's question: Llama 3.1 70B (the llama3-70b shapes), up to 16 H100s, 2,048 tokens
#: in / 512 out, 64 concurrent users, TTFT <= 1 s and TPOT <= 40 ms: the shipped example, with
#: disaggregated pools searched too (benchmarks/search.py --only serve times the same)
SIZING = (Path(__file__).resolve().parents[1] / "examples" / "llama3_70b_serve_sizing_h100.par").read_text().replace(
    "    tpot_target    = 40 ms\n", "    tpot_target    = 40 ms\n    disaggregated  = auto\n")
assert "disaggregated  = auto" in SIZING

FIGURES = ("ttft", "tpot", "tokens_per_s")


@pytest.fixture(scope="module")
def sizing(tmp_path_factory):
    path = tmp_path_factory.mktemp("sizing") / "sizing.par"
    path.write_text(SIZING)
    cfg, _ = load_spec(path)
    return path, cfg, search_serve(cfg)


def _written_out(text: str, overrides: dict) -> str:
    """``text`` with every key of ``overrides`` written in its block (replacing `auto`)."""
    lines = text.splitlines()
    for key, value in overrides.items():
        block, name = key.split(".")
        value = ("true" if value else "false") if isinstance(value, bool) else \
            ("[" + ", ".join(map(str, value)) + "]") if isinstance(value, list) else str(value)
        for i, line in enumerate(lines):
            if line.strip().startswith(f"{name} ") or line.strip().startswith(f"{name}="):
                lines[i] = f"    {name} = {value}"
                break
        else:
            at = next(i for i, line in enumerate(lines) if line.startswith(block))
            lines.insert(at + 1, f"    {name} = {value}")
    return "\n".join(lines) + "\n"


def test_best_deployment_is_the_plan_of_it_written_out(sizing, tmp_path):
    path, cfg, res = sizing
    best = res.best
    assert best is not None and best.meets
    text = _written_out(SIZING, best.overrides(cfg))
    assert not any("= auto" in line for line in text.splitlines() if not line.lstrip().startswith("#"))
    out = tmp_path / "best.par"
    out.write_text(text)
    written = parcompile.compile(out).data
    for k in FIGURES:
        assert written["serve"][k] == pytest.approx(getattr(best, k), rel=1e-12), k
    # and `parcompile plan` of the spec with `auto` plans that same deployment
    auto = parcompile.compile(path).data
    assert {k: v for k, v in auto["serve"].items()} == written["serve"]
    assert auto["search"]["chosen"] == best.text()


def test_every_kind_of_deployment_costs_what_its_plan_says(sizing):
    """The search costs a deployment without compiling it (a one-stage graph per tp degree,
    restaged; the cluster sized to the deployment): pipelined, disaggregated, quantized,
    smaller than the cluster, each against its compiled plan."""
    _path, cfg, res = sizing
    pool = res.fitting_all
    picks = [next(d for d in pool if d.pp > 1), next(d for d in pool if d.disaggregated),
             next(d for d in pool if d.weight_dtype == "int4"), next(d for d in pool if d.kv_dtype == "fp8"),
             next(d for d in pool if d.gpus < 16 and not d.disaggregated)]
    picks += random.Random(7).sample(pool, 3)
    for d in picks:
        plan = parcompile.compile(SIZING, filename="sizing.par", overrides=d.overrides(cfg)).data["serve"]
        for k in FIGURES:
            assert plan[k] == pytest.approx(getattr(d, k), rel=1e-12), (d.text(), k)


def test_ranking_fewest_gpus_and_pareto_front(sizing):
    _path, cfg, res = sizing
    ranked = res.candidates
    assert ranked and all(d.meets and d.ttft <= 1.0 and d.tpot <= 0.040 for d in ranked)
    assert [d.per_gpu for d in ranked] == sorted((d.per_gpu for d in ranked), reverse=True)
    few = res.fewest
    assert few.gpus == min(d.gpus for d in ranked)
    front = res.pareto()
    assert front
    for a in front:   # no deployment that fits beats a front point on both axes
        assert not any(b.per_gpu > a.per_gpu and b.per_user > a.per_user for b in res.fitting_all)
    # every axis the issue names is searched
    kinds = {(d.tp, d.pp > 1, d.replicas > 1, d.weight_dtype, d.kv_dtype, d.disaggregated) for d in res.fitting_all}
    assert {k[0] for k in kinds} >= {1, 2, 4, 8} and any(k[1] for k in kinds) and any(k[2] for k in kinds)
    assert {k[3] for k in kinds} == {"model", "fp8", "int4"} and {k[4] for k in kinds} == {"bf16", "fp8"}
    assert {k[5] for k in kinds} == {False, True}


def test_search_command_prints_the_ranking_the_fewest_and_the_front(sizing, capsys):
    path, _cfg, _res = sizing
    assert main(["search", str(path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "fewest GPUs that carry the load within the targets:" in out and "Pareto front" in out
    assert out.count("\n1  ") == 1 and "meets" in out


def test_targets_no_deployment_meets_name_the_nearest(tmp_path, capsys):
    spec = tmp_path / "tight.par"
    spec.write_text(SIZING.replace("tpot_target    = 40 ms", "tpot_target    = 1 ms"))
    assert main(["search", str(spec)]) == 1
    err = capsys.readouterr().err
    assert "no deployment of up to 16 GPUs meets the targets" in err and "nearest" in err
    assert "help: nearest feasible: ttft_target = " in err and "Traceback" not in err
    with pytest.raises(SpecError) as e:
        parcompile.compile(spec)
    [d] = e.value.diagnostics
    assert d.code == "does-not-fit" and d.span.line == SIZING.splitlines().index("    tpot_target    = 40 ms") + 1


@pytest.mark.parametrize("edit, words, nearest", [
    (("concurrency    = 64", "concurrency    = 0"), "concurrency must be at least 1", "use 1 or more"),
    (("prompt_len     = 2048", "prompt_len     = 8000"), "exceeds seq_len = 8192",
     "nearest feasible: max_new_tokens = 192 for this prompt"),
])
def test_bad_workloads_are_one_line_diagnostics(tmp_path, capsys, edit, words, nearest):
    spec = tmp_path / "bad.par"
    spec.write_text(SIZING.replace(*edit))
    assert main(["search", str(spec)]) == 1
    err = capsys.readouterr().err
    assert words in err and nearest in err and "Traceback" not in err


def test_open_loop_rate_above_capacity_is_an_error_with_the_capacity(tmp_path):
    src = ('model m from "llama3-8b" { seq_len = 4096 }\ncluster c from "h100-sxm" { nodes = 1, gpus_per_node = 1 }\n'
           'serve { prompt_len = 1024, max_new_tokens = 128, request_rate = 500 }\n')
    with pytest.raises(SpecError) as e:
        parcompile.compile(src, filename="r.par")
    [d] = e.value.diagnostics
    assert d.code == "overloaded" and "has no steady state" in d.message and "nearest feasible: request_rate" in d.help
    cap = float(d.message.split("at most ")[1].split(" requests/s")[0])
    ok = parcompile.compile(src.replace("= 500", f"= {cap * 0.9:.3g}"), filename="r.par").data["serve"]
    assert ok["workload"]["kind"] == "open_loop" and ok["tokens_per_s"] > 0
