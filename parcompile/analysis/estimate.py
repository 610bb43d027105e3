"""Step-time estimate (SPEC 3 `estimate`). Approximate by design; the assumptions are
written into plan.json (``estimate.assumptions``).

* Compute: each chunk's matmul FLOPs at ``COMPUTE_EFFICIENCY`` of ``peak_flops``;
  backward = 2 x forward + recomputed forward. Non-matmul ops cost nothing.
* Communication, alpha-beta per message under ring algorithms, group of ``n``:
  all-reduce ``2(n-1) (alpha + bytes/(n beta))``, all-gather / all-to-all
  ``(n-1)(alpha + bytes/(n beta))``, reduce-scatter ``(n-1)(alpha + bytes/beta)``
  (bytes = its output shard), send ``alpha + bytes/beta``. ``beta``/``alpha`` are the
  intra-node link when a group of the axis fits in one node, else the inter-node one.
  Nothing overlaps with compute (an upper bound).
* Tensor/context/expert-parallel collectives lengthen each micro-batch's op times; the
  pipeline schedule is simulated with those times (bubble) and again with the p2p time
  of a stage boundary as message latency (``pp_comm`` = the difference); the step
  collectives (gradients, norms) follow the pipeline (``dp_comm``).

``step_time = makespan + dp_comm``; ``breakdown`` adds up to it: compute + tp_comm +
cp_comm + ep_comm (the busiest rank's work) + bubble + pp_comm + dp_comm.
``tokens_per_s = global_batch * seq_len / step_time``;
``tflops_per_gpu = model_flops_per_step / (step_time * world_size) / 1e12``;
``mfu = tflops_per_gpu * 1e12 / peak_flops``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from parcompile.analysis.comm import AXIS_FAMILY, CommReport
from parcompile.passes.schedule_pipeline import COMPUTE_EFFICIENCY, ScheduleReport, simulate


@dataclass(frozen=True)
class TimeReport:
    """Seconds per step and the rates derived from it (module docstring)."""

    step_time: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    breakdown: dict[str, float]
    assumptions: dict[str, object] = field(default_factory=dict)


def _link(cluster, groups: Mapping[str, list[list[int]]], axis: str) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) for ``axis``: intra-node when its first group fits in one node."""
    gs = groups.get(axis) or [[0]]
    nodes = {r // cluster.gpus_per_node for r in gs[0]}
    if len(nodes) <= 1:
        return cluster.intra_node_latency, cluster.intra_node_bw
    return cluster.inter_node_latency, cluster.inter_node_bw


def collective_time(op: str, nbytes: int, n: int, alpha: float, beta: float) -> float:
    """Seconds for one collective (module docstring); 0 for a group of one and for recv."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) * (alpha + nbytes / (n * beta))
    if op in ("all_gather", "all_to_all"):
        return (n - 1) * (alpha + nbytes / (n * beta))
    if op == "reduce_scatter":
        return (n - 1) * (alpha + nbytes / beta)
    if op == "send":
        return alpha + nbytes / beta
    return 0.0


def estimate(cfg, degrees: Mapping[str, int], groups: Mapping[str, list[list[int]]], sched: ScheduleReport,
             comm: CommReport, model_flops_per_step: int) -> TimeReport:
    """Build the :class:`TimeReport` for ``cfg`` (a SpecConfig)."""
    par, cl = cfg.parallel, cfg.cluster
    pp, v = par.pp, par.virtual_stages
    nchunks = pp * v
    links = {a: _link(cl, groups, a) for a in AXIS_FAMILY}

    def t(c) -> float:
        al, be = links.get(c.axis, (cl.intra_node_latency, cl.intra_node_bw))
        return collective_time(c.op, c.bytes, degrees.get(c.axis, 1), al, be)

    fam_f = [dict.fromkeys(("tp", "cp", "ep"), 0.0) for _ in range(nchunks)]
    fam_b = [dict.fromkeys(("tp", "cp", "ep"), 0.0) for _ in range(nchunks)]
    p2p = 0.0
    for stage, chunk, c in comm.raw:
        fam = AXIS_FAMILY.get(c.axis, c.axis)
        if fam == "pp":
            if c.op == "send":
                p2p = max(p2p, t(c))
            continue
        if fam not in fam_f[chunk]:
            continue
        target = fam_f if c.phase == "forward" else fam_b
        target[chunk][fam] += t(c)
        if c.phase == "forward" and par.recompute == "full":
            fam_b[chunk][fam] += t(c)
    f = [sched.fwd_time[k] + sum(fam_f[k].values()) for k in range(nchunks)]
    b = [sched.bwd_time[k] + sum(fam_b[k].values()) for k in range(nchunks)]
    m = sched.num_microbatches
    sim0 = simulate(sched.actions, f, b, pp, v)
    sim1 = simulate(sched.actions, f, b, pp, v, p2p_time=p2p) if pp > 1 else sim0
    r = max(range(pp), key=lambda i: (sim0.busy[i], -i))
    chunks_r = [c * pp + r for c in range(v)]
    compute = m * sum(sched.fwd_time[k] + sched.bwd_time[k] for k in chunks_r)
    per_fam = {fam: m * sum(fam_f[k][fam] + fam_b[k][fam] for k in chunks_r) for fam in ("tp", "cp", "ep")}
    bubble = sim0.makespan - sim0.busy[r]
    pp_comm = sim1.makespan - sim0.makespan
    step_colls = [e for e in comm.collectives if e.phase == "step"]
    dp_comm = 0.0
    for s in range(pp):
        tot = 0.0
        for e in step_colls:
            if e.stage == s:
                al, be = links.get(e.axis, (cl.intra_node_latency, cl.intra_node_bw))
                tot += e.count * collective_time(e.op, e.bytes, degrees.get(e.axis, 1), al, be)
        dp_comm = max(dp_comm, tot)
    step = sim1.makespan + dp_comm
    tokens = par.global_batch * cfg.model.seq_len
    tflops = model_flops_per_step / (step * par.world_size) / 1e12 if step > 0 else 0.0
    return TimeReport(
        step_time=step,
        tokens_per_s=tokens / step if step > 0 else 0.0,
        tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / cl.peak_flops,
        breakdown={"compute": compute, "tp_comm": per_fam["tp"], "cp_comm": per_fam["cp"],
                   "ep_comm": per_fam["ep"], "bubble": bubble, "pp_comm": pp_comm, "dp_comm": dp_comm},
        assumptions={"compute_efficiency": COMPUTE_EFFICIENCY, "overlap": "none",
                     "collectives": "ring, alpha-beta", "non_matmul_ops": "free"},
    )
