"""The simulated timeline of one training step: ``trace.json`` (Chrome trace event format,
opens in Perfetto or chrome://tracing) and ``timeline.svg`` (the picture in report.md).

The timeline is the plan's own pipeline schedule (``schedule.actions``) run by the
schedule simulator with the cost model's forward, backward and weight-gradient times per
model chunk (the schedule pass's, :meth:`parcompile.analysis.estimate.ChunkTimes.per_chunk`),
plus the point-to-point time of one activation message between stages (alpha-beta: the
link's latency plus bytes over the link's bandwidth, NVLink when the pipeline group stays
inside a node). One process row per pipeline rank, two tracks each:
compute (forward, backward, input/weight gradient) and communication (sends, and the
time a receive waits for its message).
"""

from __future__ import annotations

import json
from xml.sax.saxutils import escape

from parcompile.analysis.estimate import axis_link, collective_time
from parcompile.core.schedule import SimResult, simulate

COMPUTE_OPS = ("forward", "backward", "backward_input", "backward_weight")
LABEL = {"forward": "F", "backward": "B", "backward_input": "B", "backward_weight": "W",
         "send_forward": "send F", "send_backward": "send B", "recv_forward": "wait F", "recv_backward": "wait B"}
COLOUR = {"forward": "#4c78a8", "backward": "#54a24b", "backward_input": "#54a24b", "backward_weight": "#eeca3b",
          "send_forward": "#b279a2", "send_backward": "#b279a2", "recv_forward": "#bab0ac", "recv_backward": "#bab0ac"}


def p2p_seconds(plan) -> float:
    """Seconds for one activation message between adjacent stages: the largest pp send,
    timed by the network model (:func:`~parcompile.analysis.estimate.collective_time` on the
    pp groups' :func:`~parcompile.analysis.estimate.axis_link`)."""
    cfg, data = plan.config, plan.data
    sends = [c["bytes"] for c in data["comm"]["collectives"] if c["op"] == "send" and c["axis"] == "pp"]
    if not sends:
        return 0.0
    link = axis_link(cfg.cluster, data["groups"], "pp")
    return collective_time("send", max(sends), 2, link)


def timeline(plan) -> SimResult:
    """Simulate the plan's schedule with op times and p2p time (see module docstring)."""
    sched = plan.passes.schedule.report
    p = plan.config.parallel
    return simulate(sched.actions, sched.fwd_time, sched.bwd_time, p.pp, p.virtual_stages,
                    sched.num_microbatches, p2p_time=p2p_seconds(plan), wgrad_time=sched.wgrad_time or None,
                    placement=p.pipeline_schedule.placement)


def _us(t: float) -> float:
    return round(t * 1e6, 3)


def chrome_trace(plan, sim: SimResult | None = None) -> str:
    """``trace.json``: one process per pipeline rank, threads `compute` and `communication`.

    Timestamps are microseconds from the start of the step. Deterministic: one event a line.
    """
    sim = sim or timeline(plan)
    stages = plan.data["stages"]
    events: list[dict] = []
    for s in stages:
        r = s["index"]
        ranks = s["ranks"]
        shown = ", ".join(map(str, ranks[:8])) + (" ..." if len(ranks) > 8 else "")
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                       "args": {"name": f"pipeline rank {r} (ranks {shown})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}})
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 1, "args": {"name": "communication"}})
    for r, op, mb, c, start, end in sim.events:
        if end <= start and op not in COMPUTE_OPS:
            continue
        events.append({
            "ph": "X", "pid": r, "tid": 0 if op in COMPUTE_OPS else 1,
            "name": f"{LABEL[op]}{mb}" + (f".{c}" if plan.config.parallel.virtual_stages > 1 else ""),
            "cat": "compute" if op in COMPUTE_OPS else "communication",
            "ts": _us(start), "dur": _us(end - start), "args": {"op": op, "microbatch": mb, "chunk": c},
        })
    lines = ",\n".join(json.dumps(e, sort_keys=True) for e in events)
    meta = json.dumps({"makespan_s": sim.makespan, "bubble_fraction": sim.bubble_fraction,
                       "p2p_s": p2p_seconds(plan)}, sort_keys=True)
    return ('{"displayTimeUnit": "ms", "otherData": ' + meta + ',\n"traceEvents": [\n' + lines + "\n]}\n")


def timeline_svg(plan, sim: SimResult | None = None, width: int = 960) -> str:
    """``timeline.svg``: the same timeline as a picture, a row per pipeline rank."""
    sim = sim or timeline(plan)
    pp = plan.config.parallel.pp
    left, top, row_h, comm_h, gap = 110, 28, 26, 8, 10
    span = sim.makespan or 1.0
    scale = (width - left - 10) / span
    height = top + pp * (row_h + comm_h + gap) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="10">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="16" font-size="12">{escape(plan.config.name)}: {escape(plan.data["schedule"]["name"])}, '
           f'{plan.data["schedule"]["num_microbatches"]} micro-batches, step {span * 1e3:.3g} ms, '
           f'bubble {sim.bubble_fraction:.1%}</text>']
    for r in range(pp):
        y = top + r * (row_h + comm_h + gap)
        out.append(f'<text x="4" y="{y + row_h * 0.7:.1f}">pipeline rank {r}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{span * scale:.1f}" height="{row_h}" fill="#f4f4f4"/>')
    for r, op, mb, c, start, end in sim.events:
        if end <= start:
            continue
        y = top + r * (row_h + comm_h + gap)
        x, w = left + start * scale, max((end - start) * scale, 0.5)
        if op in COMPUTE_OPS:
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h}" fill="{COLOUR[op]}" '
                       f'stroke="white" stroke-width="0.5"><title>{LABEL[op]} micro-batch {mb} chunk {c}</title></rect>')
            if w > 14:
                out.append(f'<text x="{x + w / 2:.1f}" y="{y + row_h * 0.65:.1f}" text-anchor="middle" '
                           f'fill="white">{LABEL[op]}{mb}</text>')
        else:
            out.append(f'<rect x="{x:.1f}" y="{y + row_h + 1}" width="{w:.1f}" height="{comm_h - 2}" '
                       f'fill="{COLOUR[op]}"><title>{LABEL[op]} micro-batch {mb}</title></rect>')
    y = top + pp * (row_h + comm_h + gap) + 12
    x = left
    for name, colour in (("forward", COLOUR["forward"]), ("backward / input grad", COLOUR["backward"]),
                         ("weight grad", COLOUR["backward_weight"]), ("send", COLOUR["send_forward"]),
                         ("waiting for a receive", COLOUR["recv_forward"])):
        out.append(f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{x + 14}" y="{y}">{name}</text>')
        x += 24 + 6 * len(name)
    out.append("</svg>")
    return "\n".join(out) + "\n"
