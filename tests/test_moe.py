"""Mixture of experts: parameter counts, the plan's MoE collectives and memory, the
router and its load-balancing loss (in process; the torchrun runs are in test_verify.py)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

import parcompile
from parcompile.driver import compile_config
from parcompile.runtime.model.moe import load_balancing_loss, route
from tests.program_utils import tiny_config

REPO = Path(__file__).resolve().parents[1]


def test_mixtral_8x7b_counts():
    plan = parcompile.compile(REPO / "examples" / "mixtral_8x7b_8x8_h100.par")
    m = plan.data["model"]
    assert m["params"] == 46_702_792_704
    assert round(m["active_params"] / 1e9, 1) == 12.9
    assert plan.data["degrees"]["ep"] == 8 and plan.data["degrees"]["expert_dp"] == 2
    assert plan.data["memory"]["fits"]


def test_deepseek_style_counts_and_layers():
    plan = parcompile.compile(REPO / "examples" / "deepseek_moe_16b_1x8_h100.par")
    m = plan.data["model"]
    assert round(m["params"] / 1e9, 1) == 16.4 and round(m["active_params"] / 1e9, 1) == 2.8   # DeepSeekMoE 16B
    dump = plan.graph_dump()
    assert "layers.0.mlp.w1" in dump and "layers.0.mlp.router" not in dump   # dense first layer
    assert "layers.1.mlp.router" in dump and "layers.1.mlp.shared.w1" in dump
    assert "balanced" in plan.data["estimate"]["assumptions"]["moe_routing"]


def test_all_to_all_volume_from_top_k_hidden_and_tokens():
    cfg = tiny_config(2, 1, 1, model=dict(experts=4, top_k=2, layers=1), parallel=dict(ep=2))
    plan = compile_config(cfg).data
    b, t, h, k, e = 2, 16, 64, 2, 4
    rows = b * t * k
    a2a = [c for c in plan["comm"]["collectives"] if c["op"] == "all_to_all" and c["bytes"] > 64]
    assert {c["bytes"] for c in a2a} == {rows * h * e}
    assert sum(c["count"] for c in a2a) == 4 * cfg.parallel.num_microbatches     # 2 forward + 2 backward
    routed = [c for c in a2a if c.get("routed")]
    assert len(routed) == 2 and all(c["bytes_per_row"] == h * e for c in routed)
    counts = [c for c in plan["comm"]["collectives"] if c["op"] == "all_to_all" and c["bytes"] == 4 * 8]
    assert counts and counts[0]["phase"] == "forward"                               # E int64 token counts


def test_expert_states_sharded_over_expert_dp():
    cfg = tiny_config(4, 1, 1, model=dict(experts=4, top_k=2), parallel=dict(ep=2, zero=1))
    plan = compile_config(cfg)
    st = plan.passes.collectives.stage_params[0]
    assert cfg.parallel.expert_dp == 2 and st.expert > 0
    opt = plan.data["memory"]["per_stage"][0]["optimizer"]
    assert opt == 8 * math.ceil(st.dense / 4) + 8 * math.ceil(st.expert / 2)   # fp32 Adam: 8 bytes per state element
    ops = {(c["op"], c["axis"], c["where"]) for c in plan.data["comm"]["collectives"]}
    assert ("reduce_scatter", "expert_dp", "expert_grads") in ops and ("all_gather", "expert_dp", "expert_params") in ops


def test_moe_with_tp_needs_sequence_parallel():
    # a rule of the checks table (parcompile.frontend.checks): `check`, compile and the search see it
    from parcompile.layout_search import check_layout

    cfg = tiny_config(1, 2, 1, model=dict(experts=4), parallel=dict(ep=2))
    errors = [d.message for d in check_layout(cfg) if d.severity == "error"]
    assert "a mixture-of-experts model with tp = 2 needs sequence_parallel = true" in errors
    ok = tiny_config(1, 2, 1, model=dict(experts=4), parallel=dict(ep=2, sequence_parallel=True))
    assert "a mixture-of-experts model with tp = 2 needs sequence_parallel = true" not in \
        [d.message for d in check_layout(ok)]


def test_router_top_k_and_load_balancing_loss():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.0, 3.0, -0.5]])
    w, experts, probs = route(logits, 2)
    assert experts.tolist() == [[0, 1], [2, 0]]
    assert torch.allclose(w.sum(-1), torch.ones(2))
    p = torch.softmax(logits, -1)
    assert torch.allclose(w[0], p[0, :2] / p[0, :2].sum())                 # Mixtral: renormalised top-k
    # Switch: E * sum_e f_e P_e, f from the 4 assignments (0, 1, 2, 0), P the mean probability
    f = torch.tensor([2, 1, 1, 0]) / 4.0
    assert torch.allclose(load_balancing_loss(probs, experts, 4), 4 * (f * p.mean(0)).sum())
    uniform = torch.full((8, 4), 0.25)
    assert torch.allclose(load_balancing_loss(uniform, torch.arange(16).view(8, 2) % 4, 4), torch.tensor(1.0))
