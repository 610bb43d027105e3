"""Cross-field checks (parcompile/frontend/checks.py): every message pinned, with its place."""

from __future__ import annotations

import pytest

from parcompile.diagnostics import SpecError
from parcompile.frontend import load_spec

# A valid spec (examples/tiny.par without comments), as block -> key -> value text.
BASE: dict[str, dict[str, str]] = {
    "model tiny": {
        "layers": "4", "hidden": "64", "heads": "4", "kv_heads": "2", "ffn_hidden": "128",
        "vocab": "256", "seq_len": "64", "dtype": "fp32",
    },
    'cluster local from "cpu"': {"nodes": "1", "gpus_per_node": "8"},
    "parallel": {"dp": "2", "tp": "2", "pp": "2", "micro_batch": "2", "global_batch": "16"},
    "train": {"optimizer": "adamw", "lr": "3e-3", "steps": "40"},
}


def spec(drop: tuple[str, ...] = (), **blocks: dict[str, str | None]) -> str:
    """BASE with overrides: ``spec(parallel={"tp": "3"})``; a None value removes the key.

    A block kind not in BASE (``serve``) is added; ``drop`` removes whole blocks.
    """
    out = []
    heads = {h.split()[0]: h for h in BASE}
    for kind in list(heads) + [k for k in blocks if k not in heads]:
        if kind in drop:
            continue
        values = dict(BASE.get(heads.get(kind, kind), {}))
        for k, v in blocks.get(kind, {}).items():
            if v is None:
                values.pop(k, None)
            else:
                values[k] = v
        out.append(heads.get(kind, kind) + " {")
        out += [f"    {k} = {v}" for k, v in values.items()]
        out.append("}")
    return "\n".join(out) + "\n"


def where(text: str, entry: str) -> tuple[int, int]:
    """(line, column) of the value of the entry line ``entry`` (``"tp = 3"``) in ``text``."""
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip() == entry:
            return i, line.index("=") + 3
        if line.startswith(entry):  # a block header
            return i, 1
    raise AssertionError(f"{entry!r} not in spec")


def diags(text: str) -> list[tuple[str, str, int, int, str | None, str | None]]:
    """(severity, message, line, column, help, note) of every diagnostic of ``text``."""
    try:
        _, warnings = load_spec(text, filename="t.par")
        found = warnings
    except SpecError as e:
        found = e.diagnostics
    return [(d.severity, d.message, d.span.line, d.span.column, d.help, d.note) for d in found]


def one(text: str, entry: str) -> tuple[str, str | None, str | None]:
    """The single diagnostic of ``text``; asserts it sits at ``entry``. Returns (message, help, note)."""
    found = diags(text)
    assert len(found) == 1, found
    _, message, line, column, help, note = found[0]
    assert (line, column) == where(text, entry), (found[0], where(text, entry))
    return message, help, note


def test_base_is_valid():
    cfg, warnings = load_spec(spec())
    assert warnings == []
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == (2, 2, 2)


# -- degrees and world size -----------------------------------------------------------------


def test_world_size_mismatch_prints_every_number():
    text = spec(parallel={"dp": "2", "tp": "4"}, model={"kv_heads": "4"})
    assert one(text, "dp = 2") == (
        "dp(2) * tp(4) * pp(2) * cp(1) = 16 != world_size(8) = nodes(1) * gpus_per_node(8)",
        "dp = 1 (or `dp = auto`) fills the world size, or give the cluster 16 GPUs (nodes * gpus_per_node)",
        None)


def test_world_size_mismatch_when_rest_does_not_divide():
    text = spec(parallel={"dp": "1", "tp": "4", "pp": "3", "global_batch": "12"},
                model={"layers": "6", "kv_heads": "4"})
    message, help, _ = one(text, "dp = 1")
    assert message == "dp(1) * tp(4) * pp(3) * cp(1) = 12 != world_size(8) = nodes(1) * gpus_per_node(8)"
    assert help == "tp * pp * cp = 12 must divide world_size(8), or give the cluster 12 GPUs (nodes * gpus_per_node)"


def test_dp_auto_resolves():
    cfg, _ = load_spec(spec(parallel={"dp": "auto", "tp": "4", "pp": "1"}, model={"kv_heads": "4"}))
    assert cfg.parallel.dp == 2 and "dp" in cfg.parallel.auto
    cfg, _ = load_spec(spec(parallel={"dp": None, "tp": "1", "pp": "1"}))
    assert cfg.parallel.dp == 8 and cfg.parallel.auto == ("dp",)


def test_dp_auto_does_not_divide():
    text = spec(parallel={"dp": "auto", "tp": "1", "pp": "3"}, model={"layers": "6"})
    assert one(text, "dp = auto") == (
        "dp = auto: tp(1) * pp(3) * cp(1) = 3 does not divide world_size(8) = nodes(1) * gpus_per_node(8)",
        "choose tp, pp and cp whose product divides 8", None)


def test_other_autos_resolve_to_one_and_are_remembered():
    cfg, _ = load_spec(spec(parallel={"dp": "auto", "tp": "auto", "pp": "auto", "micro_batch": "auto"}))
    p = cfg.parallel
    assert (p.dp, p.tp, p.pp, p.micro_batch) == (8, 1, 1, 1)
    assert p.auto == ("dp", "micro_batch", "pp", "tp")


def test_auto_needs_global_batch():
    text = spec(parallel={"dp": "auto", "pp": "1", "global_batch": None})
    assert one(text, "dp = auto") == ("dp = auto needs `global_batch`",
                                      "add `global_batch = N` (sequences per optimizer step)", None)


# -- heads and widths -----------------------------------------------------------------------


def test_tp_does_not_divide_heads_full_render():
    text = spec(model={"heads": "32", "kv_heads": "8", "hidden": "256", "ffn_hidden": "96"},
                parallel={"dp": "auto", "tp": "3", "pp": "1", "global_batch": "8"},
                **{"cluster": {"gpus_per_node": "6"}})
    with pytest.raises(SpecError) as e:
        load_spec(text, filename="llama.par")
    line, _ = where(text, "tp = 3")
    assert str(e.value) == (
        f"llama.par:{line}:10: error: tp = 3 does not divide heads = 32\n"
        "    tp = 3\n"
        "         ^\n"
        "  help: tp may be 1, 2, 4 or 8 (to divide heads = 32, kv_heads = 8 and ffn_hidden = 96)\n"
        "  note: tp = 3 does not divide kv_heads = 8 either"
    )


def test_tp_does_not_divide_kv_heads_for_training():
    text = spec(model={"heads": "8", "kv_heads": "2"}, parallel={"tp": "4", "dp": "1"})
    assert one(text, "tp = 4") == ("tp = 4 does not divide kv_heads = 2", "for training, tp may be 1 or 2 (to divide heads = 8, kv_heads = 2 and ffn_hidden = 128)",
                                   "serving may also use a multiple of kv_heads (kv heads replicated)")


def test_serve_allows_tp_multiple_of_kv_heads():
    text = spec(drop=("train",), model={"heads": "8", "kv_heads": "2"}, parallel={"tp": "4", "dp": "1"},
                serve={"batch": "1", "prompt_len": "16", "max_new_tokens": "16"})
    cfg, warnings = load_spec(text)
    assert cfg.workload == "serve" and warnings == []
    assert cfg.serve.kv_dtype == "fp32"  # the model dtype


def test_serve_tp_neither_divides_nor_multiple():
    text = spec(drop=("train",), model={"heads": "12", "kv_heads": "4", "hidden": "96", "ffn_hidden": "192"},
                parallel={"tp": "6", "dp": "auto", "pp": "1", "global_batch": "2"},
                cluster={"gpus_per_node": "6"}, serve={"prompt_len": "16", "max_new_tokens": "16"})
    assert one(text, "tp = 6") == ("tp = 6 neither divides nor is a multiple of kv_heads = 4",
                                   "tp may be 1, 2, 4 or 12 (dividing heads = 12 and ffn_hidden = 192, and dividing "
                                   "or a multiple of kv_heads = 4)", None)


def test_kv_heads_must_divide_heads():
    text = spec(model={"kv_heads": "3"})
    assert one(text, "kv_heads = 3") == ("kv_heads = 3 does not divide heads = 4", "kv_heads may be 1, 2 or 4", None)


def test_heads_must_divide_hidden_without_head_dim():
    text = spec(model={"hidden": "66"})
    found = diags(text)
    assert [(m, l, c) for _, m, l, c, _, _ in found] == [
        ("heads = 4 does not divide hidden = 66", *where(text, "heads = 4"))]
    assert found[0][4] == "give `head_dim` explicitly, or use heads = 1, 2, 3, 6, 11, 22, 33 or 66"
    assert load_spec(spec(model={"hidden": "66", "head_dim": "16"}))[0].model.head_dim == 16


def test_tp_must_divide_ffn_hidden():
    text = spec(model={"ffn_hidden": "129"})
    assert one(text, "tp = 2") == ("tp = 2 does not divide ffn_hidden = 129",
                                   "tp may be 1 (to divide heads = 4, kv_heads = 2 and ffn_hidden = 129)", None)


def test_rope_needs_even_head_dims():
    text = spec(model={"hidden": "60", "heads": "4", "kv_heads": "2"})  # head_dim 15
    found = diags(text)
    assert [(m, l, c) for _, m, l, c, _, _ in found] == [
        ("RoPE needs an even number of dims per head: head_dim(15) * rotary_fraction(1) = 15",
         *where(text, "heads = 4"))]


# -- pipeline layers ------------------------------------------------------------------------


def test_layers_not_divisible_are_accepted():
    """Issue 16: the compiler splits them unevenly (tests/test_uneven.py); `stage_layers`
    still gives a split by hand."""
    text = spec(model={"layers": "30", "heads": "8", "kv_heads": "8"},
                parallel={"pp": "4", "tp": "2", "dp": "1", "global_batch": "8"})
    assert not [d for d in load_spec(text)[1] if d.severity == "error"]
    ok = spec(model={"layers": "30"}, parallel={"pp": "4", "tp": "2", "dp": "1", "global_batch": "8",
                                                "stage_layers": "[8, 8, 7, 7]"})
    assert load_spec(ok)[0].parallel.layers_per_chunk(30) == (8, 8, 7, 7)


def test_fewer_layers_than_chunks():
    text = spec(model={"layers": "1"})
    assert one(text, "pp = 2") == ("layers = 1 cannot fill pp(2) * virtual_stages(1) = 2 model chunks",
                                   "use at most 1 model chunk: lower pp or virtual_stages so that "
                                   "pp * virtual_stages <= layers, or give the first (and the last) chunk no "
                                   "layer: `stage_layers = [0, 1]`", None)


def test_fewer_layers_than_chunks_proposes_layer_less_end_chunks():
    """Issue 29: with one or two layers fewer than chunks, the help proposes the
    embedding-only first chunk (and the output-only last one) that fill them."""
    text = spec(model={"layers": "2"}, parallel={"pp": "4", "dp": "1"})
    assert one(text, "pp = 4") == ("layers = 2 cannot fill pp(4) * virtual_stages(1) = 4 model chunks",
                                   "use at most 2 model chunks: lower pp or virtual_stages so that "
                                   "pp * virtual_stages <= layers, or give the first (and the last) chunk no "
                                   "layer: `stage_layers = [0, 1, 1, 0]`", None)
    fixed = spec(model={"layers": "2"}, parallel={"pp": "4", "dp": "1", "stage_layers": "[0, 1, 1, 0]"})
    assert diags(fixed) == []


def test_stage_layers_wrong_length_and_sum():
    text = spec(parallel={"stage_layers": "[1, 1, 2]"})
    assert one(text, "stage_layers = [1, 1, 2]") == (
        "stage_layers has 3 entries, expected pp(2) * virtual_stages(1) = 2",
        "one entry per model chunk, e.g. `stage_layers = [2, 2]`", None)
    text = spec(parallel={"stage_layers": "[2, 3]"})
    assert one(text, "stage_layers = [2, 3]") == ("stage_layers sum to 5, expected layers = 4",
                                                  "e.g. `stage_layers = [2, 2]`", None)


def test_stage_layers_entries_at_least_zero():
    text = spec(parallel={"stage_layers": "[5, -1]"})
    found = diags(text)
    line, col = where(text, "stage_layers = [5, -1]")
    assert [(m, l, c, h) for _, m, l, c, h, _ in found] == [
        ("each stage_layers entry must not be negative, got `-1`", line, col + 4, "use 0 or more")]


def test_stage_layers_layer_less_end_chunks_are_allowed():
    """Issue 29: an embedding-only first chunk and an output-only last chunk (Llama 3 paper
    section 3.3.2; Megatron-Core's --account-for-embedding/loss-in-pipeline-split)."""
    for value in ("[4, 0]", "[0, 4]"):
        cfg, warnings = load_spec(spec(parallel={"stage_layers": value}))
        assert list(cfg.parallel.stage_layers) == [int(x) for x in value.strip("[]").split(",")]
        assert warnings == []
    cfg, _ = load_spec(spec(parallel={"pp": "4", "dp": "1", "stage_layers": "[0, 2, 2, 0]"}))
    assert cfg.parallel.layers_per_chunk(4) == (0, 2, 2, 0)


def test_stage_layers_zero_in_a_middle_chunk():
    text = spec(parallel={"pp": "4", "dp": "1", "stage_layers": "[2, 0, 1, 1]"})
    message, help, note = one(text, "stage_layers = [2, 0, 1, 1]")
    assert message == ("stage_layers entry 2 of 4 is 0: only the first model chunk (the embedding) and the last "
                       "one (the output layer and the loss) may hold no layers")
    assert help == "give every middle model chunk at least one layer, e.g. `stage_layers = [1, 1, 1, 1]`"
    assert note == "a middle model chunk with no layers would run nothing"
    # the first of several is named, the count in the note
    text = spec(parallel={"pp": "4", "dp": "1", "stage_layers": "[0, 0, 0, 4]", "virtual_stages": None})
    message, help, note = one(text, "stage_layers = [0, 0, 0, 4]")
    assert message.startswith("stage_layers entry 2 of 4 is 0") and note.endswith("(2 such entries)")


# -- batches and schedules ------------------------------------------------------------------


def test_global_batch_not_divisible():
    text = spec(parallel={"global_batch": "18"})
    assert one(text, "global_batch = 18") == (
        "global_batch = 18 is not divisible by micro_batch(2) * dp(2) = 4",
        "nearest valid global batches: 16 or 20", None)
    text = spec(parallel={"global_batch": "3"})
    assert one(text, "global_batch = 3")[1] == "nearest valid global batches: 4"


def test_interleaved_needs_m_multiple_of_pp():
    text = spec(model={"layers": "8"},
                parallel={"schedule": "interleaved_1f1b", "virtual_stages": "2", "global_batch": "12"})
    assert one(text, "schedule = interleaved_1f1b") == (
        "interleaved_1f1b needs the number of micro-batches to be a multiple of pp = 2, "
        "got m = 3 = global_batch(12) / (micro_batch(2) * dp(2))",
        "global_batch may be 8 or 16 (multiples of micro_batch(2) * dp(2) * pp(2) = 8), or use schedule = 1f1b",
        None)


def test_virtual_stages_need_interleaved():
    text = spec(model={"layers": "8"}, parallel={"virtual_stages": "2"})
    assert one(text, "virtual_stages = 2") == (
        "virtual_stages = 2 needs schedule = interleaved_1f1b, not 1f1b",
        "set `schedule = interleaved_1f1b`, or `virtual_stages = 1`", None)


def test_1f1b_with_few_microbatches_warns():
    text = spec(parallel={"global_batch": "4"})
    cfg, warnings = load_spec(text, filename="t.par")
    assert [(d.severity, d.message, d.span.line, d.span.column, d.help) for d in warnings] == [
        ("warning", "1f1b with m = 1 micro-batch on pp = 2 stages: the bubble grows",
         *where(text, "global_batch = 4"), "global_batch >= 8 gives m >= pp")]


def test_sequence_parallel_needs_tp():
    text = spec(model={"heads": "4"}, parallel={"tp": "1", "dp": "4", "global_batch": "16",
                                                 "sequence_parallel": "true"})
    assert one(text, "sequence_parallel = true") == (
        "sequence_parallel needs tp > 1", "set tp > 1, or `sequence_parallel = false`", None)
    text = spec(model={"seq_len": "63"}, parallel={"sequence_parallel": "true"})
    assert one(text, "sequence_parallel = true")[0] == "sequence_parallel needs tp = 2 to divide seq_len = 63"


def test_context_parallel_needs_seq_len_multiple_of_2cp():
    text = spec(model={"seq_len": "66"}, parallel={"cp": "2", "dp": "1"})
    assert one(text, "cp = 2") == (
        "cp = 2 needs seq_len = 66 to be divisible by 2 * cp = 4", "seq_len may be 64 or 68 (multiples of 2 * cp = 4)",
        "context parallelism splits each sequence into 2 * cp chunks to balance causal attention")


# -- experts ----------------------------------------------------------------------------------


def test_ep_without_experts():
    text = spec(parallel={"ep": "2"})
    assert one(text, "ep = 2") == ("ep = 2 needs a mixture-of-experts model, but experts = 0",
                                   "set `experts` in the `model` block, or `ep = 1`", None)


def test_ep_must_divide_experts():
    text = spec(model={"experts": "6"}, parallel={"ep": "4", "sequence_parallel": "true"})
    found = diags(text)
    line, col = where(text, "ep = 4")
    assert [(m, l, c) for _, m, l, c, _, _ in found] == [
        ("ep = 4 does not divide experts = 6", line, col),
        ("expert_tp(2) * ep(4) = 8 does not divide tp(2) * cp(1) * dp(2) = 4", line, col),
    ]
    assert found[0][4] == ("ep may be 1 or 2 (dividing experts = 6, with expert_tp(2) * ep dividing "
                           "tp(2) * cp(1) * dp(2) = 4)")
    assert found[1][5] == ("experts fold onto the tp * cp * dp ranks of each stage: "
                           "expert_dp = tp * cp * dp / (expert_tp * ep)")


def test_moe_ok_and_expert_dp():
    cfg, _ = load_spec(spec(model={"experts": "4"}, parallel={"ep": "2", "expert_tp": "1", "sequence_parallel": "true"}))
    assert cfg.parallel.expert_dp == 2 and cfg.model.top_k == 2


def test_top_k_and_dense_layers_bounds():
    text = spec(model={"experts": "2", "top_k": "3"}, parallel={"sequence_parallel": "true"})
    assert one(text, "top_k = 3")[0] == "top_k = 3 exceeds experts = 2"
    text = spec(model={"dense_layers": "5"})
    assert one(text, "dense_layers = 5")[0] == "dense_layers = 5 exceeds layers = 4"


def test_expert_tp_must_divide_expert_ffn():
    text = spec(model={"experts": "2", "expert_ffn_hidden": "33"}, parallel={"expert_tp": "2", "sequence_parallel": "true"})
    assert one(text, "expert_tp = 2") == ("expert_tp = 2 does not divide expert_ffn_hidden = 33",
                                          "expert_tp may be 1, 3, 11 or 33", None)


def test_moe_with_tp_needs_sequence_parallel():
    text = spec(model={"experts": "4"}, parallel={"ep": "2"})
    assert one(text, "tp = 2") == (
        "a mixture-of-experts model with tp = 2 needs sequence_parallel = true",
        "set sequence_parallel = true in the `parallel` block",
        "each tp rank routes its own part of the sequence (Megatron-Core requires sequence "
        "parallelism for MoE with tensor parallelism)")
    # a rule of the checks table: `check` reports it together with the spec's other errors
    text = spec(model={"experts": "4"}, parallel={"ep": "2", "global_batch": "10"})
    found = diags(text)
    assert [(m, (l, c)) for _, m, l, c, _, _ in found] == [
        ("a mixture-of-experts model with tp = 2 needs sequence_parallel = true", where(text, "tp = 2")),
        ("global_batch = 10 is not divisible by micro_batch(2) * dp(2) = 4", where(text, "global_batch = 10")),
    ]
    assert diags(spec(model={"experts": "4"}, parallel={"ep": "2", "sequence_parallel": "true"})) == []
    assert diags(spec(model={"experts": "4"}, parallel={"ep": "2", "tp": "1", "dp": "4"})) == []


def test_moe_sequence_parallel_rule_reaches_compile_through_the_checks(monkeypatch):
    """`parcompile.compile` reports the rule from the checks run, with the spec's other
    errors in one SpecError, before any pass runs."""
    import parcompile
    import parcompile.passes.manager as manager

    monkeypatch.setattr(manager, "lower", lambda *a, **k: pytest.fail("compile lowered a spec with errors"))
    text = spec(model={"experts": "4"}, parallel={"ep": "2", "global_batch": "10"})
    with pytest.raises(SpecError) as e:
        parcompile.compile(text, filename="t.par")
    assert [d.message for d in e.value.diagnostics] == [
        "a mixture-of-experts model with tp = 2 needs sequence_parallel = true",
        "global_batch = 10 is not divisible by micro_batch(2) * dp(2) = 4"]


def test_virtual_stages_with_1f1b_or_zero_bubble_come_from_the_checks(monkeypatch):
    """1f1b and zero_bubble run one model chunk per rank: the checks table says so at
    `virtual_stages` with a fix, together with the spec's other errors, before the
    schedule pass (whose own refusal is only an internal assertion) runs."""
    import parcompile
    import parcompile.passes.manager as manager

    monkeypatch.setattr(manager, "lower", lambda *a, **k: pytest.fail("compile lowered a spec with errors"))
    for sched in ("1f1b", "zero_bubble"):
        text = spec(model={"layers": "8"}, parallel={"virtual_stages": "2", "schedule": sched,
                                                     "global_batch": "10"})
        with pytest.raises(SpecError) as e:
            parcompile.compile(text, filename="t.par")
        found = [(d.message, (d.span.line, d.span.column), d.help) for d in e.value.diagnostics]
        assert found == [   # in source order: global_batch is written before virtual_stages
            ("global_batch = 10 is not divisible by micro_batch(2) * dp(2) = 4", where(text, "global_batch = 10"),
             "nearest valid global batches: 8 or 12"),
            (f"virtual_stages = 2 needs schedule = interleaved_1f1b, not {sched}", where(text, "virtual_stages = 2"),
             "set `schedule = interleaved_1f1b`, or `virtual_stages = 1`"),
        ]


# -- order, train, serve ----------------------------------------------------------------------


def test_order_must_be_a_permutation():
    text = spec(parallel={"order": '"tp-dp-dp-pp"'})
    assert one(text, 'order = "tp-dp-dp-pp"') == (
        "order `tp-dp-dp-pp` is not a permutation of tp, cp, ep, dp and pp",
        'the five axes joined by `-`, fastest-varying first, e.g. "tp-cp-ep-dp-pp"',
        "missing `cp` and `ep`; unexpected or repeated `dp`")
    assert load_spec(spec(parallel={"order": "tp-dp-pp-cp-ep"}))[0].parallel.order == "tp-dp-pp-cp-ep"


def test_train_checks():
    text = spec(train={"min_lr": "1e-2"})
    assert one(text, "min_lr = 1e-2")[0] == "min_lr = 0.01 exceeds lr = 0.003"
    text = spec(train={"checkpoint_every": "10"})
    assert one(text, "checkpoint_every = 10") == ("checkpoint_every = 10 needs `checkpoint_dir`",
                                                  'add `checkpoint_dir = "checkpoints"`', None)
    text = spec(train={"warmup_steps": "50"})
    assert diags(text) == [("warning", "warmup_steps = 50 exceeds steps = 40: the learning rate never leaves warmup",
                            *where(text, "warmup_steps = 50"), None, None)]


def test_serve_request_longer_than_seq_len():
    text = spec(drop=("train",), serve={"prompt_len": "48", "max_new_tokens": "32"})
    assert one(text, "max_new_tokens = 32") == (
        "prompt_len(48) + max_new_tokens(32) = 80 exceeds seq_len = 64",
        "nearest feasible: max_new_tokens = 16 for this prompt; or raise the model's `seq_len` (at most its "
        "max_positions)", None)


def test_one_mistake_one_error():
    """A wrong value is not re-reported by the checks that read it."""
    text = spec(parallel={"tp": "x"}, model={"heads": "zero"})
    assert [m for _, m, *_ in diags(text)] == ["expected an integer, got `zero`", "expected an integer, got `x`"]


def test_all_errors_in_source_order():
    text = spec(model={"kv_heads": "3"}, parallel={"global_batch": "18", "order": "tp"})
    lines = [l for _, _, l, *_ in diags(text)]
    assert len(lines) == 3 and lines == sorted(lines)


def test_help_lists_stay_short():
    from parcompile.config.text import choices_words, divisors, even_split

    assert choices_words(divisors(32)) == "1, 2, 4, 8, 16 or 32"
    assert choices_words(divisors(5040)) == "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, ... or 5040"
    assert divisors(10**13) == []  # too large to list in a help line
    assert even_split(30, 4) == [8, 8, 7, 7] and even_split(8, 4) == [2, 2, 2, 2]
    text = spec(model={"hidden": str(2**41), "heads": "4", "ffn_hidden": str(2**41 + 1)})
    assert one(text, "tp = 2") == (f"tp = 2 does not divide ffn_hidden = {2**41 + 1}",
                                   f"tp may be 1 (to divide heads = 4, kv_heads = 2 and ffn_hidden = {2**41 + 1})", None)


def test_sizes_beyond_what_a_plan_is_built_for():
    """Limits that keep every compile to seconds (the fuzz tests rely on them: no hangs)."""
    text = spec(model={"layers": "65536"})
    assert one(text, "layers = 65536")[0] == "layers = 65536 is more than parcompile plans (at most 512)"
    text = spec(cluster={"nodes": "65536", "gpus_per_node": "8"}, parallel={"dp": "auto"})
    assert diags(text)[0][1] == ("world_size(524288) = nodes(65536) * gpus_per_node(8) is more than "
                                 "parcompile plans (at most 131072 ranks)")
    text = spec(parallel={"global_batch": "400000"})
    message, help, _ = one(text, "global_batch = 400000")
    assert message == ("m(100000) * pp(2) * virtual_stages(1) = 200000 micro-batch steps per optimizer step is "
                       "more than the pipeline schedule is simulated for (at most 65536)")
    assert help == "raise micro_batch (m = global_batch / (micro_batch * dp) = 400000 / (2 * 2)) or lower global_batch"


# -- keys written to no effect are warnings ----------------------------------------------------


def test_top_k_on_a_dense_model_warns():
    text = spec(model={"experts": "0", "top_k": "2"})
    assert diags(text) == [("warning", "top_k = 2 has no effect: experts = 0 makes a dense model",
                            *where(text, "top_k = 2"),
                            "remove `top_k`, or set `experts` for a mixture-of-experts model", None)]


def test_rotary_fraction_and_rope_theta_without_rope_warn():
    text = spec(model={"position": "learned", "rotary_fraction": "0.5", "rope_theta": "500000"})
    assert diags(text) == [
        ("warning", "rotary_fraction = 0.5 has no effect with position = learned", *where(text, "rotary_fraction = 0.5"),
         "remove `rotary_fraction`, or set `position = rope`",
         "rotary_fraction is the share of each head's dims that get RoPE"),
        ("warning", "rope_theta = 500000 has no effect with position = learned", *where(text, "rope_theta = 500000"),
         "remove `rope_theta`, or set `position = rope`", "rope_theta is the base of RoPE's frequencies"),
    ]
    assert diags(spec(model={"position": "rope", "rotary_fraction": "0.5"})) == []


def test_expert_tp_on_a_dense_model_warns():
    text = spec(parallel={"expert_tp": "1"})
    assert diags(text) == [("warning", "expert_tp = 1 has no effect: the model has no experts (experts = 0)",
                            *where(text, "expert_tp = 1"),
                            "remove `expert_tp`, or set `experts` in the `model` block", None)]


def test_zero_without_data_parallelism_warns():
    text = spec(parallel={"dp": "1", "tp": "2", "pp": "2", "global_batch": "8", "zero": "3"},
                cluster={"gpus_per_node": "4"})
    assert diags(text) == [("warning", "zero = 3 has no effect: with dp * cp = 1 there is no data-parallel "
                            "group to shard over", *where(text, "zero = 3"),
                            "remove `zero`, or give dp (or cp) more than one rank",
                            "ZeRO shards optimizer states, gradients and (zero = 3) parameters over the "
                            "dp * cp ranks that hold the same weights")]
    # with a data-parallel (or context-parallel) group there is something to shard; with
    # dp = auto the spec leaves dp to the cluster (SPEC's own example: zero = 1, dp = auto = 1)
    assert diags(spec(parallel={"dp": "2", "tp": "2", "pp": "1", "global_batch": "8", "zero": "3"},
                      cluster={"gpus_per_node": "4"})) == []
    assert diags(spec(parallel={"dp": "auto", "tp": "2", "pp": "2", "global_batch": "8", "zero": "3"},
                      cluster={"gpus_per_node": "4"})) == []


def test_max_positions_without_learned_positions_warns():
    text = spec(model={"max_positions": "128"})
    assert diags(text) == [("warning", "max_positions = 128 has no effect with position = rope",
                            *where(text, "max_positions = 128"),
                            "remove `max_positions`, or set `position = learned`",
                            "max_positions is the number of rows of a learned position table")]


def test_learned_positions_need_max_positions_at_least_seq_len():
    cfg, warnings = load_spec(spec(model={"position": "learned"}))
    assert cfg.model.max_positions == cfg.model.seq_len == 64 and warnings == []
    cfg, _ = load_spec(spec(model={"position": "learned", "max_positions": "128"}))
    assert cfg.model.max_positions == 128
    text = spec(model={"position": "learned", "max_positions": "32"})
    assert one(text, "seq_len = 64") == (
        "seq_len = 64 exceeds max_positions = 32, the rows of the learned position table",
        "use seq_len <= 32, or write `max_positions = 64` (a larger table)", None)


def test_list_entries_are_worded_in_the_singular():
    text = spec(train={"betas": "[0.9, 2]"})
    [(severity, message, line, column, help, note)] = diags(text)
    assert message == "each betas entry must be in [0, 1), got `2`"
    assert help == "each betas entry is a fraction: write e.g. `0.1` or `10%`"
    found = diags(spec(parallel={"stage_layers": "[1, x]"}))
    assert [(d[1], d[4]) for d in found] == [("expected an integer, got `x`", "each stage_layers entry takes a whole number")]


def test_does_not_fit_help_suggests_only_what_is_not_set():
    """Issue 16: a spec already at zero = 1 is not told to shard optimizer states (zero = 1)."""
    import parcompile

    base = ('model m from "llama3-70b" {{ seq_len = 4096 }}\ncluster c from "h100-sxm" {{ nodes = 1 }}\n'
            'parallel {{ tp = 8, micro_batch = 1, global_batch = 8{extra} }}\ntrain {{ }}\n')
    helps = {}
    for extra in ("", ", zero = 1", ", zero = 3, recompute = full"):
        plan = parcompile.compile(base.format(extra=extra))
        [d] = [w for w in plan.warnings if w.code == "does-not-fit"]
        helps[extra] = d.help
        assert d.help[0].upper() + d.help[1:] + "." in plan.report_md()   # report.md says the same
    assert helps[""] == "raise tp or pp, shard optimizer states (zero = 1) or recompute activations " \
                        "(recompute = selective or full)"
    assert helps[", zero = 1"] == "raise tp or pp, also shard gradients (zero = 2) or recompute activations " \
                                  "(recompute = selective or full)"
    assert helps[", zero = 3, recompute = full"] == "raise tp or pp"


def test_engine_on_a_serve_spec_warns_and_changes_nothing():
    """`cluster.engine` names the training engine of the training estimate: on a serve spec it
    is a warning at the key, and the serve plan is the same with either engine."""
    from pathlib import Path

    import parcompile

    path = Path(__file__).resolve().parents[1] / "examples" / "tiny_serve.par"
    base = path.read_text()
    plans = {}
    for engine in ("megatron", "eager"):
        text = base.replace("    gpus_per_node = 4\n", f"    gpus_per_node = 4\n    engine = {engine}\n", 1)
        assert text != base
        plan = parcompile.compile(text, filename=str(path))
        warned = [w for w in plan.warnings if "engine" in w.message]
        assert [w.message for w in warned] == [f"engine = {engine} has no effect: a `serve` spec's estimate "
                                                "does not use it"]
        line = text.splitlines().index(f"    engine = {engine}") + 1
        assert (warned[0].span.line, warned[0].span.column) == (line, 14) and warned[0].help == "remove `engine`"
        plans[engine] = plan.data["serve"]
    assert plans["eager"] == plans["megatron"]


@pytest.mark.parametrize("domain, ok", [("3", False), ("12", False), ("4", True), ("1", True), ("16", True),
                                        ("72", True)])
def test_nvlink_domain_holds_whole_nodes_or_a_node_whole_domains(domain, ok):
    """The network model groups `nvlink_domain` consecutive ranks: a domain that would split
    a node of 8 (3, 12) is refused at the key with the nearest sizes that do not."""
    text = spec(cluster={"nvlink_domain": domain})
    if ok:
        assert diags(text) == []
        return
    message, help, note = one(text, f"nvlink_domain = {domain}")
    assert message == (f"nvlink_domain = {domain} is neither a divisor nor a multiple of gpus_per_node = 8: "
                       "a domain would split a node")
    assert help == {"3": "nvlink_domain = 2 or 8", "12": "nvlink_domain = 8 or 16"}[domain] + \
        ", or remove it (a domain is then the node)"


def test_overlap_keys_warn_where_they_do_nothing():
    # tp_comm_overlap: sequence parallelism over tp > 1 under the megatron engine; overlap_p2p_comm:
    # interleaved 1F1B with virtual stages (Megatron-LM's rules)
    text = spec(cluster={"tp_comm_overlap": "true"})   # BASE: tp 2 without sequence parallelism
    msg, help, _ = one(text, "tp_comm_overlap = true")
    assert msg.startswith("tp_comm_overlap has no effect: it overlaps sequence parallelism's") and "remove" in help
    text = spec(cluster={"tp_comm_overlap": "true", "engine": "eager"}, parallel={"sequence_parallel": "true"})
    assert one(text, "tp_comm_overlap = true")[0].startswith("tp_comm_overlap has no effect: engine = eager")
    assert diags(spec(cluster={"tp_comm_overlap": "true"}, parallel={"sequence_parallel": "true"})) == []
    text = spec(cluster={"overlap_p2p_comm": "true"})   # BASE: pp 2, 1F1B
    assert one(text, "overlap_p2p_comm = true")[0] == ("overlap_p2p_comm has no effect: Megatron-LM overlaps pipeline "
                                                       "transfers only in interleaved 1F1B with virtual stages")
    assert diags(spec(cluster={"overlap_p2p_comm": "true"},
                      parallel={"schedule": "interleaved_1f1b", "virtual_stages": "2"})) == []


@pytest.mark.parametrize("preset, refused", [("ascend-910b", True), ("a100-80gb", False), ("h100-sxm", False),
                                             ("cpu", False)])
def test_kv_dtype_fp8_needs_a_device_with_an_fp8_type(preset, refused):
    """Tester: `kv_dtype = fp8` was accepted on Ascend 910B, which has no FP8 type. An FP8 KV
    cache is storage (cast to 16 bits for attention): vLLM keeps one on Ampere too (A100, no
    FP8 GEMM), so only a device without FP8 tensors at all refuses it, at the value."""
    from parcompile.config.presets import fp8_storage_presets

    text = spec(drop=("train",), parallel={"tp": "2", "dp": "1", "pp": "1", "global_batch": None},
                cluster={"gpus_per_node": "2"}, serve={"batch": "1", "prompt_len": "16", "max_new_tokens": "16",
                                                       "kv_dtype": "fp8"})
    text = text.replace('from "cpu"', f'from "{preset}"')
    if not refused:
        cfg, warnings = load_spec(text)
        assert cfg.serve.kv_dtype == "fp8" and warnings == []
        return
    have = fp8_storage_presets()
    assert "a100-80gb" in have and "ascend-910b" not in have
    message, help, note = one(text, "kv_dtype = fp8")
    assert message == "kv_dtype = fp8 needs FP8 tensors: cluster preset `ascend-910b` has no FP8 type"
    assert help == "use a cluster `from` " + " or ".join(f"`{p}`" for p in have[:-1]).replace(" or ", ", ") \
        + f" or `{have[-1]}`, or set kv_dtype = bf16 or fp16 (or remove it: the model's dtype)"


def test_serve_memory_advice_offers_an_fp8_cache_only_where_the_devices_have_fp8():
    """What would make a serve batch fit names `kv_dtype = fp8` on A100 (FP8 storage, no FP8
    GEMM), never on Ascend 910B, where that value is an error."""
    import parcompile

    helps = {}
    for preset in ("ascend-910b", "a100-40gb"):
        text = (f'model m from "llama3-8b" {{ seq_len = 8192 }}\ncluster c from "{preset}" {{ nodes = 1 }}\n'
                # a small prefill budget: the KV cache, not the prefill workspace (every row of a
                # step padded to its chunk), is what does not fit
                'parallel { tp = 8 }\nserve { batch = 500, prompt_len = 4096, max_new_tokens = 4096, '
                'max_prefill_tokens = 256 }\n')
        [d] = [w for w in parcompile.compile(text).warnings if w.code == "does-not-fit"]
        helps[preset] = d.help
    assert helps["ascend-910b"].endswith("; lower batch, raise tp or pp") and "fp8" not in helps["ascend-910b"]
    assert helps["a100-40gb"].endswith("; lower batch, raise tp or pp, or set kv_dtype = fp8")


@pytest.mark.parametrize("blocks, message", [
    (dict(model={"hidden": "60", "heads": "4", "kv_heads": "2"}), "RoPE needs an even number of dims per head"),
    (dict(model={"experts": "4", "top_k": "5"}, parallel={"tp": "1", "pp": "1", "dp": "8"}), "top_k = 5 exceeds"),
    (dict(model={"experts": "4", "top_k": "2", "dense_layers": "5"}, parallel={"tp": "1", "pp": "1", "dp": "8"}),
     "dense_layers = 5 exceeds layers = 4"),
    (dict(train={"lr": "1e-3", "min_lr": "2e-3"}), "min_lr = 0.002 exceeds lr = 0.001"),
    (dict(model={"layers": "100000"}), "layers = 100000 is more than parcompile plans"),
    (dict(cluster={"nodes": "100000"}), "is more than parcompile plans"),
    (dict(train={"lr": "1e400"}), "expected a finite number, got `1e400`"),
])
def test_every_error_says_how_to_fix_it(blocks, message):
    """House rule: every bad input gets a diagnostic with file:line:col and a fix (a help
    line); these had the message alone."""
    if "cluster" in blocks:
        blocks = {'cluster local from "cpu"': blocks.pop("cluster"), **blocks}
        text = spec(**{k: v for k, v in blocks.items() if not k.startswith("cluster")}).replace(
            'cluster local from "cpu" {\n    nodes = 1', 'cluster local from "cpu" {\n    nodes = 100000')
    else:
        text = spec(**blocks)
    found = [d for d in diags(text) if d[0] == "error" and message in d[1]]
    assert found, diags(text)
    assert all(d[4] for d in found), found
