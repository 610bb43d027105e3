"""What LoRA (``train.method = lora``; :mod:`parcompile.core.lora`) changes in the plan's
memory and time.

Memory, per rank (SPEC 1 `train`'s per-parameter rule, :func:`parcompile.analysis.memory.state_bytes`,
applied to the adapters only):

* the frozen weights: the model dtype's bytes per element (16-bit weights of a bf16 model),
  no gradient, no master copy, no optimizer state;
* the adapters, A (r, in) and B (out, r) of each targeted linear, ``r (in + out) / tp``
  elements per rank (Megatron-Bridge's split, :mod:`parcompile.core.lora`): parameters,
  gradients and optimizer states as any trained parameter (16-bit weights, fp32 gradients,
  fp32 master and Adam moments; sharded by ZeRO 1 and 2 like the model's);
* activations, per adapter and micro-batch: the input of A is the base layer's input, which
  the base keeps already (counted once); the r-wide intermediate ``A x`` (the input of B's
  weight gradient) is new: ``tokens * r`` elements in the model dtype, whole on every tp rank
  (A's output is all-gathered on a column-parallel base, all-reduced on a row-parallel one);
  with ``lora_dropout > 0`` also the dropped input and its 1-byte mask.

Time: the adapters' GEMMs run forward (``2 T r (in + out) / tp`` FLOPs per adapter for T
tokens) and backward (twice that: input and weight gradients); a frozen weight's backward
runs only the input-gradient GEMM, not the weight-gradient one, so the backward of a chunk is
its forward's matmuls twice less the frozen weights' GEMMs once (:func:`lora_chunk_times`).
The data-parallel reductions, the gradient buckets, the optimizer step and the gradient norm
cover the adapters only (:func:`trainable`), as only they have gradients.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping, Sequence

from parcompile.analysis.comm import CollectiveEntry, per_step_sent
from parcompile.analysis.compute import op_fwd_flops, recomputed
from parcompile.analysis.params import StageParams
from parcompile.core.buckets import (GradUnit, head_reads_embedding, reshard_after_forward, shard_elements,
                                     stage_buckets, zero3_gather_counts)
from parcompile.core.data_parallel import data_parallel_sharding, shard_degree
from parcompile.core.lora import LoraLinear, targeted
from parcompile.ir.ops import Collective


def is_lora(cfg) -> bool:
    """Whether ``cfg`` (a SpecConfig) trains LoRA adapters."""
    return cfg.workload == "train" and cfg.train is not None and cfg.train.method == "lora"


def adapters_by_layer(cfg) -> dict[int, tuple[LoraLinear, ...]]:
    """The targeted linears of each decoder layer (layer id -> linears)."""
    out: dict[int, list[LoraLinear]] = {}
    for lin in targeted(cfg.model, cfg.train.lora_targets):
        out.setdefault(int(lin.module.split(".")[1]), []).append(lin)
    return {k: tuple(v) for k, v in out.items()}


def layer_adapter_elements(cfg, tp: int) -> dict[int, int]:
    """Adapter elements of each decoder layer on one tp rank (layer id -> elements)."""
    r = cfg.train.lora_rank
    return {layer: sum(lin.adapter_elements(r, tp) for lin in lins) for layer, lins in adapters_by_layer(cfg).items()}


def adapter_params(cfg) -> int:
    """Adapter elements (A and B of every targeted linear) of the whole model, all ranks
    together: :func:`layer_adapter_elements` at tp 1; 0 without LoRA."""
    return sum(layer_adapter_elements(cfg, 1).values()) if is_lora(cfg) else 0


def trainable(cfg, degrees: Mapping[str, int], sp: StageParams) -> StageParams:
    """The parameters of one rank of a stage that have gradients: ``sp`` itself without
    LoRA; with it the adapters only, one gradient unit per decoder layer (what the
    gradient buckets, the data-parallel reductions and the optimizer cover), every adapter
    element split over tp (no norm or tp-partial gradient to all-reduce over tp, no tied
    embedding to reduce)."""
    if not is_lora(cfg):
        return sp
    per_layer = layer_adapter_elements(cfg, degrees.get("tp", 1))
    units = tuple(GradUnit(u.chunk, u.name, per_layer.get(int(u.name.split(".")[1]), 0))
                  for u in sp.units if u.name.startswith("layers."))
    dense = sum(u.dense for u in units)
    return StageParams(sp.stage, dense, 0, 0, 0, tuple(u for u in units if u.dense))


def frozen_param_bytes(cfg, degrees: Mapping[str, int], sp: StageParams, sharded: bool) -> int:
    """Bytes of the frozen weights on one rank of a stage (module docstring): every
    parameter of ``sp`` in the model dtype; when ``sharded`` (ZeRO-3) this rank's slice of
    each of the base model's buckets (:func:`frozen_gathers`), ``sum ceil(n_b / d)`` per kind
    over its group (HSDP: ``dp_shard``), as the program keeps them
    (:class:`parcompile.runtime.train.zero_frozen.FrozenShards`)."""
    e = cfg.model.dtype_bytes
    if not sharded:
        return e * sp.total
    dense, expert = stage_buckets(sp, cfg.parallel.bucket_size)
    return e * (shard_elements(dense, shard_degree(degrees)) + shard_elements(expert, degrees["expert_dp"]))


def frozen_gathers(cfg, degrees: Mapping[str, int], sp: StageParams) -> list[tuple[str, str, str, int, int]]:
    """ZeRO-3's all-gathers of LoRA's frozen weights on one rank of a stage whose
    parameters ``sp`` counts: ``(key, op, axis, bytes, count per step)`` per bucket of the
    base model (:func:`parcompile.core.buckets.stage_buckets`, as ZeRO-3 of full training
    buckets it; the program's :class:`parcompile.runtime.train.zero_frozen.FrozenShards`),
    each sending ``ceil(n / d)`` elements of the model dtype from each rank of its group,
    as often as :func:`parcompile.core.buckets.zero3_gather_counts` says (every layer has
    the same adapters, so a gradient runs through every layer's backward, which reads its
    frozen weights); no reduce-scatter (no gradient). Empty without LoRA or without ZeRO-3."""
    par = cfg.parallel
    dps = data_parallel_sharding(par)
    if not is_lora(cfg) or not dps.shards_parameters:
        return []
    e = cfg.model.dtype_bytes
    dense, expert = stage_buckets(sp, par.bucket_size)
    out = []
    for prefix, buckets, axis, size in (("", dense, dps.shard_group, shard_degree(degrees)),
                                        ("expert_", expert, "expert_dp", degrees["expert_dp"])):
        if size <= 1:
            continue
        counts = zero3_gather_counts(buckets, par.num_microbatches, reshard_after_forward(par.pp),
                                     head_reads_embedding(cfg))
        out += [(f"{prefix}frozen_params.bucket{i}", "all_gather", axis, e * math.ceil(b.elements / size) * size,
                 counts[i]) for i, b in enumerate(buckets)]
    return out


def _tokens(cfg) -> int:
    """Tokens of one micro-batch on one rank (a cp rank holds ``seq_len / cp``)."""
    par = cfg.parallel
    return par.micro_batch * cfg.model.seq_len // par.cp


def adapter_saved_bytes(cfg, degrees: Mapping[str, int], row_parallel: frozenset[str] = frozenset(),
                        skip: frozenset[str] = frozenset()) -> dict[int, int]:
    """Bytes one micro-batch of each decoder layer's adapters keeps for backward on one
    rank (module docstring): ``tokens * r`` in the model dtype per adapter, plus with
    ``lora_dropout > 0`` the dropped input and its mask (``dtype + 1`` bytes per input
    element the adapter reads: the whole ``in`` on a column-parallel base, ``in / tp`` on
    a row-parallel one, whose modules ``row_parallel`` names); the adapters of the linears
    ``skip`` names (recomputed ones) keep nothing."""
    t, e, tp = _tokens(cfg), cfg.model.dtype_bytes, degrees.get("tp", 1)
    r, dropout = cfg.train.lora_rank, cfg.train.lora_dropout > 0
    out = {}
    for layer, lins in adapters_by_layer(cfg).items():
        b = 0
        for lin in (lin for lin in lins if lin.module not in skip):
            b += t * r * e
            if dropout:
                b += t * (lin.in_features // (tp if lin.module in row_parallel else 1)) * (e + 1)
        out[layer] = b
    return out


def chunk_layers(cfg) -> list[range]:
    """The decoder layers of each model chunk, in model order."""
    out, start = [], 0
    for n in cfg.parallel.layers_per_chunk(cfg.model.layers):
        out.append(range(start, start + n))
        start += n
    return out


def adapter_chunk_flops(cfg, degrees: Mapping[str, int]) -> tuple[int, ...]:
    """Forward FLOPs of the adapters' GEMMs per model chunk, one micro-batch, one rank:
    ``2 T r (in + out) / tp`` per adapter (module docstring)."""
    per_layer = layer_adapter_elements(cfg, degrees.get("tp", 1))
    t = _tokens(cfg)
    return tuple(sum(2 * t * per_layer.get(i, 0) for i in layers) for layers in chunk_layers(cfg))


def lora_chunk_times(cfg, degrees: Mapping[str, int], matmul: Sequence[float], weighted: Sequence[float],
                     rate: float) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """LoRA's share of :func:`parcompile.analysis.estimate.chunk_times`: ``(matmul,
    weighted, frozen)`` per chunk, seconds of one micro-batch's forward. ``matmul`` gains
    the adapters' GEMMs (at ``rate``, FLOP/s); ``weighted`` (the matmuls whose weights get a
    gradient: the backward's weight-gradient part) becomes the adapters' alone; ``frozen``
    is the frozen weights' GEMMs, which the backward does not run again for a weight
    gradient. Without LoRA the inputs, and no frozen time."""
    if not is_lora(cfg):
        return tuple(matmul), tuple(weighted), ()
    extra = tuple(f / rate for f in adapter_chunk_flops(cfg, degrees))
    return tuple(m + x for m, x in zip(matmul, extra)), extra, tuple(weighted)


def frozen_backward(cfg, graph) -> tuple[frozenset[str], frozenset[str]]:
    """What LoRA's frozen weights leave out of the backward collectives
    (:func:`parcompile.analysis.comm.comm_report`'s ``no_backward``, ``no_regather``), as
    autograd decides it in the program: an op's backward runs only when one of its inputs
    requires a gradient, i.e. an adapter lies upstream of it (a column-parallel adapter's
    output is its linear's; a row-parallel one's is added after its linear's reduction:
    :mod:`parcompile.runtime.model.lora`), so the embedding and the model's start up to the
    first adapter run none (the input gradient of the first adapted module neither); a
    sequence-parallel conversion is all-gathered again in backward only when an adapted
    linear reads it (the adapter's A keeps its input for A's weight gradient; a frozen
    linear keeps none). Empty sets without LoRA."""
    if not is_lora(cfg):
        return frozenset(), frozenset()
    adapted = {lin.module for lins in adapters_by_layer(cfg).values() for lin in lins}
    rows = row_parallel(graph)
    grad: dict[str, bool] = {}   # op -> whether its output requires a gradient
    no_backward, no_regather = set(), set()
    for nd in graph.nodes():
        ins = graph.inputs(nd.name)
        reached = any(grad.get(u, False) for u in ins)
        if not reached:
            no_backward.add(nd.name)
        grad[nd.name] = (reached or (nd.name in adapted and nd.name not in rows)
                         or any(u in adapted and u in rows for u in ins))
        if nd.op.attr("regather") and not any(v in adapted for v, _ in graph.users(nd.name)):
            no_regather.add(nd.name)
    return frozenset(no_backward), frozenset(no_regather)


def with_adapter_activations(cfg, degrees: Mapping[str, int], saved, graph):
    """``saved`` (:class:`parcompile.analysis.memory.SavedBytes`) with the adapters' saved
    bytes (:func:`adapter_saved_bytes`) added to each layer, and to what the layer and its
    chunk keep after recomputation those of the linears of ``graph`` that ``recompute`` does
    not re-run (:func:`parcompile.analysis.compute.recomputed`, as for the graph's own ops:
    ``recompute = full`` keeps only the layer input, a module list drops its modules')."""
    if not is_lora(cfg):
        return saved
    rows = row_parallel(graph)
    again = frozenset(lin.module for lins in adapters_by_layer(cfg).values() for lin in lins
                      if recomputed(graph.node(lin.module), cfg.parallel.recompute))
    extra = adapter_saved_bytes(cfg, degrees, rows)
    extra_kept = adapter_saved_bytes(cfg, degrees, rows, skip=again)
    per_chunk = list(saved.per_chunk)
    for layer, b in extra_kept.items():
        if layer in saved.chunk_of_layer:
            per_chunk[saved.chunk_of_layer[layer]] += b
    kept = {k: v + extra_kept.get(k, 0) for k, v in saved.kept_per_layer.items()}
    per_layer = {k: v + extra.get(k, 0) for k, v in saved.per_layer.items()}
    return replace(saved, per_chunk=tuple(per_chunk), per_layer=per_layer, kept_per_layer=kept)


def lora_step_flops(cfg, graph, compute, num_microbatches: int):
    """``compute`` (:class:`parcompile.analysis.compute.ComputeReport`) with LoRA's FLOPs per
    step (:func:`lora_chunk_flops` of each micro-batch). The per-chunk fields stay the frozen
    model's (:func:`lora_chunk_times` adds the adapters). Without LoRA, ``compute`` itself."""
    if not is_lora(cfg):
        return compute
    model, hw = lora_chunk_flops(cfg, graph)
    return replace(compute, model_flops_per_step=compute.model_flops_per_step + sum(model) * num_microbatches,
                   hardware_flops_per_step=compute.hardware_flops_per_step + sum(hw) * num_microbatches)


def lora_chunk_flops(cfg, graph) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What LoRA changes in one micro-batch's model and hardware FLOPs (of the whole data-
    parallel batch: ``global_batch / num_microbatches`` sequences), per model chunk of
    ``graph``: the frozen weights' GEMMs run forward and input-gradient (2x forward, not 3x:
    their forward once less, the model FLOPs with the unpadded vocabulary), the adapters'
    forward, input and weight gradients (3x their forward, ``2 T r (in + out)`` each for the
    micro-batch's T tokens) added. Zeros without LoRA."""
    par, m = cfg.parallel, cfg.model
    chunks = chunk_layers(cfg)
    model, hw = [0] * len(chunks), [0] * len(chunks)
    if not is_lora(cfg):
        return tuple(model), tuple(hw)
    for nd in graph.nodes():
        if nd.params and nd.kind != "embedding":
            g = op_fwd_flops(graph, nd)
            k = nd.chunk or 0
            hw[k] -= g
            model[k] -= g * m.vocab // m.padded_vocab(par.tp) if nd.type.has_dim("vocab") else g
    tokens = par.global_batch // par.num_microbatches * m.seq_len
    per_layer = layer_adapter_elements(cfg, 1)
    for k, layers in enumerate(chunks):
        adapters = 3 * 2 * tokens * sum(per_layer.get(i, 0) for i in layers)
        model[k] += adapters
        hw[k] += adapters
    return tuple(model), tuple(hw)


def adapter_collectives(cfg, degrees: Mapping[str, int], row_parallel: frozenset[str]) -> list[tuple]:
    """The tensor-parallel collectives the adapters of one micro-batch run, per decoder
    layer, as the program runs them (:mod:`parcompile.runtime.model.lora`, Megatron-Bridge's
    split): ``(layer, module, op, bytes, phase)``, bytes the collective's output, ``module``
    the adapted linear (``layers.0.attn.wq``). Column-parallel
    base: A's r-wide output all-gathered (forward), its gradient reduce-scattered
    (backward). Row-parallel base: A's r-wide partial sums all-reduced (forward), B's output
    all-gathered along ``out`` (forward), the r-wide gradient all-reduced (backward); with
    sequence parallelism the gradient of this rank's tokens all-gathered along the
    sequence (backward). None with tp = 1."""
    tp = degrees.get("tp", 1)
    if tp == 1:
        return []
    t, e, r = _tokens(cfg), cfg.model.dtype_bytes, cfg.train.lora_rank
    sp = cfg.parallel.sequence_parallel
    out = []
    for layer, lins in adapters_by_layer(cfg).items():
        for lin in lins:
            if lin.module in row_parallel:
                rows = [("all_reduce", t * r * e, "forward"), ("all_gather", t * lin.out_features * e, "forward"),
                        ("all_reduce", t * r * e, "backward")]
                if sp:
                    rows.append(("all_gather", t * lin.out_features * e, "backward"))
            else:
                rows = [("all_gather", t * r * e, "forward"), ("reduce_scatter", t * r // tp * e, "backward")]
            out += [(layer, lin.module, *row) for row in rows]
    return out


def with_adapter_collectives(cfg, degrees: Mapping[str, int], comm, num_microbatches: int, graph):
    """``comm`` (:class:`parcompile.analysis.comm.CommReport`) with the adapters'
    collectives (:func:`adapter_collectives`) as rows of ``comm.collectives`` (``where``
    ``lora``), ``num_microbatches`` per step each (the forward ones again where ``recompute``
    re-runs the adapted linear of ``graph``: :func:`parcompile.analysis.compute.recomputed`,
    as for the graph's own ops), on the stage holding the layer, and as per-micro-batch collectives of
    the layer's model chunk in ``raw`` (the time model's); ``per_step`` recounted. (The
    frozen start's backward collectives are left out by ``comm_report`` itself:
    :func:`frozen_backward`.) A ``comm`` that has them already is returned as it is."""
    if not is_lora(cfg) or any(c.where == "lora" for c in comm.collectives):
        return comm
    par = cfg.parallel
    stage_of, chunk_of = {}, {}
    for s in range(par.pp):
        for k in par.rank_chunks(s):
            for layer in chunk_layers(cfg)[k]:
                stage_of[layer], chunk_of[layer] = s, k
    counts: dict[tuple, int] = {}
    raw = list(comm.raw)
    for layer, module, op, nbytes, phase in adapter_collectives(cfg, degrees, row_parallel(graph)):
        raw.append((stage_of[layer], chunk_of[layer], Collective(op, "tp", nbytes, phase, "lora")))
        again = phase == "forward" and recomputed(graph.node(module), par.recompute)
        phases = [phase] + (["recompute"] if again else [])
        for ph in phases:
            key = (op, nbytes, stage_of[layer], ph)
            counts[key] = counts.get(key, 0) + num_microbatches
    rows = tuple(CollectiveEntry(op, "tp", b, n, "lora", s, ph) for (op, b, s, ph), n in counts.items())
    colls = tuple(sorted(comm.collectives + rows, key=lambda c: c.stage))
    return replace(comm, collectives=colls, per_step=per_step_sent(colls, degrees, par.pp), raw=tuple(raw))


def row_parallel(graph) -> frozenset[str]:
    """The linear layers of ``graph`` whose base is row-parallel (split over ``in``), by
    module name (``layers.0.attn.wo``)."""
    return frozenset(nd.name for nd in graph.nodes() if nd.kind == "linear" and nd.op.attr("tp") == "row")


def frozen_saves(cfg, graph) -> tuple[frozenset[str], frozenset[str]]:
    """What LoRA's frozen weights change in what the ops save for backward
    (:func:`parcompile.analysis.memory.saved_bytes`): ``(ops, linears)``, the ops of
    ``graph`` no gradient reaches (:func:`frozen_backward`'s ``no_backward``: none of their
    inputs requires a gradient, so autograd records nothing there; op by op, so the ops
    of the first adapted module before its adapter save nothing either), but the adapted
    linears, whose adapter's A keeps its input for A's weight gradient; and the frozen
    linears without an adapter, which keep no input. Empty without LoRA."""
    if not is_lora(cfg):
        return frozenset(), frozenset()
    adapted = {lin.module for lins in adapters_by_layer(cfg).values() for lin in lins}
    ops = frozen_backward(cfg, graph)[0] - adapted
    linears = {nd.name for nd in graph.nodes() if nd.kind == "linear" and nd.name not in adapted}
    return frozenset(ops), frozenset(linears)
