from fractions import Fraction

import pytest

from parcompile.analysis.estimate import chunk_times, efficiency
from parcompile.core.groups import rank_groups
from parcompile.passes.base import PassError
from parcompile.passes.schedule_pipeline import ScheduleError, build_actions, simulate
from tests.plan_factories import run_until, spec, tiny_model


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (3, 7), (4, 1)])
def test_equal_stages_bubble_is_p_minus_1_over_m(name, p, m):
    acts = build_actions(name, p, m)
    sim = simulate(acts, [1.0] * p, [2.0] * p, p, num_microbatches=m)
    assert sim.bubble_fraction == pytest.approx((p - 1) / m)
    assert sim.makespan == pytest.approx((m + p - 1) * 3.0)


def test_in_flight_peaks():
    p, m = 4, 8
    one = simulate(build_actions("1f1b", p, m), [1] * p, [2] * p, p)
    assert list(one.in_flight) == [min(p - r, m) for r in range(p)]
    gp = simulate(build_actions("gpipe", p, m), [1] * p, [2] * p, p)
    assert list(gp.in_flight) == [m] * p


def test_action_format():
    acts = build_actions("1f1b", 2, 2)
    # rank 0 of 2: one warm-up forward, then one forward / one backward, then drain
    assert acts[0] == [
        {"op": "forward", "microbatch": 0, "chunk": 0},
        {"op": "send_forward", "microbatch": 0, "chunk": 0},
        {"op": "forward", "microbatch": 1, "chunk": 0},
        {"op": "send_forward", "microbatch": 1, "chunk": 0},
        {"op": "recv_backward", "microbatch": 0, "chunk": 0},
        {"op": "backward", "microbatch": 0, "chunk": 0},
        {"op": "recv_backward", "microbatch": 1, "chunk": 0},
        {"op": "backward", "microbatch": 1, "chunk": 0},
    ]
    assert acts[1][:3] == [
        {"op": "recv_forward", "microbatch": 0, "chunk": 0},
        {"op": "forward", "microbatch": 0, "chunk": 0},
        {"op": "backward", "microbatch": 0, "chunk": 0},
    ]
    assert acts[1][3] == {"op": "send_backward", "microbatch": 0, "chunk": 0}


def test_gpipe_with_virtual_stages_simulates():
    p, v, m = 2, 2, 3
    acts = build_actions("gpipe", p, m, v)
    sim = simulate(acts, [1.0] * (p * v), [2.0] * (p * v), p, v, num_microbatches=m)
    assert sim.makespan > 0


def test_deadlock_and_missing_dependencies_are_reported():
    acts = build_actions("1f1b", 2, 2)
    # rank 0 waits for a gradient before sending anything forward: deadlock
    bad = [[a for a in acts[0] if a["op"] != "send_forward"] , acts[1]]
    bad[0].insert(0, {"op": "recv_backward", "microbatch": 0, "chunk": 0})
    with pytest.raises(ScheduleError, match="deadlock|received"):
        simulate(bad, [1, 1], [2, 2], 2)
    swapped = [list(acts[0]), list(acts[1])]
    swapped[1] = [a for a in swapped[1] if not (a["op"] == "recv_forward" and a["microbatch"] == 1)]
    with pytest.raises(ScheduleError):
        simulate(swapped, [1, 1], [2, 2], 2)


def test_pass_stores_schedule_from_the_cost_model():
    """One compute-time model (issue 17): the schedule's chunk times are the estimate's,
    here derived from the chunk's FLOPs and bytes by hand (tp = 1: no collective on a chunk,
    no recomputation; issue 19's terms: GEMM operand and weight bytes, the causal fused
    attention kernel and its exponentials, the engine's elementwise traffic)."""
    cfg = spec(pp=2, global_batch=4)
    g, ctx = run_until(cfg, "schedule-pipeline")
    s = ctx.results.schedule.report
    assert s.num_microbatches == 4 and len(s.actions) == 2
    comp, cl, eff = ctx.results.schedule.compute, cfg.cluster, efficiency(cfg.cluster)
    bw = eff.memory * cl.hbm_bw
    for k in range(2):
        gemm = ((comp.chunk_fwd_flops[k] - comp.chunk_attn_flops[k]) / (eff.matmul * cl.peak_flops)   # arithmetic
                + (comp.chunk_gemm_traffic[k] + comp.chunk_weight_traffic[k]) / bw)               # operands, weights
        attn = ((comp.chunk_attn_work[k] + eff.softmax_dim * comp.chunk_attn_scores[k])
                / (eff.attention * cl.peak_flops * (1 + eff.softmax_dim / 128)))     # fused kernel at head dim 128
        mem = comp.chunk_fwd_traffic[k] / bw    # memory-bound kernels (megatron: the fused count)
        assert gemm > 0 and attn > 0 and mem > 0
        assert s.fwd_time[k] == pytest.approx(gemm + attn + mem, rel=1e-12)
        assert s.bwd_time[k] == pytest.approx(2 * (gemm + attn) + 1.5 * mem, rel=1e-12)   # backward traffic 3 / 2
        assert s.wgrad_time[k] == pytest.approx(gemm, rel=1e-12)   # the weighted matmuls again
    assert s.in_flight == [2, 1]


def test_zero_bubble_is_ordered_by_the_estimates_chunk_times():
    """The compiled zero-bubble order is the one the estimate's chunk times give (what the
    search simulates), not one of a second time model: rebuilt here from chunk_times."""
    cfg = spec(tiny_model(layers=8), pp=4, tp=2, global_batch=16, schedule="zero_bubble")
    g, ctx = run_until(cfg, "schedule-pipeline")
    s = ctx.results.schedule.report
    ct = chunk_times(cfg, ctx.degrees, rank_groups(cfg.parallel), ctx.results.schedule.compute,
                     ctx.results.schedule.comm)
    f = [ct.matmul_f[k] + ct.memory_f[k] + sum(c[k] for c in ct.comm_f.values()) for k in range(4)]
    w = list(ct.matmul_f)
    b = [2 * ct.matmul_f[k] + 1.5 * ct.memory_f[k] + ct.recompute[k] + sum(c[k] for c in ct.comm_b.values())
         for k in range(4)]
    assert any(c[0] > 0 for c in ct.comm_f.values())   # tp = 2: the collectives are in the times
    assert list(s.fwd_time) == pytest.approx(f) and list(s.bwd_time) == pytest.approx(b)
    assert s.actions == build_actions("zero_bubble", 4, 16, times=(f, [bi - wi for bi, wi in zip(b, w)], w))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (2, 2, 2), (4, 2, 4)])
def test_interleaved_bubble_is_p_minus_1_over_v_m(p, v, m):
    """Narayanan et al. 2021: the interleaved schedule's bubble is (p - 1) / (v m)."""
    acts = build_actions("interleaved_1f1b", p, m, v)
    sim = simulate(acts, [1.0 / v] * (p * v), [2.0 / v] * (p * v), p, v, num_microbatches=m)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m))


def test_interleaved_warmup_follows_megatron():
    """Rank r warms up with 2 (p - r - 1) + (v - 1) p forwards before its first backward."""
    p, v, m = 4, 2, 8
    acts = build_actions("interleaved_1f1b", p, m, v)
    for r in range(p):
        compute = [a["op"] for a in acts[r] if a["op"] in ("forward", "backward")]
        assert compute.index("backward") == 2 * (p - r - 1) + (v - 1) * p + 1  # + the first steady forward
    # local chunk 0 runs micro-batches 0..p-1 before chunk 1 starts (groups of p)
    fwd = [(a["microbatch"], a["chunk"]) for a in acts[0] if a["op"] == "forward"]
    assert fwd[:6] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1)]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (3, 5), (4, 2)])
def test_zero_bubble_beats_1f1b_at_the_same_memory(p, m):
    f, b = [1.0] * p, [2.0] * p   # B and W take one unit each
    zb = simulate(build_actions("zero_bubble", p, m, times=(f, [1.0] * p, [1.0] * p)), f, b, p,
                  num_microbatches=m)
    one = simulate(build_actions("1f1b", p, m), f, b, p, num_microbatches=m)
    assert list(zb.in_flight) == list(one.in_flight)           # ZB-H1: 1F1B's activation memory
    if m >= p:
        assert zb.bubble_fraction < one.bubble_fraction
    ops = {a["op"] for r in build_actions("zero_bubble", p, m) for a in r}
    assert {"backward_input", "backward_weight"} <= ops and "backward" not in ops


def test_weight_gradient_before_input_gradient_is_reported():
    acts = build_actions("zero_bubble", 2, 2)
    bad = [list(acts[0]), list(acts[1])]
    i = next(k for k, a in enumerate(bad[1]) if a["op"] == "backward_weight")
    w = bad[1].pop(i)
    bad[1].insert(0, w)
    with pytest.raises(ScheduleError, match="weight gradient before"):
        simulate(bad, [1, 1], [2, 2], 2)


def test_virtual_stages_need_the_interleaved_schedule():
    """The user's rule is the checks table's (tests/test_checks.py); an unchecked config
    that reaches the pass anyway is a bug, reported as the pass's failure."""
    cfg = spec(tiny_model(layers=8), pp=2, virtual_stages=2, schedule="zero_bubble", global_batch=4)
    with pytest.raises(PassError, match="pass schedule-pipeline failed: NotImplementedError: schedule zero_bubble"):
        run_until(cfg, "schedule-pipeline")


def test_in_flight_weighs_chunks_of_unlike_sizes():
    """Issue 29: with a layer-less end chunk a rank's chunks keep unlike bytes, and the
    micro-batches in flight are weighed by them. pp 2, v 2, m 4, interleaved 1F1B. Rank 1
    runs F(mb0, local 0) F(mb1, 0) F(mb0, 1) B(mb0, 1) F(mb1, 1) B(mb1, 1) F(mb2, 0)
    B(mb0, 0) ...; with its local chunk 1 (model chunk 3, output only) keeping 0 bytes and
    local chunk 0 keeping 10, three forwards of chunk 0 are outstanding after F(mb2, 0):
    30 of its 10 + 0 bytes per micro-batch, 3 micro-batches (counting forwards: 3 / 2).
    Rank 0 (1 and 10 bytes): F F (2) then F(mb0, 1) F(mb1, 1) (22) and F(mb2, 0) (23)."""
    acts = build_actions("interleaved_1f1b", 2, 4, 2)
    even = simulate(acts, [1] * 4, [2] * 4, 2, 2, 4)
    assert list(even.in_flight) == [Fraction(5, 2), Fraction(3, 2)]
    same = simulate(acts, [1] * 4, [2] * 4, 2, 2, 4, chunk_bytes=[7, 7, 7, 7])
    assert same.in_flight == even.in_flight and same.makespan == even.makespan
    weighed = simulate(acts, [1] * 4, [2] * 4, 2, 2, 4, chunk_bytes=[1, 10, 10, 0])
    assert list(weighed.in_flight) == [Fraction(23, 11), Fraction(3)]
    assert weighed.makespan == even.makespan


def test_layer_less_last_chunk_plans_the_activations_its_rank_keeps():
    """The plan's activations of the rank holding an output-only last chunk are its layers'
    bytes per micro-batch times the forwards of its layered chunk outstanding at once (read
    off its action list), plus the output layer's once."""
    from parcompile.driver import compile_config
    cfg = spec(tiny_model(layers=3), pp=2, virtual_stages=2, schedule="interleaved_1f1b",
               stage_layers=(0, 2, 1, 0), micro_batch=1, global_batch=4)
    plan = compile_config(cfg)
    acts = plan.data["schedule"]["actions"][1]
    live = peak = 0
    for a in acts:
        if a["chunk"] == 0:          # local chunk 0 of rank 1: model chunk 1, layers 0 and 1
            live += {"forward": 1, "backward": -1}.get(a["op"], 0)
            peak = max(peak, live)
    assert peak == 3
    mem = plan.data["memory"]["per_stage"][1]
    body = sum(b for _, b in mem["activations_per_layer"])    # layers 0 and 1, one micro-batch
    assert plan.data["schedule"]["in_flight"][1] == peak
    # the three micro-batches' layer bytes, plus the output layer's (less than one more body);
    # counting forwards over both local chunks would plan 3 / 2 micro-batches
    assert peak * body <= mem["activations"] < (peak + 1) * body


# Megatron-Core's rounds of N micro-batches per virtual stage (--microbatch-group-size-per-
# virtual-pipeline-stage): NVIDIA/Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553,
# megatron/core/model_parallel_config.py (the field's docstring) and
# megatron/core/pipeline_parallel/schedules.py (get_schedule_table, get_pp_rank_microbatches,
# the range checks of forward_backward_pipelining_with_interleaving).

def _forward_microbatches(acts):
    return [a["microbatch"] for a in acts if a["op"] == "forward"]


def test_interleaved_rounds_follow_megatron_cores_documented_order():
    # the docstring's two examples, PP 2 VP 2: "rank 0 | 0 1 0 1 2 3 2 3" (N 2, m 4) and
    # "rank 0 | 0 1 2 0 1 2 3 4 3 4" (N 3, m 5); the backward runs the same rounds, chunks reversed
    assert _forward_microbatches(build_actions("interleaved_1f1b", 2, 4, 2, group=2)[0]) == [0, 1, 0, 1, 2, 3, 2, 3]
    acts = build_actions("interleaved_1f1b", 2, 5, 2, group=3)
    for r in range(2):
        assert _forward_microbatches(acts[r]) == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
        fwd = [(a["microbatch"], a["chunk"]) for a in acts[r] if a["op"] == "forward"]
        bwd = [(a["microbatch"], a["chunk"]) for a in acts[r] if a["op"] == "backward"]
        assert bwd == [(mb, 1 - c) for mb, c in fwd]
    # the default (None) is N = pp
    assert build_actions("interleaved_1f1b", 4, 8, 2) == build_actions("interleaved_1f1b", 4, 8, 2, group=4)


@pytest.mark.parametrize("p,v,m", [(2, 2, 5), (2, 3, 7), (4, 2, 10), (4, 2, 12), (3, 2, 8)])
def test_interleaved_rounds_warm_up_and_in_flight(p, v, m):
    """Every round size Megatron-Core accepts runs without deadlock; rank r runs
    2 (p - r - 1) + (v - 1) N forwards before its first backward (get_pp_rank_microbatches), so
    its peak in flight is that plus one chunk-forward, over v; the bubble stays (p - 1) / (v m)
    with equal chunks and no p2p time."""
    from parcompile.analysis.memory import closed_form_in_flight
    from parcompile.core.schedule import group_error
    groups = [n for n in range(1, m + 1) if group_error(p, m, n) is None]
    assert groups and min(groups) >= p and m in groups     # below pp Megatron-Core refuses
    peaks = []
    for n in groups:
        acts = build_actions("interleaved_1f1b", p, m, v, group=n)
        sim = simulate(acts, [1.0 / v] * (p * v), [2.0 / v] * (p * v), p, v, num_microbatches=m)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m))
        for r in range(p):
            ops = [a["op"] for a in acts[r] if a["op"] in ("forward", "backward")]
            warm = min(2 * (p - r - 1) + (v - 1) * n, m * v)
            assert ops.index("backward") == min(warm + 1, m * v)   # then one forward, one backward
            assert sim.in_flight[r] == Fraction(min(warm + 1, m * v), v)
        assert list(sim.in_flight) == closed_form_in_flight("interleaved_1f1b", p, v, m, n)
        peaks.append(sim.in_flight[0])
    assert peaks == sorted(peaks)     # larger rounds keep more in flight: N = pp the fewest


def test_interleaved_rounds_outside_megatron_cores_range_are_refused():
    from parcompile.core.schedule import group_error
    assert "below pp" in group_error(4, 8, 3)
    assert "above" in group_error(4, 8, 9)
    assert "last round" in group_error(4, 10, 7)     # 10 % 7 = 3 < pp 4
    assert "last round" in group_error(2, 5, 4)      # 5 % 4 = 1 < pp 2: dependency bubbles
    assert group_error(2, 5, 3) is None and group_error(4, 12, 8) is None
    with pytest.raises(ValueError, match="below pp"):
        build_actions("interleaved_1f1b", 4, 8, 2, group=2)
    # why: rounds below pp deadlock in Megatron's order (rank 0 waits for a chunk-1 input
    # that the last rank sends only after rank 0's own later work)
    from parcompile.core import schedule as S
    acts = [S._blocks(S._interleaved_order(r, 4, 2, 8, 2), r, 4, 2) for r in range(4)]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(acts, [1.0] * 8, [2.0] * 8, 4, 2, num_microbatches=8)


def test_larger_interleaved_rounds_hide_p2p_time():
    # what Meta's tunable N is for (Llama 3 paper section 3.3.2): with a p2p time per message,
    # rounds longer than pp leave the next round's input time to arrive
    p, v, m = 4, 2, 12
    span = {n: simulate(build_actions("interleaved_1f1b", p, m, v, group=n), [0.5] * 8, [1.0] * 8, p, v,
                        num_microbatches=m, p2p_time=0.2).makespan for n in (4, 6)}
    assert span[6] < span[4]


def test_compiled_plan_runs_the_specs_rounds():
    """A spec's microbatch_group_size reaches the pass's action lists, the simulated in-flight
    counts (= the closed form the memory plan reads) and plan.json."""
    from parcompile.analysis.memory import closed_form_in_flight
    from parcompile.driver import compile_config
    cfg = spec(tiny_model(layers=8), pp=2, global_batch=5, micro_batch=1, schedule="interleaved_1f1b",
               virtual_stages=2, microbatch_group_size=3)
    _, ctx = run_until(cfg, "schedule-pipeline")
    s = ctx.results.schedule.report
    assert s.actions == build_actions("interleaved_1f1b", 2, 5, 2, group=3) != build_actions(
        "interleaved_1f1b", 2, 6, 2)
    assert list(s.sim.in_flight) == closed_form_in_flight("interleaved_1f1b", 2, 2, 5, 3)
    plan = compile_config(cfg)
    assert plan.data["schedule"]["microbatch_group_size"] == 3
    assert plan.data["schedule"]["in_flight"] == [float(x) if x.denominator > 1 else int(x)
                                                  for x in closed_form_in_flight("interleaved_1f1b", 2, 2, 5, 3)]
