"""FP8 training, the plan side (issue 32): `train.precision = fp8`, `fp8_recipe` and
`fp8_all_gather` are parsed, checked against the cluster preset, planned (estimate.assumptions.fp8),
searched and exported; `compile`, `run` and `verify` refuse them at the `precision` key until the
generated program runs FP8 (the cost model's FP8 rows are in tests/test_cost_model.py)."""

from __future__ import annotations

import json
import re

import pytest

import parcompile
from parcompile.cli import main
from parcompile.config.presets import CLUSTER_PRESETS, fp8_peak, fp8_presets
from parcompile.diagnostics import SpecError

SPEC = """model llama from "llama3-8b" {{ layers = 4 }}
cluster gpus from "{cluster}" {{ nodes = 1 }}
parallel {{ tp = 4, dp = 2, zero = {zero}, micro_batch = 1, global_batch = 8 }}
train {{
  steps = 2
{train}}}
"""


def _spec(tmp_path, train="  precision = fp8\n", cluster="h100-sxm", zero=1, name="f.par"):
    path = tmp_path / name
    path.write_text(SPEC.format(cluster=cluster, zero=zero, train=train))
    return path


def _diags(path) -> list:
    try:
        plan = parcompile.compile(path.read_text(), filename=path.name)
    except SpecError as e:
        return e.diagnostics
    return plan.warnings


def _position(path, key: str) -> str:
    """``file:line:col`` of the value of ``key`` in ``path`` (1-based, as diagnostics print it)."""
    for i, line in enumerate(path.read_text().splitlines(), 1):
        m = re.search(rf"\b{key}\s*=\s*", line)
        if m:
            return f"{path.name}:{i}:{m.end() + 1}"
    raise AssertionError(key)


def test_fp8_spec_checks_and_plans_with_its_assumptions(tmp_path, monkeypatch, capsys):
    path = _spec(tmp_path, "  precision = fp8\n  fp8_recipe = rowwise\n")
    monkeypatch.chdir(tmp_path)
    assert main(["check", path.name]) == 0
    capsys.readouterr()
    assert main(["plan", path.name, "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)["estimate"]["assumptions"]["fp8"]
    assert got["recipe"] == "rowwise" and got["fp8_peak"] == CLUSTER_PRESETS["h100-sxm"].fp8_flops
    assert "LM head" in got["bf16_gemms"] and "router" in got["bf16_gemms"]
    assert got["tp_all_gathers"] == "16-bit" and got["fp8_all_gather"] is False
    # a 16-bit plan says nothing of FP8
    plain = parcompile.compile(_spec(tmp_path, "", name="g.par").read_text(), filename="g.par")
    assert "fp8" not in plain.data["estimate"]["assumptions"]


def test_fp8_plans_faster_than_the_same_spec_in_bf16(tmp_path):
    fp8 = parcompile.compile(_spec(tmp_path).read_text(), filename="f.par")
    bf16 = parcompile.compile(_spec(tmp_path, "", name="g.par").read_text(), filename="g.par")
    assert fp8.data["estimate"]["step_time"] < bf16.data["estimate"]["step_time"]
    # the same parameters, optimizer states and master weights
    for key in ("params", "grads", "optimizer"):
        assert fp8.data["memory"]["per_stage"][0][key] == bf16.data["memory"]["per_stage"][0][key]
    # Megatron-Core / Transformer Engine keeps FP8 copies of the layer weights (2 bytes each)
    assert fp8.data["memory"]["per_stage"][0]["buffer_parts"]["fp8_weights"] > 0


@pytest.mark.parametrize("command", ["compile", "run", "verify"])
def test_compile_run_and_verify_refuse_fp8_at_the_precision_key(command, tmp_path, monkeypatch, capsys):
    path = _spec(tmp_path)
    monkeypatch.chdir(tmp_path)
    rc = main([command, path.name, "-o", "out"] if command != "verify" else [command, path.name])
    err = capsys.readouterr().err
    assert rc != 0
    assert f"{_position(path, 'precision')}: error: the generated program does not run FP8 training" in err
    assert "FP8 programs are not generated yet" in err
    assert all(c in err for c in ("`parcompile plan`", "`search`", "`check`"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "build").exists()


def test_the_api_writes_no_program_for_fp8(tmp_path):
    plan = parcompile.compile(_spec(tmp_path).read_text(), filename="f.par")
    with pytest.raises(SpecError) as e:
        plan.write(tmp_path / "out")
    assert "FP8 programs are not generated yet" in e.value.diagnostics[0].help
    assert not (tmp_path / "out").exists()
    assert plan.to_json()   # plan.json itself is there (`parcompile plan --format json`)


def test_presets_without_fp8_refuse_it_naming_those_that_have_it(tmp_path):
    path = _spec(tmp_path, cluster="ascend-910b")
    [d] = [d for d in _diags(path) if d.severity == "error"]
    assert d.message.startswith("precision = fp8 needs FP8 tensor cores: cluster preset `ascend-910b`")
    assert (d.span.line, d.span.column) == tuple(int(x) for x in _position(path, "precision").split(":")[1:])
    have = fp8_presets("tensorwise")
    assert set(have) == {n for n, p in CLUSTER_PRESETS.items() if p.fp8_flops} and "h100-sxm" in have
    assert all(f"`{n}`" in d.help for n in have) and "a100-80gb" not in d.help
    # mxfp8: only the presets with an MXFP8 peak (Blackwell)
    path = _spec(tmp_path, "  precision = fp8\n  fp8_recipe = mxfp8\n", name="m.par")
    [d] = [d for d in _diags(path) if d.severity == "error"]
    assert "fp8_recipe = mxfp8 needs MXFP8" in d.message and "`b200`" in d.help and "`h100-sxm`" not in d.help
    assert fp8_peak("b200", "mxfp8") == CLUSTER_PRESETS["b200"].mxfp8_flops
    assert not [d for d in _diags(_spec(tmp_path, "  precision = fp8\n  fp8_recipe = mxfp8\n", cluster="b200",
                                        name="b.par")) if d.severity == "error"]


def test_a_cluster_without_a_preset_refuses_fp8(tmp_path):
    src = _spec(tmp_path).read_text().replace('cluster gpus from "h100-sxm" { nodes = 1 }',
                                             "cluster gpus {\n  nodes = 1\n  gpus_per_node = 8\n  memory = 80 GiB\n"
                                             "  peak_flops = 989 TFLOPS\n  hbm_bw = 3.35 TB/s\n"
                                             "  intra_node_bw = 450 GB/s\n  inter_node_bw = 400 Gb/s\n}")
    path = tmp_path / "n.par"
    path.write_text(src)
    errors = [d for d in _diags(path) if d.severity == "error"]
    assert [d.message for d in errors] == [
        "precision = fp8 needs FP8 tensor cores: a cluster without a preset has no FP8 GEMM peak"]


def test_fp8_keys_without_fp8_and_fp8_all_gather_rules(tmp_path):
    warn = _diags(_spec(tmp_path, "  fp8_recipe = rowwise\n"))
    assert [d.message for d in warn] == ["fp8_recipe has no effect with precision = model"]
    warn = _diags(_spec(tmp_path, "  precision = fp8\n  fp8_all_gather = true\n", name="z.par"))
    assert [d.message for d in warn if d.severity == "warning"] == [
        "fp8_all_gather has no effect with zero = 1: only ZeRO-3 all-gathers parameters"]
    err = _diags(_spec(tmp_path, "  precision = fp8\n  fp8_recipe = rowwise\n  fp8_all_gather = true\n", zero=3,
                       name="r.par"))
    assert [d.message for d in err if d.severity == "error"] == [
        "fp8_all_gather = true needs fp8_recipe = tensorwise or mxfp8"]
    err = _diags(_spec(tmp_path, "  precision = fp4\n", name="u.par"))
    assert [d.message for d in err] == ["unknown precision `fp4`"] and "`fp8`" in err[0].help
    ok = _diags(_spec(tmp_path, "  precision = fp8\n  fp8_all_gather = true\n", zero=3, name="ok.par"))
    assert not ok


def test_search_plans_fp8_specs(tmp_path):
    text = _spec(tmp_path).read_text().replace("tp = 4, dp = 2", "tp = auto, dp = auto")
    plan = parcompile.compile(text, filename="s.par")
    assert plan.data["estimate"]["assumptions"]["fp8"]["recipe"] == "tensorwise"
