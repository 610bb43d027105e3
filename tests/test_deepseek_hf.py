"""DeepSeek-V3 (`deepseek_v3`, issue 18): its config.json and checkpoint layout against
transformers' own DeepseekV3Config / DeepseekV3ForCausalLM (CPU).

A tiny random DeepseekV3Config (hidden 64, 4 layers, 4 heads, multi-head latent attention
with q_lora_rank 32 or null, 8 routed experts in 2 groups top-2, one shared expert, a dense
first layer) saved with ``save_pretrained``: its config.json imports (``from_hf_dict``) as
the model transformers builds; :func:`expected_shapes` adds up to transformers' parameter
count and, through :func:`tensor_map`, reads every tensor of the checkpoint with its shape
(the router's ``e_score_correction_bias`` a buffer beside them); ``hf_config`` of the model
is a config.json transformers builds the same modules from. The published DeepSeek-V3
config.json imports (YaRN with mscale) and counts as transformers counts it (meta device).
Expected values come from transformers' modules and the config fields, never from the code
under test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from parcompile.config.schema import ModelConfig
from parcompile.core.hf import SUPPORTED_MODEL_TYPES, HFConfigError, from_hf_dict
from parcompile.core.hf_weights import (BUFFERS, FAMILIES, check_checkpoint, expected_shapes, family_problems, hf_config,
                                        hf_family, is_buffer, model_from_checkpoint_config, scan_checkpoint, tensor_map)
from parcompile.core.model import ModelKeys

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e .[test])")
safetensors_torch = pytest.importorskip("safetensors.torch")

LAYERS, EXPERTS, TOP_K, DENSE = 4, 8, 2, 1

#: the fields of deepseek-ai/DeepSeek-V3's published config.json that shape the model
DEEPSEEK_V3_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128,
    "vocab_size": 129280,
}


def _hf_config(q_lora_rank, **extra):
    return transformers.DeepseekV3Config(**{**dict(
        vocab_size=128, hidden_size=64, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=EXPERTS, n_group=2, topk_group=1,
        num_experts_per_tok=TOP_K, n_shared_experts=1, first_k_dense_replace=DENSE, routed_scaling_factor=2.5,
        norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None), **extra})


def _save(hf_cfg, path: Path, seed: int):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    with torch.no_grad():   # distinct values everywhere, so a tensor read from the wrong place shows
        for n, p in hf.named_parameters():
            p.normal_(0.0, 1.0)
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 1.0)
    hf.save_pretrained(path, safe_serialization=True)
    (path / "config_to_json.json").write_text(hf_cfg.to_json_string())
    return hf


@pytest.fixture(scope="module", params=[32, None], ids=["q_lora", "no_q_lora"])
def case(request, tmp_path_factory):
    q_lora = request.param
    d = tmp_path_factory.mktemp(f"deepseek_{q_lora}") / "hf"
    hf = _save(_hf_config(q_lora), d, seed=5 + bool(q_lora))
    cfg = json.loads((d / "config.json").read_text())
    return dict(q_lora=q_lora, dir=d, hf=hf, cfg=cfg, keys=from_hf_dict(cfg), model=model_from_checkpoint_config(cfg))


def _headers(d: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    _, headers, problems, complete = scan_checkpoint(d)
    assert not problems and complete
    return headers


def test_import_maps_every_field(case):
    k, q_lora = case["keys"], case["q_lora"]
    want = dict(vocab=128, hidden=64, layers=LAYERS, heads=4, kv_heads=4, ffn_hidden=48, q_lora_rank=q_lora or 0,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, rope_interleave=True,
                experts=EXPERTS, top_k=TOP_K, expert_ffn_hidden=16, shared_experts=1, dense_layers=DENSE,
                norm_topk_prob=True, routed_scaling_factor=2.5, n_group=2, topk_group=1, scoring_func="sigmoid",
                topk_method="noaux_tc", norm="rmsnorm", norm_eps=1e-6, activation="swiglu", position="rope",
                rope_theta=10000.0, bias=False, qkv_bias=False, tie_embeddings=False, seq_len=64, max_positions=64,
                router_aux_loss=0.0)
    assert {key: k.get(key) for key in want} == want
    assert "head_dim" not in k   # the file's head_dim (4) is transformers' RoPE width, ours nope + rope
    m = ModelConfig(**k)
    assert m.head_dim == 8 + 4 and hf_family(m) == "deepseek_v3" and hf_family(case["model"]) == "deepseek_v3"
    # config.json written by save_pretrained and by to_json_string import alike
    alt = json.loads((case["dir"] / "config_to_json.json").read_text())
    assert from_hf_dict(alt) == k


def test_parameter_count_equals_transformers(case):
    hf, m = case["hf"], case["model"]
    total = sum(p.numel() for p in hf.parameters())
    assert sum(math.prod(s) for s in expected_shapes(m).values()) == total
    assert sum(math.prod(s) for s in expected_shapes(ModelConfig(**case["keys"])).values()) == total
    # the buffer is in no parameter count: transformers keeps it among the buffers
    bias = {n for n, _ in hf.named_buffers() if n.endswith("e_score_correction_bias")}
    assert len(bias) == LAYERS - DENSE and not bias & {n for n, _ in hf.named_parameters()}


def test_expected_shapes_read_every_checkpoint_tensor(case):
    m, d = case["model"], case["dir"]
    headers = _headers(d)
    with_buffers = expected_shapes(m, buffers=True)
    buffers = {k: v for k, v in with_buffers.items() if is_buffer(k)}
    assert buffers == {f"layers.{i}.mlp.router.e_score_correction_bias": (EXPERTS,) for i in range(DENSE, LAYERS)}
    assert {k: v for k, v in with_buffers.items() if not is_buffer(k)} == expected_shapes(m)
    assert BUFFERS == ("e_score_correction_bias",)
    tmap = tensor_map(m, "deepseek_v3")
    assert set(with_buffers) <= set(tmap)
    read: dict[str, list[str]] = {}
    for name, shape in with_buffers.items():
        src = tmap[name][0]   # the first source: what save_pretrained writes
        assert src.name in headers, (name, src.name)
        assert tuple(src.shape) == headers[src.name][1] == tuple(shape), name   # one to one
        assert not src.lead and not src.transpose and not src.block and not src.offset
        read.setdefault(src.name, []).append(name)
    assert set(read) == set(headers)   # every HF tensor read ...
    assert all(len(v) == 1 for v in read.values())   # ... by one of ours
    assert headers["model.layers.1.mlp.gate.e_score_correction_bias"][0] == "F32"
    assert check_checkpoint(d, expected_shapes(m), m) == []
    # the MLA names of design19.md, with transformers' tensors
    q = "model.layers.2.self_attn."
    pairs = {"layers.2.attn.wkv_a.weight": q + "kv_a_proj_with_mqa.weight",
             "layers.2.attn.kv_a_norm.weight": q + "kv_a_layernorm.weight",
             "layers.2.attn.wkv_b.weight": q + "kv_b_proj.weight", "layers.2.attn.wo.weight": q + "o_proj.weight",
             "layers.2.mlp.router.weight": "model.layers.2.mlp.gate.weight",
             "layers.2.mlp.shared.w3.weight": "model.layers.2.mlp.shared_experts.up_proj.weight",
             "layers.2.mlp.experts.5.w2.weight": "model.layers.2.mlp.experts.5.down_proj.weight",
             "layers.0.mlp.w1.weight": "model.layers.0.mlp.gate_proj.weight",
             "layers.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
             "layers.0.mlp_norm.weight": "model.layers.0.post_attention_layernorm.weight"}
    if case["q_lora"]:
        pairs.update({"layers.2.attn.wq_a.weight": q + "q_a_proj.weight",
                      "layers.2.attn.q_a_norm.weight": q + "q_a_layernorm.weight",
                      "layers.2.attn.wq_b.weight": q + "q_b_proj.weight"})
        assert "layers.2.attn.wq.weight" not in with_buffers
    else:
        pairs["layers.2.attn.wq.weight"] = q + "q_proj.weight"
        assert "layers.2.attn.wq_a.weight" not in with_buffers
    assert {k: tmap[k][0].name for k in pairs} == pairs


def _read(tmap, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Our tensor ``name`` read from ``tensors`` (HF name -> tensor) at its first present source."""
    src = next(s for s in tmap[name] if s.name in tensors)
    t = tensors[src.name]
    t = t[src.lead] if src.lead else t
    rows = [t[hf:hf + n] for _, hf, n in src.runs(0, src.ours[0])]
    return torch.cat(rows)


def test_saved_and_fused_expert_layouts_give_the_same_tensors(case, tmp_path):
    """save_pretrained's per-expert tensors and transformers' fused in-memory layout
    (``mlp.experts.gate_up_proj`` (E, 2f, h), ``down_proj`` (E, h, f)) are both read; every
    other tensor is read where transformers' own module holds it."""
    m, hf = case["model"], case["hf"]
    saved = safetensors_torch.load_file(str(case["dir"] / "model.safetensors"))
    fused = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused and "model.layers.1.mlp.experts.0.gate_proj.weight" in saved
    tmap = tensor_map(m, "deepseek_v3")
    f = 16
    for name in expected_shapes(m, buffers=True):
        a, b = _read(tmap, name, saved), _read(tmap, name, fused)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    g = fused["model.layers.3.mlp.experts.gate_up_proj"]
    torch.testing.assert_close(_read(tmap, "layers.3.mlp.experts.6.w1.weight", saved), g[6, :f], rtol=0, atol=0)
    torch.testing.assert_close(_read(tmap, "layers.3.mlp.experts.6.w3.weight", saved), g[6, f:], rtol=0, atol=0)
    torch.testing.assert_close(_read(tmap, "layers.3.mlp.router.e_score_correction_bias", saved),
                               hf.model.layers[3].mlp.gate.e_score_correction_bias, rtol=0, atol=0)


def test_multi_token_prediction_layers_are_ignored(case, tmp_path):
    """DeepSeek-V3's checkpoint holds its MTP module as the layer after the last
    (``model.layers.61.*``); it is not read and not reported. A missing buffer is."""
    m, src = case["model"], case["dir"]
    d = tmp_path / "with_mtp"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**case["cfg"], "num_nextn_predict_layers": 1}))
    saved = safetensors_torch.load_file(str(src / "model.safetensors"))
    safetensors_torch.save_file(saved, str(d / "model.safetensors"))
    extra = {f"model.layers.{LAYERS}.{k.split('.', 3)[3]}": v for k, v in saved.items()
             if k.startswith("model.layers.3.")}
    extra[f"model.layers.{LAYERS}.eh_proj.weight"] = torch.zeros(64, 128)
    safetensors_torch.save_file(extra, str(d / "model-mtp.safetensors"))
    assert model_from_checkpoint_config(json.loads((d / "config.json").read_text())) == m
    assert check_checkpoint(d, expected_shapes(m), m) == []
    cut = tmp_path / "no_bias"
    cut.mkdir()
    (cut / "config.json").write_text((src / "config.json").read_text())
    safetensors_torch.save_file({k: v for k, v in saved.items() if k != "model.layers.2.mlp.gate.e_score_correction_bias"},
                                str(cut / "model.safetensors"))
    (problem,) = check_checkpoint(cut, expected_shapes(m), m)
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in problem.message
    assert "layers.2.mlp.router.e_score_correction_bias" in problem.message


def _module_shapes(model) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_hf_config_loads_into_the_same_model(case, tmp_path):
    m = case["model"]
    written = hf_config(m)
    assert written["model_type"] == "deepseek_v3" and written["architectures"] == ["DeepseekV3ForCausalLM"]
    assert written["num_nextn_predict_layers"] == 0 and written["q_lora_rank"] == case["q_lora"]
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(written))
    back_cfg = transformers.AutoConfig.from_pretrained(d)
    assert isinstance(back_cfg, transformers.DeepseekV3Config) and back_cfg.num_mtp_layers == 0
    for key in ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace",
                "rope_interleave", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                "intermediate_size", "rms_norm_eps", "num_key_value_heads"):
        assert getattr(back_cfg, key) == getattr(case["hf"].config, key), key
    back = transformers.AutoModelForCausalLM.from_config(back_cfg)
    assert _module_shapes(back) == _module_shapes(case["hf"])
    assert model_from_checkpoint_config(written) == m   # and it imports as the same model


def test_a_model_without_experts_is_all_dense_layers(tmp_path):
    """first_k_dense_replace >= num_hidden_layers: no MoE layer (transformers builds
    DeepseekV3MLP everywhere), imported as experts = 0, and written back so."""
    hf = _save(_hf_config(32, first_k_dense_replace=LAYERS), tmp_path / "hf", seed=3)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    k = from_hf_dict(cfg)
    assert k["experts"] == 0 and "dense_layers" not in k and "scoring_func" not in k
    m = model_from_checkpoint_config(cfg)
    assert sum(math.prod(s) for s in expected_shapes(m).values()) == sum(p.numel() for p in hf.parameters())
    assert check_checkpoint(tmp_path / "hf", expected_shapes(m), m) == []
    written = hf_config(m)
    back = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config.from_dict(written))
    assert _module_shapes(back) == _module_shapes(hf)
    assert model_from_checkpoint_config(written) == m


def test_the_published_deepseek_v3_config_imports():
    k = from_hf_dict(DEEPSEEK_V3_JSON)
    want = dict(layers=61, hidden=7168, heads=128, kv_heads=128, vocab=129280, ffn_hidden=18432, q_lora_rank=1536,
                kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, experts=256, top_k=8,
                n_group=8, topk_group=4, shared_experts=1, dense_layers=3, expert_ffn_hidden=2048,
                routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
                rope_type="yarn", rope_scaling_factor=40.0, rope_original_max_positions=4096, rope_beta_fast=32.0,
                rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0, rope_theta=10000.0, dtype="bf16",
                seq_len=163840, rope_interleave=True, router_aux_loss=0.001)   # DeepSeek's aux_loss_alpha
    assert {key: k.get(key) for key in want} == want
    m = ModelConfig(**k)
    assert hf_family(m) == "deepseek_v3" and m.head_dim == 192
    # transformers' count of the same config.json on the meta device (the MTP layer is not built)
    hf_cfg = transformers.DeepseekV3Config(**{key: v for key, v in DEEPSEEK_V3_JSON.items()
                                             if key not in ("architectures", "model_type")})
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(hf_cfg)
    total = sum(p.numel() for p in hf.parameters())
    assert sum(math.prod(s) for s in expected_shapes(m).values()) == total == 671_026_404_352
    # and written back, transformers reads the same RoPE scaling; it imports as the same model
    assert ModelConfig(**from_hf_dict(hf_config(m))) == m
    rope = hf_config(m)["rope_parameters"]
    assert {key: rope[key] for key in ("rope_type", "factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow",
                                       "original_max_position_embeddings")} == {
        "rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "original_max_position_embeddings": 4096}


def test_the_preset_is_the_published_config():
    """The `deepseek-v3` preset is the published config.json at the pre-training context."""
    from parcompile.config.presets import MODEL_PRESETS

    imported = ModelConfig(**{**from_hf_dict(DEEPSEEK_V3_JSON), "seq_len": 4096})
    assert imported == ModelConfig(**MODEL_PRESETS["deepseek-v3"])


def test_absent_fields_take_transformers_defaults():
    k = from_hf_dict({"model_type": "deepseek_v3"})
    d = transformers.DeepseekV3Config()
    assert (k["hidden"], k["layers"], k["heads"], k["vocab"], k["ffn_hidden"]) == (
        d.hidden_size, d.num_hidden_layers, d.num_attention_heads, d.vocab_size, d.intermediate_size)
    assert (k["q_lora_rank"], k["kv_lora_rank"], k["qk_nope_head_dim"], k["qk_rope_head_dim"], k["v_head_dim"]) == (
        d.q_lora_rank, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim)
    assert (k["experts"], k["top_k"], k["expert_ffn_hidden"], k["shared_experts"], k["dense_layers"]) == (
        d.n_routed_experts, d.num_experts_per_tok, d.moe_intermediate_size, d.n_shared_experts,
        d.first_k_dense_replace)
    assert (k["n_group"], k["topk_group"], k["routed_scaling_factor"], k["norm_topk_prob"], k["rope_interleave"]) == (
        d.n_group, d.topk_group, d.routed_scaling_factor, d.norm_topk_prob, d.rope_interleave)
    assert (k["norm_eps"], k["rope_theta"], k["seq_len"]) == (d.rms_norm_eps, d.rope_parameters["rope_theta"],
                                                             d.max_position_embeddings)
    assert "rope_type" not in k and d.rope_parameters["rope_type"] == "default"
    # num_local_experts is transformers' other name of n_routed_experts
    assert from_hf_dict({"model_type": "deepseek_v3", "num_local_experts": 64})["experts"] == 64


def test_fields_that_cannot_be_mapped_are_errors():
    with pytest.raises(HFConfigError, match="`attention_bias` = true in a deepseek_v3 config.json cannot be mapped"):
        from_hf_dict({**DEEPSEEK_V3_JSON, "attention_bias": True})
    with pytest.raises(HFConfigError, match="`num_key_value_heads` = 16 with 128 heads"):
        from_hf_dict({**DEEPSEEK_V3_JSON, "num_key_value_heads": 16})
    with pytest.raises(HFConfigError, match="`scoring_func` = \"softmax\""):
        from_hf_dict({**DEEPSEEK_V3_JSON, "scoring_func": "softmax"})
    with pytest.raises(HFConfigError, match="`topk_method` = \"greedy\""):
        from_hf_dict({**DEEPSEEK_V3_JSON, "topk_method": "greedy"})
    with pytest.raises(HFConfigError, match="YaRN `attention_factor` = 0.5 is not modelled"):
        from_hf_dict({**DEEPSEEK_V3_JSON, "rope_scaling": {**DEEPSEEK_V3_JSON["rope_scaling"], "attention_factor": 0.5}})
    with pytest.raises(HFConfigError, match="unsupported activation `tanh`"):
        from_hf_dict({**DEEPSEEK_V3_JSON, "hidden_act": "tanh"})
    # other families still refuse a YaRN mscale they do not model
    llama = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 128, "rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0}}
    with pytest.raises(HFConfigError, match="YaRN `mscale` = 0.707 is not modelled"):
        from_hf_dict(llama)


def test_unsupported_model_type_names_the_supported_ones():
    with pytest.raises(HFConfigError) as e:
        from_hf_dict({"model_type": "deepseek_v2"})
    assert e.value.message == 'unsupported Hugging Face model_type "deepseek_v2"'
    assert "deepseek_v3" in e.value.help and all(t in e.value.help for t in SUPPORTED_MODEL_TYPES)
    assert "deepseek_v3" in SUPPORTED_MODEL_TYPES and "deepseek_v3" in FAMILIES


def _tiny(**keys) -> ModelKeys:
    return ModelKeys(**{**dict(layers=2, hidden=64, heads=4, vocab=128, seq_len=64), **keys})


MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, rope_interleave=True)
ROUTER = dict(experts=8, top_k=2, expert_ffn_hidden=16, shared_experts=1, dense_layers=1, scoring_func="sigmoid",
              topk_method="noaux_tc", n_group=2, topk_group=1, routed_scaling_factor=2.5)


def test_family_problems():
    ds = _tiny(**MLA, **ROUTER)
    assert family_problems(ds, "deepseek_v3") == [] and hf_family(ds) == "deepseek_v3"
    for family in ("llama", "qwen3_moe", "mixtral", "gpt_oss", "gemma3_text", "gpt2"):
        (p,) = family_problems(ds, family)
        assert "kv_lora_rank = 16 (multi-head latent attention: deepseek_v3)" in p.message, family
    # DeepSeek's router on another MoE family
    (p,) = family_problems(_tiny(**{**ROUTER, "shared_experts": 0, "dense_layers": 0}), "mixtral")
    assert "scoring_func = sigmoid (DeepSeek's router: deepseek_v3)" in p.message
    assert "n_group = 2" in p.message
    # what DeepSeek-V3 does not have
    for keys, text in [(dict(qk_norm=True), "qk_norm = true"), (dict(bias=True), "bias = True"),
                       (dict(sliding_window=16), "sliding_window = 16"),
                       (dict(scoring_func="softmax"), "scoring_func = softmax (transformers' DeepSeek-V3 router "
                                                      "has sigmoid)"),
                       (dict(kv_heads=2), "kv_heads = 2 != heads"), (dict(activation="gelu"), "activation = gelu")]:
        (p,) = family_problems(_tiny(**{**MLA, **ROUTER, **keys}), "deepseek_v3")
        assert text in p.message, keys
    (p,) = family_problems(_tiny(**ROUTER), "deepseek_v3")
    assert "kv_lora_rank = 0 (it has multi-head latent attention)" in p.message


@pytest.mark.parametrize("model", [
    dict(layers=3, hidden=64, heads=4, vocab=128, seq_len=16, kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=8,
         qk_rope_head_dim=4, v_head_dim=8, experts=4, top_k=2, shared_experts=1, dense_layers=1,
         scoring_func="sigmoid", topk_method="noaux_tc", n_group=2, topk_group=1),
    dict(layers=2, hidden=64, heads=4, vocab=128, seq_len=16, kv_lora_rank=16, qk_nope_head_dim=8,
         qk_rope_head_dim=4, v_head_dim=8),
    dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, seq_len=16, experts=4, top_k=2, qk_norm=True),
    dict(layers=2, hidden=64, heads=4, vocab=128, seq_len=16, tie_embeddings=True),
])
def test_the_checks_shapes_are_the_weight_tables(model):
    """``init_from``'s check reads the graph's parameters (frontend/checks.py
    ``expected_shapes``, experts split one tensor each); the loaders read the weight
    tables: the same names and shapes."""
    from parcompile.frontend.checks import expected_shapes as graph_shapes

    m = ModelConfig(**model)
    assert graph_shapes(m) == expected_shapes(m)
