"""The `cpu` cluster preset's figures from the machine it runs on (SPEC 1, "Preset names").

The `cpu` preset runs every rank as a process of this machine (gloo). Its memory, compute
and memory bandwidth are this machine's, shared by the ranks of the node
(``gpus_per_node``), so that ``fits``, the serve KV cache's default size and the predicted
step time mean something here:

- ``memory`` per rank: the memory the OS reports available now (``MemAvailable``: psutil,
  else ``/proc/meminfo``, else ``os.sysconf``; within a cgroup v2 ``memory.max``), rounded
  down to 256 MiB, divided by the ranks of the node, less :data:`PROCESS_BYTES` (the
  process's own Python and torch);
- ``peak_flops`` per rank: one thread's fp32 GEMM rate (n = 256) times the cores each rank
  gets (``min(1, cores / ranks)`` with several ranks: torchrun starts them with
  ``OMP_NUM_THREADS=1``; all the cores for a single process);
- ``hbm_bw`` per rank: one thread's copy bandwidth (bytes read + written), scaled likewise;
- ``op_overhead`` per rank: the host time one graph op of the generated program costs in
  its forward beyond its arithmetic (Python, the dispatcher, autograd; the backward counts
  twice, analysis/estimate.py): a tiny decoder layer built from the program's own runtime
  layers (:mod:`parcompile.runtime.layers`: RMSNorm, column/row-parallel linears, RoPE,
  SDPA, SwiGLU, residual adds; :data:`LAYER_OPS` graph ops), run forward and backward at
  sizes whose arithmetic is negligible, over ``3 x`` :data:`LAYER_OPS`; times
  ``max(1, ranks / cores)`` with more ranks than cores (a rank's Python gets its share of a
  core and no more: one thread, whatever the cores);
- ``intra_node_latency`` and ``inter_node_latency`` (alpha, per message step): half the
  mean one-float gloo all-reduce between two ranks over loopback (a two-rank ring
  all-reduce is two steps) while ``ranks - 2`` other processes keep the cores busy, as the
  node's other ranks do: with more ranks than cores a collective waits for its peers to
  be scheduled, a time slice at a time (measured at ``ranks``, not scaled; :func:`gloo_latency`).

The GEMM, copy, per-op and gloo figures come from a probe (about 0.5 s, and up to about 1 s for
each new rank count's gloo figure) run once per machine and torch version and cached in ``$XDG_CACHE_HOME/parcompile/cpu-probe.json``
(default ``~/.cache/parcompile``), written atomically. ``PARCOMPILE_CPU_PROBE`` overrides:

- ``fixed``: the preset's fixed, machine-independent figures (presets.py: 16 GiB per rank,
  1 TFLOPS, 20 GB/s, 20 us per op, 50 us per message): plans that are the same bytes on every machine (the test suite and
  its golden files use it);
- ``probe``: measure again and rewrite the cache;
- ``memory=24GiB,flops=50GFLOPS,bw=10GB/s,overhead=20us,latency=80us`` (any of them, node
  totals for memory, per-thread rates for flops and bw, one thread's seconds per op for
  overhead, before the ranks share the cores, and the seconds per message step the ranks
  see for latency; in SI units): pinned figures; the rest as without.

The measured figures include whatever else the machine runs while they are measured (a
loaded machine gives slower figures: ``probe`` measures again).

Where the figures came from is written into plan.json (``estimate.assumptions.cluster_figures``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from parcompile.core.files import MAX_JSON_BYTES, json_loads, read_text

#: the environment variable that pins or refreshes the figures (module docstring)
ENV = "PARCOMPILE_CPU_PROBE"
#: the memory figure's granularity (bytes): available memory wanders by megabytes
MEMORY_STEP = 256 * 2**20
#: bytes each rank's process takes before the plan's own (Python, torch, gloo: about 350 MB
#: resident on this kind of machine), left out of its ``memory``
PROCESS_BYTES = 512 * 2**20
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


class HostError(ValueError):
    """``PARCOMPILE_CPU_PROBE`` holds something that is not a mode or a list of figures."""


@dataclass(frozen=True)
class HostFigures:
    """One node's figures: ``memory`` available (bytes, the whole node), ``cores`` this
    process may run on, one thread's fp32 GEMM rate ``gemm_flops`` (FLOP/s) and copy
    bandwidth ``copy_bw`` (bytes/s, read + written), ``source`` (where they came from, in
    words), one thread's ``op_overhead`` (seconds per graph op, forward) and gloo's
    ``latency`` (seconds per message step) at the node's rank count; None: the preset's
    fixed figure."""

    memory: int
    cores: int
    gemm_flops: float
    copy_bw: float
    source: str
    op_overhead: float | None = None
    latency: float | None = None


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
    backward of a tiny decoder layer of :mod:`parcompile.runtime.layers` (hidden 16, 8
    tokens: about 20 kFLOP, nothing next to its ops' fixed costs) over ``3 x`` :data:`LAYER_OPS`
    (the estimate's rule: a backward costs twice its forward)."""
    import torch

    from parcompile.runtime import core_attention as A, layers as L
    from parcompile.runtime.context import Axis

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


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "parcompile" / "cpu-probe.json"


def _machine_key() -> str:
    """This machine and torch version: the probe cache's key."""
    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:  # pragma: no cover - torch is a dependency
        torch_version = "?"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}|{cpu}|{cores()} cores|torch {torch_version}"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cpu-probe.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_cache(path: Path) -> dict:
    try:
        cache = json_loads(read_text(path, MAX_JSON_BYTES))   # a regular file only, size-limited
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(path: Path, cache: dict) -> str:
    try:
        _write_atomic(path, json.dumps(cache, indent=1, sort_keys=True) + "\n")
        return f"cached in {path}"
    except OSError as e:
        return f"not cached: {e.strerror or e}"


def probed_rates(refresh: bool = False, ranks: int | None = None) -> tuple[float, float, float, float | None, str]:
    """(GEMM FLOP/s, copy bytes/s, seconds per op, gloo seconds per message step at
    ``ranks`` ranks or None, source) of one thread on this machine (:func:`probe`,
    :func:`gloo_latency`): from the cache, or probed (and cached) when it has none for
    :func:`_machine_key` (or one from before the per-op figure; the gloo figure per rank
    count) or ``refresh``. ``ranks`` None: no gloo figure."""
    path, key = _cache_path(), _machine_key()
    cache = _read_cache(path)
    hit = cache.get(key)
    hit = hit if isinstance(hit, dict) and not refresh else {}
    try:
        rates = (float(hit["gemm_flops"]), float(hit["copy_bw"]), float(hit["op_overhead"]))
        when = str(hit.get("when", "?"))
        if not all(map(_usable, rates)):   # damaged (0, NaN, inf): probed again
            raise ValueError(rates)
    except (KeyError, TypeError, ValueError):
        rates, when, hit = probe(), time.strftime("%Y-%m-%d", time.gmtime()), {}
    gloo = hit.get("gloo_latency") if isinstance(hit.get("gloo_latency"), dict) else {}
    latency = None
    if ranks is not None:
        try:
            latency = float(gloo[str(int(ranks))])
        except (KeyError, TypeError, ValueError):
            latency = gloo_latency(int(ranks))
            if latency is not None:
                gloo = {**gloo, str(int(ranks)): latency}
                hit = {}   # something new to store
    if hit:
        return (*rates, latency, f"probed {when}, cached in {path}")
    cache[key] = {"gemm_flops": rates[0], "copy_bw": rates[1], "op_overhead": rates[2], "gloo_latency": gloo,
                  "when": when}
    return (*rates, latency, f"probed {when}, {_store(path, cache)}")


def _usable(x: float) -> bool:
    """Whether a figure (bytes, FLOP/s, bytes/s) is a positive, finite number."""
    return math.isfinite(x) and x > 0


def _pins(text: str) -> dict[str, float]:
    import re

    from parcompile.config.units import dimension_of, to_si, units_of

    kinds = {"memory": "memory", "flops": "compute", "bw": "bandwidth", "overhead": "time", "latency": "time"}
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in kinds:
            raise HostError(f"{ENV}: `{part}` is not a figure; give `fixed`, `probe` or figures such as "
                            f"`memory=24GiB,flops=50GFLOPS,bw=10GB/s,overhead=20us,latency=80us`")
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/%]+)\s*", value)
        zero_ok = kinds[name] == "time"      # no overhead, no latency: fine; no memory or rate: not
        si = to_si(float(m.group(1)), m.group(2)) if m and dimension_of(m.group(2)) == kinds[name] else None
        if si is None or not (_usable(si) or zero_ok and si == 0):   # 1e400 parses as inf
            raise HostError(f"{ENV}: `{part}`: give a {'non-negative' if zero_ok else 'positive'}, finite number "
                            f"and a unit of {', '.join(units_of(kinds[name]))}")
        out[name] = si
    return out


def host_figures(env: str | None = None, ranks: int | None = None) -> HostFigures | None:
    """This node's figures as ``PARCOMPILE_CPU_PROBE`` (``env``; default the environment)
    says, gloo's latency at ``ranks`` ranks on the node (None: no latency figure); None for
    ``fixed`` (the preset's own figures).

    Raises:
        HostError: the variable holds neither a mode nor figures.
    """
    mode = (os.environ.get(ENV, "") if env is None else env).strip()
    if mode == "fixed":
        return None
    pins = {} if mode in ("", "auto", "probe") else _pins(mode)
    rates = ("flops", "bw", "overhead", "latency")
    if all(k in pins for k in rates[:3]) and ("latency" in pins or ranks is None):
        gemm, copy, overhead, source = (*(pins[k] for k in rates[:3]), f"pinned by {ENV}")
        latency = pins.get("latency")
    else:
        gemm, copy, overhead, latency, source = probed_rates(refresh=mode == "probe",
                                                             ranks=None if "latency" in pins else ranks)
        gemm, copy = pins.get("flops", gemm), pins.get("bw", copy)
        overhead, latency = pins.get("overhead", overhead), pins.get("latency", latency)
        if pins:
            source += f"; {', '.join(sorted(pins))} pinned by {ENV}"
    memory = int(pins["memory"]) if "memory" in pins else available_memory()
    return HostFigures(memory, cores(), gemm, copy, source, overhead, latency)


def cpu_values(fixed: dict, ranks_per_node: int, figures: HostFigures | None = None) -> dict:
    """The `cpu` preset's keys for ``ranks_per_node`` processes on this machine: ``fixed``
    (presets.py's values) with ``memory``, ``peak_flops``, ``hbm_bw``, ``op_overhead`` and
    the two latencies per rank from ``figures`` (default :func:`host_figures`; None:
    ``fixed`` as it is; a figure of None keeps the fixed one) and ``figures`` saying where
    they came from (module docstring).

    Raises:
        HostError: a bad ``PARCOMPILE_CPU_PROBE``.
    """
    ranks = max(int(ranks_per_node), 1)
    figures = host_figures(ranks=ranks if ranks > 1 else None) if figures is None else figures
    if figures is None:
        return {**fixed, "figures": f"fixed ({ENV}=fixed: the preset's machine-independent figures)"}
    share = min(1.0, figures.cores / ranks) if ranks > 1 else float(figures.cores)
    bw_share = min(1.0, figures.cores / ranks)
    memory = max(figures.memory // ranks - PROCESS_BYTES, MEMORY_STEP) // 2**20 * 2**20
    out = {**fixed, "memory": memory, "peak_flops": figures.gemm_flops * share, "hbm_bw": figures.copy_bw * bw_share}
    # one thread's Python: a rank runs it no faster with more cores, and slower by ranks /
    # cores when the ranks outnumber the cores; gloo's latency was measured at `ranks`
    wait = max(1.0, ranks / figures.cores)
    if figures.op_overhead is not None:
        out["op_overhead"] = figures.op_overhead * wait
    if figures.latency is not None:
        out["intra_node_latency"] = out["inter_node_latency"] = figures.latency
    gloo = (f"{figures.latency * 1e6:.0f} us per gloo message step at {ranks} rank(s)" if figures.latency is not None
            else f"gloo latency fixed ({fixed.get('intra_node_latency', 0) * 1e6:.0f} us)")
    overhead = (f"{figures.op_overhead * 1e6:.1f} us per op" if figures.op_overhead is not None
                else f"op overhead fixed ({fixed.get('op_overhead', 0) * 1e6:.1f} us)")
    out["figures"] = (f"this machine: {figures.memory / 2**30:.1f} GiB available / {ranks} rank(s) - "
                      f"{PROCESS_BYTES // 2**20} MiB per process, "
                      f"{figures.cores} core(s), {figures.gemm_flops / 1e9:.1f} GFLOP/s fp32 GEMM, "
                      f"{figures.copy_bw / 1e9:.1f} GB/s copy and {overhead} per thread"
                      + (f" (x {wait:.3g}: {ranks} ranks on {figures.cores} cores)" if wait > 1 else "")
                      + f", {gloo}"
                      + f" ({figures.source})")
    return out


__all__ = ["ENV", "HostError", "HostFigures", "host_figures", "cpu_values", "available_memory", "probe",
           "probed_rates", "gloo_latency", "cores", "engine_threads"]
