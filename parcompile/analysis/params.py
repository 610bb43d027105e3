"""Parameter counts from the graph.

* ``params``: the model's parameters, with the *unpadded* vocabulary and a tied
  embedding counted once (the number papers and model cards quote).
* ``active_params``: the same, counting only ``top_k`` routed experts per MoE layer.
* per pipeline rank: the parameters one rank of that stage holds, with the padded
  vocabulary, split by tensor/expert parallelism; a tied head is counted on the first and
  on the last stage when pp > 1 (the last stage holds a copy), once when pp = 1. When a
  serving plan replicates kv heads (tp a multiple of kv_heads, vLLM), the graph keeps the
  kv projections unsplit; each rank still holds only its one (replicated) kv head, so
  those parameters count ``numel / kv_heads`` per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from parcompile.ir.fp8 import is_fp8_gemm
from parcompile.core.buckets import GradUnit, unit_order_key
from parcompile.core.schedule import Placement
from parcompile.ir.graph import Graph


@dataclass(frozen=True)
class StageParams:
    """Parameter elements on one rank of a stage: ``dense`` (reduced over dp_cp),
    ``expert`` (reduced over expert_dp), ``norm`` (replicated over tp: the ones sequence
    parallelism must all-reduce), ``embedding`` (local elements of the tied embedding or
    its head copy, 0 when untied), ``tp_partial`` (replicated elements whose gradients
    are partial sums over tp without sequence parallelism too: qk-norm weights, shared by
    heads tp splits; ``Param.grad_partial``); ``units``: the same elements by layer, in
    gradient-ready order (:class:`~parcompile.analysis.buckets.GradUnit`, the input of the
    bucket rule; empty when not derived)."""

    stage: int
    dense: int
    expert: int
    norm: int
    embedding: int
    units: tuple[GradUnit, ...] = ()
    tp_partial: int = 0
    #: elements of the weights of the GEMMs that run in FP8 under ``precision = fp8``
    #: (:func:`parcompile.ir.fp8.is_fp8_gemm`; part of ``dense`` and ``expert``),
    #: counted whatever the precision
    fp8: int = 0
    #: how many dense weights ``fp8`` counts (one scale each: FP8 all-gather's amax all-reduce;
    #: ZeRO-3 gathers the experts' weights in 16 bits, as torchao's FSDP float8 all-gather
    #: covers its Float8Linear weights only)
    fp8_weights: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.expert


@dataclass(frozen=True)
class ParamReport:
    """See module docstring. ``per_stage`` is indexed by pipeline rank."""

    params: int
    active_params: int
    per_stage: tuple[StageParams, ...]


def model_params(graph: Graph) -> int:
    """Unique parameters of the model function (unpadded; tied copies excluded)."""
    seen: dict[str, int] = {}
    for _, p in graph.params():
        if p.tied_to is None or p.tied_to == p.name:
            if p.tied_to == p.name:  # the head reading the embedding itself (pp = 1)
                continue
            seen.setdefault(p.name, p.numel)
    return sum(seen.values())


def stage_params(graph: Graph, degrees: Mapping[str, int], pp: int, tied: bool,
                 replicated_kv_heads: int = 0) -> list[StageParams]:
    """Per pipeline rank, the parameter elements one rank holds (padded, sharded).

    ``replicated_kv_heads``: the model's kv heads when a serving plan replicates them over
    tp (each rank then holds one kv head of every parameter with a ``kv`` dim), else 0.
    """
    acc = [{"dense": 0, "expert": 0, "norm": 0, "embedding": 0, "tp_partial": 0, "fp8": 0,
            "fp8_weights": 0} for _ in range(pp)]
    # (chunk, name) -> [dense, expert, fp8]
    units: list[dict[tuple[int, str], list[int]]] = [{} for _ in range(pp)]
    seen: set[tuple[int, str]] = set()
    for nd, p in graph.params():
        s = nd.stage or 0
        if (s, p.name) in seen:
            continue
        seen.add((s, p.name))
        n = p.sharding.local_type(p.type, degrees).numel
        if replicated_kv_heads and p.type.has_dim("kv") and not p.sharding.split:
            n //= replicated_kv_heads   # one replicated kv head per rank (vLLM)
        acc[s]["expert" if p.expert else "dense"] += n
        unit = units[s].setdefault((Placement.local(nd.chunk or 0, pp), _unit_name(nd, p, tied and pp > 1)), [0, 0, 0])
        unit[1 if p.expert else 0] += n
        if is_fp8_gemm(nd, graph) and p.name.endswith("weight"):
            acc[s]["fp8"] += n
            if not p.expert:   # FP8 all-gather moves the dense FP8 weights (unit[2]); experts' in 16 bits
                acc[s]["fp8_weights"] += 1
                unit[2] += n
        if not p.sharding.split and not p.expert and nd.op.attr("tp") != "replicated":
            # replicated over tp (norms, row-parallel biases, learned positions): under
            # sequence parallelism each tp rank sees part of the sequence, so these
            # gradients are partial sums that the step all-reduces over tp (Megatron-LM).
            # Not the ops of tp style `replicated` (MLA's down projections and latent norms):
            # they run on the whole gathered sequence, their gradients whole on every rank
            acc[s]["norm"] += n
        if "tp" in p.grad_partial:
            acc[s]["tp_partial"] += n
        if tied and (p.name == "embedding.weight" or p.tied_to == "embedding.weight"):
            acc[s]["embedding"] = n
    out = []
    for s, a in enumerate(acc):
        nchunks = 1 + max((c for c, _ in units[s]), default=0)
        keys = sorted(units[s], key=lambda k: unit_order_key(k[0], k[1], nchunks))
        us = tuple(GradUnit(c, name, *units[s][(c, name)][:2], alone=name in ("tied_embedding", "tied_head"),
                            fp8=units[s][(c, name)][2])
                   for c, name in keys)
        out.append(StageParams(s, **a, units=us))
    return out


def _unit_name(nd, p, tied_copies: bool) -> str:
    """The bucket unit of parameter ``p`` of op ``nd`` (:mod:`parcompile.analysis.buckets`):
    its decoder layer, the output layer, the embedding; with ``tied_copies`` (tied
    embeddings and pp > 1) the embedding and its head copy are units of their own."""
    if tied_copies and (p.name == "embedding.weight" or p.tied_to == "embedding.weight"):
        return "tied_embedding" if nd.op.module == "embedding" else "tied_head"
    if nd.op.layer is not None:
        return f"layers.{nd.op.layer}"
    return "output" if nd.op.module in ("final_norm", "lm_head") else "embedding"


def param_report(graph: Graph, degrees: Mapping[str, int], pp: int, tied: bool,
                 experts: int = 0, top_k: int = 0, replicated_kv_heads: int = 0) -> ParamReport:
    """Build the :class:`ParamReport` (expert weights scale by ``top_k / experts`` for
    ``active_params``)."""
    total = model_params(graph)
    expert = 0
    seen = set()
    for _, p in graph.params():
        if p.expert and p.name not in seen:
            seen.add(p.name)
            expert += p.numel
    active = total - expert + (expert * top_k // experts if experts else 0)
    return ParamReport(total, active, tuple(stage_params(graph, degrees, pp, tied, replicated_kv_heads)))
