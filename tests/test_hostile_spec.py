"""Issue 51: spec text a hostile or careless user writes, each a diagnostic (never a number
read differently, a traceback, minutes of CPU or a deleted build)."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest

import parcompile
from parcompile.cli import main
from parcompile.diagnostics import SpecError
from parcompile.frontend.parser import MAX_LIST_ITEMS, parse
from parcompile.server import base_url

TINY = (Path(__file__).resolve().parent.parent / "examples" / "tiny.par").read_text()


def _errors(text: str) -> list[str]:
    with pytest.raises(SpecError) as e:
        parcompile.compile(text, filename="h.par")
    return [f"{d.span.line}:{d.span.column}: {d.message} | {d.help}" for d in e.value.diagnostics
            if d.severity == "error"]


@pytest.mark.parametrize("digits, ascii_", [("1\u0660", "10"), ("\uff13", "3"), ("4\u0967", "41")])
def test_a_non_ascii_digit_is_not_read_as_a_number(digits, ascii_):
    # Python's int("1٠") is 10 and `\d` matches it: the spec would train 10 steps while a
    # reader sees something else; now an error that spells the number in ASCII
    errors = _errors(TINY.replace("steps     = 40", f"steps     = {digits}"))
    assert len(errors) == 1, errors
    assert "is not an ASCII digit" in errors[0] and f"write `{ascii_}`" in errors[0], errors


@pytest.mark.parametrize("value, bound", [("1e308 TB/s", "1.7e+296 TB/s"), ("1e300 PFLOPS", "1.7e+293 PFLOPS")])
def test_a_quantity_that_overflows_in_base_units_says_the_bound_in_its_unit(value, bound):
    """`host_memory_bw = 1e308 TB/s` overflows once in bytes/s: the help said "write a number
    below 1.8e308", which 1e308 already is. Now the bound is given in the unit written; a
    plain number's help is unchanged."""
    key = "host_memory_bw" if value.endswith("TB/s") else "peak_flops"
    spec = TINY.replace("    nodes         = 1", f"    nodes         = 1\n    {key} = {value}")
    [error] = _errors(spec)
    assert f"expected a finite number, got `{value}` | `{value}` overflows a float in" in error, error
    assert f"write a number below {bound}" in error, error
    [error] = _errors(TINY.replace("lr        = 3e-3", "lr        = 1e999"))
    assert error.endswith("| `1e999` overflows a float: write a number below 1.8e308"), error
    # a unit below its base unit: the literal itself overflowed (was "write a number below inf us")
    [error] = _errors(TINY.replace("    nodes         = 1", "    nodes         = 1\n    intra_node_latency = 1e999 us"))
    assert error.endswith("| `1e999 us` overflows a float: write a number below 1.8e308"), error


def test_cr_only_line_ends_are_newlines_and_columns_stay():
    # classic Mac OS line ends: was "missing `model` block" at 1:1
    plan = parcompile.compile(TINY.replace("\n", "\r"), filename="h.par")
    assert plan.config.parallel.tp == 2
    errors = _errors(TINY.replace("steps     = 40", "steps     = 4x").replace("\n", "\r"))
    line = TINY.splitlines().index("    steps     = 40") + 1
    assert errors and errors[0].startswith(f"{line}:17: expected an integer"), errors


@pytest.mark.parametrize("block, key, anchor", [
    ("train", "checkpoint_dir", "log_every = 5"),
    ("train", "hf_output", "log_every = 5"),
    ("train", "eval_data", "log_every = 5"),
    ("train", "tokenizer", "log_every = 5"),
])
def test_an_empty_path_is_an_error_not_the_spec_directory(block, key, anchor):
    # `checkpoint_dir = ""` joined to the spec's directory named that directory itself
    errors = _errors(TINY.replace(anchor, f'{anchor}\n    {key} = ""'))
    assert any(f"`{key}` is an empty path" in e for e in errors), errors


def test_empty_serve_weights_is_an_error():
    serve = (Path(__file__).resolve().parent.parent / "examples" / "tiny_serve.par").read_text()
    assert "serve {" in serve
    errors = _errors(serve.replace("serve {", 'serve {\n    weights = "  "', 1))
    assert any("`weights` is an empty path" in e for e in errors), errors


def test_serve_weights_that_name_a_file_are_an_error_not_a_directory_to_come(tmp_path):
    # the checkpoint's model.safetensors itself, a FIFO, a device: was the warning "weights
    # directory ... does not exist yet", and `serve` said "does not exist"
    def serve(weights):
        return SERVE.replace('weights        = "../build/tiny_ckpt"', f'weights = "{weights}"')

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 100)
    os.mkfifo(tmp_path / "fifo")
    for path in (tmp_path / "model.safetensors", tmp_path / "fifo", Path("/dev/zero")):
        errors = _errors(serve(path))
        assert len(errors) == 1 and f"weights `{path}` is not a directory" in errors[0], errors
    plan = parcompile.compile(serve(tmp_path / "later"), filename="h.par")   # a directory a training run will write: a warning
    assert any("does not exist yet" in d.message for d in plan.warnings)


def test_hf_output_holding_the_build_directory_is_refused_before_anything_is_written(tmp_path, capsys):
    spec = tmp_path / "t.par"
    spec.write_text(TINY.replace("log_every = 5", 'log_every = 5\n    hf_output = "out"'))
    assert main(["compile", str(spec), "-o", str(tmp_path / "out" / "build")]) == 1
    err = capsys.readouterr().err
    assert "holds the build directory" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
    # beside the build, or inside it, is fine (the run replaces only the output)
    assert main(["compile", str(spec), "-o", str(tmp_path / "build")]) == 0


def test_a_string_of_megabytes_parses_in_linear_memory():
    # the STRING terminal `"(\\.|[^"\\\n])*"` kept a group per character: 2 MB took 940 MB
    # and 7 s (15 MB in a spec: 36 s, 5.6 GB); the unrolled form needs no per-character state
    text = 'model m {\n  name = "' + "a" * 2_000_000 + '\\"b"\n}\n'
    parse("model m { }")
    tracemalloc.start()
    try:
        spec = parse(text, "h.par")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert spec.blocks[0].entries[0].value.value == "a" * 2_000_000 + '"b'
    assert peak < 40_000_000, f"{peak:,} bytes traced"


def test_a_huge_list_stops_the_parser_and_the_excerpt_is_cut(capsys, tmp_path):
    spec = tmp_path / "t.par"
    spec.write_text(TINY.replace("log_every = 5", "log_every = 5\n    xs = [" + ",".join(["1"] * 300_000) + "]"))
    assert main(["check", str(spec)]) == 1
    err = capsys.readouterr().err
    assert f"more than {MAX_LIST_ITEMS:,} items in one list" in err, err[:500]
    assert max(len(line) for line in err.splitlines()) < 400      # was the whole 600 kB line


@pytest.mark.parametrize("host, url", [("::1", "http://[::1]:8000/v1"), ("127.0.0.1", "http://127.0.0.1:8000/v1"),
                                       ("localhost", "http://localhost:8000/v1")])
def test_the_served_url_brackets_an_ipv6_address(host, url):
    assert base_url(host, 8000) == url


# -------------------------------------------------------------------- safetensors headers

def _safetensors(path: Path, header: dict, data: bytes = b"", claimed: int | None = None) -> Path:
    import json
    import struct

    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if claimed is None else claimed) + raw + data)
    return path


def test_a_header_claiming_gigabytes_is_not_read(tmp_path):
    # a 4 KB sparse file whose header length says 30 GiB: was a MemoryError traceback in `check`
    from parcompile.core.hf_weights import read_header

    f = _safetensors(tmp_path / "model.safetensors", {}, claimed=30 * 2**30)
    with open(f, "r+b") as fh:
        fh.truncate(30 * 2**30 + 64)            # sparse: no disk used
    tracemalloc.start()
    try:
        tensors, problems = read_header(f)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert tensors == {} and "over safetensors' limit" in problems[0].message
    assert peak < 10_000_000


@pytest.mark.parametrize("shape, offsets", [([2, 2.5], [0, 16]), ([2, -2], [0, 16]), (["2", 2], [0, 16]),
                                            ([2, 2], [0.0, 16]), ([2, 2], [True, 16])])
def test_a_shape_or_offset_that_is_not_a_json_count_is_malformed(tmp_path, shape, offsets):
    # `int(64.5)` is 64: a shape of 64.5 passed `check` and died in the ranks
    from parcompile.core.hf_weights import read_header

    f = _safetensors(tmp_path / "m.safetensors", {"w": {"dtype": "F32", "shape": shape, "data_offsets": offsets}},
                     b"\0" * 16)
    tensors, problems = read_header(f)
    assert problems and "malformed header entry for `w`" in problems[0].message, problems


@pytest.mark.parametrize("shard", ["/etc/passwd", "../x.safetensors", "sub/model.safetensors", "..", "model.bin"])
def test_an_index_naming_a_shard_outside_the_checkpoint_is_refused(tmp_path, shard):
    import json

    from parcompile.core.hf_weights import scan_checkpoint

    (tmp_path / "ck").mkdir()
    (tmp_path / "x.safetensors").write_bytes(b"")
    (tmp_path / "ck" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    names, headers, problems, complete = scan_checkpoint(tmp_path / "ck")
    assert not complete and names == {} and "not a *.safetensors file name" in problems[0].message, problems



@pytest.mark.parametrize("text", ["[]", "1e999", "{}", '{"weight_map": null}', '{"weight_map": []}'])
def test_an_index_without_a_weight_map_object_says_so(tmp_path, text):
    # was Python's own words: "list indices must be integers or slices, not str", "'weight_map'"
    from parcompile.core.hf_weights import scan_checkpoint

    (tmp_path / "model.safetensors.index.json").write_text(text)
    names, headers, problems, complete = scan_checkpoint(tmp_path)
    assert not complete and [p.message for p in problems] == [
        f"cannot read `{tmp_path / 'model.safetensors.index.json'}`: it holds no `weight_map` object (tensor name "
        "-> shard file)"]

# -------------------------------------------------------------------- HF config fields

def _tiny_hf(model_type: str, **extra) -> dict:
    cfg = {"model_type": model_type, "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "max_position_embeddings": 128, "tie_word_embeddings": False, "torch_dtype": "float32"}
    if model_type == "mixtral":
        cfg.update(num_local_experts=2, num_experts_per_tok=1)
    return {**cfg, **extra}


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "mixtral"])
@pytest.mark.parametrize("attention_bias, mlp_bias", [(False, True), (True, False), (True, True)])
def test_bias_fields_are_carried_as_transformers_reads_them_or_refused(model_type, attention_bias, mlp_bias,
                                                                      tmp_path):
    # a Llama config with `mlp_bias: true` imported without the biases (213,568 parameters
    # where transformers counts 214,848); now each bias field is carried or refused, judged
    # against transformers' own class
    import json

    import torch
    import transformers

    from parcompile.core.hf import HFConfigError, from_hf_dict

    cfg = _tiny_hf(model_type, attention_bias=attention_bias, mlp_bias=mlp_bias)
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    expected = sum(p.numel() for p in reference.parameters())
    try:
        from_hf_dict(cfg)
    except HFConfigError as e:
        assert "cannot be mapped" in str(e)
        plain = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if not k.endswith("_bias")})
        with torch.device("meta"):
            without = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(plain).parameters())
        assert without != expected, "refused a field that transformers ignores"
        return
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "s.par").write_text(f'model m from "{tmp_path / "config.json"}" {{ }}\n'
                                    'cluster c from "cpu" { gpus_per_node = 1 }\n')
    plan = parcompile.compile(tmp_path / "s.par")
    assert plan.data["model"]["params"] == expected


def test_attention_dropout_is_refused_not_dropped():
    from parcompile.core.hf import HFConfigError, from_hf_dict

    assert from_hf_dict(_tiny_hf("llama", attention_dropout=0.0))["layers"] == 2
    with pytest.raises(HFConfigError, match="`attention_dropout` = 0.1 cannot be mapped"):
        from_hf_dict(_tiny_hf("llama", attention_dropout=0.1))
    for bad in (-1, float("nan")):   # no probability: was read as 0 (`> 0` false) and dropped silently
        with pytest.raises(HFConfigError, match="`attention_dropout` = (-1|nan) cannot be mapped"):
            from_hf_dict(_tiny_hf("mistral", attention_dropout=bad))


# -------------------------------------------------------------------- data with nothing to learn

def test_examples_whose_prompt_fills_the_sample_are_counted_exactly(tmp_path, monkeypatch):
    import json
    import random

    from parcompile.runtime.data import dataset

    monkeypatch.setenv("PARCOMPILE_CACHE", str(tmp_path / "cache"))
    rng = random.Random(5)
    rows = [{"prompt": "p" * rng.randint(0, 40), "completion": "c" * rng.randint(1, 6)} for _ in range(200)]
    f = tmp_path / "pc.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = dataset.prepare(str(f), tokenizer="bytes", data_format="prompt_completion")
    for seq_len in (1, 5, 17, 30, 64):
        brute = sum(bool((cache.sample(i, seq_len)[1] == -100).all()) for i in range(cache.num_examples))
        assert cache.without_loss(seq_len) == brute, seq_len
        assert cache.without_loss(seq_len, chunk=7) == brute


def test_prompt_completion_data_with_no_loss_token_within_seq_len_is_an_error(tmp_path, monkeypatch):
    # every prompt longer than seq_len: the run trained at loss 0.0000 and exited 0
    import json

    from parcompile.api import prepare_data

    monkeypatch.setenv("PARCOMPILE_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": "x" * 100, "completion": "y"}) + "\n" for _ in range(40)))
    spec = tmp_path / "t.par"
    spec.write_text(TINY.replace('data      = "builtin:pydoc"', 'data = "pc.jsonl"\n    data_format = prompt_completion'))
    diags = prepare_data(parcompile.compile(spec).config)
    errors = [d for d in diags if d.severity == "error"]
    assert len(errors) == 1 and "all 40 of 40 examples have no loss token within seq_len = 64" in errors[0].message
    # some: a warning naming how many
    with data.open("a") as fh:
        fh.write("".join(json.dumps({"prompt": "x", "completion": "y"}) + "\n" for _ in range(40)))
    diags = prepare_data(parcompile.compile(spec).config)
    assert [d.severity for d in diags if "no loss token" in d.message] == ["warning"]
    assert any("40 of 80 examples" in d.message for d in diags)


# -------------------------------------------------------------------- serve checks before start

SERVE = (Path(__file__).resolve().parent.parent / "examples" / "tiny_serve.par").read_text()


@pytest.mark.parametrize("old, new, message", [
    ("block_size     = 16 ", "block_size     = 1000000000000000000000000000000000000000 ", "block_size must be in"),
    ("seq_len    = 64", "seq_len    = 1000000000000", "seq_len must be in"),
    ("kv_cache_tokens = 2048", "kv_cache_tokens = 9223372036854775808", "kv_cache_tokens must be in"),
])
def test_serve_sizes_beyond_reason_are_errors_at_the_key(old, new, message):
    # were: a ValueError traceback (block_size), ranks dying (seq_len), a silent clamp (2**63)
    assert old in SERVE
    errors = _errors(SERVE.replace(old, new).replace('weights        = "../build/tiny_ckpt"', ""))
    assert any(message in e for e in errors), errors


def test_blocks_larger_than_the_cache_are_an_error_not_a_traceback():
    text = SERVE.replace('weights        = "../build/tiny_ckpt"', "").replace("kv_cache_tokens = 2048", "") \
        .replace("block_size     = 16 ", "block_size     = 65536 ").replace("gpus_per_node = 4", "gpus_per_node = 4\n"
                                                                             "    memory = 4 MiB")
    errors = _errors(text)
    assert any("fewer than one request" in e or "does not fit" in e for e in errors), errors


def test_kv_cache_tokens_above_memory_is_a_does_not_fit_warning():
    text = SERVE.replace('weights        = "../build/tiny_ckpt"', "").replace("kv_cache_tokens = 2048",
                                                                          "kv_cache_tokens = 1000000000000")
    plan = parcompile.compile(text, filename="h.par")
    hit = [d for d in plan.warnings if "kv_cache_tokens = 1,000,000,000,000 does not fit" in d.message]
    assert hit and hit[0].code == "does-not-fit"


def _dcp(path: Path, shapes: dict) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({k: torch.zeros(v) for k, v in shapes.items()}, checkpoint_id=str(path))
    return path


def test_serve_weights_from_a_training_checkpoint_are_checked_before_start(tmp_path):
    # a DCP checkpoint without lm_head or with another shape passed `check` and died in the ranks
    from parcompile.frontend.checks import expected_shapes

    plan = parcompile.compile(SERVE.replace('weights        = "../build/tiny_ckpt"', ""), filename="h.par")
    shapes = expected_shapes(plan.config.model)
    assert "lm_head.weight" in shapes

    def serve_errors(directory: Path) -> list[str]:
        text = SERVE.replace('"../build/tiny_ckpt"', f'"{directory}"')
        try:
            parcompile.compile(text, filename="h.par")
        except SpecError as e:
            return [d.message for d in e.diagnostics if d.severity == "error"]
        return []

    assert serve_errors(_dcp(tmp_path / "good", shapes)) == []
    no_head = {k: v for k, v in shapes.items() if k != "lm_head.weight"}
    assert any("has no `lm_head.weight`" in e for e in serve_errors(_dcp(tmp_path / "nohead", no_head)))
    wrong = {**shapes, "layers.0.attn.wo.weight": (3, 3)} if "layers.0.attn.wo.weight" in shapes else \
        {**shapes, next(iter(shapes)): (3, 3)}
    assert any("has shape (3, 3)" in e for e in serve_errors(_dcp(tmp_path / "wrong", wrong)))
    # a directory without tensors (a config.json before the download) plans, warned; `run` refuses it
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    text = SERVE.replace('"../build/tiny_ckpt"', f'"{tmp_path / "junk"}"')
    plan = parcompile.compile(text, filename="h.par")
    assert [d.code for d in plan.warnings if "holds neither" in d.message] == ["no-weights"]
    (tmp_path / "s.par").write_text(text)
    assert main(["run", str(tmp_path / "s.par"), "-o", str(tmp_path / "build")]) == 1
