"""A serving workload's steady state on one replica: mean time to first token (TTFT), time
per output token (TPOT), output tokens/s, from the step costs of
:mod:`parcompile.analysis.serve_steps` and the engine's scheduler (chunked prefill with a
token budget, at most ``max_seqs`` sequences a step, a KV cache of ``kv_tokens``).

Workloads (``serve`` keys ``concurrency``, ``request_rate``): every request has ``P`` prompt
tokens and ``G`` output tokens.

* **Closed loop** (``concurrency``: ``c`` clients per replica, each sending its next request
  when its last one ends; vLLM's ``bench serve --max-concurrency``): requests drift apart, so
  in the steady state ``n = min(c, max_seqs, what the cache holds)`` sequences run, each
  staying ``k + G - 1`` steps (``k = ceil(P / room)`` steps of prompt chunks, ``room`` the
  token budget less the decode rows, then ``G - 1`` decode steps; its first token comes
  with its last chunk). Per step ``n / (k + G - 1)`` requests start, so a running request
  decodes beside ``(n - 1) (G - 1) / (k + G - 1)`` others on average, and a share ``q`` of
  its steps also carries other requests' prompt chunks (``q = min(1, (n - 1) k / (k + G -
  1))``, each such step ``(n - 1) P / (k + G - 1) / q`` prompt tokens): TPOT is ``(1 - q)``
  of a decode step's time plus ``q`` of such a mixed step's. TTFT is the engine's per-request
  time (:attr:`ServeEngine.request_overhead`), half a step of waiting for the step in progress
  when other requests run, and the request's own ``k`` chunk steps beside the others'
  decode rows. Requests beyond ``n`` queue: the replica then completes ``X = n / (TTFT +
  (G - 1) TPOT)`` requests per second, and by Little's law each of the ``c`` clients waits
  ``c / X`` per request, the difference before its first token.
* **Open loop** (``request_rate``: ``r`` requests/s per replica, Poisson): the running
  sequences ``n = r (TTFT + (G - 1) TPOT)`` (Little's law) solved by iteration, the same step
  mix; a rate above what ``max_seqs`` (or the cache) sustains has no steady state
  (:class:`Overloaded`). Queueing beyond the next step is not modelled.
* **Burst** (``request_rate = inf``: ``c`` requests at once; vLLM's ``benchmark_latency``):
  their prompts are prefilled first, in steps of at most the budget's tokens (a request's
  first token at the end of the step that finishes its prompt), then all decode together;
  more than ``n`` run in waves, one after another.

Prefix caching, speculative decoding and preemption are not modelled; a decode row's
context is the mean ``P + G / 2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from parcompile.analysis.serve_steps import Segment, Step, decode_step


class Overloaded(Exception):
    """An open-loop rate no steady state carries: ``capacity`` requests/s is the most the
    replica completes (``max_seqs`` or the KV cache full)."""

    def __init__(self, rate: float, capacity: float, limit: int = 0):
        super().__init__(f"{rate:g} requests/s exceeds the replica's {capacity:.3g}")
        self.rate = rate
        self.capacity = capacity
        #: the most sequences a step of the replica holds
        self.limit = limit


@dataclass(frozen=True)
class Workload:
    """One replica's share of a serve spec's workload and its scheduler's limits."""

    prompt: int
    output: int
    #: closed-loop clients on this replica (``concurrency / replicas``; a burst's requests)
    clients: float
    #: open-loop requests/s on this replica; None: closed loop; inf: a burst
    rate: float | None
    #: the scheduler's most sequences a step
    max_seqs: int
    #: tokens the replica's KV cache holds
    kv_tokens: int
    #: tokens a step may compute (chunked prefill); None: each prompt whole in one step
    budget: int | None
    block_size: int = 16
    request_overhead: float = 0.0

    @property
    def mean_context(self) -> float:
        """A decoding row's mean context: ``P + G / 2``."""
        return self.prompt + self.output / 2

    def kv_limit(self) -> int:
        """Sequences the cache holds at once, each at its mean context rounded up to blocks
        (blocks are taken as tokens need them): at least 1 where one whole sequence fits."""
        per = self.mean_context + self.block_size / 2
        return max(int(self.kv_tokens // per), 1 if self.kv_tokens >= self.prompt + self.output else 0)


@dataclass(frozen=True)
class WorkloadTimes:
    """The steady state (module docstring): seconds, requests/s and tokens/s of one replica."""

    ttft: float
    tpot: float
    #: time from a request's send to its last token, queueing included
    e2e: float
    #: requests completed per second
    request_rate: float
    #: sequences running in a step
    running: float
    #: the most sequences a step holds (``max_seqs`` or the KV cache)
    running_limit: int
    #: seconds a request waits in the queue before its prompt starts
    queue: float
    #: prompt chunk steps per request, tokens per chunk, share of a request's decode steps that
    #: also prefill others' prompts
    prefill_steps: int
    chunk: float
    mixed_share: float
    #: seconds of the steps TPOT is made of: a decode-only step, a step with others' chunks
    decode_step: float
    mixed_step: float
    #: each part of a decode-only step (summed over the stages)
    decode_parts: dict[str, float] = field(default_factory=dict)
    prefill_parts: dict[str, float] = field(default_factory=dict)


StepTime = Callable[[Step], tuple[float, dict[str, float]]]


def _room(w: Workload, decoding: float) -> float:
    """Prompt tokens a step may compute beside ``decoding`` decode rows."""
    if w.budget is None:
        return float(w.prompt)
    return max(w.budget - decoding, 1.0)


def steady_state(w: Workload, step_time: StepTime) -> WorkloadTimes:
    """The workload's steady state on one replica (module docstring); ``step_time(step)``
    gives ``(seconds, parts)`` of a :class:`~parcompile.analysis.serve_steps.Step`.
    Raises :class:`Overloaded` for an open-loop rate the replica cannot carry, ValueError
    when not one sequence fits the cache."""
    limit = min(w.max_seqs, w.kv_limit())
    if limit < 1:
        raise ValueError("not one sequence fits the KV cache")
    if w.rate is not None and math.isinf(w.rate):
        return _burst(w, limit, step_time)
    if w.rate is None:
        n = min(w.clients, limit)
        times = _running(w, n, step_time)
        service = times.ttft + (w.output - 1) * times.tpot
        x = n / service
        e2e = w.clients / x
        queue = max(e2e - service, 0.0)
        return replace(times, ttft=times.ttft + queue, e2e=e2e, request_rate=x, queue=queue, running_limit=limit)
    # open loop: n = rate * residence (Little), by iteration
    cap_times = _running(w, limit, step_time)
    capacity = limit / (cap_times.ttft + (w.output - 1) * cap_times.tpot)
    if w.rate >= capacity:
        raise Overloaded(w.rate, capacity, limit)
    n = min(limit, max(w.rate * (cap_times.ttft + (w.output - 1) * cap_times.tpot), 1e-9))
    for _ in range(50):
        times = _running(w, max(n, 1.0), step_time)
        new = w.rate * (times.ttft + (w.output - 1) * times.tpot)
        if abs(new - n) <= 1e-6 * max(n, 1.0):
            n = new
            break
        n = min(limit, 0.5 * (n + new))
    times = _running(w, max(n, 1.0), step_time)
    service = times.ttft + (w.output - 1) * times.tpot
    return replace(times, e2e=service, request_rate=w.rate, running=n, queue=0.0, running_limit=limit)


def _running(w: Workload, n: float, step_time: StepTime) -> WorkloadTimes:
    """TTFT and TPOT with ``n`` sequences running (closed-loop step mix, module docstring),
    no queue."""
    P, G = w.prompt, w.output
    ctx = w.mean_context
    others = max(n - 1.0, 0.0)
    # the prompt's chunks: the room beside the decode rows (a fixed point: the rows depend on k)
    k = 1
    for _ in range(8):
        decoding = others * (G - 1) / (k + G - 1)
        room = _room(w, decoding + 1)
        k2 = max(1, math.ceil(P / room))
        if k2 == k:
            break
        k = k2
    life = k + G - 1
    decoding = others * (G - 1) / life                 # others' decode rows beside a request
    chunk = P / k
    q = min(1.0, others * k / life)                    # share of steps with others' chunks
    prompt_tokens = others * P / life / q if q > 0 else 0.0
    mean_start = chunk * (k - 1) / 2                   # a chunk's cached prefix, on average
    mine = Segment(1, 1, ctx - 1)
    dec_t, dec_parts = step_time(Step((Segment(decoding, 1, ctx - 1), mine)))
    if q > 0:
        mixed_t, _ = step_time(Step((Segment(decoding, 1, ctx - 1), mine,
                                     Segment(prompt_tokens / chunk, chunk, mean_start))))
    else:
        mixed_t = dec_t
    tpot = (1 - q) * dec_t + q * mixed_t
    own_t, pf_parts = step_time(Step((Segment(decoding, 1, ctx - 1), Segment(1, chunk, mean_start))))
    wait = 0.5 * tpot if others > 0 else 0.0           # the step in progress when the request comes
    ttft = w.request_overhead + wait + k * own_t
    return WorkloadTimes(ttft=ttft, tpot=tpot, e2e=ttft + (G - 1) * tpot, request_rate=0.0, running=n,
                         running_limit=0, queue=0.0, prefill_steps=k, chunk=chunk, mixed_share=q,
                         decode_step=dec_t, mixed_step=mixed_t, decode_parts=dec_parts, prefill_parts=pf_parts)


def _burst(w: Workload, limit: int, step_time: StepTime) -> WorkloadTimes:
    """Every request at once: waves of ``limit``; each wave prefills its prompts in steps of
    at most the budget's tokens (a request's first token at the end of the step that finishes
    its prompt), then decodes together (module docstring). The waves but the last are alike:
    one is costed and repeated (a burst of a billion requests costs what two waves do)."""
    P, G = w.prompt, w.output
    total = max(int(round(w.clients)), 1)
    full, rest = divmod(total, limit)

    def wave(n: int) -> tuple[float, float, float, dict, dict, int, float]:
        """(mean first-token time, duration, decode step, parts...) of a wave of ``n``."""
        budget = w.budget if w.budget is not None else P
        steps = max(1, math.ceil(n * P / budget))
        per = n * P / steps
        t, done, ttft_sum, finished, parts_pf = 0.0, 0.0, 0.0, 0, {}
        for _ in range(steps):
            seg = Segment(per / P, P, 0.0) if per >= P else Segment(1, per, done % P)
            s_t, parts_pf = step_time(Step((seg,)))
            t += s_t
            done += per
            now = n if done >= n * P - 1e-9 else min(n, int(math.floor(done / P + 1e-9)))
            ttft_sum += (now - finished) * t
            finished = now
        dec_t, parts_dec = step_time(decode_step(n, w.mean_context))
        return ttft_sum / n, t + (G - 1) * dec_t, dec_t, parts_dec, parts_pf, steps, per

    waves = ([(full, limit, wave(limit))] if full else []) + ([(1, rest, wave(rest))] if rest else [])
    ttft_total = e2e_total = start = 0.0
    for count, size, (a, dur, *_x) in waves:
        # `count` waves of `size` requests, the k-th starting at start + k dur
        shift = count * start + dur * count * (count - 1) / 2
        ttft_total += size * (count * (w.request_overhead + a) + shift)
        e2e_total += size * (count * (w.request_overhead + dur) + shift)
        start += count * dur
    _a, _d, dec_t, parts_dec, parts_pf, steps, per = waves[-1][2]
    return WorkloadTimes(ttft=ttft_total / total, tpot=dec_t, e2e=e2e_total / total,
                         request_rate=total / (start + w.request_overhead), running=min(limit, total),
                         running_limit=limit, queue=0.0, prefill_steps=steps, chunk=per, mixed_share=0.0,
                         decode_step=dec_t, mixed_step=dec_t, decode_parts=parts_dec, prefill_parts=parts_pf)


@dataclass(frozen=True)
class PrefillPool:
    """The prefill side of a disaggregated deployment, per instance: the seconds one prompt
    of the workload takes (its chunks, alone on the instance: ``prompt_s``), the seconds a
    step of the budget's tokens takes (``step_s``, several prompts' chunks together: the
    instance's throughput under load) and the seconds the prompt's KV cache takes to reach
    the decode instance (``transfer_s``)."""

    instances: int
    prompt_s: float
    step_s: float
    step_tokens: float
    transfer_s: float


def disaggregated_state(w: Workload, pool: PrefillPool, step_time: StepTime, replicas: int = 1) -> WorkloadTimes:
    """The closed-loop (or open-loop) steady state of a disaggregated deployment (prefill and
    decode on separate GPU pools, NVIDIA Dynamo's and vLLM's P/D disaggregation): the decode
    replica runs decode rows only (``step_time``: its steps), TPOT a decode step of the
    running sequences; a request's first token comes after the engine's per-request time, its
    wait for a prefill instance, its prompt's chunks (``pool.prompt_s``) and its KV cache's
    transfer. The prefill instances serve the requests of every decode replica: at ``X``
    requests/s in all they are busy ``u = X P / (instances * step_tokens / step_s)`` of the
    time, and a prompt waits ``u / (2 (1 - u))`` of its service time (M/D/1); ``w``'s clients
    and rate are one decode replica's, ``pool`` the whole prefill pool, ``replicas`` the
    decode replicas the pool serves. Raises :class:`Overloaded` for an open-loop rate the
    prefill pool (or the decode replica) cannot carry."""
    P, G = w.prompt, w.output
    limit = min(w.max_seqs, w.kv_limit())
    if limit < 1:
        raise ValueError("not one sequence fits the KV cache")
    capacity_p = pool.instances * pool.step_tokens / (P * pool.step_s)   # requests/s the prefill pool carries

    def decode(n: float) -> tuple[float, dict]:
        return step_time(Step((Segment(max(n - 1.0, 0.0), 1, w.mean_context - 1), Segment(1, 1, w.mean_context - 1))))

    def ttft_at(total_rate: float) -> float:
        u = min(total_rate / capacity_p, 1.0 - 1e-9)
        return w.request_overhead + u / (2 * (1 - u)) * pool.prompt_s + pool.prompt_s + pool.transfer_s

    if w.rate is not None and not math.isinf(w.rate):
        if w.rate * replicas >= capacity_p:
            raise Overloaded(w.rate * replicas, capacity_p, limit)
        ttft = ttft_at(w.rate * replicas)
        n = 1.0
        for _ in range(50):
            tpot, parts = decode(n)
            new = min(w.rate * (G - 1) * tpot, float(limit))
            if abs(new - n) <= 1e-6 * max(n, 1.0):
                break
            n = max(new, 1.0)
        tpot, parts = decode(max(n, 1.0))
        if w.rate * (G - 1) * tpot > limit:
            raise Overloaded(w.rate, limit / ((G - 1) * tpot), limit)
        e2e = ttft + (G - 1) * tpot
        return WorkloadTimes(ttft=ttft, tpot=tpot, e2e=e2e, request_rate=w.rate, running=n, running_limit=limit,
                             queue=0.0, prefill_steps=1, chunk=float(P), mixed_share=0.0, decode_step=tpot,
                             mixed_step=tpot, decode_parts=parts, prefill_parts={})
    n = min(w.clients, limit)
    tpot, parts = decode(n)
    x = n / (ttft_at(0.0) + (G - 1) * tpot)          # requests/s of this replica, by iteration
    for _ in range(100):
        ttft = ttft_at(min(x * replicas, capacity_p * (1 - 1e-9)))
        service = ttft + (G - 1) * tpot
        new = min(n / service, capacity_p / replicas * (1 - 1e-9))
        if abs(new - x) <= 1e-9 * x:
            break
        x = 0.5 * (x + new)
    ttft = ttft_at(x * replicas)
    service = ttft + (G - 1) * tpot
    e2e = max(w.clients / x, service)
    queue = e2e - service
    return WorkloadTimes(ttft=ttft + queue, tpot=tpot, e2e=e2e, request_rate=x, running=n, running_limit=limit,
                         queue=queue, prefill_steps=1, chunk=float(P), mixed_share=0.0, decode_step=tpot,
                         mixed_step=tpot, decode_parts=parts, prefill_parts={})


__all__ = ["Overloaded", "PrefillPool", "Workload", "WorkloadTimes", "disaggregated_state", "steady_state"]
