"""The compiler, start to end: SpecConfig -> graph -> passes -> analyses -> Plan.

Reading :func:`compile_config` tells the whole story:

1. ``lower`` the model to the graph of one micro-batch (``ir/lower.py``);
2. run the passes, verifying the graph after each: ``shard-data-parallel``,
   ``shard-tensor-parallel``, ``shard-experts``, ``split-pipeline-stages``, ``insert-collectives``,
   ``schedule-pipeline``;
3. run the analyses: groups, parameters, compute, communication, memory, the estimate;
4. render them into the plan.json dict and wrap everything in a :class:`Plan`.

User mistakes the front end could not see (a schedule not supported yet, a layout
that does not divide) become :class:`SpecError` diagnostics at the spec's span; a plan
that does not fit memory is a warning (SPEC). Anything else that goes wrong inside a
pass is a :class:`PassError` naming the pass and the op.
"""

from __future__ import annotations

import contextlib
import gc
import math
from typing import Any, Iterator

from parcompile.analysis.buckets import buckets_to_dict
from parcompile.analysis.cost import analyze
from parcompile.analysis.serve import ServeReport, fit_advice, serve_report
from parcompile.config.checks import does_not_fit_help
from parcompile.config.schema import SpecConfig
from parcompile.core.heads import kv_head_replicas, kv_heads_per_rank
from parcompile.core.version import version
from parcompile.diagnostics import Diagnostic, SpecError
from parcompile.ir.graph import Graph
from parcompile.ir.lower import lower
from parcompile.ir.types import ShardingError
from parcompile.ir.verify import verify
from parcompile.passes.base import Pass, PassContext, PassError
from parcompile.passes.groups import stage_ranks
from parcompile.passes.insert_collectives import InsertCollectives
from parcompile.passes.schedule_pipeline import ScheduleReport, SchedulePipeline
from parcompile.passes.shard_data_parallel import ShardDataParallel
from parcompile.passes.shard_experts import ShardExperts
from parcompile.passes.shard_tensor_parallel import ShardTensorParallel
from parcompile.passes.split_pipeline_stages import SplitPipelineStages
from parcompile.plan import FORMAT, Plan, _gb

#: what the plan assumes of MoE token traffic (report.md's assumptions; docs/internals.md)
MOE_ROUTING = ("balanced: each rank receives as many (token, expert) rows as it sends, "
               "micro_batch * seq_len / (cp * tp) * top_k, for the all-to-alls over ep and the "
               "all-gathers / reduce-scatters over expert_tp; verify measures the rows actually routed")

PASSES: tuple[Pass, ...] = (
    ShardDataParallel(),
    ShardTensorParallel(),
    ShardExperts(),
    SplitPipelineStages(),
    InsertCollectives(),
    SchedulePipeline(),
)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector for a compile or a search. They allocate a few
    hundred thousand small, acyclic objects (graph nodes, types, rank lists), each
    allocation burst triggering full collections that scan all of them again (about a
    fifth of a large compile's time); reference counting frees them all the same. The
    collector's previous state is restored on exit."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run_pass(p: Pass, graph: Graph, ctx: PassContext, check: bool = True) -> None:
    """Apply one pass and verify the graph (unless ``check`` is false: the search's
    probes, whose passes a real compile of the chosen layout verifies); internal
    failures become :class:`PassError`."""
    try:
        p.apply(graph, ctx)
        if check:
            verify(graph, ctx.degrees)
    except SpecError:
        raise
    except ShardingError as e:
        axis = e.axis or "tp"
        raise SpecError([Diagnostic("error", f"{e} (in pass {p.name}, op {ctx.current_op})",
                                    ctx.cfg.span(f"parallel.{axis}"))]) from None
    except Exception as e:
        raise PassError(p.name, ctx.current_op or getattr(e, "op", None), e) from e


def compile_config(cfg: SpecConfig) -> Plan:
    """Compile a validated config into a :class:`Plan`.

    Raises:
        SpecError: something the front end cannot check (a schedule or model feature not
            supported yet, a sharding that does not divide).
        PassError: a bug inside a pass (names the pass and the op).
    """
    par, model = cfg.parallel, cfg.model
    ctx = PassContext.of(cfg)
    if model.experts > 0 and par.tp > 1 and not par.sequence_parallel:
        # Megatron-Core's rule: MoE with tensor parallelism dispatches sequence-parallel tokens
        raise SpecError([Diagnostic(
            "error", f"a mixture-of-experts model with tp = {par.tp} needs sequence_parallel = true",
            cfg.span("parallel.tp"), help="set sequence_parallel = true in the `parallel` block",
            note="each tp rank routes its own part of the sequence (Megatron-Core requires sequence "
                 "parallelism for MoE with tensor parallelism)")])

    # 1. lower
    graph = lower(model, batch=par.micro_batch * par.dp, origin=cfg.span("model"))
    verify(graph, ctx.degrees)

    # 2. passes
    for p in PASSES:
        run_pass(p, graph, ctx)
    sched: ScheduleReport = graph.meta["schedule"]

    # 3. analyses (parcompile/analysis/cost.py)
    cost = analyze(cfg, graph, ctx.degrees, sched)
    groups, params, compute, comm = cost.groups, cost.params, cost.compute, cost.comm
    memory, time, kv_tok = cost.memory, cost.time, cost.kv_bytes_per_token

    warnings = list(ctx.warnings)
    serve = None
    if cfg.workload == "serve" and cfg.serve is not None:
        serve = serve_report(cfg, graph.meta["chunks"], params.per_stage, groups)
        memory = serve.memory()
        _check_serve_fits(cfg, serve, warnings)
    elif not memory.fits:
        worst = max(memory.per_stage, key=lambda s: s.total)
        warnings.append(Diagnostic(
            "warning",
            f"the plan needs {_gb(worst.total)} per GPU on stage {worst.stage}, "
            f"more than the {_gb(memory.capacity)} available",
            cfg.span("cluster.memory"),
            help=does_not_fit_help(par, cfg.model.dtype),
            code="does-not-fit",
        ))

    # 4. plan.json
    chunks: list[list[int]] = graph.meta["chunks"]
    stages = []
    for s in range(par.pp):
        mine = [chunks[c * par.pp + s] for c in range(par.virtual_stages)]
        stages.append({
            "index": s,
            "layers": sorted(x for c in mine for x in c),
            "chunks": mine,
            "ranks": stage_ranks(groups["pp"], s),
            "params_per_rank": params.per_stage[s].total,
        })
    data: dict[str, Any] = {
        "format": FORMAT,
        "version": version(),
        "name": cfg.name,
        "workload": cfg.workload,
        "world_size": par.world_size,
        "degrees": {"dp": par.dp, "tp": par.tp, "pp": par.pp, "cp": par.cp, "ep": par.ep,
                    "expert_tp": par.expert_tp, "expert_dp": par.expert_dp,
                    "virtual_stages": par.virtual_stages},
        "order": par.order,
        "groups": groups,
        "model": {
            "params": params.params,
            "active_params": params.active_params,
            "padded_vocab": model.padded_vocab(par.tp),
            "kv_heads_per_rank": kv_heads_per_rank(model.kv_heads, par.tp),
            "kv_head_replicas": kv_head_replicas(model.kv_heads, par.tp),
            "layers": model.layers, "hidden": model.hidden, "heads": model.heads,
            "kv_heads": model.kv_heads, "head_dim": model.head_dim, "ffn_hidden": model.ffn_hidden,
            "vocab": model.vocab, "seq_len": model.seq_len, "dtype": model.dtype,
            "tie_embeddings": model.tie_embeddings,
        },
        "stages": stages,
        "schedule": {
            "name": sched.name,
            "num_microbatches": sched.num_microbatches,
            "bubble_fraction": time.bubble_fraction,
            "in_flight": sched.in_flight,
            "actions": sched.actions,
        },
        "memory": {
            "per_stage": [{"stage": x.stage, "params": x.params, "grads": x.grads, "optimizer": x.optimizer,
                           "activations": x.activations, "kv_cache": x.kv_cache, "buffers": x.buffers,
                           "buffer_parts": dict(x.buffer_parts), "total": x.total,
                           "activations_per_layer": [[layer, b] for layer, b in x.layer_activations]}
                          for x in memory.per_stage],
            "peak": memory.peak,
            "capacity": memory.capacity,
            "fits": memory.fits,
        },
        "comm": {
            "per_step": comm.per_step,
            "collectives": [c.to_dict() for c in comm.collectives],
        },
        "compute": {
            "model_flops_per_step": compute.model_flops_per_step,
            "hardware_flops_per_step": compute.hardware_flops_per_step,
        },
        "estimate": {
            "step_time": time.step_time,
            "tokens_per_s": time.tokens_per_s,
            "tflops_per_gpu": time.tflops_per_gpu,
            "mfu": time.mfu,
            "breakdown": time.breakdown,
            "assumptions": ({**time.assumptions, "moe_routing": MOE_ROUTING} if model.experts else time.assumptions),
        },
    }
    if cfg.workload == "train":
        # the gradient buckets of each stage (analysis/buckets.py) and how much of their
        # reduction the backward hides (analysis/estimate.py: grad_overlap)
        data["comm"]["grad_buckets"] = {
            "bucket_size": par.bucket_size,
            "reduce_dtype": par.reduce_dtype,
            "per_stage": [buckets_to_dict(sp, par.bucket_size) for sp in params.per_stage],
        }
        data["estimate"]["grad_reduction"] = [g.to_dict() for g in time.grad_reduction]
    if serve is not None:
        data["serve"] = serve.to_dict()
        assert data["serve"]["kv_bytes_per_token"] == max(kv_tok)
    return Plan(cfg, graph, data, warnings, dict(ctx.degrees))


def _check_serve_fits(cfg: SpecConfig, rep: ServeReport, warnings: list[Diagnostic]) -> None:
    """Serving memory: an error when not even one sequence of ``prompt_len +
    max_new_tokens`` tokens fits beside the weights (with what would fit), a
    ``does-not-fit`` warning when the whole batch does not."""
    worst = max(rep.stages, key=lambda s: s.weights + s.workspace + s.kv_cache)
    if not rep.one_sequence_fits:
        one = max(rep.stages, key=lambda s: s.weights + s.workspace + rep.context * s.kv_bytes_per_token)
        need = one.weights + one.workspace + rep.context * one.kv_bytes_per_token
        advice = fit_advice(cfg, rep)
        raise SpecError([Diagnostic(
            "error",
            f"one sequence of {rep.context:,} tokens does not fit: stage {one.stage} needs {_gb(need)} per GPU "
            f"(weights {_gb(one.weights)}, workspace {_gb(one.workspace)}, KV cache "
            f"{_gb(rep.context * one.kv_bytes_per_token)}), {_gb(rep.capacity)} are usable",
            cfg.span("serve.prompt_len"),
            help=("would fit: " + "; ".join(advice)) if advice else "use GPUs with more memory",
            code="does-not-fit")])
    if not rep.batch_fits:
        seqs = rep.max_concurrent_tokens // rep.context
        warnings.append(Diagnostic(
            "warning",
            f"the KV cache of batch {rep.batch_per_replica} per replica needs {_gb(worst.kv_cache)} per GPU on "
            f"stage {worst.stage}; {_gb(max(worst.free_for_kv, 0))} are left beside the weights",
            cfg.span("serve.batch"),
            help=f"at most {seqs} sequences of {rep.context:,} tokens fit ({rep.max_concurrent_tokens:,} tokens "
                 f"of cache); lower batch, raise tp or pp, or set kv_dtype = fp8",
            code="does-not-fit"))
