"""``schedule-pipeline``: the action list of every pipeline rank, checked by a simulator.

Actions (docs/internals.md) are ``{"op", "microbatch", "chunk"}`` with ``op`` in
``forward``, ``backward``, ``recv_forward``, ``send_forward``, ``recv_backward``,
``send_backward``; ``chunk`` is the rank's local chunk (model chunk ``chunk * pp + rank``).

* ``gpipe``: all forwards, then all backwards (torchtitan's ScheduleGPipe order); with
  virtual stages, breadth-first over the local chunks.
* ``1f1b``: PipeDream-Flush / Megatron's non-interleaved schedule: rank ``r`` runs
  ``min(pp - r - 1, m)`` warm-up forwards, then alternates one forward and one backward,
  then drains the backwards.
* ``interleaved_1f1b`` and ``zero_bubble`` are not supported yet (a SpecError at
  ``schedule``).

The simulator runs the lists with blocking receives and asynchronous sends, checks
every dependency (a forward has its input, a backward its forward and its output
gradient, every message is consumed) and reports a deadlock by rank and action. From
the cost model's op times it gives the makespan, the bubble fraction
``(makespan - busiest rank's compute) / busiest rank's compute`` (which is ``(p-1)/m``
for equal stages under GPipe and 1F1B) and the peak number of micro-batches whose
activations each rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

from parcompile.diagnostics import Diagnostic, SpecError
from parcompile.ir.graph import Graph
from parcompile.passes.base import PassContext

SUPPORTED = ("gpipe", "1f1b")

#: fraction of peak FLOP/s the cost model assumes matmuls achieve (stated in plan.json)
COMPUTE_EFFICIENCY = 0.5


class ScheduleError(RuntimeError):
    """An action list is inconsistent or deadlocks; names the rank and action."""


def _act(op: str, mb: int, chunk: int) -> dict:
    return {"op": op, "microbatch": mb, "chunk": chunk}


def _fwd_block(r: int, pp: int, v: int, mb: int, c: int) -> list[dict]:
    k, last = c * pp + r, pp * v - 1
    out = []
    if k > 0:
        out.append(_act("recv_forward", mb, c))
    out.append(_act("forward", mb, c))
    if k < last:
        out.append(_act("send_forward", mb, c))
    return out


def _bwd_block(r: int, pp: int, v: int, mb: int, c: int) -> list[dict]:
    k, last = c * pp + r, pp * v - 1
    out = []
    if k < last:
        out.append(_act("recv_backward", mb, c))
    out.append(_act("backward", mb, c))
    if k > 0:
        out.append(_act("send_backward", mb, c))
    return out


def build_actions(schedule: str, pp: int, m: int, virtual_stages: int = 1) -> list[list[dict]]:
    """Per pipeline rank, its ordered actions for one step of ``m`` micro-batches.

    Raises:
        NotImplementedError: ``schedule`` is not ``gpipe`` or ``1f1b``, or ``1f1b`` with
            virtual stages (that is the interleaved schedule).
    """
    v = virtual_stages
    out = []
    for r in range(pp):
        acts: list[dict] = []
        if schedule == "gpipe":
            for c in range(v):
                for mb in range(m):
                    acts += _fwd_block(r, pp, v, mb, c)
            for c in reversed(range(v)):
                for mb in range(m):
                    acts += _bwd_block(r, pp, v, mb, c)
        elif schedule == "1f1b" and v == 1:
            warm = min(pp - r - 1, m)
            for mb in range(warm):
                acts += _fwd_block(r, pp, 1, mb, 0)
            for i in range(m - warm):
                acts += _fwd_block(r, pp, 1, warm + i, 0)
                acts += _bwd_block(r, pp, 1, i, 0)
            for mb in range(m - warm, m):
                acts += _bwd_block(r, pp, 1, mb, 0)
        else:
            raise NotImplementedError(f"schedule {schedule} with virtual_stages = {v}")
        out.append(acts)
    return out


@dataclass(frozen=True)
class SimResult:
    """What the simulator found. Times in seconds; ``in_flight`` in micro-batches through
    all of a rank's layers (``Fraction`` when virtual stages make it fractional)."""

    makespan: float
    busy: tuple[float, ...]
    finish: tuple[float, ...]
    in_flight: tuple[Fraction, ...]

    @property
    def bubble_fraction(self) -> float:
        """Idle time of the busiest rank over its compute time."""
        c = max(self.busy)
        return (self.makespan - c) / c if c > 0 else 0.0


def simulate(actions: Sequence[Sequence[dict]], fwd_time: Sequence[float], bwd_time: Sequence[float],
             pp: int, virtual_stages: int = 1, num_microbatches: int | None = None,
             p2p_time: float = 0.0) -> SimResult:
    """Run the action lists (see module docstring).

    ``fwd_time[k]``/``bwd_time[k]``: seconds for one micro-batch through model chunk ``k``.
    ``p2p_time``: seconds from a send to its receive being satisfiable.

    Raises:
        ScheduleError: a missing dependency, a duplicate or missing action, or a deadlock.
    """
    v = virtual_stages
    last = pp * v - 1
    clock = [0.0] * pp
    busy = [0.0] * pp
    pos = [0] * pp
    msgs: dict[tuple[str, int, int], float] = {}   # (direction, mb, receiving model chunk) -> ready
    received: set[tuple[str, int, int]] = set()
    fwd_done: set[tuple[int, int]] = set()
    bwd_done: set[tuple[int, int]] = set()
    live = [Fraction(0)] * pp
    peak = [Fraction(0)] * pp
    total = sum(len(a) for a in actions)
    done = 0
    while done < total:
        progressed = False
        for r in range(pp):
            acts = actions[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                op, mb, c = a["op"], a["microbatch"], a["chunk"]
                k = c * pp + r
                where = f"pipeline rank {r} action {pos[r]} ({op} microbatch {mb} chunk {c})"
                if op in ("recv_forward", "recv_backward"):
                    key = ("f" if op == "recv_forward" else "b", mb, k)
                    if key not in msgs:
                        break  # blocked
                    clock[r] = max(clock[r], msgs.pop(key))
                    received.add(key)
                elif op == "forward":
                    if k > 0 and ("f", mb, k) not in received:
                        raise ScheduleError(f"{where}: input not received")
                    if (mb, k) in fwd_done:
                        raise ScheduleError(f"{where}: forward run twice")
                    received.discard(("f", mb, k))
                    fwd_done.add((mb, k))
                    clock[r] += fwd_time[k]
                    busy[r] += fwd_time[k]
                    live[r] += Fraction(1, v)
                    peak[r] = max(peak[r], live[r])
                elif op == "send_forward":
                    if k == last or (mb, k) not in fwd_done:
                        raise ScheduleError(f"{where}: nothing to send")
                    msgs[("f", mb, k + 1)] = clock[r] + p2p_time
                elif op == "backward":
                    if (mb, k) not in fwd_done:
                        raise ScheduleError(f"{where}: backward before forward")
                    if k < last and ("b", mb, k) not in received:
                        raise ScheduleError(f"{where}: output gradient not received")
                    if (mb, k) in bwd_done:
                        raise ScheduleError(f"{where}: backward run twice")
                    received.discard(("b", mb, k))
                    bwd_done.add((mb, k))
                    clock[r] += bwd_time[k]
                    busy[r] += bwd_time[k]
                    live[r] -= Fraction(1, v)
                elif op == "send_backward":
                    if k == 0 or (mb, k) not in bwd_done:
                        raise ScheduleError(f"{where}: nothing to send")
                    msgs[("b", mb, k - 1)] = clock[r] + p2p_time
                else:
                    raise ScheduleError(f"{where}: unknown action")
                pos[r] += 1
                done += 1
                progressed = True
        if not progressed:
            blocked = [f"rank {r} at {actions[r][pos[r]]}" for r in range(pp) if pos[r] < len(actions[r])]
            raise ScheduleError("pipeline schedule deadlocks: " + "; ".join(blocked))
    if msgs:
        raise ScheduleError(f"messages never received: {sorted(msgs)[:4]}")
    if num_microbatches is not None:
        want = {(mb, k) for mb in range(num_microbatches) for k in range(pp * v)}
        if fwd_done != want or bwd_done != want:
            raise ScheduleError("schedule does not run every micro-batch through every chunk once")
    return SimResult(max(clock), tuple(busy), tuple(clock), tuple(peak))


@dataclass(frozen=True)
class ScheduleReport:
    """The schedule of one step: name, ``m``, actions per rank, the simulation with the
    cost model's times (no p2p latency: communication is priced by the estimate)."""

    name: str
    num_microbatches: int
    actions: list[list[dict]]
    sim: SimResult
    fwd_time: tuple[float, ...]
    bwd_time: tuple[float, ...]

    @property
    def bubble_fraction(self) -> float:
        return self.sim.bubble_fraction

    @property
    def in_flight(self) -> list:
        return [int(x) if x.denominator == 1 else float(x) for x in self.sim.in_flight]


def chunk_times(chunk_fwd_flops: Sequence[int], chunk_recompute_flops: Sequence[int],
                peak_flops: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per model chunk, (forward, backward) seconds of one micro-batch: FLOPs at
    ``COMPUTE_EFFICIENCY * peak_flops``; backward = 2 x forward + recomputed forward."""
    rate = COMPUTE_EFFICIENCY * peak_flops
    f = tuple(x / rate for x in chunk_fwd_flops)
    b = tuple(2 * x / rate + y / rate for x, y in zip(chunk_fwd_flops, chunk_recompute_flops))
    return f, b


@dataclass(frozen=True)
class SchedulePipeline:
    """Build and simulate the schedule; stores a :class:`ScheduleReport` in
    ``graph.meta["schedule"]``. Needs ``graph.meta["compute"]`` (FLOPs per chunk) or
    computes it."""

    name: str = "schedule-pipeline"

    def apply(self, graph: Graph, ctx: PassContext) -> None:
        from parcompile.analysis.compute import compute_report

        cfg = ctx.cfg
        par = cfg.parallel
        if par.schedule not in SUPPORTED or (par.schedule == "1f1b" and par.virtual_stages > 1):
            what = par.schedule if par.schedule not in SUPPORTED else "1f1b with virtual_stages > 1"
            raise SpecError([Diagnostic(
                "error", f"schedule {what} is not supported yet",
                cfg.span("parallel.schedule"),
                help="use schedule = 1f1b or gpipe (gpipe runs virtual stages breadth-first)",
            )])
        m = par.num_microbatches
        comp = compute_report(graph, ctx.degrees, par.pp * par.virtual_stages, cfg.model.vocab,
                              cfg.model.padded_vocab(par.tp), m, par.recompute)
        graph.meta["compute"] = comp
        f, b = chunk_times(comp.chunk_fwd_flops, comp.chunk_recompute_flops, cfg.cluster.peak_flops)
        actions = build_actions(par.schedule, par.pp, m, par.virtual_stages)
        sim = simulate(actions, f, b, par.pp, par.virtual_stages, m)
        graph.meta["schedule"] = ScheduleReport(par.schedule, m, actions, sim, f, b)
