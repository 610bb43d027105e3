"""`parcompile verify` of `serve` specs: the serve miniature (the training miniature's model
and layout, a few greedy requests) under torchrun against the same program in one process:
greedy tokens equal, prefill and decode logits within fp32 tolerances, the KV cache bytes of
every rank equal to the plan's, and parameters per rank. A deliberately wrong program (kv
heads mapped to the wrong tp ranks) and a plan whose KV bytes are off must fail.

The cases share one torchrun launch per world size with tests/test_verify.py's
(``tests/verify_batch.py``).
"""

from __future__ import annotations

import copy

import pytest

from parcompile.diagnostics import SpecError
from parcompile.verification import (SERVE_NEW_TOKENS, Tolerances, kv_cache_check, miniature, serve_miniature,
                               serve_prompts)
from tests.serve_utils import measured_collectives, planned_collectives, serve_config
from tests.verify_batch import result_of, verify_fixture

#: the tp rank -> kv head rule of the generated serve program, and a wrong one (rank r takes
#: kv head r % kv_heads: tp 4, 2 kv heads -> 0, 1, 0, 1 instead of 0, 0, 1, 1)
KV_MAPPING = "shard_index=tp.index // KV_REPLICAS"
WRONG_KV_MAPPING = "shard_index=tp.index % KV_HEADS"

DEEPSEEK_V3 = dict(kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_heads=4,
                   rope_interleave=True, rope_type="yarn", rope_scaling_factor=4.0, rope_original_max_positions=8,
                   rope_mscale=0.707, rope_mscale_all_dim=1.0, experts=4, top_k=2, shared_experts=1,
                   dense_layers=1, scoring_func="sigmoid", topk_method="noaux_tc", n_group=2, topk_group=1,
                   routed_scaling_factor=2.5)
GEMMA3 = dict(qk_norm=True, zero_centered_gamma=True, sandwich_norm=True, scale_embeddings=True, activation="geglu",
              sliding_window=4, sliding_window_pattern=2, rope_local_base_freq=100.0, query_pre_attn_scalar=24.0,
              tie_embeddings=True)
GEMMA2 = dict(zero_centered_gamma=True, sandwich_norm=True, scale_embeddings=True, activation="geglu",
              sliding_window=4, sliding_window_pattern=2, query_pre_attn_scalar=24.0, tie_embeddings=True,
              attn_logit_softcapping=0.5, final_logit_softcapping=0.5)

CASES = {
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "tp2_pp2": dict(tp=2, pp=2),
    # kv-head replication: 2 kv heads on tp 4, each on 2 ranks (vLLM)
    "tp4_kv2_replicated": dict(tp=4, model=dict(heads=8, kv_heads=2)),
    # dp: independent replicas, each its own share of the sequences (tokens and logits joined in order)
    "dp2_tp2": dict(dp=2, tp=2),
    # DeepSeek-V3: multi-head latent attention (the latent cache on every tp rank), MoE
    "deepseek_v3_mla_tp2": dict(tp=2, model=DEEPSEEK_V3),
    # Gemma 3: local sliding-window layers (a cache of the window) and global ones, tied embeddings
    "gemma3_sliding_window_tp2_pp2": dict(tp=2, pp=2, model=GEMMA3),
    # Gemma 2 (issue 31): the attention's scores and the final logits soft-capped (caps low
    # enough to bite on the miniature), local and global layers alternating, tied embeddings
    "gemma2_softcap_tp2_pp2": dict(tp=2, pp=2, model=GEMMA2),
    # MoE with the experts split over ep inside the tp group: training's all-to-all dispatch,
    # decode-sized, beside a dense layer and shared experts split over tp (issue 33)
    "moe_ep2_tp2": dict(tp=2, model=dict(experts=4, top_k=2, shared_experts=1, dense_layers=1),
                        parallel=dict(ep=2, expert_tp=1)),
}
WRONG = {"tp4_kv2_wrong_kv_mapping": dict(tp=4, model=dict(heads=8, kv_heads=2))}


def _config(kw: dict):
    kw = dict(kw)
    return serve_config(kw.pop("dp", 1), kw.pop("tp", 1), kw.pop("pp", 1), **kw)


def _corrupt_kv_mapping(mini_dir) -> None:
    program = mini_dir / "serve.py"
    text = program.read_text()
    assert text.count(KV_MAPPING) == 2, "the serve program's kv-head rule (wk, wv) moved: update this test"
    program.write_text(text.replace(KV_MAPPING, WRONG_KV_MAPPING))


def _build(test: str, case: str) -> tuple:
    if case in WRONG:
        return _config(WRONG[case]), "fp32", None, _corrupt_kv_mapping
    return _config(CASES[case]), "fp32"


verified = verify_fixture(__name__, _build, per_test=False)   # tp2_pp2 serves three tests: run once


def _row(result, start: str):
    return next(c for c in result.checks if c.what.startswith(start))


@pytest.mark.torchrun
@pytest.mark.parametrize("case", list(CASES))
def test_serve_layout_matches_single_process(case, verified, request):
    result = result_of(verified, request, case)
    print(result.table())
    assert result.ok, result.table()
    tol = Tolerances()
    assert result.tokens == result.ref_tokens and len(result.tokens) == 2 * result.mini.parallel.dp
    assert all(len(t) == SERVE_NEW_TOKENS for t in result.tokens)
    assert len({tuple(t) for t in result.tokens}) == len(result.tokens)   # different sequences, not one repeated
    for row in ("prefill logits", "decode logits"):
        assert _row(result, row).max_abs <= tol.logits_atol
    kv = _row(result, "KV cache bytes per rank")
    assert kv.max_abs == 0 and "measured" in kv.detail
    # each rank's cache is the plan's, and the plan's is sequences x tokens x bytes per token
    sv, mem = result.plan["serve"], result.plan["memory"]["per_stage"]
    tokens = sv["prompt_len"] + sv["max_new_tokens"]
    for r in result.records:
        assert r["cache_bytes"] == mem[r["stage"]]["kv_cache"] > 0
        if not result.mini.model.sliding_window:
            assert r["cache_bytes"] == sv["batch_per_replica"] * tokens * sv["kv_bytes_per_token_per_stage"][r["stage"]]
    if case == "tp4_kv2_replicated":
        assert result.plan["model"]["kv_head_replicas"] == 2 and result.mini.model.kv_heads == 2
    if case == "moe_ep2_tp2":   # the experts split over ep: each rank holds half, rows go by all-to-all
        assert result.plan["degrees"]["ep"] == 2 and result.plan["degrees"]["expert_tp"] == 1
        for r in result.records:
            assert any(c["op"] == "all_to_all" and c["axis"] == "ep" and c["count"] > 0 for c in r["comm"]), r["comm"]
        # the serving estimate (costed from the graph) counts the collectives the program runs:
        # bytes exactly, the all-to-alls' (routing decides theirs) by count
        planned = planned_collectives(result.mini, SERVE_NEW_TOKENS)
        for r in result.records:
            want = planned[r["stage"]]
            got = measured_collectives(r)
            assert {k: n for k, n in got.items() if k[0] != "all_to_all"} == \
                {k: n for k, n in want.items() if k[0] != "all_to_all"}, r["rank"]
            # (a record may hold several all-to-all entries of equal bytes: routed rows apart)
            a2a = sum(c["count"] for c in r["comm"] if (c["op"], c["axis"]) == ("all_to_all", "ep"))
            assert a2a == sum(n for k, n in want.items() if k[:2] == ("all_to_all", "ep")) > 0, r["rank"]
    if case.startswith(("gemma3", "gemma2")):   # the local layers' caches hold their window only
        assert mem[0]["kv_cache"] < sv["batch_per_replica"] * tokens * sv["kv_bytes_per_token_per_stage"][0]


@pytest.mark.torchrun
@pytest.mark.parametrize("case", list(WRONG))
def test_wrong_kv_head_mapping_is_caught(case, verified, request):
    result = result_of(verified, request, case)
    print(result.table())
    assert not result.ok
    assert not _row(result, "greedy tokens").ok or not _row(result, "prefill logits").ok
    assert _row(result, "prefill logits").max_abs > 100 * Tolerances().logits_atol
    assert _row(result, "KV cache bytes per rank").ok       # the right bytes, the wrong heads


@pytest.mark.torchrun
@pytest.mark.parametrize("case", ["tp2_pp2"])
def test_plan_with_wrong_kv_bytes_is_caught(case, verified, request):
    result = result_of(verified, request, case)
    plan = copy.deepcopy(result.plan)
    for stage in plan["memory"]["per_stage"]:   # a plan that counted each rank's kv heads twice
        stage["kv_cache"] *= 2
    check = kv_cache_check(result.records, plan)
    assert not check.ok and check.max_abs == result.plan["memory"]["per_stage"][0]["kv_cache"]
    assert "!= plan" in check.detail


@pytest.mark.torchrun
@pytest.mark.parametrize("case", ["tp2_pp2"])
def test_cli_prints_serve_rows_and_exits_1_on_a_mismatch(case, verified, request, monkeypatch, capsys):
    import parcompile.verification
    from parcompile.cli import main

    good = result_of(verified, request, case)
    bad = copy.copy(good)
    bad.checks = good.checks[:-1] + [kv_cache_check(good.records, {**good.plan, "memory": {"per_stage": [
        {**s, "kv_cache": s["kv_cache"] + 4} for s in good.plan["memory"]["per_stage"]]}})]
    for result, code, verdict in ((good, 0, "verify: passed"), (bad, 1, "verify: FAILED")):
        monkeypatch.setattr(parcompile.verification, "verify", lambda cfg, **kw: result)
        assert main(["verify", "examples/tiny_serve.par"]) == code
        out = capsys.readouterr().out
        assert "greedy sequences, prompts of up to 8 tokens + 8 new" in out and verdict in out
        assert "tokens:    " + " ".join(map(str, good.tokens[0])) in out
        assert ("MISMATCH" in out) == (code == 1)


# ---- the serve miniature, in-process ---------------------------------------------------------

def test_serve_miniature_keeps_layout_and_kv_replication():
    mini = serve_miniature(_config(CASES["tp4_kv2_replicated"]))
    m, p, s = mini.model, mini.parallel, mini.serve
    assert (p.tp, p.pp, m.kv_heads, m.heads) == (4, 1, 2, 8) and mini.workload == "serve"
    assert s.temperature == 0 and s.weights is None and s.prompt_len + s.max_new_tokens <= m.seq_len
    # the training miniature's model: one rule (miniature), replication kept for serving only
    train = miniature(_config(CASES["tp4_kv2_replicated"]).model_copy(update=dict(workload="train", serve=None)))
    assert train.model.kv_heads == 4
    assert mini.model.model_dump(exclude={"kv_heads", "heads", "hidden", "ffn_hidden", "expert_ffn_hidden"}) == \
        train.model.model_dump(exclude={"kv_heads", "heads", "hidden", "ffn_hidden", "expert_ffn_hidden"})
    dp2 = serve_miniature(_config(dict(dp=2, tp=2)))
    assert dp2.serve.batch == 4 and dp2.parallel.dp == 2


def test_serve_prompts_are_left_padded_per_replica():
    plan = {"serve": {"batch": 4, "prompt_len": 8}, "model": {"vocab": 50}}
    prompts = serve_prompts(plan)
    assert [len(p) for p in prompts] == [8, 6, 8, 6] and all(0 <= t < 50 for p in prompts for t in p)
    assert serve_prompts(plan) == prompts


def test_serve_verify_refuses_16_bit_and_too_many_ranks():
    with pytest.raises(SpecError, match="fp32 only"):
        serve_miniature(_config(dict(tp=2)), dtype="bf16")
    with pytest.raises(SpecError, match="world_size 32 > 16"):
        serve_miniature(_config(dict(tp=8, pp=4, model=dict(heads=8, kv_heads=8))))
