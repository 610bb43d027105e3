"""The serving workspace from the graph (parcompile/analysis/serve_memory.py ``serve_workspace``)
against the peak bytes torch.profiler measures while the generated serve program prefills
(tests/serve_memory.py), and a case counted by hand."""

from __future__ import annotations

import pytest

from parcompile.analysis.serve_memory import prefill_step, serve_workspace
from parcompile.passes.manager import compile_graph

from tests.serve_memory import measure_prefill
from tests.serve_utils import build_serve, serve_config

MOE = dict(experts=4, top_k=2, expert_ffn_hidden=32, shared_experts=1, dense_layers=0)
MLA = dict(kv_lora_rank=32, q_lora_rank=0, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
GPT2 = dict(norm="layernorm", activation="gelu", position="learned", kv_heads=4, max_positions=64)

#: (tp, model keys) of each measured case (serve_config's 4-layer model, h 64, 4 heads)
CASES = {
    "llama_tp1": (1, {}),
    "llama_tp2": (2, {}),
    "llama_bf16_unfused_tp2": (2, dict(dtype="bf16", attention="unfused")),
    "moe_tp2": (2, MOE),
    "mla_tp2": (2, MLA),
    "gpt2_learned_tp1": (1, GPT2),
    # gpt-oss's attention: sinks (the softmax spelled out), sliding-window and full layers
    "sinks_window_bf16_tp2": (2, dict(attention_sinks=True, dtype="bf16", sliding_window=8, sliding_window_pattern=2)),
}

#: predicted / measured. Below 1: allocations the graph does not name (torch's CPU flash
#: kernel's per-thread buffers, ~8 KB here; oneDNN's packing buffers of a 16-bit GEMM; the
#: norms' per-token statistics) and the allocator's rounding. Above 1: the MoE layer's
#: experts are bounded for any routing (one expert receiving every token of the step), a
#: random router's busiest expert takes fewer (about 9% of the workspace here); the dense
#: and MLA layers land on the measured bytes.
BAND = (0.95, 1.10)


@pytest.mark.parametrize("case", sorted(CASES))
def test_workspace_is_the_measured_prefill_peak(tmp_path, case):
    tp, model = CASES[case]
    b, P = 4, 24
    cfg = serve_config(tp=tp, model=model, serve=dict(batch=b, prompt_len=P, max_new_tokens=4))
    plan = build_serve(cfg, tmp_path)
    predicted = plan["serve"]["workspace_bytes_per_rank"]
    assert plan["memory"]["per_stage"][0]["activations"] == predicted
    measured = measure_prefill(tmp_path, b, P)
    assert BAND[0] <= predicted / measured <= BAND[1], (case, predicted, measured)


def test_head_is_the_measured_peak(tmp_path):
    """A vocabulary large beside the layers (16,384 x 4 rows against 8 tokens of h 64): the
    step's peak is the head's, the fp32 logits and the top-p sampler's working set."""
    cfg = serve_config(model=dict(vocab=16384), serve=dict(batch=4, prompt_len=2, max_new_tokens=4))
    plan = build_serve(cfg, tmp_path)
    c = compile_graph(cfg)
    (w,) = serve_workspace(cfg, c.graph, c.ctx.degrees, *prefill_step(cfg))
    assert w.head > w.layer
    measured = measure_prefill(tmp_path, 4, 2)
    assert BAND[0] <= plan["serve"]["workspace_bytes_per_rank"] / measured <= BAND[1]


def test_dense_workspace_counted_by_hand():
    """fp32 llama layer, tp 1, b = 4 sequences of T = 24 tokens (N = 96), h 64, SwiGLU f 128:
    the peak is SwiGLU's, with the layer's input, the attention's residual sum, the MLP's
    normed input (its argument) and w1's and w3's outputs live: N 4 (3 h + 3 f). The step's
    inputs: the causal mask (N L bytes) and the fp32 cos and sin at 16 rotated dims.
    The head: the last hidden state, the lm head's 256 fp32 logits per row and the
    sampler's 24 bytes per logit (top-p: measured in test_head_is_the_measured_peak)."""
    cfg = serve_config(serve=dict(batch=4, prompt_len=24, max_new_tokens=4))
    c = compile_graph(cfg)
    assert prefill_step(cfg) == (4, 24, 24)
    (w,) = serve_workspace(cfg, c.graph, c.ctx.degrees, 4, 24, 24)
    N = 4 * 24
    assert w.layer == N * 4 * (3 * 64 + 3 * 128)
    assert w.step == N * 24 + 2 * N * 16 * 4
    assert w.head == N * 64 * 4 + 4 * 256 * (4 + 24)
    assert w.received == 0 and w.total == w.layer + w.step


def test_chunked_prefill_costs_one_budget_of_tokens_attending_the_prompt():
    """With serve.max_prefill_tokens the server's step holds at most that many prompt tokens
    per row (left-padded to the longest): rows x budget tokens, the last chunk attending the
    whole prompt (its context's keys and values gathered beside the chunk's)."""
    whole = serve_config(serve=dict(batch=4, prompt_len=24, max_new_tokens=4))
    chunked = serve_config(serve=dict(batch=4, prompt_len=24, max_new_tokens=4, max_prefill_tokens=8))
    assert prefill_step(chunked) == (4, 8, 24)
    c = compile_graph(chunked)
    (w8,) = serve_workspace(chunked, c.graph, c.ctx.degrees, *prefill_step(chunked))
    (w24,) = serve_workspace(whole, c.graph, c.ctx.degrees, *prefill_step(whole))
    assert w8.total < w24.total
    # at the chunk's attention core: 4 x 8 query rows over 24 keys
    (w8_own,) = serve_workspace(chunked, c.graph, c.ctx.degrees, 4, 8, 8)
    assert w8.total > w8_own.total
