"""Hostile and careless inputs (issue 30, "Signals and inputs"): many diagnostics stay
linear and capped, files that are no regular files are named for what they are and never
read, an unclosed `{` is pointed at, `seq_len` beyond an imported context is warned about."""

from __future__ import annotations

from pathlib import Path

import pytest

from parcompile import api
from parcompile.cli import main
from parcompile.diagnostics import SHOWN, Diagnostic, Span, SpecError, render_all

ROOT = Path(__file__).resolve().parent.parent
TINY = (ROOT / "examples" / "tiny.par").read_text()


def _with_unknown_keys(n: int) -> str:
    extra = "".join(f"    zz_unknown_{i} = 1\n" for i in range(n))
    return TINY.replace("    optimizer = adamw\n", "    optimizer = adamw\n" + extra)


class _CountingText(str):
    """Spec text that counts how often it is split into lines."""

    splits = 0

    def splitlines(self, *args, **kwargs):
        type(self).splits += 1
        return super().splitlines(*args, **kwargs)


def test_rendering_many_diagnostics_splits_the_source_once():
    # was: each diagnostic split the whole text again (and SpecError rendered them all when
    # raised): 16,000 unknown keys took 13 s, 100,000 did not finish in 9 minutes
    n = 2000
    text = _CountingText("".join(f"k{i} = 1\n" for i in range(n)))
    diags = [Diagnostic("error", f"unknown key `k{i}`", Span("a.par", i + 1, 1, i + 1, 3)) for i in range(n)]
    _CountingText.splits = 0
    err = SpecError(diags, text)
    assert _CountingText.splits == 0          # nothing rendered on raise
    out = render_all(err.diagnostics, text)
    assert _CountingText.splits == 1
    assert out.count("error: unknown key") == n and f"k{n - 1} = 1\n^^" in out


def test_many_unknown_keys_are_all_found_and_the_cli_prints_a_capped_list(capsys, tmp_path):
    n = 3000
    with pytest.raises(SpecError) as e:
        api.compile(_with_unknown_keys(n), "big.par")
    assert sum("unknown key `zz_unknown_" in d.message for d in e.value.diagnostics) == n
    spec = tmp_path / "big.par"
    spec.write_text(_with_unknown_keys(n))
    assert main(["check", str(spec)]) == 1
    err = capsys.readouterr().err
    assert err.count(": error: unknown key `zz_unknown_") == SHOWN
    assert err.rstrip().splitlines()[-1] == (f"... and {n - SHOWN:,} more ({n - SHOWN:,} errors); "
                                             f"fix the ones above and check again")
    # JSON lists every one (editors and CI filter it themselves)
    assert main(["check", str(spec), "--format", "json"]) == 1
    assert capsys.readouterr().out.count('"unknown key `zz_unknown_') == n


# -- item 13: only regular files are read, with a size limit ---------------------------------

posix_only = pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs FIFOs and /dev")


def _spec_with(tmp_path, old: str, new: str) -> Path:
    spec = tmp_path / "s.par"
    spec.write_text(TINY.replace(old, new))
    return spec


@posix_only
def test_check_of_a_fifo_or_a_device_is_a_usage_error_at_once(tmp_path, capsys):
    # was: `check` on a FIFO blocked forever (nothing writes to it), on /dev/zero it read
    # until the kernel killed it
    import os

    fifo = tmp_path / "spec.par"
    os.mkfifo(fifo)
    assert main(["check", str(fifo)]) == 2
    assert capsys.readouterr().err == (f"parcompile: error: cannot read {fifo}: it is a FIFO (named pipe), not a "
                                       f"regular file; give a .par file\n")
    assert main(["check", "/dev/zero"]) == 2
    assert "cannot read /dev/zero: it is a character device, not a regular file" in capsys.readouterr().err
    with pytest.raises(SpecError, match=r"cannot read `.*spec.par`: is a FIFO \(named pipe\), not a regular file"):
        api.compile(fifo)


def test_a_spec_over_the_size_limit_is_not_read(tmp_path, capsys, monkeypatch):
    from parcompile.core import files

    monkeypatch.setattr(files, "MAX_SPEC_BYTES", 1000)
    big = tmp_path / "big.par"
    big.write_text(TINY + "#" * 1000)
    assert main(["check", str(big)]) == 2
    assert f"bytes, more than the 1,000 this file may have; a spec is a few kilobytes" in capsys.readouterr().err


def test_a_directory_given_as_the_spec_is_told_to_give_a_par_file(tmp_path, capsys):
    """`parcompile check DIR` said "cannot read DIR: it is a directory; a spec is a few
    kilobytes", the size limit's fix: read_bytes raises its own FileReadError, not
    IsADirectoryError, so the directory took the branch of a file over the limit."""
    assert main(["check", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"parcompile: error: cannot read {tmp_path}: it is a directory; give a .par file\n"


@posix_only
def test_a_fifo_or_dev_null_named_by_a_spec_says_what_it_is(tmp_path, capsys):
    # was: `data = "/dev/null"` or a FIFO passed `check` and `run` said "data file not found";
    # a FIFO as the imported config.json blocked `check` forever
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for value, what in ((fifo, "a FIFO (named pipe)"), ("/dev/null", "a character device")):
        spec = _spec_with(tmp_path, '"builtin:pydoc"', f'"{value}"')
        assert main(["check", str(spec)]) == 1
        assert f"error: data `{value}` is {what}, not a regular file" in capsys.readouterr().err
    os.mkfifo(tmp_path / "config.json")
    spec = _spec_with(tmp_path, "model tiny {", 'model tiny from "config.json" {')
    assert main(["check", str(spec)]) == 1
    err = capsys.readouterr().err
    assert f"s.par:3:17: error: cannot read `{tmp_path / 'config.json'}`: it is a FIFO (named pipe), not a " \
           f"regular file" in err
    spec = _spec_with(tmp_path, "    log_every = 5\n", f'    log_every = 5\n    init_from = "{fifo}"\n')
    assert main(["check", str(spec)]) == 1
    assert f"init_from directory `{fifo}` is a FIFO (named pipe), not a directory" in capsys.readouterr().err


@posix_only
def test_the_runtime_names_a_fifo_data_source_and_tokenizer(tmp_path):
    import os

    from parcompile.runtime.data.dataset import DataError, load_tokenizer, resolve_files

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match=r"data is a FIFO \(named pipe\), not a regular file"):
        resolve_files(str(fifo))
    with pytest.raises(DataError, match=r"tokenizer is a character device, not a regular file"):
        load_tokenizer("/dev/zero")


# -- item 14: an unclosed `{`; seq_len beyond the imported context -----------------------------

@pytest.mark.parametrize("unclosed, line, col, next_block, next_line", [
    ("    position   = rope\n}\n", 3, 12, "cluster", 17),      # model's `}` missing: `cluster local ...` follows
    ("    global_batch = 16      # m = 16 / (2 * 2) = 4 micro-batches\n}\n", 22, 10, "train", 31),
])
def test_a_missing_brace_points_at_the_block_left_open(unclosed, line, col, next_block, next_line):
    # was: reported at the next block (`expected `=` after key `cluster`, found `local``)
    text = TINY.replace(unclosed, unclosed[:-2] + "\n", 1)
    with pytest.raises(SpecError) as e:
        api.compile(text, "t.par")
    (d,) = e.value.diagnostics
    kind = "model" if line == 3 else "parallel"
    assert (d.span.line, d.span.column, d.message) == (line, col, f"the `{kind}` block is not closed")
    assert TINY.splitlines()[line - 1][col - 1] == "{"
    assert d.help == f"add `}}` after its last entry, before `{next_block}` on line {next_line}, which starts " \
                     f"another block"


def _hf_spec(tmp_path, config: dict, seq_len: int) -> str:
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    return (f'model m from "{tmp_path / "config.json"}" {{\n    seq_len = {seq_len}\n}}\n'
            'cluster c from "cpu" {\n    gpus_per_node = 1\n}\n'
            "parallel {\n    micro_batch = 1\n    global_batch = 1\n}\ntrain {\n    lr = 1e-3\n}\n")


LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "hidden_act": "silu"}
# Llama 3.1's form (config.json of meta-llama/Llama-3.1-8B: factor 8.0, original 8192, 131072), scaled down
LLAMA3_SCALED = {**LLAMA, "max_position_embeddings": 128,
                 "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 64,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0}}


def test_seq_len_above_the_imported_context_is_a_warning(tmp_path):
    # was: seq_len = 256 over max_position_embeddings = 64 passed silently
    assert not [w for w in api.compile(_hf_spec(tmp_path, LLAMA, 64), "h.par").warnings if "max_positions" in w.message]
    (w,) = [w for w in api.compile(_hf_spec(tmp_path, LLAMA, 256), "h.par").warnings if "max_positions" in w.message]
    assert (w.span.line, w.span.column) == (2, 15)
    assert w.message == ("seq_len = 256 is above the model's max_positions = 64: positions past it were never seen "
                         "in training")
    assert "rope_scaling_factor = 4" in w.help
    # within what llama3 scaling reaches (64 * 2 = 128 = max_position_embeddings): nothing to say
    assert not [w for w in api.compile(_hf_spec(tmp_path, LLAMA3_SCALED, 128), "h.par").warnings
                if "max_positions" in w.message]


def test_seq_len_beyond_what_rope_scaling_reaches_is_an_error(tmp_path):
    with pytest.raises(SpecError) as e:
        api.compile(_hf_spec(tmp_path, LLAMA3_SCALED, 512), "h.par")
    (d,) = [d for d in e.value.diagnostics if d.severity == "error"]
    assert (d.span.line, d.span.column) == (2, 15)
    assert d.message == ("seq_len = 512 is beyond what the model's RoPE scaling reaches: rope_type = llama3 extends "
                         "rope_original_max_positions = 64 by rope_scaling_factor = 2 to 128 positions")
    assert d.help == "use seq_len <= 128, or write `rope_scaling_factor = 8` (a longer extension, to be fine-tuned)"


def test_a_tokenizer_over_the_size_limit_is_not_read(tmp_path, monkeypatch):
    from parcompile.runtime.data import dataset

    monkeypatch.setattr(dataset, "MAX_JSON_BYTES", 10)
    (tmp_path / "tokenizer.json").write_text("{" + " " * 20 + "}")
    with pytest.raises(dataset.DataError, match="tokenizer file is 22 bytes, more than the 10 a tokenizer.json"):
        dataset.load_tokenizer(str(tmp_path))


# -- the fuzz of data files (issue 30): what was a traceback is a diagnostic at path:line -----

@pytest.mark.parametrize("line, message", [
    ("[" * 100_000 + "]" * 100_000, "not valid JSON: nested too deeply to read"),         # RecursionError
    ('{"text": "ab\\udcff"}', "field `text` holds a lone surrogate (\\udcff) at character 3: not text"),
], ids=["nested-100000-deep", "lone-surrogate"])
def test_data_lines_that_crashed_are_diagnostics_at_their_line(tmp_path, monkeypatch, line, message):
    from parcompile.frontend import load_spec

    monkeypatch.setenv("PARCOMPILE_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n' + line + "\n")
    cfg, _ = load_spec(TINY.replace('"builtin:pydoc"', f'"{data}"'), "t.par")
    (d,) = [d for d in api.prepare_data(cfg) if d.severity == "error"]
    assert (d.span.file, d.span.line, d.message) == (str(data), 2, message)
