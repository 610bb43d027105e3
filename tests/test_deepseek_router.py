"""DeepSeek-V3's MoE router (runtime/model/moe.py: route, Router, dispatch, GroupedExperts, combine):
sigmoid scores, the group-limited top-k on scores + ``e_score_correction_bias``, weights
from the uncorrected scores, ``norm_topk_prob`` (+1e-20), ``routed_scaling_factor``.

The reference is transformers' own ``DeepseekV3TopkRouter`` / ``DeepseekV3MoE`` with
random weights and a random non-zero correction bias; parcompile's layers get the same
weights by name (the fused ``gate_up_proj`` (E, 2F, h): gate rows, then up rows). Also:
the buffer's life (fp32 under any dtype, its layout, DCP save and load, the fp32 it is
written in), the spec's checks of the router keys, the plan's router attributes and the
generated programs' constructor arguments (in process, no torchrun).
"""

from __future__ import annotations

import math

import pytest
import torch

from parcompile.runtime.distributed.context import Axis
from parcompile import runtime as rt
from parcompile.runtime.model.moe import (ExpertAxes, GroupedExperts, Router, combine, dispatch, load_balancing_loss,
                                    route)
from tests.test_checks import diags, one, spec, where

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e .[test])")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

H, E, F, K, GROUPS, TOPK_GROUP, SCALE = 32, 16, 24, 4, 4, 2, 2.5
N_TOKENS = 48


def _one(name: str) -> Axis:
    return Axis(name, [0], 0, None)


def _hf_config(norm_topk_prob: bool):
    return transformers.DeepseekV3Config(
        hidden_size=H, intermediate_size=64, moe_intermediate_size=F, n_routed_experts=E, n_shared_experts=1,
        num_experts_per_tok=K, n_group=GROUPS, topk_group=TOPK_GROUP, routed_scaling_factor=SCALE,
        norm_topk_prob=norm_topk_prob, hidden_act="silu", num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=64, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=0)


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk_prob", "raw_topk_prob"])
def case(request):
    """transformers' DeepseekV3MoE (random weights, a bias that changes choices) and its input."""
    norm = request.param
    torch.manual_seed(5 + norm)
    hf = hf_ds.DeepseekV3MoE(_hf_config(norm)).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
        hf.gate.e_score_correction_bias.copy_(torch.rand(E) * 0.6 - 0.3)
    x = torch.randn(2, N_TOKENS // 2, H, generator=torch.Generator().manual_seed(1))
    return {"hf": hf, "x": x, "norm": norm}


def _router_kw(norm: bool) -> dict:
    return dict(norm_topk_prob=norm, scoring_func="sigmoid", topk_method="noaux_tc", n_group=GROUPS,
                topk_group=TOPK_GROUP, routed_scaling_factor=SCALE)


def _copy_from_hf(ours: torch.nn.Module, hf, shared: bool = False) -> None:
    """transformers' DeepseekV3MoE tensors -> our names (moe.py's docstrings)."""
    sd = hf.state_dict()
    ps = dict(ours.named_parameters())
    bufs = dict(ours.named_buffers())
    with torch.no_grad():
        ps["router.weight"].copy_(sd["gate.weight"])
        bufs["router.e_score_correction_bias"].copy_(sd["gate.e_score_correction_bias"])
        for e in range(E):
            gate_up, down = sd["experts.gate_up_proj"][e], sd["experts.down_proj"][e]
            ps[f"experts.{e}.w1"].copy_(gate_up[:F])
            ps[f"experts.{e}.w3"].copy_(gate_up[F:])
            ps[f"experts.{e}.w2"].copy_(down)
        if shared:
            ps["shared.w1.weight"].copy_(sd["shared_experts.gate_proj.weight"])
            ps["shared.w3.weight"].copy_(sd["shared_experts.up_proj.weight"])
            ps["shared.w2.weight"].copy_(sd["shared_experts.down_proj.weight"])


class _RoutedExperts(torch.nn.Module):
    """A generated program's routed experts on one process (ep = expert_tp = 1: every expert
    here): its router -> dispatch -> grouped experts -> combine, as the MoE class calls them."""

    def __init__(self, name: str, aux_loss_scale: float = 0.0, **router_kw):
        super().__init__()
        axes = ExpertAxes(_one("ep"), _one("expert_tp"), _one("expert_dp"))
        self.aux_loss_scale = aux_loss_scale
        self.router = Router(f"{name}.router", H, E, K, _one("tp"), 0, **router_kw)
        self.experts = GroupedExperts(f"{name}.experts", E, H, F, "swiglu", axes, 0, 0.02, local=(E, F, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = self.router(x)
        rows = self.experts(dispatch(x, route, local_experts=E))
        return combine(rows, route, self.aux_loss_scale if self.training else 0.0)


def _moe_layer(norm: bool) -> _RoutedExperts:
    return _RoutedExperts("layers.1.mlp", **_router_kw(norm))


def _sorted(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) of each token in expert order (transformers' top-k is unsorted)."""
    order = experts.argsort(dim=-1)
    return weights.gather(1, order), experts.gather(1, order)


# --------------------------------------------------------------------------- the router


def test_router_equals_transformers(case):
    hf, x = case["hf"], case["x"]
    router = Router("layers.1.mlp.router", H, E, K, _one("tp"), 0, **_router_kw(case["norm"]))
    with torch.no_grad():
        router.weight.copy_(hf.gate.weight)
        router.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        _, ref_w, ref_e = hf.gate(x)
        w, e, _ = router(x.reshape(-1, H))
    ref_w, ref_e = _sorted(ref_w, ref_e)
    w, e = _sorted(w, e)
    assert torch.equal(e, ref_e)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-6)
    if case["norm"]:   # the k weights sum to routed_scaling_factor
        torch.testing.assert_close(w.sum(-1), torch.full((N_TOKENS,), SCALE), rtol=0, atol=1e-5)
    # the bias and the groups change the choice on these tokens (else the test could not fail)
    logits = x.reshape(-1, H) @ hf.gate.weight.t()
    _, plain, _ = route(logits, K, scoring_func="sigmoid")
    _, no_bias, _ = route(logits, K, scoring_func="sigmoid", n_group=GROUPS, topk_group=TOPK_GROUP)
    _, no_groups, _ = route(logits, K, scoring_func="sigmoid", correction_bias=hf.gate.e_score_correction_bias)
    for other in (plain, no_bias, no_groups):
        assert not torch.equal(other.sort(-1)[0], e)


def test_group_limited_choice_by_hand():
    # 8 experts in 4 groups of 2, keep 2 groups, top 2 experts. Scores s = sigmoid(logits);
    # the bias lifts expert 7 so that group 3 (6, 7) beats group 0 (0, 1), whose expert 0
    # alone has the largest score
    s = torch.tensor([[0.95, 0.10, 0.60, 0.55, 0.20, 0.15, 0.40, 0.30]])
    logits = torch.log(s / (1 - s))
    b = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.4])
    # group sums of s + b: g0 1.05, g1 1.15, g2 0.35, g3 1.10 -> groups 1 and 3 kept;
    # among 2, 3, 6, 7 the corrected scores 0.60, 0.55, 0.40, 0.70 -> experts 7 and 2
    w, e, balance = route(logits, 2, True, "sigmoid", b, 4, 2, 2.5)
    w, e = _sorted(w, e)
    assert e.tolist() == [[2, 7]]
    # weights from the uncorrected scores 0.60 and 0.30, normalised, times 2.5
    torch.testing.assert_close(w, torch.tensor([[0.6 / 0.9 * 2.5, 0.3 / 0.9 * 2.5]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(balance, s / s.sum(), rtol=0, atol=1e-6)
    w_raw, _, _ = route(logits, 2, False, "sigmoid", b, 4, 2, 1.0)
    torch.testing.assert_close(w_raw.sort(-1)[0], torch.tensor([[0.3, 0.6]]), rtol=0, atol=1e-6)
    # sigmoid with top_k = 1 and norm_topk_prob: the weight is 1 (transformers divides anyway)
    w1, e1, _ = route(logits, 1, True, "sigmoid")
    assert e1.tolist() == [[0]] and w1.tolist() == [[1.0]]


def test_softmax_router_unchanged():
    """The default router is the softmax top-k of before (bit for bit; no 1e-20)."""
    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    p = torch.softmax(logits, -1)
    top, idx = p.topk(2, dim=-1)
    w, e, balance = route(logits, 2)
    assert torch.equal(e, idx) and torch.equal(w, top / top.sum(-1, keepdim=True)) and torch.equal(balance, p)
    w, e, _ = route(logits, 1)
    assert torch.equal(w, p.max(-1, keepdim=True)[0])   # Switch: p itself


def test_sigmoid_balance_loss_uses_normalised_scores():
    """DeepSeek-V3's balance loss (its report, eq. 17-20): P_i the mean over tokens of s_i /
    sum_j s_j; with uniform scores and every expert chosen equally often it is 1."""
    logits = torch.zeros(8, 4)
    w, e, balance = route(logits, 2, True, "sigmoid")
    torch.testing.assert_close(balance, torch.full((8, 4), 0.25))
    torch.testing.assert_close(load_balancing_loss(balance, torch.arange(16).view(8, 2) % 4, 4), torch.tensor(1.0))
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5]])
    _, e, balance = route(logits, 2, True, "sigmoid")
    s = torch.sigmoid(logits)
    f = torch.bincount(e.reshape(-1), minlength=4).float() / 2
    torch.testing.assert_close(load_balancing_loss(balance, e, 4), 4 * (f * (s / s.sum())).sum())


# --------------------------------------------------------------------------- the layers


def test_moe_layer_equals_transformers(case):
    """The program's routed experts (ep = 1, in process) = transformers' gate + routed experts, forward and the
    gradients of the input and the router weight (through the uncorrected scores)."""
    hf, x = case["hf"], case["x"]
    ours = _moe_layer(case["norm"]).eval()
    _copy_from_hf(ours, hf)
    xr, xo = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    _, w, idx = hf.gate(xr)
    ref = hf.experts(xr.reshape(-1, H), idx, w).view_as(x)
    out = ours(xo)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    ours_w, ours_e, _ = ours.router(x.reshape(-1, H))
    assert torch.equal(_sorted(ours_w, ours_e)[1], _sorted(w, idx)[1])
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    torch.testing.assert_close(xo.grad, xr.grad, rtol=1e-5, atol=1e-5)   # gradients of size ~30
    torch.testing.assert_close(ours.router.weight.grad, hf.gate.weight.grad, rtol=1e-5, atol=1e-5)
    assert ours.router.e_score_correction_bias.grad is None   # held fixed
    hf.zero_grad()


class _ServedMoE(torch.nn.Module):
    """The serve program's MoE module with ep = 1 (tp = 1 here), as codegen writes it from
    the serving graph: router, local dispatch, the grouped experts on every rank
    (``ExpertAxes.tensor_parallel``), combine, the shared experts' row-parallel w2 left
    unreduced and added, one all-reduce over tp of the sum."""

    def __init__(self, name: str, **router_kw):
        super().__init__()
        tp = self.tp = _one("tp")
        self.router = Router(f"{name}.router", H, E, K, tp, 0, **router_kw)
        self.experts = GroupedExperts(f"{name}.experts", E, H, F, "swiglu", ExpertAxes.tensor_parallel(tp), 0, 0.02,
                                      local=(E, F, H))
        self.shared = torch.nn.Module()
        self.shared.w1 = rt.ColumnParallelLinear(f"{name}.shared.w1", H, F, False, tp, 0)
        self.shared.w3 = rt.ColumnParallelLinear(f"{name}.shared.w3", H, F, False, tp, 0)
        self.shared.w2 = rt.RowParallelLinear(f"{name}.shared.w2", F, H, False, tp, 0, reduce=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = self.router(x)
        y = combine(self.experts(dispatch(x, route, local_experts=E)), route)
        shared = self.shared.w2(rt.swiglu(self.shared.w1(x), self.shared.w3(x)))
        return rt.reduce_from_tp(y + shared, self.tp)


def test_served_moe_equals_deepseek_v3_moe(case):
    """The serve program's MoE module (ep = 1, tp = 1), with the shared expert, = transformers'
    whole DeepseekV3MoE."""
    hf, x = case["hf"], case["x"]
    ours = _ServedMoE("layers.1.mlp", **_router_kw(case["norm"])).eval()
    _copy_from_hf(ours, hf, shared=True)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=1e-5)


def test_moe_layer_aux_loss_with_sigmoid_scores():
    """Training with an aux loss: its gradient reaches the router through the normalised
    sigmoid scores (a layer without it gives another router gradient)."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, H)
    grads = []
    for scale in (0.0, 0.5):
        layer = _moe_layer(True)
        layer.aux_loss_scale = scale
        layer.train()
        layer(x).sum().backward()
        grads.append(layer.router.weight.grad.clone())
    assert (grads[0] - grads[1]).abs().max() > 1e-4


def test_correction_bias_is_a_fixed_fp32_buffer_with_a_layout():
    from parcompile.runtime.state.weights import layout_tensors

    layer = _moe_layer(True)
    b = layer.router.e_score_correction_bias
    assert b.dtype == torch.float32 and b.shape == (E,) and not b.any()
    assert "router.e_score_correction_bias" in layer.state_dict()
    assert all(p is not b for p in layer.parameters())
    layer.to(dtype=torch.bfloat16)   # as a 16-bit program moves its stage
    b = layer.router.e_score_correction_bias
    assert b.dtype == torch.float32 and layer.router.weight.dtype == torch.bfloat16
    assert (b.global_name, b.global_shape, b.shard_dim, b.num_shards) == (
        "layers.1.mlp.router.e_score_correction_bias", (E,), None, 1)
    assert any(t is b for t in layout_tensors(layer))
    greedy = _RoutedExperts("m")
    assert greedy.router.e_score_correction_bias is None and "router.e_score_correction_bias" not in \
        greedy.state_dict()


def test_correction_bias_travels_through_dcp_checkpoints(tmp_path):
    from parcompile.runtime.state import checkpoint
    from parcompile.runtime.distributed.context import ParallelContext
    from parcompile.runtime.state.weights import load_dcp

    ctx = ParallelContext(0, 1, {}, torch.device("cpu"), None, distributed=False)
    a = _moe_layer(True)
    bias = torch.linspace(-0.5, 0.5, E)
    with torch.no_grad():
        a.router.e_score_correction_bias.copy_(bias)
    final = checkpoint.save(tmp_path / "ck", 3, a, None, ctx)
    from parcompile.runtime.state.hf_export import read_dcp_global

    assert torch.equal(read_dcp_global(final)["layers.1.mlp.router.e_score_correction_bias"], bias)
    b = _moe_layer(True)
    load_dcp(b, str(final), ctx)
    assert torch.equal(b.router.e_score_correction_bias, bias)
    assert torch.equal(b.router.weight, a.router.weight)


def test_hf_output_writes_the_bias_in_fp32():
    from parcompile.core.hf_weights import Source
    from parcompile.runtime.state.hf_export import _assemble

    name = "layers.1.mlp.router.e_score_correction_bias"
    bias = torch.tensor([0.1234567, -0.7654321])
    src = Source("model.layers.1.mlp.gate.e_score_correction_bias", (2,), ours=(2,))
    out = _assemble([(name, src)], {name: bias}, torch.bfloat16)
    assert out.dtype == torch.float32 and torch.equal(out, bias)
    w = _assemble([("layers.1.mlp.router.weight", src)], {"layers.1.mlp.router.weight": bias}, torch.bfloat16)
    assert w.dtype == torch.bfloat16


def test_route_takes_no_rank():
    """route() reads only its arguments: the same tokens route alike on any rank (ep, tp)."""
    import inspect

    params = list(inspect.signature(route).parameters)
    assert params == ["logits", "top_k", "norm_topk_prob", "scoring_func", "correction_bias", "n_group",
                      "topk_group", "routed_scaling_factor"]


# --------------------------------------------------------------------------- the spec's checks

MOE = {"experts": "16", "top_k": "4", "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": "4",
       "topk_group": "2", "routed_scaling_factor": "2.5"}
SP = {"sequence_parallel": "true"}


def test_deepseek_router_keys_are_valid():
    from parcompile.frontend import load_spec

    cfg, warnings = load_spec(spec(model=MOE, parallel=SP))
    assert warnings == []
    m = cfg.model
    assert (m.scoring_func, m.topk_method, m.n_group, m.topk_group, m.routed_scaling_factor) == (
        "sigmoid", "noaux_tc", 4, 2, 2.5)


def test_noaux_tc_needs_sigmoid():
    text = spec(model={**MOE, "scoring_func": "softmax"}, parallel=SP)
    message, help, note = one(text, "topk_method = noaux_tc")
    assert message == "topk_method = noaux_tc needs scoring_func = sigmoid, got scoring_func = softmax"
    assert help == "set scoring_func = sigmoid (DeepSeek-V3), or topk_method = greedy for a softmax router"


def test_n_group_must_divide_the_experts():
    text = spec(model={**MOE, "n_group": "3"}, parallel=SP)
    message, help, note = one(text, "n_group = 3")
    assert message == "n_group = 3 does not divide experts = 16"
    assert help == "n_group may be 1, 2, 4 or 8"   # groups of at least 2 experts (16: no)
    text = spec(model={**MOE, "n_group": "16", "topk_group": "4"}, parallel=SP)
    assert one(text, "n_group = 16")[0] == "n_group = 16 leaves experts(16) / n_group(16) = 1 expert per group"


def test_topk_group_at_most_n_group():
    text = spec(model={**MOE, "topk_group": "5"}, parallel=SP)
    assert one(text, "topk_group = 5")[:2] == ("topk_group = 5 exceeds n_group = 4",
                                               "topk_group may be 1 to 4 (the groups each token may choose from)")


def test_top_k_within_the_kept_groups():
    text = spec(model={**MOE, "top_k": "9"}, parallel=SP)
    message, help, note = one(text, "top_k = 9")
    assert message == ("top_k = 9 exceeds the experts of the kept groups: topk_group(2) * experts(16) / "
                       "n_group(4) = 8")
    assert help == "lower top_k to at most 8, or raise topk_group to 3"
    assert diags(spec(model={**MOE, "top_k": "8"}, parallel=SP)) == []


def test_groups_have_no_effect_with_greedy():
    text = spec(model={"experts": "16", "top_k": "4", "n_group": "4"}, parallel=SP)
    assert diags(text) == [("warning", "n_group = 4 has no effect with topk_method = greedy",
                            *where(text, "n_group = 4"),
                            "set topk_method = noaux_tc (DeepSeek-V3's group-limited routing), or remove `n_group`",
                            "the experts are chosen within groups only with topk_method = noaux_tc")]


@pytest.mark.parametrize("key, value, words", [("scoring_func", "sigmoid", "sigmoid"),
                                               ("topk_method", "noaux_tc", "noaux_tc"),
                                               ("n_group", "2", "2"), ("topk_group", "1", "1"),
                                               ("routed_scaling_factor", "2.5", "2.5")])
def test_router_keys_on_a_dense_model_warn(key, value, words):
    """As norm_topk_prob: a router key on a dense model is a warning (no effect), not an error."""
    text = spec(model={key: value})
    assert diags(text) == [("warning", f"{key} = {words} has no effect: experts = 0 makes a dense model",
                            *where(text, f"{key} = {value}"),
                            f"remove `{key}`, or set `experts` for a mixture-of-experts model", None)]


def test_bad_router_values_are_spanned():
    text = spec(model={**MOE, "scoring_func": "relu"}, parallel=SP)
    assert diags(text) == [("error", "unknown scoring_func `relu`", *where(text, "scoring_func = relu"),
                            "scoring_func may be `softmax` or `sigmoid`", None)]
    text = spec(model={**MOE, "routed_scaling_factor": "0"}, parallel=SP)
    assert diags(text) == [("error", "routed_scaling_factor must be positive, got `0`",
                            *where(text, "routed_scaling_factor = 0"), "use a number above 0", None)]


# --------------------------------------------------------------------------- plan and programs

ROUTER = dict(experts=8, top_k=2, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
              routed_scaling_factor=2.5, shared_experts=1, layers=2, dense_layers=1)
ARGS = "scoring_func='sigmoid', topk_method='noaux_tc', n_group=4, topk_group=2, routed_scaling_factor=2.5"


def test_plan_router_attributes_and_program_arguments(tmp_path):
    from parcompile.codegen.emit import render_program
    from parcompile.driver import compile_config
    from tests.program_utils import tiny_config

    cfg = tiny_config(model=ROUTER)
    plan = compile_config(cfg)
    node = plan.graph.node("layers.1.mlp.router")
    router = node.op
    assert (router.attr("scoring_func"), router.attr("topk_method"), router.attr("n_group"),
            router.attr("topk_group"), router.attr("routed_scaling_factor")) == ("sigmoid", "noaux_tc", 4, 2, 2.5)
    assert [p.name for p in node.params] == ["layers.1.mlp.router.weight"]   # the bias is a buffer
    assert ARGS in " ".join(render_program(cfg, plan).split())   # a long constructor wraps after commas
    plain = compile_config(tiny_config(model=dict(experts=8, top_k=2, layers=2)))
    attrs = plain.graph.node("layers.0.mlp.router").op.attr_map
    assert not {"scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor"} & set(attrs)
    assert "scoring_func" not in render_program(tiny_config(model=dict(experts=8, top_k=2, layers=2)), plain)
    greedy = compile_config(tiny_config(model=dict(experts=8, top_k=2, layers=2, n_group=4)))   # no effect
    assert "n_group" not in greedy.graph.node("layers.0.mlp.router").op.attr_map
    # the same parameters (the buffer is not one), and the router's extra traffic
    assert plan.data["model"]["params"] == compile_config(tiny_config(model={
        **ROUTER, "scoring_func": "softmax", "topk_method": "greedy", "n_group": 1, "topk_group": 1})).data[
        "model"]["params"]


def test_programs_describe_the_router_of_the_keys(tmp_path):
    """The training program's TOP_K comment and MoE docstring name the router it builds, as
    serve.py's EXPERTS_PER_TOKEN does (was: "softmax top-k router" above a sigmoid, group-limited
    one); a softmax router is still called so."""
    from parcompile.codegen.emit import render_program
    from parcompile.driver import compile_config
    from tests.program_utils import tiny_config

    cfg = tiny_config(model=ROUTER)
    text = render_program(cfg, compile_config(cfg))
    [top_k] = [ln for ln in text.splitlines() if ln.startswith("TOP_K = ")]
    doc = text[text.index("class MoE(nn.Module):"):text.index("def __init__", text.index("class MoE(nn.Module):"))]
    for words in (top_k, doc):
        assert "softmax" not in words and "sigmoid, within 2 of 4 groups, renormalised over the k" in words, words
    plain = tiny_config(model=dict(experts=8, top_k=2, layers=2))
    [top_k] = [ln for ln in render_program(plain, compile_config(plain)).splitlines() if ln.startswith("TOP_K = ")]
    assert "softmax, renormalised over the k" in top_k, top_k


def test_training_program_holds_the_router_of_the_keys(tmp_path):
    """The generated program's MoE layer holds the router of the keys and routes with it."""
    from parcompile import runtime as rt
    from parcompile.runtime.distributed.context import init_parallel
    from tests.program_utils import build_program, tiny_config

    module, plan = build_program(tiny_config(model=ROUTER), tmp_path)
    stage = module.Stage(plan, init_parallel(plan))
    [r] = [mod for mod in stage.modules() if isinstance(mod, rt.Router)]
    assert (r.scoring_func, r.topk_method, r.n_group, r.topk_group, r.routed_scaling_factor) == (
        "sigmoid", "noaux_tc", 4, 2, 2.5)
    assert r.e_score_correction_bias.global_name == "layers.1.mlp.router.e_score_correction_bias"


def test_serve_program_arguments_and_run(tmp_path):
    """serve.py builds the Router with the router's arguments, runs the routed experts op by op
    (dispatch, GroupedExperts, combine) and generates; its parameters are the plan's (the
    correction bias is a buffer, in neither)."""
    from tests.serve_utils import build_serve, run_in_process, serve_config

    cfg = serve_config(model=ROUTER, serve=dict(max_new_tokens=3))
    plan = build_serve(cfg, tmp_path)
    text = (tmp_path / "serve.py").read_text()
    assert ARGS in " ".join(text.split()) and "rt.Router(" in text   # (the call may wrap)
    assert "rt.dispatch(" in text and "rt.GroupedExperts(" in text and "rt.combine(" in text
    rec = run_in_process(tmp_path, ["--prompt-ids", "1,2,3,4"])
    assert rec["params"] == plan["stages"][0]["params_per_rank"]


def test_router_traffic_counts_the_choice():
    from parcompile.ir.ops import OPS
    from parcompile.ir.types import Dim, TensorType

    out = TensorType((Dim("b", 2), Dim("s", 4), Dim("experts", 8)), "fp32")
    x = TensorType((Dim("b", 2), Dim("s", 4), Dim("hidden", 16)), "fp32")
    traffic = OPS["router"].traffic
    assert traffic({"topk_method": "noaux_tc"}, [x], out) == 7 * out.nbytes
    assert traffic({}, [x], out) == 3 * out.nbytes == 3 * math.prod((2, 4, 8)) * 4


# --------------------------------------------------------------------------- ep under torchrun


def test_the_verify_miniature_keeps_the_router_and_groups_that_bind():
    """``parcompile verify``'s miniature of a DeepSeek-V3 router over ep keeps sigmoid scoring,
    the correction bias and groups that bind (4 experts in 2 groups, 1 kept, top 2); the
    equivalence under torchrun is tests/test_verify.py's ``deepseek_v3_tp2_pp2_ep2``."""
    from parcompile import verification as v
    from tests.program_utils import tiny_config

    cfg = tiny_config(2, 2, 1, model=dict(experts=8, top_k=2, scoring_func="sigmoid", topk_method="noaux_tc",
                                          n_group=4, topk_group=1, routed_scaling_factor=2.5),
                      parallel=dict(ep=2, sequence_parallel=True))
    m = v.miniature(cfg).model
    assert (m.experts, m.n_group, m.topk_group, m.top_k, m.routed_scaling_factor) == (4, 2, 1, 2, 2.5)
    assert (m.scoring_func, m.topk_method) == ("sigmoid", "noaux_tc")
