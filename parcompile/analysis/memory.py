"""Memory per rank of each pipeline stage (SPEC 1 `train`, SPEC 3 `memory`).

Model states, per parameter, with ``d = dp * cp`` for dense and ``expert_dp`` for expert
parameters and sharded buffers rounded up (``ceil(n / d)`` per rank):

=====  ==================================  ==================================
zero   16-bit model (bf16/fp16)            fp32 model
=====  ==================================  ==================================
0      2 + 4 + 12        = 18              4 + 4 + 8      = 16
1      2 + 4 + 12/d      (Megatron dist.)  4 + 4 + 8/d
2      2 + 4/d + 12/d                      4 + 4/d + 8/d
3      2/d + 4/d + 12/d                    4/d + 4/d + 8/d
=====  ==================================  ==================================

(Under an FSDP2 engine, ``Engine.fsdp2``, ZeRO-3's 16-bit model keeps its shards in fp32
with no master copy: ``4/d + 4/d + 8/d``; NeMo AutoModel's models are cast to bf16,
parameters, gradients and Adam's states alike: ``2/d + 2/d + 4/d``; :func:`state_bytes`.)

(params + fp32 gradients + optimizer: fp32 master weights for 16-bit models and 4 bytes
per optimizer state: 2 for Adam/AdamW, 0 for SGD. Under ``engine = megatron`` on a GPU
preset with ``reduce_dtype`` bf16, the gradients of zero 0 and 1 are 2 bytes, not 4:
Megatron-Core's grad buffer is in the parameters' dtype with ``--grad-reduce-in-bf16``,
:func:`parcompile.analysis.estimate.grad_element_bytes`; the generated program keeps fp32.) Gradients live in one fp32 buffer per
gradient bucket (Megatron-LM's grad buffer), which ZeRO pads to a multiple of d so it can
be reduce-scattered as it is: at ``zero = 1`` the full gradients are ``4 * sum ceil(n_b / d)
* d`` bytes, reduced once per step after the last micro-batch's backward (Megatron-LM).
At ``zero = 2`` and ``3`` each bucket is reduce-scattered in every micro-batch's backward
and accumulated into the rank's fp32 shard (the ``4/d`` of the table, kept across the
step; DeepSpeed ZeRO-2, FSDP2), so only the full buckets in flight exist during the step:
the ``grad_buckets_in_flight`` buffer, at most two adjacent buckets of a chunk
(:func:`parcompile.analysis.buckets.buckets_in_flight`), in the reduce dtype
(``parallel.reduce_dtype``: 4 bytes per element, or 2 with bf16 or fp16, the model's
16-bit gradients reduce-scattered in 16 bits and added into the fp32 shard;
:func:`parcompile.analysis.buckets.bucket_element_bytes`). The zero-bubble schedule keeps
the once-per-step reduction, and its full buffers live from the step's first backward
until their reduce-scatters are done: the ``full_grads`` buffer.

Activations: the bytes one micro-batch saves for backward on the rank, per op of the
graph (:mod:`parcompile.ir.ops`: the operands each op keeps, counted once per tensor,
plus softmax and dropout masks), times the micro-batches the schedule keeps in flight on
the stage (``in_flight``: GPipe ``m``; 1F1B ``min(p - s, m)`` on stage s; interleaved
1F1B ``(2(p-s-1) + (v-1)N + 1)/v`` capped at ``m``, with rounds of ``N``
micro-batches (``parallel.microbatch_group_size``, default ``p``: then ``p (1 + (p-1)/(p v))``
on stage 0, Korthikanti et al. 2022 section 4.2.3); when a rank's chunks keep unlike bytes, an
uneven ``stage_layers`` with virtual stages or a layer-less first or last chunk, the
simulated schedule weighs each chunk's forwards in flight by its bytes,
:func:`parcompile.core.schedule.simulate`'s ``chunk_bytes``). Rules, after Megatron-LM:

* with sequence parallelism a column-parallel layer keeps the sequence-split input it
  all-gathers, not the gathered copy (it gathers again in backward; Korthikanti
  section 4.2.2), so a GPT layer keeps ``34 sbh/t + 5as^2b/t`` (their Table 2);
* ``recompute = selective`` drops what the attention core keeps inside itself: the
  ``s x s`` tensors of the unfused core (``34 sbh/t``), the log-sum-exp and mask of the
  fused one; the checkpoint holds the core's inputs (with context parallelism the
  all-gathered k and v) and the output projection keeps its output;
* ``recompute = full`` keeps only each layer's input (``2sbh``, ``2sbh/t`` with sequence
  parallelism); the layer rebuilt during its backward is a temporary buffer.

Per layer (``activations_per_layer`` in ``plan.json``) these are the bytes the generated
program keeps, as :mod:`parcompile.runtime.machine.memory` measures them with saved-tensor hooks:
the program's layers keep what Megatron-LM's fused kernels keep (RMSNorm: input and
per-token statistics; SwiGLU: its two inputs; RoPE: nothing; softmax: 16-bit
probabilities; GQA: k and v never expanded). Left out, as in Korthikanti's accounting:
the norms' fp32 per-token statistics (4-8 bytes per token and norm, under 1% of a
layer at h >= 64).

FP8 training (``train.precision = fp8``) under Transformer Engine (``engine = megatron``, not
the ``cpu`` preset's program): an FP8 linear keeps the FP8 cast of its input, 1 byte per
element, in place of the 16-bit tensor (:func:`parcompile.analysis.fp8.saves_fp8_inputs`).

With ``dropout > 0`` the embedding output's dropout mask (1 byte per element of the first
layer's input) is kept on the first stage, as Megatron-LM's GPT does.

Temporary buffers (``buffers``; not saved for backward, alive for one op or one layer at
a time, so counted once per stage, not per micro-batch): the working set of the layer
recomputation rebuilds, the logits before the fp32 loss (last stage), the all-gathered
input of a column-parallel layer with sequence parallelism, point-to-point receive
buffers between stages, and with ``zero = 3`` the most gathered parameters a rank holds at
once (with ``pp = 1`` every bucket gathered just in time, two units adjacent in forward
order at most, the embedding and the output layer included; with ``pp > 1`` every bucket,
kept across the micro-batches, as torchtitan's FSDP does: :func:`zero3_gathered_bytes`).
The buffers are summed (:func:`buffer_total`), except the logits and the recomputation's
working set, of which the larger counts: the logits live from the LM head's forward
until the loss has its fp32 copy, and their gradient from the loss's backward through
the LM head's, while a layer is rebuilt only inside its own backward, after the output
layer's (a rank runs one action at a time, and the program drops the logits once the
loss is computed: :func:`parcompile.runtime.train.pipeline.run_schedule`).

Gradient buckets and the activation peak (:func:`backward_freed`): with ZeRO 2 and 3 the
full buffers of the buckets in flight (``grad_buckets_in_flight``) exist only inside a
backward, and a bucket is full only once the backward of its layers is done, which has
freed what those layers kept for the micro-batch. So the buckets add to the activation
peak net of those layers' kept bytes: ``buffers`` counts the buckets ``min(buckets,
freed)`` less (``buffer_parts`` keeps their full size, what the program measures).

Attention: which kernel an attention core runs (fused: its output and an fp32 log-sum-exp
kept; unfused: the ``s x s`` softmax kept) is :mod:`parcompile.core.attention`'s table, read
for the engine (``cluster.engine``), or for the generated program itself on the ``cpu``
preset, whose saved bytes ``verify`` measures.

Allocator (:func:`allocator_bytes`; ``allocator`` per stage, not part of ``total``):
what PyTorch's CUDA caching allocator holds beyond the live tensors at the peak, so that
``total + allocator`` is what ``torch.cuda.max_memory_reserved`` shows (``reserved_peak``,
the largest over the stages). Its blocks are cached, not returned to the driver, and a
freed block serves a later request only if that fits in it. With expandable segments
(``cluster.expandable_segments``, ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, as
torchtitan's ``run_train.sh`` sets it and the generated program does) freed blocks merge
with their neighbours and the segment grows only when no free range fits: a gap of the
largest temporary buffer stays mapped (the logits and their fp32 copies, gathered ZeRO-3
parameters, gradient buckets, ...), so the allocator term is the largest ``buffer_parts``
entry. Without them every temporary buffer's
block stays cached in its own ``cudaMalloc`` segment (segments never merge): their sum.
Checked against torchtitan's Llama 3.1 8B FSDP row (82.4 GiB max reserved published,
:mod:`parcompile.analysis.calibration`). NCCL's own buffers are allocated outside the
caching allocator and are not in it. The flat ``cluster.memory_reserve`` still decides
``fits`` (SPEC); a reserved peak above ``cluster.memory`` is a warning.

KV cache (``serve``): ``batch * (prompt_len + max_new_tokens)`` tokens times the bytes a
token adds on the stage's most loaded rank.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from parcompile.core.dtypes import DTYPE_BYTES
from parcompile.core.dtypes import OPTIMIZER_STATES  # noqa: F401  (re-exported: fp32 states per parameter)
from parcompile.core.buckets import (GRAD_BYTES, buckets_in_flight, head_reads_embedding,
                                    reshard_after_forward, shard_elements, stage_buckets, zero3_gathered)
from parcompile.analysis.offload import offload_states
from parcompile.core.data_parallel import DataParallelSharding, data_parallel_sharding, shard_degree
from parcompile.analysis.compute import op_sac
from parcompile.ir.fp8 import enabled as fp8_enabled, gathers_fp8, is_fp8_gemm
from parcompile.analysis.fp8 import saves_fp8_inputs, weight_copy_bytes
from parcompile.analysis.estimate import engine as engine_of, grad_element_bytes
from parcompile.core.attention import attention_engine, with_kernel
from parcompile.analysis.params import StageParams
from parcompile.analysis.lora import (frozen_param_bytes, frozen_saves, is_lora, trainable,
                                     with_adapter_activations)
from parcompile.analysis.module_saves import kept_with_modules, megatron_router_attrs, module_regions
from parcompile.core.recompute import is_module_list
from parcompile.core.schedule import Schedule, as_schedule, build_actions, in_flight
from parcompile.ir.graph import Graph
from parcompile.ir.ops import Trait, spec

#: temporary buffers never alive at once (module docstring): of each group the largest counts
EXCLUSIVE_BUFFERS = (("logits", "recompute"),)
#: ops of the output layer (after the last decoder layer)
OUTPUT_MODULES = ("final_norm", "lm_head", "loss")


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one rank of pipeline stage ``stage``."""

    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int
    kv_cache: int = 0
    #: temporary buffers (module docstring), and their parts by name
    buffers: int = 0
    buffer_parts: Mapping[str, int] = field(default_factory=dict)
    #: per decoder layer of the stage, in layer order: ``(layer id, bytes)`` one micro-batch
    #: keeps for backward on this rank after recomputation (what a generated program
    #: measures with saved-tensor hooks; :mod:`parcompile.runtime.machine.memory`)
    layer_activations: tuple[tuple[int, int], ...] = ()
    #: what PyTorch's caching allocator holds beyond the live tensors at this stage's peak
    #: (:func:`allocator_bytes`): not part of ``total``, part of :attr:`reserved`
    allocator: int = 0
    #: bytes this rank keeps in host memory (``parallel.offload``, :mod:`parcompile.analysis.offload`):
    #: not part of ``total``
    host: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.kv_cache + self.buffers

    @property
    def reserved(self) -> int:
        """The allocator's reserved bytes at the stage's peak (``torch.cuda.max_memory_reserved``):
        ``total + allocator``."""
        return self.total + self.allocator


@dataclass(frozen=True)
class MemoryReport:
    """``per_stage``, ``peak`` (largest total), ``capacity`` (memory minus the reserve),
    ``fits`` (``peak <= capacity``), ``reserved_peak`` (largest :attr:`StageMemory.reserved`)."""

    per_stage: tuple[StageMemory, ...]
    peak: int
    capacity: int
    fits: bool
    reserved_peak: int = 0


def state_bytes(n: int, dtype_bytes: int, sharding: DataParallelSharding, optimizer: str = "adamw",
                shard: int | None = None, fsdp2: int = 0, grad_bytes: int = GRAD_BYTES,
                shard_grad_bytes: int = GRAD_BYTES) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes for ``n`` parameters on one rank (module table),
    sharded as ``sharding`` says over its ``d = sharding.shard`` ranks. ``shard``: the elements of sharded state per rank when the parameters form several
    sharded buffers (the gradient buckets, ``sum ceil(n_b / d)``:
    :func:`stage_state_bytes`); default ``ceil(n / d)``. At
    ``zero = 1`` the full gradient buffers are padded alike: ``4 * shard * d``.
    ``fsdp2`` (an engine with ``Engine.fsdp2``: its :func:`fsdp2_state_bytes`) at ``zero =
    3``: FSDP2 keeps the sharded parameters, their gradients and the optimizer's states in
    that many bytes per element and steps the parameters in place, 16-bit copies existing
    only all-gathered (``MixedPrecisionPolicy(param_dtype=bfloat16)``): torchtitan's fp32
    model, 4: ``16/d`` in all with Adam and no master copy; NeMo AutoModel's bf16 model, 2:
    ``8/d``. ``grad_bytes``: bytes per element of the full gradient buffers zero 0 and 1
    keep across the step (:func:`parcompile.analysis.estimate.grad_element_bytes`: 4, or 2
    for Megatron-Core with ``reduce_dtype`` bf16, its ``--grad-reduce-in-bf16``); the
    sharded gradients of zero 2 and 3 stay fp32 unless ``shard_grad_bytes`` (2 with
    ``grad_dtype = bf16``: Megatron-Core's bf16 main gradients)."""
    k, d = OPTIMIZER_STATES[optimizer], sharding.shard
    if shard is None:
        shard = math.ceil(n / d) if d > 1 else n
    if fsdp2 and sharding.shards_parameters and dtype_bytes < 4:
        return fsdp2 * shard, fsdp2 * shard, fsdp2 * k * shard
    opt_per = 4 * k + (4 if dtype_bytes < 4 else 0)
    params = dtype_bytes * (shard if sharding.shards_parameters else n)
    # ZeRO-1 keeps full gradient buffers, padded to shard * d as the buckets are
    grads = shard_grad_bytes * shard if sharding.shards_gradients else grad_bytes * (
        shard * d if sharding.shards_optimizer_states and d > 1 else n)
    opt = opt_per * (shard if sharding.shards_optimizer_states else n)
    return params, grads, opt


def stage_state_bytes(cfg, degrees, sp) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes on one rank of a stage: SPEC's per-parameter rule
    (:func:`state_bytes`) with the sharded buffers being the gradient buckets
    (:func:`parcompile.core.buckets.stage_buckets`), so a sharded state rounds up per
    bucket (``sum ceil(n_b / d)``)."""
    par, e, opt = cfg.parallel, cfg.model.dtype_bytes, cfg.train.optimizer
    dps = data_parallel_sharding(par)
    # LoRA (analysis/lora.py): frozen weights hold only themselves, the adapters the states
    frozen = frozen_param_bytes(cfg, degrees, sp, dps.shards_parameters) if is_lora(cfg) else 0
    sp = trainable(cfg, degrees, sp)
    dense, expert = stage_buckets(sp, par.bucket_size)
    d, ed = shard_degree(degrees), degrees["expert_dp"]   # HSDP: sharded over dp_shard only
    f2 = engine_of(cfg.cluster).fsdp2_state_bytes
    gb = grad_element_bytes(cfg)
    sgb = DTYPE_BYTES[par.grad_dtype]   # parallel.grad_dtype: the zero 2 and 3 gradient shards too
    pd = state_bytes(sp.dense, e, dps, opt, shard=shard_elements(dense, d), fsdp2=f2, grad_bytes=gb,
                     shard_grad_bytes=sgb)
    pe = state_bytes(sp.expert, e, dps.experts(ed), opt, shard=shard_elements(expert, ed), fsdp2=f2, grad_bytes=gb,
                     shard_grad_bytes=sgb)
    return (pd[0] + pe[0] + frozen, pd[1] + pe[1], pd[2] + pe[2])


def _alias(graph: Graph, name: str, gathered_ok: bool = False) -> str:
    """The tensor a saved operand stands for: layout ops without forward communication are
    views; with ``gathered_ok`` an all-gather's output stands for its (sequence-split)
    input, which is what Megatron-LM keeps for a column-parallel layer."""
    nd = graph.node(name)
    while nd.has_trait(Trait.CONVERSION):
        fwd = [k for k, _ in nd.op.attr("fwd")]
        if fwd and not (gathered_ok and fwd == ["all_gather"]):
            break   # a split changes the local tensor; other collectives make a new one
        name = graph.inputs(name)[0]
        nd = graph.node(name)
    return name


#: the suffix naming a saved tensor's FP8 cast (:func:`saved_bytes`: Transformer Engine's FP8
#: linears keep it, 1 byte per element of the tensor)
FP8_COPY = "#fp8"


def _local_bytes(graph: Graph, name: str, degrees: Mapping[str, int]) -> int:
    if name.endswith(FP8_COPY):
        nd = graph.node(name[:-len(FP8_COPY)])
        return nd.sharding.local_type(nd.type, degrees).numel
    nd = graph.node(name)
    return nd.sharding.local_type(nd.type, degrees).nbytes


@dataclass(frozen=True)
class SavedBytes:
    """Per model chunk, bytes one micro-batch keeps for backward on one rank; and per
    layer, the bytes it keeps without recomputation (what rebuilding it costs)."""

    per_chunk: tuple[int, ...]
    per_layer: dict[int, int]
    #: per layer, the attention core's s x s tensors (what selective recomputation rebuilds)
    per_layer_attention: dict[int, int]
    #: per model chunk, the part of ``per_chunk`` that the output layer keeps (final norm,
    #: LM head, loss): the last chunk's backward follows its forward at once, so one
    #: micro-batch of it is in flight (GPipe: all of them)
    output_layer: tuple[int, ...]
    #: per layer, the bytes one micro-batch keeps for backward after recomputation
    #: (``recompute = none``: ``per_layer``; ``selective``: without the attention core's
    #: internal tensors; ``full``: the layer's input only)
    kept_per_layer: dict[int, int] = field(default_factory=dict)
    #: the model chunk of each layer
    chunk_of_layer: dict[int, int] = field(default_factory=dict)


def _node_saves(graph: Graph, nd, a, degrees: Mapping[str, int], te_fp8: bool,
                lora: tuple = (frozenset(), frozenset())) -> tuple[list[str], int, int]:
    """What node ``nd`` (attributes ``a``, its kernel resolved) saves for its backward when
    nothing is recomputed (:func:`saved_bytes`): ``(keep, extra, gathered)``, ``keep`` the
    names of the saved tensors (views resolved to their source; an FP8 linear's input
    as its FP8 cast under Transformer Engine, ``te_fp8``), ``extra`` the bytes of its
    op extras (masks, log-sum-exp, gathered operands: ``OpSpec.saved_extra`` plus
    ``gathered``), ``gathered`` the bytes of its operands gathered for it
    (``OpSpec.saved_gathered``), on one rank under ``degrees``. ``lora`` (LoRA:
    :func:`parcompile.analysis.lora.frozen_saves`): the ops no gradient reaches, which
    save nothing, and the frozen linears without an adapter, which keep no input (autograd
    saves a matmul's input only for its weight's gradient)."""
    if nd.name in lora[0]:
        return [], 0, 0
    s = spec(nd.kind)
    ins = graph.inputs(nd.name)
    keep = [_alias(graph, ins[i], gathered_ok=nd.kind == "linear") for i in s.saves(a)]
    if te_fp8 and nd.kind == "linear" and is_fp8_gemm(nd, graph):
        keep = [t + FP8_COPY for t in keep]   # its FP8 cast (1 byte per element), not the 16-bit tensor
    if s.saves_output(a):
        keep.append(nd.name)
    local_in = [r.local_type(graph.node(u).type, degrees) for r, u in zip(nd.requires, ins)]
    gathered = s.saved_gathered(a, local_in, degrees)
    if nd.name in lora[1]:
        keep = [t for t in keep if t == nd.name]   # a frozen weight: no weight gradient, no input kept
    return keep, s.saved_extra(a, local_in, nd.sharding.local_type(nd.type, degrees)) + gathered, gathered


def _engine_node_saves(graph: Graph, nd, a, degrees: Mapping[str, int], te_fp8: bool,
                       mcore_moe: bool, lora: tuple = (frozenset(), frozenset())) -> tuple[list[str], int, int]:
    """:func:`_node_saves` under the engine's MoE kernels: with Megatron-Core's (``mcore_moe``)
    the router keeps its 16-bit input and the combine no expert outputs, the router's weights
    being applied in the experts' activation (:mod:`parcompile.analysis.module_saves`)."""
    keep, x, gathered = _node_saves(graph, nd, megatron_router_attrs(a) if mcore_moe else a, degrees, te_fp8, lora)
    return ([] if mcore_moe and nd.kind == "moe_combine" else keep), x, gathered


def _kept_when_recomputing(nd, keep: list[str], x: int, gathered: int, recompute: str,
                           sac: frozenset[str] | None) -> tuple[list[str], int]:
    """What a layer's node keeps through the forward under ``recompute = selective``
    (:func:`saved_bytes`): ``(keep, extra)`` from what it saves (``keep``, ``x``,
    ``gathered``: :func:`_node_saves`). Under torchtitan's op-level policy (``sac``, the
    linears it recomputes: :func:`parcompile.analysis.compute.op_sac`) the attention
    kernel keeps its output, a saved linear its output and gathered operands, the router
    and experts what they save, any other op nothing; under Megatron-LM's (``sac`` None)
    the recomputed attention core keeps only its inputs; otherwise all it saves."""
    s = spec(nd.kind)
    if sac is not None:
        if s.selective_recompute:
            keep = [nd.name]               # the attention kernel's output (and its extra)
        elif nd.kind == "linear" and nd.name not in sac:
            keep, x = [nd.name], gathered  # a saved matmul's output
        elif nd.kind not in ("router", "experts"):
            keep, x = [], 0                # recomputed from what is kept
    elif recompute == "selective" and s.selective_recompute:
        # the recomputed attention core keeps its inputs only: no softmax (unfused)
        # and no log-sum-exp (flash); its output is kept by the output projection
        x = gathered   # the checkpoint holds the gathered operands
        keep = [t for t in keep if t != nd.name]
    return keep, x


def saved_bytes(graph: Graph, degrees: Mapping[str, int], num_chunks: int, recompute: str,
                embedding_dropout: bool = False, engine: str = "megatron", kernels: str | None = None,
                fp8: bool = False, lora: tuple = (frozenset(), frozenset())) -> SavedBytes:
    """The activation accounting of the module docstring (``lora``: :func:`_node_saves`). ``embedding_dropout``: the
    embedding output goes through dropout (Megatron-LM's GPT), whose 1-byte mask, the
    size of the first layer's input, the first chunk keeps. ``engine``
    (``cluster.engine``): where its ``Engine.sac`` is ``"op"``, ``selective`` is torchtitan's op-level policy
    (:func:`parcompile.analysis.compute.op_sac`): a layer keeps its input, the outputs of
    the linears it does not recompute, and the attention kernel's output and log-sum-exp;
    ``fp8``: the spec trains in FP8 (the policy recomputes every FP8 linear; under Transformer
    Engine, ``kernels`` or ``engine`` ``megatron``, an FP8 linear keeps the FP8 cast of its
    input, 1 byte per element, :func:`parcompile.analysis.fp8.saves_fp8_inputs`)."""
    sac = op_sac(graph, recompute, engine, fp8)
    te_fp8 = saves_fp8_inputs(fp8, kernels or engine)
    regions = module_regions(graph, recompute)
    mcore_moe = (kernels or engine) == "megatron"
    tensors: list[dict[str, int]] = [{} for _ in range(num_chunks)]   # chunk -> tensor -> bytes
    extra = [0] * num_chunks
    head = [0] * num_chunks
    layer_own: dict[int, dict[str, int]] = {}
    layer_extra: dict[int, int] = {}
    layer_attn: dict[int, int] = {}
    layer_input: dict[int, tuple[str, int]] = {}
    kept_own: dict[int, dict[str, int]] = {}
    kept_extra: dict[int, int] = {}
    for nd in graph.nodes():
        s = spec(nd.kind)
        c = nd.chunk or 0
        a = nd.op.attr_map
        if nd.has_trait(Trait.ATTENTION):
            a = with_kernel(a, kernels or engine)
        ins = graph.inputs(nd.name)
        keep, x, gathered = _engine_node_saves(graph, nd, a, degrees, te_fp8, mcore_moe, lora)
        layer = nd.op.layer
        if layer is not None:
            own = layer_own.setdefault(layer, {})
            for t in keep:
                own.setdefault(t, _local_bytes(graph, t, degrees))
            layer_extra[layer] = layer_extra.get(layer, 0) + x
            if s.selective_recompute and not s.kernel(a).fused:
                layer_attn[layer] = layer_attn.get(layer, 0) + x
            if layer not in layer_input and nd.kind == "norm":
                t = _alias(graph, ins[0])
                layer_input[layer] = (t, _local_bytes(graph, t, degrees))
            if recompute == "full":
                continue   # only the layer input is kept (added below)
            keep, x = (kept_with_modules(graph, nd, a, keep, x, gathered, regions, own.__getitem__) if regions
                       else _kept_when_recomputing(nd, keep, x, gathered, recompute, sac))
            kown = kept_own.setdefault(layer, {})
            for t in keep:
                kown.setdefault(t, _local_bytes(graph, t, degrees))
            kept_extra[layer] = kept_extra.get(layer, 0) + x
        out_layer = layer is None and nd.op.module in OUTPUT_MODULES
        for t in keep:
            if t not in tensors[c]:
                tensors[c][t] = _local_bytes(graph, t, degrees)
                if out_layer:
                    head[c] += tensors[c][t]
        extra[c] += x
        if out_layer:
            head[c] += x
    chunk_of_layer = {nd.op.layer: nd.chunk or 0 for nd in graph.nodes() if nd.op.layer is not None}
    if recompute == "full" or sac is not None:
        for layer, (t, b) in layer_input.items():
            tensors[chunk_of_layer[layer]].setdefault(t, b)
    if embedding_dropout and layer_input:
        first = min(layer_input)
        t, b = layer_input[first]
        extra[chunk_of_layer[first]] += graph.node(t).sharding.local_type(graph.node(t).type, degrees).numel
    per_layer = {layer: sum(own.values()) + layer_extra.get(layer, 0) for layer, own in layer_own.items()}
    if recompute == "full":
        kept = {layer: b for layer, (t, b) in layer_input.items()}
    else:
        kept = {layer: sum(own.values()) + kept_extra.get(layer, 0) for layer, own in kept_own.items()}
        if sac is not None:
            for layer, (t, b) in layer_input.items():
                if t not in kept_own.get(layer, {}):
                    kept[layer] = kept.get(layer, 0) + b
    out = tuple(sum(t.values()) + e for t, e in zip(tensors, extra))
    return SavedBytes(out, per_layer, layer_attn, tuple(head), kept, chunk_of_layer)


def saved_bytes_per_chunk(graph: Graph, degrees: Mapping[str, int], num_chunks: int, recompute: str,
                          ) -> list[int]:
    """Bytes one micro-batch keeps for backward on one rank, per model chunk."""
    return list(saved_bytes(graph, degrees, num_chunks, recompute).per_chunk)


def closed_form_in_flight(schedule: Schedule | str, pp: int, v: int, m: int, group: int | None = None) -> list[Fraction]:
    """Peak micro-batches (through all of a stage's layers) whose activations stage s keeps,
    from the schedule's warm-up (module docstring); what the simulator finds for
    Megatron-LM's schedules, without needing the action lists
    (:meth:`parcompile.core.schedule.Schedule.closed_form_in_flight`: interleaved 1F1B keeps
    its warm-up forwards and the one that starts the steady state, of ``v`` chunks each, in
    rounds of ``group`` micro-batches, None: ``pp``). ``schedule``: the value or its name."""
    sched = as_schedule(schedule)
    return [sched.closed_form_in_flight(s, pp, v, m, group) for s in range(pp)]


def unlike_chunk_bytes(cfg, saved: SavedBytes) -> tuple[int, ...] | None:
    """Bytes one micro-batch keeps for backward in each model chunk, less the output
    layer's (which :func:`memory_from_parts` counts once), when some pipeline rank's chunks
    hold unlike numbers of layers (an uneven ``stage_layers`` with ``virtual_stages > 1``, a
    layer-less first or last chunk); else None: a rank's forwards in flight then weigh the
    same, and counting them is exact (:func:`parcompile.core.schedule.in_flight`)."""
    par = cfg.parallel
    pp, v = par.pp, par.virtual_stages
    counts = par.layers_per_chunk(cfg.model.layers)
    if v == 1 or all(len({counts[k] for k in par.rank_chunks(r)}) == 1 for r in range(pp)):
        return None
    return tuple(a - o for a, o in zip(saved.per_chunk, saved.output_layer))


@lru_cache(maxsize=4096)
def _weighted_in_flight(schedule: Schedule, pp: int, v: int, m: int, chunk_bytes: tuple[int, ...],
                        group: int | None = None) -> tuple[Fraction, ...]:
    """:func:`parcompile.core.schedule.in_flight` of ``schedule``'s own action lists (their
    order does not depend on the chunk times: only zero-bubble's does, and it runs no
    virtual stages, so its chunks are never unlike on a rank)."""
    return in_flight(_actions(schedule, pp, m, v, group), pp, v, chunk_bytes, schedule.placement)


@lru_cache(maxsize=256)
def _actions(schedule: Schedule, pp: int, m: int, v: int, group: int | None) -> list:
    """``schedule``'s action lists (:func:`parcompile.core.schedule.build_actions`), shared by
    the layouts of one pipeline whose chunks weigh differently (:func:`_weighted_in_flight`)."""
    return build_actions(schedule, pp, m, v, group=group)


def memory_report(graph: Graph, cfg, degrees: Mapping[str, int], stage_params: Sequence[StageParams],
                  in_flight: Sequence | None = None,
                  kv_bytes_per_sequence: Sequence[int] | None = None) -> MemoryReport:
    """Build the :class:`MemoryReport` for ``cfg`` (a SpecConfig). ``in_flight`` per
    stage comes from the simulated schedule; None takes :func:`closed_form_in_flight`."""
    par, model = cfg.parallel, cfg.model
    pp, v = par.pp, par.virtual_stages
    saved = saved_bytes(graph, degrees, pp * v, par.recompute, model.dropout > 0, cfg.cluster.engine,
                        attention_engine(cfg.cluster), fp8=fp8_enabled(cfg), lora=frozen_saves(cfg, graph))
    saved = with_adapter_activations(cfg, degrees, saved, graph)
    bufs = buffer_bytes(graph, cfg, degrees, saved)
    return memory_from_parts(cfg, degrees, stage_params, saved, bufs, in_flight, kv_bytes_per_sequence)


def memory_from_parts(cfg, degrees: Mapping[str, int], stage_params: Sequence[StageParams], saved: SavedBytes,
                      bufs: Sequence[Mapping[str, int]], in_flight: Sequence | None = None,
                      kv_bytes_per_sequence: Sequence[int] | None = None,
                      stop_above: int | None = None) -> MemoryReport:
    """The :class:`MemoryReport` from its parts: parameters per stage, the bytes one
    micro-batch saves per chunk, the buffers per stage and the micro-batches in flight
    (None: :func:`closed_form_in_flight`). :func:`memory_report` reads the parts off a
    graph; the layout search (:mod:`parcompile.layout_search`) builds them from one costed layer.
    ``stop_above`` (the search, which only asks whether a layout fits): the stages after the
    first whose total exceeds it are left out, so the report's ``peak`` is then a lower
    bound (above ``stop_above``) and ``per_stage`` shorter."""
    par, model = cfg.parallel, cfg.model
    pp, v, sched = par.pp, par.virtual_stages, par.pipeline_schedule
    e = model.dtype_bytes
    serve = cfg.workload == "serve"
    if in_flight is None:
        group = par.microbatch_group_size
        in_flight = closed_form_in_flight(sched, pp, v, par.num_microbatches, group)
        unlike = unlike_chunk_bytes(cfg, saved)
        if unlike is not None and not serve:
            in_flight = _weighted_in_flight(sched, pp, v, par.num_microbatches, unlike, group)
    stages = []
    for s, sp in enumerate(stage_params):
        kv = host = 0
        if serve:
            params, grads, opt = e * sp.total, 0, 0
            acts = 0
            if kv_bytes_per_sequence is not None and cfg.serve is not None:
                kv = cfg.serve.batch * kv_bytes_per_sequence[s]   # one sequence's cache (analysis/kv.py)
        else:
            # ZeRO: sharded per gradient bucket; offload: some of it in host memory
            params, grads, opt, host = offload_states(cfg, degrees, sp, stage_state_bytes(cfg, degrees, sp))
            ks = par.rank_chunks(s)
            body = sum(saved.per_chunk[k] - saved.output_layer[k] for k in ks)
            out_layer = sum(saved.output_layer[k] for k in ks)
            n_out = par.num_microbatches if sched.forwards_first else 1
            acts = int(Fraction(in_flight[s]) * body) + n_out * out_layer
        layers = tuple(sorted((layer, b) for layer, b in saved.kept_per_layer.items()
                              if saved.chunk_of_layer.get(layer) in par.rank_chunks(s))) if not serve else ()
        parts = dict(bufs[s])
        gathered = zero3_gathered_bytes(cfg, degrees, sp)
        if gathered:
            parts["zero3_gather"] = gathered
        fp8_copies = weight_copy_bytes(cfg, sp.fp8, engine_of(cfg.cluster).name) if not serve else 0
        if fp8_copies:
            parts["fp8_weights"] = fp8_copies   # precision = fp8 (analysis/fp8.py)
        full = full_grad_bytes(cfg, degrees, sp)
        if full:
            parts["grad_buckets_in_flight" if data_parallel_sharding(par).per_microbatch else "full_grads"] = full
        buffers = buffer_total(parts) - (0 if serve else backward_freed(cfg, degrees, sp, saved, s, parts))
        stages.append(StageMemory(s, params, grads, opt, acts, kv, buffers, parts, layers,
                                  allocator_bytes({k: v for k, v in parts.items() if k not in PERSISTENT_BUFFERS},
                                                  getattr(cfg.cluster, "expandable_segments", True)), host))
        if stop_above is not None and stages[-1].total > stop_above:
            break
    peak = max(x.total for x in stages)
    cap = usable_memory(cfg.cluster)
    return MemoryReport(tuple(stages), peak, cap, peak <= cap, max(x.reserved for x in stages))


def usable_memory(cluster) -> int:
    """Bytes a plan may use per GPU: the GPU's ``memory`` less the ``memory_reserve``
    fraction (:attr:`MemoryReport.capacity`; the search's memory bounds compare with it)."""
    return int(cluster.memory * (1 - cluster.memory_reserve))


def backward_freed(cfg, degrees: Mapping[str, int], sp: StageParams, saved: SavedBytes, stage: int,
                   parts: Mapping[str, int]) -> int:
    """Bytes by which the ``grad_buckets_in_flight`` buffer of pipeline stage ``stage``
    overlaps its activation peak less than in full (module docstring, "Gradient buckets
    and the activation peak"). With ZeRO 2 and 3 a bucket's full buffer exists only in a
    backward, from the backward of its first unit until its reduce-scatter is done; by the
    time the two buckets in flight are full, the backward of their decoder layers has freed
    what those layers kept for the micro-batch. The stage's peak is then ``max(activations,
    activations - freed + buckets)`` beside the other buffers: the buckets count
    ``min(buckets, freed)`` less. The pair is the largest two adjacent dense buckets of a
    chunk (:func:`parcompile.core.buckets.buckets_in_flight`'s rule); a layer's kept bytes
    are its chunk's (``per_chunk - output_layer`` of :class:`SavedBytes`, one micro-batch)
    over the chunk's decoder layers, the same for the plan and the search's probes. 0 when
    the buckets are reduced once per step, or nothing is in flight."""
    full = parts.get("grad_buckets_in_flight", 0)
    d = shard_degree(degrees)
    if not full or d <= 1:
        return 0
    dense, _ = stage_buckets(sp, cfg.parallel.bucket_size)
    per_chunk: dict[int, list] = {}
    for b in dense:
        per_chunk.setdefault(b.chunk, []).append(b)
    best, freed = -1, 0
    for c, bs in per_chunk.items():
        k = cfg.parallel.rank_chunks(stage)[c]
        layers = sum(u.startswith("layers.") for b in bs for u in b.units)
        if not layers or k >= len(saved.per_chunk):
            continue
        per_layer = (saved.per_chunk[k] - saved.output_layer[k]) // layers
        for pair in list(zip(bs, bs[1:])) or [(bs[0],)]:
            size = sum(math.ceil(b.elements / d) * d for b in pair)
            if size > best:
                best = size
                freed = per_layer * sum(u.startswith("layers.") for b in pair for u in b.units)
    return min(full, max(freed, 0))


#: buffer parts held for the whole step, not transient: no allocator gap is left for them
#: (the FP8 weight copies Transformer Engine caches, analysis/fp8.py)
PERSISTENT_BUFFERS = frozenset({"fp8_weights"})


def allocator_bytes(parts: Mapping[str, int], expandable_segments: bool = True) -> int:
    """What PyTorch's CUDA caching allocator holds beyond the live tensors at a stage's
    peak (module docstring, "Allocator"), from the stage's temporary buffers
    (``buffer_parts``, bytes): with expandable segments the largest of them (one gap of
    its size left mapped), without them their sum (each transient's block cached in its
    own segment). 0 without temporary buffers."""
    sizes = [v for v in parts.values() if v > 0]
    if not sizes:
        return 0
    return max(sizes) if expandable_segments else sum(sizes)


def buffer_total(parts: Mapping[str, int]) -> int:
    """Bytes of a stage's temporary buffers at their peak, from its ``buffer_parts``: their
    sum, with each group of :data:`EXCLUSIVE_BUFFERS` (never alive at once: the logits and
    the recomputation's working set) counted by its largest member."""
    total = sum(parts.values())
    for group in EXCLUSIVE_BUFFERS:
        sizes = [parts.get(k, 0) for k in group]
        total -= sum(sizes) - max(sizes)
    return total


def merge_buffers(into: dict[str, int], other: Mapping[str, int]) -> dict[str, int]:
    """Merge the buffers ``other`` (name -> bytes) of more ops of a stage into ``into``, in
    place, and return it: per name the largest (one buffer of each name is alive at a time,
    reused from op to op). :func:`buffer_bytes` builds a stage's buffers with it op by op,
    the search a rank's from its probe's chunks."""
    for k, b in other.items():
        into[k] = max(into.get(k, 0), b)
    return into


def buffer_bytes(graph: Graph, cfg, degrees: Mapping[str, int], saved: SavedBytes) -> list[dict[str, int]]:
    """Per pipeline stage, the temporary buffers of the module docstring, by name."""
    par = cfg.parallel
    pp = par.pp
    serve = cfg.workload == "serve"
    out: list[dict[str, int]] = [{} for _ in range(pp)]

    def bump(s: int, key: str, b: int) -> None:
        if b > 0:
            merge_buffers(out[s], {key: b})

    layer_stage: dict[int, int] = {}
    for nd in graph.nodes():
        s = nd.stage or 0
        if nd.op.layer is not None:
            layer_stage[nd.op.layer] = s
        if nd.has_trait(Trait.LOSS) and not serve:
            # the 16-bit logits live until the loss has made its fp32 copy; an eager loss
            # (torchtitan: cross_entropy(pred.float(), ...)) holds that fp32 copy beside its
            # log-softmax output, a fused one (Megatron's vocab-parallel loss) does not
            t = graph.inputs(nd.name)[0]
            extra = 0
            if engine_of(cfg.cluster).fp32_loss:
                lt = graph.node(t).sharding.local_type(graph.node(t).type, degrees)
                extra = 4 * lt.numel if lt.itemsize < 4 else 0
            bump(s, "logits", _local_bytes(graph, t, degrees) + extra)
        elif nd.has_trait(Trait.CONVERSION) and [k for k, _ in nd.op.attr("fwd")] == ["all_gather"]:
            bump(s, "tp_gather", _local_bytes(graph, nd.name, degrees))
        elif nd.has_trait(Trait.STAGE_TRANSFER):
            b = _local_bytes(graph, nd.name, degrees)
            bump(nd.op.attr("src_stage"), "p2p", 2 * b)
            bump(nd.op.attr("dst_stage"), "p2p", 2 * b)
    if not serve:
        for layer, s in layer_stage.items():
            if par.recompute == "full" or (par.recompute == "selective" and engine_of(cfg.cluster).sac == "op"):
                # the layer's recomputed tensors (torchtitan's op-level policy rebuilds all but the kept)
                bump(s, "recompute", saved.per_layer.get(layer, 0) - (
                    0 if par.recompute == "full" else saved.kept_per_layer.get(layer, 0)))
            elif par.recompute == "selective":
                bump(s, "recompute", saved.per_layer_attention.get(layer, 0))
            elif is_module_list(par.recompute):
                # the modules' dropped tensors, rebuilt during the layer's backward (at most all of them)
                bump(s, "recompute", saved.per_layer.get(layer, 0) - saved.kept_per_layer.get(layer, 0))
    return out


def zero3_gathered_bytes(cfg, degrees: Mapping[str, int], sp: StageParams) -> int:
    """Most bytes of full (tp-local) parameters a ZeRO-3 rank holds at once during a step,
    beside its own slice: :func:`parcompile.analysis.buckets.zero3_gathered` over the
    stage's gradient buckets (each gathered into a buffer padded to ``ceil(n / d) * d``
    elements; LoRA: the base model's buckets, its frozen weights', and the adapters'). With
    ``pp = 1`` that is the buckets of two units adjacent in forward order
    (embedding, layers, output layer: one runs while the next is prefetched), plus a tied
    embedding's bucket, kept for the step; with ``pp > 1`` every bucket (all are gathered
    before the first backward and kept across the micro-batches). 0 without ZeRO-3 or when
    the parameters' group has one rank (nothing is sharded)."""
    par = cfg.parallel
    if cfg.workload == "serve" or not data_parallel_sharding(par).shards_parameters:
        return 0
    dense, expert = stage_buckets(sp, par.bucket_size)
    e = cfg.model.dtype_bytes
    # the model dtype's bytes; with FP8 all-gather (ir/fp8.py gathers_fp8) the program
    # (runtime/train/zero_gather.py ParamGather._gather_fp8) keeps the bucket's buffer in the dtype
    # (the parameters' storage, the FP8 weights dequantized there) and beside it the E4M3
    # copies its FP8 GEMMs read, 1 byte per FP8 weight element. torchao's FSDP2 holds the
    # FP8 weights at 1 byte only (no 16-bit copy): this plan prices the program's buffers
    size = (lambda b, d: e * math.ceil(b.elements / d) * d + b.fp8) if gathers_fp8(cfg) else \
        (lambda b, d: e * math.ceil(b.elements / d) * d)
    kinds = [(dense, shard_degree(degrees)), (expert, degrees["expert_dp"])]
    if is_lora(cfg):   # the frozen weights (``sp``'s buckets: analysis/lora.py frozen_gathers) and the adapters'
        kinds += list(zip(stage_buckets(trainable(cfg, degrees, sp), par.bucket_size), [k[1] for k in kinds]))
    step_long, jit = zero3_gathered(kinds, reshard_after_forward(par.pp), head_reads_embedding(cfg), size)
    return int(step_long + jit)


def full_grad_bytes(cfg, degrees: Mapping[str, int], sp: StageParams) -> int:
    """ZeRO 2 and 3: bytes of full gradient buffers a rank holds at once during a step
    (module docstring), for the kinds sharded over more than one rank (an unsharded kind
    keeps its gradients as state); 0 otherwise. Reduced per micro-batch
    (:attr:`parcompile.core.data_parallel.DataParallelSharding.per_microbatch`): the buckets in flight,
    ``buckets_in_flight`` per kind (two adjacent buckets of a chunk at most) times the
    reduce dtype's bytes; once per step (zero-bubble): every bucket padded to a multiple of
    its group's size, ``b * sum ceil(n_b / d) * d``, ``b`` 4 (fp32) or the reduce dtype's
    under an engine that keeps the step's buffers in it (Megatron-Core). Both per element as
    :func:`parcompile.analysis.estimate.grad_element_bytes`, which the step's collectives use."""
    par = cfg.parallel
    dps = data_parallel_sharding(par)
    if cfg.workload == "serve" or not dps.shards_gradients:
        return 0
    dense, expert = stage_buckets(trainable(cfg, degrees, sp), par.bucket_size)
    d, ed = shard_degree(degrees), degrees["expert_dp"]
    if dps.per_microbatch:
        return grad_element_bytes(cfg) * (buckets_in_flight(dense, d) + buckets_in_flight(expert, ed))
    return grad_element_bytes(cfg) * ((shard_elements(dense, d) * d if d > 1 else 0) + (shard_elements(expert, ed) * ed if ed > 1 else 0))
