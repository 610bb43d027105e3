"""Sizing a deployment (``parcompile search`` of a ``serve`` spec): which GPUs, split how,
in which precision, carry the spec's workload within its latency targets
(``serve.ttft_target``, ``serve.tpot_target``).

The candidates (:func:`deployments`): every tensor-parallel degree inside a node that the
checks accept, every pipeline depth, as many replicas as the cluster's GPUs allow (the
cluster is what may be used: a deployment may take fewer GPUs), the weight and KV dtypes
the spec leaves ``auto`` (FP8 where the GPUs hold FP8; MXFP4 for a mixture of experts;
INT4 for a dense model), and with ``disaggregated = auto`` prefill and decode on separate
pools (a prefill tp and instance count beside each decode layout). Each replica runs at
most ``ceil(concurrency / replicas)`` sequences unless the spec gives ``batch``.

Each candidate is costed by the plan's own rules, without compiling it: one one-stage graph
per tensor-parallel degree (lowered and run through the sharding passes), its per-layer
step costs (:func:`parcompile.analysis.serve_steps.layer_units`) summed into the candidate's
stages (:func:`~parcompile.analysis.serve_steps.split_units`), its workspace restaged the
same way, its links from where its groups fall (:func:`parcompile.core.groups.axis_placement`),
then the workload's steady state (:mod:`parcompile.analysis.serve_workload`). A deployment
that holds fewer GPUs than the cluster is planned on a cluster of its own size
(:func:`deployment_cluster`), so its figures are those ``parcompile plan`` gives it written
out (``tests/test_serve_search.py`` holds them equal).

The result (:class:`ServeSearch`): the deployments that fit and meet the targets, ranked by
output tokens/s per GPU; the fewest GPUs among them; the Pareto front of tokens/s per GPU
against tokens/s per user (``1 / tpot``) over all that fit; and, when none meets the
targets, the nearest (the smallest excess over the targets).
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from parcompile.analysis import serve as S
from parcompile.analysis.efficiency import efficiency
from parcompile.analysis.kv import kv_bytes_per_sequence
from parcompile.analysis.network import links_of
from parcompile.analysis.serve_memory import WorkspaceParts, prefill_step, stage_workspaces, workspace_parts
from parcompile.analysis.serve_steps import Rates, layer_units, split_units, with_cache_dtype
from parcompile.analysis.serve_workload import (Overloaded, WorkloadTimes, disaggregated_state,
                                                steady_state)
from parcompile.config.presets import fp8_storage
from parcompile.config.schema import SpecConfig
from parcompile.core.axes import AXIS_FAMILY
from parcompile.core.families import for_model
from parcompile.core.dtypes import DTYPE_BYTES
from parcompile.core.groups import axis_placement
from parcompile.core.units import seconds_text
from parcompile.diagnostics import Diagnostic, SpecError
from parcompile.ir.lower import lower
from parcompile.passes.base import PassContext
from parcompile.passes.manager import PASSES, paused_gc, run_pass
from parcompile.passes.split_pipeline_stages import candidate_splits


@dataclass(frozen=True)
class Deployment:
    """One candidate deployment and its figures (seconds, tokens/s, bytes per GPU)."""

    tp: int
    pp: int
    replicas: int
    batch: int
    weight_dtype: str
    kv_dtype: str
    disaggregated: bool = False
    prefill_tp: int = 0
    prefill_replicas: int = 0
    split: tuple[int, ...] = ()
    fits: bool = True
    peak: int = 0
    capacity: int = 0
    ttft: float = math.inf
    tpot: float = math.inf
    tokens_per_s: float = 0.0
    meets: bool = False
    excess: float = math.inf

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.replicas + self.prefill_tp * self.prefill_replicas

    @property
    def per_gpu(self) -> float:
        """Output tokens/s per GPU."""
        return self.tokens_per_s / self.gpus

    @property
    def per_user(self) -> float:
        """Output tokens/s one request sees while it decodes (``1 / tpot``)."""
        return 1.0 / self.tpot if self.tpot > 0 else 0.0

    def degrees_text(self) -> str:
        """:meth:`text` (the name the layout search's candidates give it)."""
        return self.text()

    def text(self) -> str:
        """The deployment in words (``tp 4 x 2 replicas, fp8 weights``)."""
        parts = [f"tp {self.tp}"] + ([f"pp {self.pp}"] if self.pp > 1 else [])
        per = -(-self.batch // self.replicas)
        words = (" x ".join(parts) + f" x {self.replicas} replica{'s' if self.replicas > 1 else ''}"
                 f" of {per:,} sequence{'s' if per > 1 else ''}")
        if self.disaggregated:
            words = (f"decode {words} + prefill tp {self.prefill_tp} x {self.prefill_replicas} "
                     f"instance{'s' if self.prefill_replicas > 1 else ''}")
        dt = []
        if self.weight_dtype != "model":
            dt.append(f"{self.weight_dtype} weights")
        if self.kv_dtype == "fp8":
            dt.append("fp8 KV")
        return words + (f", {', '.join(dt)}" if dt else "")

    def overrides(self, cfg: SpecConfig) -> dict[str, Any]:
        """The spec keys that write this deployment out (``parcompile.compile(source,
        overrides=...)`` plans it): the layout, the serve keys, and the cluster sized to the
        deployment's GPUs where it takes fewer than the cluster's."""
        out: dict[str, Any] = {"parallel.tp": self.tp, "parallel.pp": self.pp, "parallel.dp": self.replicas,
                               "serve.batch": self.batch, "serve.weight_dtype": self.weight_dtype,
                               "serve.kv_dtype": self.kv_dtype, "serve.disaggregated": self.disaggregated}
        if self.split:
            out["parallel.stage_layers"] = list(self.split)
        if self.disaggregated:
            out["serve.prefill_tp"] = self.prefill_tp
            out["serve.prefill_replicas"] = self.prefill_replicas
        nodes, gpn = deployment_cluster(cfg, self)
        if (nodes, gpn) != (cfg.cluster.nodes, cfg.cluster.gpus_per_node):
            out["cluster.nodes"], out["cluster.gpus_per_node"] = nodes, gpn
        return out


def deployment_cluster(cfg: SpecConfig, d: Deployment) -> tuple[int, int] | None:
    """``(nodes, gpus_per_node)`` of the cluster a deployment is planned on: the spec's when
    it takes all of its GPUs; inside one node, that node's GPUs it takes; else its GPUs in
    nodes of the most GPUs (at most the cluster's per node) that hold whole tensor-parallel
    groups (decode and prefill). None when no such nodes hold it."""
    cl = cfg.cluster
    g = d.gpus
    if g == cl.nodes * cl.gpus_per_node:
        return cl.nodes, cl.gpus_per_node
    if g <= cl.gpus_per_node:
        return 1, g
    for gpn in range(cl.gpus_per_node, 0, -1):
        if g % gpn == 0 and gpn % d.tp == 0 and (not d.prefill_tp or gpn % d.prefill_tp == 0):
            return g // gpn, gpn
    return None


@dataclass
class ServeSearch:
    """What the sizing search found (module docstring): ``candidates`` those that fit and
    meet the targets, best first; ``fitting_all`` every one that fits memory and carries the
    load; ``evaluated`` how many were costed."""

    cfg: SpecConfig
    candidates: list[Deployment]
    evaluated: int
    seconds: float
    graphs: int = 0
    fitting_all: list[Deployment] = field(default_factory=list)

    @property
    def enumerated(self) -> int:
        return self.evaluated

    @property
    def valid(self) -> int:
        return self.evaluated

    @property
    def fitting(self) -> int:
        """How many deployments fit memory and carry the load (targets or not)."""
        return len(self.fitting_all)

    @property
    def meeting(self) -> list[Deployment]:
        """The deployments that fit and meet the targets, best first (tokens/s per GPU)."""
        return [d for d in self.candidates if d.meets]

    @property
    def best(self) -> Deployment | None:
        m = self.meeting
        return m[0] if m else None

    @property
    def fewest(self) -> Deployment | None:
        """The fewest GPUs that carry the load within the targets (the most tokens/s per GPU
        among those)."""
        m = self.meeting
        return min(m, key=lambda d: (d.gpus, -d.per_gpu)) if m else None

    @property
    def nearest(self) -> Deployment | None:
        """The fitting deployment closest to the targets (the smallest relative excess)."""
        return min(self.fitting_all, key=lambda d: (d.excess, -d.per_gpu)) if self.fitting_all else None

    def pareto(self) -> list[Deployment]:
        """The fitting deployments no other beats on both tokens/s per GPU and per user,
        by tokens/s per user."""
        pts = sorted(self.fitting_all, key=lambda d: (-d.per_user, -d.per_gpu))
        out: list[Deployment] = []
        best_gpu = -1.0
        for d in pts:
            if d.per_gpu > best_gpu * (1 + 1e-12):
                out.append(d)
                best_gpu = d.per_gpu
        return out

    def config(self, d: Deployment | int = 0) -> SpecConfig:
        """The spec's config with deployment ``d`` (or the ``d``-th ranked; its keys as
        :meth:`Deployment.overrides`)."""
        return apply_deployment(self.cfg, self.candidates[d] if isinstance(d, int) else d)

    def table(self, top: int = 10) -> str:
        """The ranked deployments, the fewest GPUs that carry the load and the Pareto front,
        as ``parcompile search`` prints them."""
        sv = self.cfg.serve
        targets = ", ".join(x for x in (f"TTFT <= {_ms(sv.ttft_target)}" if sv.ttft_target else "",
                                        f"TPOT <= {_ms(sv.tpot_target)}" if sv.tpot_target else "") if x) or "none"
        load = (f"{sv.clients} concurrent users" if sv.request_rate is None else
                f"{sv.clients} requests at once" if math.isinf(sv.request_rate) else f"{sv.request_rate:g} requests/s")
        head = (f"{self.cfg.name}: {sv.prompt_len:,} tokens in / {sv.max_new_tokens:,} out, {load}, targets {targets}; "
                f"{self.evaluated:,} deployments of up to {self.cfg.cluster.nodes * self.cfg.cluster.gpus_per_node} "
                f"GPUs costed, {self.fitting:,} fit memory with a steady state, {len(self.candidates):,} meet the targets "
                f"({self.seconds:.2f} s)")
        out = [head, ""]
        if self.candidates:
            out += _rows(self.candidates[:top], rank=True)
            few = self.fewest
            out += ["", f"fewest GPUs that carry the load within the targets: {few.gpus} ({few.text()}: TTFT {_ms(few.ttft)}, "
                        f"TPOT {_ms(few.tpot)}, {few.tokens_per_s:,.0f} tokens/s)"]
        else:
            near = self.nearest
            out.append("no deployment meets the targets" + (
                f"; nearest: {near.text()} on {near.gpus} GPUs (TTFT {_ms(near.ttft)}, TPOT {_ms(near.tpot)})"
                if near is not None else "; none fits memory"))
        front = self.pareto()
        if front:
            out += ["", "Pareto front (tokens/s per GPU against tokens/s per user):", ""]
            out += _rows(front, rank=False)
        return "\n".join(out)


def _ms(s: float | None) -> str:
    return "-" if s is None else seconds_text(s)


def _rows(ds: list[Deployment], rank: bool) -> list[str]:
    rows = [(("#",) if rank else ()) + ("deployment", "GPUs", "TTFT", "TPOT", "tok/s", "tok/s/GPU", "tok/s/user",
                                        "meets")]
    for i, d in enumerate(ds):
        rows.append(((str(i + 1),) if rank else ()) + (d.text(), str(d.gpus), _ms(d.ttft), _ms(d.tpot),
                                                        f"{d.tokens_per_s:,.0f}", f"{d.per_gpu:,.0f}",
                                                        f"{d.per_user:,.1f}", "yes" if d.meets else "no"))
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    return ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]


def apply_deployment(cfg: SpecConfig, d: Deployment) -> SpecConfig:
    """``cfg`` with deployment ``d``'s layout, serve keys and cluster."""
    nodes, gpn = deployment_cluster(cfg, d)
    par = cfg.parallel.model_copy(update={"tp": d.tp, "pp": d.pp, "dp": d.replicas, "expert_tp": d.tp,
                                          "stage_layers": tuple(d.split) if d.split else None, "auto": ()})
    sv = cfg.serve.model_copy(update={"batch": d.batch, "weight_dtype": d.weight_dtype, "kv_dtype": d.kv_dtype,
                                      "disaggregated": d.disaggregated, "auto": (),
                                      "prefill_tp": d.prefill_tp or None, "prefill_replicas": d.prefill_replicas or None,
                                      "weight_format": cfg.serve.weight_format if d.weight_dtype == cfg.serve.weight_dtype
                                      else None})
    cl = cfg.cluster.model_copy(update={"nodes": nodes, "gpus_per_node": gpn})
    return cfg.model_copy(update={"parallel": par, "serve": sv, "cluster": cl})


def needs_serve_search(cfg: SpecConfig) -> bool:
    """A serve spec with a layout key or a serve key written ``auto`` (``dp`` left out
    fills the cluster, as in training; ``dp = auto`` searches the replicas)."""
    return cfg.workload == "serve" and cfg.serve is not None and bool(
        set(cfg.parallel.auto) - {"dp"} or cfg.serve.auto or _dp_searched(cfg))


def _dp_searched(cfg: SpecConfig) -> bool:
    """``dp = auto`` written in the spec: the replicas are searched (else they fill the cluster)."""
    return "dp" in cfg.parallel.auto and "parallel.dp" in cfg.spans


# --------------------------------------------------------------------------- the costing


class _Graphs:
    """One one-stage graph per tensor-parallel degree and what is derived from it, cached."""

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.graphs: dict[int, tuple] = {}
        self.types: dict[int, dict] = {}
        self.units: dict[tuple, list] = {}
        self.parts: dict[tuple, WorkspaceParts] = {}
        self.work: dict[tuple, list] = {}
        self.stages: dict[tuple, list] = {}
        self.rates: dict[tuple, Rates] = {}
        self.pools: dict[tuple, tuple] = {}

    def graph(self, tp: int) -> tuple:
        got = self.graphs.get(tp)
        if got is None:
            c = _layout(self.cfg, tp, 1, 1, None)
            ctx = PassContext.of(c)
            g = lower(c.model, batch=c.parallel.micro_batch * c.parallel.dp, origin=c.span("model"), serve=True)
            for p in PASSES:
                if p.name == "schedule-pipeline":
                    break
                run_pass(p, g, ctx, check=False)
            got = self.graphs[tp] = (g, dict(ctx.degrees))
        return got

    def layer_units(self, cfg: SpecConfig, tp: int) -> list:
        fmt, fp8 = S.quant_of(cfg)
        kv = cfg.serve.kv_dtype
        key = (tp, fmt, fp8, kv)
        got = self.units.get(key)
        if got is None:
            model = cfg.model.dtype
            if kv != model:   # the model dtype's units, their cache bytes rescaled
                base = self.layer_units(cfg.model_copy(update={"serve": cfg.serve.model_copy(
                    update={"kv_dtype": model})}), tp)
                got = with_cache_dtype(base, DTYPE_BYTES[model], DTYPE_BYTES[kv])
            else:
                g, deg = self.graph(tp)
                got = layer_units(_layout(cfg, tp, 1, 1, None), g, deg, fmt, fp8, types=self.types.setdefault(tp, {}))
            self.units[key] = got
        return got

    def split(self, cfg: SpecConfig, tp: int, split: tuple[int, ...]) -> list:
        fmt, fp8 = S.quant_of(cfg)
        key = (tp, fmt, fp8, cfg.serve.kv_dtype, split)
        got = self.stages.get(key)
        if got is None:
            got = self.stages[key] = split_units(cfg, self.layer_units(cfg, tp), split)
        return got

    def workspace(self, cfg: SpecConfig, tp: int, split: tuple[int, ...]) -> list[int]:
        step = prefill_step(cfg)
        key = (tp, split, step, cfg.serve.kv_dtype)
        got = self.work.get(key)
        if got is None:
            pkey = (tp, step, cfg.serve.kv_dtype)
            parts = self.parts.get(pkey)
            if parts is None:
                g, deg = self.graph(tp)
                one = _layout(cfg, tp, 1, cfg.parallel.dp, None)
                parts = self.parts[pkey] = workspace_parts(one, g, {**deg, "dp": cfg.parallel.dp}, *step)
            got = self.work[key] = [w.total for w in stage_workspaces(cfg, parts, _stage_of(split))]
        return got

    def serve_rates(self, cfg: SpecConfig) -> Rates:
        par, cl = cfg.parallel, cfg.cluster
        key = (par.tp, par.pp, par.dp, S.quant_of(cfg)[1], cl.nodes, cl.gpus_per_node)
        got = self.rates.get(key)
        if got is None:
            got = self.rates[key] = _rates(cfg)
        return got


def _stage_of(split: tuple[int, ...]):
    """The stage of each layer id under ``split`` (layers per stage, in order)."""
    starts = list(itertools.accumulate(split[:-1], initial=0))
    return lambda layer: max(bisect.bisect_right(starts, layer) - 1, 0)


def _layout(cfg: SpecConfig, tp: int, pp: int, dp: int, split: tuple[int, ...] | None) -> SpecConfig:
    par = cfg.parallel.model_copy(update={"tp": tp, "pp": pp, "dp": dp, "expert_tp": tp, "auto": (),
                                          "stage_layers": split})
    return cfg.model_copy(update={"parallel": par})


def _split(layers: int, pp: int) -> tuple[int, ...]:
    if layers % pp == 0:
        return (layers // pp,) * pp
    return tuple(candidate_splits(layers, pp)[0])


def cost(cfg: SpecConfig, graphs: _Graphs, d: Deployment) -> Deployment:
    """Deployment ``d`` costed (module docstring): memory per GPU, the workload's steady
    state, whether it meets the targets and by how much it misses them."""
    c = apply_deployment(cfg, d)
    split = d.split or (c.model.layers,)
    stages = graphs.split(c, d.tp, split)
    cap = int(c.cluster.memory * (1 - c.cluster.memory_reserve))
    work = graphs.workspace(c, d.tp, split)
    kv_seq = kv_bytes_per_sequence(c, [list(range(sum(split[:i]), sum(split[:i + 1]))) for i in range(len(split))],
                                   c.serve.prompt_len + c.serve.max_new_tokens)
    free = [cap - st.held_bytes - w for st, w in zip(stages, work)]
    if any(f < k for f, k in zip(free, kv_seq)):
        return _replace(d, fits=False, peak=max(st.held_bytes + w + k for st, w, k in zip(stages, work, kv_seq)),
                        capacity=cap)
    per_tok = [st.kv_bytes_per_token for st in stages]
    tokens = S.paged_cache_tokens(S.kv_cache_limit(c, d.replicas), min(f // k for f, k in zip(free, per_tok) if k),
                                  c.serve.block_size)
    b = -(-c.serve.batch // d.replicas)
    whole = min(f // k for f, k in zip(free, kv_seq))   # sequences of the whole context the cache holds
    if b > whole and _searched_batch(cfg) and not c.serve.burst:
        # no more at once than the cache holds at their whole context: the plan's batch then fits
        return cost(cfg, graphs, _replace(d, batch=whole * d.replicas))
    peak = max(st.held_bytes + w + b * k for st, w, k in zip(stages, work, kv_seq))
    rates = graphs.serve_rates(c)
    work_load = S.replica_workload(c, tokens, d.replicas)
    decode = lambda step: S.step_seconds(stages, rates, step)   # noqa: E731
    try:
        if d.disaggregated:
            pool, side = _prefill(cfg, graphs, c)
            if not side.fits:
                return _replace(d, fits=False, peak=max(peak, side.weights + side.workspace), capacity=cap)
            times = disaggregated_state(work_load, pool, decode, replicas=d.replicas)
        else:
            times = steady_state(work_load, decode)
    except (Overloaded, ValueError):
        return _replace(d, fits=False, peak=peak, capacity=cap)
    return _scored(c, d, times, peak, cap)


def _scored(cfg: SpecConfig, d: Deployment, t: WorkloadTimes, peak: int, cap: int) -> Deployment:
    sv = cfg.serve
    tokens_per_s = t.request_rate * sv.max_new_tokens * d.replicas
    over = [t.ttft / sv.ttft_target - 1 if sv.ttft_target else -1.0,
            t.tpot / sv.tpot_target - 1 if sv.tpot_target else -1.0]
    excess = max(0.0, *over)
    return _replace(d, fits=True, peak=peak, capacity=cap, ttft=t.ttft, tpot=t.tpot, tokens_per_s=tokens_per_s,
                    meets=excess == 0.0, excess=excess)


def _replace(d: Deployment, **kw) -> Deployment:
    return replace(d, **kw)


def _rates(cfg: SpecConfig) -> Rates:
    """:func:`parcompile.analysis.serve.serve_rates` with the links from where the groups
    fall (no groups built)."""
    domain = getattr(cfg.cluster, "domain_size", None) or cfg.cluster.gpus_per_node
    par = cfg.parallel
    links = links_of(cfg.cluster, {a: axis_placement(par, a, domain) for a in AXIS_FAMILY}, efficiency(cfg.cluster))
    _fmt, fp8 = S.quant_of(cfg)
    return S.serve_rates(cfg, None, {"tp": par.tp, "pp": par.pp, "dp": par.dp, "cp": 1, "ep": 1, "expert_tp": par.tp},
                         fp8, links=links)


def _prefill(cfg: SpecConfig, graphs: _Graphs, c: SpecConfig):
    pcfg = S.prefill_config(c)
    tp, cl = pcfg.parallel.tp, c.cluster
    key = (tp, pcfg.parallel.dp, S.quant_of(pcfg), pcfg.serve.kv_dtype, cl.nodes, cl.gpus_per_node,
           c.parallel.world_size)
    got = graphs.pools.get(key)
    if got is None:
        whole = (pcfg.model.layers,)
        stages = graphs.split(pcfg, tp, whole)
        got = graphs.pools[key] = S.prefill_pool_from(c, pcfg, stages, graphs.serve_rates(pcfg),
                                                      graphs.workspace(pcfg, tp, whole)[0])
    return got


# --------------------------------------------------------------------------- the candidates


def _choices(cfg: SpecConfig) -> tuple[list[str], list[str], list[bool]]:
    """The weight dtypes, KV dtypes and disaggregation a search tries: the spec's, or where
    ``auto``: the model's dtype, FP8 where the GPUs hold FP8 (made on load from a 16-bit
    checkpoint), and where no 16-bit checkpoint is named (a checkpoint quantized so to be
    found) INT4 (AWQ / GPTQ) and, for gpt-oss, its published MXFP4 experts."""
    sv, m, cl = cfg.serve, cfg.model, cfg.cluster
    fp8 = bool(fp8_storage(cl.preset))
    if "weight_dtype" in sv.auto:
        sixteen_bit = bool(sv.weights and os.path.isdir(sv.weights) and not sv.quantized_checkpoint)
        wd = ["model"] + (["fp8"] if fp8 else [])
        if not sixteen_bit:
            wd += ["int4"] + (["mxfp4"] if m.experts and for_model(m).model_type == "gpt_oss" else [])
    else:
        wd = [sv.weight_dtype]
    kd = [m.dtype] + (["fp8"] if fp8 and m.dtype != "fp8" else []) if "kv_dtype" in sv.auto else [sv.kv_dtype]
    dis = [False, True] if "disaggregated" in sv.auto else [sv.disaggregated]
    return wd, kd, dis


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _searched_batch(cfg: SpecConfig) -> bool:
    """The spec leaves ``batch`` to the search (``auto``, or not given)."""
    return "batch" in cfg.serve.auto or "serve.batch" not in cfg.spans


def _batches(cfg: SpecConfig, replicas: int, disagg: bool) -> list[int]:
    """The ``batch`` values (sequences at once, all replicas) a deployment of ``replicas`` is
    costed at: the spec's when it gives one; else every client's request at once
    (``ceil(clients / replicas)`` a replica) and, for an aggregated deployment, a half and a
    quarter of that (fewer sequences a step: a shorter TPOT, requests queueing before
    their first token)."""
    sv = cfg.serve
    if not _searched_batch(cfg) or sv.burst:   # a burst's batch is its requests: the workload itself
        return [sv.batch]
    full = max(-(-sv.clients // replicas), 1)
    per = {full} if disagg else {full, max(1, full // 2), max(1, full // 4)}
    return [b * replicas for b in sorted(per, reverse=True)]


def deployments(cfg: SpecConfig, valid_tp: list[int]) -> Iterator[Deployment]:
    """Every candidate of the spec's ``auto`` keys (module docstring), before costing."""
    par, sv, cl, m = cfg.parallel, cfg.serve, cfg.cluster, cfg.model
    world = cl.nodes * cl.gpus_per_node
    auto = set(par.auto)
    tps = valid_tp if "tp" in auto else [par.tp]
    pps = [p for p in _divisors(world) if p <= m.layers] if "pp" in auto else [par.pp]
    wd, kd, dis = _choices(cfg)
    for disagg in dis:
        for tp in tps:
            for pp in (pps if not disagg else [1]):
                per = tp * pp
                if per > world:
                    continue
                if _dp_searched(cfg):
                    reps = range(1, world // per + 1)
                elif "dp" in auto:   # left out: the replicas fill the cluster (the prefill pool's GPUs aside)
                    reps = [world // per] if not disagg else range(1, world // per + 1)
                else:
                    reps = [par.dp]
                for r in reps:
                    split = _split(m.layers, pp) if pp > 1 else ()
                    pools = [(0, 0)]
                    if disagg:   # the prefill pool's tp and instances: the spec's, else what the GPUs left allow
                        left = world - per * r
                        ptps = [sv.prefill_tp] if "serve.prefill_tp" in cfg.spans else valid_tp
                        pools = [(ptp, n) for ptp in ptps for n in
                                 ([sv.prefill_replicas] if "serve.prefill_replicas" in cfg.spans
                                  else range(1, left // ptp + 1)) if 0 < ptp * n <= left]
                    for ptp, pn in pools:
                        shape = Deployment(tp, pp, r, 1, "model", m.dtype, disagg, ptp, pn, split)
                        if deployment_cluster(cfg, shape) is None:   # no nodes hold its groups whole
                            continue
                        for b in _batches(cfg, r, disagg):
                            for w in wd:
                                for k in kd:
                                    yield Deployment(tp, pp, r, b, w, k, disagg, ptp, pn, split)


def search_serve(cfg: SpecConfig, top: int = 10) -> ServeSearch:
    """Size the deployment of serve spec ``cfg`` (module docstring). Raises
    :class:`SpecError` when no candidate passes the checks."""
    from parcompile.layout_search.space import check_layout

    t0 = time.perf_counter()
    with paused_gc():
        graphs = _Graphs(cfg)
        world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
        valid_tp = []
        for tp in _divisors(min(world, cfg.cluster.gpus_per_node)):
            c = _layout(cfg, tp, 1, 1, None)
            if not any(x.severity == "error" for x in check_layout(c)):
                valid_tp.append(tp)
        if not valid_tp:
            raise SpecError([Diagnostic("error", "no tensor-parallel degree inside a node passes the checks",
                                        cfg.span("parallel.tp"), help="give `tp` to see why")])
        out = []
        evaluated = 0
        for d in deployments(cfg, valid_tp):
            evaluated += 1
            out.append(cost(cfg, graphs, d))
    fitting = list({_key(d): d for d in out if d.fits}.values())   # a batch capped to the cache: once
    ranked = sorted((d for d in fitting if d.meets), key=lambda d: (-d.per_gpu, d.gpus, d.tpot, d.ttft, d.text()))
    return ServeSearch(cfg, ranked, evaluated, time.perf_counter() - t0, len(graphs.graphs), fitting)


def _key(d: Deployment) -> tuple:
    return (d.tp, d.pp, d.replicas, d.batch, d.weight_dtype, d.kv_dtype, d.disaggregated, d.prefill_tp,
            d.prefill_replicas)


def resolve_serve(cfg: SpecConfig) -> tuple[SpecConfig, ServeSearch]:
    """The serve spec with its ``auto`` keys filled by the best deployment, and the search.
    Raises :class:`SpecError` (code ``does-not-fit``) when none meets the targets (or none
    fits), naming the nearest."""
    res = search_serve(cfg)
    if not res.candidates:
        raise SpecError([no_deployment_diagnostic(res)])
    return res.config(0), res


def no_deployment_diagnostic(res: ServeSearch) -> Diagnostic:
    """The error when no deployment fits and meets the targets: the nearest feasible point
    (the fitting deployment with the smallest excess over the targets) and what it misses."""
    cfg = res.cfg
    sv = cfg.serve
    near = res.nearest
    if near is None and sv.request_rate is not None and not sv.burst:
        return Diagnostic("error", f"no deployment of up to {cfg.cluster.nodes * cfg.cluster.gpus_per_node} GPUs "
                                   f"carries request_rate = {sv.request_rate:,.4g} requests/s: each has no steady state "
                                   f"({res.evaluated:,} costed)", cfg.span("serve.request_rate"),
                          help="lower the rate (`parcompile plan` of a deployment says what it carries), or give "
                               "the cluster more GPUs", code="does-not-fit")
    if near is None:
        return Diagnostic("error", f"no deployment of up to {cfg.cluster.nodes * cfg.cluster.gpus_per_node} GPUs "
                                   f"fits memory and carries the load ({res.evaluated:,} costed)",
                          cfg.span("cluster"), help="give the cluster more GPUs, GPUs with more memory, "
                                                    "or allow quantized weights (`weight_dtype = auto`)",
                          code="does-not-fit")
    miss = []
    if sv.ttft_target and near.ttft > sv.ttft_target:
        miss.append(f"TTFT {_ms(near.ttft)} > {_ms(sv.ttft_target)}")
    if sv.tpot_target and near.tpot > sv.tpot_target:
        miss.append(f"TPOT {_ms(near.tpot)} > {_ms(sv.tpot_target)}")
    key = "serve.ttft_target" if sv.ttft_target and near.ttft > sv.ttft_target else "serve.tpot_target"
    return Diagnostic("error", f"no deployment of up to {cfg.cluster.nodes * cfg.cluster.gpus_per_node} GPUs meets "
                               f"the targets: the nearest, {near.text()} on {near.gpus} GPUs, has " + ", ".join(miss),
                      cfg.span(key), help=f"nearest feasible: ttft_target = {_ms(near.ttft).replace(' ', ' ')}, "
                                          f"tpot_target = {_ms(near.tpot)} with {near.text()}; or more GPUs, "
                                          "fewer users, or shorter requests",
                      code="does-not-fit")


__all__ = ["Deployment", "ServeSearch", "apply_deployment", "cost", "deployment_cluster",
           "deployments", "needs_serve_search", "no_deployment_diagnostic", "resolve_serve", "search_serve"]
