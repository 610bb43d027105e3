"""Data-parallel gradient reduction in buckets, overlapped with the backward pass.

PyTorch DDP (Li et al. 2020, "PyTorch Distributed", section 3.2.3) and Megatron-LM
(``core/distributed/param_and_grad_buffer.py``, ``distributed_data_parallel.py`` with
``overlap_grad_reduce``) reduce gradients in buckets: a bucket's collective starts as soon
as the backward has produced all of its gradients, so it runs while the backward computes
the gradients of earlier layers. The partition is :func:`parcompile.core.buckets.partition`,
the same function the plan uses, applied to this rank's parameters grouped into units
(a decoder layer, the output layer, the embedding; :func:`param_units`), so the
collectives the program runs match the plan's ``comm.collectives`` byte for byte.

**When is a gradient final?** The pipeline executor
(:func:`parcompile.runtime.train.pipeline.run_schedule`) tells :class:`GradSync` which
backward action is the last of each local chunk (the last micro-batch's). During that
action every gradient a parameter of the chunk receives is its last one of the step
(autograd sums all uses of a parameter within one backward before its accumulate hook
runs), so the parameter is *ready* when :mod:`parcompile.runtime.train.grads` announces it.
Zero-bubble schedules split a backward into B (input gradients) and W (weight
gradients, :mod:`parcompile.runtime.train.wgrad`): a linear weight whose gradient is still
filed for a later W is not ready in B (autograd runs its hook with no gradient); it is
when its last W closure has run. When the chunk's last backward (or W) action ends,
every parameter of the chunk still waiting is ready: one that got no gradient in the
last micro-batch, such as an expert no token was routed to, has its final gradient (or
none, which counts as zeros). Counting accumulations instead would break on exactly
these cases (a weight announced twice per micro-batch under zero-bubble, an expert
announced fewer than m times).

**Launch order.** Buckets are launched strictly in bucket order (bucket k + 1 waits for
k), so every rank of the group issues the same collectives in the same order, whatever
order their gradients became ready in (expert buckets depend on the router). A bucket's
gradients are views of one flat fp32 buffer (:meth:`GradBuckets.allocate`; Megatron-LM's
grad buffer), which is reduced asynchronously in place
(:func:`parcompile.runtime.distributed.comm.all_reduce_async` or ``reduce_scatter_async``, counted
when launched): ``zero = 0`` all-reduces it; ZeRO pads it to a multiple of ``d`` and
reduce-scatters it, so rank i receives slice i (Megatron-LM's distributed optimizer).
:meth:`GradBuckets.finish`, after the backward, launches what is left, waits for all and
scales the sums (1/d, the data-parallel mean; 1/(dp*cp) for expert weights).

``bucket_size = 0``: one bucket per chunk, launched by ``finish`` (no overlap).

**ZeRO 2 and 3: every micro-batch** (``per_microbatch``;
:attr:`parcompile.core.data_parallel.DataParallelSharding.per_microbatch`; DeepSpeed ZeRO-2's
``reduce_independent_p_g_buckets_and_remove_grads``, FSDP2's post-backward
reduce-scatter). Every backward action of a chunk (a whole ``backward``; the zero-bubble
schedule keeps the once-per-step mode) completes that micro-batch's gradients of the
chunk, so :class:`GradSync` arms the chunk during each of them, not only the last. A
bucket's full fp32 buffer is allocated when the micro-batch's first gradient reaches one
of its parameters (``_grad_prepare``, :mod:`parcompile.runtime.train.grads`); before that,
every earlier bucket of the chunk not yet launched in this micro-batch is launched (its
gradients are complete: they arrive in bucket order; a bucket with none, an expert bucket
no token reached, is launched as zeros) and every reduce-scatter but the most recent is
waited for, its output added into the bucket's fp32 shard ``acc`` (``shard`` elements,
kept across the step) and its buffer freed. A bucket is reduce-scattered as soon as its
last gradient arrives (in bucket order within the chunk), its parameters' gradients are
detached from the buffer (the next micro-batch allocates a new one), and the end of the
action launches what is left. Each armed action starts by waiting for all. So the
collectives are ``m`` reduce-scatters per bucket per step, in the same order on every rank
of the group (the action list, then bucket order), at most two full buckets are held at
once (the one being filled and the one before it, reducing), and they are held when the
second is allocated: :attr:`GradBuckets.peak_bytes`, the plan's
``grad_buckets_in_flight`` (:func:`parcompile.core.buckets.buckets_in_flight`). The
last action's last reduce-scatters overlap whatever follows (forwards, sends) until the
next armed action or :meth:`GradBuckets.finish`.

**Reduce dtype** (``parallel.reduce_dtype``; :func:`parcompile.core.buckets.bucket_element_bytes`).
Per micro-batch, a bucket's full buffer is allocated in the reduce dtype: fp32, or the
model's 16-bit dtype (FSDP2's ``MixedPrecisionPolicy(reduce_dtype)``, Megatron-LM's
``--grad-reduce-in-bf16``, DeepSpeed's ``communication_data_type``). The parameters'
16-bit gradients of the micro-batch land in it (each parameter receives one gradient per
micro-batch: autograd sums its uses within one backward), it is reduce-scattered in that
dtype, and the output slice is added into the fp32 shard ``acc``, which the step's
micro-batches accumulate in fp32 and :meth:`GradBuckets.finish` scales by 1/d (DeepSpeed's
post-division). Buffers reduced once per step stay fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from parcompile.core.buckets import GradUnit, partition, unit_order_key
from parcompile.runtime.distributed.comm import all_reduce_async, reduce_scatter_async
from parcompile.runtime.distributed.context import Axis
from parcompile.runtime.machine.dtypes import TORCH_DTYPES
from parcompile.runtime.train.grads import grad_dtype, is_mixed, main_grad, set_main_grad
from parcompile.runtime.train.wgrad import STORE


def unit_of(p: nn.Parameter, chunk_of_layer: dict[int, int], last_chunk: int) -> tuple[int, str]:
    """(local chunk, unit name) of parameter ``p`` (:mod:`parcompile.core.buckets`),
    from its ``global_name`` and tied-embedding marks (``tied``: a tied embedding summed
    over the `embedding` group, ``tied_copy``: its LM-head copy on the last stage)."""
    name = getattr(p, "global_name", "")
    if getattr(p, "tied", False):
        return (last_chunk, "tied_head") if getattr(p, "tied_copy", False) else (0, "tied_embedding")
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return chunk_of_layer.get(layer, 0), f"layers.{layer}"
    if name.startswith(("final_norm", "lm_head")):
        return last_chunk, "output"
    return 0, "embedding"


def param_units(params: list[nn.Parameter], chunks: list[list[int]] | None) -> list[tuple[GradUnit, list]]:
    """This rank's parameters grouped into units, in gradient-ready order: ``(unit,
    params)`` with the unit's element count in ``unit.dense``; ``chunks`` lists the layer
    ids of each local chunk (None: one chunk)."""
    chunks = chunks or [[]]
    chunk_of_layer = {layer: c for c, ids in enumerate(chunks) for layer in ids}
    groups: dict[tuple[int, str], list] = {}
    for p in params:
        groups.setdefault(unit_of(p, chunk_of_layer, len(chunks) - 1), []).append(p)
    keys = sorted(groups, key=lambda k: unit_order_key(k[0], k[1], len(chunks)))
    return [(GradUnit(c, name, sum(p.numel() for p in groups[(c, name)]),
                      alone=name in ("tied_embedding", "tied_head")), groups[(c, name)]) for c, name in keys]


@dataclass
class BucketLayout:
    """One bucket: its parameters in order, their offsets in the flat buffer, its
    ``elements`` and, sharded, ``shard`` = ceil(elements / d) per rank (the buffer is
    padded to ``shard * d``)."""

    index: int
    chunk: int
    units: tuple[str, ...]
    params: list[nn.Parameter]
    offsets: list[int]
    elements: int
    shard: int
    #: per step: gradients not final yet, the flat buffer, the output, the work
    waiting: int = 0
    flat: torch.Tensor | None = None
    out: torch.Tensor | None = None
    work: object = None
    launched: bool = False
    early: bool = False
    #: per micro-batch (ZeRO 2, 3): this rank's slice of the bucket's gradient summed over the step
    acc: torch.Tensor | None = None


def bucket_layouts(params: list[nn.Parameter], chunks: list[list[int]] | None, d: int,
                   bucket_size: int) -> list[BucketLayout]:
    """The buckets of ``params`` (in module order; ``chunks``: layer ids per local chunk, for
    the units), as :func:`parcompile.core.buckets.partition` groups their units at
    ``bucket_size`` fp32 bytes (0: one per chunk), each with ``shard = ceil(elements / d)``
    elements per rank of a group of ``d`` (1: not sharded)."""
    units = param_units(params, chunks)
    by_name = {(u.chunk, u.name): ps for u, ps in units}
    out = []
    for i, b in enumerate(partition([u for u, _ in units], bucket_size, "dense")):
        ps = [p for name in b.units for p in by_name[(b.chunk, name)]]
        offsets, off = [], 0
        for p in ps:
            offsets.append(off)
            off += local_numel(p)
        assert off == b.elements, (off, b)
        out.append(BucketLayout(i, b.chunk, b.units, ps, offsets, off, math.ceil(off / d)))
    return out


def local_numel(p: nn.Parameter) -> int:
    """Elements of ``p``, also while ZeRO-3 has freed its storage."""
    return math.prod(getattr(p, "global_local_shape", tuple(p.shape))) if p.data.numel() == 0 else p.numel()


class GradBuffers:
    """The flat gradient buffers of :class:`GradBuckets` (a part of it): one per bucket, the
    parameters' gradients views of it (:meth:`allocate`, :meth:`attach`), dropped when the
    reduce-scatters are done (:meth:`release`), and the bytes they hold now and at most
    since the step began (``held``, ``peak_bytes``; :meth:`buffer_bytes`). Reads the
    buckets' ``buckets``, ``axis`` and ``sharded``."""

    def allocate(self) -> None:
        """Give every bucket a zeroed fp32 gradient buffer (``shard * d`` elements when
        sharded, so it can be reduce-scattered as it is; ``elements`` otherwise) and make
        each parameter's gradient (``main_grad``) a view of it: autograd and
        :func:`parcompile.runtime.train.grads.accumulate` then add into the buffer in place, and
        the bucket is reduced without a copy (Megatron-LM's ``param_and_grad_buffer``,
        DDP's ``gradient_as_bucket_view``)."""
        for b in self.buckets:
            if b.flat is None:
                self._new_buffer(b, grad_dtype() if any(is_mixed(p) for p in b.params) else torch.float32)
            else:
                b.flat.zero_()
            self.attach(b)

    def _new_buffer(self, b: BucketLayout, dtype: torch.dtype = torch.float32) -> None:
        n = b.shard * self.axis.size if self.sharded else b.elements
        b.flat = torch.zeros(n, dtype=dtype, device=b.params[0].device)
        self.held += n * b.flat.element_size()
        self.peak_bytes = max(self.peak_bytes, self.held)

    def attach(self, b: BucketLayout) -> None:
        """Point the gradients of bucket ``b``'s parameters at its buffer. An fp32
        parameter ZeRO-3 holds no data for (between steps) cannot take a gradient of its
        full shape: it is attached when gathered (:meth:`parcompile.runtime.train.zero_gather.ParamGather._gather_bucket`)."""
        if b.flat is None:
            return
        for p, off in zip(b.params, b.offsets):
            if not is_mixed(p) and p.data.numel() == 0:
                continue
            shape = getattr(p, "global_local_shape", tuple(p.shape))
            set_main_grad(p, b.flat[off:off + local_numel(p)].view(shape))

    def release(self) -> None:
        """Drop the gradient buffers (ZeRO 2 and 3, once the reduce-scatters are done)."""
        for b in self.buckets:
            for p in b.params:
                set_main_grad(p, None)
            if b.flat is not None:
                self.held -= b.flat.numel() * b.flat.element_size()
            b.flat = None

    def buffer_bytes(self) -> int:
        """Bytes of the full gradient buffers held now (reduce-scatters in flight included)."""
        return self.held


class MicrobatchReduction:
    """ZeRO 2 and 3's reduction every micro-batch (a part of :class:`GradBuckets`; module
    docstring, "every micro-batch"): a bucket's buffer in the reduce dtype given when its
    first gradient of the micro-batch arrives, the earlier buckets of the chunk launched
    first (:meth:`prepare`), each bucket reduce-scattered in bucket order
    (:meth:`_launch_round`, :meth:`_launch_chunk_ready`) and the outputs added into the fp32
    shards ``acc`` as they complete (:meth:`drain`). Keeps the reduce-scatters in flight
    (``flight``) and each chunk's next bucket (``pos``); reads the buckets' ``per_microbatch``,
    ``armed`` and ``chunk_buckets`` and launches through :meth:`GradBuckets._launch`."""

    def prepare(self, p: nn.Parameter) -> None:
        """A gradient of ``p`` is about to be added (:mod:`parcompile.runtime.train.grads`): give
        its bucket a buffer if it has none in this micro-batch (module docstring)."""
        if not self.per_microbatch:
            return
        b = self.bucket_of.get(id(p))
        if b is None or b.flat is not None:
            return
        if self.armed.get(b.chunk) is not None:   # the earlier buckets of the chunk are complete
            order = self.chunk_buckets[b.chunk]
            at = order.index(b)
            if self.pos.get(b.chunk, 0) > at:
                raise RuntimeError(f"a gradient of {getattr(p, 'global_name', 'a parameter')} arrived after its "
                                   f"bucket {b.index} was reduce-scattered in this micro-batch (gradients must "
                                   "arrive in bucket order)")
            while self.pos.get(b.chunk, 0) < at:
                self._launch_round(order[self.pos.get(b.chunk, 0)])
        self.drain(keep=1)
        self._new_buffer(b, self.reduce_dtype)
        self.attach(b)

    def drain(self, keep: int = 0) -> None:
        """Wait for the reduce-scatters in flight but the last ``keep``, add each output into
        its bucket's shard ``acc`` and free the buffer."""
        while len(self.flight) > keep:
            b, out, flat, work = self.flight.pop(0)
            if work is not None:
                work.wait()
            b.acc.add_(out)   # into the fp32 shard (from the reduce dtype)
            self.held -= flat.numel() * flat.element_size()

    def _launch_round(self, b: BucketLayout) -> None:
        """Per micro-batch: reduce-scatter bucket ``b`` (the next of its chunk) now; its
        parameters' gradients leave the buffer and wait for a new one."""
        if b.flat is None:   # no gradient reached it in this micro-batch: zeros
            self._new_buffer(b, self.reduce_dtype)
        self._launch(b)
        self.flight.append((b, b.out, b.flat, b.work))
        for p in b.params:
            set_main_grad(p, None)
            self.ready.discard(id(p))
        b.flat = b.out = b.work = None
        b.waiting = len(b.params)
        self.pos[b.chunk] = self.pos.get(b.chunk, 0) + 1

    def _launch_chunk_ready(self, chunk: int) -> None:
        order = self.chunk_buckets[chunk]
        while self.pos.get(chunk, 0) < len(order) and order[self.pos.get(chunk, 0)].waiting == 0:
            self._launch_round(order[self.pos.get(chunk, 0)])


class GradBuckets(GradBuffers, MicrobatchReduction):
    """The gradient buckets of one set of parameters reduced over one axis (module
    docstring): dense parameters over ``dp_cp``, or expert weights over ``expert_dp``.

    Args:
        params: the parameters, in module order.
        chunks: layer ids per local chunk (``Stage.chunks``), for the units.
        axis: the group to reduce over.
        bucket_size: fp32 bytes at which a bucket closes (0: one bucket per chunk, no overlap).
        sharded: ZeRO (reduce-scatter into padded shards) instead of an all-reduce.
        scale: what the sums are multiplied by (``1 / d``: the mean over data-parallel ranks).
        per_microbatch: reduce-scatter every bucket in each micro-batch's backward into the
            fp32 shard ``acc`` (module docstring; sharded only): the plan's
            :attr:`~parcompile.core.data_parallel.DataParallelSharding.per_microbatch`, ZeRO 2
            and 3 but under a zero-bubble schedule, whose action lists :class:`GradSync` then refuses.
        reduce_dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the dtype of the per-micro-batch
            buffers and their reduce-scatters (module docstring, "Reduce dtype").
    """

    def __init__(self, params: list[nn.Parameter], chunks: list[list[int]] | None, axis: Axis,
                 bucket_size: int, sharded: bool, scale: float, per_microbatch: bool = False,
                 reduce_dtype: str = "fp32"):
        self.axis, self.sharded, self.scale = axis, sharded, scale
        self.per_microbatch = per_microbatch and sharded and axis.size > 1
        #: dtype of the buffers reduce-scattered per micro-batch
        self.reduce_dtype = TORCH_DTYPES[reduce_dtype]  # parallel.reduce_dtype
        if self.per_microbatch and self.reduce_dtype != torch.float32 and \
                any(p.dtype != self.reduce_dtype for p in params):
            raise ValueError(f"reduce_dtype {reduce_dtype} needs {reduce_dtype} parameters (their gradients "
                             "fill the buckets); frontend/checks.py refuses other specs")
        #: bytes of full gradient buffers held now, and at most since the step began
        self.held = 0
        self.peak_bytes = 0
        #: per micro-batch: reduce-scatters in flight, (bucket, output, buffer, work) in launch order
        self.flight: list[tuple] = []
        self.final = True   # the armed action is its chunk's last of the step (ZeRO-3 frees at launch)
        self.overlap = bucket_size > 0
        self.buckets: list[BucketLayout] = bucket_layouts(params, chunks, axis.size if sharded else 1, bucket_size)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        #: each parameter's offset in its bucket's flat buffer
        self.offset_of = {id(p): off for b in self.buckets for p, off in zip(b.params, b.offsets)}
        self.chunk_params: dict[int, list[nn.Parameter]] = {}
        self.chunk_buckets: dict[int, list[BucketLayout]] = {}
        for b in self.buckets:
            self.chunk_params.setdefault(b.chunk, []).extend(b.params)
            self.chunk_buckets.setdefault(b.chunk, []).append(b)
        #: per micro-batch: per chunk, the position of its next bucket to launch
        self.pos: dict[int, int] = {}
        self.active = axis.size > 1
        self.sync: GradSync | None = None
        #: called with each bucket as it launches (its gradients are final; ZeRO-3 frees
        #: the bucket's gathered parameters)
        self.on_launch = None
        self.armed: dict[int, str] = {}
        self.ready: set[int] = set()
        self.next = 0
        for p in params:
            p._grad_listener = self.listen
            if self.per_microbatch:
                p._grad_prepare = self.prepare
        self.reset()

    # -- per step -------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a step (called with ``zero_grad``): zeroed gradient buffers, nothing ready."""
        self.armed.clear()
        self.ready.clear()
        self.next = 0
        self.drain()
        self.pos.clear()
        if self.per_microbatch:   # buffers per micro-batch, on demand; the shards accumulate the step
            self.release()
            for b in self.buckets:
                if b.acc is None:
                    b.acc = torch.zeros(b.shard, dtype=grad_dtype(), device=b.params[0].device)
                else:
                    b.acc.zero_()
        else:
            self.allocate()
        self.peak_bytes = self.held
        for b in self.buckets:
            b.waiting = len(b.params)
            b.out = b.work = None
            b.launched = b.early = False

    def begin(self, chunk: int, phase: str, last: bool = True) -> None:
        """A backward action of ``chunk`` that completes gradients starts: the chunk's last
        of the step (``last``), or, per micro-batch, any; ``phase`` is ``full`` (a whole
        backward), ``input`` (zero-bubble B) or ``weight`` (zero-bubble W)."""
        if self.per_microbatch:
            self.drain()
            self.final = last
        self.armed[chunk] = phase

    def end(self, chunk: int, phase: str, last: bool = True) -> None:
        """That action ended: the chunk's parameters are ready (in B, those with no weight
        gradient still filed); per micro-batch, every bucket of the chunk not launched in
        this micro-batch is launched (in order), and the next micro-batch starts afresh."""
        self.armed.pop(chunk, None)
        if self.per_microbatch:
            order = self.chunk_buckets.get(chunk, [])
            while self.pos.get(chunk, 0) < len(order):
                self._launch_round(order[self.pos.get(chunk, 0)])
            self.pos[chunk] = 0
            return
        for p in self.chunk_params.get(chunk, []):
            if phase != "input" or not STORE.has_pending(p):
                self._mark(p)

    def listen(self, p: nn.Parameter) -> None:
        """A gradient reached ``p`` (:mod:`parcompile.runtime.train.grads`)."""
        b = self.bucket_of.get(id(p))
        if b is None:
            return
        phase = self.armed.get(b.chunk)
        if phase is None:
            return
        if phase == "input" and STORE.has_pending(p):
            return   # its weight gradient comes in a later W
        self._mark(p)

    def _mark(self, p: nn.Parameter) -> None:
        if id(p) in self.ready:
            return
        self.ready.add(id(p))
        b = self.bucket_of[id(p)]
        b.waiting -= 1
        if b.waiting == 0 and self.overlap:
            if self.per_microbatch:
                self._launch_chunk_ready(b.chunk)
            else:
                self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next < len(self.buckets) and self.buckets[self.next].waiting == 0:
            self._launch(self.buckets[self.next])
            self.next += 1

    def _launch(self, b: BucketLayout) -> None:
        b.launched = True
        b.early = self.sync is not None and self.sync.in_backward()
        if self.on_launch is not None and (not self.per_microbatch or self.final):
            self.on_launch(b)
        if not self.active:
            return
        flat = b.flat   # the parameters' gradients are views of it (allocate)
        if self.sharded:
            b.out = torch.empty(b.shard, dtype=flat.dtype, device=flat.device)
            b.work = reduce_scatter_async(b.out, flat, self.axis)
        else:
            b.out = flat
            b.work = all_reduce_async(flat, self.axis)

    def finish(self) -> list[torch.Tensor | None]:
        """After the backward: launch every bucket not launched yet (in order), wait for
        all, scale the sums. ``zero = 0``: each parameter's gradient becomes the reduced
        one in place (zeros for a parameter that got none). Sharded: returns each bucket's
        owned slice of the reduced gradient (``shard`` elements); the full gradients are
        left as they are. Per micro-batch: waits for the reduce-scatters in flight and
        returns the scaled shards ``acc``."""
        if self.per_microbatch:
            for b in self.buckets:   # without a GradSync: reduce what is held, once
                if b.flat is not None:
                    self._launch_round(b)
            self.drain()
            for b in self.buckets:
                if self.scale != 1.0:
                    b.acc.mul_(self.scale)
                b.launched = True
            return [b.acc for b in self.buckets]
        for b in self.buckets:
            for p in b.params:
                self.ready.add(id(p))
            b.waiting = 0
        while self.next < len(self.buckets):
            self._launch(self.buckets[self.next])
            self.next += 1
        shards: list[torch.Tensor | None] = []
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            if not self.active:   # nothing to reduce over: scale in place (expert weights: 1 / (dp * cp))
                if self.scale != 1.0:
                    for p in b.params:
                        if main_grad(p) is not None:
                            main_grad(p).mul_(self.scale)
                shards.append(None)
                continue
            out = b.out
            if self.scale != 1.0:
                out.mul_(self.scale)   # unsharded: the buffer itself, so the gradients
            shards.append(out if self.sharded else None)
            b.work = None
            b.out = out if self.sharded else None
        return shards

    def report(self) -> list[dict]:
        """Per bucket of the last step: its axis, elements, and whether it was launched
        before the last backward action of the step ended (``early``: overlapped)."""
        return [{"axis": self.axis.name, "chunk": b.chunk, "elements": b.elements, "early": b.early}
                for b in self.buckets]


class GradSync:
    """What the pipeline executor tells the gradient buckets of an optimizer: which
    backward action of a chunk is its last (module docstring). ``start(actions)`` at the
    beginning of a step; ``begin(i)`` / ``end(i)`` around each gradient action ``i``."""

    OPS = {"backward": "full", "backward_input": "input", "backward_weight": "weight"}

    def __init__(self, parts: list[GradBuckets]):
        self.parts = [p for p in parts if p.buckets]
        for p in self.parts:
            p.sync = self
        self.final: dict[int, tuple[int, str]] = {}
        self.every: dict[int, tuple[int, str]] = {}
        self.left = 0
        self.running = False

    def start(self, actions: list[dict]) -> None:
        """Find the last backward (and W) action of each local chunk in this rank's list,
        and, for the parts that reduce per micro-batch, every whole backward action."""
        if any(p.per_microbatch for p in self.parts) and any(a["op"] == "backward_input" for a in actions):
            raise RuntimeError("the data-parallel sharding reduces gradients in every micro-batch, which an "
                               "action list with a split backward (zero-bubble) cannot: the plan's "
                               "DataParallelSharding has per_microbatch=False for such a schedule")
        last: dict[tuple[int, str], int] = {}
        for i, a in enumerate(actions):
            phase = self.OPS.get(a["op"])
            if phase is not None:
                last[(a["chunk"], "weight" if phase == "weight" else "grad")] = i
        self.final = {i: (chunk, self.OPS[actions[i]["op"]]) for (chunk, _), i in last.items()}
        self.every = {i: (a["chunk"], "full") for i, a in enumerate(actions) if a["op"] == "backward"}
        self.left = sum(1 for a in actions if a["op"] in self.OPS)
        self.running = False

    def in_backward(self) -> bool:
        """True while a backward action runs or one is still to come."""
        return self.running or self.left > 0

    def _tell(self, i: int, what: str) -> None:
        for p in self.parts:
            f = (self.every if p.per_microbatch else self.final).get(i)
            if f is not None:
                getattr(p, what)(*f, last=i in self.final)

    def begin(self, i: int) -> None:
        self.running = True
        self._tell(i, "begin")

    def end(self, i: int) -> None:
        self.running = False
        self.left -= 1
        self._tell(i, "end")


class BucketedReduction:
    """What every optimizer that reduces its gradients through ``self.buckets`` (a
    :class:`GradBuckets`) offers the program: ``grad_sync`` for the pipeline executor and
    ``bucket_report`` for the metrics."""

    buckets: GradBuckets

    @property
    def grad_sync(self) -> GradSync:
        """What the pipeline executor tells when a chunk's last backward runs."""
        return GradSync([self.buckets])

    def bucket_report(self) -> list[dict]:
        """Per gradient bucket of the last step: axis, elements, launched early."""
        return self.buckets.report()

    @property
    def zero3_gathered_peak(self) -> int:
        """Most bytes of ZeRO-3 gathered parameters held at once this step (0: not ZeRO-3)."""
        return 0

    #: ZeRO 2, 3: the most bytes of full gradient buffers held at once during the step (the
    #: plan's ``grad_buckets_in_flight``, or ``full_grads`` when reduced once per step)
    full_grad_bytes = 0


__all__ = ["GradBuckets", "GradSync", "BucketLayout", "BucketedReduction", "bucket_layouts", "param_units", "unit_of", "local_numel"]
