"""``parallel.recompute`` as a list of Megatron-Core modules and ``parallel.grad_dtype``
(parcompile/core/recompute.py, parcompile/analysis/module_saves.py): diagnostics, the bytes
each module drops (from the tensors' shapes, not from the plan), the time it adds, the
exports."""

from __future__ import annotations

import json

import pytest

import parcompile
from parcompile.diagnostics import SpecError

H, S, B, E, K, F = 64, 32, 2, 4, 2, 96   # hidden, seq, micro-batch, experts, top_k, expert ffn


def spec(recompute: str = "none", grad: str = "", extra_model: str = "", cluster: str = "h100-sxm",
         zero: int = 1) -> str:
    return f"""
model m {{
    layers = 2
    hidden = {H}
    heads = 4
    vocab = 256
    seq_len = {S}
    experts = {E}
    top_k = {K}
    expert_ffn_hidden = {F}
    {extra_model}
}}
cluster c from "{cluster}" {{
    nodes = 1
    gpus_per_node = 2
}}
parallel {{
    dp = 2
    zero = {zero}
    micro_batch = {B}
    recompute = {recompute}
    {grad}
}}
train {{ }}
"""


def errors(src: str) -> list[str]:
    with pytest.raises(SpecError) as e:
        parcompile.compile(src, filename="m.par")
    return [f"{d.span.line}:{d.span.column}: {d.message}" for d in e.value.diagnostics]


def test_list_entries_are_checked_each_at_its_column():
    got = errors(spec("[moe_act, full, moe_ac, moe_act]"))
    line = spec("[moe_act, full, moe_ac, moe_act]").splitlines().index(
        "    recompute = [moe_act, full, moe_ac, moe_act]") + 1
    assert got == [f"{line}:27: `full` cannot be combined with a list of modules: full recomputes whole layers",
                   f"{line}:33: unknown recompute module `moe_ac`",
                   f"{line}:41: recompute module `moe_act` given twice"]
    assert errors(spec("[]"))[0].endswith("recompute = [] names no module")


@pytest.mark.parametrize("word, hint", [("layernorm", "`[layernorm]`"), ("moe_ac", "`[moe_act]`"),
                                        ("Full", "`full` (values are case-sensitive)")])
def test_a_bare_module_name_is_pointed_at_the_list(word, hint):
    # was: recompute = layernorm got "did you mean `layernorm` (values are case-sensitive)?"
    with pytest.raises(SpecError) as e:
        parcompile.compile(spec(word), filename="m.par")
    assert e.value.diagnostics[0].help.startswith(f"did you mean {hint}? ")


@pytest.mark.parametrize("module, words", [("mla_up_proj", "needs multi-latent attention"),
                                           ("shared_experts", "needs shared experts"),
                                           ("mlp", "every layer of this model is a mixture-of-experts layer")])
def test_a_module_the_model_lacks_is_an_error(module, words):
    assert any(words in e for e in errors(spec(f"[{module}]")))


def test_moe_modules_need_experts():
    src = spec("[moe_act]").replace(f"experts = {E}", "experts = 0").replace(f"top_k = {K}", "")
    assert any("`moe_act` needs a mixture-of-experts model" in e for e in errors(src))


def test_grad_dtype_needs_a_bf16_model_and_agrees_with_reduce_dtype():
    assert any("grad_dtype = bf16 needs a bf16 model" in e
               for e in errors(spec(grad="grad_dtype = bf16", extra_model="dtype = fp32")))
    assert any("but reduce_dtype = fp32" in e for e in errors(spec(grad="grad_dtype = bf16\n reduce_dtype = fp32")))


def _layer_saves(src: str) -> int:
    p = parcompile.compile(src)
    return dict(p.data["memory"]["per_stage"][0]["activations_per_layer"])[1]


def test_layernorm_drops_the_two_norm_outputs():
    # one micro-batch's (b, s, h) bf16 output of attn_norm and of mlp_norm, one rank (dp only)
    norm_out = B * S * H * 2
    assert _layer_saves(spec("none")) - _layer_saves(spec("[layernorm]")) == 2 * norm_out


def test_moe_act_drops_the_experts_activation_output():
    # the (token, choice) rows' swiglu product, ffn wide, bf16: linear_fc2's input
    act_out = B * S * K * F * 2
    assert _layer_saves(spec("none")) - _layer_saves(spec("[moe_act]")) == act_out


def test_moe_keeps_the_layers_mlp_input_only():
    # the whole MoE MLP checkpointed: it keeps the mlp_norm output it reads (b, s, h), and no more
    # than the layer's attention half plus that input
    p_none, p_moe = _layer_saves(spec("none")), _layer_saves(spec("[moe]"))
    attn_half = _layer_saves(spec("[moe]"))
    assert p_moe < p_none
    assert attn_half >= B * S * H * 2


def test_recomputed_modules_add_their_forward_time():
    t = {rc: parcompile.compile(spec(rc)).data["estimate"]["breakdown"]["recompute"]
         for rc in ("none", "[layernorm]", "[moe]")}
    assert t["none"] == 0 < t["[layernorm]"] < t["[moe]"]


def _one_gpu(src: str) -> str:
    """``src`` on one GPU (dp 1): the step is the micro-batches' chunk times and the optimizer."""
    return src.replace("gpus_per_node = 2", "gpus_per_node = 1").replace("dp = 2", "dp = 1")


def test_each_module_adds_its_forward_once_more_to_the_step():
    # was: moe_act added nothing (its activation, part of the experts op, was left out).
    # Expected from the tensors' shapes and the GPU's figures: an elementwise kernel moves its
    # bytes at the memory bandwidth (efficiency x hbm_bw, over the engine's elementwise factor);
    # a GEMM takes the GEMM-rate model's time for its shape (analysis/gemm.py, held to its own
    # sources in tests/test_gemm_rate.py); one micro-batch, two layers, bf16
    from parcompile.analysis.gemm import gemm_pricer

    def step(src):
        return parcompile.compile(_one_gpu(src))

    def bandwidth(plan):
        e = plan.data["estimate"]["assumptions"]
        return e["memory_efficiency"] * plan.config.cluster.hbm_bw / e["elementwise_traffic"]

    none, act = step(spec("none")), step(spec("[moe_act]"))
    assert none.config.parallel.num_microbatches == 1
    # SwiGLU over the (token, choice) rows: gate and up read, their product written
    act_bytes = 3 * B * S * K * F * 2
    got = act.data["estimate"]["step_time"] - none.data["estimate"]["step_time"]
    assert got == pytest.approx(2 * act_bytes / bandwidth(act), rel=1e-9)

    n, r, v, c, cq, heads = 8, 8, 16, 16, 16, 4   # qk_nope, qk_rope, v, kv_lora, q_lora head dims
    mla = (f"kv_lora_rank = {c}\n q_lora_rank = {cq}\n qk_rope_head_dim = {r}\n qk_nope_head_dim = {n}\n "
           f"v_head_dim = {v}")
    none, up = step(spec("none", extra_model=mla)), step(spec("[mla_up_proj]", extra_model=mla))
    rows, g = B * S, gemm_pricer(up.config)
    gemms = g.train_seconds(rows, heads * (n + r), cq) + g.train_seconds(rows, heads * (n + v), c)   # wq_b, wkv_b
    moved = 2 * rows * (2 * heads * (n + r)          # RoPE on q: read, write
                        + (c + r) + r                 # RoPE on the shared key: wkv_a's output read, the key written
                        + heads * (n + v) + heads * v  # the values: wkv_b's output read, copied out
                        + 2 * heads * (n + r))        # the keys [k_nope, rope key] per head: read, written
    got = up.data["estimate"]["step_time"] - none.data["estimate"]["step_time"]
    assert got == pytest.approx(2 * (gemms + moved / bandwidth(up)), rel=1e-9)


def test_grad_dtype_bf16_halves_the_gradient_buffers_and_the_dp_reduction():
    f32, b16 = (parcompile.compile(spec(grad=g)) for g in ("", "grad_dtype = bf16"))
    assert 2 * b16.data["memory"]["per_stage"][0]["grads"] == f32.data["memory"]["per_stage"][0]["grads"]

    def reduced(plan):   # the gradient reduce-scatters over data parallelism (zero 1), bytes
        return [c["bytes"] for c in plan.data["comm"]["collectives"] if c["op"] == "reduce_scatter"]
    assert reduced(f32) and [2 * b for b in reduced(b16)] == reduced(f32)


def test_megatron_export_carries_the_modules_and_the_grad_dtype():
    # every flag one Megatron-LM core_v0.19.0's parser took for this plan (tests/check_engine_parsers.py
    # megatron, its _megatron_module_plans: the sets' provenance is in tests/test_export.py)
    from tests.test_export import (MEGATRON_CORE_V0_19_0_FLAGS, MEGATRON_CORE_V0_19_0_PRECISION_FLAGS,
                                   MEGATRON_CORE_V0_19_0_RECOMPUTE_FLAGS, parse_megatron)

    plan = parcompile.compile(spec("[layernorm, moe_act]", grad="grad_dtype = bf16"))
    _launcher, flags = parse_megatron(parcompile.export(plan, "megatron").text)
    assert flags["--recompute-granularity"] == "selective"
    assert flags["--recompute-modules"] == "layernorm moe_act"
    assert flags["--grad-reduce-in-bf16"] is True
    assert set(flags) <= (MEGATRON_CORE_V0_19_0_FLAGS | MEGATRON_CORE_V0_19_0_PRECISION_FLAGS
                          | MEGATRON_CORE_V0_19_0_RECOMPUTE_FLAGS)


@pytest.mark.parametrize("target", ["deepspeed", "torchtitan"])
def test_other_exports_refuse_a_module_list(target):
    plan = parcompile.compile(spec("[layernorm, moe_act]"))
    out = parcompile.export(plan, target)
    assert any("module list is not expressible" in e for e in out.errors)


def test_the_program_checkpoints_the_modules_it_runs_again(tmp_path):
    # the training program wraps the recomputed modules whole (rt.checkpointed, the same
    # boundaries as Megatron-Core's); tests/test_verify.py runs them against one process
    src = spec("[mlp, shared_experts, core_attn]", cluster="cpu", extra_model="shared_experts = 1\n dense_layers = 1")
    parcompile.compile(src).write(tmp_path)
    text = (tmp_path / "program.py").read_text()
    assert "self.mlp = MoE(i, tp, experts) if i >= DENSE_LAYERS else rt.checkpointed(MLP(i, tp))" in text
    assert "self.shared = rt.checkpointed(SharedMLP(i, tp))" in text
    assert "recompute=True" in text   # the attention core
    moe = parcompile.compile(spec("[moe]", cluster="cpu")).write(tmp_path / "moe")
    assert "self.mlp = rt.checkpointed(MoE(i, tp, experts))" in (tmp_path / "moe" / "program.py").read_text()
    parcompile.compile(spec("[moe_act, layernorm]", cluster="cpu")).write(tmp_path / "act")
    text = (tmp_path / "act" / "program.py").read_text()
    assert "recompute_act=True" in text   # GroupedExperts
    assert "rt.discard_between(self.attn_norm, self.attn)" in text and "rt.discard_between(self.mlp_norm, self.mlp)" in text


def test_the_cpu_plan_prices_what_the_program_frees():
    # the program frees moe_act's, layernorm's and mla_up_proj's outputs (tests/test_verify.py
    # measures them; was: mla_up_proj's kept on the cpu preset, with a warning at the module)
    cpu_none = _layer_saves(spec("none", cluster="cpu"))
    assert cpu_none - _layer_saves(spec("[moe_act]", cluster="cpu")) == B * S * K * F * 2   # the bf16 product
    # the program's router keeps an fp32 copy of its input, not mlp_norm's output: only attn_norm's is freed
    assert cpu_none - _layer_saves(spec("[layernorm]", cluster="cpu")) == B * S * H * 2
    mla = "kv_lora_rank = 16\n q_lora_rank = 16\n qk_rope_head_dim = 8\n qk_nope_head_dim = 8\n v_head_dim = 16"
    src = spec("[mla_up_proj]", cluster="cpu", extra_model=mla)
    assert _layer_saves(src) < _layer_saves(spec("none", cluster="cpu", extra_model=mla))
    assert not parcompile.compile(src).warnings
    assert _layer_saves(spec("[mla_up_proj]", extra_model=mla)) < _layer_saves(spec("none", extra_model=mla))


@pytest.mark.slow
@pytest.mark.parametrize("q_lora", [16, 0])
def test_the_program_frees_mla_up_projections_as_planned(tmp_path, q_lora):
    """The generated program's meter (saved-tensor hooks, one process, one step;
    runtime/machine/memory.py) against the plan, per layer: what mla_up_proj frees is the
    query and key the core would keep (its padded copy of the value stays: the program's
    fused core pads MLA's value), and with core_attn the checkpoint's q, k and v; each to the
    byte of the plan's difference. (The plan leaves out the norms' fp32 statistics, the same
    bytes under each value: measured minus planned is one constant.) Was: the program
    kept them all (fails: a saving of 0)."""
    from parcompile.verification import _emit, _run_reference
    from tests.program_utils import tiny_config

    mk = dict(kv_lora_rank=16, q_lora_rank=q_lora, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_heads=4)
    b, s, heads, e = 2, 16, 4, 4    # tiny_config: micro-batch, seq_len, heads, fp32

    def saves(rc):
        plan = _emit(tiny_config(1, 1, 1, model=mk, parallel=dict(recompute=rc)), tmp_path / str(rc))
        _run_reference(tmp_path / str(rc), tmp_path / str(rc) / "metrics", 1)
        got = json.loads((tmp_path / str(rc) / "metrics" / "rank0.json").read_text())["saved_per_layer"]
        return got["1"], dict(plan["memory"]["per_stage"][0]["activations_per_layer"])[1]

    (m_none, p_none), (m_up, p_up) = saves("none"), saves(("mla_up_proj",))
    (m_core, p_core), (m_both, p_both) = saves(("core_attn",)), saves(("mla_up_proj", "core_attn"))
    q = k = b * s * heads * (8 + 4) * e
    v = b * s * heads * 8 * e
    assert m_none - m_up == q + k == p_none - p_up
    assert m_core - m_both == q + k + v == p_core - p_both
    assert m_none - p_none == m_up - p_up == m_both - p_both


def test_megatron_bridge_export_sets_the_recipe_fields():
    # Megatron-Bridge's gpt-oss recipes set model.recompute_modules and ddp.grad_reduce_in_fp32 = False
    from parcompile.exporters import megatron_bridge_config

    sections, _notes, errors = megatron_bridge_config(parcompile.compile(spec("[layernorm, moe_act]",
                                                                              grad="grad_dtype = bf16")))
    assert sections["model"]["recompute_granularity"] == "selective"
    assert sections["model"]["recompute_modules"] == ["layernorm", "moe_act"]
    assert sections["ddp"]["grad_reduce_in_fp32"] is False
    assert not [e for e in errors if "recompute" in e or "grad" in e]


def test_selective_is_megatrons_default_list():
    # Megatron-Core's recompute_modules default is [core_attn]: an MoE layer's selective
    # recomputation drops the attention core's own tensors only (the fused kernel's
    # log-sum-exp), none of the experts'
    assert _layer_saves(spec("selective")) == _layer_saves(spec("[core_attn]"))
    assert 0 < _layer_saves(spec("none")) - _layer_saves(spec("selective")) < B * S * H


def test_search_keeps_a_module_list():
    src = spec("[layernorm, moe_act]").replace("dp = 2", "dp = auto\n    global_batch = 4")
    ranked = parcompile.search(src, top=3)
    text = ranked.text()
    assert "recompute=[layernorm, moe_act]" in text
