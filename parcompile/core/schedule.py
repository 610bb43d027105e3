"""Pipeline schedules: the action list of every pipeline rank, and the simulator that checks
and times them (the ground floor: standard library only; the ``schedule-pipeline`` pass,
:mod:`parcompile.passes.schedule_pipeline`, builds them for a graph).

Actions (docs/internals.md) are ``{"op", "microbatch", "chunk"}`` with ``op`` in
``forward``, ``backward`` (input and weight gradients), ``backward_input`` and
``backward_weight`` (the two halves of a backward, zero-bubble schedules only),
``recv_forward``, ``send_forward``, ``recv_backward``, ``send_backward``; ``chunk`` is
the rank's local chunk (model chunk ``chunk * pp + rank``).

* ``gpipe``: all forwards, then all backwards (torchtitan's ScheduleGPipe order); with
  virtual stages, breadth-first over the local chunks.
* ``1f1b``: PipeDream-Flush / Megatron's non-interleaved schedule: rank ``r`` runs
  ``min(pp - r - 1, m)`` warm-up forwards, then alternates one forward and one backward,
  then drains the backwards.
* ``interleaved_1f1b``: Megatron-LM's interleaved schedule (Narayanan et al. 2021, and
  Megatron-Core's ``forward_backward_pipelining_with_interleaving``): micro-batches run in
  rounds of ``N`` (``parallel.microbatch_group_size``, Megatron-Core's
  ``--microbatch-group-size-per-virtual-pipeline-stage``, default ``pp``): each round runs
  its ``N`` micro-batches through local chunk 0, then chunk 1, ..., forward, and the same
  rounds with the chunks reversed backward (``get_schedule_table``; the last round takes
  what is left). Rank ``r`` warms up with ``2 (pp - r - 1) + (v - 1) N`` forwards
  (``get_pp_rank_microbatches``), then alternates: a larger ``N`` keeps more micro-batches
  in flight, ``N = pp`` (depth-first) the fewest. Megatron-Core needs ``pp <= N <= m`` and
  ``m % N`` either 0 or at least ``pp`` (:func:`group_error`). Source: NVIDIA/Megatron-LM
  ``megatron/core/pipeline_parallel/schedules.py`` and ``megatron/core/model_parallel_config.py``
  at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553.
* ``zero_bubble``: ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): each
  backward is split into B (input gradient, on the critical path) and W (weight
  gradient, deferrable). The order is found by list-scheduling the cost model's F, B
  and W times: a free rank runs a ready B first, else a forward while fewer than
  ``pp - r`` micro-batches are between F and B on it (1F1B's activation bound), else a
  deferred W; at most ``pp - r - 1`` W's wait at once, and the rest drain at the end.

The simulator runs the lists with blocking receives and asynchronous sends, checks
every dependency (a forward has its input, a backward its forward and its output
gradient, every message is consumed) and reports a deadlock by rank and action. From
the cost model's op times (the seconds of each model chunk's forward, backward and weight
gradient, :class:`parcompile.analysis.estimate.ChunkTimes`; this module takes them as
numbers) it gives the makespan, the bubble fraction
``(makespan - busiest rank's compute) / busiest rank's compute`` (which is ``(p-1)/m`` for
equal stages under GPipe and 1F1B) and the peak number of micro-batches whose activations
each rank holds.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

#: the schedules SPEC 1 ``parallel.schedule`` names
SUPPORTED = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


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


def _bwd_block(r: int, pp: int, v: int, mb: int, c: int, op: str = "backward") -> list[dict]:
    k, last = c * pp + r, pp * v - 1
    out = []
    if k < last:
        out.append(_act("recv_backward", mb, c))
    out.append(_act(op, mb, c))
    if k > 0:
        out.append(_act("send_backward", mb, c))
    return out


def group_error(pp: int, m: int, group: int) -> str | None:
    """Why Megatron-Core refuses interleaved 1F1B rounds of ``group`` micro-batches on ``pp``
    ranks with ``m`` micro-batches, or None when it runs them: ``pp <= group <= m``, and
    the last round (``m % group`` micro-batches) empty or at least ``pp`` long (shorter
    leaves dependency bubbles). Megatron-LM ``megatron/core/pipeline_parallel/schedules.py``
    (``forward_backward_pipelining_with_interleaving``'s ValueError and RuntimeError),
    commit d98e8a64ddf34856e74b24714e3bedb2f5a39553."""
    if group < pp:
        return f"microbatch_group_size = {group} is below pp = {pp}"
    if group > m:
        return f"microbatch_group_size = {group} is above the {m} micro-batches per step"
    last = m % group
    if 0 < last < pp:
        return (f"the last round holds m({m}) % microbatch_group_size({group}) = {last} micro-batches, "
                f"fewer than pp = {pp}")
    return None


def interleaved_warmup(r: int, pp: int, v: int, m: int, group: int | None = None) -> int:
    """Forwards rank ``r`` runs before its first backward under interleaved 1F1B with
    rounds of ``group`` micro-batches (None: ``pp``): ``2 (pp - r - 1) + (v - 1) group``,
    at most all ``m v`` (Megatron-Core's ``get_pp_rank_microbatches``, module docstring).
    The one rule :func:`build_actions` orders by and the closed-form in-flight count
    (:func:`parcompile.analysis.memory.closed_form_in_flight`) reads."""
    n = pp if group is None else group
    return min(2 * (pp - r - 1) + (v - 1) * n, m * v)


def _interleaved_table(v: int, m: int, group: int) -> list[tuple[int, int]]:
    """(microbatch, local chunk) of each forward in order: rounds of ``group`` micro-batches,
    each through chunk 0, ..., v - 1; the last round takes every micro-batch left
    (Megatron-Core's ``get_schedule_table``)."""
    table: list[tuple[int, int]] = []
    for lo in range(0, m, group):
        hi = m if lo + group >= m else lo + group
        table += [(mb, c) for c in range(v) for mb in range(lo, hi)]
    return table


def _interleaved_order(r: int, pp: int, v: int, m: int, group: int | None = None) -> list[tuple[str, int, int]]:
    """Rank ``r``'s compute order under Megatron's interleaved 1F1B: (F|B, microbatch, chunk).

    The ``i``-th forward runs ``_interleaved_table``'s entry ``i``, the ``i``-th backward the
    same micro-batch on the mirrored chunk ``v - 1 - c``.
    """
    total = m * v
    table = _interleaved_table(v, m, pp if group is None else group)
    fwd = [("F", mb, c) for mb, c in table]
    bwd = [("B", mb, v - 1 - c) for mb, c in table]
    warm = interleaved_warmup(r, pp, v, m, group)
    order = fwd[:warm]
    for k in range(total - warm):
        order += [fwd[warm + k], bwd[k]]
    return order + bwd[total - warm:]


def _zero_bubble_order(pp: int, m: int, f: Sequence[float], b: Sequence[float],
                       w: Sequence[float]) -> list[list[tuple[str, int, int]]]:
    """ZB-H1 compute orders of every rank (see module docstring), one chunk per rank.

    A discrete-event list scheduler: ``f[r]``, ``b[r]``, ``w[r]`` are the F, B and W times
    of rank r's chunk; messages arrive when the producing op ends.
    """
    order: list[list[tuple[str, int, int]]] = [[] for _ in range(pp)]
    next_f = [0] * pp
    between = [0] * pp          # micro-batches after F, before B
    pending_w: list[list[int]] = [[] for _ in range(pp)]
    fwd_in: list[dict[int, float]] = [dict() for _ in range(pp)]   # mb -> arrival of its input
    grad_in: list[dict[int, float]] = [dict() for _ in range(pp)]  # mb -> arrival of its output grad
    done_b = [0] * pp
    waiting = [False] * pp
    clock = [0.0] * pp
    heap = [(0.0, r) for r in range(pp)]
    for r in range(pp):
        if r == 0:
            for mb in range(m):
                fwd_in[0][mb] = 0.0

    def post(r: int, box: list[dict[int, float]], mb: int, t: float) -> None:
        box[r][mb] = t
        if waiting[r]:
            waiting[r] = False
            heapq.heappush(heap, (max(t, clock[r]), r))

    while heap:
        t, r = heapq.heappop(heap)
        clock[r] = t
        ready_b = sorted(mb for mb, at in grad_in[r].items() if at <= t)
        mb_f = next_f[r]
        can_f = mb_f < m and fwd_in[r].get(mb_f, float("inf")) <= t and between[r] < pp - r
        if ready_b:
            mb = ready_b[0]
            del grad_in[r][mb]
            order[r].append(("Bi", mb, 0))
            between[r] -= 1
            done_b[r] += 1
            end = t + b[r]
            if r > 0:
                post(r - 1, grad_in, mb, end)
            pending_w[r].append(mb)
            if len(pending_w[r]) > pp - r - 1:  # keep at most pp - r - 1 deferred W's
                order[r].append(("W", pending_w[r].pop(0), 0))
                end += w[r]
            heapq.heappush(heap, (end, r))
        elif can_f:
            del fwd_in[r][mb_f]
            order[r].append(("F", mb_f, 0))
            next_f[r] += 1
            between[r] += 1
            end = t + f[r]
            if r < pp - 1:
                post(r + 1, fwd_in, mb_f, end)
            else:
                grad_in[r][mb_f] = end   # the last stage's loss gives its own output gradient
            heapq.heappush(heap, (end, r))
        elif pending_w[r] and done_b[r] < m and not any(t < at < t + w[r] for at in grad_in[r].values()):
            # fill idle time with a deferred W, unless an announced B would have to wait for it
            order[r].append(("W", pending_w[r].pop(0), 0))
            heapq.heappush(heap, (t + w[r], r))
        elif done_b[r] < m:
            future = [at for at in list(grad_in[r].values()) + [fwd_in[r].get(mb_f, float("inf"))] if at > t]
            if future and min(future) < float("inf"):
                heapq.heappush(heap, (min(future), r))
            else:
                waiting[r] = True
        else:
            order[r] += [("W", mb, 0) for mb in pending_w[r]]
            pending_w[r] = []
    return order


def _blocks(order: list[tuple[str, int, int]], r: int, pp: int, v: int) -> list[dict]:
    """Wrap a compute order with its receives and sends."""
    acts: list[dict] = []
    for kind, mb, c in order:
        if kind == "F":
            acts += _fwd_block(r, pp, v, mb, c)
        elif kind == "B":
            acts += _bwd_block(r, pp, v, mb, c)
        elif kind == "Bi":
            acts += _bwd_block(r, pp, v, mb, c, op="backward_input")
        else:
            acts.append(_act("backward_weight", mb, c))
    return acts


def build_actions(schedule: str, pp: int, m: int, virtual_stages: int = 1,
                  times: tuple[Sequence[float], Sequence[float], Sequence[float]] | None = None,
                  group: int | None = None) -> list[list[dict]]:
    """Per pipeline rank, its ordered actions for one step of ``m`` micro-batches.

    ``times`` (F, B, W seconds per model chunk) orders the ``zero_bubble`` schedule; it
    defaults to equal times (F = B = W). ``group``: the interleaved schedule's rounds
    (``parallel.microbatch_group_size``; None: ``pp``, Megatron-Core's default); other
    schedules ignore it.

    Raises:
        NotImplementedError: ``1f1b`` with virtual stages (that is the interleaved
            schedule), or ``zero_bubble`` with virtual stages.
        ValueError: an interleaved ``group`` Megatron-Core refuses (:func:`group_error`).
    """
    v = virtual_stages
    if schedule == "interleaved_1f1b":
        if group is not None and (why := group_error(pp, m, group)):
            raise ValueError(why)
        return [_blocks(_interleaved_order(r, pp, v, m, group), r, pp, v) for r in range(pp)]
    if schedule == "zero_bubble":
        if v != 1:
            raise NotImplementedError(f"schedule zero_bubble with virtual_stages = {v}")
        f, b, w = times if times is not None else ([1.0] * pp, [1.0] * pp, [1.0] * pp)
        return [_blocks(o, r, pp, 1) for r, o in enumerate(_zero_bubble_order(pp, m, f, b, w))]
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
    #: every action as it ran: (rank, op, microbatch, chunk, start s, end s); a receive
    #: spans the time the rank waited for its message, a send the p2p time
    events: tuple[tuple[int, str, int, int, float, float], ...] = ()

    @property
    def bubble_fraction(self) -> float:
        """Idle time of the busiest rank over its compute time."""
        c = max(self.busy)
        return (self.makespan - c) / c if c > 0 else 0.0


def _where(r: int, i: int, op: str, mb: int, c: int) -> str:
    return f"pipeline rank {r} action {i} ({op} microbatch {mb} chunk {c})"


def simulate(actions: Sequence[Sequence[dict]], fwd_time: Sequence[float], bwd_time: Sequence[float],
             pp: int, virtual_stages: int = 1, num_microbatches: int | None = None,
             p2p_time: float = 0.0, wgrad_time: Sequence[float] | None = None,
             chunk_bytes: Sequence[int] | None = None) -> SimResult:
    """Run the action lists (see module docstring).

    ``fwd_time[k]``/``bwd_time[k]``: seconds for one micro-batch through model chunk ``k``
    (the backward with both gradients). ``wgrad_time[k]``: the weight-gradient part of
    it (default: ``fwd_time[k]``, the matmuls' weight-gradient FLOPs equal their forward
    FLOPs); ``backward_input`` takes the rest. ``p2p_time``: seconds from a send to its
    receive being satisfiable. ``chunk_bytes[k]``: what one micro-batch keeps for backward
    in model chunk ``k`` (bytes; default: the same for every chunk); the result's
    ``in_flight`` is :func:`in_flight` of the action lists (a rank's live activations depend
    on the order of its own actions only, not on the times).

    Raises:
        ScheduleError: a missing dependency, a duplicate or missing action, or a deadlock.
    """
    v = virtual_stages
    last = pp * v - 1
    wgrad = list(wgrad_time) if wgrad_time is not None else list(fwd_time)
    wgrad_done: set[tuple[int, int]] = set()
    split: set[tuple[int, int]] = set()     # backward_input done, backward_weight owed
    clock = [0.0] * pp
    busy = [0.0] * pp
    pos = [0] * pp
    msgs: dict[tuple[str, int, int], float] = {}   # (direction, mb, receiving model chunk) -> ready
    received: set[tuple[str, int, int]] = set()
    fwd_done: set[tuple[int, int]] = set()
    bwd_done: set[tuple[int, int]] = set()
    events: list[tuple[int, str, int, int, float, float]] = []
    total = sum(len(a) for a in actions)
    done = 0
    received_add, received_discard = received.add, received.discard
    fwd_add, bwd_add, wgrad_add, events_append = fwd_done.add, bwd_done.add, wgrad_done.add, events.append
    while done < total:
        progressed = False
        for r in range(pp):
            acts = actions[r]
            n, i = len(acts), pos[r]
            if i >= n:
                continue
            # this rank's state in locals while it runs (written back when it blocks or ends)
            t, bz = clock[r], busy[r]
            while i < n:
                a = acts[i]
                op, mb, c = a["op"], a["microbatch"], a["chunk"]
                k = c * pp + r
                start = t
                if op == "recv_forward" or op == "recv_backward":
                    key = ("f" if op == "recv_forward" else "b", mb, k)
                    if key not in msgs:
                        break  # blocked
                    t = max(t, msgs.pop(key))
                    received_add(key)
                elif op == "forward":
                    if k > 0 and ("f", mb, k) not in received:
                        raise ScheduleError(f"{_where(r, i, op, mb, c)}: input not received")
                    if (mb, k) in fwd_done:
                        raise ScheduleError(f"{_where(r, i, op, mb, c)}: forward run twice")
                    received_discard(("f", mb, k))
                    fwd_add((mb, k))
                    t += fwd_time[k]
                    bz += fwd_time[k]
                elif op == "send_forward":
                    if k == last or (mb, k) not in fwd_done:
                        raise ScheduleError(f"{_where(r, i, op, mb, c)}: nothing to send")
                    msgs[("f", mb, k + 1)] = t + p2p_time
                elif op == "backward" or op == "backward_input":
                    if (mb, k) not in fwd_done:
                        raise ScheduleError(f"{_where(r, i, op, mb, c)}: backward before forward")
                    if k < last and ("b", mb, k) not in received:
                        raise ScheduleError(f"{_where(r, i, op, mb, c)}: output gradient not received")
                    if (mb, k) in bwd_done:
                        raise ScheduleError(f"{_where(r, i, op, mb, c)}: backward run twice")
                    received_discard(("b", mb, k))
                    bwd_add((mb, k))
                    if op == "backward":
                        d = bwd_time[k]
                        wgrad_add((mb, k))
                    else:
                        d = bwd_time[k] - wgrad[k]
                        split.add((mb, k))
                    t += d
                    bz += d
                elif op == "backward_weight":
                    if (mb, k) not in split:
                        raise ScheduleError(f"{_where(r, i, op, mb, c)}: weight gradient before its input gradient")
                    split.discard((mb, k))
                    wgrad_add((mb, k))
                    t += wgrad[k]
                    bz += wgrad[k]
                elif op == "send_backward":
                    if k == 0 or (mb, k) not in bwd_done:
                        raise ScheduleError(f"{_where(r, i, op, mb, c)}: nothing to send")
                    msgs[("b", mb, k - 1)] = t + p2p_time
                else:
                    raise ScheduleError(f"{_where(r, i, op, mb, c)}: unknown action")
                events_append((r, op, mb, c, start, t + p2p_time if op.startswith("send") else t))
                i += 1
                done += 1
                progressed = True
            pos[r], clock[r], busy[r] = i, t, bz
        if not progressed:
            blocked = [f"rank {r} at {actions[r][pos[r]]}" for r in range(pp) if pos[r] < len(actions[r])]
            raise ScheduleError("pipeline schedule deadlocks: " + "; ".join(blocked))
    if msgs:
        raise ScheduleError(f"messages never received: {sorted(msgs)[:4]}")
    if split:
        raise ScheduleError(f"weight gradients never computed: {sorted(split)[:4]}")
    if num_microbatches is not None:
        want = {(mb, k) for mb in range(num_microbatches) for k in range(pp * v)}
        if fwd_done != want or bwd_done != want or wgrad_done != want:
            raise ScheduleError("schedule does not run every micro-batch through every chunk once")
    return SimResult(max(clock), tuple(busy), tuple(clock), in_flight(actions, pp, v, chunk_bytes), tuple(events))


def in_flight(actions: Sequence[Sequence[dict]], pp: int, virtual_stages: int = 1,
              chunk_bytes: Sequence[int] | None = None) -> tuple[Fraction, ...]:
    """Per pipeline rank, the peak over its action list of what its forwards not yet
    backwarded keep, in units of one micro-batch through all of the rank's chunks (the
    plan's ``schedule.in_flight``). A forward of model chunk ``k`` adds ``chunk_bytes[k]``,
    its backward (or ``backward_input``) takes it away; without ``chunk_bytes`` every chunk
    weighs the same, and the peak is the count of such forwards over ``virtual_stages``.
    Chunks of unlike sizes (an uneven ``stage_layers``, a layer-less first or last chunk)
    need the bytes: in an interleaved schedule a rank's first chunks hold more micro-batches
    than its last ones. A rank whose chunks keep nothing counts forwards. Depends on each
    rank's own order only, so :func:`simulate` and the closed-form costing (the search,
    :func:`parcompile.analysis.memory.memory_from_parts`) share it."""
    v = virtual_stages
    weight = [int(x) for x in chunk_bytes] if chunk_bytes is not None else [1] * (pp * v)
    out = []
    for r in range(pp):
        w = {c: weight[c * pp + r] for c in range(v)}
        whole = sum(w.values())
        if whole <= 0:
            w, whole = {c: 1 for c in range(v)}, v
        live = peak = 0
        for a in actions[r]:
            op = a["op"]
            if op == "forward":
                live += w[a["chunk"]]
                peak = max(peak, live)
            elif op == "backward" or op == "backward_input":
                live -= w[a["chunk"]]
        out.append(Fraction(peak, whole))
    return tuple(out)


@dataclass(frozen=True)
class ScheduleReport:
    """The schedule of one step: name, ``m``, actions per rank, and their simulation with
    the cost model's chunk times (the estimate's, without the pipeline's p2p time, which
    the estimate adds). ``fwd_time[k]``, ``bwd_time[k]`` (the whole backward) and
    ``wgrad_time[k]`` (its weight-gradient part): seconds of one micro-batch through model
    chunk ``k``, as :func:`simulate` takes them (``wgrad_time`` empty: ``fwd_time``)."""

    name: str
    num_microbatches: int
    actions: list[list[dict]]
    sim: SimResult
    fwd_time: tuple[float, ...]
    bwd_time: tuple[float, ...]
    wgrad_time: tuple[float, ...] = ()

    @property
    def bubble_fraction(self) -> float:
        """The simulation's bubble fraction (:attr:`SimResult.bubble_fraction`)."""
        return self.sim.bubble_fraction

    @property
    def in_flight(self) -> list:
        """Per pipeline rank, the peak micro-batches held (ints, floats where fractional)."""
        return [int(x) if x.denominator == 1 else float(x) for x in self.sim.in_flight]
