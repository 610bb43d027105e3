"""This machine's figures, measured with torch: the measurements behind the `cpu` cluster
preset (SPEC 1, "Preset names"; :mod:`parcompile.frontend.host` turns them into the preset's
keys, caches them and reads ``PARCOMPILE_CPU_PROBE``) and the serve engine's thread count.

- :func:`available_memory`: the memory the OS reports available now (``MemAvailable``:
  psutil, else ``/proc/meminfo``, else ``os.sysconf``; within a cgroup v2 ``memory.max``),
  rounded down to :data:`MEMORY_STEP`;
- :func:`probe`: one thread's fp32 GEMM rate (n = :data:`GEMM_N`), one thread's copy
  bandwidth (bytes read + written) and the host time one graph op of the generated program
  costs in its forward beyond its arithmetic (Python, the dispatcher, autograd; the backward
  counts twice, analysis/estimate.py): a tiny decoder layer built from the program's own
  runtime layers (:mod:`parcompile.runtime.model.layers`: RMSNorm, column/row-parallel linears,
  RoPE, SDPA, SwiGLU, residual adds; :data:`LAYER_OPS` graph ops), run forward and backward
  at sizes whose arithmetic is negligible, over ``3 x`` :data:`LAYER_OPS`;
- :func:`gloo_latency`: half the mean one-float gloo all-reduce between two ranks over
  loopback (a two-rank ring all-reduce is two steps) while ``ranks - 2`` other processes
  keep the cores busy, as the node's other ranks do: with more ranks than cores a
  collective waits for its peers to be scheduled, a time slice at a time.

The measured figures include whatever else the machine runs while they are measured.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

#: the memory figure's granularity (bytes): available memory wanders by megabytes
MEMORY_STEP = 256 * 2**20
#: the probe's GEMM size and time budgets (seconds) for each of its two measurements
GEMM_N = 256
PROBE_S = 0.08
COPY_BYTES = 32 * 2**20
#: graph ops of the probe's decoder layer (:func:`_layer_overhead`): attn_norm, wq, wk, wv,
#: rope_q, rope_k, attention core, wo, residual add, mlp_norm, w1, w3, swiglu, w2, residual add
LAYER_OPS = 15
#: one-float gloo all-reduces the latency probe times (after warming up), in blocks of
#: :data:`GLOO_BLOCK` (:func:`gloo_latency`)
GLOO_ROUNDS = 60
GLOO_BLOCK = 10
#: with more ranks than cores the rounds go on for this long at least (seconds): the waits
#: for a descheduled peer come a time slice apart, and their mean needs many slices
GLOO_CONTENDED_S = 0.3
#: the most busy processes the latency probe starts beside its two ranks, per core
BUSY_PER_CORE = 8


def available_memory() -> int:
    """Bytes of memory available to new processes now (module docstring), rounded down to
    :data:`MEMORY_STEP`."""
    avail = None
    try:
        import psutil

        avail = int(psutil.virtual_memory().available)
    except Exception:
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 16 * 2**30
    try:       # a container's limit (cgroup v2)
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            avail = min(avail, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return max(avail // MEMORY_STEP * MEMORY_STEP, MEMORY_STEP)


def cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def engine_threads(ranks: int, cpus: int | None = None) -> int:
    """The intra-op threads (``OMP_NUM_THREADS``) each of ``ranks`` serve engine ranks gets on
    this machine: the ``cpus`` (default :func:`cores`) less one for the HTTP front, shared
    by the ranks, at least one: ``max(1, (cpus - 1) // ranks)``.

    The front (its event loop, tokenizer and the connections to the leaders) runs beside the
    ranks. A rank with more threads than the cores left idle for it waits at every parallel
    region's barrier for a thread the OS has not scheduled: with torch's default (all the
    cores) beside a busy front on 2 cores, an engine step measured 128 ms instead of 3.5 ms
    (issue 33). torchrun itself sets 1 only when it starts more than one process.

    Raises:
        ValueError: ``ranks`` < 1.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    return max(1, ((cores() if cpus is None else cpus) - 1) // ranks)


def _best_rate(work, amount: float) -> float:
    """``amount / seconds`` of ``work()``'s fastest run over about :data:`PROBE_S` seconds
    (after one run to warm up)."""
    work()
    best, end = 0.0, time.perf_counter() + PROBE_S
    while True:
        t0 = time.perf_counter()
        work()
        dt = time.perf_counter() - t0
        best = max(best, amount / max(dt, 1e-9))
        if t0 + dt > end:
            return best


def _layer_overhead() -> float:
    """Seconds per graph op of the forward (module docstring): the fastest forward and
    backward of a tiny decoder layer of :mod:`parcompile.runtime.model.layers` (hidden 16, 8
    tokens: about 20 kFLOP, nothing next to its ops' fixed costs) over ``3 x`` :data:`LAYER_OPS`
    (the estimate's rule: a backward costs twice its forward)."""
    import torch

    from parcompile.runtime.model import core_attention as A, layers as L
    from parcompile.runtime.distributed.context import Axis

    one = Axis("tp", [0], 0)
    h, f, t, d = 16, 32, 8, 8
    n1, n2 = L.RMSNorm("n1", h, 1e-5, 0, one), L.RMSNorm("n2", h, 1e-5, 0, one)
    wq, wk, wv = (L.ColumnParallelLinear(f"w{n}", h, o, False, one, 0) for n, o in (("q", h), ("k", d), ("v", d)))
    wo, w2 = L.RowParallelLinear("wo", h, h, False, one, 0), L.RowParallelLinear("w2", f, h, False, one, 0)
    w1, w3 = L.ColumnParallelLinear("w1", h, f, False, one, 0), L.ColumnParallelLinear("w3", h, f, False, one, 0)
    cos, sin = L.rope_tables(t, d, 10000.0)
    x = torch.randn(1, t, h, requires_grad=True)

    def layer():
        a = n1(x)
        q = L.apply_rope(wq(a).view(1, t, 2, d), cos, sin).transpose(1, 2)
        k = L.apply_rope(wk(a).view(1, t, 1, d), cos, sin).transpose(1, 2)
        v = wv(a).view(1, t, 1, d).transpose(1, 2)
        y = x + wo(A.attention_core(q, k, v, True, 0.0, True, 0).transpose(1, 2).reshape(1, t, h))
        b = n2(y)
        (y + w2(L.swiglu(w1(b), w3(b)))).sum().backward()

    return 1.0 / _best_rate(layer, 1.0) / (3 * LAYER_OPS)


def gloo_latency(ranks: int = 2) -> float | None:
    """Seconds per message step of gloo among ``ranks`` ranks on this machine: half the mean
    one-float all-reduce of two ranks (two threads of this process, loopback TCP; a
    two-rank ring all-reduce is two steps) over :data:`GLOO_ROUNDS` rounds while ``ranks -
    2`` forked processes (at most :data:`BUSY_PER_CORE` per core) keep the cores busy as the
    node's other ranks would. With more ranks than cores the waits for a descheduled peer
    (a time slice now and then) are the point: the mean of all rounds, for at least
    :data:`GLOO_CONTENDED_S` seconds; else the mean of the
    fastest block of :data:`GLOO_BLOCK` rounds (what else the machine runs meanwhile shows in
    some blocks only). None when gloo cannot run here (no loopback interface, no gloo in this
    torch, no ``fork``)."""
    import datetime
    import signal
    import threading

    import torch
    import torch.distributed as dist

    try:
        store = dist.HashStore()
        timeout = datetime.timedelta(seconds=10)
    except Exception:
        return None
    busy = min(max(int(ranks) - 2, 0), BUSY_PER_CORE * cores())
    oversubscribed = int(ranks) > cores()
    if busy and not hasattr(os, "fork"):
        return None
    means: list[float] = []
    ready = threading.Barrier(3, timeout=15)     # both ranks connected; then the busy processes start

    def rank(r: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("probe", store), r, 2, timeout)
            x = torch.zeros(1)
            for _ in range(3):
                pg.allreduce([x]).wait()
            ready.wait()
            ready.wait()
            blocks: list[float] = []
            until = time.perf_counter() + (GLOO_CONTENDED_S if oversubscribed else 0.0)
            while len(blocks) < GLOO_ROUNDS // GLOO_BLOCK or (time.perf_counter() < until and len(blocks) < 1000):
                t0 = time.perf_counter()
                for _ in range(GLOO_BLOCK):
                    pg.allreduce([x]).wait()
                blocks.append((time.perf_counter() - t0) / GLOO_BLOCK)
            means.append(sum(blocks) / len(blocks) if oversubscribed else min(blocks))
        except Exception:
            ready.abort()

    pids: list[int] = []
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    try:
        for th in threads:
            th.start()
        ready.wait()                             # connected (gloo's handshake would wait on the busy ones)
        for _ in range(busy):
            pid = os.fork()
            if pid == 0:   # a busy rank: spin, and end by itself should this process die
                end = time.monotonic() + 10
                while time.monotonic() < end:
                    pass
                os._exit(0)
            pids.append(pid)
        ready.wait()
        for th in threads:
            th.join(timeout=15)
    except threading.BrokenBarrierError:
        pass
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
    return max(means) / 2 if len(means) == 2 else None


def probe() -> tuple[float, float, float]:
    """(one thread's fp32 GEMM FLOP/s at n = :data:`GEMM_N`, one thread's copy bytes/s of
    a :data:`COPY_BYTES` buffer, read + written, each the best of repeats over about
    :data:`PROBE_S` seconds; the program's seconds per graph op of the forward,
    :func:`_layer_overhead`). gloo's latency depends on the rank count: :func:`gloo_latency`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(GEMM_N, GEMM_N)
        b = torch.randn(GEMM_N, GEMM_N)
        src = torch.ones(COPY_BYTES // 4)
        dst = torch.empty_like(src)
        gemm = _best_rate(lambda: torch.mm(a, b), 2.0 * GEMM_N**3)
        copy = _best_rate(lambda: dst.copy_(src), 2.0 * COPY_BYTES)
        del src, dst
        return gemm, copy, _layer_overhead()
    finally:
        torch.set_num_threads(threads)


__all__ = ["MEMORY_STEP", "LAYER_OPS", "available_memory", "cores", "engine_threads", "gloo_latency", "probe"]
