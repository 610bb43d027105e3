"""The `cpu` cluster preset's figures from the machine it runs on (SPEC 1, "Preset names"),
measured by :mod:`parcompile.runtime.machine.host`.

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
  layers (:mod:`parcompile.runtime.model.layers`: RMSNorm, column/row-parallel linears, RoPE,
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
from parcompile.runtime.machine.host import MEMORY_STEP, available_memory, cores, gloo_latency, probe

#: the environment variable that pins or refreshes the figures (module docstring)
ENV = "PARCOMPILE_CPU_PROBE"
#: bytes each rank's process takes before the plan's own (Python, torch, gloo: about 350 MB
#: resident on this kind of machine), left out of its ``memory``
PROCESS_BYTES = 512 * 2**20


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
        if name in out:   # two values for one figure: neither is silently the one planned with
            raise HostError(f"{ENV}: `{name}` is given twice; give each figure once")
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


__all__ = ["ENV", "HostError", "HostFigures", "host_figures", "cpu_values", "probed_rates"]
