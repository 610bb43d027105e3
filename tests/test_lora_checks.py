"""LoRA's spec keys and checks (parcompile/frontend/checks_lora.py, core/lora.py): each hostile
value is one diagnostic at its file:line:col."""

from __future__ import annotations

import pytest

from parcompile.core.lora import lora_linears, targeted
from parcompile.frontend import load_spec

from tests.test_checks import one, spec, where

LORA = {"method": "lora"}


def lora(**train: str) -> str:
    return spec(train={**LORA, **train})


def test_defaults_and_names():
    cfg, warnings = load_spec(lora())
    t = cfg.train
    assert warnings == []
    assert (t.method, t.lora_rank, t.lora_alpha, t.lora_dropout, t.lora_targets) == ("lora", 16, 32, 0, ("all-linear",))
    assert len(targeted(cfg.model, t.lora_targets)) == 7 * 4
    # the spec's names and Hugging Face's name the same layers
    cfg2, _ = load_spec(lora(lora_targets='["q_proj", "wv", "down_proj"]'))
    assert [x.module for x in targeted(cfg2.model, cfg2.train.lora_targets)][:3] == \
        ["layers.0.attn.wq", "layers.0.attn.wv", "layers.0.mlp.w2"]
    cfg3, _ = load_spec(lora(lora_targets='"o_proj"'))
    assert cfg3.train.lora_targets == ("o_proj",)


def test_hf_names_are_transformers_module_names():
    """The Hugging Face leaf names are the modules of transformers' own LlamaForCausalLM."""
    transformers = pytest.importorskip("transformers")
    cfg, _ = load_spec(lora())
    m = cfg.model
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=m.hidden, intermediate_size=m.ffn_hidden, num_hidden_layers=1,
        num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, vocab_size=m.vocab))
    linear = {n.rsplit(".", 1)[-1] for n, mod in hf.model.layers.named_modules()
              if isinstance(mod, transformers.pytorch_utils.nn.Linear)}
    assert {x.hf_leaf for x in lora_linears(m)} == linear


@pytest.mark.parametrize("entry, message, help_has", [
    ("lora_rank = 0", "lora_rank must be", None),
    ("lora_rank = 100", "lora_rank = 100 exceeds 32, the smaller side of wk (32 x 64)", "at most 32"),
    ("lora_rank = 3", "lora_rank = 3 is not a multiple of tp = 2", "multiple of 2"),
    ('lora_targets = ["q_proj", "qkv"]', "lora_targets names `qkv`, which the model does not have", "q_proj"),
    ("lora_targets = []", "lora_targets is empty", "all-linear"),
    ("lora_dropout = 1", "lora_dropout must be in [0, 1)", None),
    ("lora_dropout = -0.1", "lora_dropout must be", None),
])
def test_hostile_values(entry, message, help_has):
    key, value = (s.strip() for s in entry.split("=", 1))
    text = lora(**{key: value})
    msg, help, _ = one(text, entry)
    assert msg.startswith(message), msg
    if help_has:
        assert help_has in help


def test_lora_merge_needs_method_lora():
    text = spec(train={"lora_merge": "true"})
    msg, _, _ = one(text, "lora_merge = true")
    assert msg == "lora_merge needs method = lora; this spec has method = full"


def test_lora_keys_need_method_lora():
    text = spec(train={"lora_rank": "8"})
    msg, help, _ = one(text, "lora_rank = 8")
    assert msg == "lora_rank needs method = lora; this spec has method = full"
    assert "method = lora" in help


def test_method_word_checked():
    text = spec(train={"method": "qlora"})
    msg, help, _ = one(text, "method = qlora")
    assert msg == "unknown method `qlora`" and "`full` or `lora`" in help


def test_program_refuses_what_lora_does_not_run_yet(tmp_path):
    """`compile` writes no program for LoRA with FP8 (its adapters run 16-bit GEMMs); a plain
    LoRA spec compiles."""
    import parcompile
    from parcompile.diagnostics import SpecError

    parcompile.compile(lora()).write(tmp_path / "ok")
    assert (tmp_path / "ok" / "program.py").is_file()
    plan = parcompile.compile(lora(precision="fp8"))
    with pytest.raises(SpecError) as e:
        plan.write(tmp_path / "out")
    assert any("LoRA adapters with FP8" in d.message for d in e.value.diagnostics)


@pytest.mark.parametrize("target", ["megatron"])
def test_exports_refuse_lora_they_do_not_carry(target):
    """An export of a LoRA spec for an engine without LoRA would train every weight: refused,
    naming why (the others carry it: tests/test_export_lora.py)."""
    import parcompile

    out = parcompile.export(parcompile.compile(lora()), target)
    assert any(e.startswith("method = lora:") for e in out.errors), out.errors
    assert not any(e.startswith("method = lora:") for e in parcompile.export(parcompile.compile(spec()), target).errors)


@pytest.mark.parametrize("blocks, entry, what", [
    (dict(train={**LORA, "precision": "fp8"}), "precision = fp8", "LoRA adapters with FP8"),
    (dict(parallel={"schedule": "zero_bubble"}, train=LORA), "schedule = zero_bubble",
     "LoRA adapters with the zero-bubble schedule"),
    (dict(model={"experts": "4", "top_k": "2"}, parallel={"zero": "3", "sequence_parallel": "true"}, train=LORA),
     "zero = 3",
     "LoRA with zero = 3 on an MoE model"),
])
def test_program_refusals_are_one_line_at_their_key(tmp_path, blocks, entry, what):
    """Each LoRA feature the program does not run is its own one-line error at the key that
    asks for it, with the reason in its help (was: one error for three features at
    `method`)."""
    import parcompile
    from parcompile.diagnostics import SpecError

    text = spec(**blocks)
    with pytest.raises(SpecError) as e:
        parcompile.compile(text).write(tmp_path / "out")
    got = [d for d in e.value.diagnostics if what in d.message]
    assert len(got) == 1 and "\n" not in got[0].message and got[0].help, e.value.diagnostics
    assert (got[0].span.line, got[0].span.column) == where(text, entry)
