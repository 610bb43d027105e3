import math

import pytest

from parcompile.analysis.memory import saved_bytes_per_chunk, state_bytes
from parcompile.core.data_parallel import DataParallelSharding
from parcompile.driver import compile_config
from tests.plan_factories import llama2_7b, llama3_8b, run_until, spec, tiny_model


# ------------------------------------------------------------------ parameters

def test_llama2_7b_params_exact():
    plan = compile_config(spec(llama2_7b()))
    assert plan.data["model"]["params"] == 6_738_415_616


def test_llama3_8b_params_exact():
    plan = compile_config(spec(llama3_8b(), tp=8, global_batch=1))
    assert plan.data["model"]["params"] == 8_030_261_248
    assert plan.data["model"]["active_params"] == 8_030_261_248


def test_params_per_rank_uses_padded_vocab_and_counts_tied_copies():
    m = tiny_model(vocab=1000, tie_embeddings=True)
    h, V = 64, 1000
    Vp = math.ceil(V / 256) * 256                         # tp = 2: multiple of 128 * 2
    layer = 2 * h + (h * 64 + 2 * h * 32 + 64 * h + 3 * h * 128) // 2
    plan = compile_config(spec(m, tp=2, pp=2, global_batch=2))
    st = plan.data["stages"]
    assert st[0]["params_per_rank"] == Vp // 2 * h + 2 * layer
    assert st[1]["params_per_rank"] == 2 * layer + h + Vp // 2 * h
    # the model counts the unpadded, tied embedding once
    full_layer = 2 * h + h * 64 + 2 * h * 32 + 64 * h + 3 * h * 128
    assert plan.data["model"]["params"] == V * h + 4 * full_layer + h
    one = compile_config(spec(m, global_batch=1))
    assert one.data["stages"][0]["params_per_rank"] == math.ceil(V / 128) * 128 * h + 4 * full_layer + h


# ------------------------------------------------------------------ compute

def gpt(L=2, h=64, a=4, s=32, V=256):
    return tiny_model(layers=L, hidden=h, heads=a, kv_heads=a, ffn_hidden=4 * h, vocab=V, seq_len=s,
                      norm="layernorm", activation="gelu", position="learned", bias=True)


def test_model_flops_equal_korthikanti_for_gpt():
    L, h, s, V, B = 2, 64, 32, 256, 8
    plan = compile_config(spec(gpt(L, h, 4, s, V), dp=2, tp=2, micro_batch=2, global_batch=B))
    # 72 B s L h^2 (1 + s/6h + V/12hL), multiplied out to stay in integers
    want = 72 * B * s * L * h * h + 12 * B * s * s * L * h + 6 * B * s * h * V
    assert plan.data["compute"]["model_flops_per_step"] == want
    assert plan.data["compute"]["hardware_flops_per_step"] == want


def test_hardware_flops_add_full_recompute():
    L, h, s, V, B = 2, 64, 32, 256, 4
    plan = compile_config(spec(gpt(L, h, 4, s, V), global_batch=B, recompute="full"))
    # Korthikanti: 96 B s L h^2 (1 + s/6h + V/16hL)
    want = 96 * B * s * L * h * h + 16 * B * s * s * L * h + 6 * B * s * h * V
    assert plan.data["compute"]["hardware_flops_per_step"] == want


# ------------------------------------------------------------------ memory

@pytest.mark.parametrize("zero,per_param", [(0, 18), (1, 6 + 12 / 8), (2, 2 + 16 / 8), (3, 18 / 8)])
def test_16bit_state_bytes(zero, per_param):
    n = 8000
    assert sum(state_bytes(n, 2, DataParallelSharding(stage=zero, shard=8))) == per_param * n


@pytest.mark.parametrize("zero,per_param", [(0, 16), (1, 8 + 8 / 4), (2, 4 + 12 / 4), (3, 16 / 4)])
def test_fp32_state_bytes(zero, per_param):
    n = 4000
    assert sum(state_bytes(n, 4, DataParallelSharding(stage=zero, shard=4))) == per_param * n


def test_sharded_buffers_round_up_and_split_into_parts():
    p, g, o = state_bytes(10, 2, DataParallelSharding(stage=1, shard=4))
    # zero 1: the full fp32 gradient buffer is padded to a multiple of d = 4 (12 elements)
    # so it is reduce-scattered as it is; the optimizer states are the ceil(10 / 4) = 3 shard
    assert (p, g, o) == (20, 4 * 12, 12 * 3)
    assert state_bytes(10, 4, DataParallelSharding(), "sgd") == (40, 40, 0)


def test_memory_report_uses_params_per_rank():
    plan = compile_config(spec(dp=2, zero=1, micro_batch=1, global_batch=2))
    n = plan.data["stages"][0]["params_per_rank"]
    s0 = plan.data["memory"]["per_stage"][0]
    assert (s0["params"], s0["grads"], s0["optimizer"]) == (4 * n, 4 * n, 8 * math.ceil(n / 2))
    assert s0["total"] == sum(s0[k] for k in ("params", "grads", "optimizer", "activations", "kv_cache", "buffers"))
    assert s0["buffers"] == sum(s0["buffer_parts"].values())
    cap = plan.config.cluster.memory * (1 - plan.config.cluster.memory_reserve)
    assert plan.data["memory"]["capacity"] == int(cap)


def test_activations_per_layer_match_korthikanti():
    s, b, h, a = 32, 2, 64, 4
    def saved(L, tp):
        m = tiny_model(layers=L, hidden=h, heads=a, kv_heads=a, ffn_hidden=4 * h, seq_len=s, dtype="bf16",
                       norm="layernorm", activation="gelu", position="learned", attention="unfused", dropout=0.1)
        g, ctx = run_until(spec(m, tp=tp, micro_batch=b, global_batch=b), "insert-collectives")
        return saved_bytes_per_chunk(g, ctx.degrees, 1, "none")[0]
    # one layer, 16-bit, no parallelism: s b h (34 + 5 a s / h)
    assert saved(2, 1) - saved(1, 1) == s * b * h * 34 + 5 * a * s * s * b
    # tensor parallel without sequence parallelism: s b h (10 + 24/t) + 5 a s^2 b / t
    t = 2
    assert saved(2, t) - saved(1, t) == s * b * h * (10 + 24 // t) + 5 * a * s * s * b // t


# ------------------------------------------------------------------ comm and estimate

def test_comm_per_step_ring_bytes():
    plan = compile_config(spec(tp=2, global_batch=1))
    b, t, h, e, L = 1, 64, 64, 4, 4
    act = b * t * h * e
    n = 2
    ring = lambda nbytes: 2 * (n - 1) * nbytes // n
    # 4 per layer + embedding + head backward; 3 loss reductions (fp32 per token); grad norm
    want = (4 * L + 2) * ring(act) + 3 * ring(b * t * 4) + ring(4)
    assert plan.data["comm"]["per_step"]["tp"] == want
    assert plan.data["comm"]["per_step"]["dp"] == 0


def test_estimate_formulas():
    cfg = spec(dp=2, tp=2, pp=2, micro_batch=2, global_batch=16)
    d = compile_config(cfg).data
    est, comp = d["estimate"], d["compute"]
    assert sum(est["breakdown"].values()) == pytest.approx(est["step_time"])
    assert est["tflops_per_gpu"] == pytest.approx(comp["model_flops_per_step"] / (est["step_time"] * 8) / 1e12)
    assert est["mfu"] == pytest.approx(est["tflops_per_gpu"] * 1e12 / cfg.cluster.peak_flops)
    assert est["tokens_per_s"] == pytest.approx(16 * 64 / est["step_time"])
    assert 0 < est["mfu"] < 1


def test_zero3_counts_the_parameters_it_gathers_for_the_step():
    """ZeRO-3 all-gathers a stage's parameters at the step's start and frees them after the
    update (torchtitan FSDP + PP): during the step the full 16-bit parameters sit beside
    the rank's slice, a buffer of e * (local parameters); none without sharding."""
    from parcompile.driver import compile_config
    from tests.program_utils import tiny_config

    for dp, want_gather in ((2, True), (1, False)):
        plan = compile_config(tiny_config(dp=dp, pp=2, model=dict(dtype="bf16"), parallel=dict(zero=3)))
        for st, mem in zip(plan.data["stages"], plan.data["memory"]["per_stage"]):
            got = mem["buffer_parts"].get("zero3_gather", 0)
            assert got == (2 * st["params_per_rank"] if want_gather else 0)


def test_op_level_selective_recompute_engines_are_the_engine_tables():
    """analysis/compute.py keeps the engines of torchtitan's op-level selective recompute
    beside op_sac (estimate imports compute, not the other way): the same set as the
    engines whose Engine.sac is "op"."""
    from parcompile.analysis.compute import OP_SAC_ENGINES
    from parcompile.analysis.estimate import ENGINES

    assert OP_SAC_ENGINES == {name for name, e in ENGINES.items() if e.sac == "op"}
