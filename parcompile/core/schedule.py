"""Pipeline schedules: the action list of every pipeline rank, and the simulator that checks
and times them (the ground floor: standard library only; the ``schedule-pipeline`` pass,
:mod:`parcompile.passes.schedule_pipeline`, builds them for a graph).

Actions (docs/internals.md) are ``{"op", "microbatch", "chunk"}`` with ``op`` in
``forward``, ``backward`` (input and weight gradients), ``backward_input`` and
``backward_weight`` (the two halves of a backward, zero-bubble schedules only),
``recv_forward``, ``send_forward``, ``recv_backward``, ``send_backward``; ``chunk`` is
the rank's local chunk (model chunk ``chunk * pp + rank`` under the ``loop`` placement,
:class:`Placement`).

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

@dataclass(frozen=True)
class Placement:
    """Which pipeline rank holds each model chunk: torch.distributed.pipelining's stage-to-rank
    "style" (``generate_stage_to_rank_mapping`` in ``torch/distributed/pipelining/_utils.py``,
    pytorch/pytorch commit cf30153c4c131c8164ee7798e5022d810682e2cb, torch 2.13.0; torchtitan
    0.3.0 ``torchtitan/distributed/pipeline_parallel.py`` ``_get_pp_rank_to_stage_indices_mapping``
    picks ``v`` for ScheduleZBVZeroBubble and ScheduleDualPipeV, ``loop`` for the rest).

    * ``loop``: model chunk ``k`` on rank ``k % pp`` (Megatron-Core's interleaved
      assignment; local chunk ``c`` of rank ``r`` is model chunk ``c * pp + r``).
    * ``v``: the chunks snake down and back up the ranks, so rank ``r`` holds chunks ``r`` and
      ``2 pp - 1 - r`` (the V of ZBV and DualPipeV); the last model chunk is on rank 0.

    Either way local chunk ``c`` is the ``c``-th lap over the ranks (``k // pp``). Ranks and
    chunks are 0-based ints; ``pp`` the pipeline degree, ``v`` the chunks per rank.
    """

    name: str
    #: odd laps run the ranks backwards (``v``)
    mirrored: bool = False

    def rank(self, k: int, pp: int) -> int:
        """The pipeline rank holding model chunk ``k``."""
        lap, i = divmod(k, pp)
        return pp - 1 - i if self.mirrored and lap % 2 else i

    @staticmethod
    def local(k: int, pp: int) -> int:
        """Model chunk ``k``'s local chunk index on its rank."""
        return k // pp

    def chunk(self, r: int, c: int, pp: int) -> int:
        """The model chunk local chunk ``c`` of rank ``r`` holds."""
        return c * pp + (pp - 1 - r if self.mirrored and c % 2 else r)

    def chunks(self, r: int, pp: int, v: int) -> tuple[int, ...]:
        """Rank ``r``'s model chunks in local order (``v`` of them)."""
        return tuple(self.chunk(r, c, pp) for c in range(v))

    def ranks(self, pp: int, v: int) -> tuple[int, ...]:
        """The rank of every model chunk, in model order (``pp * v`` entries)."""
        return tuple(self.rank(k, pp) for k in range(pp * v))

    def layers(self, r: int, chunk_layers: Sequence[Sequence[int]], pp: int) -> list[list[int]]:
        """Rank ``r``'s layer ids per local chunk, from ``chunk_layers`` (the layer ids of each
        model chunk in model order, :func:`parcompile.passes.split_pipeline_stages.chunk_layers`)."""
        return [list(chunk_layers[k]) for k in self.chunks(r, pp, len(chunk_layers) // pp)]


LOOP = Placement("loop")
V = Placement("v", mirrored=True)
PLACEMENTS = {p.name: p for p in (LOOP, V)}


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule (SPEC 1 ``parallel.schedule``), as a value: look one up from the
    spec's name with :func:`lookup` and pass it on; every reader asks it, not its name.

    ``virtual_stages``: the chunks per rank it runs (None: ``parallel.virtual_stages``, any);
    ``rounds``: Megatron-Core's interleaved rounds (``microbatch_group_size``, the warm-up of
    :func:`interleaved_warmup`, ``overlap_p2p_comm``); ``split_backward``: each backward split
    into an input-gradient and a weight-gradient action (zero-bubble); ``forwards_first``:
    every forward of the step before any backward (GPipe: every micro-batch's activations
    held at once). Its action lists are :func:`build_actions`'s.
    """

    name: str
    placement: Placement = LOOP
    virtual_stages: int | None = 1
    rounds: bool = False
    split_backward: bool = False
    forwards_first: bool = False

    def closed_form_in_flight(self, r: int, pp: int, v: int, m: int, group: int | None = None) -> Fraction:
        """Peak micro-batches (through all of rank ``r``'s chunks) whose activations the rank
        keeps, from the schedule's warm-up: all ``m`` when forwards run first, interleaved
        1F1B's warm-up forwards and the one that starts the steady state (``v`` chunks each,
        :func:`interleaved_warmup`), else 1F1B's ``pp - r`` (the activation bound ZB-H1 keeps
        too); at most ``m``. What the simulator finds for these schedules."""
        if self.forwards_first:
            return Fraction(m)
        if self.rounds and v > 1:
            return Fraction(min(interleaved_warmup(r, pp, v, m, group) + 1, m * v), v)
        return Fraction(min(pp - r, m))


#: the schedules SPEC 1 ``parallel.schedule`` names, by name
SCHEDULES = {s.name: s for s in (
    Schedule("gpipe", forwards_first=True),
    Schedule("1f1b"),
    Schedule("interleaved_1f1b", virtual_stages=None, rounds=True),
    Schedule("zero_bubble", split_backward=True),
)}
SUPPORTED = tuple(SCHEDULES)


def as_schedule(schedule: "Schedule | str") -> Schedule:
    """``schedule`` itself, or the :class:`Schedule` its name names (:func:`lookup`)."""
    return lookup(schedule) if isinstance(schedule, str) else schedule


def lookup(name: str) -> Schedule:
    """The :class:`Schedule` SPEC 1 ``parallel.schedule = name`` names.

    Raises:
        ValueError: no schedule has that name (the spec's checks refuse it first)."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; one of {', '.join(SCHEDULES)}") from None


class ScheduleError(RuntimeError):
    """An action list is inconsistent or deadlocks; names the rank and action."""


def _act(op: str, mb: int, chunk: int) -> dict:
    return {"op": op, "microbatch": mb, "chunk": chunk}


def _fwd_block(r: int, pp: int, v: int, mb: int, c: int, place: Placement) -> list[dict]:
    k, last = place.chunk(r, c, pp), pp * v - 1
    out = []
    if k > 0:
        out.append(_act("recv_forward", mb, c))
    out.append(_act("forward", mb, c))
    if k < last:
        out.append(_act("send_forward", mb, c))
    return out


def _bwd_block(r: int, pp: int, v: int, mb: int, c: int, place: Placement, op: str = "backward") -> list[dict]:
    k, last = place.chunk(r, c, pp), pp * v - 1
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


def _blocks(order: list[tuple[str, int, int]], r: int, pp: int, v: int, place: Placement = LOOP) -> list[dict]:
    """Wrap a compute order with its receives and sends."""
    acts: list[dict] = []
    for kind, mb, c in order:
        if kind == "F":
            acts += _fwd_block(r, pp, v, mb, c, place)
        elif kind == "B":
            acts += _bwd_block(r, pp, v, mb, c, place)
        elif kind == "Bi":
            acts += _bwd_block(r, pp, v, mb, c, place, op="backward_input")
        else:
            acts.append(_act("backward_weight", mb, c))
    return acts


def _gpipe_order(r: int, pp: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """Rank ``r``'s compute order under GPipe: every forward, chunk by chunk (breadth-first
    over the local chunks, torch's ScheduleLoopedBFS with ``v > 1``), then every backward,
    the chunks reversed."""
    return ([("F", mb, c) for c in range(v) for mb in range(m)]
            + [("B", mb, c) for c in reversed(range(v)) for mb in range(m)])


def _one_f_one_b_order(r: int, pp: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """Rank ``r``'s compute order under 1F1B (module docstring), one chunk per rank."""
    if v != 1:
        raise NotImplementedError(f"schedule 1f1b with virtual_stages = {v}")
    warm = min(pp - r - 1, m)
    order = [("F", mb, 0) for mb in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i, 0), ("B", i, 0)]
    return order + [("B", mb, 0) for mb in range(m - warm, m)]


def _orders(sched: "Schedule", pp: int, m: int, v: int, times, group: int | None) -> list[list[tuple[str, int, int]]]:
    """Every rank's compute order (F, B, Bi, W; microbatch; local chunk) under ``sched``."""
    if sched.rounds:
        if group is not None and (why := group_error(pp, m, group)):
            raise ValueError(why)
        return [_interleaved_order(r, pp, v, m, group) for r in range(pp)]
    if sched.split_backward:
        if v != 1:
            raise NotImplementedError(f"schedule {sched.name} with virtual_stages = {v}")
        f, b, w = times if times is not None else ([1.0] * pp, [1.0] * pp, [1.0] * pp)
        return _zero_bubble_order(pp, m, f, b, w)
    step = _gpipe_order if sched.forwards_first else _one_f_one_b_order
    return [step(r, pp, v, m) for r in range(pp)]


def build_actions(schedule: "Schedule | str", pp: int, m: int, virtual_stages: int = 1,
                  times: tuple[Sequence[float], Sequence[float], Sequence[float]] | None = None,
                  group: int | None = None) -> list[list[dict]]:
    """Per pipeline rank, its ordered actions for one step of ``m`` micro-batches.

    ``schedule``: a :class:`Schedule` (or its name, looked up with :func:`lookup`); its
    placement says which rank holds each model chunk, so where each receive and send
    goes. ``times`` (F, B, W seconds per model chunk) orders the ``zero_bubble`` schedule;
    it defaults to equal times (F = B = W). ``group``: the interleaved schedule's rounds
    (``parallel.microbatch_group_size``; None: ``pp``, Megatron-Core's default); other
    schedules ignore it.

    Raises:
        NotImplementedError: ``1f1b`` with virtual stages (that is the interleaved
            schedule), or ``zero_bubble`` with virtual stages.
        ValueError: an interleaved ``group`` Megatron-Core refuses (:func:`group_error`),
            or a name no schedule has.
    """
    sched = as_schedule(schedule)
    v = virtual_stages
    return [_blocks(o, r, pp, v, sched.placement) for r, o in enumerate(_orders(sched, pp, m, v, times, group))]


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


class _Run:
    """The simulator's state: what every rank has done and what is in transit."""

    def __init__(self, pp: int, v: int, place: Placement, fwd_time, bwd_time, wgrad, p2p_time: float):
        self.pp, self.last, self.place, self.p2p = pp, pp * v - 1, place, p2p_time
        self.fwd_time, self.bwd_time, self.wgrad = fwd_time, bwd_time, wgrad
        self.clock, self.busy, self.pos = [0.0] * pp, [0.0] * pp, [0] * pp
        self.msgs: dict[tuple[str, int, int], float] = {}   # (direction, mb, receiving model chunk) -> ready
        self.received: set[tuple[str, int, int]] = set()
        self.fwd_done: set[tuple[int, int]] = set()
        self.bwd_done: set[tuple[int, int]] = set()
        self.wgrad_done: set[tuple[int, int]] = set()
        self.split: set[tuple[int, int]] = set()     # backward_input done, backward_weight owed
        self.events: list[tuple[int, str, int, int, float, float]] = []

    def advance(self, r: int, acts: Sequence[dict]) -> int:
        """Run rank ``r``'s actions until one blocks or none is left; returns how many ran.
        Raises ScheduleError on a broken dependency (:func:`simulate`)."""
        n, i0 = len(acts), self.pos[r]
        i, t, bz = i0, self.clock[r], self.busy[r]   # this rank's state in locals while it runs
        pp, last, p2p, chunk = self.pp, self.last, self.p2p, self.place.chunk
        msgs, received, fwd_done, bwd_done = self.msgs, self.received, self.fwd_done, self.bwd_done
        events_append, fwd_time = self.events.append, self.fwd_time
        while i < n:
            a = acts[i]
            op, mb, c = a["op"], a["microbatch"], a["chunk"]
            k = chunk(r, c, pp)
            start = t
            if op == "recv_forward" or op == "recv_backward":
                key = ("f" if op == "recv_forward" else "b", mb, k)
                if key not in msgs:
                    break  # blocked
                t = max(t, msgs.pop(key))
                received.add(key)
            elif op == "forward":
                if k > 0 and ("f", mb, k) not in received:
                    raise ScheduleError(f"{_where(r, i, op, mb, c)}: input not received")
                if (mb, k) in fwd_done:
                    raise ScheduleError(f"{_where(r, i, op, mb, c)}: forward run twice")
                received.discard(("f", mb, k))
                fwd_done.add((mb, k))
                d = fwd_time[k]
                t, bz = t + d, bz + d
            elif op == "send_forward":
                if k == last or (mb, k) not in fwd_done:
                    raise ScheduleError(f"{_where(r, i, op, mb, c)}: nothing to send")
                msgs[("f", mb, k + 1)] = t + p2p
            elif op == "backward" or op == "backward_input" or op == "backward_weight":
                d = self._backward(r, i, op, mb, c, k)
                t, bz = t + d, bz + d
            elif op == "send_backward":
                if k == 0 or (mb, k) not in bwd_done:
                    raise ScheduleError(f"{_where(r, i, op, mb, c)}: nothing to send")
                msgs[("b", mb, k - 1)] = t + p2p
            else:
                raise ScheduleError(f"{_where(r, i, op, mb, c)}: unknown action")
            events_append((r, op, mb, c, start, t + p2p if op.startswith("send") else t))
            i += 1
        self.pos[r], self.clock[r], self.busy[r] = i, t, bz
        return i - i0

    def _backward(self, r: int, i: int, op: str, mb: int, c: int, k: int) -> float:
        """Check and record a backward, input-gradient or weight-gradient action; its seconds."""
        if op == "backward_weight":
            if (mb, k) not in self.split:
                raise ScheduleError(f"{_where(r, i, op, mb, c)}: weight gradient before its input gradient")
            self.split.discard((mb, k))
            self.wgrad_done.add((mb, k))
            return self.wgrad[k]
        if (mb, k) not in self.fwd_done:
            raise ScheduleError(f"{_where(r, i, op, mb, c)}: backward before forward")
        if k < self.last and ("b", mb, k) not in self.received:
            raise ScheduleError(f"{_where(r, i, op, mb, c)}: output gradient not received")
        if (mb, k) in self.bwd_done:
            raise ScheduleError(f"{_where(r, i, op, mb, c)}: backward run twice")
        self.received.discard(("b", mb, k))
        self.bwd_done.add((mb, k))
        if op == "backward":
            self.wgrad_done.add((mb, k))
            return self.bwd_time[k]
        self.split.add((mb, k))
        return self.bwd_time[k] - self.wgrad[k]


def simulate(actions: Sequence[Sequence[dict]], fwd_time: Sequence[float], bwd_time: Sequence[float],
             pp: int, virtual_stages: int = 1, num_microbatches: int | None = None,
             p2p_time: float = 0.0, wgrad_time: Sequence[float] | None = None,
             chunk_bytes: Sequence[int] | None = None, placement: Placement = LOOP) -> SimResult:
    """Run the action lists (see module docstring).

    ``fwd_time[k]``/``bwd_time[k]``: seconds for one micro-batch through model chunk ``k``
    (the backward with both gradients). ``wgrad_time[k]``: the weight-gradient part of
    it (default: ``fwd_time[k]``, the matmuls' weight-gradient FLOPs equal their forward
    FLOPs); ``backward_input`` takes the rest. ``p2p_time``: seconds from a send to its
    receive being satisfiable. ``chunk_bytes[k]``: what one micro-batch keeps for backward
    in model chunk ``k`` (bytes; default: the same for every chunk); the result's
    ``in_flight`` is :func:`in_flight` of the action lists (a rank's live activations depend
    on the order of its own actions only, not on the times). ``placement``: which rank holds
    each model chunk (the schedule's, :attr:`Schedule.placement`).

    Raises:
        ScheduleError: a missing dependency, a duplicate or missing action, or a deadlock.
    """
    v = virtual_stages
    wgrad = list(wgrad_time) if wgrad_time is not None else list(fwd_time)
    run = _Run(pp, v, placement, fwd_time, bwd_time, wgrad, p2p_time)
    total = sum(len(a) for a in actions)
    done = 0
    while done < total:
        ran = sum(run.advance(r, actions[r]) for r in range(pp))
        if not ran:
            blocked = [f"rank {r} at {actions[r][run.pos[r]]}" for r in range(pp) if run.pos[r] < len(actions[r])]
            raise ScheduleError("pipeline schedule deadlocks: " + "; ".join(blocked))
        done += ran
    if run.msgs:
        raise ScheduleError(f"messages never received: {sorted(run.msgs)[:4]}")
    if run.split:
        raise ScheduleError(f"weight gradients never computed: {sorted(run.split)[:4]}")
    if num_microbatches is not None:
        want = {(mb, k) for mb in range(num_microbatches) for k in range(pp * v)}
        if run.fwd_done != want or run.bwd_done != want or run.wgrad_done != want:
            raise ScheduleError("schedule does not run every micro-batch through every chunk once")
    return SimResult(max(run.clock), tuple(run.busy), tuple(run.clock),
                     in_flight(actions, pp, v, chunk_bytes, placement), tuple(run.events))


def in_flight(actions: Sequence[Sequence[dict]], pp: int, virtual_stages: int = 1,
              chunk_bytes: Sequence[int] | None = None, placement: Placement = LOOP) -> tuple[Fraction, ...]:
    """Per pipeline rank, the peak over its action list of what its forwards not yet
    backwarded keep, in units of one micro-batch through all of the rank's chunks (the
    plan's ``schedule.in_flight``). A forward of model chunk ``k`` adds ``chunk_bytes[k]``,
    its backward (or ``backward_input``) takes it away; without ``chunk_bytes`` every chunk
    weighs the same, and the peak is the count of such forwards over ``virtual_stages``.
    Chunks of unlike sizes (an uneven ``stage_layers``, a layer-less first or last chunk)
    need the bytes: in an interleaved schedule a rank's first chunks hold more micro-batches
    than its last ones. A rank whose chunks keep nothing counts forwards. Depends on each
    rank's own order only, so :func:`simulate` and the closed-form costing (the search,
    :func:`parcompile.analysis.memory.memory_from_parts`) share it. ``placement``: which
    rank holds each model chunk (the schedule's)."""
    v = virtual_stages
    weight = [int(x) for x in chunk_bytes] if chunk_bytes is not None else [1] * (pp * v)
    out = []
    for r in range(pp):
        w = {c: weight[placement.chunk(r, c, pp)] for c in range(v)}
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
