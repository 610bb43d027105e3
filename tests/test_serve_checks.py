"""Hostile and mistaken serve specs (issue 45's keys): each a diagnostic at its key with a
help line, never a traceback, never a hang."""

from __future__ import annotations

import json

import pytest

import parcompile
from parcompile.cli import main
from parcompile.diagnostics import SpecError

BASE = ('model m from "{model}" {{ seq_len = 8192 }}\ncluster c from "{cluster}" {{ nodes = 1, gpus_per_node = 8 }}\n'
        "parallel {{ {parallel} }}\nserve {{\n{serve}\n}}\n")


def spec(serve: str, model: str = "llama3-70b", cluster: str = "h100-sxm", parallel: str = "tp = 8") -> str:
    return BASE.format(model=model, cluster=cluster, parallel=parallel, serve=serve)


def one_error(text: str) -> tuple[str, str, int]:
    with pytest.raises(SpecError) as e:
        parcompile.compile(text, filename="s.par")
    errors = [d for d in e.value.diagnostics if d.severity == "error"]
    assert len(errors) == 1, [d.message for d in errors]
    d = errors[0]
    assert d.help, d.message
    return d.message, d.help, d.span.line


@pytest.mark.parametrize("serve, parallel, words, line", [
    ("    concurrency = 8\n    disaggregated = true\n    prefill_replicas = 2\n    prefill_tp = 4", "tp = 4, dp = auto",
     "the prefill pool takes 8 GPUs (prefill_replicas * prefill_tp), all of the cluster's 8", 7),
    ("    concurrency = 8\n    disaggregated = true\n    prefill_replicas = 3\n    prefill_tp = 4", "tp = 4, dp = 1",
     "more than the cluster's 8", 7),
    ("    batch = auto\n    request_rate = inf", "tp = 8", "request_rate = inf sends `batch` requests at once", 5),
])
def test_workload_mistakes(serve, parallel, words, line):
    message, _help, at = one_error(spec(serve, parallel=parallel))
    assert words in message and at == line


def test_mxfp4_on_a_dense_model_and_fp8_weights_without_an_fp8_type():
    message, help, _ = one_error(spec("    concurrency = 4\n    weight_dtype = mxfp4"))
    assert "quantizes a mixture of experts' experts" in message and "fp8 or int4" in help
    message, help, _ = one_error(spec("    concurrency = 4\n    weight_dtype = fp8", cluster="ascend-910b"))
    assert "weight_dtype = fp8 needs FP8 tensors" in message and "int4" in help


def test_a_4_bit_weight_dtype_without_weights_is_refused_by_run_before_launching(tmp_path, capsys, monkeypatch):
    """`weight_dtype = int4` (or mxfp4) with no `weights`: the serve program draws random
    weights and makes only fp8 on load, so `parcompile run` started torchrun and every rank
    stopped on "weights of INT4 weight-only (AWQ) ... are not made on load", with no spec
    location. Now `check` warns at weight_dtype (a deployment may be sized before the
    download) and `run` / `serve` refuse it there (code no-weights) before anything launches."""
    from parcompile import jobs

    text = ('model m { layers = 2, hidden = 64, heads = 2, ffn_hidden = 128, vocab = 256, seq_len = 64, dtype = fp32 }\n'
            'cluster c from "cpu" { gpus_per_node = 1 }\nserve { batch = 2, prompt_len = 8, max_new_tokens = 8,\n'
            '    weight_dtype = int4 }\n')
    plan = parcompile.compile(text, filename="s.par")
    [w] = [d for d in plan.warnings if d.code == "no-weights"]
    assert (w.span.line, w.span.column) == (4, 20) and "weight_dtype = int4" in w.message and "weights" in w.help
    (tmp_path / "s.par").write_text(text)
    monkeypatch.setattr(jobs, "run", lambda *a, **k: pytest.fail("torchrun launched"))
    assert main(["run", str(tmp_path / "s.par"), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "s.par:4:20: error: weight_dtype = int4" in err, err
    fp8 = parcompile.compile(text.replace("int4", "model"), filename="s.par")
    assert not [d for d in fp8.warnings if d.code == "no-weights"]


@pytest.mark.parametrize("config, words", [
    ("{not json", "its config.json cannot be read"),
    ("[1, 2, 3]", "its config.json is not a JSON object"),
    ('{"model_type": "llama", "x": ' + "9" * 5001 + "}", "an integer of too many digits"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": "false"}}',
     "desc_act = 'false' (GPTQ act-order) is not served"),
    ('{"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 1e309]}}',
     "weight_block_size must be two positive integers"),
])
def test_a_weights_config_json_that_lies(tmp_path, config, words):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "config.json").write_text(config)
    path = tmp_path / "s.par"
    path.write_text(spec(f'    concurrency = 4\n    weights = "{tmp_path / "w"}"'))
    with pytest.raises(SpecError) as e:
        parcompile.compile(path)
    [d] = [d for d in e.value.diagnostics if d.severity == "error"]
    assert words in d.message and d.help


def test_a_huge_burst_answers_in_seconds(tmp_path, capsys):
    path = tmp_path / "burst.par"
    path.write_text(spec("    batch = 1000000000\n    prompt_len = 128\n    max_new_tokens = 128\n    request_rate = inf",
                         parallel="tp = 4, dp = 2"))
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1,000,000,000 requests at once" in out and "days" in out


def test_a_written_layout_that_misses_its_target_warns(tmp_path):
    plan = parcompile.compile(spec("    concurrency = 64\n    prompt_len = 2048\n    max_new_tokens = 128\n"
                                   "    tpot_target = 5 ms"), filename="t.par")
    [w] = [d for d in plan.warnings if d.code == "misses-target"]
    assert "exceeds tpot_target = 5 ms" in w.message and "parcompile search" in w.help
    assert plan.data["serve"]["tpot"] > 0.005


def test_the_search_keeps_what_the_spec_writes_and_what_its_checkpoint_can_be(tmp_path):
    """The prefill pool the spec writes is the one costed; a 16-bit checkpoint named as
    `weights` is served as it is or quantized to FP8 on load, never INT4 / MXFP4 (a checkpoint
    quantized so would be needed); MXFP4 only for gpt-oss; every deployment that fits holds
    its batch's whole context in its cache (its plan fits)."""
    from parcompile.frontend import load_spec
    from parcompile.layout_search.serve import search_serve

    src = spec("    concurrency = 64\n    prompt_len = 2048\n    max_new_tokens = 256\n    weight_dtype = auto\n"
               "    disaggregated = true\n    prefill_tp = 4\n    prefill_replicas = 1\n    tpot_target = 60 ms",
               parallel="tp = auto, dp = auto").replace("nodes = 1", "nodes = 2")
    (tmp_path / "a.par").write_text(src)
    res = search_serve(load_spec(tmp_path / "a.par")[0])
    assert res.fitting_all and {(d.prefill_tp, d.prefill_replicas) for d in res.fitting_all} == {(4, 1)}
    assert {d.weight_dtype for d in res.fitting_all} == {"model", "fp8", "int4"}          # no mxfp4 for Llama
    for d in res.candidates[:3]:
        plan = parcompile.compile(src, filename="a.par", overrides=d.overrides(res.cfg))
        assert plan.data["memory"]["fits"] and plan.data["serve"]["fits"]
    hf = tmp_path / "hf16"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    (tmp_path / "b.par").write_text(src.replace("    weight_dtype = auto", f'    weight_dtype = auto\n    weights = "{hf}"'))
    res = search_serve(load_spec(tmp_path / "b.par")[0])
    assert {d.weight_dtype for d in res.fitting_all} == {"model", "fp8"}
