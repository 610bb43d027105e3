"""The serving workload's steady state (analysis/serve_workload.py) on steps of known cost,
the step mix's attention pairs against a brute-force count, and the quantized weights a
serve plan prices (core/quant.py) counted by hand (issue 45)."""

from __future__ import annotations

import math

import pytest

import parcompile
from parcompile.analysis.serve_steps import Segment, Step
from parcompile.analysis.serve_workload import (Overloaded, PrefillPool, Workload, disaggregated_state,
                                                steady_state)
from parcompile.core.quant import FORMATS


def linear(fixed=1e-3, per_token=1e-5, per_row=2e-5):
    """A step costing ``fixed + per_token * tokens + per_row * rows`` seconds."""
    def step_time(step: Step):
        t = fixed + per_token * step.tokens + per_row * step.rows
        return t, {"gemm": t}
    return step_time


def work(**kw) -> Workload:
    base = dict(prompt=100, output=50, clients=4, rate=None, max_seqs=8, kv_tokens=10**6, budget=1000,
                block_size=16, request_overhead=2e-3)
    base.update(kw)
    return Workload(**base)


@pytest.mark.parametrize("window", [0, 3, 7, 200])
@pytest.mark.parametrize("start, tokens", [(0, 1), (0, 12), (5, 1), (9, 6), (40, 33)])
def test_segment_pairs_and_cached_context_by_brute_force(window, start, tokens):
    seg = Segment(3, tokens, start)
    brute = sum(min(start + i, window) if window else start + i for i in range(1, tokens + 1))
    assert seg.pairs(window) == pytest.approx(3 * brute)
    assert seg.cached(window) == 3 * (min(start, window) if window else start)


def test_one_client_decodes_alone_and_prefills_in_chunks():
    """Concurrency 1: every decode step is one row (TPOT is that step), the prompt's chunks
    (ceil(P / budget) of them) come after the engine's per-request time; nothing waits."""
    st = linear()
    w = work(clients=1, budget=30)
    t = steady_state(w, st)
    assert t.tpot == pytest.approx(st(Step((Segment(1, 1, 124),)))[0])
    k = math.ceil(100 / 29)                    # the budget less the request's own row
    assert t.prefill_steps == k and t.queue == 0 and t.mixed_share == 0
    chunk = 100 / k
    assert t.ttft == pytest.approx(2e-3 + k * st(Step((Segment(1, chunk, 0),)))[0])
    assert t.e2e == pytest.approx(t.ttft + 49 * t.tpot)
    assert t.request_rate == pytest.approx(1 / t.e2e)


def test_closed_loop_little_and_queue_beyond_the_batch():
    st = linear()
    free = steady_state(work(clients=4, max_seqs=8), st)
    assert free.queue == 0 and free.running == 4
    assert free.request_rate == pytest.approx(4 / free.e2e)          # Little: c = X * E2E
    assert 0 < free.mixed_share < 1 and free.tpot > free.decode_step  # others' prompts slow the decode steps
    full = steady_state(work(clients=20, max_seqs=8), st)
    assert full.running == 8 and full.queue > 0
    service = full.ttft - full.queue + 49 * full.tpot
    assert full.request_rate == pytest.approx(8 / service)
    assert full.e2e == pytest.approx(20 / full.request_rate)
    assert full.ttft == pytest.approx(full.queue + (service - 49 * full.tpot))


def test_the_kv_cache_limits_the_running_sequences():
    st = linear()
    per = 100 + 50 / 2 + 16 / 2
    t = steady_state(work(clients=20, max_seqs=64, kv_tokens=int(5 * per)), st)
    assert t.running == 5 and t.running_limit == 5 and t.queue > 0
    with pytest.raises(ValueError):
        steady_state(work(kv_tokens=100), st)                         # not one sequence of 150 tokens


def test_burst_prefills_every_prompt_then_decodes_together():
    st = linear()
    t = steady_state(work(clients=8, rate=math.inf, budget=400), st)   # 800 prompt tokens: 2 steps of 400
    one = st(Step((Segment(4, 100, 0),)))[0]
    assert t.prefill_steps == 2
    # requests 1-4 finish their prompts in the first step, 5-8 in the second
    assert t.ttft == pytest.approx(2e-3 + (4 * one + 4 * 2 * one) / 8)
    assert t.tpot == pytest.approx(st(Step((Segment(8, 1, 124),)))[0])
    assert t.e2e == pytest.approx(2e-3 + 2 * one + 49 * t.tpot)


def test_open_loop_running_sequences_by_little_and_overload():
    st = linear()
    t = steady_state(work(rate=5.0), st)
    assert t.running == pytest.approx(5.0 * t.e2e, rel=1e-4)
    with pytest.raises(Overloaded) as e:
        steady_state(work(rate=1e4), st)
    assert 0 < e.value.capacity < 1e4 and e.value.limit == 8


def test_disaggregated_decode_steps_carry_no_prompts():
    st = linear()
    pool = PrefillPool(instances=1, prompt_s=0.02, step_s=0.05, step_tokens=400, transfer_s=0.003)
    t = disaggregated_state(work(clients=4), pool, st)
    assert t.tpot == pytest.approx(st(Step((Segment(3, 1, 124), Segment(1, 1, 124))))[0])
    u = t.request_rate * 100 / (400 / 0.05)
    assert t.ttft == pytest.approx(2e-3 + u / (2 * (1 - u)) * 0.02 + 0.02 + 0.003)
    assert t.request_rate == pytest.approx(4 / t.e2e)
    with pytest.raises(Overloaded):
        disaggregated_state(work(rate=1e3), pool, st)


def _serve(weight_dtype: str, model: str = "llama3-8b", tp: int = 1) -> dict:
    src = (f'model m from "{model}" {{ seq_len = 4096 }}\ncluster c from "h100-sxm" {{ nodes = 1, '
           f'gpus_per_node = {tp} }}\nparallel {{ tp = {tp} }}\nserve {{ prompt_len = 1024, max_new_tokens = 128, '
           f'concurrency = 8, weight_dtype = {weight_dtype} }}\n')
    return parcompile.compile(src, filename="q.par").data


def test_fp8_weights_priced_by_hand():
    """Llama 3 8B, fp8 (128 x 128 blocks, fp32 scales): the decoder layers' linear weights at
    1 byte plus a scale per block; embedding, LM head and norms stay bf16."""
    dense, fp8 = _serve("model"), _serve("fp8")
    h, f, kv, L, V = 4096, 14336, 1024, 32, 128256
    fmt = FORMATS["fp8-block"]
    mats = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]   # wq wk wv wo w1 w3 w2 as (out, in)
    linear_params = L * sum(o * i for o, i in mats)
    stored = L * sum(fmt.weight_bytes((o, i)) for o, i in mats)
    assert stored == linear_params + L * 4 * sum(-(-o // 128) * -(-i // 128) for o, i in mats)
    assert dense["serve"]["weights_bytes_per_rank"] - fp8["serve"]["weights_bytes_per_rank"] == 2 * linear_params - stored
    sv = fp8["serve"]
    assert (sv["weight_dtype"], sv["weight_format"]) == ("fp8", "fp8-block")
    assert sv["max_concurrent_tokens"] > dense["serve"]["max_concurrent_tokens"]      # the bytes freed hold cache
    assert sv["tpot"] < dense["serve"]["tpot"] and sv["ttft"] < dense["serve"]["ttft"]  # fewer bytes, FP8 GEMMs
    assert V * h * 2 * 2 < sv["weights_bytes_per_rank"]                                 # embedding + head in bf16


def test_mxfp4_experts_priced_by_hand():
    """gpt-oss-20b as published: only the experts in MXFP4 (half a byte a value, one byte of
    scale per 32), attention, router, embedding and head in bf16."""
    dense, mx = _serve("model", "gpt-oss-20b"), _serve("mxfp4", "gpt-oss-20b")
    E, h, i, L = 32, 2880, 2880, 24
    experts = L * E * 3 * h * i                     # gate, up and down of every expert
    stored = L * E * 3 * (h * i // 2 + h * i // 32)
    assert dense["serve"]["weights_bytes_per_rank"] - mx["serve"]["weights_bytes_per_rank"] == 2 * experts - stored
    assert mx["serve"]["weight_format"] == "mxfp4" and mx["serve"]["tpot"] < dense["serve"]["tpot"]


def test_burst_in_waves_against_a_request_by_request_count():
    """20 requests at once, 8 a wave: waves of 8, 8 and 4 back to back, each one prefill step
    (the budget holds a wave's prompts) then 49 decode steps; every request's first token and
    end counted one by one."""
    st = linear()
    w = work(clients=20, rate=math.inf, max_seqs=8, budget=10**6)
    t = steady_state(w, st)
    start, ttfts, ends = 0.0, [], []
    for n in (8, 8, 4):
        pf = st(Step((Segment(n, 100, 0),)))[0]
        dur = pf + 49 * st(Step((Segment(n, 1, 124),)))[0]
        ttfts += [2e-3 + start + pf] * n
        ends += [2e-3 + start + dur] * n
        start += dur
    assert t.ttft == pytest.approx(sum(ttfts) / 20) and t.e2e == pytest.approx(sum(ends) / 20)
    assert t.request_rate == pytest.approx(20 / (start + 2e-3))
    # a burst of a billion costs what its two kinds of wave do
    big = steady_state(work(clients=10**9, rate=math.inf, max_seqs=8, budget=10**6), st)
    assert big.ttft > t.ttft and math.isfinite(big.e2e)
