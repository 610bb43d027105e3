"""Gradient buckets: how a rank's gradients are grouped for the data-parallel reduction
(``parallel.bucket_size``), one rule shared by the plan (:mod:`parcompile.analysis`,
:mod:`parcompile.passes`, :mod:`parcompile.layout_search`) and the generated program
(:mod:`parcompile.runtime.train.buckets`, :mod:`parcompile.runtime.train.zero`). Standard library only
(the ground floor, :mod:`parcompile.core`).

Data-parallel ranks reduce their fp32 gradients in *buckets* launched as soon as the
backward has produced all of a bucket's gradients, so the reduction of the first buckets
runs while the backward computes the next ones: PyTorch DDP's bucketing (Li et al. 2020,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training", section 3.2.3)
and Megatron-LM's ``--overlap-grad-reduce`` (``core/distributed/param_and_grad_buffer.py``
and ``distributed_data_parallel.py``). The rule, per pipeline rank:

1. **Units** (:class:`GradUnit`), per local model chunk, in gradient-ready order, the
   reverse of the forward: the output layer (final norm + LM head) when the chunk is the
   model's last, then the decoder layers from last to first, then the embedding (with
   learned positions) when the chunk is the model's first. A unit is all of one layer's
   parameters on the rank: a layer is never split over two buckets.
2. **Chunks** are taken from the rank's last local chunk to its first: in every schedule
   the last micro-batch's backward visits them in that order.
3. **Buckets**: units are appended to the open bucket, which closes as soon as its fp32
   bytes (4 per element) reach ``bucket_size``, and at the end of each chunk. ``bucket_size
   = 0`` makes one bucket per chunk, reduced after the backward (no overlap).
4. **A tied embedding** (and its LM-head copy on the last stage, pp > 1) is a bucket of its
   own, as Megatron-LM's buffer gives the shared embedding one: with ZeRO both copies are
   then sharded alike, so the sum over the `embedding` group can run on the shards.
5. **Expert weights** (MoE) are reduced over ``expert_dp``, not ``dp_cp``: they form their
   own buckets by the same rule, from the expert part of each unit.

Model-parallel sums of gradients (the sequence-parallel all-reduce over tp of parameters
replicated over tp, the tied embedding's all-reduce over `embedding`) run after the
data-parallel reduction, on reduced gradients (Megatron-LM's ``finalize_model_grads``
order): summing over tp or `embedding` and averaging over dp are linear and commute, so
those parameters stay in their layer's bucket and overlap like the others. With ZeRO the
sums run on the owned shards, whose offsets agree on every rank of the group (identical
bucket layouts over tp; the tied embedding alone in its bucket on both stages).

ZeRO >= 1 shards each bucket on its own (Megatron-LM's distributed optimizer): a bucket of
n elements is padded to ``ceil(n / d) * d`` and rank i owns slice i, so a rank holds
``sum over buckets of ceil(n_b / d)`` elements of sharded state (:func:`shard_elements`).

ZeRO-3 also gathers the parameters bucket by bucket, into one padded buffer per bucket
(``ceil(n / d) * d`` elements; :func:`zero3_gathered`). Units run in a chunk's forward in
the order of :func:`unit_position`: the embedding, the decoder layers by id, the output
layer. Which buckets are gathered when follows torchtitan's FSDP2 policy
(``reshard_after_forward``; :func:`reshard_after_forward`, :func:`zero3_just_in_time`):

- ``pp = 1``: every bucket is gathered just in time, before the forward of its first unit,
  with the next unit's buckets prefetched while a unit runs (FSDP's forward and backward
  prefetch), and freed after the forward of its last unit: the embedding (torchtitan's
  ``tok_embeddings``, resharded after forward), each layer bucket, and the output layer's
  bucket, which is the exception: it holds the forward's last module, whose backward
  follows at once, so it is kept from its forward through its backward (torchtitan's
  ``fully_shard([norm, output], reshard_after_forward=False)`` under the default policy)
  and freed after it. A bucket is gathered again for the backward when a unit of it other
  than the embedding is in it (:func:`needed_in_backward`: the embedding's backward reads
  the token ids only, never the table), before the backward of its last such unit, and
  freed once the gradient of its first such unit's input is complete. So a layer bucket
  is all-gathered ``2 m`` times per step, the output layer's and an embedding-only bucket
  ``m`` times (:func:`zero3_gather_counts`), and a rank holds, at most, the buckets of two
  units adjacent in forward order (one runs while the next is prefetched; the output
  layer's backward runs while the last layer is prefetched): over ``[embedding, layer 0,
  ..., layer N-1, output]``, the largest union of two neighbours' buckets. The one
  bucket kept for the step is a tied embedding's with ``pp = 1`` (the LM head reads the
  embedding table: used at both ends of the forward);
- ``pp > 1``: a bucket of decoder layers only (:func:`is_layer_bucket`) is gathered
  before the forward of its first layer, the others (embedding, output layer, tied
  copies) at the step's start; all are kept across the micro-batches of the step (SPEC:
  as torchtitan's FSDP + PP, which sets ``reshard_after_forward = False`` there) and freed
  when the bucket's gradients are final (when its last reduce-scatter starts): one
  all-gather per step, every bucket held at once before the first backward.

**When gradients are reduced** (:attr:`parcompile.core.data_parallel.DataParallelSharding.per_microbatch`). ``zero = 0`` and ``1``
reduce every bucket once per step, after the last micro-batch has produced its gradients
(Megatron-LM: the full fp32 buffers are kept between steps anyway). ``zero = 2`` and
``3`` reduce-scatter each bucket during *every* micro-batch's backward, as soon as that
micro-batch's gradients of the bucket are complete, add the result into the rank's fp32
gradient shard (kept across the step) and free the full bucket buffer (DeepSpeed ZeRO-2's
``reduce_bucket``, FSDP2's per-backward reduce-scatter): ``m`` reduce-scatters per bucket
per step, and only the buckets in flight exist in full (:func:`buckets_in_flight`). The
zero-bubble schedule keeps the once-per-step reduction: its B actions write the norms'
gradients of every layer of a chunk before the W actions complete them, so streaming
would hold every bucket anyway.

**Reduce dtype** (``parallel.reduce_dtype``; :func:`bucket_element_bytes`). Buckets
reduce-scattered per micro-batch are held, and reduced, in the reduce dtype: fp32 by
default (Megatron-LM's and torchtitan's default, ``mixed_precision_reduce = "float32"``),
or the model's 16-bit dtype (FSDP2's ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``,
Megatron-LM's ``--grad-reduce-in-bf16``, DeepSpeed's ``communication_data_type``): a
micro-batch's 16-bit gradients go into a 16-bit bucket, which is reduce-scattered in 16
bits and added into the rank's fp32 shard, so the gradient state stays ``4/d`` bytes per
element and only the buckets in flight and the reduce-scatter traffic halve. Buckets
reduced once per step (zero 0 and 1, zero-bubble) accumulate the micro-batches in their
fp32 buffers and are reduced in fp32 in the generated program (frontend/checks.py warns
that a 16-bit reduce dtype has no effect there). Megatron-Core instead keeps its whole
gradient buffer in the reduce dtype at every ZeRO level: ``grad_dtype = torch.float if
grad_reduce_in_fp32 else param.dtype`` (``group_params_for_buffers``,
``megatron/core/distributed/param_and_grad_buffer.py`` at NVIDIA/Megatron-LM d98e8a6;
``--grad-reduce-in-bf16`` sets ``accumulate_allreduce_grads_in_fp32 = False``,
``megatron/training/arguments.py``), so the step's micro-batches accumulate in bf16 and
the buffer is all-reduced or reduce-scattered in bf16: ``step_buffers`` (a plan for
``engine = megatron`` on a GPU preset, :func:`parcompile.analysis.estimate.grad_element_bytes`).

**Buckets in flight** (the program's rule, :class:`parcompile.runtime.train.buckets.GradBuckets`):
a bucket's full buffer is allocated when the first gradient of the micro-batch reaches
it; before that, every earlier bucket of the chunk is launched (its gradients of the
micro-batch are complete: gradients arrive in bucket order) and every reduce-scatter but
the most recent one is waited for and its buffer freed; each backward action starts by
waiting for all. So a rank holds at most two full buckets at once, the one being filled
and the one before it whose reduce-scatter may still run, and it does hold them when the
second is allocated: the peak is, over the chunks, the largest sum of two adjacent
buckets of a chunk (one bucket alone if the chunk has one), each padded to
``ceil(n / d) * d`` elements of the reduce dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from parcompile.core.data_parallel import DataParallelSharding
from parcompile.core.dtypes import DTYPE_BYTES, GRAD_BYTES


@dataclass(frozen=True)
class GradUnit:
    """One unit of the bucket rule: the parameters of one layer (or the output layer, or
    the embedding) on one rank, as element counts.

    ``chunk`` is the local chunk (virtual stage) index on the pipeline rank; ``name`` is
    ``"output"``, ``"layers.N"``, ``"embedding"`` or ``"tied_embedding"``; ``dense``
    elements are reduced over dp_cp, ``expert`` elements over expert_dp; ``alone`` units
    (the tied embedding or its head copy) form a bucket of their own; ``fp8``: the dense
    elements that are weights of FP8 GEMMs (``train.precision = fp8``; gathered as E4M3
    bytes with FP8 all-gather, :func:`fp8_gather_elements`).
    """

    chunk: int
    name: str
    dense: int
    expert: int = 0
    alone: bool = False
    fp8: int = 0

    def size(self, kind: str) -> int:
        """Elements of ``kind`` (``"dense"`` or ``"expert"``)."""
        return self.dense if kind == "dense" else self.expert


@dataclass(frozen=True)
class Bucket:
    """One gradient bucket: its local chunk, its units in ready order, its elements."""

    chunk: int
    units: tuple[str, ...]
    elements: int
    #: of ``elements``, the FP8 GEMM weights' (dense buckets; :attr:`GradUnit.fp8`)
    fp8: int = 0

    @property
    def bytes(self) -> int:
        """fp32 gradient bytes."""
        return GRAD_BYTES * self.elements


def unit_order_key(chunk: int, name: str, num_chunks: int) -> tuple:
    """Sort key putting units in gradient-ready order (module docstring, rules 1-2): chunks
    from the last to the first; in a chunk the LM-head copy, the output layer, the layers
    from last to first, the embedding, the tied embedding."""
    if name.startswith("layers."):
        rank, sub = 2, -int(name.split(".")[1])
    else:
        rank, sub = {"tied_head": 0, "output": 1, "embedding": 3, "tied_embedding": 4}[name], 0
    return (num_chunks - 1 - chunk, rank, sub)


def partition(units: Sequence[GradUnit], bucket_size: int, kind: str = "dense") -> list[Bucket]:
    """The buckets of one rank: ``units`` in ready order (chunk by chunk), closed by the
    rule of the module docstring. Units with no element of ``kind`` are skipped.

    Args:
        units: the rank's units in gradient-ready order.
        bucket_size: fp32 bytes at which a bucket closes; 0: one bucket per chunk.
        kind: ``"dense"`` (reduced over dp_cp) or ``"expert"`` (over expert_dp).

    Returns:
        The buckets in launch order; their elements sum to the units' elements of ``kind``.
    """
    out: list[Bucket] = []
    names: list[str] = []
    n = f = 0
    chunk: int | None = None

    def close() -> None:
        nonlocal names, n, f
        if names:
            out.append(Bucket(chunk, tuple(names), n, f))
        names, n, f = [], 0, 0

    for u in units:
        size = u.size(kind)
        if size <= 0:
            continue
        if u.chunk != chunk:
            close()
            chunk = u.chunk
        if u.alone:
            close()
            out.append(Bucket(u.chunk, (u.name,), size, u.fp8 if kind == "dense" else 0))
            continue
        names.append(u.name)
        n += size
        f += u.fp8 if kind == "dense" else 0
        if bucket_size > 0 and GRAD_BYTES * n >= bucket_size:
            close()
    close()
    return out


#: :func:`stage_buckets`' partitions by the identity of the units tuple they were cut from
#: (kept alive beside them, so an id is not reused while its entry stands): a stage's state,
#: ZeRO-3 gathers, gradient buffers and step collectives each read its buckets, and the
#: layout search composes a stage's units once for many layouts. Cleared when full.
_PARTITIONS: dict[tuple[int, int], tuple] = {}
_PARTITIONS_MAX = 4096


def stage_buckets(sp, bucket_size: int) -> tuple[list[Bucket], list[Bucket]]:
    """(dense buckets, expert buckets) of one rank of a stage, from its
    :class:`~parcompile.analysis.params.StageParams` (``units`` in ready order; a
    StageParams without units counts as one unit per kind). The lists are shared between
    calls with the same units (:data:`_PARTITIONS`): read them, do not change them."""
    units = getattr(sp, "units", ())
    if not units:
        units = (GradUnit(0, "stage", sp.dense, sp.expert),)
        return partition(units, bucket_size, "dense"), partition(units, bucket_size, "expert")
    key = (id(units), bucket_size)
    got = _PARTITIONS.get(key)
    if got is not None and got[0] is units:
        return got[1], got[2]
    dense, expert = partition(units, bucket_size, "dense"), partition(units, bucket_size, "expert")
    if len(_PARTITIONS) >= _PARTITIONS_MAX:
        _PARTITIONS.clear()
    _PARTITIONS[key] = (units, dense, expert)
    return dense, expert


def fp8_gather_elements(elements: int, fp8: int, d: int) -> tuple[int, int]:
    """ZeRO-3 with FP8 all-gather (``train.fp8_all_gather``): the elements each of the ``d``
    ranks sends in a bucket's two all-gathers, ``(E4M3, 16-bit)``. A bucket of ``elements``
    (``fp8`` of them FP8 GEMM weights) is sharded as without FP8, ``shard = ceil(elements /
    d)`` per rank, and a shard's boundaries cut across FP8 and 16-bit parameters, so a rank
    holds between ``max(0, fp8 - (d - 1) shard)`` and ``min(shard, fp8)`` FP8 elements. The
    all-gathers need one size on every rank: each rank packs its FP8 elements (cast with
    their weight's tensorwise scale, known to every rank from the step's amax all-reduce,
    so no scale is gathered) into ``min(shard, fp8)`` bytes and the rest (its padding
    included) into ``min(shard, shard d - fp8)`` elements of the model dtype, zero-padded.
    Either is 0 when the bucket has none (then that all-gather does not run). The plan's
    step collectives (passes/insert_collectives.py) and the program
    (runtime/train/zero_gather.py ``ParamGather``) both size them here."""
    shard = -(-elements // d) if d > 0 else elements
    return min(shard, fp8), min(shard, shard * d - fp8)


def shard_elements(buckets: Iterable[Bucket], d: int) -> int:
    """Elements of the sharded state one rank holds under ZeRO: ``sum ceil(n_b / d)``
    (each bucket padded to a multiple of ``d``); all of them when ``d == 1``."""
    return sum(math.ceil(b.elements / d) if d > 1 else b.elements for b in buckets)


def is_layer_bucket(b) -> bool:
    """True for a bucket (a :class:`Bucket`, or anything with ``units``) of decoder layers
    only, which ZeRO-3 gathers before its first layer with ``pp > 1``."""
    return all(u.startswith("layers.") for u in b.units)


def bucket_layers(b: Bucket) -> tuple[int, ...]:
    """The decoder layer ids of a bucket's units, ascending (forward order)."""
    return tuple(sorted(int(u.split(".")[1]) for u in b.units if u.startswith("layers.")))


#: unit names of the embedding side and the output side of a chunk
EMBEDDING_UNITS = ("embedding", "tied_embedding")
OUTPUT_UNITS = ("output", "tied_head")


def unit_position(name: str) -> tuple[int, int]:
    """Where unit ``name`` runs in its chunk's forward, as a sort key: the embedding (or a
    tied embedding) first, the decoder layers by id, the output layer (or a tied LM-head
    copy) last."""
    if name.startswith("layers."):
        return (1, int(name.split(".")[1]))
    return (0, 0) if name in EMBEDDING_UNITS else (2, 0)


def bucket_positions(b) -> tuple[tuple[int, int], ...]:
    """The forward positions (:func:`unit_position`) of a bucket's units, ascending."""
    return tuple(sorted({unit_position(u) for u in b.units}))


def reshard_after_forward(pp: int) -> bool:
    """ZeRO-3's policy (module docstring): buckets freed after each micro-batch's forward
    and backward when ``pp == 1``; kept across the step's micro-batches with pipeline
    parallelism (torchtitan's ``apply_fsdp``, ``reshard_after_forward_policy =
    "default"``: True without PP, False with PP "to avoid per-microbatch all-gathers")."""
    return pp == 1


def zero3_just_in_time(b, per_microbatch: bool, head_reads_embedding: bool = False) -> bool:
    """True when ZeRO-3 gathers bucket ``b`` where the forward first needs it rather than
    at the step's start (module docstring). ``per_microbatch``
    (:func:`reshard_after_forward`, ``pp = 1``): every bucket, except one holding the
    embedding when the LM head reads the embedding table too (``head_reads_embedding``:
    tied embeddings with ``pp = 1``); otherwise the buckets of decoder layers only."""
    if not per_microbatch:
        return is_layer_bucket(b)
    return not (head_reads_embedding and any(u in EMBEDDING_UNITS for u in b.units))


def needed_in_backward(b) -> bool:
    """True when the backward reads the parameters of bucket ``b``: it holds a unit other
    than the embedding (whose backward reads the token ids only)."""
    return any(u not in EMBEDDING_UNITS for u in b.units)


def holds_output(b) -> bool:
    """True when bucket ``b`` holds the output layer, the forward's last module, whose
    backward follows at once: with ``pp = 1`` it is kept from its forward through its
    backward instead of being freed and gathered again (module docstring)."""
    return any(u in OUTPUT_UNITS for u in b.units)


def zero3_gathered(kinds: Sequence[tuple[Sequence[Bucket], int]], per_microbatch: bool,
                   head_reads_embedding: bool = False, size=None) -> tuple[int, int]:
    """Elements of gathered ZeRO-3 parameters one rank holds during a step, as
    ``(step_long, just_in_time)``: the buckets kept for the whole step, and the most the
    buckets gathered and freed per micro-batch hold at once. The peak is their sum.

    Args:
        kinds: ``(buckets, d)`` per parameter kind (dense over dp_cp, experts over
            expert_dp); a kind with ``d == 1`` is not sharded and gathers nothing.
        per_microbatch: :func:`reshard_after_forward` (``pp = 1``): while a unit runs
            (forward or backward) the rank holds the buckets that contain it and
            prefetches those of the unit that runs next (the next one in forward order
            going forward, the one before going backward; the output layer, kept from its
            forward through its backward, with the last layer prefetched for the
            backward), so the most held at once is, over units adjacent in forward order
            (:func:`unit_position`) within a chunk, their buckets' union; otherwise
            (``pp > 1``) every bucket is gathered before the first backward, all at once.
        head_reads_embedding: tied embeddings with ``pp = 1`` (:func:`zero3_just_in_time`):
            the embedding's bucket is kept for the step.

    Each gathered bucket is a padded buffer of ``ceil(n / d) * d`` elements, or what
    ``size(bucket, d)`` says it holds (bytes, say: ZeRO-3's FP8 all-gather).
    """
    step_long = 0
    held: dict[tuple, dict[tuple[int, int], int]] = {}   # (chunk, position) -> {(kind, bucket): elements}
    chunk_positions: dict[int, set[tuple[int, int]]] = {}
    for k, (buckets, d) in enumerate(kinds):
        for i, b in enumerate(buckets):
            pos = bucket_positions(b)
            chunk_positions.setdefault(b.chunk, set()).update(pos)
            if d <= 1:
                continue
            full = size(b, d) if size is not None else math.ceil(b.elements / d) * d
            if per_microbatch and zero3_just_in_time(b, True, head_reads_embedding):
                for at in pos:
                    held.setdefault((b.chunk, at), {})[(k, i)] = full
            else:
                step_long += full
    jit = 0
    for chunk, positions in chunk_positions.items():
        ids = sorted(positions)
        for a, b in zip(ids, ids[1:] or ids):
            jit = max(jit, sum({**held.get((chunk, a), {}), **held.get((chunk, b), {})}.values()))
    return step_long, jit


def reduce_counts(buckets: Sequence[Bucket], microbatches: int, per_microbatch: bool) -> list[int]:
    """Reductions per step of each bucket: ``m`` when ``per_microbatch``
    (:attr:`parcompile.core.data_parallel.DataParallelSharding.per_microbatch`), else 1."""
    return [microbatches if per_microbatch else 1 for _ in buckets]


def buckets_in_flight(buckets: Sequence[Bucket], d: int) -> int:
    """Elements of full (padded) gradient buckets a rank holds at most at once when it
    reduce-scatters per micro-batch (module docstring, "Buckets in flight"): over the
    chunks, the largest sum of two adjacent buckets of a chunk (one bucket alone when the
    chunk has one), each padded to ``ceil(n / d) * d``. 0 when ``d == 1`` (nothing is
    sharded: the gradients are state)."""
    if d <= 1:
        return 0
    per_chunk: dict[int, list[int]] = {}
    for b in buckets:
        per_chunk.setdefault(b.chunk, []).append(math.ceil(b.elements / d) * d)
    best = 0
    for sizes in per_chunk.values():
        best = max(best, max(x + y for x, y in zip(sizes, sizes[1:])) if len(sizes) > 1 else sizes[0])
    return best


def zero3_gather_counts(buckets: Sequence[Bucket], microbatches: int, per_microbatch: bool,
                        head_reads_embedding: bool = False) -> list[int]:
    """All-gathers per step of each bucket's parameters under ZeRO-3 (module docstring):
    with ``per_microbatch`` (``pp = 1``) a bucket gathered just in time is gathered in
    every micro-batch's forward and, when the backward reads it and it was freed after
    the forward (not the output layer's), again for the backward: ``2 m`` for a layer
    bucket, ``m`` for the output layer's and an embedding-only bucket; 1 for a bucket kept
    for the step (every bucket with ``pp > 1``, a tied embedding's with ``pp = 1``)."""
    out = []
    for b in buckets:
        if not (per_microbatch and zero3_just_in_time(b, True, head_reads_embedding)):
            out.append(1)
        else:
            out.append(microbatches * (2 if needed_in_backward(b) and not holds_output(b) else 1))
    return out


def bucket_element_bytes(sharding: DataParallelSharding, reduce_dtype: str = "fp32",
                         step_buffers: bool = False, grad_dtype: str = "fp32") -> int:
    """Bytes per element of a full gradient bucket and of its reduction (module docstring,
    "Reduce dtype"): the reduce dtype's when buckets are reduce-scattered per micro-batch
    (``sharding.per_microbatch``) or when ``step_buffers`` (Megatron-Core: the buffers
    that accumulate the step are held in the reduce dtype too), else 4 (fp32: the program's
    buffers accumulate the step in fp32). ``grad_dtype`` (``parallel.grad_dtype``) bf16: every
    gradient buffer is bf16 and reduced as it is, the program's too (Megatron-Core's
    ``--grad-reduce-in-bf16``: NVIDIA/Megatron-LM d98e8a6 ``param_and_grad_buffer.py``, ``grad_dtype =
    param.dtype`` unless ``grad_reduce_in_fp32``)."""
    if grad_dtype != "fp32":
        return DTYPE_BYTES[grad_dtype]
    return DTYPE_BYTES[reduce_dtype] if step_buffers or sharding.per_microbatch else GRAD_BYTES


def head_reads_embedding(cfg) -> bool:
    """Tied embeddings on one pipeline rank: the LM head reads the embedding table
    (:func:`zero3_just_in_time`)."""
    return bool(cfg.model.tie_embeddings) and cfg.parallel.pp == 1


__all__ = ["GRAD_BYTES", "GradUnit", "Bucket", "partition", "stage_buckets", "shard_elements", "fp8_gather_elements",
           "unit_order_key", "is_layer_bucket", "bucket_layers",
           "reshard_after_forward", "zero3_gathered", "zero3_gather_counts",
           "reduce_counts", "buckets_in_flight", "bucket_element_bytes", "unit_position",
           "bucket_positions", "zero3_just_in_time", "needed_in_backward", "holds_output", "head_reads_embedding",
           "EMBEDDING_UNITS", "OUTPUT_UNITS"]
