"""trace.json and timeline.svg: the plan's own schedule, timed by the cost model."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from parcompile.analysis.trace import COMPUTE_OPS, p2p_seconds
from parcompile.driver import compile_config
from tests.program_utils import tiny_config


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)])
def test_trace_follows_the_planned_actions(schedule, v):
    cfg = tiny_config(1, 1, 2, model=dict(layers=8),
                      parallel=dict(schedule=schedule, virtual_stages=v, global_batch=8))
    plan = compile_config(cfg)
    trace = json.loads(plan.trace_json())
    sched = plan.passes.schedule.report
    for r, actions in enumerate(plan.data["schedule"]["actions"]):
        planned = [(a["op"], a["microbatch"], a["chunk"]) for a in actions if a["op"] in COMPUTE_OPS]
        ran = sorted((e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == r and e["tid"] == 0),
                     key=lambda e: e["ts"])
        assert [(e["args"]["op"], e["args"]["microbatch"], e["args"]["chunk"]) for e in ran] == planned
        for e in ran:   # forwards and weight gradients last as long as the cost model says
            k = e["args"]["chunk"] * 2 + r
            if e["args"]["op"] == "forward":
                assert e["dur"] == pytest.approx(sched.fwd_time[k] * 1e6, abs=1e-3)
            elif e["args"]["op"] == "backward_weight":
                assert sched.wgrad_time[k] < sched.fwd_time[k]   # the matmuls only, not the memory-bound kernels
                assert e["dur"] == pytest.approx(sched.wgrad_time[k] * 1e6, abs=1e-3)
        starts = [e["ts"] for e in ran]
        ends = [e["ts"] + e["dur"] for e in ran]
        assert all(s >= prev - 1e-3 for s, prev in zip(starts[1:], ends)), "compute overlaps on one rank"
    sends = [e for e in trace["traceEvents"] if e.get("args", {}).get("op") == "send_forward"]
    assert sends and all(e["dur"] == pytest.approx(p2p_seconds(plan) * 1e6, abs=1e-3) for e in sends)
    assert trace["otherData"]["makespan_s"] >= max(e["ts"] + e["dur"] for e in ran) / 1e6 - 1e-9


def test_timeline_svg_is_valid_and_names_every_rank():
    plan = compile_config(tiny_config(1, 1, 4, parallel=dict(schedule="zero_bubble")))
    root = ET.fromstring(plan.timeline_svg())
    text = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert all(f"pipeline rank {r}" in text for r in range(4)) and "bubble" in text
    assert plan.timeline_svg() == plan.timeline_svg()
