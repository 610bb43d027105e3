"""``insert-collectives``: make every edge's layouts agree, with one generic rule.

1. Stage changes: a tensor read on another model chunk than the one producing it goes
   through one ``send_recv`` op per (tensor, receiving chunk): a send of activations and
   a receive of their gradient on the producer's pipeline rank, the mirror on the
   consumer's.
2. Layout changes: for every edge, the forward conversion ``convert(producer layout,
   consumer requirement)`` and the backward one ``convert(gradient layout the consumer
   returns, dual(producer layout))`` (:func:`parcompile.ir.ops.convert`). When either is
   not empty, one ``redistribute`` op carries both; consumers of the same tensor that
   need the same conversion share it (wq/wk/wv share one "copy to tensor-parallel
   region", whose backward is the all-reduce). The op's ``where`` is the producer's
   module for a forward reduction (``wo``, ``w2``, the embedding) or a local split (the
   scatter into the sequence-parallel region), the first consumer's otherwise (the QKV
   and MLP inputs, the head). Layout changes are inserted before stage changes, and a
   producer's conversion (a reduction or a local split) runs on the producer's model
   chunk: an embedding-only first chunk reduces (or reduce-scatters) the embedding before
   it sends it, as Megatron-LM's embedding does.
3. Step collectives, once per step per rank of a stage: the gradient reduction over
   ``dp_cp``, one per gradient bucket (:mod:`parcompile.analysis.buckets`; an all-reduce
   of the bucket's fp32 gradients; with ZeRO >= 1 a reduce-scatter of it and an
   all-gather of the updated parameters, which ZeRO-3 runs before their use instead:
   ``2 m`` times per step for a bucket of decoder layers with ``pp = 1``), the same over
   ``expert_dp`` for MoE expert weights, the tied-embedding
   all-reduce over ``embedding``, sequence-parallel norm gradients over ``tp`` (without
   sequence parallelism: the qk-norm gradients, partial over ``tp``), the
   squared gradient norm over ``tp`` and ``pp`` (and, for expert weights, over
   ``expert_dp`` with ZeRO, ``ep`` and ``expert_tp``), the logged loss over ``dp_cp``.

Nothing is inserted on an axis of degree 1. Returns a
:class:`~parcompile.passes.results.CollectivesInserted` (the stages' parameters the step
collectives were sized from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parcompile.core.recompute import is_module_list
from parcompile.ir.recompute import node_modules
from parcompile.analysis.buckets import (head_reads_embedding, reduce_counts,
                                        reshard_after_forward, stage_buckets,
                                        zero3_gather_counts)
from parcompile.analysis.comm import CollectiveEntry
from parcompile.analysis.estimate import grad_element_bytes
from parcompile.ir.fp8 import gathers_fp8
from parcompile.analysis.lora import frozen_gathers, trainable
from parcompile.analysis.params import stage_params
from parcompile.core.axes import FOUND_INF_AXES
from parcompile.core.buckets import fp8_gather_elements
from parcompile.core.data_parallel import data_parallel_sharding, shard_degree
from parcompile.core.dtypes import GRAD_BYTES
from parcompile.ir.graph import Graph
from parcompile.ir.ops import COMM_KINDS, Trait, convert, dual, spec
from parcompile.passes.base import PassContext
from parcompile.passes.results import CollectivesInserted


def _insert_send_recv(graph: Graph, ctx: PassContext) -> None:
    for u in ctx.visit(graph.topological()):
        pu = graph.node(u)
        by_chunk: dict[int, list[tuple[str, int]]] = {}
        for v, k in graph.users(u):
            c = graph.node(v).chunk
            if c != pu.chunk:
                by_chunk.setdefault(c, []).append((v, k))
        for c in sorted(by_chunk):
            if c != pu.chunk + 1:
                raise ValueError(f"{u} on model chunk {pu.chunk} is read on chunk {c}: not adjacent")
            dst = graph.node(by_chunk[c][0][0])
            graph.insert_between(
                u, by_chunk[c], graph.unique_name(f"{u}.send_recv"), "send_recv",
                attrs={"src_stage": pu.stage, "dst_stage": dst.stage, "src_chunk": pu.chunk, "dst_chunk": c},
                sharding=pu.sharding, requires=pu.sharding, grad=dual(pu.sharding),
                stage=dst.stage, chunk=c,
            )


def _conversion_name(where: str, fwd, bwd) -> str:
    f = [k for k, _ in fwd if k in COMM_KINDS]
    b = [k for k, _ in bwd if k in COMM_KINDS]
    if f:
        return f"{where}.{'_'.join(f)}"
    if b:
        return f"{where}.bwd_{'_'.join(b)}"
    return f"{where}.{'_'.join(k for k, _ in fwd) or 'relayout'}"


def _insert_conversions(graph: Graph, ctx: PassContext) -> None:
    deg = ctx.degrees
    for u in ctx.visit(graph.topological()):
        pu = graph.node(u)
        groups: dict[tuple, list[tuple[str, int]]] = {}
        for v, k in graph.users(u):
            nv = graph.node(v)
            req, grad = nv.requires[k], nv.grads[k]
            fwd = convert(pu.sharding, req, deg)
            # integer tensors (token ids, labels) carry no gradient, so nothing flows back
            bwd = [] if pu.type.dtype.startswith("int") else convert(grad, dual(pu.sharding), deg)
            if not fwd and not bwd:
                continue
            key = (req, grad, tuple(fwd), tuple(bwd))
            groups.setdefault(key, []).append((v, k))
        for (req, grad, fwd, bwd), consumers in groups.items():
            first = graph.node(consumers[0][0])
            local = pu.sharding.partial or any(kind == "split" for kind, _ in fwd)
            where = pu.op.module if local else first.op.module
            name = graph.unique_name(_conversion_name(where, fwd, bwd))
            attrs = {"fwd": fwd, "bwd": bwd, "where": where}
            # sequence parallelism: column-parallel layers keep the sequence-split input and
            # all-gather it again in backward (Megatron-LM; Korthikanti et al. 2022, 4.2.2);
            # analysis/comm.py counts that all-gather unless full recomputation rebuilds the
            # layer anyway; under full recomputation a decoder layer keeps only its input, so
            # nothing in it is kept split and codegen writes no keep_split_input block there
            recomputed = ctx.cfg.parallel.recompute == "full" and pu.op.layer is not None   # analysis/comm.py _in_layer
            if (ctx.cfg.workload == "train" and not recomputed and [(k, ax) for k, ax in fwd if k in COMM_KINDS] == [("all_gather", "tp")]
                    and all(graph.node(v).kind == "linear" for v, _ in consumers)):
                attrs["regather"] = True
            # a conversion the producer's layout calls for (a partial sum reduced, a split
            # made) runs where the producer runs: the embedding's reduction stays on the
            # first model chunk when that chunk holds no decoder layer (Megatron-LM's
            # embedding reduce-scatters before the pipeline send)
            graph.insert_between(
                u, consumers, name, "redistribute",
                attrs=attrs,
                sharding=req, requires=pu.sharding, grad=dual(pu.sharding),
                on_producer=local and first.chunk != pu.chunk,
            )
            # the consumers now see the converted tensor; its gradient arrives in `grad`


def _bucket_collectives(cfg, deg, s: int, sp, fp8_gather: bool, add) -> None:
    """The gradient buckets' collectives of pipeline stage ``s`` (``sp``: its
    :class:`~parcompile.analysis.params.StageParams`) for :func:`step_collectives`, each
    passed to ``add``: per bucket of the dense weights (over dp_cp) and of the expert
    weights (over expert_dp) an all-reduce of its gradients, or with ZeRO a reduce-scatter
    and an all-gather of its shards; with FP8 all-gather (``fp8_gather``) a bucket's FP8
    weights gathered as E4M3 bytes (core/buckets.py ``fp8_gather_elements``), the rest in
    the dtype."""
    par = cfg.parallel
    pp, e, d, ed = par.pp, cfg.model.dtype_bytes, shard_degree(deg), deg["expert_dp"]
    # dense weights are replicated over dp_cp, expert weights over expert_dp only (runtime/model/moe.py):
    # per gradient bucket (analysis/buckets.py) one all-reduce of its fp32 gradients, or
    # with ZeRO a reduce-scatter and an all-gather of the bucket's (padded) shards
    dense, expert = stage_buckets(sp, par.bucket_size)
    dps = data_parallel_sharding(par)
    # HSDP: dense buckets are sharded over dp_shard, their shards all-reduced over dp_replicate
    # once per step (runtime/train/zero.py ShardedOptimizer.reduce_gradients), in fp32
    dense_axis = dps.shard_group if dps.shards_optimizer_states else "dp_cp"
    for prefix, buckets, axis, size in (("", dense, dense_axis, d if dps.shards_optimizer_states else deg["dp_cp"]),
                                        ("expert_", expert, "expert_dp", ed)):
        if size <= 1:
            continue
        gathers = zero3_gather_counts(buckets, par.num_microbatches, reshard_after_forward(pp),
                                      head_reads_embedding(cfg)) if dps.shards_parameters else [1] * len(buckets)
        grad_bytes = grad_element_bytes(cfg)   # fp32, or the reduce dtype (analysis/estimate.py)
        reduces = reduce_counts(buckets, par.num_microbatches, dps.per_microbatch)
        op = dps.gradient_reduction
        for i, b in enumerate(buckets):
            if not dps.shards_optimizer_states:   # replicated: all-reduce the full bucket
                add(s, f"{prefix}grads.bucket{i}", op, axis, grad_bytes * b.elements, f"{prefix}grads")
                continue
            shard = math.ceil(b.elements / size)
            add(s, f"{prefix}grads.bucket{i}", op, axis, grad_bytes * shard, f"{prefix}grads", reduces[i])
            if dps.replicate > 1 and not prefix:
                add(s, f"grads_replicate.bucket{i}", "all_reduce", dps.replicate_group, GRAD_BYTES * shard, "grads")
            if fp8_gather and b.fp8:
                n8, n16 = fp8_gather_elements(b.elements, b.fp8, size)
                add(s, f"{prefix}params_fp8.bucket{i}", "all_gather", axis, n8 * size, f"{prefix}params",
                    gathers[i])
                if n16:
                    add(s, f"{prefix}params.bucket{i}", "all_gather", axis, e * n16 * size, f"{prefix}params",
                        gathers[i])
            else:
                add(s, f"{prefix}params.bucket{i}", "all_gather", axis, e * shard * size, f"{prefix}params",
                    gathers[i])


def step_collectives(cfg, deg, stages, frozen=None) -> list[tuple[int, str, str, str, int, str, int]]:
    """The step collectives of the module docstring (3.), as ``(stage, key, op, axis,
    bytes, where, count)`` for ``stages`` (:class:`~parcompile.analysis.params.StageParams`
    per pipeline rank); ``count`` is runs per step (1, but with ``pp = 1`` ``2 m`` for the
    all-gathers of a ZeRO-3 layer bucket resharded after every forward and backward and
    ``m`` for the output layer's and the embedding's:
    :func:`parcompile.analysis.buckets.zero3_gather_counts`; ``m`` for the gradient
    reduce-scatters of ZeRO 2 and 3, which run in every micro-batch's backward, in the
    reduce dtype: :func:`parcompile.analysis.buckets.reduce_counts`; the gradient
    reductions' bytes per element are :func:`parcompile.analysis.estimate.grad_element_bytes`). Shared by the pass and by
    :mod:`parcompile.layout_search`, which costs layouts without building their graphs.
    ``frozen``: LoRA, the stages' whole parameters, whose frozen weights ZeRO-3 gathers too
    (:func:`parcompile.analysis.lora.frozen_gathers`, ``where`` ``params``)."""
    par = cfg.parallel
    pp = par.pp
    d = deg["dp_cp"]
    out: list[tuple[int, str, str, str, int, str, int]] = []

    def add(stage: int, key: str, op: str, axis: str, nbytes: int, where: str, count: int = 1) -> None:
        out.append((stage, key, op, axis, int(nbytes), where, count))

    dps = data_parallel_sharding(par)
    for s, sp in enumerate(stages):
        ed = deg["expert_dp"]
        fp8_gather = gathers_fp8(cfg)
        _bucket_collectives(cfg, deg, s, sp, fp8_gather, add)
        for key, op, axis, nbytes, count in frozen_gathers(cfg, deg, frozen[s]) if frozen else ():
            add(s, key, op, axis, nbytes, "params", count)
        if fp8_gather and d > 1 and sp.fp8:
            # the FP8 weights' tensorwise scales: the amaxes of their shards all-reduced (max)
            # over dp once per step, one fp32 per weight (torchtitan's
            # precompute_float8_dynamic_scale_for_fsdp); every rank then knows every scale
            layers = sum(1 for u in sp.units if u.name.startswith("layers.")) or 1
            add(s, "fp8_amax", "all_reduce", "dp_cp", 4 * (sp.fp8_weights or 7 * layers), "fp8_amax")
            if deg["tp"] > 1:   # and over tp: a tp-sharded weight's scale is the whole weight's
                add(s, "fp8_amax_tp", "all_reduce", "tp", 4 * (sp.fp8_weights or 7 * layers), "fp8_amax")
        if pp > 1 and cfg.model.tie_embeddings and s in (0, pp - 1) and sp.embedding:
            add(s, "tied_embedding", "all_reduce", "embedding", GRAD_BYTES * sp.embedding, "tied_embedding")
        if par.sequence_parallel and deg["tp"] > 1 and sp.norm:
            add(s, "sp_norm_grads", "all_reduce", "tp", GRAD_BYTES * sp.norm, "sp_norm_grads")
        elif deg["tp"] > 1 and sp.tp_partial:   # qk-norm weights (sequence parallelism: in sp_norm_grads)
            add(s, "tp_partial_grads", "all_reduce", "tp", GRAD_BYTES * sp.tp_partial, "tp_partial_grads")
        if dps.shards_optimizer_states and dps.shard > 1:   # sharded gradients: the norm's squares are summed over dp too
            add(s, "grad_norm_dp", "all_reduce", dps.shard_group, 4, "grad_norm")
        if deg["tp"] > 1:
            add(s, "grad_norm_tp", "all_reduce", "tp", 4, "grad_norm")
        if sp.expert:   # expert squares: summed over their shards (expert_dp with ZeRO, ep, expert_tp)
            if dps.shards_optimizer_states and ed > 1:
                add(s, "grad_norm_expert_dp", "all_reduce", "expert_dp", 4, "grad_norm")
            if deg["ep"] > 1:
                add(s, "grad_norm_ep", "all_reduce", "ep", 4, "grad_norm")
            if deg["expert_tp"] > 1:
                add(s, "grad_norm_expert_tp", "all_reduce", "expert_tp", 4, "grad_norm")
        if pp > 1:
            add(s, "grad_norm_pp", "all_reduce", "pp", 4, "grad_norm")
        if cfg.model.dtype == "fp16":   # dynamic loss scaling: did any rank overflow? (max over all)
            for axis in FOUND_INF_AXES:
                if deg[axis] > 1:
                    add(s, f"found_inf_{axis}", "all_reduce", axis, 4, "found_inf")
        if s == pp - 1 and d > 1:
            add(s, "loss_log", "all_reduce", "dp_cp", 4, "loss_log")
    return out


#: the axes :func:`step_collectives` runs collectives over
STEP_AXES = ("dp_cp", "expert_dp", "embedding", "tp", "pp", "ep", "expert_tp", "dp_shard", "dp_replicate")


def step_entries(cfg, deg, stages, frozen=None) -> list[CollectiveEntry]:
    """:func:`step_collectives` as the rows of the communication report
    (:class:`~parcompile.analysis.comm.CollectiveEntry`, phase ``step``): what
    :func:`parcompile.analysis.comm.comm_report` reads from the graph's ``step_collective``
    ops, for :mod:`parcompile.layout_search`, which costs layouts without building their graphs."""
    return [CollectiveEntry(op, axis, nb, count, where, s, "step")
            for s, _key, op, axis, nb, where, count in step_collectives(cfg, deg, stages, frozen)]


def _insert_step_collectives(graph: Graph, ctx: PassContext) -> list:
    """Add the step collectives (module docstring, 3); returns the stages' parameters they
    were sized from."""
    cfg = ctx.cfg
    stages = stage_params(graph, ctx.degrees, cfg.parallel.pp, cfg.model.tie_embeddings)
    trained = [trainable(cfg, ctx.degrees, sp) for sp in stages]   # LoRA: the adapters' gradients only
    for stage, key, op, axis, nbytes, where, count in step_collectives(cfg, ctx.degrees, trained, stages):
        name = graph.unique_name(f"step.stage{stage}.{key}")
        attrs = {"op": op, "axis": axis, "bytes": int(nbytes), "where": where}
        if count != 1:
            attrs["count"] = count
        graph.add_op(name, "step_collective", [], attrs)
        graph.set_stage(name, stage, stage)
    return stages


def _mark_recomputation(graph: Graph, ctx: PassContext) -> None:
    """Mark what runs again in backward with the attribute ``recompute``: under
    ``recompute = selective`` the ops of the op table's ``selective_recompute`` (the
    attention core), ``"selective"``; under ``full`` every op of a decoder layer (not its
    conversions: they are the layer's inputs and outputs), ``"full"``. The program reads
    the marks (codegen); the collectives inside repeat in backward as planned."""
    mode = ctx.cfg.parallel.recompute
    if is_module_list(mode) and ctx.cfg.workload == "train":
        _mark_modules(graph, mode)
        mode = "selective" if "core_attn" in mode else "none"
    if ctx.cfg.workload != "train" or mode not in ("selective", "full"):
        return
    for nd in graph.nodes():
        if mode == "selective" and spec(nd.kind).selective_recompute:
            graph.set_attrs(nd.name, recompute="selective")
        elif mode == "full" and nd.op.layer is not None and not (nd.has_trait(Trait.CONVERSION) or nd.has_trait(Trait.STAGE_TRANSFER)):
            graph.set_attrs(nd.name, recompute="full")


def _mark_modules(graph: Graph, modules: tuple[str, ...]) -> None:
    """``recompute = [...]``: mark the ops of the checkpointed modules the program wraps whole
    (``mlp``, ``moe``, ``shared_experts``: ``rt.checkpointed``, codegen/emit.py) and the experts
    whose activation it recomputes (``moe_act``: ``GroupedExperts(recompute_act=True)``), the
    norms whose output it frees (``layernorm``: ``rt.discard_between``, codegen/emit.py) and
    MLA's up projections and RoPE (``mla_up_proj``: one ``rt.discarding`` function,
    codegen/blocks.py ``_Region``) with
    ``recompute`` = the module's name (``moe`` over the others: they run inside it). The core
    is marked ``selective`` by the caller (``core_attn``)."""
    for nd in graph.nodes():
        mine = node_modules(nd) & set(modules) & {"mlp", "moe", "shared_experts", "moe_act", "layernorm", "mla_up_proj"}
        if mine and not nd.has_trait(Trait.CONVERSION):
            graph.set_attrs(nd.name, recompute="moe" if "moe" in mine else min(mine))


@dataclass(frozen=True)
class InsertCollectives:
    """Insert send/recv, layout conversions and step collectives (module docstring)."""

    name: str = "insert-collectives"

    def apply(self, graph: Graph, ctx: PassContext) -> CollectivesInserted:
        _insert_conversions(graph, ctx)   # first: a producer's conversion precedes its send
        _insert_send_recv(graph, ctx)
        stages = _insert_step_collectives(graph, ctx)
        _mark_recomputation(graph, ctx)
        return CollectivesInserted(tuple(stages))
