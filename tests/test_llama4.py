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

import json

import pytest
import torch

import parcompile
from parcompile.config.hf import from_hf_dict

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


def test_a_placement_parcompile_cannot_express_is_refused():
    from parcompile.config.hf import HFConfigError

    cfg = json.loads(_hf_config(no_rope_layers=[1, 0, 0, 1]).to_json_string())
    with pytest.raises(HFConfigError, match="no_rope_layers"):
        from_hf_dict(cfg)
    cfg = json.loads(_hf_config(moe_layers=[0, 3]).to_json_string())
    with pytest.raises(HFConfigError, match="moe_layers"):
        from_hf_dict(cfg)
