"""The cost model against Korthikanti et al. 2022 (Table 2 formulas, exact per layer), the
published step times of Megatron-LM 2021 Table 1 and Korthikanti Table 5 (A100) and the
H100-era rows: torchtitan's Llama 3.1 8B FSDP, Megatron-Bridge's GPT-OSS 120B, the Llama 3
paper's 405B, torchtitan's 2025 Llama 3.1 70B and 8B FSDP + TP, NeMo AutoModel's GPT-OSS 20B
and Qwen3-30B-A3B (parcompile/analysis/calibration.py; `python benchmarks/cost_model.py`
prints them all): time within 8%, layouts planned as fitting, memory within 10% where
published."""

from fractions import Fraction
from functools import lru_cache

import pytest

from parcompile.analysis.calibration import (H100_ROWS, ROWS, h100_config, layer_activation_bytes, row_config,
                                             stage_activation_bytes)
from parcompile.analysis.compute import causal_share, compute_report, op_sac
from parcompile.analysis.estimate import chunk_times, closed_form_bubble, efficiency
from parcompile.analysis.memory import closed_form_in_flight, saved_bytes_per_chunk
from parcompile.driver import compile_config
from parcompile.passes.manager import cost_without_schedule
from tests.plan_factories import run_until, spec, tiny_model

S, B, H, A = 32, 2, 64, 4


def _saved(L, tp, sp=False, recompute="none", attention="unfused", dtype="fp16"):
    m = tiny_model(layers=L, hidden=H, heads=A, kv_heads=A, ffn_hidden=4 * H, seq_len=S, dtype=dtype, vocab=256,
                   norm="layernorm", activation="gelu", position="learned", bias=True, attention=attention,
                   dropout=0.1, tie_embeddings=True)
    cfg = spec(m, tp=tp, micro_batch=B, global_batch=B, sequence_parallel=sp, recompute=recompute)
    g, ctx = run_until(cfg, "insert-collectives")
    return saved_bytes_per_chunk(g, ctx.degrees, 1, recompute)[0]


def _per_layer(**kw):
    return _saved(3, **kw) - _saved(2, **kw)


# ------------------------------------------------------------------ Korthikanti Table 2, exact

@pytest.mark.parametrize("tp,sp,recompute,want", [
    (1, False, "none", S * B * H * 34 + 5 * A * S * S * B),                       # sbh(34 + 5as/h)
    (2, False, "none", S * B * H * (10 + 24 // 2) + 5 * A * S * S * B // 2),      # sbh(10 + 24/t + 5as/ht)
    (4, False, "none", S * B * H * 10 + S * B * H * 24 // 4 + 5 * A * S * S * B // 4),
    (2, True, "none", S * B * H * 34 // 2 + 5 * A * S * S * B // 2),              # sbh/t (34 + 5as/h)
    (4, True, "selective", S * B * H * 34 // 4),                                  # 34 sbh/t
    (2, False, "selective", S * B * H * (10 + 24 // 2)),                          # sbh(10 + 24/t)
    (1, False, "full", 2 * S * B * H),                                            # 2sbh
    (2, False, "full", 2 * S * B * H),
    (2, True, "full", 2 * S * B * H // 2),                                        # the split layer input
])
def test_layer_activations_equal_korthikanti_table_2(tp, sp, recompute, want):
    assert _per_layer(tp=tp, sp=sp, recompute=recompute) == want
    assert layer_activation_bytes(S, B, H, A, tp, sp, recompute) == want


def test_flash_attention_keeps_logsumexp_instead_of_s_squared():
    # the 5as^2b/t terms become the fused kernel's fp32 log-sum-exp per query and local
    # head; its output is the projection's input, counted once; dropout replays its RNG
    got = _per_layer(tp=2, sp=True, attention="flash")
    assert got == S * B * H * 34 // 2 + S * B * (A // 2) * 4


def test_fp32_layers_follow_the_same_accounting():
    # 4-byte activations: the 32 sbh of 2-byte tensors double, the two 1-byte residual
    # dropout masks stay; scores: softmax 4 + mask 1 + dropout output 4 bytes
    assert _per_layer(tp=1, dtype="fp32") == 66 * S * B * H + 9 * A * S * S * B


# ------------------------------------------------------------------ in flight and bubble

def test_closed_form_in_flight_matches_schedules():
    p, m = 4, 8
    assert closed_form_in_flight("1f1b", p, 1, m) == [min(p - s, m) for s in range(p)]
    assert closed_form_in_flight("gpipe", p, 1, m) == [m] * p
    v = 2
    got = closed_form_in_flight("interleaved_1f1b", p, v, m)
    assert got[0] == p * (1 + Fraction(p - 1, p * v))     # Korthikanti 4.2.3
    assert closed_form_bubble(p, v, m) == (p - 1) / (v * m)


def test_closed_form_and_simulated_pipeline_agree():
    row = next(r for r in ROWS if r.name == "1008B")
    m = tiny_model(layers=16, hidden=256, heads=8, kv_heads=8, ffn_hidden=1024, seq_len=128, vocab=512,
                   norm="layernorm", activation="gelu", position="learned", bias=True, dtype="fp16")
    cfg = spec(m, tp=2, pp=4, dp=1, micro_batch=1, global_batch=16, recompute=row.recompute)
    sim = compile_config(cfg).data["estimate"]["step_time"]
    closed = cost_without_schedule(cfg).time.step_time
    assert closed == pytest.approx(sim, rel=0.03)


# ------------------------------------------------------------------ published rows

CALIBRATION = [r for r in ROWS if not r.held_out]


@lru_cache(maxsize=None)
def _cost(row):
    return cost_without_schedule(row_config(row))


@lru_cache(maxsize=None)
def _a100_errors() -> dict[str, float]:
    # every A100 row, calibration and held out, costed by the search's probes, which give
    # the compiler's figures (test_search.py test_fast_cost_equals_the_compilers) in a tenth
    # of the time; one row checked here too
    from parcompile.layout_search import Coster

    def fast(r):
        cfg = row_config(r)
        return Coster(cfg).cost(cfg).step_time

    first = CALIBRATION[0]
    assert fast(first) == pytest.approx(_cost(first).time.step_time, rel=1e-9)
    return {r.name: fast(r) / r.step_time - 1 for r in ROWS}


def test_a100_calibration_rows_within_10_percent():
    errs = _a100_errors()
    for r in CALIBRATION:
        assert abs(errs[r.name]) <= 0.10, (r.name, errs[r.name])


def test_a100_step_times_mean_error_at_most_3_5_percent():
    # the mean of all 18 within 3.5% (issue 19: the H100-era model keeps the A100 fit)
    errs = _a100_errors()
    assert sum(map(abs, errs.values())) / len(errs) <= 0.035, errs


#: handed rows the estimate does not meet yet (issue 29), each with why; calibration empties it
_TIME_PENDING = {
}
_FIT_PENDING = {
    "Llama 3.1 405B": "78.0 GiB over 72 with the paper's v 8 layer-less split and rounds of N = pp = 16 "
                      "(Megatron-Core's default; the paper does not give N): stage 1 keeps 2 (pp - 2) + (v - 1) N "
                      "+ 1 = 141 one-layer chunk-forwards in flight at 0.497 GiB each (70.0 GiB) beside 8.0 GiB "
                      "of state and buffers; 128 would fit. The only other N Megatron-Core accepts at m = 32 "
                      "(32) keeps more; 1F1B's 15 x 8 would fit (67.6 GiB) with a bubble of 15/32. Meta's own "
                      "schedule keeps fewer than Megatron-Core's warm-up, by how much the paper does not say "
                      "(test_405b_row_rounds_cannot_make_it_fit)",
}


def test_405b_row_rounds_cannot_make_it_fit():
    # why the 405B row's pending fit is not a schedule question: of the round sizes Megatron-Core
    # runs at pp 16, m 32 (N in [pp, m], m % N 0 or >= pp: 16 and 32), the default keeps the fewest
    # micro-batches in flight; the worst stage's activations are its chunk-forwards in flight
    # (Megatron-Core's warm-up, 2 (pp - r - 1) + (v - 1) N, plus one) times the bytes one layer saves
    from parcompile.core.schedule import group_error
    row = next(r for r in H100_ROWS if r.name == "Llama 3.1 405B")
    par = h100_config(row).parallel
    pp, v, m = par.pp, par.virtual_stages, par.num_microbatches
    assert (pp, v, m, par.microbatch_group_size) == (16, 8, 32, 16)
    assert [n for n in range(1, m + 1) if group_error(pp, m, n) is None] == [16, 32]
    mem = _h100_cost(row).memory
    worst = max(mem.per_stage, key=lambda s: s.total)
    assert worst.stage == 1 and not mem.fits      # stage 0's first chunk holds no layer
    one = dict(worst.layer_activations)            # bytes one micro-batch saves in each layer of stage 1
    assert len(one) == 8 and len(set(one.values())) == 1
    chunk_forwards = 2 * (pp - 1 - 1) + (v - 1) * 16 + 1
    assert worst.activations == pytest.approx(chunk_forwards * next(iter(one.values())), rel=1e-6)
    # rounds of 32 hold more; what does not fit is the interleaved warm-up: the same stage with
    # 1F1B's pp - 1 = 15 micro-batches through its 8 layers in flight would
    assert closed_form_in_flight("interleaved_1f1b", pp, v, m, 32)[1] > closed_form_in_flight(
        "interleaved_1f1b", pp, v, m, 16)[1]
    rest = worst.total - worst.activations
    assert rest + closed_form_in_flight("1f1b", pp, 1, m)[1] * 8 * next(iter(one.values())) <= mem.capacity


def _pending(table):
    return [pytest.param(r, id=r.name, marks=pytest.mark.xfail(strict=True, reason=table[r.name]))
            if r.name in table else pytest.param(r, id=r.name) for r in H100_ROWS]


@lru_cache(maxsize=None)
def _h100_cost(row):
    return cost_without_schedule(h100_config(row))


@pytest.mark.parametrize("row", _pending(_TIME_PENDING))
def test_h100_rows_within_8_percent_of_published(row):
    # every handed H100 row (issue 19's three, issue 29's four): published step time, or
    # the step time its published rate gives, within 8%
    cfg = h100_config(row)
    t = _h100_cost(row).time
    flops = t.tflops_per_gpu * 1e12 * t.step_time * cfg.parallel.world_size
    want = row.published_step_time(flops)
    assert t.step_time == pytest.approx(want, rel=0.08), f"{row.name}: {t.step_time:.2f} s vs {want:.2f} s"


@pytest.mark.parametrize("row", _pending(_FIT_PENDING))
def test_h100_rows_plan_as_fitting(row):
    # each layout ran on its GPUs: the plan must say it fits (peak <= memory - reserve)
    mem = _h100_cost(row).memory
    assert mem.fits, f"{row.name}: {mem.peak / 2**30:.1f} GiB over {mem.capacity / 2**30:.1f} GiB"


def test_2025_rows_are_read_from_their_sources():
    # the configurations of issue 29's rows as their sources state them (not copied from
    # the estimate): torchtitan's asyncTP page and NeMo AutoModel's performance summary
    rows = {r.name: r for r in H100_ROWS}
    want = {
        "Llama 3.1 70B FSDP+TP": ("llama3-70b", 256, 8192, dict(dp=32, tp=8, micro_batch=16, global_batch=512,
                                                                recompute="full"), "compile"),
        "Llama 3.1 8B FSDP+TP": ("llama3-8b", 64, 8192, dict(dp=8, tp=8, micro_batch=12, global_batch=96,
                                                             recompute="selective"), "compile"),
        "GPT-OSS 20B FSDP+EP": ("gpt-oss-20b", 8, 4096, dict(dp=8, ep=8, micro_batch=2, global_batch=256,
                                                             recompute="full"), "automodel"),
        "Qwen3-30B-A3B FSDP+EP": ("qwen3-30b-a3b", 8, 4096, dict(dp=8, ep=8, micro_batch=4, global_batch=512,
                                                                 recompute="full"), "automodel"),
    }
    for name, (model, gpus, seq, par, eng) in want.items():
        row = rows[name]
        cfg = h100_config(row)
        assert row.model == model and cfg.model.seq_len == seq and cfg.parallel.world_size == gpus
        assert {k: getattr(cfg.parallel, k) for k in par} == par and cfg.cluster.engine == eng
        assert row.commit and row.assumed
    # published: 597.3 and 4,378 tokens/s per GPU; 10.04 and 21.773 s per step
    assert rows["Llama 3.1 70B FSDP+TP"].published_step_time(0) == pytest.approx(512 * 8192 / (597.3 * 256))
    assert rows["Llama 3.1 8B FSDP+TP"].published_step_time(0) == pytest.approx(96 * 8192 / (4378 * 64))
    assert rows["GPT-OSS 20B FSDP+EP"].published_step_time(0) == 10.04
    assert rows["Qwen3-30B-A3B FSDP+EP"].published_step_time(0) == 21.773
    # the torchtitan rows ran on Grand Teton's 96 GB, 2.4 TB/s, 500 W H100 (the page's hardware list)
    for name in ("Llama 3.1 70B FSDP+TP", "Llama 3.1 8B FSDP+TP"):
        cl = h100_config(rows[name]).cluster
        assert (cl.memory, cl.hbm_bw, cl.peak_flops) == (96 * 10**9, 2.4e12, 884e12)
        assert h100_config(rows[name]).parallel.sequence_parallel   # torchtitan's TP plan


@pytest.mark.parametrize("row", [r for r in H100_ROWS if r.peak_gib], ids=lambda r: r.name)
def test_published_peak_memory_within_10_percent_with_the_allocator_term(row):
    # torchtitan reports the largest max_reserved: the plan's reserved peak (allocated plus
    # the caching allocator's term, memory.reserved_peak) within 10%; the allocated peak,
    # what the plan checks against memory * (1 - memory_reserve), below it
    mem = _h100_cost(row).memory
    assert mem.reserved_peak / 2**30 == pytest.approx(row.peak_gib, rel=0.10)
    assert mem.peak / 2**30 < row.peak_gib


@pytest.mark.parametrize("row", CALIBRATION, ids=[r.name for r in CALIBRATION])
def test_stage_activations_within_2_percent_of_korthikanti(row):
    cfg = row_config(row)
    cost = _cost(row)
    par = cfg.parallel
    flight = closed_form_in_flight(par.schedule, par.pp, par.virtual_stages, par.num_microbatches)
    for s in {0, par.pp - 1}:
        got = cost.memory.per_stage[s].activations
        want = stage_activation_bytes(cfg, s, flight[s])
        layers_only = flight[s] * sum(n for k, n in enumerate(par.layers_per_chunk(cfg.model.layers))
                                      if k % par.pp == s) * layer_activation_bytes(
            cfg.model.seq_len, par.micro_batch, cfg.model.hidden, cfg.model.heads, par.tp,
            par.sequence_parallel, par.recompute)
        assert got == pytest.approx(float(want), rel=0.02), (row.name, s)
        assert got >= layers_only


def test_full_recompute_working_set_is_a_buffer():
    row = next(r for r in ROWS if r.name == "22B full recompute")
    st = _cost(row).memory.per_stage[0]
    assert st.buffer_parts["recompute"] > 0
    # the logits and the recomputation's working set are never alive at once: the larger counts (issue 16)
    parts = dict(st.buffer_parts)
    assert st.buffers == sum(parts.values()) - min(parts.pop("logits", 0), parts["recompute"])
    assert st.total == st.params + st.grads + st.optimizer + st.activations + st.kv_cache + st.buffers


# ------------------------------------------------------------------ report.md

def test_report_has_memory_time_and_collectives_tables():
    md = compile_config(spec(tiny_model(), dp=2, tp=2, pp=2, micro_batch=2, global_batch=16)).report_md()
    assert "| stage | params | grads | optimizer | activations | buffers | kv cache | total |" in md
    assert "| part | seconds | share |" in md and "| bubble |" in md
    assert "| stage | op | axis | bytes | count |" in md


def test_report_warns_in_plain_language():
    # does not fit; bubble above 20% (pp 4, m 2); tp across nodes (tp 4 over 2-GPU nodes)
    cfg = spec(tiny_model(), tp=4, pp=4, micro_batch=1, global_batch=2, nodes=8, gpus_per_node=2,
               cluster={"memory": 10**5})
    md = compile_config(cfg).report_md()
    assert "## Warnings" in md
    assert "does not fit" in md
    assert "bubble" in md and "idles" in md
    assert "crosses nodes" in md
    ok = compile_config(spec(tiny_model(), tp=2, global_batch=1)).report_md()
    assert "## Warnings" not in ok


def test_link_is_chosen_by_where_the_group_sits():
    from parcompile.analysis.estimate import axis_crosses_nodes
    from parcompile.core.groups import rank_groups
    cfg = spec(tiny_model(), tp=2, dp=2, nodes=2, gpus_per_node=2)
    g = rank_groups(cfg.parallel)
    assert not axis_crosses_nodes(cfg.cluster, g, "tp")
    assert axis_crosses_nodes(cfg.cluster, g, "dp_cp")


def test_simulated_interleaved_schedule_agrees_with_the_closed_form():
    row = next(r for r in ROWS if r.name == "145.6B")            # interleaved, v = 2
    cfg = row_config(row)
    d = compile_config(cfg).data
    closed = cost_without_schedule(cfg).time
    assert d["estimate"]["step_time"] == pytest.approx(closed.step_time, rel=0.01)
    assert d["schedule"]["bubble_fraction"] == pytest.approx(closed_form_bubble(8, 2, 48), rel=0.05)
    assert d["schedule"]["in_flight"][0] == pytest.approx(8 * (1 + 7 / 16))


# ------------------------------------------------------------------ engines and kernels (issue 19)

def _llama(**kw):
    return tiny_model(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn_hidden=512, seq_len=256, vocab=512,
                      dtype="bf16", **kw)


def _report(cfg, engine="megatron"):
    g, ctx = run_until(cfg, "insert-collectives")
    par = cfg.parallel
    return compute_report(g, ctx.degrees, par.pp, cfg.model.vocab, cfg.model.padded_vocab(par.tp), 1,
                          par.recompute, engine), g


def test_causal_fused_attention_runs_half_the_scores():
    comp, _ = _report(spec(_llama(), micro_batch=2, global_batch=2))
    S = 256
    assert causal_share({"seq_len": S}) == (S + 1) / (2 * S)
    assert causal_share({"seq_len": S, "window": 16}) == 1 - 15 / (2 * S)
    # 2 layers x 4 b s^2 heads head_dim (no causal halving), the work the kernel runs (S+1)/2S of it
    want = 2 * 4 * 2 * S * S * 4 * 64
    assert comp.chunk_attn_flops == (want,)
    assert comp.chunk_attn_work == (pytest.approx(want * (S + 1) / (2 * S)),)
    assert comp.chunk_attn_scores == (pytest.approx(want * (S + 1) / (2 * S) / 64),)
    # unfused attention is costed as its matmuls and the scores' traffic: no kernel
    unfused, _ = _report(spec(_llama(attention="unfused"), micro_batch=2, global_batch=2))
    assert unfused.chunk_attn_flops == (0,) and unfused.chunk_fwd_flops == comp.chunk_fwd_flops


def test_gemm_operands_scale_with_tokens_and_weights_do_not():
    one, _ = _report(spec(_llama(), micro_batch=1, global_batch=1))
    four, _ = _report(spec(_llama(), micro_batch=4, global_batch=4))
    assert four.chunk_gemm_traffic == tuple(4 * x for x in one.chunk_gemm_traffic)
    assert four.chunk_weight_traffic == one.chunk_weight_traffic
    # the weights read are the model's matmul weights, 16-bit: wq wk wv wo w1 w3 w2 per layer + the head
    m = _llama()
    per_layer = 256 * (256 + 2 * 128 + 256) + 3 * 256 * 512
    assert one.chunk_weight_traffic == (2 * (2 * per_layer + 256 * 512),)


def test_small_gemms_and_few_tokens_per_expert_run_below_the_gemm_rate():
    # seconds per FLOP of the matmuls falls with the micro-batch (operands amortise the
    # weights and the experts' GEMMs their weights, read once per micro-batch)
    moe = _llama(experts=8, top_k=2, expert_ffn_hidden=256)
    rates = []
    for mb in (1, 8):
        cfg = spec(moe, micro_batch=mb, global_batch=mb)
        comp, _ = _report(cfg)
        ct = chunk_times(cfg, {"tp": 1}, None, comp, type("C", (), {"raw": ()})(),
                         links={a: (0.0, 1.0) for a in ("tp", "cp", "ep", "dp", "dp_cp", "pp")})
        rates.append(comp.chunk_fwd_flops[0] / ct.matmul_f[0])
    eff = efficiency(cfg.cluster)
    assert rates[0] < rates[1] < eff.matmul * cfg.cluster.peak_flops


def test_eager_engine_is_slower_and_says_so_in_plan_json():
    text = """
model m { layers = 2, hidden = 256, heads = 4, kv_heads = 2, ffn_hidden = 512, vocab = 512, seq_len = 256 }
cluster c from "h100-sxm" { nodes = 1, gpus_per_node = 2 %s }
parallel { dp = 2, zero = 3, recompute = selective, micro_batch = 2, global_batch = 4 }
"""
    from parcompile import compile as compile_spec
    meg = compile_spec(text % "").data["estimate"]
    eag = compile_spec(text % ", engine = eager").data["estimate"]
    assert meg["assumptions"]["engine"] == "megatron" and eag["assumptions"]["engine"] == "eager"
    assert eag["assumptions"]["elementwise_traffic"] > meg["assumptions"]["elementwise_traffic"] == 1.0
    assert eag["assumptions"]["attention_efficiency"] < meg["assumptions"]["attention_efficiency"]
    assert eag["step_time"] > meg["step_time"]
    # torchtitan with torch.compile: the eager engine with its elementwise ops fused;
    # NeMo AutoModel: TE's fused attention, eager SwiGLU and loss (estimate.py ENGINES)
    com = compile_spec(text % ", engine = compile").data["estimate"]
    auto = compile_spec(text % ", engine = automodel").data["estimate"]
    assert com["assumptions"]["engine"] == "compile" and auto["assumptions"]["engine"] == "automodel"
    assert com["assumptions"]["elementwise_traffic"] == 1.0
    assert com["assumptions"]["attention_efficiency"] == eag["assumptions"]["attention_efficiency"]
    assert auto["assumptions"]["attention_efficiency"] == meg["assumptions"]["attention_efficiency"]
    assert com["step_time"] < eag["step_time"]
    from parcompile.plan_schema import validate_plan
    validate_plan(compile_spec(text % ", engine = automodel").data)
    from parcompile.diagnostics import SpecError
    from parcompile.frontend import load_spec
    with pytest.raises(SpecError) as e:
        load_spec(text % ", engine = deepspeed")
    assert "engine" in str(e.value) and "megatron" in str(e.value)


def test_eager_selective_is_torchtitans_op_level_policy():
    # every other linear of a layer (forward order) is recomputed, with every elementwise op;
    # a layer keeps its input, the other linears' outputs and the attention kernel's output
    cfg = spec(_llama(), micro_batch=2, global_batch=2, recompute="selective")
    _, g = _report(cfg, "eager")
    sac = op_sac(g, "selective", "eager")
    assert op_sac(g, "selective", "megatron") is None and op_sac(g, "full", "eager") is None
    assert sac == {f"layers.{i}.{n}" for i in range(2) for n in ("attn.wk", "attn.wo", "mlp.w3")}
    eager, _ = _report(cfg, "eager")
    meg, _ = _report(cfg, "megatron")
    assert eager.chunk_recompute_flops[0] > meg.chunk_recompute_flops[0]
    from parcompile.analysis.memory import saved_bytes
    g2, ctx = run_until(cfg, "insert-collectives")
    kept = saved_bytes(g2, ctx.degrees, 1, "selective", engine="eager").kept_per_layer[0]
    T, e = 2 * 256, 2
    # input h + wq h + wv kv + attention out h + its fp32 log-sum-exp + w1 ffn + w2 h
    assert kept == T * e * (256 + 256 + 128 + 256 + 512 + 256) + T * 4 * 4


def test_deepep_sends_a_token_once_per_rank_holding_its_experts():
    # DeepEP (engine automodel) moves a token to each rank holding some of its top_k
    # experts, once; balanced routing puts them adjacent (AutoModel's FakeBalancedGate:
    # token t to experts t k .. t k + k - 1): ceil(k / (E / ep)) ranks of the k rows
    from parcompile.analysis.estimate import routed_share
    rows = {r.name: h100_config(r) for r in H100_ROWS}
    qwen, oss = rows["Qwen3-30B-A3B FSDP+EP"], rows["GPT-OSS 20B FSDP+EP"]
    assert routed_share(qwen, {"ep": 8}) == 1 / 8          # 128 experts, 16 per rank, top-8: one rank
    assert routed_share(oss, {"ep": 8}) == 1 / 4           # 32 experts, 4 per rank, top-4: one rank
    assert routed_share(rows["GPT-OSS 120B"], {"ep": 8}) == 1.0   # Megatron's all-to-all: a row per expert
    assert routed_share(oss, {"ep": 1}) == 1.0
    m = tiny_model(experts=16, top_k=4, expert_ffn_hidden=64)
    cfg = spec(m, dp=8, ep=8, cluster={"engine": "automodel"})
    assert routed_share(cfg, {"ep": 8}) == 2 / 4           # 2 experts per rank: two ranks
    # the estimate's expert all-to-all time follows: a quarter of Megatron's bytes for GPT-OSS
    # 20B, the messages' latency unchanged
    # (Megatron's experts without their host wait, Engine.expert_host: the all-to-alls alone)
    import dataclasses
    from parcompile.analysis import efficiency as eff_mod
    saved = eff_mod.ENGINES["megatron"]
    eff_mod.ENGINES["megatron"] = dataclasses.replace(saved, expert_host=0.0)
    try:
        meg = cost_without_schedule(oss.model_copy(update={"cluster": oss.cluster.model_copy(
            update={"engine": "megatron"})})).time.breakdown["ep_comm"]
    finally:
        eff_mod.ENGINES["megatron"] = saved
    deepep = _h100_cost(next(r for r in H100_ROWS if r.name == "GPT-OSS 20B FSDP+EP")).time.breakdown["ep_comm"]
    assert meg / 4 < deepep < meg / 3


def test_fsdp2_engines_keep_their_shards_in_the_models_dtype_and_no_master_copy():
    # FSDP2 keeps ZeRO-3's shards in the model's dtype, the optimizer stepping them in
    # place: torchtitan's fp32 model 4 + 4 + 8 bytes per parameter over d, against
    # Megatron's 2 + 4 + 12
    from parcompile.analysis.memory import state_bytes
    from parcompile.core.data_parallel import DataParallelSharding
    from parcompile.layout_search import Coster
    n, d = 8000, 8
    assert state_bytes(n, 2, DataParallelSharding(stage=3, shard=d), "adamw", fsdp2=4) == (4 * n // d, 4 * n // d, 8 * n // d)
    assert state_bytes(n, 2, DataParallelSharding(stage=3, shard=d), "adamw") == (2 * n // d, 4 * n // d, 12 * n // d)
    assert state_bytes(n, 2, DataParallelSharding(stage=2, shard=d), "adamw", fsdp2=4) == state_bytes(n, 2, DataParallelSharding(stage=2, shard=d), "adamw")   # ZeRO-3 only
    # NeMo AutoModel casts its MoE models to bf16 and steps them with torch Adam: 2 + 2 + 4
    assert state_bytes(n, 2, DataParallelSharding(stage=3, shard=d), "adam", fsdp2=2) == (2 * n // d, 2 * n // d, 4 * n // d)
    row = next(r for r in H100_ROWS if r.name == "Qwen3-30B-A3B FSDP+EP")
    cfg = h100_config(row)
    st = _h100_cost(row).memory.per_stage[0]

    def under(engine):
        return cost_without_schedule(cfg.model_copy(update={"cluster": cfg.cluster.model_copy(
            update={"engine": engine})})).memory.per_stage[0]
    meg, tt = under("megatron"), under("compile")
    assert tt.params == 2 * meg.params and tt.grads == meg.grads and 3 * tt.optimizer == 2 * meg.optimizer
    assert st.params == meg.params and 2 * st.grads == meg.grads and 3 * st.optimizer == meg.optimizer
    # the search's fast costing applies the same rule
    fast = Coster(cfg).cost(cfg, with_memory=True)
    assert fast.peak == _h100_cost(row).memory.peak
    assert fast.step_time == pytest.approx(_h100_cost(row).time.step_time, rel=1e-9)


def test_fitted_numbers_name_their_rows():
    # issue 29: calibrate only on the handed rows, as few numbers as possible, each named
    # with the rows it was fitted to (benchmarks/cost_model.py prints them)
    from parcompile.analysis.calibration import FITTED, FP8_ROWS
    names = {r.name for r in ROWS} | {r.name for r in H100_ROWS} | {r.name for r in FP8_ROWS}
    held_out = {r.name for r in ROWS if r.held_out}
    for f in FITTED:
        assert f.rows and set(f.rows) <= names - held_out, f
        assert f.value() > 0
    assert len({(f.table, f.key, f.field) for f in FITTED}) == len(FITTED)


# ------------------------------------------------------------------ FP8 training (issue 32)

from parcompile.analysis.calibration import FP8_ROWS  # noqa: E402

#: handed FP8 rows the estimate does not meet yet, each with why
_FP8_PENDING: dict[str, str] = {}


@lru_cache(maxsize=None)
def _fp8_cost(row):
    return cost_without_schedule(h100_config(row))


def _fp8_rate(row) -> float:
    t = _fp8_cost(row).time
    return t.tokens_per_s / h100_config(row).parallel.world_size


@pytest.mark.parametrize("row", [pytest.param(r, id=r.name, marks=pytest.mark.xfail(strict=True, reason=_FP8_PENDING[r.name]))
                                 if r.name in _FP8_PENDING else pytest.param(r, id=r.name) for r in FP8_ROWS])
def test_fp8_rows_within_10_percent_of_published(row):
    # issue 32's handed FP8 rows: tokens per second per GPU within 10% of the published
    assert _fp8_rate(row) == pytest.approx(row.tokens_per_s_per_gpu, rel=0.10), row.name


def test_fp8_rows_are_read_from_their_sources():
    # the published figures and layouts as the sources print them (torchtitan asyncTP page at
    # 2887250; Megatron-Bridge docs/performance-summary-archive.md at 4ab94df, 26.04.01)
    rows = {r.name: r for r in FP8_ROWS}
    want = {"Llama 3.1 70B FSDP+TP fp8 tensorwise": (809.8, "tensorwise", 256, dict(dp=32, tp=8)),
            "Llama 3.1 70B FSDP+TP fp8 rowwise": (599.6, "rowwise", 256, dict(dp=32, tp=8)),
            "Llama 3.1 8B FSDP+TP fp8 tensorwise": (5078.1, "tensorwise", 64, dict(dp=8, tp=8)),
            "Llama 3.1 8B FSDP+TP fp8 rowwise": (3708.5, "rowwise", 64, dict(dp=8, tp=8)),
            "Llama 3 70B TP4 PP8 VP5 fp8": (1664, "tensorwise", 64, dict(tp=4, pp=8, virtual_stages=5,
                                                                           micro_batch=1, global_batch=256))}
    assert set(rows) == set(want)
    for name, (rate, recipe, gpus, par) in want.items():
        cfg = h100_config(rows[name])
        assert rows[name].tokens_per_s_per_gpu == rate and cfg.train.precision == "fp8"
        assert cfg.train.fp8_recipe == recipe and cfg.parallel.world_size == gpus and cfg.model.seq_len == 8192
        assert {k: getattr(cfg.parallel, k) for k in par} == par
        # torchtitan 820504e's tomls: enable_fsdp_float8_all_gather = false; Megatron-Bridge's recipe sets
        # fp8_param_gather = True at zero 1, which fp8_all_gather (ZeRO-3 only) does not express (row's assumed)
        assert not cfg.train.fp8_all_gather
        assert rows[name].commit and rows[name].assumed
        if rows[name].bf16_row:   # the same layout as its bf16 row
            b = h100_config(next(r for r in H100_ROWS if r.name == rows[name].bf16_row))
            assert b.parallel == cfg.parallel and b.cluster == cfg.cluster and b.model == cfg.model


@pytest.mark.parametrize("row", [r for r in FP8_ROWS if r.bf16_row], ids=lambda r: r.name)
def test_fp8_plans_faster_than_bf16_where_the_rows_say_so(row):
    # the published FP8 / bf16 ratio on the same layout: 1.36 and 1.16 (tensorwise, faster),
    # 1.004 (70B rowwise: even) and 0.85 (8B rowwise: slower); the plan's ratio on the same side
    # where the published one is more than 2% from even, within 10% of even where it is not
    bf16 = next(r for r in H100_ROWS if r.name == row.bf16_row)
    want = row.tokens_per_s_per_gpu / bf16.tokens_per_s_per_gpu
    t, tb = _fp8_cost(row).time, _h100_cost(bf16).time
    got = t.tokens_per_s / tb.tokens_per_s
    if abs(want - 1) > 0.02:
        assert (got > 1) == (want > 1), (row.name, got, want)
    else:
        assert got == pytest.approx(1, abs=0.10), (row.name, got)


def test_fp8_plans_only_the_layer_linears_at_the_fp8_rate():
    # the layer GEMMs run at the FP8 rate, the LM head, embedding, router and attention core
    # do not: the FP8 FLOPs are the layers' linear FLOPs, and a faster FP8 peak shortens the
    # matmul time by what those take
    from parcompile.ir.fp8 import is_fp8_gemm
    row = next(r for r in FP8_ROWS if r.name == "Llama 3.1 8B FSDP+TP fp8 tensorwise")
    cfg = h100_config(row)
    g, ctx = run_until(cfg, "insert-collectives")
    rep = compute_report(g, ctx.degrees, 1, cfg.model.vocab, cfg.model.padded_vocab(cfg.parallel.tp), 1, "none",
                         fp8=True)
    from parcompile.analysis.compute import op_fwd_flops
    linears = sum(op_fwd_flops(g, nd, ctx.degrees) for nd in g.nodes()
                  if nd.kind == "linear" and nd.op.layer is not None)
    head = sum(op_fwd_flops(g, nd, ctx.degrees) for nd in g.nodes() if nd.name.startswith("lm_head"))
    assert rep.chunk_fp8_flops[0] == linears > 0 and head > 0
    assert not any(is_fp8_gemm(nd, g) for nd in g.nodes() if nd.op.layer is None or nd.kind in ("router", "attention"))
    # q, k and v read one gathered input, cast once on its sequence shard
    assert rep.chunk_fp8_in_tp[0] < rep.chunk_fp8_in[0] < rep.chunk_fp8_operands[0]


def test_fp8_all_gather_halves_the_zero3_parameter_gathers():
    # fp8_all_gather: a bucket's FP8 weights travel at 1 byte, the rest at 2, in two
    # all-gathers whose per-rank sizes are one bound for every rank (a shard's boundaries cut
    # across FP8 and 16-bit parameters), so each bucket moves at least its bytes (FP8 at 1,
    # the rest and the padding at 2) and at most that plus its 16-bit part (r = shard d - fp8
    # elements) padded: at 2 bytes on the d - 1 other ranks, at 1 in the FP8 gather (its
    # d min(shard, fp8) - fp8 <= r); the embedding and the output layer (no FP8 GEMM) as without
    from parcompile.analysis.buckets import stage_buckets
    row = next(r for r in FP8_ROWS if r.name == "Llama 3.1 8B FSDP+TP fp8 tensorwise")
    cfg = h100_config(row)
    on = cfg.model_copy(update={"train": cfg.train.model_copy(update={"fp8_all_gather": True})})
    plans = [compile_config(c) for c in (cfg, on)]
    gathers = [sum(e.bytes * e.count for e in p.passes.schedule.comm.collectives if e.where == "params")
               for p in plans]
    sp = plans[0].passes.collectives.stage_params[0]
    share = sp.fp8 / sp.total
    assert 0.8 < share < 1
    assert gathers[1] < gathers[0] * (1 - share / 2) * 1.001   # the layers gathered 2m times, the rest m
    d = plans[1].degrees["dp_cp"]
    by_key = {}
    for nd in plans[1].graph.nodes():
        if nd.kind == "step_collective" and nd.op.attr("where") == "params" and ".stage0." in nd.name:
            key = nd.name.split(".")[-1]
            by_key[key] = by_key.get(key, 0) + nd.op.attr("bytes")
    dense, _ = stage_buckets(sp, on.parallel.bucket_size)
    assert any(b.fp8 for b in dense) and any(not b.fp8 for b in dense)
    for i, b in enumerate(dense):
        shard = -(-b.elements // d)
        least = b.fp8 + 2 * (shard * d - b.fp8)
        assert least <= by_key[f"bucket{i}"] <= least + (2 * (d - 1) + 1) * (shard * d - b.fp8), i
        if not b.fp8:
            assert by_key[f"bucket{i}"] == 2 * shard * d
    assert any(e.where == "fp8_amax" for e in plans[1].passes.schedule.comm.collectives)
    # the program keeps the 16-bit buffer (its parameters' storage) and beside it the E4M3
    # copies its GEMMs read: more than without, by at most half (1 byte per element of 2)
    off, on = (p.memory.per_stage[0].buffer_parts["zero3_gather"] for p in plans)
    assert off < on <= off * 1.5


def test_fp8_fast_cost_equals_the_compilers():
    # the search costs FP8 layouts with the same rules (compute, casts, collectives, memory)
    from parcompile.layout_search import Coster
    for name in ("Llama 3.1 8B FSDP+TP fp8 tensorwise", "Llama 3 70B TP4 PP8 VP5 fp8"):
        row = next(r for r in FP8_ROWS if r.name == name)
        cfg = h100_config(row)
        fast = Coster(cfg).cost(cfg, with_memory=True)
        assert fast.peak == _fp8_cost(row).memory.peak, name
        assert fast.step_time == pytest.approx(_fp8_cost(row).time.step_time, rel=1e-9), name


def test_fp8_all_gather_fast_cost_equals_the_compilers():
    # zero 3 with fp8_all_gather: the search's probe units carry each layer's FP8 weights, so
    # its per-bucket E4M3 and 16-bit gathers are the compiler's (core/buckets.fp8_gather_elements)
    from parcompile.layout_search import Coster
    row = next(r for r in FP8_ROWS if r.name == "Llama 3.1 8B FSDP+TP fp8 tensorwise")
    cfg = h100_config(row)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"fp8_all_gather": True})})
    plan = compile_config(cfg)
    fast = Coster(cfg).cost(cfg, with_memory=True)
    assert fast.peak == plan.memory.peak
    # the step time too: the probe's weight casts run on the 1/(dp cp) shards before the
    # gathers, as the compiler's (analysis/fp8.py fp8_costs; 0.27% slower before)
    assert fast.step_time == pytest.approx(plan.estimate.step_time, rel=1e-9)


def test_fp8_bf16_first_layer_fast_cost_equals_the_compilers():
    # fp8_bf16_layers_start = 1: the search probes the 16-bit first layer apart (search/probe.py
    # leading_layers, Graph.fp8 of the probes from ir/fp8.graph_fp8), so its fast cost is
    # the compiler's, and differs from the all-FP8 one (the probe once took every layer as FP8)
    from parcompile.layout_search import Coster
    row = next(r for r in FP8_ROWS if r.name == "Llama 3.1 8B FSDP+TP fp8 tensorwise")
    base = h100_config(row)
    cfg = base.model_copy(update={"train": base.train.model_copy(update={"fp8_bf16_layers_start": 1})})
    plan = compile_config(cfg)
    fast = Coster(cfg).cost(cfg, with_memory=True)
    assert fast.peak == plan.memory.peak
    assert fast.step_time == pytest.approx(plan.estimate.step_time, rel=1e-9)
    all_fp8 = Coster(base).cost(base, with_memory=True)
    assert fast.step_time > all_fp8.step_time * (1 + 1e-6)


def test_search_refuses_fp8_bf16_last_layers():
    # the probes compose one kind of leading layer: 16-bit last layers get a diagnostic, not a
    # cost that takes them as FP8
    from parcompile.layout_search import Coster
    row = next(r for r in FP8_ROWS if r.name == "Llama 3.1 8B FSDP+TP fp8 tensorwise")
    base = h100_config(row)
    cfg = base.model_copy(update={"train": base.train.model_copy(update={"fp8_bf16_layers_end": 1})})
    from parcompile.diagnostics import SpecError
    with pytest.raises(SpecError, match="fp8_bf16_layers_end"):
        Coster(cfg)


MB_FP8 = "Llama 3 70B TP4 PP8 VP5 fp8"


@pytest.mark.parametrize("row", FP8_ROWS, ids=lambda r: r.name)
def test_fp8_rows_plan_as_fitting(row):
    # each layout ran on its GPUs: the plan must say it fits (the Megatron-Bridge row fits once
    # its bf16 gradient buffer is counted: 73.7 GiB with fp32 buffers, test below)
    mem = _fp8_cost(row).memory
    assert mem.fits, f"{row.name}: {mem.peak / 2**30:.1f} GiB over {mem.capacity / 2**30:.1f} GiB"


def test_megatron_grad_buffer_is_in_the_reduce_dtype_at_zero_1():
    # Megatron-Bridge 4ab94df perf_recipes/_common.py: _benchmark_common and _perf_precision set
    # grad_reduce_in_fp32 = False; Megatron-LM d98e8a6 param_and_grad_buffer.py group_params_for_buffers:
    # grad_dtype = torch.float if grad_reduce_in_fp32 else param.dtype, at every ZeRO level. The
    # row's zero-1 gradient buffer is 2 bytes per element under engine megatron, 4 in the
    # generated program (cpu preset) and with reduce_dtype fp32
    from parcompile.analysis.estimate import grad_element_bytes
    row = next(r for r in FP8_ROWS if r.name == MB_FP8)
    cfg = h100_config(row)
    assert cfg.parallel.reduce_dtype == "bf16" and cfg.parallel.zero == 1
    assert grad_element_bytes(cfg) == 2
    fp32 = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"reduce_dtype": "fp32"})})
    cpu = _with_cluster(cfg, preset="cpu")
    assert grad_element_bytes(fp32) == 4 and grad_element_bytes(cpu) == 4
    # stage 0 holds the embedding and 10 layers (2 per chunk), tp 4 shards, the norms whole
    # (sequence parallelism); every bucket even, so zero 1's padding to dp 2 adds nothing
    m, tp = cfg.model, cfg.parallel.tp
    kv = m.kv_heads * m.hidden // m.heads
    layer = (2 * m.hidden * m.hidden + 2 * m.hidden * kv + 3 * m.hidden * m.ffn_hidden) // tp + 2 * m.hidden
    full = 10 * layer + m.padded_vocab(tp) * m.hidden // tp
    bf16, f32 = _fp8_cost(row).memory.per_stage[0], cost_without_schedule(fp32).memory.per_stage[0]
    assert bf16.grads == 2 * full and f32.grads == 4 * full
    assert f32.total - bf16.total == 2 * full and bf16.params == f32.params and bf16.optimizer == f32.optimizer
    assert cost_without_schedule(fp32).memory.peak / 2 ** 30 > 72 > _fp8_cost(row).memory.peak / 2 ** 30
    # the gradient reduce-scatters move bf16 too (the step's collectives, one rule)
    rs, rs32 = ([c.bytes for c in cost.comm.collectives if c.where == "grads" and c.stage == 0]
                for cost in (_fp8_cost(row), cost_without_schedule(fp32)))
    assert 2 * (layer // 2) in rs and rs32 == [2 * b for b in rs]   # a layer's bucket: its dp shard in bf16
    # the search's fast costing and its state floor apply the same rule
    from parcompile.layout_search import Coster
    fast, fast32 = Coster(cfg), Coster(fp32)
    assert fast.cost(cfg, with_memory=True).peak == _fp8_cost(row).memory.peak
    assert fast.cost(cfg, with_memory=True).step_time == pytest.approx(_fp8_cost(row).time.step_time, rel=1e-9)
    assert fast.state_floor(cfg.parallel) < fast32.state_floor(fp32.parallel) <= f32.total


def test_megatron_zero_bubble_full_grads_are_in_the_reduce_dtype():
    # the zero-bubble schedule reduces once per step, so zero 2 keeps full gradient buffers
    # (full_grads); under engine megatron they are its grad buffer, bf16 with reduce_dtype bf16
    # (Megatron-LM d98e8a6 param_and_grad_buffer.py group_params_for_buffers), as the step's
    # reduce-scatters count them: half the fp32 buffers' bytes, the same padded elements
    cfg = h100_config(next(r for r in FP8_ROWS if r.name == MB_FP8))
    par = cfg.parallel.model_copy(update={"zero": 2, "schedule": "zero_bubble", "virtual_stages": 1,
                                          "stage_layers": None})
    bf16 = cfg.model_copy(update={"parallel": par})
    fp32 = cfg.model_copy(update={"parallel": par.model_copy(update={"reduce_dtype": "fp32"})})
    full = [cost_without_schedule(c).memory.per_stage[0].buffer_parts["full_grads"] for c in (bf16, fp32)]
    rs = [sum(x.bytes for x in cost_without_schedule(c).comm.collectives if x.where == "grads" and x.stage == 0)
          for c in (bf16, fp32)]
    assert 2 * full[0] == full[1] and 2 * rs[0] == rs[1]


def test_megatron_bridge_fp8_row_is_its_recipes():
    # Megatron-Bridge 4ab94df, perf_recipes/llama/h100/llama3.py llama3_70b_pretrain_64gpu_h100_fp8cs_config:
    # pipeline_model_parallel_layout "Et*2|(t*2|)*34,t*3|(t*2|)*3,tL" (40 chunks: E + 2, 34 x 2, 3, 3 x 2, 1 + L),
    # tp_comm_overlap with userbuffers, overlap_p2p_comm (CommOverlapConfig with virtual stages)
    cfg = h100_config(next(r for r in FP8_ROWS if r.name == MB_FP8))
    layout = "Et*2|" + "t*2|" * 34 + "t*3|" + "t*2|" * 3 + "tL"
    want = tuple(int(c.split("*")[1]) if "*" in c else c.count("t") for c in layout.split("|"))
    assert cfg.parallel.layers_per_chunk(80) == want and len(want) == 8 * 5 and sum(want) == 80
    assert cfg.cluster.tp_comm_overlap and cfg.cluster.overlap_p2p_comm and cfg.parallel.sequence_parallel


def _with_cluster(cfg, **kw):
    return cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update=kw)})


def test_tp_exposed_is_the_split_gemm_rule():
    from parcompile.analysis.estimate import tp_exposed
    assert tp_exposed(1.0, 0.0, 4) == 1.0                   # nothing to hide under
    assert tp_exposed(1.0, 4 / 3, 4) == pytest.approx(0.0)   # 3 of 4 chunks hide 1 s
    assert tp_exposed(1.0, 1.0, 4) == pytest.approx(0.25)
    assert tp_exposed(1.0, 100.0, 1) == 1.0                 # one rank: no chunks to pipeline
    assert tp_exposed(1.0, 1.0, 2) == pytest.approx(0.5)


def test_tp_collectives_pair_with_their_gemms():
    # an attention block's all-gather feeds q, k and v, its reduce-scatter drains the output
    # projection; the MLP's feed gate and up, drain down: FLOPs from the model's dimensions
    cfg = h100_config(next(r for r in FP8_ROWS if r.name == MB_FP8))
    c = cost_without_schedule(cfg)
    m, t, tokens = cfg.model, 4, 8192
    d = m.hidden // m.heads
    qkv = 2 * tokens * m.hidden * (m.hidden + 2 * m.kv_heads * d) // t
    out = 2 * tokens * m.hidden * m.hidden // t
    up, down = 2 * tokens * m.hidden * 2 * m.ffn_hidden // t, 2 * tokens * m.ffn_hidden * m.hidden // t
    seen = {(col.where.split(".")[-1], col.op, col.phase): col.gemm_flops for _s, k, col in c.comm.raw
            if k == 1 and col.axis == "tp" and col.where.startswith("layers.")}
    assert seen[("attn", "all_gather", "forward")] == (qkv, 0)
    assert seen[("attn", "reduce_scatter", "forward")] == (out, 0)
    assert seen[("mlp", "all_gather", "forward")] == (up, 0)
    assert seen[("mlp", "reduce_scatter", "forward")] == (down, 0)


def test_tp_comm_overlap_hides_tp_collectives_only_with_sequence_parallelism():
    cfg = h100_config(next(r for r in FP8_ROWS if r.name == MB_FP8))
    off = cost_without_schedule(_with_cluster(cfg, tp_comm_overlap=False)).time.breakdown
    on = _fp8_cost(next(r for r in FP8_ROWS if r.name == MB_FP8)).time.breakdown
    assert on["tp_comm"] < 0.25 * off["tp_comm"] and on["compute"] == off["compute"]
    nosp = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"sequence_parallel": False})})
    a = cost_without_schedule(nosp).time.breakdown["tp_comm"]
    b = cost_without_schedule(_with_cluster(nosp, tp_comm_overlap=False)).time.breakdown["tp_comm"]
    assert a == b   # Megatron-LM asserts sequence parallelism with --tp-comm-overlap: nothing overlaps


def test_overlap_p2p_comm_blocks_only_in_warmup_and_flush():
    # interleaved 1F1B: rank r waits for the transfers of its 2 (pp - r - 1) + (v - 1) pp warmup
    # forwards and as many flush backwards, of m v each; without virtual stages it is off
    from parcompile.analysis.estimate import p2p_blocking_share
    cfg = h100_config(next(r for r in FP8_ROWS if r.name == MB_FP8))
    pp, v, m = 8, 5, 128
    assert p2p_blocking_share(cfg, pp, v, m) == [(2 * (pp - r - 1) + (v - 1) * pp) / (m * v) for r in range(pp)]
    assert p2p_blocking_share(_with_cluster(cfg, overlap_p2p_comm=False), pp, v, m) is None
    assert p2p_blocking_share(cfg, pp, 1, m) is None
    off = cost_without_schedule(_with_cluster(cfg, overlap_p2p_comm=False)).time.breakdown["pp_comm"]
    on = _fp8_cost(next(r for r in FP8_ROWS if r.name == MB_FP8)).time.breakdown["pp_comm"]
    assert 0 < on < 0.15 * off


def test_transformer_engine_keeps_fp8_linear_inputs():
    # per layer, TE keeps the FP8 casts of q/k/v's, gate/up's and down's inputs (1 byte) where the
    # 16-bit plan keeps the norms' outputs and the activation's output (2 bytes), and the output
    # projection's input in FP8 beside the attention kernel's 16-bit output: sbh/t + s ffn/t less
    from parcompile.analysis.memory import saved_bytes
    cfg = h100_config(next(r for r in FP8_ROWS if r.name == MB_FP8))
    g, ctx = run_until(cfg, "insert-collectives")
    n = 40
    te = saved_bytes(g, ctx.degrees, n, "none", engine="megatron", kernels="megatron", fp8=True).per_layer[0]
    plain = saved_bytes(g, ctx.degrees, n, "none", engine="megatron", kernels="megatron", fp8=False).per_layer[0]
    prog = saved_bytes(g, ctx.degrees, n, "none", engine="megatron", kernels="program", fp8=True).per_layer[0]
    m, t, s = cfg.model, 4, 8192
    assert plain - te == s * m.hidden // t + s * m.ffn_hidden // t
    assert prog == plain   # the generated program (torchao-style FP8) keeps its 16-bit inputs


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("ep", [1, 4])
def test_expert_host_is_paid_per_local_expert_in_each_moe_layer_forward(monkeypatch, recompute, ep):
    # after Megatron-Core's dispatcher syncs with the host, the host issues the experts' work expert
    # by expert (Engine.expert_host per local expert per MoE layer forward), in the ep time of the
    # forward; a fully recomputed layer pays it again in the backward. 2 MoE layers of 8 experts,
    # 8 / ep on a rank; no collectives: the ep time is the wait alone
    import dataclasses
    from parcompile.analysis import efficiency as eff_mod
    wait = 1e-3
    monkeypatch.setitem(eff_mod.ENGINES, "megatron", dataclasses.replace(eff_mod.ENGINES["megatron"],
                                                                         expert_host=wait))
    cfg = spec(_llama(experts=8, top_k=2, expert_ffn_hidden=256), micro_batch=2, global_batch=2 * ep, dp=ep, ep=ep,
               recompute=recompute)
    comp, _ = _report(cfg)
    assert comp.chunk_moe_experts == (2 * 8 // ep,)
    ct = chunk_times(cfg, {"tp": 1, "ep": ep}, None, comp, type("C", (), {"raw": ()})(),
                     links={a: (0.0, 1.0) for a in ("tp", "cp", "ep", "dp", "dp_cp", "pp")})
    assert ct.comm_f["ep"] == (pytest.approx(2 * 8 / ep * wait),)
    assert ct.comm_b["ep"] == (pytest.approx(2 * 8 / ep * wait if recompute == "full" else 0.0),)
    # a dense model has no experts and waits nothing
    dense, _ = _report(spec(_llama(), micro_batch=2, global_batch=2))
    assert dense.chunk_moe_experts == (0,)


def test_dispatch_and_combine_move_the_routed_rows_through_two_permutations():
    # Megatron-Core's all-to-all dispatcher: permute (N token rows -> N k rows sorted by expert)
    # and, with several local experts, sort_chunks_by_idxs (N k rows again); the combine undoes
    # both. DeepEP's (engine automodel) one each way. Rows of h = 256 bf16, N = 2 x 256 tokens, k = 2
    from parcompile.analysis.compute import op_fwd_traffic
    N, k, h, b = 2 * 256, 2, 256, 2
    for ep, local in ((1, 8), (8, 1)):
        cfg = spec(_llama(experts=8, top_k=k, expert_ffn_hidden=256), micro_batch=2, global_batch=16, dp=8, ep=ep)
        g, ctx = run_until(cfg, "insert-collectives")
        disp = next(nd for nd in g.nodes() if nd.kind == "moe_dispatch")
        comb = next(nd for nd in g.nodes() if nd.kind == "moe_combine")
        again = 2 * N * k * h * b if local > 1 else 0
        assert op_fwd_traffic(g, disp, ctx.degrees) == N * h * b + N * k * h * b + again
        assert op_fwd_traffic(g, comb, ctx.degrees) == N * k * h * b + N * h * b + again
    cfg = spec(_llama(experts=8, top_k=k, expert_ffn_hidden=256), micro_batch=2, global_batch=2)
    meg, _ = _report(cfg, "megatron")
    auto, _ = _report(cfg, "automodel")
    # two MoE layers, 8 local experts: DeepEP skips the regrouping's 2 x 2 passes over the N k rows
    assert meg.chunk_fwd_traffic[0] - auto.chunk_fwd_traffic[0] == 2 * 2 * 2 * N * k * h * b
