"""All analyses of a compiled graph in one call: parameters, FLOPs, communication,
memory and the step-time estimate (the driver's step 3).

:func:`analyze` works with or without the schedule pass: given its
:class:`~parcompile.core.schedule.ScheduleReport`, memory takes the simulated
``in_flight`` and the estimate simulates the action lists; without it (a graph run up
to ``insert-collectives``) both use the closed forms of
:func:`parcompile.analysis.memory.closed_form_in_flight` and
:func:`parcompile.analysis.estimate.estimate`, so a layout can be costed before (or
without) building its schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from parcompile.analysis import kv
from parcompile.analysis.comm import CommReport, comm_report
from parcompile.analysis.gemm import gemm_pricer
from parcompile.analysis.compute import ComputeReport, compute_report
from parcompile.analysis.estimate import TimeReport, estimate
from parcompile.ir.fp8 import enabled as fp8_enabled
from parcompile.analysis.memory import MemoryReport, memory_report
from parcompile.analysis.lora import frozen_backward, lora_step_flops, trainable, with_adapter_collectives
from parcompile.analysis.params import ParamReport, StageParams, param_report
from parcompile.core.attention import attention_engine
from parcompile.core.groups import rank_groups
from parcompile.core.heads import kv_heads_replicated
from parcompile.ir.graph import Graph


@dataclass(frozen=True)
class CostReport:
    """The typed reports plan.json and report.md are rendered from."""

    groups: dict
    params: ParamReport
    compute: ComputeReport
    comm: CommReport
    memory: MemoryReport
    time: TimeReport
    kv_bytes_per_token: list[int]
    #: the parameters of one rank of each stage that have gradients
    #: (:func:`~parcompile.analysis.lora.trainable`: with LoRA the adapters only), what the
    #: gradient buckets, their reduction and the optimizer cover
    trained: tuple[StageParams, ...]


def analyze(cfg, graph: Graph, degrees, chunks: Sequence[Sequence[int]], sched=None,
            compute: ComputeReport | None = None, comm: CommReport | None = None) -> CostReport:
    """Run every analysis on ``graph`` (passes up to ``insert-collectives`` at least).

    ``chunks``: the layer ids of each model chunk (``split-pipeline-stages``' result);
    ``sched``: the schedule pass's :class:`~parcompile.core.schedule.ScheduleReport`, or None
    (the closed forms); ``compute``, ``comm``: the reports the schedule pass timed the chunks
    with, reused (the same arguments), else computed here."""
    par, model = cfg.parallel, cfg.model
    groups = rank_groups(par)
    replicated = model.kv_heads if kv_heads_replicated(model.kv_heads, par.tp) else 0
    params = param_report(graph, degrees, par.pp, model.tie_embeddings, model.experts, model.top_k, replicated)
    m = par.num_microbatches if sched is None else sched.num_microbatches
    if compute is None or not compute.chunk_fwd_traffic:
        compute = compute_report(graph, degrees, par.pp * par.virtual_stages, model.vocab,
                                 model.padded_vocab(par.tp), m, par.recompute, cfg.cluster.engine,
                                 attention_engine(cfg.cluster), fp8=fp8_enabled(cfg), gemm=gemm_pricer(cfg))
    compute = lora_step_flops(cfg, graph, compute, m)   # LoRA: frozen weights have no weight-gradient GEMM
    if comm is None or sched is None:
        comm = comm_report(graph, degrees, m, par.recompute, par.pp, *frozen_backward(cfg, graph))
    comm = with_adapter_collectives(cfg, degrees, comm, m, graph)   # LoRA's tp collectives
    kv_tok = kv.kv_bytes_per_token(cfg, chunks)
    in_flight = sched.sim.in_flight if sched is not None else None
    kv_seq = (kv.kv_bytes_per_sequence(cfg, chunks, cfg.serve.prompt_len + cfg.serve.max_new_tokens)
              if cfg.serve is not None else None)
    memory = memory_report(graph, cfg, degrees, params.per_stage, in_flight, kv_seq)
    trained = tuple(trainable(cfg, degrees, sp) for sp in params.per_stage)   # LoRA: the adapters
    time = estimate(cfg, degrees, groups, sched, comm, compute.model_flops_per_step, compute, trained)
    return CostReport(groups, params, compute, comm, memory, time, kv_tok, trained)
