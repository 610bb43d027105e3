"""Step-time estimate (SPEC 3 `estimate`): a chunk-level time model. The assumptions are
written into plan.json (``estimate.assumptions``).

**Compute.** For one micro-batch through one model chunk on one rank, from the graph
(:mod:`parcompile.analysis.compute`; :func:`chunk_times`, the one compute-time model: the
``schedule-pipeline`` pass orders and simulates its schedule with the same times). With
``P = peak_flops``, ``BW = eff.memory * hbm_bw``:

* GEMMs (linear, router, LM head, grouped experts, unfused attention's): each timed from its
  shape by the GEMM-rate model (:mod:`parcompile.analysis.gemm`, shapes from
  :func:`parcompile.analysis.compute.gemm_shapes`) at the clock a step sustains (``eff.gemm_clock``,
  FP8 ``eff.fp8_clock``; grouped expert GEMMs as the engine schedules them: :func:`parcompile.analysis.gemm.
  grouped_gemm_seconds`); without GEMM kernel facts ``flops / (eff.matmul * P) + (operand + weight bytes) / BW``;
* fused attention cores: the FLOPs the causal kernel runs (:func:`~parcompile.analysis.
  compute.causal_share`) plus ``softmax_dim`` FLOPs per score for its exponentials, at
  ``attention * P * (1 + softmax_dim / 128)`` (the kernel's measured fraction at head dim
  128; :func:`attention_efficiency` picks the engine's kernel); an unfused core is its
  matmuls at the GEMM rate and its scores' traffic;
* with ``train.precision = fp8`` (:mod:`parcompile.analysis.fp8`) the layers' linear GEMMs
  at the FP8 rate (the GEMM-rate model at the FP8 / MXFP8 peak, inputs and weights of 1 byte),
  plus the recipe's casts at ``BW`` and its amax all-reduces over tp;
* the non-matmul kernels (norms, activations, RoPE, dropout, residual adds, the loss) are
  memory-bound and move ``traffic * Engine.elementwise`` bytes (``OpSpec.traffic`` is the
  fused count) at ``BW``;
* the host's fixed cost per op (``cluster.op_overhead``: the eager program's Python,
  dispatcher and autograd work per graph op, what dominates a CPU run of a small model;
  0 on the GPU presets, whose host work runs ahead of the GPU's queue): ``ops *
  op_overhead`` per chunk, ``ops`` the graph ops of the chunk's forward
  (:func:`parcompile.analysis.compute.counts_as_op`).

Backward costs twice the forward (every term); recomputation adds the forward of the
recomputed ops (all of a layer with ``full``; the attention core with ``selective``, or
torchtitan's op-level policy under an engine with ``Engine.sac = "op"``). ``EFFICIENCY`` gives the
fractions per GPU preset, ``ENGINES`` what each engine (``cluster.engine``) changes, with
their sources (``docs/clusters.md``); a cluster without a preset takes
``DEFAULT_EFFICIENCY``.

**Communication**, by the network model (:class:`Link`, :func:`collective_algorithm`,
``docs/clusters.md``): a group of ``n`` ranks with ``k`` on each of ``N`` NVLink domains
(nodes) runs the algorithm NCCL would pick (ring, tree, NVLS, NVLSTree, all-to-all, p2p) at
its bus bandwidth ``B``: ``latency + bytes * f / B`` with nccl-tests' factors ``f``
(all-reduce ``2(n-1)/n`` of the buffer; all-gather / all-to-all ``(n-1)/n`` of the gathered
output; reduce-scatter ``n-1`` times the output shard; send 1). Inside a domain ``B`` is
NVLink's (``intra_node_bw * eff.link``, NVLS where the switches reduce); across domains a
ring drives ``k`` NICs (``k * inter_node_bw * eff.net``, at most NVLink's), an all-to-all
sends ``(n-k)/n`` of its data through each rank's NIC, a send uses one NIC. What overlaps:

* tensor-, context- and expert-parallel collectives do not overlap compute (Megatron-LM
  2021-22 runs them on the compute stream): they lengthen each chunk's forward and
  backward (and the recomputed forward with ``recompute = full``); with
  ``cluster.tp_comm_overlap`` (Transformer Engine's userbuffers under the megatron engine,
  with sequence parallelism) each tensor-parallel all-gather and reduce-scatter of a layer
  hides under the GEMMs it feeds or drains, split in tp chunks: only :func:`tp_exposed` of
  it lengthens them;
* pipeline send/recv are blocking, as Megatron-LM's ``batch_isend_irecv`` steps are:
  each forward of a chunk that sends on, and each backward that sends back, waits for its
  transfer (``pp_comm`` = the makespan with transfers minus the makespan without); with
  ``cluster.overlap_p2p_comm`` under interleaved 1F1B only the warmup's and the flush's
  transfers block (:func:`p2p_blocking_share`). A
  tensor-parallel-replicated activation travels as Megatron-LM's scatter/gather
  optimisation sends it (Narayanan et al. 2021, section 4.1): 1/t per rank over the
  pipeline link, then an all-gather over the tensor-parallel link;
* the data-parallel gradient reduction overlaps the backward of the last micro-batch on
  the stage, bucket by bucket, as torch DDP and Megatron-Core's ``overlap_grad_reduce``
  do (:func:`grad_overlap`): one communication stream; a bucket
  (:mod:`parcompile.analysis.buckets`) starts when the backward has produced its last
  unit's gradients and the previous bucket is done; what runs past the end of the
  backward is exposed (``dp_comm``). ZeRO 2 and 3 reduce-scatter the buckets in every
  micro-batch's backward; all but the last micro-batch's hide under the compute that
  follows them, the last one's is simulated as above. ZeRO's parameter all-gathers overlap the next
  step's first forward; norms, the model-parallel gradient sums and the loss reductions
  are exposed.
  Overlapped is not free: the hidden part slows the compute beneath it by
  ``eff.overlap`` of its time (NCCL's kernels occupy streaming multiprocessors), counted in
  ``dp_comm``; under an FSDP2 engine (``Engine.fsdp2``) with ZeRO-3, FSDP2's copies into and out of its
  flat buffers are exposed too (:func:`step_sums`).

**Pipeline.** With the schedule's action lists the simulator runs them with these chunk
times (bubble from the actual schedule). Without them (:func:`estimate` with
``sched=None``) the closed form ``makespan = m W_max + (p - 1)/v * W_mean`` is used,
``W`` a rank's time for one micro-batch through all its chunks; for equal stages its
bubble is :func:`closed_form_bubble` ``= (p-1)/(v m)``, what 1F1B and Megatron's
interleaved 1F1B give.

**Optimizer**: the step after the pipeline drains is memory-bound
(:func:`optimizer_time`).

``step_time = makespan + dp_comm + optimizer``; ``breakdown`` adds up to it: compute
(matmuls, forward and backward), memory_bound (non-matmul kernels; backward moves
``BACKWARD_TRAFFIC`` times the forward's bytes), op_overhead (only where
``cluster.op_overhead`` is set), recompute, tp_comm, cp_comm, ep_comm (the
busiest rank's work), bubble, pp_comm, dp_comm, optimizer.
``tokens_per_s = global_batch * seq_len / step_time``;
``tflops_per_gpu = model_flops_per_step / (step_time * world_size) / 1e12``;
``mfu = tflops_per_gpu * 1e12 / peak_flops``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from parcompile.analysis.comm import CommReport
from parcompile.analysis.compute import ComputeReport
# the cluster's rates and engine, and the network model, live in their own modules; their
# names stay importable from here (re-exported) for the estimate's callers
from parcompile.analysis.efficiency import (DEFAULT_EFFICIENCY, DEFAULT_ENGINE, EFFICIENCY, ENGINES,  # noqa: F401
                                            Efficiency, Engine, attention_efficiency, efficiency, engine,
                                            fp8_efficiency)
from parcompile.ir.fp8 import enabled as fp8_enabled
from parcompile.analysis.fp8 import assumptions as fp8_assumptions, fp8_costs, weight_cast_bytes
from parcompile.analysis.gemm import gemm_assumptions
from parcompile.analysis.lora import lora_chunk_times
from parcompile.analysis.offload import OPTIMIZER_BYTES, offload_assumptions, offload_step_time, optimizer_step_bytes  # noqa: F401
from parcompile.analysis.network import (NVLS_LATENCY_STEPS, REFERENCE_BYTES, TREE_BANDWIDTH,  # noqa: F401
                                         Algorithm, Link, axis_crosses_nodes, axis_link, collective_algorithm,
                                         collective_algorithms, collective_time, links_of, make_link, nic_share,
                                         replica_all_reduce_time)
from parcompile.core.axes import AXIS_FAMILY
from parcompile.core.attention import attention_engine
from parcompile.core.buckets import GradUnit, bucket_element_bytes, partition, reshard_after_forward
from parcompile.core.data_parallel import data_parallel_sharding, shard_degree
from parcompile.core.schedule import LOOP, Placement, interleaved_warmup, simulate


#: backward traffic of a memory-bound kernel over its forward traffic: it reads the saved
#: input and the output gradient and writes the input gradient (3 tensors, forward 2)
BACKWARD_TRAFFIC = 1.5


def grad_element_bytes(cfg, sharding=None) -> int:
    """Bytes per element of ``cfg``'s full gradient buffers and of their data-parallel
    reductions (``sharding``: this :class:`~parcompile.core.data_parallel.DataParallelSharding`
    instead of ``cfg``'s, for the search's bounds): :func:`parcompile.core.buckets.bucket_element_bytes` with ``step_buffers``
    where the plan is for an engine that keeps the step's buffers in the reduce dtype
    (:attr:`Engine.step_grads_in_reduce_dtype`: Megatron-Core with ``--grad-reduce-in-bf16``,
    Megatron-Bridge's ``grad_reduce_in_fp32 = False``) and not for the generated program
    itself (the ``cpu`` preset, :func:`parcompile.core.attention.attention_engine`), whose
    zero 0 and 1 buffers accumulate in fp32. Used by the memory (the zero 0 and 1 gradient
    state), the step's collectives and the gradient-reduction time alike."""
    par = cfg.parallel
    step = engine(cfg.cluster).step_grads_in_reduce_dtype and attention_engine(cfg.cluster) != "program"
    dps = data_parallel_sharding(par) if sharding is None else sharding
    return bucket_element_bytes(dps, par.reduce_dtype, step_buffers=step, grad_dtype=par.grad_dtype)


def closed_form_bubble(pp: int, virtual_stages: int, num_microbatches: int) -> float:
    """The bubble fraction of 1F1B (``v = 1``) and Megatron-LM's interleaved 1F1B with
    equal stages: ``(p - 1) / (v m)`` (Narayanan et al. 2021, section 2.2)."""
    return (pp - 1) / (virtual_stages * num_microbatches)


@dataclass(frozen=True)
class TimeReport:
    """Seconds per step and the rates derived from it (module docstring)."""

    step_time: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    breakdown: dict[str, float]
    assumptions: dict[str, object] = field(default_factory=dict)
    bubble_fraction: float = 0.0
    #: per stage, the bucketed gradient reduction (:func:`grad_overlap`; training only)
    grad_reduction: tuple[GradOverlap, ...] = ()


def routed_share(cfg, degrees: Mapping[str, int]) -> float:
    """The bytes an expert-parallel all-to-all moves over the balanced per-expert count
    (:func:`parcompile.ir.ops.moe_collectives`: ``top_k`` rows per token): 1, except under
    an engine whose dispatcher deduplicates (``Engine.dedup_dispatch``, DeepEP), which sends
    a token once to each rank holding some of its experts. Under the balanced routing the
    estimate assumes (plan.json ``moe_routing``), a token's ``top_k`` experts are adjacent
    and aligned, as NeMo AutoModel's fake balanced gate routes (token ``t`` to experts
    ``t k .. t k + k - 1`` mod ``E``, ``nemo_automodel/components/moe/layers.py``
    ``FakeBalancedGate``): they sit on ``ceil(k / (E / ep))`` ranks, so the share is that
    over ``k``."""
    m = cfg.model
    ep = degrees.get("ep", 1)
    if not m.experts or ep <= 1 or not engine(cfg.cluster).dedup_dispatch:
        return 1.0
    local = max(1, m.experts // ep)
    return min(m.top_k, -(-m.top_k // local)) / m.top_k


@dataclass(frozen=True)
class ChunkTimes:
    """Seconds for one micro-batch through each model chunk on one rank, by part."""

    matmul_f: tuple[float, ...]
    memory_f: tuple[float, ...]
    recompute: tuple[float, ...]
    comm_f: dict[str, tuple[float, ...]]     # family -> per chunk (forward, incl. recomputed)
    comm_b: dict[str, tuple[float, ...]]
    p2p: float
    #: per chunk, the forward seconds of the matmuls that have weights (the weight gradient
    #: repeats them); empty: all of ``matmul_f``
    weighted_f: tuple[float, ...] = ()
    #: per chunk, the host's fixed cost of the forward's ops (``ops * cluster.op_overhead``;
    #: the backward twice); empty: none
    overhead_f: tuple[float, ...] = ()
    frozen_f: tuple[float, ...] = ()   # per chunk, frozen weights' GEMMs: no weight gradient (LoRA)

    def _overhead(self, k: int) -> float:
        return self.overhead_f[k] if self.overhead_f else 0.0

    def fwd(self, k: int) -> float:
        return self.matmul_f[k] + self.memory_f[k] + self._overhead(k) + sum(c[k] for c in self.comm_f.values())

    def bwd(self, k: int) -> float:
        return (2 * self.matmul_f[k] + BACKWARD_TRAFFIC * self.memory_f[k] + 2 * self._overhead(k)
                + self.recompute[k] + sum(c[k] for c in self.comm_b.values()) - sum(self.frozen_f[k:k + 1]))

    def wgrad(self, k: int) -> float:
        """The weight-gradient part of a backward: the weighted matmuls' forward again."""
        return self.weighted_f[k] if self.weighted_f else self.matmul_f[k]

    def per_chunk(self) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
        """(forward, backward, weight-gradient) seconds of every model chunk, without the
        pipeline's p2p time: :meth:`fwd`, :meth:`bwd` and :meth:`wgrad` of each, what the
        schedule pass orders and simulates its action lists with."""
        ks = range(len(self.matmul_f))
        return (tuple(self.fwd(k) for k in ks), tuple(self.bwd(k) for k in ks), tuple(self.wgrad(k) for k in ks))


def overlaps_tp(cfg, degrees: Mapping[str, int]) -> bool:
    """Whether the tensor-parallel collectives of ``cfg`` overlap their GEMMs
    (:func:`tp_exposed`): ``cluster.tp_comm_overlap`` with sequence parallelism over more
    than one tp rank (Megatron-LM asserts sequence parallelism with ``--tp-comm-overlap``,
    ``megatron/training/arguments.py`` at core_v0.19.0; Megatron-Bridge turns it off with a
    warning below tp 2 or without sequence parallelism, ``training/comm_overlap.py`` at 4ab94df),
    under the ``megatron`` engine (the other engines' tensor parallelism runs unoverlapped)."""
    return bool(getattr(cfg.cluster, "tp_comm_overlap", False)) and cfg.parallel.sequence_parallel \
        and degrees.get("tp", 1) > 1 and engine(cfg.cluster).name == "megatron"


def tp_exposed(comm: float, gemm: float, n: int) -> float:
    """Exposed seconds of a tensor-parallel all-gather or reduce-scatter of ``comm`` seconds
    that Transformer Engine's userbuffers overlap with its GEMM of ``gemm`` seconds
    (arithmetic; ``cluster.tp_comm_overlap``) over ``n`` tp ranks: the GEMM runs in ``n``
    chunks, one per rank's shard, and the collective in its ``n - 1`` ring steps, step ``i``
    moving the shard chunk ``i + 1`` needs (an all-gather) or the partial sum chunk ``i``
    made (a reduce-scatter) while the next chunk computes, so ``n - 1`` of the ``n`` chunks
    hide a step: ``max(0, comm - (n - 1) / n * gemm)``. Transformer Engine
    (``transformer_engine/pytorch/module/base.py`` ``initialize_ub``: ``ring_exchange`` and
    ``pipeline`` split GEMMs; ``bulk`` for the backward's regather of a column-parallel input
    under its input-gradient GEMM and that GEMM's reduce-scatter under the weight gradient's;
    Megatron-Core ``model_parallel_config.py`` ``tp_comm_overlap_ag`` / ``_rs`` /
    ``tp_comm_bulk_wgrad`` / ``_dgrad`` at core_v0.19.0; Megatron-Bridge's
    ``userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192``, ``training/comm_overlap.py`` at
    4ab94df): the bulk overlaps hide the whole GEMM's worth, which the split rule's
    ``(n - 1) / n`` understates (one rule for all). The ring steps copy through the
    copy engines (userbuffers' peer-to-peer) or a few SMs (bulk: 2-24 of 132 in that
    configuration) and the GEMM chunks re-read their weight: neither slowdown is modelled."""
    return max(0.0, comm - (n - 1) / n * gemm) if n > 1 else comm


def p2p_blocking_share(cfg, pp: int, v: int, m: int) -> list[float] | None:
    """Per pipeline rank, the share of its chunk-forwards (and of its chunk-backwards) whose
    transfer it waits for, under ``cluster.overlap_p2p_comm`` with Megatron's interleaved 1F1B
    (``v > 1``; Megatron-LM turns the overlap off without virtual stages, arguments.py at
    core_v0.19.0): the warmup's forwards and the flush's backwards
    (:func:`parcompile.core.schedule.interleaved_warmup`; ``schedules.py``'s warmup calls
    ``send_forward_recv_forward`` synchronously unless ``overlap_p2p_comm_warmup_flush``); the
    steady state's sends and receives are posted and waited for when the tensor is needed,
    under the compute between; under the ``megatron`` engine. None: every transfer blocks
    (Megatron-LM's ``batch_isend_irecv`` steps)."""
    par = cfg.parallel
    if not getattr(cfg.cluster, "overlap_p2p_comm", False) or v <= 1 or not par.pipeline_schedule.rounds \
            or engine(cfg.cluster).name != "megatron":
        return None
    return [interleaved_warmup(r, pp, v, m, par.microbatch_group_size) / (m * v) for r in range(pp)]


def chunk_times(cfg, degrees: Mapping[str, int], groups: Mapping[str, list[list[int]]] | None,
                compute: ComputeReport, comm: CommReport,
                links: Mapping[str, tuple[float, float]] | None = None) -> ChunkTimes:
    """The per-chunk times of the module docstring. ``links`` (axis -> (alpha, beta), see
    :func:`links_of`) replaces reading the links off ``groups``."""
    par, cl = cfg.parallel, cfg.cluster
    eff, eng = efficiency(cl), engine(cl)
    nchunks = par.pp * par.virtual_stages
    rate = eff.matmul * cl.peak_flops
    # the attention kernels: matmuls plus one exponential per score; at head dim 128 they
    # run at the measured fraction, at another head dim d the exponentials weigh
    # softmax_dim / d against the matmuls (FlashAttention-3, Shah et al. 2024, section 3.1)
    arate = attention_efficiency(cl) * cl.peak_flops * (1 + eff.softmax_dim / 128)
    bw = eff.memory * cl.hbm_bw
    ebw = bw / eng.elementwise
    z = (0,) * max(nchunks, len(compute.chunk_fwd_flops))
    traffic = compute.chunk_fwd_traffic or z
    rec_traffic = compute.chunk_recompute_traffic or z

    f8 = fp8_costs(cfg, fp8_efficiency(cfg), bw, degrees, cached_weights=eng.name == "megatron")

    timed = bool(compute.chunk_gemm_seconds)

    def gemms(flops, attn, work, operands, weights, gemm_s, fp8_flops=0, cast=0.0, fp8_operands=0):
        # GEMMs by their shapes (analysis/gemm.py) + FP8 casts; else the flat rule
        if timed:
            return gemm_s + cast
        t = (flops - attn) / rate + (operands + weights) / bw
        if f8 is not None:
            # FP8 operands (inputs and weights) are read at 1 byte, not the dtype's
            t += fp8_flops / f8.rate - fp8_flops / rate + cast - fp8_operands * (cfg.model.dtype_bytes - 1) / bw
        return t

    def attention(work, scores):
        return (work + eff.softmax_dim * scores) / arate

    fwd = list(zip(compute.chunk_fwd_flops, compute.chunk_attn_flops or z, compute.chunk_attn_work or z,
                   compute.chunk_gemm_traffic or z, compute.chunk_weight_traffic or z,
                   compute.chunk_gemm_seconds or z))
    scores = compute.chunk_attn_scores or z
    again = zip(compute.chunk_recompute_flops, compute.chunk_recompute_attn_flops or z,
                compute.chunk_recompute_attn_work or z, compute.chunk_recompute_gemm_traffic or z,
                compute.chunk_recompute_weight_traffic or z, compute.chunk_recompute_gemm_seconds or z)
    if f8 is not None:
        # the casts of a forward and backward, spread over them as the GEMMs are (1 : 2):
        # a third of them in the forward's time (analysis/fp8.py), the recomputed forward's own
        sharded = f8.sharded_casts
        ins = (compute.chunk_fp8_in_tp if sharded else compute.chunk_fp8_in) or z
        outs = (compute.chunk_fp8_out_tp if sharded else compute.chunk_fp8_out) or z
        rins = (compute.chunk_recompute_fp8_in_tp if sharded else compute.chunk_recompute_fp8_in) or z
        cast_f = tuple((f8.per_in * i + f8.per_out * o + f8.per_weight * w) / 3
                       for i, o, w in zip(ins, outs, compute.chunk_fp8_weight or z))
        cast_r = tuple(f8.rec_in * i + f8.rec_weight * w
                       for i, w in zip(rins, compute.chunk_recompute_fp8_weight or z))
        fop = tuple(x + w for x, w in zip(compute.chunk_fp8_operands or z, compute.chunk_fp8_weight or z))
        rop = tuple(x + w for x, w in zip(compute.chunk_recompute_fp8_operands or z,
                                          compute.chunk_recompute_fp8_weight or z))
        fwd = [t + (f, c, o) for t, f, c, o in zip(fwd, compute.chunk_fp8_flops or z, cast_f, fop)]
        again = [t + (f, c, o) for t, f, c, o in zip(again, compute.chunk_recompute_fp8_flops or z, cast_r, rop)]
    weighted = tuple(gemms(*t) for t in fwd)
    mm = tuple(w + attention(t[2], sc) for w, t, sc in zip(weighted, fwd, scores))
    mm, weighted, frozen = lora_chunk_times(cfg, degrees, mm, weighted, rate)   # LoRA's adapters, frozen weights
    mem = tuple(x / ebw for x in traffic)
    # the host's fixed cost per op (cluster.op_overhead; 0 but on the cpu preset)
    per_op = getattr(cl, "op_overhead", 0.0)
    ovh = tuple(n * per_op for n in compute.chunk_fwd_ops or z) if per_op else ()
    rec = tuple(gemms(*t) + attention(t[2], sc) + y / ebw + n * per_op
                for t, sc, y, n in zip(again, compute.chunk_recompute_attn_scores or z, rec_traffic,
                                       compute.chunk_recompute_ops or z))
    cf, cb, p2p = _chunk_comm(cfg, degrees, groups, compute, comm, links, f8, rate)
    for k, (n, r) in enumerate(zip(compute.chunk_moe_experts or z, compute.chunk_recompute_moe_experts or z)):
        # Engine.expert_host: the experts' host wait in the ep time; a recomputed MoE layer's again
        cf["ep"][k], cb["ep"][k] = cf["ep"][k] + n * eng.expert_host, cb["ep"][k] + r * eng.expert_host
    return ChunkTimes(mm, mem, rec, {f: tuple(v) for f, v in cf.items()}, {f: tuple(v) for f, v in cb.items()}, p2p,
                      weighted, ovh, frozen)


def _chunk_comm(cfg, degrees: Mapping[str, int], groups: Mapping[str, list[list[int]]] | None,
                compute: ComputeReport, comm: CommReport, links: Mapping | None, f8, rate: float
                ) -> tuple[dict[str, list[float]], dict[str, list[float]], float]:
    """The communication part of :func:`chunk_times`: per axis family (tp, cp, ep) and
    chunk, the seconds of the forward's (``cf``) and backward's (``cb``, with the
    recomputed forward's under full recomputation) blocking collectives of ``comm.raw``,
    each timed by the network model on its axis' link (:func:`collective_time`; the ep
    all-to-alls at :func:`routed_share` of their bytes, the others at the bytes they move (FP8 tp all-gathers
    included: :func:`parcompile.ir.fp8.moved_bytes`),
    an overlapped tp collective by :func:`tp_exposed` against its GEMM at ``rate``
    FLOP/s), the FP8 tensorwise scales' all-reduces over tp, and ``p2p``: the longest
    pipeline send (Megatron-LM's scatter/gather over tp without sequence parallelism)."""
    par, cl = cfg.parallel, cfg.cluster
    eff = efficiency(cl)
    nchunks = par.pp * par.virtual_stages
    z = (0,) * len(compute.chunk_fwd_flops)
    if links is None:
        links = {a: axis_link(cl, groups, a, eff) for a in AXIS_FAMILY}
    fams = ("tp", "cp", "ep")
    share = routed_share(cfg, degrees)
    overlap_tp = overlaps_tp(cfg, degrees)
    cf = {f: [0.0] * nchunks for f in fams}
    cb = {f: [0.0] * nchunks for f in fams}
    p2p = 0.0
    for _stage, chunk, c in comm.raw:
        fam = AXIS_FAMILY.get(c.axis, c.axis)
        link = links.get(c.axis) or make_link(cl, 1, 1, eff)
        nbytes = c.bytes * share if fam == "ep" and c.op == "all_to_all" else c.bytes
        t = collective_time(c.op, nbytes, degrees.get(c.axis, 1), link)
        if overlap_tp and fam == "tp" and c.gemm_flops != (0, 0):
            f8_flops, other = c.gemm_flops
            gemm = other / rate + (f8_flops / f8.rate if f8 is not None else f8_flops / rate)
            t = tp_exposed(t, gemm, degrees.get(c.axis, 1))
        if fam == "pp":
            if c.op == "send":
                tp = degrees.get("tp", 1)
                if tp > 1 and not par.sequence_parallel:
                    # Megatron-LM's scatter/gather: each tp rank sends 1/t of the
                    # (tp-replicated) activation, the receivers all-gather it over tp
                    t = (collective_time("send", c.bytes // tp, 1, link)
                         + collective_time("all_gather", c.bytes, tp, links["tp"]))
                p2p = max(p2p, t)
            continue
        if fam not in cf:
            continue
        (cf if c.phase == "forward" else cb)[fam][chunk] += t
        if c.phase == "forward" and par.recompute == "full":
            cb[fam][chunk] += t
    if f8 is not None and f8.amax:
        # tensorwise scales of tp-sharded operands: one scalar all-reduce over tp per cast
        # (analysis/fp8.py), on the critical path as the other tp collectives
        one = collective_time("all_reduce", 4, degrees.get("tp", 1), links.get("tp") or make_link(cl, 1, 1, eff))
        for k, (n, g, sc) in enumerate(zip(compute.chunk_fp8_gemms or z, compute.chunk_fp8_gathered or z,
                                           compute.chunk_fp8_scattered or z)):
            w = n if f8.amax_weights else 0
            cf["tp"][k] += (g + w) * one
            cb["tp"][k] += (sc + w + ((g + w) if par.recompute == "full" else 0)) * one
    return cf, cb, p2p


def _closed_form_makespan(f: Sequence[float], b: Sequence[float], pp: int, v: int, m: int,
                          place: Placement = LOOP) -> tuple[float, list[float]]:
    """(makespan, busy per rank) of the closed form in the module docstring."""
    work = [sum(f[k] + b[k] for k in place.chunks(r, pp, v)) for r in range(pp)]
    return closed_form_span(work, pp, v, m), [m * w for w in work]


def closed_form_span(work: Sequence[float], pp: int, v: int, m: int) -> float:
    """The closed-form makespan of the module docstring, ``m * max(work) + (pp - 1) / v *
    mean(work)``, from ``work``: per pipeline rank, the seconds of one micro-batch's forward
    and backward through its ``v`` chunks (transfers included)."""
    return m * max(work) + (pp - 1) / v * (sum(work) / pp)


def pipeline_makespan(ct: ChunkTimes, pp: int, v: int, m: int, actions=None,
                      with_p2p: bool = True, blocking: Sequence[float] | None = None,
                      place: Placement = LOOP) -> tuple[float, list[float]]:
    """(makespan, busy seconds per rank) of one step's pipeline: simulated from the action
    lists when given, else the closed form. ``blocking`` (:func:`p2p_blocking_share`): per
    rank, the share of its chunks' transfers it waits for (the rest overlap compute; in the
    simulation they are a latency of ``p2p`` on their dependency); None: all of them.
    ``place``: which rank holds each model chunk (the schedule's placement)."""
    nchunks = pp * v
    last = nchunks - 1
    p2p = ct.p2p if (with_p2p and pp > 1) else 0.0
    share = [1.0] * pp if blocking is None else list(blocking)
    f0, b0, w0 = ct.per_chunk()   # the schedule pass's times; blocking sends add the p2p
    f = [f0[k] + (p2p * share[place.rank(k, pp)] if k < last else 0.0) for k in range(nchunks)]
    b = [b0[k] + (p2p * share[place.rank(k, pp)] if k > 0 else 0.0) for k in range(nchunks)]
    if actions is None:
        return _closed_form_makespan(f, b, pp, v, m, place)
    kw = {}
    if any(a["op"] in ("backward_input", "backward_weight") for acts in actions for a in acts):
        kw["wgrad_time"] = list(w0[:nchunks])
    if blocking is not None:
        kw["p2p_time"] = p2p   # the overlapped transfers still take their time to arrive
    sim = simulate(actions, f, b, pp, v, placement=place, **kw)
    return sim.makespan, list(sim.busy)


@dataclass(frozen=True)
class GradOverlap:
    """The data-parallel gradient reduction of one stage, simulated bucket by bucket
    (module docstring): ``seconds`` of collectives in all, the part ``hidden`` behind the
    last micro-batch's backward and the part ``exposed`` after it; ``buckets`` counts the
    dense and expert buckets."""

    stage: int
    buckets: int
    seconds: float
    hidden: float
    exposed: float

    def to_dict(self) -> dict:
        # float noise of the bucket simulation (1e-20 s) reads as exactly 0
        def clean(t: float) -> float:
            return t if t > 1e-12 * max(self.seconds, 1e-9) else 0.0

        return {"stage": self.stage, "buckets": self.buckets, "seconds": self.seconds, "hidden": clean(self.hidden),
                "exposed": clean(self.exposed)}


def _unit_weight(u, model_chunk: int) -> int:
    """How much of its chunk's backward a unit's gradients take, in parameters: a layer's
    (and the LM head's) backward FLOPs scale with its parameters; the embedding's backward
    is a scatter-add, so its gradient arrives when the chunk's backward ends."""
    if u.name in ("embedding", "tied_embedding") or (u.name == "stage" and model_chunk == 0):
        return 0
    return u.dense + u.expert


def grad_overlap(cfg, degrees: Mapping[str, int], links, ct: ChunkTimes, sp) -> GradOverlap:
    """Simulate one stage's bucketed gradient reduction on one communication stream.

    The last micro-batch's backward visits the stage's chunks from its last to its first
    (``bwd`` seconds each, :class:`ChunkTimes`); inside a chunk, a unit's gradients are
    ready after the share of the backward its parameters take (:func:`_unit_weight`). A
    bucket (:mod:`parcompile.analysis.buckets`) is ready with its last unit and starts at
    ``max(ready, end of the previous bucket)``; with ``bucket_size = 0`` every bucket is
    ready when the backward ends. ``exposed = end of the last bucket - end of the
    backward``. Buckets are all-reduces (reduce-scatters with ZeRO) over dp_cp (experts:
    expert_dp), timed by :func:`collective_time`.

    ZeRO 2 and 3 reduce-scatter every bucket in each of the ``m`` micro-batches' backwards
    (:attr:`parcompile.core.data_parallel.DataParallelSharding.per_microbatch`): the earlier micro-batches'
    reduce-scatters run under the compute that follows them (the next forwards and
    backwards; the program waits for them only when the next backward starts), so only the
    last micro-batch's can be exposed, as simulated; ``seconds`` counts all ``m`` rounds and
    ``hidden`` the rest.
    """
    par, cl = cfg.parallel, cfg.cluster
    s = sp.stage
    mine = par.rank_chunks(s)
    units = getattr(sp, "units", ()) or (GradUnit(0, "stage", sp.dense, sp.expert),)
    # ready time of each unit: chunks in ready order, back to back
    ready: dict[tuple[int, str], float] = {}
    t = 0.0
    for c in sorted({u.chunk for u in units}, reverse=True):
        here = [u for u in units if u.chunk == c]
        k = mine[c]
        total = sum(_unit_weight(u, k) for u in here)
        b = ct.bwd(k) if k < len(ct.matmul_f) else 0.0
        done = 0
        for u in here:
            done += _unit_weight(u, k)
            ready[(c, u.name)] = t + (b * done / total if total else b)
        t += b
    bwd_end = sum(ct.bwd(k) for k in mine if k < len(ct.matmul_f))
    dps = data_parallel_sharding(par)
    op = dps.gradient_reduction
    events = []
    once, hsdp = 0.0, dps.replicate > 1 and dps.shards_optimizer_states   # HSDP: all-reduces over replicas, once
    for kind, axis in (("dense", dps.shard_group if hsdp else "dp_cp"), ("expert", "expert_dp")):
        if (n := dps.shard if hsdp and kind == "dense" else degrees.get(axis, 1)) <= 1:
            continue
        link = links.get(axis) or make_link(cl, 1, 1)
        for b in partition(units, par.bucket_size, kind):
            nbytes = grad_element_bytes(cfg) * (
                -(-b.elements // n) if dps.shards_optimizer_states else b.elements)   # reduce dtype (grad_element_bytes)
            r = bwd_end if par.bucket_size == 0 else max(ready[(b.chunk, name)] for name in b.units)
            once += (ar := replica_all_reduce_time(dps, b.elements, links, cl) if hsdp and kind == "dense" else 0.0)
            events.append((r, kind != "dense", collective_time(op, nbytes, n, link) + ar))
    # times relative to the end of the backward (buckets all ready then: exposed == busy exactly)
    end, busy = None, 0.0
    for r, _, dur in sorted(events):
        end = (r - bwd_end if end is None else max(end, r - bwd_end)) + dur
        busy += dur
    exposed = min(busy, max(0.0, end)) if events else 0.0
    if dps.per_microbatch:   # m rounds; all but the last micro-batch's hide (docstring); HSDP's all-reduces once
        busy = (busy - once) * par.num_microbatches + once
    return GradOverlap(s, len(events), busy, max(0.0, busy - exposed), exposed)


def step_sums(cfg, degrees, links, collectives) -> list[tuple[float, float, float, float]]:
    """Per pipeline stage, seconds of its step collectives (``count`` runs each, timed by
    :func:`collective_time`): ``(gradient reductions, parameter all-gathers, the rest, buffer
    copies)``,
    what :func:`dp_exposed` sets against the stage's backward and forward. The buffer copies
    are FSDP2's under an engine with ``Engine.fsdp2`` and ZeRO-3 (2 x the unsharded bytes of each
    parameter all-gather and gradient reduce-scatter, at ``eff.memory * hbm_bw``, on the
    compute stream: exposed); 0 otherwise."""
    par, cl = cfg.parallel, cfg.cluster
    per_stage: dict[int, list] = {}   # each stage's step collectives, in order
    for e in collectives:
        if e.phase == "step":
            per_stage.setdefault(e.stage, []).append(e)
    # FSDP2 (Engine.fsdp2, ZeRO-3) copies each all-gather's output out of, and each
    # reduce-scatter's input into, its flat communication buffer on the compute stream:
    # read and write the full (unsharded) bytes once each
    copy_bw = efficiency(cl).memory * cl.hbm_bw if engine(cl).fsdp2 and data_parallel_sharding(par).shards_parameters \
        else 0.0
    out = []
    for s in range(par.pp):
        grads = params = exposed = copies = 0.0
        for e in per_stage.get(s, ()):
            link = links.get(e.axis) or make_link(cl, 1, 1)
            t = e.count * collective_time(e.op, e.bytes, degrees.get(e.axis, 1), link)
            if copy_bw and e.op in ("all_gather", "reduce_scatter") and e.where in (
                    "grads", "expert_grads", "params", "expert_params"):
                full = e.bytes * (degrees.get(e.axis, 1) if e.op == "reduce_scatter" else 1)
                copies += e.count * 2 * full / copy_bw
            if e.where in ("grads", "expert_grads"):
                grads += t
            elif e.where in ("params", "expert_params"):
                params += t
            else:
                exposed += t
        out.append((grads, params, exposed, copies))
    return out


def dp_exposed(cfg, degrees, links, collectives, ct: ChunkTimes, stage_params=None, sums=None) -> float:
    """Exposed step-collective time of the slowest stage (module docstring): the gradient
    buckets' exposure (:func:`grad_overlap`; without ``stage_params``, the step's
    gradient collectives against the last micro-batch's backward), ZeRO's parameter
    all-gathers beyond the next step's first forward (ZeRO-3 with ``pp = 1``: beyond all of
    the step's forwards and backwards, which regather the layers), and every other step
    collective. ``sums``: :func:`step_sums` of ``collectives``, when known.

    The hidden part of the gradient reductions and parameter all-gathers is not free: it
    slows the compute beneath it by :attr:`Efficiency.overlap` of its own time (NCCL's kernels
    share the GPU), which this adds."""
    par = cfg.parallel
    pp = par.pp
    tax = efficiency(cfg.cluster).overlap
    dps = data_parallel_sharding(par)
    worst = 0.0
    for s, (grads, params, exposed, copies) in enumerate(sums if sums is not None
                                                 else step_sums(cfg, degrees, links, collectives)):
        # gradients overlap the last micro-batch's backward bucket by bucket; ZeRO's
        # parameter all-gathers the next step's first forward, or, ZeRO-3 regathering
        # layers in every micro-batch (pp = 1), every forward and backward (prefetched
        # one bucket ahead, as FSDP does)
        bwd = sum(ct.bwd(k) for k in par.rank_chunks(s))
        fwd = sum(ct.fwd(k) for k in par.rank_chunks(s))
        if dps.shards_parameters and reshard_after_forward(pp):
            # the gathers share the data-parallel link with the gradient reductions: what
            # the gradients occupy of the step's compute is not there for the gathers
            fwd = max(0.0, par.num_microbatches * (fwd + bwd) - grads)
        if stage_params is not None:
            grad_exposed = grad_overlap(cfg, degrees, links, ct, stage_params[s]).exposed
        elif dps.per_microbatch:   # m rounds: the last one's against the last backward
            grad_exposed = max(0.0, grads / par.num_microbatches - bwd)
        else:
            grad_exposed = max(0.0, grads - bwd)
        params_exposed = max(0.0, params - fwd)
        # what the step's collectives run under compute: the gradient reductions' one round
        # set against the last backward (ZeRO 2/3's earlier per-micro-batch rounds are not
        # taxed) and the parameter gathers; the step collectives' sums, as the search's
        # floors read them (the total grows by at most ``tax`` per second less exposed)
        rounds = par.num_microbatches if dps.per_microbatch else 1
        hidden = max(0.0, grads / rounds - grad_exposed) + (params - params_exposed)
        worst = max(worst, grad_exposed + params_exposed + exposed + copies + tax * hidden)
    return worst


def optimizer_time(cfg, degrees: Mapping[str, int], stage_params) -> float:
    """Seconds of the optimizer step on the busiest rank: memory-bound, it moves
    ``OPTIMIZER_BYTES`` per parameter it updates (a ``1/d`` shard with ``zero >= 1``),
    plus reading the fp32 gradients for the norm and zeroing them (8 bytes per gradient
    held); at ``eff.memory * hbm_bw``. Offloaded: :func:`parcompile.analysis.offload.offload_step_time`."""
    if not stage_params or cfg.workload != "train":
        return 0.0
    par, cl, eff = cfg.parallel, cfg.cluster, efficiency(cfg.cluster)
    per = optimizer_step_bytes(cfg)
    if par.offload != "none":   # stepped on the CPU, the parameters copied back (analysis/offload.py)
        return offload_step_time(cfg, degrees, stage_params, per).exposed
    worst, eng, dps = 0.0, engine(cl).name, data_parallel_sharding(par)
    for sp in stage_params:
        d, de = shard_degree(degrees) if "dp_cp" in degrees else 1, degrees.get("expert_dp", 1)
        upd = -(-sp.dense // d) if dps.shards_optimizer_states else sp.dense
        upd += -(-sp.expert // de) if dps.shards_optimizer_states else sp.expert
        grads = (-(-sp.dense // d) + -(-sp.expert // de)) if dps.shards_gradients else sp.total
        # FP8 under Transformer Engine: the step's weight casts, once (analysis/fp8.py)
        worst = max(worst, (per * upd + 8 * grads + weight_cast_bytes(cfg, sp.fp8, eng)) / (eff.memory * cl.hbm_bw))
    return worst


def estimate(cfg, degrees: Mapping[str, int], groups: Mapping[str, list[list[int]]], sched,
             comm: CommReport, model_flops_per_step: int, compute: ComputeReport | None = None,
             stage_params=None) -> TimeReport:
    """Build the :class:`TimeReport` for ``cfg`` (a SpecConfig). ``sched`` (a
    ScheduleReport) gives the action lists to simulate; None uses the closed form.
    ``compute``: the compute report the chunk times come from (required; the schedule
    pass's when ``sched`` is given)."""
    par, cl = cfg.parallel, cfg.cluster
    m = par.num_microbatches if sched is None else sched.num_microbatches
    if compute is None:
        raise ValueError("estimate needs the ComputeReport")
    eff = efficiency(cl)
    ct = chunk_times(cfg, degrees, groups, compute, comm)
    actions = sched.actions if sched is not None else None
    links = {a: axis_link(cl, groups, a, eff) for a in AXIS_FAMILY}
    step, parts = step_time_parts(cfg, degrees, links, ct, m, comm.collectives, stage_params, actions)
    overlap = tuple(grad_overlap(cfg, degrees, links, ct, sp) for sp in stage_params) \
        if stage_params is not None and cfg.workload == "train" else ()
    tokens = par.global_batch * cfg.model.seq_len
    tflops = model_flops_per_step / (step * par.world_size) / 1e12 if step > 0 else 0.0
    breakdown = {k: v for k, v in parts.items() if k != "bubble_fraction"}
    return TimeReport(
        step_time=step,
        tokens_per_s=tokens / step if step > 0 else 0.0,
        tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / cl.peak_flops,
        breakdown=breakdown,
        assumptions={
            "matmul_efficiency": eff.matmul, "memory_efficiency": eff.memory, "link_efficiency": eff.link,
            "efficiency_source": eff.source,
            "overlap": overlap_words(cfg, degrees, m) + "; dp gradient "
                       + ("reduce-scatters run in every micro-batch's backward bucket by bucket (ZeRO 2/3), "
                          "the last micro-batch's overlapping its backward"
                          if data_parallel_sharding(par).per_microbatch else
                          "reduction overlaps the last micro-batch's backward bucket by bucket")
                       + (f" (buckets of {par.bucket_size:,} bytes)" if par.bucket_size else
                          " (bucket_size = 0: one bucket per chunk, after the backward)"),
            "collectives": "network model: NCCL's algorithm per group (ring, tree, NVLS, NVLSTree, all-to-all, "
                           "p2p) from its ranks per node and nodes, bus bandwidth from nccl-tests (docs/clusters.md)",
            "pipeline": "simulated action lists" if actions is not None else "closed form (p-1)/(v m)",
            "links": {a: ("inter-node" if axis_crosses_nodes(cl, groups, a) else "intra-node")
                      for a in ("tp", "cp", "ep", "dp_cp", "pp", "dp_shard", "dp_replicate") if degrees.get(a, 1) > 1 and a in groups},
            "network": network_assumptions(degrees, links, comm),
            **engine_assumptions(cfg), **offload_assumptions(cfg, degrees, stage_params),
            **({"gemm_rate": gemm_assumptions(cfg)} if compute.chunk_gemm_seconds else {}),
        },
        bubble_fraction=parts["bubble_fraction"],
        grad_reduction=overlap,
    )


def overlap_words(cfg, degrees: Mapping[str, int], m: int) -> str:
    """plan.json ``estimate.assumptions.overlap``'s first part: what of the tp, cp and ep
    collectives and of the pipeline's transfers is on the critical path (:func:`overlaps_tp`,
    :func:`p2p_blocking_share`)."""
    par = cfg.parallel
    tp, p2p = overlaps_tp(cfg, degrees), p2p_blocking_share(cfg, par.pp, par.virtual_stages, m) is not None
    if not tp and not p2p:
        return "tp/cp/ep collectives and pipeline send/recv on the critical path"
    return (("tp collectives overlapped with the GEMMs they feed or drain (tp_comm_overlap), cp/ep collectives on "
             "the critical path" if tp else "tp/cp/ep collectives on the critical path")
            + ("; pipeline send/recv overlapped with compute but in the interleaved warmup and flush "
               "(overlap_p2p_comm)" if p2p else "; pipeline send/recv on the critical path"))


def network_assumptions(degrees: Mapping[str, int], links: Mapping[str, Link], comm: CommReport) -> dict[str, dict]:
    """plan.json ``estimate.assumptions.network``: for each axis with more than one rank whose
    collectives the plan runs, where its groups sit (``ranks_per_node``: the fewest ranks of a
    group on one NVLink domain; ``nodes``: the most domains a group spans) and, per collective
    op, the algorithm :func:`collective_algorithm` picks and its bus bandwidth (bytes/s).
    Sorted by axis and op (deterministic)."""
    ops: dict[str, set[str]] = {}
    for _stage, _chunk, c in comm.raw:
        ops.setdefault(c.axis, set()).add(c.op)
    for e in comm.collectives:
        ops.setdefault(e.axis, set()).add(e.op)
    out: dict[str, dict] = {}
    for axis in sorted(ops):
        n, link = degrees.get(axis, 1), links.get(axis)
        if link is None or (n <= 1 and "send" not in ops[axis]):
            continue
        algos = {}
        for op in sorted(ops[axis] - {"recv"}):
            a = collective_algorithm(op, max(n, 2) if op == "send" else n, link)
            if a is not None:
                algos[op] = {"algorithm": a.name, "bus_bw": a.bus_bw}
        if algos:
            out[axis] = {"ranks_per_node": link.k, "nodes": link.domains, "collectives": algos}
    return out


def engine_assumptions(cfg) -> dict[str, object]:
    """plan.json ``estimate.assumptions``' engine keys for ``cfg`` (a SpecConfig): the engine
    (``cluster.engine``), what it runs, its attention efficiency, elementwise traffic and
    the overlap slowdown of the cluster; ``expert_gemm_streams`` and ``expert_host`` for MoE models."""
    cl = cfg.cluster
    eng = engine(cl)
    out: dict[str, object] = {
        "engine": eng.name, "kernels": eng.description, "attention_efficiency": attention_efficiency(cl),
        "elementwise_traffic": eng.elementwise, "overlap_slowdown": efficiency(cl).overlap,
    }
    if getattr(cl, "figures", None):
        out["cluster_figures"] = cl.figures
    if cfg.model.experts:
        out["expert_gemm_streams"] = eng.expert_gemm_streams
        out["expert_host"] = eng.expert_host
    if fp8_enabled(cfg):
        out["fp8"] = fp8_assumptions(cfg, fp8_efficiency(cfg), efficiency(cl).fp8_source)
    return out


def step_time_parts(cfg, degrees: Mapping[str, int], links: Mapping[str, tuple[float, float]], ct: ChunkTimes,
                    m: int, collectives, stage_params=None, actions=None) -> tuple[float, dict[str, float]]:
    """(step seconds, breakdown) from the chunk times: the pipeline's makespan (simulated
    from ``actions``, else the closed form), the exposed step collectives
    (``collectives``: :class:`~parcompile.analysis.comm.CollectiveEntry` rows, those of
    phase ``step`` are read) and the optimizer step. The breakdown also holds
    ``bubble_fraction`` (idle over busy time of the busiest rank)."""
    span1, parts = pipeline_parts(cfg, ct, m, actions)
    dp_comm = dp_exposed(cfg, degrees, links, collectives, ct, stage_params)
    opt = optimizer_time(cfg, degrees, stage_params)
    parts = dict(parts)
    parts.update({"dp_comm": dp_comm, "optimizer": opt})
    return span1 + dp_comm + opt, parts


def pipeline_parts(cfg, ct: ChunkTimes, m: int, actions=None) -> tuple[float, dict[str, float]]:
    """(makespan with transfers, breakdown of the busiest rank) of one step's pipeline:
    the part of :func:`step_time_parts` that does not depend on ZeRO or the optimizer."""
    par = cfg.parallel
    pp, v = par.pp, par.virtual_stages
    place = par.pipeline_schedule.placement
    span0, busy0 = pipeline_makespan(ct, pp, v, m, actions, with_p2p=False, place=place)
    blocking = p2p_blocking_share(cfg, pp, v, m)
    span1, _ = pipeline_makespan(ct, pp, v, m, actions, with_p2p=True, blocking=blocking, place=place) if pp > 1 \
        else (span0, busy0)
    r = max(range(pp), key=lambda i: (busy0[i], -i))
    mine = par.rank_chunks(r)
    parts = {
        "compute": m * sum(3 * ct.matmul_f[k] - sum(ct.frozen_f[k:k + 1]) for k in mine),   # LoRA: frozen_f
        "memory_bound": m * sum((1 + BACKWARD_TRAFFIC) * ct.memory_f[k] for k in mine),
        "recompute": m * sum(ct.recompute[k] for k in mine),
    }
    if ct.overhead_f:
        parts["op_overhead"] = m * sum(3 * ct.overhead_f[k] for k in mine)
    for fam in ("tp", "cp", "ep"):
        parts[f"{fam}_comm"] = m * sum(ct.comm_f[fam][k] + ct.comm_b[fam][k] for k in mine)
    bubble = span0 - busy0[r]
    parts.update({"bubble": bubble, "pp_comm": span1 - span0,
                  "bubble_fraction": bubble / busy0[r] if busy0[r] > 0 else 0.0})
    return span1, parts
