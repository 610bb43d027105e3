"""Presets (parcompile/config/presets.py) and `from` imports, presets and Hugging Face."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from parcompile.core.hf import HFConfigError, from_hf_dict
from parcompile.config.presets import CLUSTER_PRESETS, MODEL_PRESETS, cluster_preset
from parcompile.config.schema import ModelConfig
from parcompile.diagnostics import SpecError
from parcompile.frontend import load_spec

SPEC_MD = Path(__file__).resolve().parents[2] / "shared" / "SPEC.md"  # ../shared beside the clone


def count_params(m: ModelConfig) -> int:
    """The standard parameter count of a decoder-only transformer (unpadded vocabulary)."""
    h, d = m.hidden, m.head_dim
    q, kv = m.heads * d, m.kv_heads * d
    attn = 2 * h * q + 2 * h * kv + (2 * d if m.qk_norm else 0)
    if m.bias:
        attn += q + 2 * kv + h
    elif m.qkv_bias:
        attn += q + 2 * kv
    gated = m.activation == "swiglu"

    def mlp(ffn: int) -> int:
        return (3 if gated else 2) * h * ffn + ((2 if gated else 1) * ffn + h if m.bias else 0)

    norm = (2 if m.norm == "layernorm" else 1) * h
    if m.experts:
        moe_layers = m.layers - m.dense_layers
        ffn_params = (moe_layers * (m.experts * mlp(m.expert_ffn_hidden) + h * m.experts)
                      + m.dense_layers * mlp(m.ffn_hidden))
    else:
        ffn_params = m.layers * mlp(m.ffn_hidden)
    total = m.layers * (attn + 2 * norm) + ffn_params + norm
    total += m.vocab * h * (1 if m.tie_embeddings else 2)
    if m.position == "learned":
        total += m.max_positions * h
    return total


def preset_model(name: str) -> ModelConfig:
    return ModelConfig(name=name, **MODEL_PRESETS[name])


@pytest.mark.parametrize("name, params", [
    ("llama2-7b", 6_738_415_616),
    ("llama2-13b", 13_015_864_320),
    ("llama2-70b", 68_976_648_192),
    ("llama3-8b", 8_030_261_248),
    ("llama3-70b", 70_553_706_496),
    ("llama3.1-405b", 405_853_388_800),
    ("mistral-7b", 7_241_732_096),
    ("mixtral-8x7b", 46_702_792_704),
    ("qwen2-7b", 7_615_616_512),
    # Qwen3: the model cards' safetensors totals (tests/test_qwen3_moe.py counts them with transformers)
    ("qwen3-8b", 8_190_735_360),
    ("qwen3-30b-a3b", 30_532_122_624),
    ("qwen3-235b-a22b", 235_093_634_560),
])
def test_model_preset_parameter_counts(name, params):
    assert count_params(preset_model(name)) == params


def test_gpt3_175b():
    m = preset_model("gpt3-175b")
    assert (m.layers, m.hidden, m.heads, m.ffn_hidden, m.vocab, m.seq_len) == (96, 12288, 96, 49152, 51200, 2048)
    assert (m.norm, m.activation, m.position, m.bias, m.tie_embeddings) == ("layernorm", "gelu", "learned", True, True)
    assert round(count_params(m) / 1e9) == 175


@pytest.mark.skipif(not SPEC_MD.exists(), reason="the shared SPEC.md is not on this machine")
def test_preset_names_are_the_specs():
    text = SPEC_MD.read_text()
    section = text[text.index("Preset names"):text.index("### `parallel`")]
    models = section[section.index("models"):section.index("clusters")]
    clusters = section[section.index("clusters"):]
    # SPEC fixes these names (extending is welcome, renaming is not): every name it lists is a
    # preset, spelt so; presets added since (issue 14's families) are listed in docs/language.md.
    spec_models = re.findall(r"`([^`]+)`", models)
    assert spec_models and [m for m in MODEL_PRESETS if m in spec_models] == spec_models
    spec_clusters = re.findall(r"`([^`]+)`", clusters.split("(")[0])
    assert spec_clusters and [c for c in CLUSTER_PRESETS if c in spec_clusters] == spec_clusters


def test_every_preset_is_documented():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "language.md").read_text()
    section = docs[docs.index("## Presets and Hugging Face configs"):docs.index("- Clusters:")]
    listed = set(re.findall(r"`([^`]+)`", section))
    assert set(MODEL_PRESETS) <= listed, set(MODEL_PRESETS) - listed


def test_cluster_presets():
    h100 = cluster_preset("h100-sxm", "bf16")
    assert h100["peak_flops"] == 989e12 and h100["memory"] == 80 * 2**30
    assert h100["inter_node_bw"] == 50e9 and h100["intra_node_bw"] == 450e9
    assert cluster_preset("h100-sxm", "fp32")["peak_flops"] == pytest.approx(494.7e12)
    assert cluster_preset("a100-80gb", "fp16")["peak_flops"] == 312e12
    cpu = cluster_preset("cpu", "fp32")
    assert cpu["gpus_per_node"] == 8 and cpu["memory"] == 16 * 2**30 and cpu["peak_flops"] == 1e12
    assert {cluster_preset("cpu", d)["peak_flops"] for d in ("fp32", "bf16", "fp16")} == {1e12}
    for name, preset in CLUSTER_PRESETS.items():
        assert set(preset.peak_flops) == {"fp32", "bf16", "fp16"}, name


def test_preset_values_are_overridden_by_block_keys():
    cfg, _ = load_spec('model m from "llama3-8b" { seq_len = 4096 }\n'
                       'cluster c from "h100-sxm" { nodes = 4, memory = 40 GiB }\nparallel { tp = 8 }')
    assert cfg.model.seq_len == 4096 and cfg.model.hidden == 4096 and cfg.model.name == "m"
    c = cfg.cluster
    assert (c.nodes, c.gpus_per_node, c.memory, c.preset, c.name) == (4, 8, 40 * 2**30, "h100-sxm", "c")
    assert cfg.parallel.dp == 4
    assert not c.is_cpu


def test_cpu_preset_is_cpu_and_dtype_independent():
    cfg, _ = load_spec(Path(__file__).resolve().parent.parent / "examples" / "tiny.par")
    assert cfg.cluster.is_cpu and cfg.cluster.world_size == 8 and cfg.cluster.peak_flops == 1e12


def _errors(text: str) -> list[tuple[str, int, int, str | None]]:
    with pytest.raises(SpecError) as e:
        load_spec(text, filename="p.par")
    return [(d.message, d.span.line, d.span.column, d.help) for d in e.value.diagnostics]


CLUSTER = '\ncluster c from "h100-sxm" { }\nparallel { tp = 8 }\n'


def test_unknown_model_preset_lists_valid_names():
    [(message, line, col, help)] = _errors('model m from "llama3-7b" { }' + CLUSTER)
    assert (message, line, col) == ("unknown model preset `llama3-7b`", 1, 14)
    assert help == ("did you mean `llama3-70b`? model presets are `llama2-7b`, `llama2-13b`, `llama2-70b`, "
                    "`llama3-8b`, `llama3-70b`, `llama3.1-405b`, `mistral-7b`, `mixtral-8x7b`, `mixtral-8x22b`, "
                    "`qwen2-7b`, `qwen2-72b`, `qwen3-8b`, `qwen3-30b-a3b`, `qwen3-235b-a22b`, `deepseek-v3`, `gemma3-27b`, `llama4-scout`, "
                    "`gpt-oss-20b`, `gpt-oss-120b` or `gpt3-175b`, or a path "
                    "to a Hugging Face `config.json`")


def test_unknown_cluster_preset_and_swapped_kinds():
    [(message, line, col, help)] = _errors('model m from "llama3-8b" { }\ncluster c from "h100" { }')
    assert (message, line, col) == ("unknown cluster preset `h100`", 2, 16)
    # `h100` is the H100 preset cut at its dash, not the H200 one letter away
    assert help.startswith("did you mean `h100-sxm`? cluster presets are `a100-40gb`")
    [(message, *_)] = _errors('model m from "h200" { }' + CLUSTER)
    assert message == "`h200` is a cluster preset, not a model preset"
    [(message, *_)] = _errors('model m from "llama3-8b" { }\ncluster c from "llama3-8b" { }')
    assert message == "`llama3-8b` is a model preset, not a cluster preset"


# -- Hugging Face config.json -------------------------------------------------------------------

LLAMA3_8B_JSON = {
    "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "tie_word_embeddings": False, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
}


def test_hf_llama_matches_preset():
    values = from_hf_dict(LLAMA3_8B_JSON)
    assert ModelConfig(**values) == preset_model("llama3-8b").model_copy(update={"name": "model"})


def test_hf_families():
    gpt2 = from_hf_dict({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024,
                         "n_inner": None, "vocab_size": 50257, "layer_norm_epsilon": 1e-5,
                         "activation_function": "gelu_new"})
    m = ModelConfig(**gpt2)
    assert (m.layers, m.hidden, m.ffn_hidden, m.seq_len, m.norm, m.activation, m.position) == \
        (12, 768, 3072, 1024, "layernorm", "gelu", "learned")
    assert m.bias and m.tie_embeddings and count_params(m) == 124_439_808  # GPT-2 small
    neox = ModelConfig(**from_hf_dict({
        "model_type": "gpt_neox", "num_hidden_layers": 6, "hidden_size": 512, "intermediate_size": 2048,
        "num_attention_heads": 8, "vocab_size": 50304, "max_position_embeddings": 2048, "layer_norm_eps": 1e-5,
        "hidden_act": "gelu", "rotary_pct": 0.25, "rotary_emb_base": 10000, "use_parallel_residual": True,
        "tie_word_embeddings": False, "torch_dtype": "float16"}))
    assert (neox.rotary_fraction, neox.parallel_residual, neox.dtype, neox.bias) == (0.25, True, "fp16", True)
    assert count_params(neox) == 70_426_624  # EleutherAI/pythia-70m
    qwen = ModelConfig(**from_hf_dict({**LLAMA3_8B_JSON, "model_type": "qwen2", "sliding_window": 4096,
                                       "use_sliding_window": False}))
    assert qwen.qkv_bias and qwen.sliding_window == 0
    mistral = ModelConfig(**from_hf_dict({**LLAMA3_8B_JSON, "model_type": "mistral", "sliding_window": 4096}))
    assert mistral.sliding_window == 4096
    mixtral = ModelConfig(**from_hf_dict({**LLAMA3_8B_JSON, "model_type": "mixtral", "num_local_experts": 8,
                                          "num_experts_per_tok": 2}))
    assert (mixtral.experts, mixtral.top_k) == (8, 2)


def test_hf_errors():
    with pytest.raises(HFConfigError, match="unsupported Hugging Face model_type \"bert\""):
        from_hf_dict({"model_type": "bert"})
    with pytest.raises(HFConfigError, match="`hidden_size` in the config.json should be an integer, got \"big\""):
        from_hf_dict({**LLAMA3_8B_JSON, "hidden_size": "big"})
    with pytest.raises(HFConfigError, match="unsupported activation `tanh`"):
        from_hf_dict({**LLAMA3_8B_JSON, "hidden_act": "tanh"})


def test_from_json_in_a_spec(tmp_path):
    (tmp_path / "llama.json").write_text(json.dumps(LLAMA3_8B_JSON))
    spec = tmp_path / "s.par"
    spec.write_text('model m from "llama.json" { seq_len = 2048 }' + CLUSTER)
    cfg, _ = load_spec(spec)
    assert cfg.model.seq_len == 2048 and cfg.model.kv_heads == 8 and cfg.model.rope_theta == 500000.0
    (tmp_path / "bad.json").write_text("{ nope")
    spec.write_text('model m from "bad.json" { }' + CLUSTER)
    with pytest.raises(SpecError) as e:
        load_spec(spec, filename="s.par")
    [d] = e.value.diagnostics
    assert (d.message, d.span.line, d.span.column) == (
        f"`{tmp_path / 'bad.json'}` is not valid JSON: Expecting property name enclosed in double quotes "
        "at line 1 column 3", 1, 14)
    (tmp_path / "list.json").write_text("[1, 2]")
    spec.write_text('model m from "list.json" { }' + CLUSTER)
    with pytest.raises(SpecError) as e:
        load_spec(spec, filename="s.par")
    assert e.value.diagnostics[0].message == \
        f"`{tmp_path / 'list.json'}` is not a Hugging Face config (expected a JSON object)"
    spec.write_text('model m from "missing.json" { }' + CLUSTER)
    with pytest.raises(SpecError) as e:
        load_spec(spec, filename="s.par")
    [d] = e.value.diagnostics
    assert d.message == f"cannot read `{tmp_path / 'missing.json'}`: no such file"
    assert d.help == "a `.json` source is resolved relative to the spec file"


# -- accelerators (issue 32) -----------------------------------------------------------------

def test_fp8_peaks_are_twice_the_16_bit_peaks():
    """FP8 dense runs at twice the bf16 dense rate on every part with FP8 tensor cores (two
    datasheet figures checked against each other); MXFP8 exists on Blackwell alone. The `cpu`
    preset runs FP8 GEMMs emulated (runtime/model/fp8.py: an fp32 GEMM of the E4M3 values) at its
    16-bit rate, MXFP8 likewise (dequantized blocks: a stand-in, not a datasheet)."""
    has_fp8 = {n for n, p in CLUSTER_PRESETS.items() if p.fp8_flops} - {"cpu"}
    assert has_fp8 == {"h100-sxm", "h200", "b200", "gb200-nvl72", "mi300x"}
    cpu = CLUSTER_PRESETS["cpu"]
    assert cpu.fp8_flops == cpu.peak_flops["bf16"] == cpu.mxfp8_flops
    for name in has_fp8:
        preset = CLUSTER_PRESETS[name]
        assert preset.fp8_flops == pytest.approx(2 * preset.peak_flops["bf16"], rel=1e-3), name
    assert {n for n, p in CLUSTER_PRESETS.items() if p.mxfp8_flops} == {"b200", "gb200-nvl72", "cpu"}
    assert all(p.mxfp8_flops == p.fp8_flops for p in CLUSTER_PRESETS.values() if p.mxfp8_flops)


def test_gb200_nvl72_is_one_nvlink_domain_of_18_trays():
    cfg, _ = load_spec('model m from "llama3-8b" { }\ncluster c from "gb200-nvl72" { nodes = 18 }\n'
                       'parallel { tp = 8, micro_batch = 1, global_batch = 72 }')
    c = cfg.cluster
    assert (c.gpus_per_node, c.world_size, c.domain_size, c.nics_per_node, c.nvls) == (4, 72, 72, 4, True)
    assert c.peak_flops == 2.5e15 and c.memory == 186 * 2**30


def test_nvlink_domain_decides_which_groups_are_inside_a_node():
    """tp = 8 spans two 4-GPU trays: inside the NVL72 domain it runs on NVLink (NVLS); with
    the domain cut to a tray (`nvlink_domain = 4`) it crosses the network (NVLS tree), slower."""
    from parcompile.driver import compile_config

    got = {}
    for domain in ("", ", nvlink_domain = 4"):
        cfg, _ = load_spec('model m from "llama3-8b" { }\ncluster c from "gb200-nvl72" { nodes = 18' + domain + ' }\n'
                           'parallel { tp = 8, micro_batch = 1, global_batch = 72 }')
        plan = compile_config(cfg).data
        tp = plan["estimate"]["assumptions"]["network"]["tp"]
        got[cfg.cluster.domain_size] = (tp["ranks_per_node"], tp["nodes"], tp["collectives"]["all_reduce"]["algorithm"],
                                        plan["estimate"]["step_time"])
    assert got[72][:3] == (8, 1, "nvls") and got[4][:3] == (4, 2, "nvls_tree")
    assert got[72][3] < got[4][3]


def _tflops(x: float) -> str:
    """``2.25e15`` -> ``2,250``, ``1.3074e15`` -> ``1,307.4``: as docs/clusters.md writes peaks."""
    t = x / 1e12
    return f"{t:,.0f}" if t == round(t) else f"{t:,.1f}"


def test_docs_clusters_lists_every_preset_with_its_datasheet_figures():
    """docs/clusters.md's datasheet table has a row per cluster preset that states the
    preset's own peaks (bf16, TF32, FP8), and every preset has its achievable fractions."""
    from parcompile.analysis.estimate import EFFICIENCY

    docs = (Path(__file__).resolve().parents[1] / "docs" / "clusters.md").read_text()
    table = docs[docs.index("## Datasheet numbers"):docs.index("What each preset's figures were measured against")]
    rows = {line.split("|")[1].strip().strip("`"): line for line in table.splitlines() if line.startswith("| `")}
    assert set(rows) == set(CLUSTER_PRESETS)
    measured = docs[docs.index("What each preset's figures were measured against"):docs.index("The `cpu` preset describes")]
    for name, preset in CLUSTER_PRESETS.items():
        assert f"`{name}`" in measured, name
        assert name in EFFICIENCY, name
        if name == "cpu":
            continue
        cells = rows[name].split("|")
        assert f"{_tflops(preset.peak_flops['bf16'])} TFLOPS" in cells[3], name
        assert _tflops(preset.peak_flops["fp32"]) in cells[4], name
        assert (_tflops(preset.fp8_flops) in cells[5]) if preset.fp8_flops else cells[5].strip().startswith("none"), name


def test_model_from_a_directory_names_its_config_json(tmp_path):
    """`from "Llama-3.2-1B"` (the checkpoint directory, as `init_from` takes it) said "unknown
    model preset" and listed the presets; now the error says what the path is, and for a
    directory holding a config.json the fix is that file's path. A missing name is still an
    unknown preset (with its did-you-mean)."""
    ckpt = tmp_path / "Llama-3.2-1B"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "config").write_text("{}")
    spec = tmp_path / "p.par"

    def errors(source: str) -> list[tuple[str, int, int, str | None]]:
        spec.write_text(f'model m from "{source}" {{ }}' + CLUSTER)
        with pytest.raises(SpecError) as e:
            load_spec(spec)
        return [(d.message, d.span.line, d.span.column, d.help) for d in e.value.diagnostics]

    said = ": a model's `from` takes a preset name or the path of a Hugging Face `config.json`"
    assert errors("Llama-3.2-1B") == [("`Llama-3.2-1B` is a directory" + said, 1, 14,
                                       'write `from "Llama-3.2-1B/config.json"`')]
    assert errors("empty/") == [("`empty/` is a directory" + said, 1, 14,
                                 "name the checkpoint's config.json file (a path ending in `.json`)")]
    assert errors("config") == [("`config` is a file without the `.json` suffix" + said, 1, 14,
                                 "name the checkpoint's config.json file (a path ending in `.json`)")]
    [(message, _, _, help)] = errors("llama3-7b")
    assert message == "unknown model preset `llama3-7b`" and help.startswith("did you mean `llama3-70b`?")
