"""Llama 4's text model (`llama4_text`, issue 46's proof) against transformers' own
Llama4ForCausalLM (transformers 5.25, models/llama4/modeling_llama4.py; fp32, CPU).

Scout's shape (meta-llama/Llama-4-Scout-17B-16E's config.json ``text_config``, as a hub copy
holds it: 48 layers, hidden 5120, 40 heads, 8 kv heads, head_dim 128, 16 experts top-1 of
width 8192, dense width 16384, ``no_rope_layers`` [1, 1, 1, 0] * 12, chunks of 8192, llama3
RoPE scaling, vocab 202,048) counts as transformers counts it on the meta device.

A tiny random Llama4TextConfig (4 layers: a NoPE layer every 3rd, chunks of 6 tokens on the
RoPE layers (16 tokens compared), temperature tuning with ``floor_scale`` 4 and ``attn_scale``
0.5, the L2 qk-norm, MoE every 2nd layer (4 experts, top 2, one shared expert) between dense
layers of another width) saved with ``save_pretrained``: its config.json imports, its
parameter count is transformers', ``load_hf`` fills a single-process program whose logits
equal transformers'; each feature bites (transformers' logits move when it is turned off),
so the comparison fails if the program dropped one.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch

import parcompile
from parcompile.core.hf import from_hf_dict
from parcompile.core.hf_weights import expected_shapes, hf_config, hf_family
from parcompile.config.presets import MODEL_PRESETS
from tests.family_utils import assert_logits_equal, import_keys, stage_from_hf, token_ids
from tests.program_utils import tiny_config

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e .[test])")

#: meta-llama/Llama-4-Scout-17B-16E config.json's text_config (a hub copy found through the
#: search tool, transformers_version 4.51.0; the fields that shape the model)
SCOUT = dict(
    attention_bias=False, attention_chunk_size=8192, attn_scale=0.1, attn_temperature_tuning=True, floor_scale=8192,
    head_dim=128, hidden_act="silu", hidden_size=5120, interleave_moe_layer_step=1, intermediate_size=8192,
    intermediate_size_mlp=16384, max_position_embeddings=262144, moe_layers=list(range(48)),
    no_rope_layers=[1, 1, 1, 0] * 12, num_attention_heads=40, num_experts_per_tok=1, num_hidden_layers=48,
    num_key_value_heads=8, num_local_experts=16, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=dict(factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0, original_max_position_embeddings=8192,
                      rope_type="llama3"),
    use_qk_norm=True, vocab_size=202048, tie_word_embeddings=False,
)

LAYERS, CHUNK = 4, 6


def _hf_config(**extra):
    return transformers.Llama4TextConfig(**{**dict(
        vocab_size=300, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
        num_local_experts=4, num_experts_per_tok=2, interleave_moe_layer_step=2, no_rope_layer_interval=3,
        attention_chunk_size=CHUNK, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None), **extra})


def _save(path: Path, **extra):
    torch.manual_seed(23)
    hf = transformers.Llama4ForCausalLM(_hf_config(**extra)).float().eval()
    hf.config._attn_implementation = "eager"
    with torch.no_grad():   # non-trivial norms and a decisive router, so a misplaced weight shows
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("router.weight"):
                p.normal_(0.0, 0.5)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama4")
    hf = _save(tmp / "hf")
    cfg = tiny_config(model=import_keys(tmp / "hf"), name="llama4")
    stage, plan = stage_from_hf(cfg, tmp / "hf", tmp / "prog")
    return dict(tmp=tmp, hf=hf, cfg=cfg, stage=stage, plan=plan)


def test_scout_counts_as_transformers_on_the_meta_device(tmp_path):
    """Scout's text config as `model s from "config.json"`: the plan's parameter count equals
    Llama4ForCausalLM's on the meta device (107,769,861,120: its text model; the hub
    copy's 109.7 B adds the vision tower)."""
    hcfg = transformers.Llama4TextConfig(**SCOUT)
    with torch.device("meta"):
        total = sum(p.numel() for p in transformers.Llama4ForCausalLM(hcfg).parameters())
    (tmp_path / "config.json").write_text(hcfg.to_json_string())
    spec = tmp_path / "s.par"
    spec.write_text('model s from "config.json" { }\ncluster c from "h100-sxm" { nodes = 8 }\n'
                    'parallel { tp = 2, pp = 4, sequence_parallel = true, global_batch = 64 }\n')
    plan = parcompile.compile(spec)
    m = plan.config.model
    assert (m.nope_layer_interval, m.attention_chunk_size, m.qk_l2_norm, m.experts, m.top_k, m.shared_experts) == (
        4, 8192, True, 16, 1, 1)
    assert (m.ffn_hidden, m.expert_ffn_hidden, m.rope_type, m.rope_scaling_factor) == (16384, 8192, "llama3", 8.0)
    assert plan.data["model"]["params"] == total
    spec.write_text(spec.read_text().replace('from "config.json"', 'from "llama4-scout"'))
    preset = parcompile.compile(spec)
    assert preset.data["model"]["params"] == total
    assert {k: v for k, v in preset.config.model if k != "name"} == {k: v for k, v in m if k != "name"}


def test_import_maps_every_field(case):
    m, hc = case["cfg"].model, case["hf"].config
    from parcompile.core.model import moe_layer, rope_layer

    assert [int(rope_layer(m, i)) for i in range(LAYERS)] == hc.no_rope_layers
    assert [i for i in range(LAYERS) if moe_layer(m, i)] == hc.moe_layers
    assert (m.attention_chunk_size, m.floor_scale, m.attn_scale, m.attn_temperature_tuning) == (CHUNK, 4.0, 0.5, True)
    assert (m.ffn_hidden, m.expert_ffn_hidden, m.experts, m.top_k, m.shared_experts) == (96, 32, 4, 2, 1)
    assert (m.scoring_func, m.norm_topk_prob, m.moe_apply_probs_on_input, m.rope_interleave) == (
        "sigmoid", False, True, True)
    assert hf_family(m) == "llama4_text"


def test_config_round_trips(case):
    """keys -> config.json (hf_config) -> keys: the same model; transformers reads the
    written config.json into the same layer lists."""
    m = case["cfg"].model
    written = hf_config(m)
    assert written["model_type"] == "llama4_text"
    back = transformers.Llama4TextConfig(**{k: v for k, v in written.items() if k != "model_type"})
    hc = case["hf"].config
    assert (back.no_rope_layers, back.moe_layers, back.layer_types) == (hc.no_rope_layers, hc.moe_layers,
                                                                         hc.layer_types)
    again = {k: v for k, v in from_hf_dict(written).items() if v is not None and k not in ("seq_len", "dtype")}
    assert tiny_config(model={**import_keys(case["tmp"] / "hf"), **again}).model == m


def test_parameter_count_equals_transformers(case):
    total = sum(p.numel() for p in case["hf"].parameters())
    assert case["plan"]["model"]["params"] == total
    assert sum(math.prod(s) for s in expected_shapes(case["cfg"].model).values()) == total


def test_logits_equal_transformers(case):
    assert_logits_equal(case["stage"], case["hf"], case["cfg"].model.vocab)


@pytest.mark.parametrize("feature", ["attention_chunk_size", "attn_temperature_tuning", "use_qk_norm",
                                     "no_rope_layers", "router"])
def test_each_feature_bites(case, feature):
    """transformers' logits change when a feature is switched off (or, ``router``: its
    weights applied to the experts' outputs instead of their inputs), so the logits test
    above would fail if the program dropped it."""
    hf = case["hf"]
    ids = token_ids(case["cfg"].model.vocab)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        other = copy.deepcopy(hf)
        if feature == "router":
            for layer in other.model.layers:
                if layer.is_moe_layer:
                    layer.feed_forward.forward = _weights_on_outputs(layer.feed_forward)
        else:
            value = {"attention_chunk_size": None, "attn_temperature_tuning": False, "use_qk_norm": False,
                     "no_rope_layers": [1] * LAYERS}[feature]
            setattr(other.config, feature, value)
            if feature == "attention_chunk_size":
                other.config.layer_types = ["full_attention"] * LAYERS
            for i, layer in enumerate(other.model.layers):
                attn = layer.self_attn
                attn.attn_temperature_tuning = other.config.attn_temperature_tuning
                attn.use_rope = other.config.no_rope_layers[i]
                if feature == "use_qk_norm" and hasattr(attn, "qk_norm"):
                    del attn.qk_norm
        got = other(input_ids=ids).logits
    assert (got - want).abs().max() > 1e-3, feature


def _weights_on_outputs(moe):
    """Llama4TextMoe's forward with each router weight scaling its expert's output."""
    def forward(x):
        x = x.reshape(-1, moe.hidden_dim)
        scores, logits = moe.router(x)
        E = scores.shape[1]
        out = moe.experts(x.repeat(E, 1)).view(E, -1, x.shape[-1])
        return moe.shared_expert(x) + (out * scores.t().unsqueeze(-1)).sum(0), logits
    return forward


def test_a_placement_parcompile_cannot_express_is_refused():
    from parcompile.core.hf import HFConfigError

    cfg = json.loads(_hf_config(no_rope_layers=[1, 0, 0, 1]).to_json_string())
    with pytest.raises(HFConfigError, match="no_rope_layers"):
        from_hf_dict(cfg)
    cfg = json.loads(_hf_config(moe_layers=[0, 3]).to_json_string())
    with pytest.raises(HFConfigError, match="moe_layers"):
        from_hf_dict(cfg)


@pytest.mark.parametrize("field, value, why", [
    ("no_rope_layers", [1, 1, 1, 0, 1], "5 entries for num_hidden_layers = 4"),
    ("no_rope_layers", [1, 1], "2 entries"),
    ("no_rope_layers", ["a", 1, 1, 1], "0 \\(NoPE\\) or 1"),
    ("no_rope_layers", [1, 1, 2, 1], "0 \\(NoPE\\) or 1"),
    ("no_rope_layer_interval", 0, "divides by it"),
    ("attention_chunk_size", 0, "divides positions by it"),
    ("num_local_experts", 0, "num_local_experts"),
    ("layer_types", ["full_attention"] * LAYERS, "layer_types"),
    ("layer_types", ["sliding_attention"] * LAYERS, "layer_types"),
])
def test_a_config_json_field_out_of_range_is_refused(tmp_path, field, value, why):
    """Worst values of Llama 4's config.json fields are an HFConfigError, and a spec importing
    the file reports it at the `from` clause (file:line:col), never a model transformers would
    not build: ``no_rope_layers`` of the wrong length or entries (transformers indexes it by
    layer and reads its truthiness; was: extra entries ignored, "a" read as RoPE),
    ``no_rope_layer_interval`` 0 (Llama4TextConfig's ``(i + 1) % 0``; was: read as no NoPE
    layer), ``attention_chunk_size`` 0 (transformers' chunked mask divides by it; was: read as
    no chunks), ``num_local_experts`` 0 with MoE layers (was: read as dense layers), a
    ``layer_types`` other than the one derived (transformers masks by it; was: ignored)."""
    from parcompile.core.hf import HFConfigError
    from parcompile.diagnostics import SpecError
    from parcompile.frontend import load_spec

    cfg = json.loads(_hf_config().to_json_string())
    cfg[field] = value
    if field == "no_rope_layer_interval":
        del cfg["no_rope_layers"]
    with pytest.raises(HFConfigError, match=why):
        from_hf_dict(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = tmp_path / "s.par"
    spec.write_text('model s from "config.json" { }\ncluster c from "cpu" { gpus_per_node = 1 }\nparallel { }\n')
    with pytest.raises(SpecError, match=r"s\.par:1:\d+: error: .*" + why):
        load_spec(spec)


def test_serving_is_refused_with_a_diagnostic(case):
    """The serve program has no chunked or temperature-tuned cached attention yet: a serve spec
    of the checkpoint is refused at the model, naming Llama 4's layers and what to use instead."""
    from parcompile.codegen.emit import program_gaps
    from parcompile.frontend import load_spec

    tmp = case["tmp"]
    spec = tmp / "serve.par"
    spec.write_text('model m from "hf/config.json" { dtype = fp32 }\ncluster c from "cpu" { gpus_per_node = 1 }\n'
                    'parallel { }\nserve { batch = 2, prompt_len = 6, max_new_tokens = 4, weights = "hf" }\n')
    cfg, _ = load_spec(spec)
    gaps = [g for g in program_gaps(cfg) if g.severity == "error"]
    assert len(gaps) == 1 and "Llama 4's layers while serving" in gaps[0].message
    assert gaps[0].span.line == 1 and "vLLM" in gaps[0].help
    with pytest.raises(Exception, match="Llama 4's layers while serving"):
        parcompile.compile(spec).write(tmp / "serve_out")


def test_the_miniature_keeps_llama4s_layers_biting():
    """verify's miniature of Scout (16 tokens, a few layers) keeps the complex RoPE pairs, NoPE
    layers, MoE layers between dense ones and shrinks the chunk and the temperature's unit so
    that both act within its 16 tokens (tests/test_verify.py's llama4 case runs one)."""
    from parcompile.core.model import moe_layer, rope_layer
    from parcompile.miniature import miniature

    cfg = tiny_config(2, 2, 2, model=dict(MODEL_PRESETS["llama4-scout"], interleave_moe_layer_step=2),
                      parallel=dict(ep=2, sequence_parallel=True))
    m = miniature(cfg).model
    assert (m.rope_interleave, m.qk_l2_norm, m.attn_temperature_tuning) == (True, True, True)
    assert m.attention_chunk_size < m.seq_len and m.floor_scale < m.seq_len
    assert {rope_layer(m, i) for i in range(m.layers)} == {True, False}
    assert {moe_layer(m, i) for i in range(m.layers)} == {True, False}


def test_a_hand_written_llama4_spec_checks(tmp_path):
    """rope_interleave without multi-head latent attention is Llama 4's RoPE (accepted, as its
    preset and config.json give it); with a partial rotary_fraction it is a spanned error."""
    from parcompile.diagnostics import SpecError
    from parcompile.frontend import load_spec

    spec = tmp_path / "m.par"
    body = "layers = 4, hidden = 64, heads = 4, vocab = 256, seq_len = 32, rope_interleave = true, nope_layer_interval = 2"
    spec.write_text(f'model m {{\n    {body}\n}}\ncluster c from "cpu" {{ gpus_per_node = 1 }}\nparallel {{ }}\n')
    cfg, _ = load_spec(spec)
    assert cfg.model.rope_interleave and cfg.model.nope_layer_interval == 2
    spec.write_text(spec.read_text().replace("nope_layer_interval = 2", "rotary_fraction = 0.5"))
    with pytest.raises(SpecError, match=r"m\.par:2:\d+: error: rope_interleave with a partial rotary_fraction"):
        load_spec(spec)


def test_hf_output_of_a_fine_tune_loads_back_in_transformers(case, tmp_path):
    """A short fine-tune's hf_output (config.json and safetensors in transformers' fused
    expert layout) loads in transformers with the same tensor names and layer lists, the
    experts, the shared expert and the router changed, and gives the logits parcompile gives."""
    from tests.family_utils import check_written_back, fine_tune

    cfg = case["cfg"]
    out = fine_tune(cfg, case["tmp"] / "hf", tmp_path)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "llama4_text" and written["architectures"] == ["Llama4ForCausalLM"]
    back = check_written_back(cfg, out, case["hf"], tmp_path / "prog_back",
                              moved=("experts.gate_up_proj", "experts.down_proj", "shared_expert", "router"))
    assert (back.config.no_rope_layers, back.config.moe_layers) == (case["hf"].config.no_rope_layers,
                                                                     case["hf"].config.moe_layers)


@pytest.mark.parametrize("key", ["attention_chunk_size", "sliding_window"])
def test_a_chunk_or_window_beyond_any_position_masks_as_none(key):
    """A spec may write ``attention_chunk_size`` or ``sliding_window`` = 10**30 (a warning, not
    an error): the unfused core's mask (core_attention.causal_mask) equals plain causal
    attention's, as transformers' chunked / sliding mask of a chunk longer than the sequence
    is; was an OverflowError in the rank (torch cannot convert 10**30 to int64)."""
    from parcompile.runtime.model.core_attention import attention_core, causal_mask

    pos = torch.arange(8)
    plain = causal_mask(pos, pos, 0)
    assert torch.equal(plain, torch.ones(8, 8, dtype=torch.bool).tril())
    big = dict(window=10**30) if key == "sliding_window" else dict(window=0, chunk=10**30)
    assert torch.equal(causal_mask(pos, pos, **big), plain)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = attention_core(q, k, v, False, 0.0, False, q_pos=pos + 5, k_pos=pos + 5, **big)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("keys, said", [
    ("nope_layer_interval = 2, position = learned", "2:.*error: nope_layer_interval describes Llama 4's RoPE"),
    ("qk_l2_norm = true, position = none", "2:.*error: qk_l2_norm describes Llama 4's RoPE"),
    ("attention_chunk_size = 4, position = learned", "2:.*error: attention_chunk_size describes"),
    ("attention_chunk_size = 1000000000000000000000000000000", "2:.*warning: attention_chunk_size has no effect"),
    ("attn_temperature_tuning = true, nope_layer_interval = 99", "2:.*warning: attn_temperature_tuning has no effect"),
    ("interleave_moe_layer_step = 99, experts = 4", "2:.*warning: interleave_moe_layer_step has no effect"),
    ("moe_apply_probs_on_input = true", "2:.*warning: moe_apply_probs_on_input has no effect"),
])
def test_llama4_keys_with_nothing_to_act_on_are_reported(tmp_path, keys, said):
    """Worst values of Llama 4's spec keys (frontend/checks_model.py check_llama4): its RoPE /
    NoPE keys without RoPE are a spanned error (was: accepted, the temperature then scaling every
    layer, the chunk and the L2 norm acting on none); a chunk past seq_len, a temperature without
    a NoPE layer and MoE keys without a MoE layer are spanned warnings (was: silent)."""
    from parcompile.diagnostics import SpecError
    from parcompile.frontend import load_spec

    spec = tmp_path / "m.par"
    spec.write_text(f'model m {{\n    layers = 4, hidden = 64, heads = 4, vocab = 256, seq_len = 32, {keys}\n}}\n'
                    'cluster c from "cpu" { gpus_per_node = 1 }\nparallel { }\n')
    if "error" in said:
        with pytest.raises(SpecError, match=r"m\.par:" + said):
            load_spec(spec)
        return
    _, bag = load_spec(spec)
    assert any(re.search(said, f"{d.span.line}:{d.severity}: {d.message}") for d in bag), [str(d) for d in bag]


def test_a_single_trailing_moe_layer_is_the_only_one_in_the_program(tmp_path):
    """2 layers, ``interleave_moe_layer_step`` 2: transformers' ``moe_layers`` is [1], one MoE
    layer after a dense one and none after it. The program's Block builds MoE exactly there
    (codegen/emit.py ``_block_methods``: was MoE on every layer whenever no dense layer followed
    the first MoE one, so the checkpoint did not load) and its logits equal transformers'."""
    hf = _save(tmp_path / "hf", num_hidden_layers=2, no_rope_layer_interval=2)
    assert hf.config.moe_layers == [1]
    cfg = tiny_config(model=import_keys(tmp_path / "hf"), name="llama4_2")
    stage, _ = stage_from_hf(cfg, tmp_path / "hf", tmp_path / "prog")
    assert [any(n.startswith(f"layers.{i}.mlp.experts") for n, _ in stage.named_parameters())
            for i in range(2)] == [False, True]
    assert_logits_equal(stage, hf, cfg.model.vocab)
