"""`from "config.json"`: imported Hugging Face configs give the published parameter counts.

``tests/data/hf/*.json`` reproduce the fields of the models' published ``config.json``
files. Each is imported through a spec and compiled all the way to a plan; the plan's
``model.params`` (the graph's count, unpadded vocabulary) must equal the count the model
card / safetensors index publishes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import parcompile
from parcompile.core.hf import HFConfigError, from_hf_dict, load_hf_config
from parcompile.config.schema import ModelConfig

from tests.test_presets import count_params

HF = Path(__file__).resolve().parent / "data" / "hf"

# name -> (published parameter count, what the import must also say)
PUBLISHED = {
    "llama-2-7b": (6_738_415_616, {"kv_heads": 32, "ffn_hidden": 11008, "dtype": "fp16", "seq_len": 4096}),
    "mistral-7b-v0.1": (7_241_732_096, {"kv_heads": 8, "sliding_window": 4096, "rope_theta": 10000.0}),
    "qwen2-7b": (7_615_616_512, {"kv_heads": 4, "qkv_bias": True, "bias": False, "sliding_window": 0,
                                 "norm_eps": 1e-6, "rope_theta": 1e6}),
    "qwen2-0.5b": (494_032_768, {"tie_embeddings": True, "qkv_bias": True}),
    "gpt2": (124_439_808, {"position": "learned", "norm": "layernorm", "activation": "gelu", "bias": True,
                           "tie_embeddings": True, "seq_len": 1024}),
    "pythia-160m": (162_322_944, {"parallel_residual": True, "rotary_fraction": 0.25, "bias": True,
                                  "tie_embeddings": False, "dtype": "fp16"}),
    # Qwen/Qwen3-30B-A3B (qwen3_moe: `num_experts`, no dense layers, norm_topk_prob true)
    "qwen3-30b-a3b": (30_532_122_624, {"experts": 128, "top_k": 8, "expert_ffn_hidden": 768, "ffn_hidden": 6144,
                                       "dense_layers": 0, "norm_topk_prob": True, "router_aux_loss": 0.001,
                                       "qk_norm": True, "head_dim": 128, "kv_heads": 4, "sliding_window": 0,
                                       "qkv_bias": False, "dtype": "bf16", "seq_len": 40960}),
}


def spec_for(name: str, tmp_path: Path) -> Path:
    """A spec importing ``tests/data/hf/NAME.json`` on one GPU.

    Short sequences keep it quick; a learned position table keeps its ``n_positions`` rows
    (``max_positions``) whatever ``seq_len`` is, so GPT-2 still counts 124,439,808.
    """
    body = "\n    seq_len = 512\n"
    spec = tmp_path / f"{name}.par"
    spec.write_text(f'model m from "{HF / (name + ".json")}" {{{body}}}\n'
                    'cluster c from "h100-sxm" {\n    gpus_per_node = 1\n}\n')
    return spec


def test_fixtures_are_all_used():
    assert sorted(p.stem for p in HF.glob("*.json")) == sorted([*PUBLISHED, "mixtral-8x7b-v0.1"])


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_imported_parameter_count_equals_the_published_one(name, tmp_path):
    params, facts = PUBLISHED[name]
    plan = parcompile.compile(spec_for(name, tmp_path))
    assert plan.data["model"]["params"] == params
    m = plan.config.model
    for key, value in facts.items():
        if key != "seq_len":
            assert getattr(m, key) == value, key
    if "seq_len" in facts:  # from max_position_embeddings, before the block overrode it
        assert load_hf_config(HF / f"{name}.json")["seq_len"] == facts["seq_len"]


def test_block_keys_override_the_import(tmp_path):
    spec = tmp_path / "s.par"
    spec.write_text(f'model m from "{HF / "llama-2-7b.json"}" {{\n    layers = 2\n    seq_len = 256\n'
                    '    dtype = bf16\n}\ncluster c from "h100-sxm" { gpus_per_node = 1 }\n')
    plan = parcompile.compile(spec)
    assert (plan.config.model.layers, plan.config.model.dtype, plan.config.model.seq_len) == (2, "bf16", 256)


def test_mixtral_import_counts_46_7b():
    """MoE layers are not lowered to the graph yet (issue 8), so the import is counted with
    the standard formula of tests/test_presets.py (the same one that checks the presets)."""
    values = load_hf_config(HF / "mixtral-8x7b-v0.1.json")
    m = ModelConfig(**values)
    assert (m.experts, m.top_k, m.expert_ffn_hidden, m.kv_heads, m.sliding_window) == (8, 2, 14336, 8, 0)
    assert m.norm_topk_prob is True   # Mixtral renormalises its top-2 weights
    assert count_params(m) == 46_702_792_704


def test_fields_that_cannot_be_mapped_are_errors():
    llama = json.loads((HF / "llama-2-7b.json").read_text())
    with pytest.raises(HFConfigError, match="`attention_bias` = true with `mlp_bias` = false cannot be mapped"):
        from_hf_dict({**llama, "attention_bias": True})
    assert from_hf_dict({**llama, "attention_bias": True, "mlp_bias": True})["bias"] is True
    qwen = json.loads((HF / "qwen2-7b.json").read_text())
    with pytest.raises(HFConfigError, match=r"the window on 7 of 28 layers \(`max_window_layers` = 21\) cannot be"):
        from_hf_dict({**qwen, "use_sliding_window": True, "max_window_layers": 21})


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize("layers, extra", [
    (4, {"max_window_layers": 0}), (4, {"max_window_layers": 4}), (4, {"max_window_layers": 28}), (4, {}),
    (32, {}), (4, {"max_window_layers": 0, "use_sliding_window": False}),
    (4, {"layer_types": ["sliding_attention"] * 4}), (4, {"layer_types": ["full_attention"] * 4})])
def test_qwen_sliding_window_is_on_exactly_where_transformers_puts_it(model_type, layers, extra):
    """The window of every layer as transformers' own config class decides it (the layers
    i >= max_window_layers, default 28; or `layer_types`); a mix is refused."""
    transformers = pytest.importorskip("transformers")
    raw = {"model_type": model_type, "num_hidden_layers": layers, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "use_sliding_window": True,
           "sliding_window": 16, "head_dim": 16, **extra}
    kls = transformers.Qwen3Config if model_type == "qwen3" else transformers.Qwen2Config
    hf = kls(**{k: v for k, v in raw.items() if k != "model_type"})
    windows = {hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types}
    if len(windows) > 1:
        with pytest.raises(HFConfigError, match="cannot be mapped"):
            from_hf_dict(raw)
        return
    assert (from_hf_dict(raw).get("sliding_window") or None) == windows.pop()


def test_import_error_is_a_diagnostic_at_the_from(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads((HF / "llama-2-7b.json").read_text()), "attention_bias": True}))
    spec = tmp_path / "s.par"
    spec.write_text('model m from "bad.json" { }\ncluster c from "h100-sxm" { }\n')
    with pytest.raises(parcompile.SpecError) as e:
        parcompile.compile(spec)
    [d] = [d for d in e.value.diagnostics if d.severity == "error"]
    assert (d.span.line, d.span.column) == (1, 14) and "cannot be mapped" in d.message
    assert d.help and "qkv_bias" in d.help


def test_gpt2_position_table_is_sized_by_n_positions_not_seq_len(tmp_path):
    """GPT-2 with n_positions = 64 trained on 32-token sequences: Hugging Face's
    GPT2LMHeadModel has a 64 x hidden `wpe`, and so does the plan (268,160 parameters)."""
    cfg = {"model_type": "gpt2", "n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "n_positions": 64}
    (tmp_path / "gpt2.json").write_text(json.dumps(cfg))
    assert from_hf_dict(cfg)["max_positions"] == 64
    spec = tmp_path / "s.par"
    spec.write_text('model m from "gpt2.json" { seq_len = 32 }\ncluster c from "cpu" { gpus_per_node = 1 }\n')
    plan = parcompile.compile(spec)
    assert (plan.config.model.seq_len, plan.config.model.max_positions) == (32, 64)
    assert plan.data["model"]["params"] == 268_160  # = GPT2LMHeadModel(that config) parameters
    # the Llama family maps max_position_embeddings the same way
    llama = json.loads((HF / "llama-2-7b.json").read_text())
    assert from_hf_dict(llama)["max_positions"] == llama["max_position_embeddings"] == 4096


def test_seq_len_beyond_the_learned_position_table_is_an_error(tmp_path):
    cfg = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "n_positions": 64}
    (tmp_path / "gpt2.json").write_text(json.dumps(cfg))
    spec = tmp_path / "s.par"
    spec.write_text('model m from "gpt2.json" { seq_len = 128 }\ncluster c from "cpu" { gpus_per_node = 1 }\n')
    with pytest.raises(parcompile.SpecError) as e:
        parcompile.compile(spec)
    [d] = e.value.diagnostics
    assert d.message == "seq_len = 128 exceeds max_positions = 64, the rows of the learned position table"
    assert (d.span.line, d.span.column) == (1, 38)  # at `128`
    assert d.help == "use seq_len <= 64, or write `max_positions = 128` (a larger table)"
    # a larger table in the block fixes it
    spec.write_text('model m from "gpt2.json" { seq_len = 128, max_positions = 128 }\n'
                    'cluster c from "cpu" { gpus_per_node = 1 }\n')
    assert parcompile.compile(spec).config.model.max_positions == 128


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("field, value, what", [
    ("rope_parameters", "llama3", "an object"), ("rope_parameters", [8.0], "an object"),
    ("rope_scaling", 8, "an object"), ("layer_types", "sliding_attention", "a list")])
def test_rope_and_layer_fields_of_the_wrong_type_are_errors_not_ignored(model_type, field, value, what):
    """A `rope_parameters` that is not an object (or a `layer_types` that is not a list)
    names the field, as every other field of the wrong type does: read as absent, it
    would plan the model without its RoPE scaling (or its window layout) and say nothing."""
    raw = {"model_type": model_type, "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 256, "head_dim": 16, field: value}
    if field == "layer_types" and model_type in ("llama", "deepseek_v3"):
        pytest.skip(f"{model_type} has no layer_types")
    if field == "layer_types" and model_type == "qwen3":
        raw["use_sliding_window"] = True
    with pytest.raises(HFConfigError, match=f"`{field}` in the config.json should be {what}") as e:
        from_hf_dict(raw)
    assert e.value.help == f"write `{field}` as {what} in the config.json, as transformers saves it"


def test_gpt_oss_reads_the_hubs_rope_scaling():
    """openai/gpt-oss-120b's config.json (transformers 4) keeps YaRN in `rope_scaling`; its
    factor is read, not replaced by the family's default."""
    raw = {"model_type": "gpt_oss", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 256, "head_dim": 16,
           "num_local_experts": 4, "num_experts_per_tok": 2, "rope_theta": 150000,
           "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "original_max_position_embeddings": 4096, "truncate": False}}
    keys = from_hf_dict(raw)
    assert (keys["rope_type"], keys["rope_scaling_factor"]) == ("yarn", 8.0)


@pytest.mark.parametrize("field", ["torch_dtype", "dtype"])
def test_a_torch_dtype_parcompile_does_not_train_in_is_an_error_at_the_from(tmp_path, field):
    """`"torch_dtype": "int8"` (or transformers 5's `dtype`) is refused at the `from` with
    the field's fix, not planned as the default bf16; the block's `dtype` replaces it; a
    checkpoint's layout is still read (it does not depend on the dtype)."""
    from parcompile.core.hf_weights import model_from_checkpoint_config
    llama = json.loads((HF / "llama-2-7b.json").read_text())
    llama.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps({**llama, field: "int8"}))
    spec = tmp_path / "s.par"
    spec.write_text('model m from "config.json" { seq_len = 512 }\ncluster c from "h100-sxm" { }\n')
    with pytest.raises(parcompile.SpecError) as e:
        parcompile.compile(spec)
    [d] = [d for d in e.value.diagnostics if d.severity == "error"]
    assert (d.span.line, d.span.column) == (1, 14) and "invalid dtype" in d.message and "`int8`" in d.message
    assert d.help and "write `dtype = ...` in the block" in d.help
    spec.write_text('model m from "config.json" { seq_len = 512, dtype = bf16 }\ncluster c from "h100-sxm" { }\n')
    assert parcompile.compile(spec).model.dtype == "bf16"
    assert model_from_checkpoint_config({**llama, field: "int8"}).layers == llama["num_hidden_layers"]


def test_a_multimodal_config_points_at_its_text_config():
    """google/gemma-3-27b-it's config.json is `gemma3` (vision + language): the error names
    the `text_config` the import does take and how to use it, not only the supported list."""
    text = {"model_type": "gemma3_text", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "head_dim": 16}
    with pytest.raises(HFConfigError, match="a multimodal config; its `text_config` is a `gemma3_text` model") as e:
        from_hf_dict({"model_type": "gemma3", "text_config": text, "vision_config": {}})
    assert "save the `text_config` object on its own" in e.value.help
    assert from_hf_dict(text)["layers"] == 4
    with pytest.raises(HFConfigError, match=r'^unsupported Hugging Face model_type "mamba"$'):
        from_hf_dict({"model_type": "mamba", "text_config": {"model_type": "mamba"}})
