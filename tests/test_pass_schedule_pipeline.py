import pytest

from parcompile.diagnostics import SpecError
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
    cfg = spec(pp=2, global_batch=4)
    g, _ = run_until(cfg, "schedule-pipeline")
    s = g.meta["schedule"]
    assert s.num_microbatches == 4 and len(s.actions) == 2
    assert all(b == pytest.approx(2 * f) for f, b in zip(s.fwd_time, s.bwd_time))
    assert s.in_flight == [2, 1]


@pytest.mark.parametrize("name", ["interleaved_1f1b", "zero_bubble"])
def test_unsupported_schedules_are_spec_errors(name):
    cfg = spec(tiny_model(layers=8), pp=2, virtual_stages=2 if name.startswith("inter") else 1,
               schedule=name, global_batch=4)
    with pytest.raises(SpecError) as e:
        run_until(cfg, "schedule-pipeline")
    assert "not supported yet" in str(e.value)
