"""DeepSeek-V3 (`deepseek_v3`, issue 18) against transformers' own DeepseekV3ForCausalLM (fp32, CPU).

A tiny random DeepseekV3Config (4 layers, hidden 64, 4 heads; multi-head latent attention
with a 16-wide kv latent, 8 + 4 dims per q/k head, 8 per value head, a 32-wide query
latent or none; interleaved RoPE with YaRN and DeepSeek's mscale; 8 routed experts in 2
groups, top-2 within the best group by sigmoid scores plus a correction bias, weights
normalised and times 2.5, one shared expert, a dense first layer) saved with
``save_pretrained``: its config.json imports with ``from_hf_dict``; the plan's parameter
counts equal transformers'; ``load_hf`` fills a single-process program whose logits equal
transformers' (eager attention); the serve program's greedy tokens equal ``generate`` in
one process and under tp 2, its cache (the latent and the RoPE key) the plan's bytes;
``hf_output`` of a short fine-tune loads back with ``from_pretrained``. Every rule is read
off transformers' modules, never parcompile's output. The preset counts as transformers
counts the published config (meta device), plans on 32 x 8 H100 with ep, and keeps
61 x (512 + 64) x 2 = 70,272 KV bytes per token at any tp.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from parcompile.core.hf_weights import expected_shapes, hf_family
from parcompile.frontend import load_spec
from tests.family_utils import (assert_logits_equal, check_written_back, fine_tune, import_keys, stage_from_hf)
from tests.program_utils import tiny_config
from tests.serve_utils import build_serve, run_in_process

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e .[test])")

LAYERS, EXPERTS, TOP_K, DENSE, VOCAB = 4, 8, 2, 1, 300
ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}


def _hf_config(q_lora_rank):
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=EXPERTS, n_group=2, topk_group=1, num_experts_per_tok=TOP_K,
        n_shared_experts=1, first_k_dense_replace=DENSE, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True,
        rope_parameters=dict(ROPE), bos_token_id=None, eos_token_id=None, pad_token_id=None, num_mtp_layers=0)


def _save(q_lora_rank, path: Path):
    torch.manual_seed(31)
    hf = transformers.DeepseekV3ForCausalLM(_hf_config(q_lora_rank)).float().eval()
    hf.config._attn_implementation = "eager"
    with torch.no_grad():   # norms away from 1, a decisive router, a correction bias that matters
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


@pytest.fixture(scope="module", params=[32, None], ids=["q_lora", "no_q_lora"])
def case(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepseek_v3")
    hf = _save(request.param, tmp / "hf")
    keys = import_keys(tmp / "hf")
    cfg = tiny_config(model=keys, name="deepseek_v3")
    stage, plan = stage_from_hf(cfg, tmp / "hf", tmp / "prog")
    return dict(q_lora=request.param, tmp=tmp, hf=hf, cfg=cfg, stage=stage, plan=plan)


def test_import_maps_every_field(case):
    m, c = case["cfg"].model, case["hf"].config
    assert (m.kv_lora_rank, m.q_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (
        c.kv_lora_rank, c.q_lora_rank or 0, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim)
    assert m.head_dim == c.qk_nope_head_dim + c.qk_rope_head_dim and m.kv_heads == m.heads
    assert (m.experts, m.top_k, m.shared_experts, m.dense_layers) == (EXPERTS, TOP_K, 1, DENSE)
    assert (m.scoring_func, m.topk_method, m.n_group, m.topk_group, m.routed_scaling_factor) == (
        "sigmoid", "noaux_tc", 2, 1, 2.5)
    assert (m.rope_type, m.rope_mscale, m.rope_mscale_all_dim, m.rope_interleave) == ("yarn", 0.707, 1.0, True)
    assert hf_family(m) == "deepseek_v3"


def test_parameter_counts_equal_transformers(case):
    hf = case["hf"]
    total = sum(p.numel() for p in hf.parameters())
    assert case["plan"]["model"]["params"] == total
    assert sum(math.prod(s) for s in expected_shapes(case["cfg"].model).values()) == total
    # active: the routed experts a token does not reach drop out (top_k of the experts)
    routed = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    assert case["plan"]["model"]["active_params"] == total - routed * (EXPERTS - TOP_K) // EXPERTS


def test_logits_equal_transformers(case):
    assert_logits_equal(case["stage"], case["hf"], VOCAB)


PROMPTS = [[5, 17, 99, 3, 250, 42], [7, 7, 120, 9, 31, 299]]


def _serve_spec(root: Path, tp: int):
    spec = root / f"serve_tp{tp}.par"
    spec.write_text('model m from "hf/config.json" { dtype = fp32 }\n'
                    f'cluster c from "cpu" {{ gpus_per_node = {tp} }}\nparallel {{ tp = {tp} }}\n'
                    'serve { batch = 2, prompt_len = 6, max_new_tokens = 8, weights = "hf" }\n')
    cfg, _ = load_spec(spec)
    return cfg


def _generate(hf):
    with torch.no_grad():
        return hf.generate(torch.tensor(PROMPTS), max_new_tokens=8, do_sample=False,
                           attention_mask=torch.ones(2, 6, dtype=torch.long))[:, 6:].tolist()


def test_greedy_serving_equals_generate(case, tmp_path):
    plan = build_serve(_serve_spec(case["tmp"], 1), tmp_path / "prog")
    got = run_in_process(tmp_path / "prog", sum((["--prompt-ids", ",".join(map(str, p))] for p in PROMPTS), []))
    assert got["tokens"] == _generate(case["hf"])
    # the latent (16) and the RoPE key (4) per token and layer: 2 sequences x 14 tokens x 4 layers, fp32
    assert got["cache_bytes"] == plan["serve"]["kv_cache_bytes_per_rank"] == 2 * 14 * LAYERS * (16 + 4) * 4


@pytest.fixture(scope="module")
def tp2_served(tmp_path_factory):
    """Both cases served under tp 2 in one torchrun launch of 2 ranks (a launch costs more
    than both runs on CI's 2 cores): q_lora_rank -> (plan, each rank's record)."""
    from tests.serve_utils import serve_cases_in_one_launch

    return serve_cases_in_one_launch(tmp_path_factory, "deepseek_v3_tp2", (32, None), _save, _serve_spec, PROMPTS)


@pytest.mark.torchrun
def test_tp2_greedy_serving_equals_generate(case, tp2_served):
    """tp 2 (one launch for both cases): the heads' up projections split, the latent cache
    replicated on both ranks."""
    from tests.serve_utils import replica_tokens

    plan, recs = tp2_served[case["q_lora"]]
    assert replica_tokens(recs) == _generate(case["hf"])
    assert all(r["cache_bytes"] == plan["serve"]["kv_cache_bytes_per_rank"] == 2 * 14 * LAYERS * 20 * 4
               for r in recs)


def test_hf_output_of_a_fine_tune_loads_back_in_transformers(case, tmp_path):
    cfg = case["cfg"]
    out = fine_tune(cfg, case["tmp"] / "hf", tmp_path)
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    moved = ("kv_a_proj_with_mqa", "kv_b_proj", "shared_experts", "mlp.gate.weight")
    back = check_written_back(cfg, out, case["hf"], tmp_path / "prog_back",
                              moved=moved + (("q_b_proj",) if case["q_lora"] else ("q_proj",)))
    # the correction bias is held fixed and written back as it was read
    for n, b in case["hf"].named_buffers():
        if n.endswith("e_score_correction_bias"):
            assert torch.equal(dict(back.named_buffers())[n], b)


def _preset_spec(tmp_path: Path, body: str, name: str = "d.par") -> Path:
    spec = tmp_path / name
    spec.write_text('model d from "deepseek-v3" { }\n' + body)
    return spec


def test_the_preset_counts_as_transformers_and_plans_on_32_nodes_with_ep(tmp_path):
    import parcompile

    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(num_mtp_layers=0))
    total = sum(p.numel() for p in hf.parameters())
    plan = parcompile.compile(_preset_spec(tmp_path, (
        'cluster c from "h100-sxm" { nodes = 32 }\n'
        'parallel { tp = 8, pp = 8, ep = 32, expert_tp = 1, sequence_parallel = true, zero = 1, '
        'recompute = full, global_batch = 1024 }\n')))
    assert plan.data["model"]["params"] == total == 671_026_404_352
    # DeepSeek-V3's report: 37B activated per token
    assert round(plan.data["model"]["active_params"] / 1e9) == 38
    assert plan.data["memory"]["fits"]


@pytest.mark.parametrize("tp", [1, 2, 8, 16])
def test_kv_bytes_per_token_are_the_latent_at_any_tp(tp, tmp_path):
    """61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes (bf16) = 70,272, the
    same on every tp rank (pp = 1; GPUs of 2 TiB so that every tp fits: the rule, not the
    fit, is under test); Llama-3 8B's stay 32 layers x 2 x 8 kv heads x 128 x 2 = 131,072."""
    import parcompile

    serve = 'serve { batch = 1, prompt_len = 1024, max_new_tokens = 128 }\n'
    cluster = f'cluster c from "h200" {{ nodes = 2, memory = 2 TiB }}\nparallel {{ tp = {tp} }}\n'
    plan = parcompile.compile(_preset_spec(tmp_path, cluster + serve))
    assert plan.data["serve"]["kv_bytes_per_token"] == 70_272
    llama = tmp_path / "l.par"
    llama.write_text('model l from "llama3-8b" { }\n' + cluster.replace("tp = 16", "tp = 8") + serve)
    assert parcompile.compile(llama).data["serve"]["kv_bytes_per_token"] == 131_072 // min(tp, 8)


#: deepseek-ai/DeepSeek-V3 inference/configs/config_671B.json at commit
#: 9b4e9788e4a3a731f7567338ed15d3ec549ce03b: n_layers, n_heads, kv_lora_rank, qk_rope_head_dim
V3_LAYERS, V3_HEADS, V3_KV_LORA, V3_ROPE = 61, 128, 512, 64


@pytest.mark.parametrize("tp", [1, 8])
def test_decode_is_costed_in_the_absorbed_form_from_the_graph(tp, tmp_path):
    """The serving estimate's decode step of DeepSeek-V3 (analysis/serve.py step_costs, from
    the serving graph) against a hand count from the published config: the cache it reads
    per token of context is the latent and the RoPE key of every layer, once for all heads
    and the same on every tp rank (bf16); the scores and weighted sums are the latent dot
    products per local head (DeepSeek-V2 section 2.1.1's absorbed form, as vLLM decodes):
    2 (c + r) + 2 c FLOPs per cached token, not the expanded 2 (n + r) + 2 v."""
    import parcompile
    from parcompile.analysis.serve import step_costs
    from parcompile.passes.manager import compile_graph

    spec = _preset_spec(tmp_path, f'cluster c from "h200" {{ nodes = 2, memory = 2 TiB }}\nparallel {{ tp = {tp} }}\n'
                                  'serve { batch = 1, prompt_len = 1024, max_new_tokens = 128 }\n')
    cfg, _ = load_spec(spec)
    c = compile_graph(cfg)
    context = 1000
    (decode,) = step_costs(cfg, c.graph, c.ctx.degrees, 1, 1, context)
    assert decode.kv_bytes_per_token == V3_LAYERS * (V3_KV_LORA + V3_ROPE) * 2 == 70_272
    assert decode.kv_layers == ((0, (V3_KV_LORA + V3_ROPE) * 2),) * V3_LAYERS
    per_head = 2 * context * (V3_KV_LORA + V3_ROPE) + 2 * context * V3_KV_LORA
    assert decode.attn_flops == V3_LAYERS * (V3_HEADS // tp) * per_head
    # the plan's figure is the same rule (analysis/kv.py)
    assert parcompile.compile(spec).data["serve"]["kv_bytes_per_token"] == decode.kv_bytes_per_token


def test_the_preset_serves_on_two_h200_nodes(tmp_path):
    """tp 8 x pp 2 on 16 H200s: 31 and 30 layers a stage, their latent caches."""
    import parcompile

    plan = parcompile.compile(_preset_spec(tmp_path, 'cluster c from "h200" { nodes = 2 }\n'
                                           'parallel { tp = 8, pp = 2 }\n'
                                           'serve { batch = 8, prompt_len = 2048, max_new_tokens = 512 }\n'))
    sv = plan.data["serve"]
    assert sv["fits"] and sv["kv_bytes_per_token_per_stage"] == [31 * 1152, 30 * 1152]
    # one latent "kv head", the same on all 8 ranks of a tp group (vLLM's MLA cache)
    assert (sv["kv_heads_per_rank"], sv["kv_head_replicas"]) == (1, 8)


MLA = "kv_lora_rank = 16, q_lora_rank = 32, qk_nope_head_dim = 8, qk_rope_head_dim = 4, v_head_dim = 8"


@pytest.mark.parametrize("model, parallel, gpus, want", [
    (MLA, "tp = 8", 8, "tp = 8 does not divide heads = 4"),
    (MLA + ", kv_heads = 2", "", 1, "kv_heads = 2 != heads = 4"),
    (MLA + ", head_dim = 16", "", 1, "qk_nope_head_dim + qk_rope_head_dim = 12 wide; head_dim = 16"),
    (MLA + ", qk_norm = true", "", 1, "qk-norm with multi-head latent attention is not built"),
    (MLA + ", sliding_window = 8", "", 1, "a sliding window with multi-head latent attention is not built"),
    (MLA, "cp = 2", 2, "context parallelism (cp = 2) with multi-head latent attention is not built"),
    (MLA.replace("qk_rope_head_dim = 4", "qk_rope_head_dim = 5"), "", 1,
     "RoPE needs an even number of dims per head: qk_rope_head_dim = 5"),
    (MLA.replace("v_head_dim = 8", "v_head_dim = 0"), "", 1, "multi-head latent attention needs v_head_dim > 0"),
    (MLA + ", experts = 6, top_k = 2, scoring_func = sigmoid, topk_method = noaux_tc, n_group = 4", "", 1,
     "n_group = 4 does not divide experts = 6"),
    ("q_lora_rank = 32", "", 1, "kv_lora_rank = 0"),
])
def test_each_mla_rule_is_a_spanned_diagnostic(model, parallel, gpus, want, tmp_path):
    from parcompile.diagnostics import SpecError

    spec = tmp_path / "m.par"
    spec.write_text("model m {\n    layers = 2, hidden = 64, heads = 4, vocab = 256, seq_len = 32\n"
                    f"    {model}\n}}\ncluster c from \"cpu\" {{ gpus_per_node = {gpus} }}\nparallel {{ {parallel} }}\n")
    with pytest.raises(SpecError) as e:
        load_spec(spec)
    text = str(e.value)
    assert want in text, text
    assert "m.par:" in text   # file:line:col


def test_megatron_export_names_mla_and_the_router(tmp_path):
    """The Megatron-LM flags of DeepSeek-V3 (Megatron-Core's MLA and sigmoid router), as its
    DeepSeek-V3 recipes write them: each value from the preset's published config."""
    import parcompile
    from parcompile.exporters import megatron_args

    plan = parcompile.compile(_preset_spec(tmp_path, (
        'cluster c from "h100-sxm" { nodes = 32 }\n'
        'parallel { tp = 8, pp = 8, ep = 32, expert_tp = 1, sequence_parallel = true, zero = 1, '
        'recompute = full, global_batch = 1024 }\n')))
    flags = dict(megatron_args(plan)[0])
    assert {k: flags[k] for k in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
                                  "--v-head-dim", "--moe-router-score-function", "--moe-router-num-groups",
                                  "--moe-router-group-topk", "--moe-router-topk-scaling-factor",
                                  "--moe-shared-expert-intermediate-size", "--moe-layer-freq")} == {
        "--q-lora-rank": "1536", "--kv-lora-rank": "512", "--qk-head-dim": "128", "--qk-pos-emb-head-dim": "64",
        "--v-head-dim": "128", "--moe-router-score-function": "sigmoid", "--moe-router-num-groups": "8",
        "--moe-router-group-topk": "4", "--moe-router-topk-scaling-factor": "2.5",
        "--moe-shared-expert-intermediate-size": "2048", "--moe-layer-freq": "([0]*3+[1]*58)"}
    assert "--multi-latent-attention" in flags and "--moe-router-enable-expert-bias" in flags
    assert "--kv-channels" not in flags
