"""Error goldens: one wrong spec per rule of issue 3, with the full text `parcompile check` prints.

Each ``tests/errors/NAME.par`` is a configuration someone really ran; ``NAME.txt`` beside it
is everything `parcompile check NAME.par` writes to stderr (run from ``tests/errors/``, so
file names stay short). A missing ``.txt`` fails; after an intended change of wording,
`python -m pytest tests/test_errors.py --update-goldens` rewrites them, and the diff is
reviewed like code: the goldens are what a new user reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import parcompile
from parcompile.cli import main

ERRORS = Path(__file__).resolve().parent / "errors"
SPECS = sorted(ERRORS.glob("*.par"))

#: The rules of issue 3, each with the golden that pins it.
RULES = {
    "heads_52_tp_3": "52 heads with tp = 3 (valid: 1, 2, 4, 13, 26, 52)",
    "kv_heads_4_tp_8": "28 heads, 4 kv heads with tp = 8",
    "kv_heads_4_tp_7": "28 heads, 4 kv heads with tp = 7 (heads fine, kv heads not)",
    "interleaved_pp_6_m_3": "interleaved_1f1b with pp = 6 and 3 micro-batches",
    "interleaved_group_1_below_pp_2": "microbatch_group_size = 1 with pp = 2 (Megatron-Core runs pp to m)",
    "world_size_8_on_4_gpus": "dp = 2, tp = 2, pp = 2 on 4 GPUs",
    "global_batch_256_micro_2_dp_7": "global_batch = 256, micro_batch = 2, dp = 7",
    "experts_ep_8_on_4_gpus": "16 experts on 4 GPUs, tp = 4, ep = 8, expert_tp = 1",
    "experts_256_ep_3": "256 experts with ep = 3",
    "sequence_parallel_tp_1": "sequence_parallel = true with tp = 1",
    "sequence_parallel_seq_len": "seq_len not divisible by tp with sequence parallelism",
    "context_parallel_seq_len": "seq_len not divisible by 2 * cp",
    "kv_heads_8_tp_16_train": "kv_heads = 8, tp = 16 rejected for training",
    "serve_kv_heads_8_tp_12": "serving: tp neither a divisor nor a multiple of kv_heads",
    "bucket_size_megatron_elements": "bucket_size given in elements, as Megatron-LM's --ddp-bucket-size",
    "vocab_250_with_text_data": "a vocabulary below 256 with text read as bytes",
}

#: Words each golden must contain: the numbers of the rule and what would work.
MUST_SAY = {
    "interleaved_group_1_below_pp_2": ["microbatch_group_size = 1", "pp = 2", "m = 5", "3 or 5"],
    "heads_52_tp_3": ["heads = 52", "1, 2, 4, 13, 26 or 52"],
    "kv_heads_4_tp_8": ["heads = 28", "kv_heads = 4", "tp = 8"],
    "kv_heads_4_tp_7": ["tp = 7 does not divide kv_heads = 4", "1, 2 or 4"],
    "interleaved_pp_6_m_3": ["pp = 6", "m = 3", "global_batch may be 6"],
    "world_size_8_on_4_gpus": ["= 8 != world_size(4)", "dp = 1"],
    "global_batch_256_micro_2_dp_7": ["global_batch = 256", "micro_batch(2) * dp(7) = 14", "252 or 266"],
    "experts_ep_8_on_4_gpus": ["expert_tp(1) * ep(8) = 8", "tp(4) * cp(1) * dp(1) = 4", "ep may be 1, 2 or 4"],
    "experts_256_ep_3": ["ep = 3 does not divide experts = 256", "ep may be"],
    "sequence_parallel_tp_1": ["sequence_parallel needs tp > 1"],
    "vocab_250_with_text_data": ['data = "builtin:pydoc"', "vocab >= 256", "vocab = 250", 'data = "synthetic"'],
    "sequence_parallel_seq_len": ["tp = 8", "seq_len = 4100", "4096 or 4104"],
    "context_parallel_seq_len": ["seq_len = 6100", "2 * cp = 16", "6096 or 6112"],
    "kv_heads_8_tp_16_train": ["tp = 16 does not divide kv_heads = 8", "1, 2, 4 or 8", "serving may"],
    "serve_kv_heads_8_tp_12": ["tp = 12 neither divides nor is a multiple of kv_heads = 8", "16, 24 or 48"],
    "bucket_size_megatron_elements": ["bucket_size takes a memory size", "40000000 fp32 elements write `160 MB`", "count elements"],
}


def check_stderr(name: str, capsys, monkeypatch) -> str:
    """What `parcompile check NAME.par` prints to stderr; asserts it fails with exit status 1."""
    monkeypatch.chdir(ERRORS)
    capsys.readouterr()
    status = main(["check", f"{name}.par"])
    out = capsys.readouterr()
    assert status == 1, f"{name}.par was accepted:\n{out.out}"
    assert out.out == ""
    return out.err


def test_every_rule_has_a_golden():
    assert sorted(p.stem for p in SPECS) == sorted(RULES)


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_error_golden(spec, capsys, monkeypatch, request):
    text = check_stderr(spec.stem, capsys, monkeypatch)
    golden = spec.with_suffix(".txt")
    if request.config.getoption("--update-goldens"):
        golden.write_text(text)
    assert golden.exists(), f"tests/errors/{golden.name} is missing; run pytest --update-goldens"
    assert text == golden.read_text(), (
        f"{spec.name}: the diagnostics differ from tests/errors/{golden.name}; if intended, "
        "regenerate with pytest --update-goldens and review the diff")


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_error_golden_reads_well(spec, capsys, monkeypatch):
    """Every golden: an error at a place in the file, the source line and caret, every number
    of the rule, a help line saying what would work, and no traceback."""
    text = check_stderr(spec.stem, capsys, monkeypatch)
    first = text.splitlines()[0]
    assert first.startswith(f"{spec.name}:") and ": error: " in first
    assert "\n  help: " in text
    assert "Traceback" not in text
    for words in MUST_SAY[spec.stem]:
        assert words in text, f"{spec.name}: {words!r} missing from\n{text}"


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_errors_stop_compile_before_any_file(spec, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ERRORS)
    out = tmp_path / "out"
    assert main(["compile", spec.name, "-o", str(out)]) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_kv_heads_8_tp_16_is_accepted_for_serving_with_replication():
    """The same layout that training rejects serves: each kv head on tp / kv_heads = 2 ranks."""
    train = (ERRORS / "kv_heads_8_tp_16_train.par").read_text()
    serve = train[:train.index("train {")] + "serve {\n    batch = 4\n    prompt_len = 2048\n    max_new_tokens = 256\n}\n"
    plan = parcompile.compile(serve, filename="serve.par")
    model = json.loads(plan.to_json())["model"]
    assert (model["kv_heads"], plan.data["degrees"]["tp"]) == (8, 16)
    assert model["kv_heads_per_rank"] == 1 and model["kv_head_replicas"] == 2
    m = plan.config.model
    # one kv head per layer per rank: K and V, head_dim values each, bf16
    assert plan.data["serve"]["kv_bytes_per_token"] == m.layers * 2 * 1 * m.head_dim * 2
    assert "each kv head replicated on 2 ranks" in plan.report_md()
