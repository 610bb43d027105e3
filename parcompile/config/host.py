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
- ``hbm_bw`` per rank: one thread's copy bandwidth (bytes read + written), scaled likewise.

The GEMM and copy rates come from a probe (about 0.2 s) run once per machine and torch
version and cached in ``$XDG_CACHE_HOME/parcompile/cpu-probe.json`` (default
``~/.cache/parcompile``), written atomically. ``PARCOMPILE_CPU_PROBE`` overrides:

- ``fixed``: the preset's fixed, machine-independent figures (presets.py: 16 GiB per rank,
  1 TFLOPS, 20 GB/s): plans that are the same bytes on every machine (the test suite and
  its golden files use it);
- ``probe``: measure again and rewrite the cache;
- ``memory=24GiB,flops=50GFLOPS,bw=10GB/s`` (any of them, node totals for memory and
  per-thread rates for the others, in SI units): pinned figures; the rest as without.

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


class HostError(ValueError):
    """``PARCOMPILE_CPU_PROBE`` holds something that is not a mode or a list of figures."""


@dataclass(frozen=True)
class HostFigures:
    """One node's figures: ``memory`` available (bytes, the whole node), ``cores`` this
    process may run on, one thread's fp32 GEMM rate ``gemm_flops`` (FLOP/s) and copy
    bandwidth ``copy_bw`` (bytes/s, read + written), and ``source`` (where they came from,
    in words)."""

    memory: int
    cores: int
    gemm_flops: float
    copy_bw: float
    source: str


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


def probe() -> tuple[float, float]:
    """(one thread's fp32 GEMM FLOP/s at n = :data:`GEMM_N`, one thread's copy bytes/s of
    a :data:`COPY_BYTES` buffer, read + written), each the best of repeats over about
    :data:`PROBE_S` seconds."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(GEMM_N, GEMM_N)
        b = torch.randn(GEMM_N, GEMM_N)
        src = torch.ones(COPY_BYTES // 4)
        dst = torch.empty_like(src)
        rates = []
        for work, amount in ((lambda: torch.mm(a, b), 2.0 * GEMM_N**3), (lambda: dst.copy_(src), 2.0 * COPY_BYTES)):
            work()                                  # warm up
            best, end = 0.0, time.perf_counter() + PROBE_S
            while True:
                t0 = time.perf_counter()
                work()
                dt = time.perf_counter() - t0
                best = max(best, amount / max(dt, 1e-9))
                if t0 + dt > end:
                    break
            rates.append(best)
        return rates[0], rates[1]
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


def probed_rates(refresh: bool = False) -> tuple[float, float, str]:
    """(GEMM FLOP/s, copy bytes/s, source) of one thread on this machine: from the cache, or
    probed (and cached) when it has none for :func:`_machine_key` or ``refresh``."""
    path, key = _cache_path(), _machine_key()
    cache: dict = {}
    try:
        cache = json_loads(read_text(path, MAX_JSON_BYTES))   # a regular file only, size-limited
        if not isinstance(cache, dict):
            cache = {}
        hit = cache.get(key)
        if not refresh and isinstance(hit, dict):
            gemm, copy = float(hit["gemm_flops"]), float(hit["copy_bw"])
            if _usable(gemm) and _usable(copy):   # else damaged (0, NaN, inf): probed again
                return gemm, copy, f"probed {hit.get('when', '?')}, cached in {path}"
    except (OSError, ValueError, KeyError, TypeError):
        cache = {}
    gemm, copy = probe()
    when = time.strftime("%Y-%m-%d", time.gmtime())
    cache[key] = {"gemm_flops": gemm, "copy_bw": copy, "when": when}
    try:
        _write_atomic(path, json.dumps(cache, indent=1, sort_keys=True) + "\n")
        where = f"cached in {path}"
    except OSError as e:
        where = f"not cached: {e.strerror or e}"
    return gemm, copy, f"probed {when}, {where}"


def _usable(x: float) -> bool:
    """Whether a figure (bytes, FLOP/s, bytes/s) is a positive, finite number."""
    return math.isfinite(x) and x > 0


def _pins(text: str) -> dict[str, float]:
    import re

    from parcompile.config.units import dimension_of, to_si, units_of

    kinds = {"memory": "memory", "flops": "compute", "bw": "bandwidth"}
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in kinds:
            raise HostError(f"{ENV}: `{part}` is not a figure; give `fixed`, `probe` or figures such as "
                            f"`memory=24GiB,flops=50GFLOPS,bw=10GB/s`")
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/%]+)\s*", value)
        si = to_si(float(m.group(1)), m.group(2)) if m and dimension_of(m.group(2)) == kinds[name] else None
        if si is None or not _usable(si):   # 1e400 parses as inf
            raise HostError(f"{ENV}: `{part}`: give a positive, finite number and a unit of "
                            f"{', '.join(units_of(kinds[name]))}")
        out[name] = si
    return out


def host_figures(env: str | None = None) -> HostFigures | None:
    """This node's figures as ``PARCOMPILE_CPU_PROBE`` (``env``; default the environment)
    says; None for ``fixed`` (the preset's own figures).

    Raises:
        HostError: the variable holds neither a mode nor figures.
    """
    mode = (os.environ.get(ENV, "") if env is None else env).strip()
    if mode == "fixed":
        return None
    pins = {} if mode in ("", "auto", "probe") else _pins(mode)
    if "flops" in pins and "bw" in pins:
        gemm, copy, source = pins["flops"], pins["bw"], f"pinned by {ENV}"
    else:
        gemm, copy, source = probed_rates(refresh=mode == "probe")
        gemm, copy = pins.get("flops", gemm), pins.get("bw", copy)
        if pins:
            source += f"; {', '.join(sorted(pins))} pinned by {ENV}"
    memory = int(pins["memory"]) if "memory" in pins else available_memory()
    return HostFigures(memory, cores(), gemm, copy, source)


def cpu_values(fixed: dict, ranks_per_node: int, figures: HostFigures | None = None) -> dict:
    """The `cpu` preset's keys for ``ranks_per_node`` processes on this machine: ``fixed``
    (presets.py's values) with ``memory``, ``peak_flops`` and ``hbm_bw`` per rank from
    ``figures`` (default :func:`host_figures`; None: ``fixed`` as it is) and ``figures``
    saying where they came from.

    Raises:
        HostError: a bad ``PARCOMPILE_CPU_PROBE``.
    """
    figures = host_figures() if figures is None else figures
    if figures is None:
        return {**fixed, "figures": f"fixed ({ENV}=fixed: the preset's machine-independent figures)"}
    ranks = max(int(ranks_per_node), 1)
    share = min(1.0, figures.cores / ranks) if ranks > 1 else float(figures.cores)
    bw_share = min(1.0, figures.cores / ranks)
    memory = max(figures.memory // ranks - PROCESS_BYTES, MEMORY_STEP) // 2**20 * 2**20
    return {**fixed, "memory": memory,
            "peak_flops": figures.gemm_flops * share, "hbm_bw": figures.copy_bw * bw_share,
            "figures": (f"this machine: {figures.memory / 2**30:.1f} GiB available / {ranks} rank(s) - "
                        f"{PROCESS_BYTES // 2**20} MiB per process, "
                        f"{figures.cores} core(s), {figures.gemm_flops / 1e9:.1f} GFLOP/s fp32 GEMM and "
                        f"{figures.copy_bw / 1e9:.1f} GB/s copy per thread ({figures.source})")}


__all__ = ["ENV", "HostError", "HostFigures", "host_figures", "cpu_values", "available_memory", "probe",
           "probed_rates", "cores"]
