"""Qwen3-MoE (`qwen3_moe`, issue 18) against transformers' own Qwen3MoeForCausalLM (fp32, CPU).

A tiny random Qwen3MoeConfig (4 layers, hidden 64, head_dim 32 != hidden / heads, 8
experts top-2, moe_intermediate_size 32, a dense first layer through ``mlp_only_layers =
[0]``) saved with ``save_pretrained``; with ``norm_topk_prob`` true and false. Its
config.json is imported with ``from_hf_dict``; the plan's parameter counts (total and
active) must equal the counts taken from transformers' module; ``load_hf`` fills a
single-process program whose logits must equal transformers'; ``hf_output`` of a short
fine-tune loads back with ``from_pretrained``. The Qwen3 presets count as transformers
counts the published configs (meta device), and a layer placement parcompile cannot express
is refused with a diagnostic at the `from`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import parcompile
from parcompile import runtime as rt
from parcompile.core.hf import HFConfigError, from_hf_dict
from parcompile.core.hf_weights import check_checkpoint, expected_shapes, hf_config, hf_family
from parcompile.config.presets import MODEL_PRESETS
from parcompile.config.schema import ModelConfig
from parcompile.runtime.model.moe import route
from tests.family_utils import assert_logits_equal, fine_tune, import_keys, logits, stage_from_hf, token_ids
from tests.program_utils import tiny_config

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e .[test])")

LAYERS, EXPERTS, TOP_K = 4, 8, 2


def _hf_config(norm_topk_prob: bool, **extra):
    return transformers.Qwen3MoeConfig(**{**dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk_prob, mlp_only_layers=[0], decoder_sparse_step=1,
        router_aux_loss_coef=0.001, tie_word_embeddings=False, use_sliding_window=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None), **extra})


def _save(norm_topk_prob: bool, path: Path):
    torch.manual_seed(17 + norm_topk_prob)
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(norm_topk_prob),
                                                       attn_implementation="eager").float().eval()
    with torch.no_grad():   # non-trivial norms and a decisive router, so a misplaced weight shows
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    hf.save_pretrained(path, safe_serialization=True)
    return hf




@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk_prob", "raw_topk_prob"])
def case(request, tmp_path_factory):
    norm = request.param
    tmp = tmp_path_factory.mktemp(f"qwen3_moe_{norm}")
    hf = _save(norm, tmp / "hf")
    keys = import_keys(tmp / "hf")
    cfg = tiny_config(model=keys, name="qwen3_moe")
    stage, plan = stage_from_hf(cfg, tmp / "hf", tmp / "prog")
    return dict(norm=norm, tmp=tmp, hf=hf, cfg=cfg, stage=stage, keys=keys, plan=plan)




def test_import_maps_every_field(case):
    m, norm = case["cfg"].model, case["norm"]
    assert (m.experts, m.top_k, m.expert_ffn_hidden, m.ffn_hidden, m.dense_layers) == (EXPERTS, TOP_K, 32, 96, 1)
    assert (m.qk_norm, m.head_dim, m.qkv_bias, m.bias, m.norm_topk_prob) == (True, 32, False, False, norm)
    assert m.router_aux_loss == 0.001 and m.sliding_window == 0
    assert hf_family(m) == "qwen3_moe"


def test_parameter_counts_equal_transformers(case):
    hf, plan, m = case["hf"], case["plan"], case["cfg"].model
    total = sum(p.numel() for p in hf.parameters())
    # active: every parameter but the experts a token does not use, taken from transformers' modules
    moe_layers = [layer.mlp for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
    assert len(moe_layers) == LAYERS - 1   # mlp_only_layers = [0]
    per_layer_experts = [sum(p.numel() for p in mlp.experts.parameters()) for mlp in moe_layers]
    active = total - sum(n * (EXPERTS - TOP_K) // EXPERTS for n in per_layer_experts)
    assert plan["model"]["params"] == total
    assert plan["model"]["active_params"] == active
    assert sum(math.prod(s) for s in expected_shapes(m).values()) == total


def test_logits_equal_transformers(case):
    assert_logits_equal(case["stage"], case["hf"], case["cfg"].model.vocab)


def test_norm_topk_prob_changes_the_output(case):
    """The other router setting on the same weights gives other logits: the flag is used."""
    m, stage = case["cfg"].model, case["stage"]
    ids = token_ids(m.vocab)
    ours = logits(stage, ids)
    moe = [mod for mod in stage.modules() if isinstance(mod, rt.Router)]
    assert moe and all(mod.norm_topk_prob == m.norm_topk_prob for mod in moe)
    try:
        for mod in moe:
            mod.norm_topk_prob = not m.norm_topk_prob
        other = logits(stage, ids)
    finally:
        for mod in moe:
            mod.norm_topk_prob = m.norm_topk_prob
    assert (ours - other).abs().max() > 1e-3


def test_route_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = torch.softmax(logits, -1)
    w, e, _ = route(logits, 2, norm_topk_prob=False)
    assert e.tolist() == [[0, 1]]
    torch.testing.assert_close(w, p[:, :2])
    w, _, _ = route(logits, 2)
    torch.testing.assert_close(w, p[:, :2] / p[:, :2].sum())


def test_hf_output_of_a_fine_tune_loads_back_in_transformers(case, tmp_path):
    m = case["cfg"].model
    out = fine_tune(case["cfg"], case["tmp"] / "hf", tmp_path)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "qwen3_moe" and written["norm_topk_prob"] == case["norm"]
    assert written["mlp_only_layers"] == [0] and written["num_experts"] == EXPERTS
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    ref_sd, got_sd = case["hf"].state_dict(), back.state_dict()
    assert set(ref_sd) == set(got_sd)
    moved = [k for k in ref_sd if not torch.equal(ref_sd[k], got_sd[k])]
    assert any("experts.gate_up_proj" in k for k in moved) and any("mlp.gate.weight" in k for k in moved)
    # the written checkpoint read into parcompile again gives transformers' logits of it
    stage, _ = stage_from_hf(case["cfg"], out, tmp_path / "prog_back")
    ids = token_ids(m.vocab)
    with torch.no_grad():
        torch.testing.assert_close(logits(stage, ids)[..., :m.vocab], back(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)
    assert tiny_config(model=import_keys(out)).model == m   # the config imports as the same model
    assert not check_checkpoint(out, expected_shapes(m), m)


def test_fused_expert_layout_loads(case, tmp_path):
    """transformers' in-memory layout (mlp.experts.gate_up_proj / down_proj) is read too."""
    from safetensors.torch import save_file

    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((case["tmp"] / "hf" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in case["hf"].state_dict().items()}, str(fused / "model.safetensors"))
    stage, _ = stage_from_hf(case["cfg"], fused, tmp_path / "prog")
    ids = token_ids(case["cfg"].model.vocab)
    torch.testing.assert_close(logits(stage, ids), logits(case["stage"], ids), atol=0, rtol=0)


# ---- the layer placement ------------------------------------------------------------------------


def _raw(**extra) -> dict:
    cfg = _hf_config(True, **extra).to_dict()
    cfg["model_type"] = "qwen3_moe"
    return cfg


@pytest.mark.parametrize("only, step", [([], 1), ([0], 1), ([0, 1, 2], 1), ([1, 0], 1), ([0, 1, 2, 3], 1),
                                        ([2], 1), ([], 2), ([0], 2), ([1, 3], 1), ([3], 1)])
def test_layer_placement_is_transformers_or_refused(only, step):
    """dense_layers where transformers' Qwen3MoeDecoderLayer puts dense MLPs on exactly the
    first N layers; any other placement is refused, naming the layers."""
    raw = _raw(mlp_only_layers=only, decoder_sparse_step=step)
    hf = transformers.Qwen3MoeConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        layers = transformers.Qwen3MoeForCausalLM(hf).model.layers
    moe = [hasattr(layer.mlp, "experts") for layer in layers]
    n = moe.index(True) if True in moe else LAYERS
    if all(moe[n:]):
        assert from_hf_dict(raw)["dense_layers"] == n
        return
    with pytest.raises(HFConfigError, match="dense after the mixture-of-experts layer") as e:
        from_hf_dict(raw)
    dense_after = [i for i in range(n, LAYERS) if not moe[i]]
    assert ", ".join(map(str, dense_after)) in e.value.message
    assert "dense_layers = N" in e.value.help


def test_unmappable_placement_is_a_diagnostic_at_the_from(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_raw(decoder_sparse_step=2, mlp_only_layers=[])))
    spec = tmp_path / "s.par"
    spec.write_text('model m from "config.json" { }\ncluster c from "cpu" { gpus_per_node = 1 }\n')
    with pytest.raises(parcompile.SpecError) as e:
        parcompile.compile(spec)
    [d] = [d for d in e.value.diagnostics if d.severity == "error"]
    assert (d.span.line, d.span.column) == (1, 14)
    assert "`decoder_sparse_step` = 2" in d.message and "layer 2 dense" in d.message
    assert d.help and "mlp_only_layers" in d.help


def test_transformers_defaults_fill_absent_fields():
    """A config.json without the MoE fields gets Qwen3MoeConfig's defaults (norm_topk_prob
    false among them), as transformers loads it."""
    raw = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}
    d = transformers.Qwen3MoeConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    keys = from_hf_dict(raw)
    assert (keys["experts"], keys["top_k"], keys["expert_ffn_hidden"], keys["norm_topk_prob"],
            keys["router_aux_loss"], keys["dense_layers"]) == (
        d.num_experts, d.num_experts_per_tok, d.moe_intermediate_size, d.norm_topk_prob, d.router_aux_loss_coef, 0)


# ---- presets ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_qwen3_presets_count_as_transformers(name, tmp_path):
    """The plan's total and active parameters of each preset against transformers' module
    of its config.json (meta device, no memory)."""
    m = ModelConfig(name=name, **MODEL_PRESETS[name])
    raw = hf_config(m)
    kls = transformers.Qwen3MoeConfig if raw["model_type"] == "qwen3_moe" else transformers.Qwen3Config
    hcfg = kls(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type", "transformers_version")})
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hcfg)
    total = sum(p.numel() for p in hf.parameters())
    experts = [sum(p.numel() for p in layer.mlp.experts.parameters()) for layer in hf.model.layers
               if hasattr(layer.mlp, "experts")]
    active = total - sum(n * (m.experts - m.top_k) // m.experts for n in experts)
    spec = tmp_path / "s.par"
    spec.write_text(f'model q from "{name}" {{ seq_len = 4096 }}\ncluster c from "h100-sxm" {{ nodes = 8 }}\n'
                    'parallel { tp = 4, pp = 2, sequence_parallel = true }\n')
    plan = parcompile.compile(spec)
    assert plan.data["model"]["params"] == total
    assert plan.data["model"]["active_params"] == active
    published = {"qwen3-8b": 8_190_735_360, "qwen3-30b-a3b": 30_532_122_624, "qwen3-235b-a22b": 235_093_634_560}
    assert total == published[name]   # the model cards' safetensors totals


def test_norm_topk_prob_on_a_dense_model_warns():
    from parcompile.frontend import load_spec

    cfg, diags = load_spec('model m from "qwen3-8b" { norm_topk_prob = false }\ncluster c from "h100-sxm" { }\n'
                           'parallel { tp = 8 }\n', filename="p.par")
    [w] = [d for d in diags if "norm_topk_prob" in d.message]
    assert w.severity == "warning" and (w.span.line, w.span.column) == (1, 44) and "has no effect" in w.message
    cfg, diags = load_spec('model m from "qwen3-30b-a3b" { norm_topk_prob = false }\ncluster c from "h100-sxm" { }\n'
                           'parallel { tp = 4, ep = 2, sequence_parallel = true }\n', filename="p.par")
    assert cfg.model.norm_topk_prob is False and not [d for d in diags if "norm_topk_prob" in d.message]


@pytest.mark.parametrize("norm", [True, False])
def test_megatron_export_routes_as_the_model(norm, tmp_path):
    """Megatron-Core's default router takes the top-k logits, then the softmax over them
    (renormalised); --moe-router-pre-softmax is the softmax over every expert, then top-k."""
    from parcompile.exporters import export

    spec = tmp_path / "s.par"
    spec.write_text(f'model q from "qwen3-30b-a3b" {{ seq_len = 4096, norm_topk_prob = {str(norm).lower()} }}\n'
                    'cluster c from "h100-sxm" { nodes = 2 }\nparallel { tp = 4, ep = 4, sequence_parallel = true }\n')
    text = export(parcompile.compile(spec), "megatron").text
    assert ("--moe-router-pre-softmax" in text) is (not norm)
    assert "--qk-layernorm" in text and "--moe-router-topk 8" in text
