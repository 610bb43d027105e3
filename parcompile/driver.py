"""The compiler, start to end: spec text -> SpecConfig -> graph -> passes -> analyses -> Plan.

Reading this module top to bottom tells the whole story. :func:`compile_source` (what
``parcompile.compile`` calls) runs:

1. **parse** the spec's text into its AST (:func:`parcompile.frontend.parse_spec`);
2. **check**: build the resolved :class:`SpecConfig` and run every rule of the checks
   table, :data:`parcompile.frontend.checks.CHECKS` (:func:`parcompile.frontend.check_spec`);
   every error of the spec is raised at once, each at its span with a fix;
3. **search** the layouts when the spec writes ``auto`` layout keys
   (:func:`parcompile.layout_search.resolve`: the best layout the checks accept), adding the
   checks' warnings of the chosen layout;
4. **settle the split** of layers that do not divide into the model chunks
   (:func:`parcompile.layout_search.settle_split`, with a note);

then :func:`compile_config`, for a checked config:

5. ``lower`` the model to the graph of one micro-batch (``ir/lower.py``);
6. run the **passes**, verifying the graph after each: ``shard-data-parallel``,
   ``shard-tensor-parallel``, ``shard-experts``, ``split-pipeline-stages``, ``insert-collectives``,
   ``schedule-pipeline``;
7. run the **analyses**: groups, parameters, compute, communication, memory, the estimate
   (and for ``serve`` specs the serving memory and latency);
8. build **plan.json** from the models of :mod:`parcompile.plan_schema` (those that also
   publish its schema) and wrap everything in a :class:`Plan`.

Warnings come in that order: the checks', the search's, the split's note, the passes',
then the plan's (a plan that does not fit memory is a ``does-not-fit`` warning, SPEC).
Every user rule about the spec is a row of the checks table; the errors found later are
about results (serving memory that cannot hold one sequence) or a layout a pass cannot
shard, each a :class:`SpecError` at the spec's span. Anything else that goes wrong inside
a pass is a :class:`PassError` naming the pass and the op.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from parcompile.analysis.buckets import buckets_to_dict
from parcompile.analysis.cost import CostReport
from parcompile.analysis.lora import adapter_params, is_lora
from parcompile.analysis.offload import host_per_node
from parcompile.analysis.serve import (ServeReport, fit_advice, prefill_config, running_limit, running_tokens,
                                      serve_report)
from parcompile.frontend.checks import does_not_fit_help
from parcompile.config.presets import fp8_storage
from parcompile.config.schema import SpecConfig
from parcompile.analysis.kv import cache_heads
from parcompile.core.outputs import checkpoint_bytes, space_problem
from parcompile.core.units import bytes_text, seconds_text
from parcompile.core.version import version
from parcompile.diagnostics import Diagnostic, SpecError
from parcompile.frontend import check_source, check_spec, parse_spec
from parcompile.core.groups import stage_ranks
from parcompile.core.lora import targeted
from parcompile.passes.manager import compile_graph, paused_gc
from parcompile.passes.schedule_pipeline import ScheduleReport
from parcompile.plan import FORMAT, Plan
from parcompile.plan_schema import (Comm, Compute, Degrees, Estimate, Lora, Memory, Model, PlanJSON, Schedule,
                                    Search, Serve, Stage, StageMemory, Train, plan_dict)
from parcompile.layout_search import check_layout, needs_search, resolve, settle_split
from parcompile.layout_search.serve import needs_serve_search, resolve_serve

#: what the plan assumes of MoE token traffic (report.md's assumptions; docs/internals.md)
MOE_ROUTING = ("balanced: each rank receives as many (token, expert) rows as it sends, "
               "micro_batch * seq_len / (cp * tp) * top_k, for the all-to-alls over ep and the "
               "all-gathers / reduce-scatters over expert_tp; verify measures the rows actually routed")

def compile_source(source, filename: str | None = None, overrides: Mapping[str, Any] | None = None) -> Plan:
    """Compile a spec, text or a ``pathlib.Path``, to its :class:`Plan` (steps 1-8 of the
    module docstring); ``filename`` names text sources in diagnostics; ``overrides``
    (``{"parallel.tp": 4}``) are applied as if written in the spec
    (:mod:`parcompile.frontend.overrides`).

    Raises:
        SpecError: the spec has errors (all of them in ``.diagnostics``; ``.source`` holds
            the text they quote), or no layout of its ``auto`` keys fits memory (code
            ``does-not-fit``).
        TypeError: ``source`` is neither a str nor a ``pathlib.Path``, or ``overrides``
            not a mapping.
        PassError: a bug inside a pass (names the pass and the op).
    """
    check_source(source, filename)
    with paused_gc():
        # 1. parse (and apply the overrides)
        parsed = parse_spec(source, filename, overrides)
        try:
            # 2. check: the config, every rule of the checks table
            cfg, warnings = check_spec(parsed)
            # 3. search: the `auto` layout keys filled with the best layout the checks accept
            result = None
            if needs_serve_search(cfg):   # a serve spec's `auto`: the deployment that carries its load best
                cfg, result = resolve_serve(cfg)
            elif needs_search(cfg):
                cfg, result = resolve(cfg)
                seen = {(d.message, d.span) for d in warnings}
                warnings += [d for d in check_layout(cfg) if d.severity == "warning" and (d.message, d.span) not in seen]
            # 4. settle the split: layers that do not divide into the chunks are split unevenly
            cfg, split_note = settle_split(cfg)
            if split_note is not None:
                warnings.append(split_note)
            # 5-8. lower, passes, analyses, plan.json
            plan = compile_config(cfg, warnings=warnings, search=result)
        except SpecError as e:   # errors found after the front end quote the spec too
            e.source = e.source or parsed.sources
            raise
        plan.source = parsed.sources
        return plan


def compile_config(cfg: SpecConfig, warnings: list[Diagnostic] | tuple = (), search: Any = None) -> Plan:
    """Compile a checked config into a :class:`Plan` (steps 5-8 of the module docstring).

    ``warnings`` (the front end's, the search's, the split's note) come first in the plan's
    warnings; ``search`` (a :class:`parcompile.layout_search.SearchResult`) is the search that
    chose the layout, recorded as plan.json's ``search`` section.

    Raises:
        SpecError: what only the analyses show (serving memory that cannot hold one
            sequence) or a sharding a pass cannot make.
        PassError: a bug inside a pass (names the pass and the op).
    """
    par = cfg.parallel
    # 5. lower, 6. passes, 7. analyses (parcompile/passes/manager.py: the graph of one
    # micro-batch through PASSES, verified after each; parcompile/analysis/cost.py)
    compiled = compile_graph(cfg)
    graph, ctx, cost = compiled.graph, compiled.ctx, compiled.cost
    results = compiled.results
    sched: ScheduleReport = results.schedule.report

    # 7. serving: parcompile/analysis/serve.py
    warnings = list(warnings) + list(ctx.warnings)
    serve = None
    if cfg.workload == "serve" and cfg.serve is not None:
        prefill = None
        if cfg.serve.disaggregated:   # the prefill pool's instance, compiled as its own layout
            pcfg = prefill_config(cfg)
            pc = compile_graph(pcfg, schedule=False)
            prefill = (pcfg, pc.graph, pc.ctx.degrees, pc.cost.groups)
        serve = serve_report(cfg, results.chunks, cost.groups, graph, ctx.degrees, prefill)
        _check_serve_fits(cfg, serve, warnings, graph, ctx.degrees)
    elif not cost.memory.fits:
        worst = max(cost.memory.per_stage, key=lambda s: s.total)
        warnings.append(Diagnostic(
            "warning",
            f"the plan needs {bytes_text(worst.total)} per GPU on stage {worst.stage}, "
            f"more than the {bytes_text(cost.memory.capacity)} available",
            cfg.span("cluster.memory"),
            help=does_not_fit_help(par, cfg.model.dtype),
            code="does-not-fit",
        ))
    elif cost.memory.reserved_peak > cfg.cluster.memory:   # fits, but not with the allocator's cache
        worst = max(cost.memory.per_stage, key=lambda s: s.reserved)
        warnings.append(Diagnostic(
            "warning",
            f"the caching allocator would reserve {bytes_text(worst.reserved)} per GPU on stage {worst.stage} "
            f"({bytes_text(worst.allocator)} beyond the live tensors), more than the GPU's "
            f"{bytes_text(cfg.cluster.memory)}",
            cfg.span("cluster.memory"),
            help=("set expandable_segments = true (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), "
                  "or leave more of memory free" if not cfg.cluster.expandable_segments
                  else "leave more of memory free: the largest temporary buffer is "
                  + max(worst.buffer_parts, key=worst.buffer_parts.get)),
            code="reserved-exceeds-memory",
        ))

    if cfg.workload == "train":
        _check_checkpoint_space(cfg, cost.params.params)
        host = host_per_node(cfg, [x.host for x in cost.memory.per_stage]) if par.offload != "none" else 0
        if host > cfg.cluster.host_memory:   # offload: host memory per node (analysis/offload.py)
            warnings.append(Diagnostic(
                "warning", f"offload = {par.offload} keeps {bytes_text(host)} in host memory per node, more than "
                f"its {bytes_text(cfg.cluster.host_memory)}", cfg.span("parallel.offload"),
                help="shard over more ranks (zero, dp), or offload less (offload = optimizer)", code="host-memory"))

    # 8. plan.json
    data = plan_data(cfg, results.chunks, sched, cost, serve, search)
    plan = Plan(cfg, graph, data, warnings, dict(ctx.degrees), passes=results)
    plan.search = search
    return plan


def _check_checkpoint_space(cfg: SpecConfig, params: int) -> None:
    """The file system of ``checkpoint_dir`` holds one checkpoint of ``params`` parameters
    (:func:`parcompile.core.outputs.checkpoint_bytes`): else the first save, after the
    steps it follows, would fail. Raises :class:`SpecError` at the key."""
    t = cfg.train
    if t.checkpoint_dir is None:
        return
    need = checkpoint_bytes(params, cfg.model.dtype, t.optimizer)
    problem = space_problem(t.checkpoint_dir, need)
    if problem:
        raise SpecError([Diagnostic("error", f"checkpoint_dir: {problem}", cfg.span("train.checkpoint_dir"),
                                    help="free space there, or give a directory on a larger file system")])


def plan_data(cfg: SpecConfig, chunks: Sequence[Sequence[int]], sched: ScheduleReport, cost: CostReport,
              serve: ServeReport | None = None, search: Any = None) -> dict[str, Any]:
    """The plan.json dict of a compiled config, built section by section from the models
    of :mod:`parcompile.plan_schema` (validated as they are built) and dumped by
    :func:`~parcompile.plan_schema.plan_dict`.

    ``chunks``: the layer ids of each model chunk in model order (the passes' ``results.chunks``);
    ``sched``, ``cost``: the schedule pass's report and the analyses; ``serve``: the serving
    report of a ``serve`` spec (its memory replaces the training memory); ``search``: the
    search that chose the layout, if any.
    """
    par, model = cfg.parallel, cfg.model
    groups, params, compute, comm = cost.groups, cost.params, cost.compute, cost.comm
    memory, time = (serve.memory() if serve is not None else cost.memory), cost.time
    comm_section: dict[str, Any] = {"per_step": comm.per_step, "collectives": [c.to_dict() for c in comm.collectives]}
    estimate: dict[str, Any] = {
        "step_time": time.step_time,
        "tokens_per_s": time.tokens_per_s,
        "tflops_per_gpu": time.tflops_per_gpu,
        "mfu": time.mfu,
        "breakdown": time.breakdown,
        "assumptions": ({**time.assumptions, "moe_routing": MOE_ROUTING} if model.experts else time.assumptions),
    }
    if cfg.workload == "train":
        # the gradient buckets of each stage's trained parameters (analysis/buckets.py; with
        # LoRA the adapters', cost.trained) and how much of their reduction the backward
        # hides (analysis/estimate.py: grad_overlap, timed on the same buckets)
        comm_section["grad_buckets"] = {
            "bucket_size": par.bucket_size,
            "reduce_dtype": par.reduce_dtype,
            "per_stage": [buckets_to_dict(sp, par.bucket_size) for sp in cost.trained],
        }
        estimate["grad_reduction"] = [g.to_dict() for g in time.grad_reduction]
    extra: dict[str, Any] = {"train": _train_section(cfg, params)} if cfg.workload == "train" else {}
    if serve is not None:
        extra["serve"] = Serve(**serve.to_dict())
        assert extra["serve"].kv_bytes_per_token == max(cost.kv_bytes_per_token)
    if search is not None:
        spec = getattr(search, "cfg", cfg)   # the spec as written: its `auto` keys (the plan's config has none left)
        auto = list(spec.parallel.auto) + [f"serve.{k}" for k in (spec.serve.auto if spec.serve is not None else ())]
        extra["search"] = Search(auto=sorted(auto), chosen=search.best.degrees_text(),
                                 enumerated=search.enumerated, valid=search.valid, fitting=search.fitting)
    plan = PlanJSON(
        format=FORMAT,
        version=version(),
        name=cfg.name,
        workload=cfg.workload,
        world_size=par.world_size,
        degrees=Degrees(dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, expert_tp=par.expert_tp,
                        expert_dp=par.expert_dp, virtual_stages=par.virtual_stages),
        order=par.order,
        groups=groups,
        model=_model_section(cfg, params),
        stages=_stages_section(cfg, chunks, groups, params),
        schedule=Schedule(name=sched.name, num_microbatches=sched.num_microbatches,
                          bubble_fraction=time.bubble_fraction, in_flight=sched.in_flight,
                          **({"microbatch_group_size": par.microbatch_group_size or par.pp}
                             if par.pipeline_schedule.rounds and par.virtual_stages > 1 else {}),
                          actions=sched.actions),
        memory=_memory_section(cfg, memory),
        comm=Comm(**comm_section),
        compute=Compute(model_flops_per_step=compute.model_flops_per_step,
                        hardware_flops_per_step=compute.hardware_flops_per_step),
        estimate=Estimate(**estimate),
        **extra,
    )
    # the maps whose keys the analyses order keep that order (report.md lists them so)
    return plan_dict(plan, {("comm", "per_step"): list(comm.per_step),
                            ("estimate", "breakdown"): list(time.breakdown)})


def _stages_section(cfg: SpecConfig, chunks: Sequence[Sequence[int]], groups: dict, params) -> list[Stage]:
    """plan.json's ``stages``: per pipeline rank its model chunks' layers, ranks and
    parameters per rank."""
    par = cfg.parallel
    stages = []
    for s in range(par.pp):
        mine = par.pipeline_schedule.placement.layers(s, chunks, par.pp)
        stages.append(Stage(
            index=s, layers=sorted(x for c in mine for x in c), chunks=mine,
            ranks=stage_ranks(groups["pp"], s), params_per_rank=params.per_stage[s].total))
    return stages


def _model_section(cfg: SpecConfig, params) -> Model:
    """plan.json's ``model``: the model's dimensions and parameter counts."""
    par, model = cfg.parallel, cfg.model
    return Model(
        params=params.params,
        active_params=params.active_params,
        padded_vocab=model.padded_vocab(par.tp),
        kv_heads_per_rank=cache_heads(model, par.tp)[0],
        kv_head_replicas=cache_heads(model, par.tp)[1],
        layers=model.layers, hidden=model.hidden, heads=model.heads,
        kv_heads=model.kv_heads, head_dim=model.head_dim, ffn_hidden=model.ffn_hidden,
        vocab=model.vocab, seq_len=model.seq_len, dtype=model.dtype,
        tie_embeddings=model.tie_embeddings)


def _train_section(cfg: SpecConfig, params) -> Train:
    """plan.json's ``train``: the method, and the whole model's trainable and frozen
    parameters (LoRA: the adapters, :func:`parcompile.analysis.lora.adapter_params`, and the
    base model's ``params``)."""
    if not is_lora(cfg):
        return Train(method="full", trainable_params=params.params, frozen_params=0)
    t = cfg.train
    lins = targeted(cfg.model, t.lora_targets)
    return Train(method="lora", trainable_params=adapter_params(cfg), frozen_params=params.params,
                 lora=Lora(rank=t.lora_rank, alpha=t.lora_alpha, dropout=t.lora_dropout, adapted_linears=len(lins),
                           targets=list(dict.fromkeys(lin.hf_leaf for lin in lins))))


def _memory_section(cfg: SpecConfig, memory) -> Memory:
    """plan.json's ``memory`` from the memory report (a serve spec's: no allocator term)."""
    train = cfg.workload != "serve"
    return Memory(
        per_stage=[StageMemory(stage=x.stage, params=x.params, grads=x.grads, optimizer=x.optimizer,
                               activations=x.activations, kv_cache=x.kv_cache, buffers=x.buffers,
                               buffer_parts=dict(x.buffer_parts), total=x.total,
                               **({"allocator": x.allocator} if train else {}),
                               **({"host": x.host} if train and cfg.parallel.offload != "none" else {}),
                               activations_per_layer=[[layer, b] for layer, b in x.layer_activations])
                   for x in memory.per_stage],
        peak=memory.peak, capacity=memory.capacity, fits=memory.fits,
        **(dict(reserved_peak=memory.reserved_peak, device_memory=cfg.cluster.memory,
                expandable_segments=cfg.cluster.expandable_segments) if train else {}),
        **(dict(host_per_node=host_per_node(cfg, [x.host for x in memory.per_stage]),
                host_memory=cfg.cluster.host_memory) if train and cfg.parallel.offload != "none" else {}))


def _check_serve_fits(cfg: SpecConfig, rep: ServeReport, warnings: list[Diagnostic], graph, degrees) -> None:
    """Serving memory: an error when not even one sequence of ``prompt_len +
    max_new_tokens`` tokens fits beside the weights (with what would fit, from the plan's
    sharded ``graph`` on its mesh ``degrees``), a ``does-not-fit`` warning when the whole
    batch does not."""
    worst = max(rep.stages, key=lambda s: s.weights + s.workspace + s.kv_cache)
    sv = cfg.serve
    if not rep.one_sequence_fits and all(s.free_for_kv >= s.kv_per_sequence for s in rep.stages):
        raise SpecError([Diagnostic(   # the bytes fit; whole blocks do not
            "error", f"the KV cache holds {rep.kv_cache_tokens:,} tokens in blocks of {sv.block_size:,}, fewer than "
                     f"one request of {rep.context:,} tokens takes ({rep.request_tokens:,} in whole blocks)",
            cfg.span("serve.block_size"), help="use a smaller block_size (vLLM's default is 16)", code="does-not-fit")])
    if not rep.one_sequence_fits:
        one = max(rep.stages, key=lambda s: s.weights + s.workspace + s.kv_per_sequence)
        need = one.weights + one.workspace + one.kv_per_sequence
        advice = fit_advice(cfg, rep, graph, degrees)
        raise SpecError([Diagnostic(
            "error",
            f"one sequence of {rep.context:,} tokens does not fit: stage {one.stage} needs {bytes_text(need)} per GPU "
            f"(weights {bytes_text(one.weights)}, workspace {bytes_text(one.workspace)}, KV cache "
            f"{bytes_text(one.kv_per_sequence)}), {bytes_text(rep.capacity)} are usable",
            cfg.span("serve.prompt_len"),
            help=("would fit: " + "; ".join(advice)) if advice else "use GPUs with more memory",
            code="does-not-fit")])
    if rep.overload is not None:
        rate, cap, limit = rep.overload
        raise SpecError([Diagnostic(
            "error", f"request_rate = {rate:g} requests/s has no steady state: the deployment completes at most "
                     f"{cap:.3g} requests/s (at most {limit:,} sequences at once on each of {rep.replicas} "
                     f"replica(s): batch, the engine's default, or what the KV cache holds)",
            cfg.span("serve.request_rate"),
            help=f"nearest feasible: request_rate = {cap * 0.9:.3g} (90% of it); or more replicas (dp), a larger "
                 "batch, or `parcompile search` with dp = auto to size the deployment",
            code="overloaded")])
    if sv.kv_cache_tokens is not None and sv.kv_cache_tokens > rep.max_concurrent_tokens:
        warnings.append(Diagnostic(
            "warning", f"kv_cache_tokens = {sv.kv_cache_tokens:,} does not fit: the memory left beside the weights "
                       f"and workspace holds {rep.max_concurrent_tokens:,} tokens of KV cache, which is what the "
                       f"server would allocate ({rep.kv_cache_tokens:,} in whole blocks)",
            cfg.span("serve.kv_cache_tokens"), help=f"set kv_cache_tokens <= {rep.kv_cache_tokens:,}, or leave it "
                                                    "out for what the running sequences use", code="does-not-fit"))
    for key, target, got, what in (("ttft_target", sv.ttft_target, rep.ttft, "time to first token"),
                                   ("tpot_target", sv.tpot_target, rep.tpot, "time per output token")):
        if target is not None and rep.times is not None and got > target:
            warnings.append(Diagnostic(
                "warning", f"the plan's {what}, {seconds_text(got)}, exceeds {key} = {seconds_text(target)}",
                cfg.span(f"serve.{key}"),
                help="`parcompile search` with `tp`, `pp`, `dp` (and `weight_dtype`, `kv_dtype`) = auto finds "
                     "the deployments that meet it", code="misses-target"))
    _check_host_kv(cfg, rep, warnings)
    if not rep.batch_fits:
        seqs = rep.max_concurrent_tokens // rep.context
        warnings.append(Diagnostic(
            "warning",
            f"the KV cache of batch {rep.batch_per_replica} per replica needs {bytes_text(worst.kv_cache)} per GPU on "
            f"stage {worst.stage}; {bytes_text(max(worst.free_for_kv, 0))} are left beside the weights",
            cfg.span("serve.batch"),
            help=f"at most {seqs} sequences of {rep.context:,} tokens fit ({rep.max_concurrent_tokens:,} tokens "
                 f"of cache); lower batch, raise tp or pp"
                 + (", or set kv_dtype = fp8" if rep.kv_dtype != "fp8" and fp8_storage(cfg.cluster.preset) else ""),
            code="does-not-fit"))


#: the share of a rank's host memory (the `cpu` preset's ``memory``: the machine's available
#: memory shared by its ranks) past which the server's KV cache draws a warning (issue 47)
HOST_KV_SHARE = 0.5


def _check_host_kv(cfg: SpecConfig, rep: ServeReport, warnings: list[Diagnostic]) -> None:
    """On the `cpu` preset, a ``host-memory`` warning at ``serve.kv_cache_tokens`` (or the
    `serve` block) when the paged KV cache the server allocates on its most loaded rank
    (``kv_cache_tokens x kv_bytes_per_token``) exceeds :data:`HOST_KV_SHARE` of the memory
    each rank has on this machine."""
    cl = cfg.cluster
    cache = rep.kv_cache_tokens * rep.kv_bytes_per_token
    if cl.preset != "cpu" or cache <= HOST_KV_SHARE * cl.memory:
        return
    seqs = running_tokens(cfg, rep.replicas)     # the default's rule (analysis/serve.py kv_cache_limit)
    warnings.append(Diagnostic(
        "warning", f"the server's KV cache of {rep.kv_cache_tokens:,} tokens takes {bytes_text(cache)} per rank, more "
                   f"than {HOST_KV_SHARE:.0%} of the {bytes_text(cl.memory)} of this machine's memory each of its "
                   f"{cl.gpus_per_node} rank(s) has", cfg.span("serve.kv_cache_tokens"),
        help=f"set kv_cache_tokens = {seqs:,} (what {running_limit(cfg, rep.replicas)} running sequences of "
             f"{rep.context:,} tokens use, the default without it) or "
             f"less, or lower batch", code="host-memory"))
