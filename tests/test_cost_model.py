"""The cost model against Korthikanti et al. 2022 (Table 2 formulas, exact per layer) and
the published step times of Megatron-LM 2021 Table 1 and Korthikanti Table 5
(parcompile/analysis/calibration.py; `python benchmarks/cost_model.py` prints them all)."""

from fractions import Fraction

import pytest

from parcompile.analysis.calibration import ROWS, layer_activation_bytes, row_config, stage_activation_bytes
from parcompile.analysis.estimate import closed_form_bubble
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


@pytest.mark.parametrize("row", CALIBRATION, ids=[r.name for r in CALIBRATION])
def test_step_time_within_10_percent_of_published(row):
    est = cost_without_schedule(row_config(row)).time.step_time
    assert est == pytest.approx(row.step_time, rel=0.10), f"{row.name}: {est:.2f} s vs {row.step_time} s"


@pytest.mark.parametrize("row", CALIBRATION, ids=[r.name for r in CALIBRATION])
def test_stage_activations_within_2_percent_of_korthikanti(row):
    cfg = row_config(row)
    cost = cost_without_schedule(cfg)
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
    st = cost_without_schedule(row_config(row)).memory.per_stage[0]
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
    from parcompile.passes.groups import rank_groups
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
