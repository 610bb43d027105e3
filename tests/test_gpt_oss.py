"""gpt-oss (`gpt_oss`, issue 18) against transformers' own GptOssForCausalLM (fp32, CPU).

A tiny random GptOssConfig (4 layers, hidden 64, head_dim 16, 4 experts top-2 of width
32, sliding window 4 on layers 0 and 2, full attention on 1 and 3, YaRN RoPE) saved with
``save_pretrained``: its config.json imports with ``from_hf_dict``; the plan's total and
active parameter counts equal transformers'; ``load_hf`` fills a single-process program
whose logits (16 tokens, past the window) equal transformers' (eager attention: the sinks
as transformers computes them); ``hf_output`` of a short fine-tune loads back with
``from_pretrained`` and gives transformers' logits again. Every rule (biased router,
expert biases, the clamped SwiGLU, the interleaved fused gate_up layout, attention sinks,
alternating windows, YaRN) is read off transformers' module, never parcompile's output.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from parcompile.core.hf_weights import expected_shapes, hf_family
from tests.family_utils import (assert_logits_equal, check_written_back, fine_tune, import_keys, stage_from_hf,
                                 token_ids)
from tests.program_utils import tiny_config

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e .[test])")

LAYERS, EXPERTS, TOP_K = 4, 4, 2


def _hf_config(**extra):
    return transformers.GptOssConfig(**{**dict(
        vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, sliding_window=4,
        max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 150000.0},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None), **extra})


def _save(path: Path):
    torch.manual_seed(29)
    hf = transformers.GptOssForCausalLM(_hf_config()).float().eval()
    hf.config._attn_implementation = "eager"
    with torch.no_grad():   # zeros at init: biases and sinks that matter, and a decisive router
        for n, p in hf.named_parameters():
            if n.endswith("_bias") or n.endswith(".bias") or n.endswith("sinks"):
                p.normal_(0.0, 0.5)
            elif "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("router.weight"):
                p.normal_(0.0, 0.5)
            elif n.endswith("experts.gate_up_proj"):
                p.normal_(0.0, 1.0)   # gate and up of std ~8: many past swiglu_limit = 7, so the clamp matters
    hf.save_pretrained(path, safe_serialization=True)
    return hf




@pytest.fixture(scope="module")
def case(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt_oss")
    hf = _save(tmp / "hf")
    cfg = tiny_config(model=import_keys(tmp / "hf"), name="gpt_oss")
    stage, plan = stage_from_hf(cfg, tmp / "hf", tmp / "prog")
    return dict(tmp=tmp, hf=hf, cfg=cfg, stage=stage, plan=plan)




def test_import_maps_every_field(case):
    m, hf = case["cfg"].model, case["hf"]
    assert [bool(w) for w in m.layer_windows] == [k == "sliding_attention" for k in hf.config.layer_types]
    assert (m.experts, m.top_k, m.expert_ffn_hidden, m.dense_layers, m.shared_experts) == (EXPERTS, TOP_K, 32, 0, 0)
    assert (m.bias, m.qkv_bias, m.router_bias, m.attention_sinks, m.norm_topk_prob) == (True, True, True, True, True)
    assert (m.swiglu_alpha, m.swiglu_limit) == (hf.config.swiglu_alpha, hf.config.swiglu_limit)
    assert (m.rope_type, m.rope_scaling_factor, m.rope_original_max_positions, m.rope_truncate) == ("yarn", 4.0, 16,
                                                                                                    False)
    assert hf_family(m) == "gpt_oss"


def test_parameter_counts_equal_transformers(case):
    hf, plan = case["hf"], case["plan"]
    total = sum(p.numel() for p in hf.parameters())
    experts = [sum(p.numel() for p in layer.mlp.experts.parameters()) for layer in hf.model.layers]
    active = total - sum(n * (EXPERTS - TOP_K) // EXPERTS for n in experts)
    assert plan["model"]["params"] == total
    assert plan["model"]["active_params"] == active
    assert sum(math.prod(s) for s in expected_shapes(case["cfg"].model).values()) == total


def test_the_clamp_is_reached(case):
    """Some expert inputs pass swiglu_limit, so a model without the clamp would differ."""
    hf, ids = case["hf"], token_ids(case["cfg"].model.vocab)
    seen = []
    layer = hf.model.layers[0]
    hook = layer.mlp.experts.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    with torch.no_grad():
        hf(input_ids=ids)
    hook.remove()
    gate_up = seen[0] @ layer.mlp.experts.gate_up_proj[0]
    assert (gate_up.abs() > hf.config.swiglu_limit).float().mean() > 0.05


def test_logits_equal_transformers(case):
    assert_logits_equal(case["stage"], case["hf"], case["cfg"].model.vocab)


def test_hf_output_of_a_fine_tune_loads_back_in_transformers(case, tmp_path):
    cfg = case["cfg"]
    out = fine_tune(cfg, case["tmp"] / "hf", tmp_path)
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt_oss"
    check_written_back(cfg, out, case["hf"], tmp_path / "prog_back",
                       moved=("experts.gate_up_proj", "experts.down_proj_bias", "router.bias", "self_attn.sinks"))


@pytest.mark.parametrize("name, layers, experts, card_active, layout", [
    ("gpt-oss-20b", 24, 32, 3.6e9, "nodes = 2 }\nparallel { tp = 2, pp = 2, ep = 4, recompute = selective"),
    ("gpt-oss-120b", 36, 128, 5.1e9, "nodes = 8 }\nparallel { tp = 2, pp = 4, ep = 8, zero = 1, recompute = full"),
])
def test_presets_count_as_transformers_and_plan(name, layers, experts, card_active, layout, tmp_path):
    """The presets against transformers' GptOssConfig defaults (the published config.json
    values) with the preset's layers and experts, meta device. OpenAI's model cards count
    active parameters without the input embedding: 3.6B and 5.1B."""
    import parcompile

    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(num_hidden_layers=layers,
                                                                      num_local_experts=experts))
    total = sum(p.numel() for p in hf.parameters())
    spec = tmp_path / "g.par"
    spec.write_text(f'model g from "{name}" {{ seq_len = 8192 }}\ncluster c from "h100-sxm" {{ {layout}, '
                    'expert_tp = 1, sequence_parallel = true, global_batch = 64 }\n')
    plan = parcompile.compile(spec)
    assert plan.data["model"]["params"] == total
    embedding = hf.model.embed_tokens.weight.numel()
    assert round((plan.data["model"]["active_params"] - embedding) / 1e8) == round(card_active / 1e8)
    assert plan.data["memory"]["fits"]
