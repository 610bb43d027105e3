"""The front end: grammar, parser, AST, syntax and structure diagnostics, load_spec, examples."""

from __future__ import annotations

from pathlib import Path

import pytest

from parcompile.frontend.build import KEYS
from parcompile.config.schema import ClusterConfig, ModelConfig, ParallelConfig, ServeConfig, TrainConfig
from parcompile.diagnostics import Span, SpecError
from parcompile.frontend import ast, load_spec, parse
from parcompile.frontend.parser import GRAMMAR_PATH

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
SPEC_EXAMPLE = Path(__file__).resolve().parent / "data" / "spec_example.par"


def syntax_error(text: str) -> tuple[str, int, int, str | None]:
    with pytest.raises(SpecError) as e:
        parse(text, "s.par")
    [d] = e.value.diagnostics
    return d.message, d.span.line, d.span.column, d.help


def errors(text: str) -> list[tuple[str, int, int, str | None, str | None]]:
    with pytest.raises(SpecError) as e:
        load_spec(text, filename="s.par")
    return [(d.message, d.span.line, d.span.column, d.help, d.note) for d in e.value.diagnostics
            if d.severity == "error"]


# -- grammar and AST ---------------------------------------------------------------------------


def test_grammar_lives_at_the_top_of_the_repo():
    # parcompile/grammar links to grammar/, so wheels carry the grammar as package data
    assert GRAMMAR_PATH.resolve() == (REPO / "grammar" / "par.lark").resolve() and GRAMMAR_PATH.exists()


def test_ast_values_and_spans():
    text = ('model m from "llama3-8b" {  # comment\n'
            '  a = 128_256, b = 3e-4\n'
            '  c = true\n'
            '  d = rmsnorm\n'
            '  e = "x\\"y\\n"\n'
            '  f = [8, 8,\n'
            '       7, 7,]\n'
            '  g = 400 Gb/s\n'
            '  h = 1f1b\n'
            '  i = -2\n'
            '  j = 10%\n'
            '}\n'
            'parallel\n{\n}\n')
    spec = parse(text, "x.par")
    model, parallel = spec.blocks
    assert (model.kind, model.name, model.source) == ("model", "m", "llama3-8b")
    assert model.span == Span("x.par", 1, 1, 1, 25)
    assert model.name_span == Span("x.par", 1, 7, 1, 8) and model.source_span == Span("x.par", 1, 14, 1, 25)
    assert (parallel.kind, parallel.name, parallel.source, parallel.entries) == ("parallel", None, None, ())
    v = {e.key: e.value for e in model.entries}
    assert v["a"] == ast.Int(128256, "128_256", Span("x.par", 2, 7, 2, 14))
    assert v["b"] == ast.Float(3e-4, "3e-4", Span("x.par", 2, 20, 2, 24))
    assert v["c"] == ast.Bool(True, "true", Span("x.par", 3, 7, 3, 11))
    assert v["d"] == ast.Word("rmsnorm", "rmsnorm", Span("x.par", 4, 7, 4, 14))
    assert isinstance(v["e"], ast.String) and v["e"].value == 'x"y\n'
    assert [i.value for i in v["f"].items] == [8, 8, 7, 7] and v["f"].span == Span("x.par", 6, 7, 7, 14)
    g = v["g"]
    assert (g.number.value, g.unit, g.text, g.unit_span) == (400, "Gb/s", "400 Gb/s", Span("x.par", 8, 11, 8, 15))
    assert v["h"] == ast.Word("1f1b", "1f1b", Span("x.par", 9, 7, 9, 11))
    assert v["i"].value == -2 and v["j"].unit == "%"
    entry = model.entries[0]
    assert entry.key_span == Span("x.par", 2, 3, 2, 4) and entry.value_span == v["a"].span


def test_separators_and_empty_file():
    spec = parse("parallel { tp = 2, pp = 2 }  model m {}\n\n\n# end", "x.par")
    assert [b.kind for b in spec.blocks] == ["parallel", "model"]
    assert [e.key for e in spec.blocks[0].entries] == ["tp", "pp"]
    assert parse("", "x.par").blocks == ()


# -- syntax errors, in the user's words ---------------------------------------------------------


def test_missing_equals_full_render():
    with pytest.raises(SpecError) as e:
        load_spec("parallel {\n    tp 8\n}\n", filename="s.par")
    assert str(e.value) == (
        "s.par:2:8: error: expected `=` after key `tp`, found `8`\n"
        "    tp 8\n"
        "       ^"
    )


def test_unterminated_string_full_render():
    with pytest.raises(SpecError) as e:
        load_spec('train {\n    data = "abc\n}\n', filename="s.par")
    assert str(e.value) == (
        "s.par:2:12: error: unterminated string\n"
        '    data = "abc\n'
        "           ^^^^\n"
        '  help: close the string with `"` on the same line'
    )



def test_control_bytes_of_the_source_line_are_not_echoed_to_the_terminal():
    """A line with terminal escapes (clear screen, set title) is shown with `?` for each
    control character, one column each, so the caret still points at the error."""
    with pytest.raises(SpecError) as e:
        load_spec("model m {\n    x\x1b[2J = \x1b]0;t\x07 1\n}\n", filename="s.par")
    text = str(e.value)
    assert not any(ord(ch) < 32 and ch != "\n" for ch in text), repr(text)
    line, caret = text.split("\n")[1:3]
    assert line == "    x?[2J = ?]0;t? 1"
    d = e.value.diagnostics[0]
    assert caret.index("^") == d.span.column - 1


def test_names_from_other_tools_and_keys_of_another_block_get_a_fix():
    text = ('model m {\n layers = 2\n hidden = 64\n heads = 4\n vocab = 256\n seq_len = 16\n'
            ' dtype = float32\n tp = 2\n}\ncluster c from "cpu" { gpus_per_node = 1 }\n'
            'parallel { global_batch = 2 }\ntrain { learning_rate = 1e-3 }\n')
    with pytest.raises(SpecError) as e:
        load_spec(text, filename="s.par")
    helps = {d.message: d.help for d in e.value.diagnostics}
    assert helps["unknown dtype `float32`"].startswith("did you mean `fp32`?")
    assert helps["unknown key `tp` in `model`"].startswith("`tp` is a key of the `parallel` block; move it there.")
    assert helps["unknown key `learning_rate` in `train`"].startswith("did you mean `lr`?")

VALUE_HELP = ('a value is a number, a quantity such as `80 GiB`, `true` or `false`, a word, '
              'a "string" or a [list]')
SEP_HELP = "write one `key = value` per line, or separate entries with `,`"


@pytest.mark.parametrize("text, expected", [
    ("parallel {\n  tp =\n}", ("expected a value after `tp =`, found the end of the line", 2, 7, VALUE_HELP)),
    ("parallel {\n  tp = }", ("expected a value after `tp =`, found `}`", 2, 8, VALUE_HELP)),
    ("parallel {\n  tp = @\n}", ("expected a value after `tp =`, found `@`", 2, 8, VALUE_HELP)),
    ("parallel {\n  tp = 8 pp = 2\n}", ("missing `,` or newline before `pp`", 2, 10, SEP_HELP)),
    ("parallel {\n  tp = 8 \"x\"\n}",
     ("expected a newline or `,` after the value of `tp`, found the string \"x\"", 2, 10, SEP_HELP)),
    ("parallel {\n  tp = 8\n", ("the `parallel` block is not closed", 1, 10, "add `}` after its last entry")),
    ("parallel {\n  tp = 8\n}\n}", ("unexpected `}`", 4, 1, "no block is open here")),
    ("tp = 8", ("`tp = ...` is outside of any block", 1, 1,
                "entries go inside a block, e.g. `parallel { tp = 8 }`")),
    ("model a b {\n}", ("expected `{` to open the `model` block, found `b`", 1, 9,
                        'a block is `KIND NAME [from "SOURCE"] { key = value ... }` (`parallel`, `train` and `serve`: `KIND { ... }`)')),
    ("model a", ("expected `{` to open the `model` block, found the end of the file", 1, 8,
                 'a block is `KIND NAME [from "SOURCE"] { key = value ... }` (`parallel`, `train` and `serve`: `KIND { ... }`)')),
    ("parallel {\n  s = [1, 2\n}", ("expected `,` or `]` in the list, found `}`", 3, 1,
                                    "list items are separated by `,`: `[8, 8, 7, 7]`")),
    ("parallel {\n  s = [1, 2", ("unclosed `[`", 2, 7, "close the list with `]`")),
    ("parallel {\n  = 3\n}", ("expected a key, found `=`", 2, 3, "an entry is `key = value`")),
    ("parallel {\n  tp = 8 @\n}", ("unexpected character `@`", 2, 10,
                                   "keys and names are lower_snake_case words; strings go in double quotes")),
    ("= 3", ("expected a block, found `=`", 1, 1,
             'a block is `KIND NAME [from "SOURCE"] { key = value ... }` (`parallel`, `train` and `serve`: `KIND { ... }`); '
             "blocks are model, cluster, parallel, train, serve")),
    ("parallel { s = " + "[" * 20 + " }", ("lists nested more than 16 deep", 1, 32,
                                          "values are flat lists such as `[8, 8, 7, 7]`")),
    ("model a { x = 1" + "0" * 120 + " }", ("integer literal of 121 digits is too long", 1, 15, None)),
    ("parallel {\n  tp: 8\n}", ("expected `=` after key `tp`, found `:`", 2, 5, None)),
    ("model m from 3 {}", ("unexpected `3`", 1, 14, "expected a string")),
    ("model m {\x00}", ("unexpected character `'\\x00'`", 1, 10,
                        "keys and names are lower_snake_case words; strings go in double quotes")),
])
def test_syntax_errors(text, expected):
    assert syntax_error(text) == expected


# -- structure of a spec ----------------------------------------------------------------------

MODEL = 'model m from "llama3-8b" { }\n'
CLUSTER = 'cluster c from "h100-sxm" { }\n'
PARALLEL = "parallel { tp = 8 }\n"


def test_unknown_block_and_block_given_twice():
    assert errors(MODEL + CLUSTER + PARALLEL + "paralel { }\nmodel n { }\n") == [
        ("unknown block `paralel`", 4, 1,
         "did you mean `parallel`? blocks are `model`, `cluster`, `parallel`, `train` or `serve`", None),
        ("block `model` given twice", 5, 1, "move its keys into the `model` block at line 1 and remove this one",
         "first given at line 1"),
    ]


def test_missing_blocks():
    assert errors(PARALLEL) == [
        ("missing `model` block", 1, 1, 'add one, e.g. `model llama from "llama3-8b" { }`', None),
        ("missing `cluster` block", 1, 1, 'add one, e.g. `cluster gpus from "h100-sxm" { nodes = 1 }`', None),
    ]


def test_missing_parallel_block_means_defaults():
    cfg, _ = load_spec(MODEL + 'cluster c from "h100-sxm" { gpus_per_node = 1 }\n')
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == (1, 1, 1)
    assert cfg.workload == "train" and cfg.train == TrainConfig()


def test_names_and_from_only_on_model_and_cluster():
    assert errors(MODEL + CLUSTER + 'parallel p from "x" { tp = 8 }\n') == [
        ("`parallel` takes no name", 3, 10, "write `parallel { ... }`", None),
        ("`parallel` takes no `from`", 3, 17, "only `model` and `cluster` import presets", None),
    ]


def test_train_and_serve_together():
    assert errors(MODEL + CLUSTER + PARALLEL + "train { }\nserve { }\n") == [
        ("a spec has `train` or `serve`, not both", 5, 1,
         "remove one of them: a training spec and a serving spec are two files (the same `model` block in each)",
         "`train` given at line 4")]


def test_unknown_key_and_key_twice():
    found = errors(MODEL + CLUSTER + "parallel {\n  tp = 8\n  tpp = 2\n  tp = 4\n}\n")
    assert [f[:3] for f in found] == [("unknown key `tpp` in `parallel`", 5, 3), ("key `tp` given twice", 6, 3)]
    assert found[0][3].startswith("did you mean `tp`? keys of `parallel` are dp, tp, pp, cp, ep, expert_tp, ")
    assert found[1][4] == "first given at line 4"
    assert found[1][3] == "keep one `tp = ...`: remove this line or line 4"


def test_missing_required_model_keys():
    assert errors("model m { layers = 2, hidden = 8 }\n" + CLUSTER) == [
        ("missing required keys `heads`, `vocab` and `seq_len` in `model`", 1, 1,
         'add `heads = ...`, or start from a preset: `model m from "llama3-8b" { ... }`', None)]


def test_value_type_errors():
    text = (MODEL.replace("{ }", "{\n  layers = abc\n  norm = rmsnrom\n  bias = yes\n  norm_eps = x\n"
                                 "  dtype = 16\n  zero_x = 1\n}")
            + CLUSTER + "parallel {\n  tp = 8\n  zero = 4\n  order = 7\n  stage_layers = 4\n}\n"
            + "train {\n  betas = [0.9]\n  lr = 0\n  steps = 0\n  seed = -1\n}\n")
    found = errors(text)
    assert [f[:4] for f in found] == [
        ("expected an integer, got `abc`", 2, 12, "layers takes a whole number"),
        ("unknown norm `rmsnrom`", 3, 10, "did you mean `rmsnorm`? norm may be `layernorm` or `rmsnorm`"),
        ("expected `true` or `false`, got `yes`", 4, 10, "write `bias = true` or `bias = false`"),
        ("expected a number, got `x`", 5, 14, "norm_eps takes a number such as `0.1` or `3e-4`"),
        ("unknown dtype `16`", 6, 11, "did you mean `fp16`? dtype may be `fp32`, `bf16` or `fp16`"),
        ("unknown key `zero_x` in `model`", 7, 3, found[5][3]),
        ("zero must be 0, 1, 2 or 3, got `4`", 12, 10,
         "0 none, 1 shards optimizer states, 2 also gradients, 3 also parameters"),
        ("expected a string, got `7`", 13, 11, 'write it in double quotes: `order = "..."`'),
        ("expected a list, got `4`", 14, 18, "write `stage_layers = [8, 8, 7, 7]`"),
        ("betas needs 2 entries, got 1", 17, 11, "write `betas = [0.9, 0.95]`"),
        ("lr must be positive, got `0`", 18, 8, "use a number above 0"),
        ("steps must be at least 1, got `0`", 19, 11, "use 1 or more"),
        ("seed must not be negative, got `-1`", 20, 10, "use 0 or more"),
    ]


def test_auto_only_where_allowed():
    assert errors(MODEL + CLUSTER + "parallel { tp = 8, global_batch = auto }")[0][:4] == (
        "expected an integer, got `auto`", 3, 35, "global_batch takes a whole number")


def test_unknown_word_for_an_auto_key_lists_auto():
    """Before: `offload = yes` answered "offload may be `none`, `optimizer` or `params`",
    leaving out the `auto` the docs give it (the search's keys)."""
    found = errors(MODEL + CLUSTER + "parallel {\n  zero = 1\n  offload = yes\n  schedule = fast\n}\n")
    assert [f[3] for f in found] == ["offload may be `none`, `optimizer`, `params` or `auto`",
                                     "schedule may be `gpipe`, `1f1b`, `interleaved_1f1b`, `zero_bubble` or `auto`"]


def test_data_path_is_resolved_against_the_spec_dir(tmp_path):
    (tmp_path / "corpus.txt").write_text("hello")
    spec = tmp_path / "s.par"
    spec.write_text(MODEL + CLUSTER + PARALLEL + 'train { data = "corpus.txt" }\n')
    cfg, _ = load_spec(spec)
    assert cfg.train.data == str(tmp_path / "corpus.txt")
    spec.write_text(MODEL + CLUSTER + PARALLEL + 'train { data = "nope.txt" }\n')
    with pytest.raises(SpecError) as e:
        load_spec(spec, filename="s.par")
    [d] = e.value.diagnostics
    assert (d.message, d.span.line, d.span.column, d.help) == (
        "data `nope.txt` does not exist", 4, 16,
        f"give a file, a directory of .txt/.jsonl/.parquet files or a glob (relative to `{tmp_path}`), "
        '`"builtin:pydoc"` (English text every Python carries) or `"synthetic"`')
    # a directory and a glob are data sources too
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.jsonl").write_text('{"text": "hi"}\n')
    for source, want in (("docs", tmp_path / "docs"), ("docs/*.jsonl", tmp_path / "docs" / "*.jsonl")):
        spec.write_text(MODEL + CLUSTER + PARALLEL + f'train {{ data = "{source}" }}\n')
        assert load_spec(spec)[0].train.data == str(want)
    spec.write_text(MODEL + CLUSTER + PARALLEL + 'train { eval_data = "docs/*.parquet" }\n')
    with pytest.raises(SpecError) as e:
        load_spec(spec, filename="s.par")
    assert e.value.diagnostics[0].message == "eval_data `docs/*.parquet` matches no file"


def test_serve_weights_missing_is_a_warning():
    cfg, warnings = load_spec(MODEL + CLUSTER + PARALLEL + 'serve { weights = "ckpt" }\n', filename="s.par")
    assert cfg.workload == "serve" and cfg.serve.kv_dtype == "bf16"
    assert [(w.severity, w.message) for w in warnings] == [
        ("warning", "weights directory `ckpt` does not exist yet")]


def test_unreadable_file():
    with pytest.raises(SpecError) as e:
        load_spec(Path("no/such.par"))
    [d] = e.value.diagnostics
    assert (d.message, d.span.file) == ("cannot read `no/such.par`: No such file or directory", "no/such.par")


def test_key_table_covers_the_schema():
    from parcompile.frontend.build import BLOCK_KINDS
    from parcompile.frontend.parser import BLOCK_KINDS as PARSER_BLOCK_KINDS

    assert BLOCK_KINDS == PARSER_BLOCK_KINDS
    # figures: set by the cpu preset (frontend/host.py); weight_format: read from the serve checkpoint
    internal = {"name", "preset", "auto", "figures", "weight_format", "quantized_checkpoint"}
    for kind, cls in [("model", ModelConfig), ("cluster", ClusterConfig), ("parallel", ParallelConfig),
                      ("train", TrainConfig), ("serve", ServeConfig)]:
        # dp_shard: another way to write dp_replicate (= dp / dp_shard; frontend/checks_offload.py
        # resolve_dp_shard), read back as the ParallelConfig.dp_shard property
        assert set(KEYS[kind]) - {"dp_shard"} == set(cls.model_fields) - internal, kind


# -- load_spec and the shipped specs ------------------------------------------------------------


def test_spec_example_resolves():
    cfg, warnings = load_spec(SPEC_EXAMPLE)
    assert warnings == []
    assert cfg.name == "spec_example" and cfg.filename == str(SPEC_EXAMPLE)
    m, c, p = cfg.model, cfg.cluster, cfg.parallel
    assert (m.name, m.layers, m.hidden, m.ffn_hidden, m.heads, m.kv_heads, m.vocab, m.seq_len) == \
        ("llama3_8b", 32, 4096, 14336, 32, 8, 128256, 8192)
    assert (m.norm, m.activation, m.position, m.dtype, m.head_dim) == ("rmsnorm", "swiglu", "rope", "bf16", 128)
    assert (c.name, c.preset, c.nodes, c.gpus_per_node, c.world_size) == ("dgx_h100", "h100-sxm", 2, 8, 16)
    assert c.inter_node_bw == 50e9 and c.peak_flops == 989e12
    assert (p.dp, p.tp, p.pp, p.cp, p.ep, p.expert_tp) == (1, 8, 2, 1, 1, 8)
    assert p.auto == ("dp",) and p.sequence_parallel and p.zero == 1
    assert (p.schedule, p.virtual_stages, p.recompute) == ("interleaved_1f1b", 2, "selective")
    assert (p.micro_batch, p.global_batch, p.num_microbatches) == (1, 512, 512)
    assert p.layers_per_chunk(m.layers) == (8, 8, 8, 8)
    assert (cfg.train.optimizer, cfg.train.lr, cfg.train.steps) == ("adamw", 3e-4, 100)
    assert cfg.spans["parallel.tp"] == Span(str(SPEC_EXAMPLE), 23, 10, 23, 11)
    assert cfg.spans["cluster"].line == 16 and cfg.span("model.norm_eps") == cfg.spans["model"]


@pytest.mark.parametrize("name, world, degrees, m", [
    ("tiny", 8, (2, 2, 2), 4),
    ("llama3_8b_2x8_h100", 16, (1, 8, 2), 512),
    ("llama3_70b_8x8_h100", 64, (2, 8, 4), 512),
    ("gpt3_175b_megatron", 1536, (24, 8, 8), 64),
])
def test_examples(name, world, degrees, m):
    cfg, warnings = load_spec(EXAMPLES / f"{name}.par")
    p = cfg.parallel
    assert warnings == [] and cfg.name == name
    assert (cfg.cluster.world_size, (p.dp, p.tp, p.pp), p.num_microbatches) == (world, degrees, m)


def test_tiny_example_in_full(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg, _ = load_spec(Path("examples/tiny.par"))
    assert cfg.filename == "examples/tiny.par" and cfg.source_dir == "examples"
    m = cfg.model
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn_hidden, m.vocab, m.seq_len, m.dtype) == \
        (4, 64, 4, 2, 128, 256, 64, "fp32")
    t = cfg.train
    assert (t.optimizer, t.lr, t.steps, t.seed, t.data, t.log_every) == ("adamw", 3e-3, 40, 1, "builtin:pydoc", 5)
    assert cfg.parallel.schedule == "1f1b" and cfg.cluster.is_cpu


def test_text_source_names():
    text = (EXAMPLES / "tiny.par").read_text()
    cfg, _ = load_spec(text)
    assert (cfg.name, cfg.filename, cfg.source_dir) == ("spec", "<spec>", None)
    cfg, _ = load_spec(text, filename="configs/mine.par")
    assert (cfg.name, cfg.filename, cfg.source_dir) == ("mine", "configs/mine.par", "configs")


# -- no user mistake shows a traceback: tests/test_fuzz.py (random and mutated specs, compiled
# all the way to a plan, under a timeout)


# -- issues a new user hit (one test per fix) -----------------------------------------------------


def test_byte_order_mark_is_ignored_and_columns_stay_right():
    text = MODEL + CLUSTER + PARALLEL
    cfg, _ = load_spec("\ufeff" + text, filename="s.par")
    assert cfg.parallel.tp == 8 and cfg.model.name == "m"
    # a mistake on the first line is reported at the column a user sees (the BOM is invisible)
    with pytest.raises(SpecError) as e:
        load_spec("\ufeffmodel m from \"llama3-7b\" { }\n" + CLUSTER, filename="s.par")
    [d] = e.value.diagnostics
    assert (d.span.line, d.span.column) == (1, 14)
    assert "\ufeff" not in e.value.render()
    assert parse("\ufeff" + text, "s.par").blocks[0].span == Span("s.par", 1, 1, 1, 25)


def test_byte_order_mark_in_a_file(tmp_path):
    spec = tmp_path / "bom.par"
    spec.write_bytes(b"\xef\xbb\xbf" + (MODEL + CLUSTER + PARALLEL).encode())
    cfg, _ = load_spec(spec)
    assert cfg.parallel.tp == 8


@pytest.mark.parametrize("text, expected", [
    # the key is named whole, the caret sits under the bad character
    ("model m {\n    läyers = 4\n}", ("invalid character `ä` in key `läyers`", 2, 6,
                                     "write `layers`; keys are lower_snake_case ASCII words "
                                     "(letters a-z, digits and `_`)")),
    ("model m {\n  äyers = 4\n}", ("invalid character `ä` in key `äyers`", 2, 3,
                                   "write `ayers`; keys are lower_snake_case ASCII words "
                                   "(letters a-z, digits and `_`)")),
    ("model mödel { }", ("invalid character `ö` in name `mödel`", 1, 8,
                         "write `model`; block kinds and names are ASCII words "
                         "(letters, digits, `_`, `.` and `-`)")),
    ("model m {\n  norm = rmsnörm\n}", ("invalid character `ö` in value `rmsnörm`", 2, 14,
                                        "write `rmsnorm`; bare-word values are ASCII; "
                                        "put other text in double quotes")),
])
def test_non_ascii_letters_in_words(text, expected):
    assert syntax_error(text) == expected


@pytest.mark.parametrize("literal, message, help", [
    ("2__56", "misplaced `_` in the number `2__56`", "`_` goes between two digits, one at a time (`128_256`); write `256`"),
    ("256_", "misplaced `_` in the number `256_`", "`_` goes between two digits, one at a time (`128_256`); write `256`"),
    ("1__0.5", "misplaced `_` in the number `1__0.5`",
     "`_` goes between two digits, one at a time (`128_256`); write `10.5`"),
    ("0256", "integer `0256` has a leading zero", "write `256`"),
    ("-007", "integer `-007` has a leading zero", "write `-7`"),
])
def test_malformed_integer_literals(literal, message, help):
    text = f"model m {{\n    layers = {literal}\n}}"
    with pytest.raises(SpecError) as e:
        parse(text, "s.par")
    [d] = e.value.diagnostics
    assert (d.message, d.span.line, d.span.column, d.help) == (message, 2, 14, help)
    if "leading zero" in message:
        assert "octal" in d.note


def test_well_formed_integer_literals_still_parse():
    spec = parse("parallel { a = 0, b = 128_256, c = -1, d = 0.5, e = 00.5, f = 1_000.5, g = 3e-4 }", "s.par")
    values = [e.value.value for e in spec.blocks[0].entries]
    assert values == [0, 128256, -1, 0.5, 0.5, 1000.5, 3e-4]


def test_model_and_cluster_need_a_name():
    assert errors('model from "llama3-8b" { }\ncluster { gpus_per_node = 8 }\n' + PARALLEL) == [
        ("`model` block needs a name", 1, 1,
         'write `model llama from "llama3-8b" { ... }`; the name is a word such as `llama`', None),
        ("`cluster` block needs a name", 2, 1, "write `cluster gpus { ... }`; the name is a word such as `gpus`",
         None),
    ]


def test_suggestions_are_case_aware():
    found = errors('model m from "llama3-8b" { Layers = 4, norm = RMSNorm }\n'
                   'cluster c from "H100-sxm" { hbm_bw = 3 tb/s }\n' + PARALLEL + "train { optimizer = adamW }\n")
    helps = {message: help for message, _, _, help, _ in found}
    assert helps["unknown key `Layers` in `model`"].startswith(
        "did you mean `layers` (keys are lower_snake_case)? keys of `model` are ")
    assert helps["unknown norm `RMSNorm`"] == \
        "did you mean `rmsnorm` (values are case-sensitive)? norm may be `layernorm` or `rmsnorm`"
    assert helps["unknown cluster preset `H100-sxm`"].startswith(
        "did you mean `h100-sxm` (preset names are case-sensitive)? cluster presets are ")
    assert helps["unknown unit `tb/s`"].startswith("did you mean `TB/s` (units are case-sensitive)? units are ")
    assert helps["unknown optimizer `adamW`"] == \
        "did you mean `adamw` (values are case-sensitive)? optimizer may be `adamw`, `adam` or `sgd`"


def test_did_you_mean_prefers_a_case_insensitive_match():
    from parcompile.config.text import close_matches, did_you_mean
    from parcompile.config.units import UNITS

    assert close_matches("tb/s", UNITS) == ["TB/s"]          # not `Gb/s`, the closest by raw spelling
    assert close_matches("gb/s", UNITS) == ["GB/s", "Gb/s"]  # both differ only in case
    assert close_matches("Gib", UNITS) == ["GiB"]
    assert close_matches("adamW", ["adamw", "adam", "sgd"]) == ["adamw"]
    assert close_matches("hiden", ["hidden", "heads"]) == ["hidden"]
    assert close_matches("zzz", ["hidden"]) == []
    assert did_you_mean("gb/s", UNITS, "units are case-sensitive") == \
        "did you mean `GB/s` or `Gb/s` (units are case-sensitive)? "
    assert did_you_mean("hiden", ["hidden"], "keys are lower_snake_case") == "did you mean `hidden`? "


def test_did_you_mean_prefers_a_preset_cut_or_extended_at_a_dash():
    """`gb200` is the GB200 NVL72 preset, not `b200` (the closer spelling); `b200-sxm` is
    `b200`, not `h100-sxm`; `a100` is either A100."""
    from parcompile.config.presets import CLUSTER_PRESET_NAMES
    from parcompile.config.text import close_matches

    assert close_matches("gb200", CLUSTER_PRESET_NAMES) == ["gb200-nvl72"]
    assert close_matches("b200-sxm", CLUSTER_PRESET_NAMES) == ["b200"]
    assert close_matches("a100", CLUSTER_PRESET_NAMES) == ["a100-40gb", "a100-80gb"]
    assert close_matches("mi300", CLUSTER_PRESET_NAMES) == ["mi300x"]   # no dash: the nearest spelling


@pytest.mark.parametrize("source, word", [(123, "int"), (None, "NoneType"), (b"model m { }", "bytes"),
                                          (bytearray(b"x"), "bytearray"), (["x"], "list")])
def test_compile_rejects_what_is_not_a_spec_at_the_boundary(source, word):
    import parcompile

    with pytest.raises(TypeError) as e:
        parcompile.compile(source)
    assert str(e.value).startswith(f"source must be the spec text (str) or a pathlib.Path, got {word}")
    with pytest.raises(TypeError):
        load_spec(source)
    with pytest.raises(TypeError, match="filename must be a str or None, got int"):
        parcompile.compile(MODEL + CLUSTER, filename=3)


def test_a_key_after_a_number_on_one_line_is_not_read_as_its_unit():
    """`nodes = 1  gpus_per_node = 8`: `gpus` must not be taken as the unit of `1`."""
    from parcompile.frontend import load_spec

    src = 'model m from "llama3-8b" { }\ncluster c from "h100-sxm" { nodes = 1  gpus_per_node = 8 }\n'
    with pytest.raises(SpecError) as e:
        load_spec(src)
    d = e.value.diagnostics[0]
    assert "`gpus_per_node`" in d.message and (d.span.line, d.span.column) == (2, 40)
