"""FLOPs from the graph (matmuls only; see :mod:`parcompile.ir.ops`).

* ``model_flops_per_step``: forward + backward (3x forward) of every matmul of the model
  for the whole global batch, unpadded vocabulary, attention without causal halving and
  without recomputation. For a GPT layer (MHA, ffn = 4h) this is Korthikanti et al.
  (2022), eq. in section 6: ``72 B s L h^2 (1 + s/(6h) + V/(12hL))``; computed from the
  graph, it generalises to GQA, SwiGLU and sliding windows.
* ``hardware_flops_per_step``: the same with the padded vocabulary, plus the forward
  FLOPs recomputed in backward (``recompute = full``: every layer op; ``selective``: the
  attention core).
* per model chunk: the forward FLOPs of one micro-batch on one rank, and the bytes its
  non-matmul kernels move (``OpSpec.traffic``; the cost model's inputs), with the part of
  each that recomputation runs again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from parcompile.ir.graph import Graph, Node
from parcompile.ir.ops import spec

BACKWARD_FACTOR = 2  # backward FLOPs = 2 x forward


def op_fwd_flops(graph: Graph, nd: Node, degrees: Mapping[str, int] | None = None) -> int:
    """Forward matmul FLOPs of one op for one micro-batch: global when ``degrees`` is None,
    else on one rank (local types)."""
    s = spec(nd.kind)
    ins = graph.input_types(nd.name)
    if degrees is None:
        return s.fwd_flops(nd.op.attr_map, ins, nd.type)
    local_in = [r.local_type(t, degrees) for r, t in zip(nd.requires, ins)]
    return s.fwd_flops(nd.op.attr_map, local_in, nd.sharding.local_type(nd.type, degrees))


def op_fwd_traffic(graph: Graph, nd: Node, degrees: Mapping[str, int]) -> int:
    """Bytes the op's non-matmul kernels move in the forward of one micro-batch on one rank."""
    s = spec(nd.kind)
    local_in = [r.local_type(t, degrees) for r, t in zip(nd.requires, graph.input_types(nd.name))]
    return s.traffic(nd.op.attr_map, local_in, nd.sharding.local_type(nd.type, degrees))


def recomputed(nd: Node, recompute: str) -> bool:
    """Whether ``recompute`` re-runs this op's forward during backward."""
    if recompute == "full":
        return nd.op.layer is not None and nd.kind not in ("send_recv", "step_collective")
    if recompute == "selective":
        return spec(nd.kind).selective_recompute
    return False


@dataclass(frozen=True)
class ComputeReport:
    """FLOPs per step (whole cluster) and per model chunk (one rank, one micro-batch)."""

    model_flops_per_step: int
    hardware_flops_per_step: int
    #: per model chunk: forward FLOPs, and recomputed forward FLOPs, one rank, one micro-batch
    chunk_fwd_flops: tuple[int, ...]
    chunk_recompute_flops: tuple[int, ...]
    #: per model chunk: forward bytes moved by non-matmul kernels, and the recomputed part
    chunk_fwd_traffic: tuple[int, ...] = ()
    chunk_recompute_traffic: tuple[int, ...] = ()


def compute_report(graph: Graph, degrees: Mapping[str, int], num_chunks: int, vocab: int, padded_vocab: int,
                   num_microbatches: int, recompute: str) -> ComputeReport:
    """Build the :class:`ComputeReport`. The graph's batch dim is one micro-batch over all
    data-parallel ranks, so a step is ``num_microbatches`` graphs."""
    model = hw = 0
    fwd = [0] * num_chunks
    rec = [0] * num_chunks
    traffic = [0] * num_chunks
    rec_traffic = [0] * num_chunks
    for nd in graph.nodes():
        moved = op_fwd_traffic(graph, nd, degrees)
        if moved:
            traffic[nd.chunk or 0] += moved
            if recomputed(nd, recompute):
                rec_traffic[nd.chunk or 0] += moved
        g = op_fwd_flops(graph, nd)
        if g == 0:
            continue
        unpadded = g * vocab // padded_vocab if nd.type.has_dim("vocab") else g
        model += unpadded * (1 + BACKWARD_FACTOR)
        hw += g * (1 + BACKWARD_FACTOR) + (g if recomputed(nd, recompute) else 0)
        local = op_fwd_flops(graph, nd, degrees)
        c = nd.chunk or 0
        fwd[c] += local
        if recomputed(nd, recompute):
            rec[c] += local
    return ComputeReport(model * num_microbatches, hw * num_microbatches, tuple(fwd), tuple(rec),
                         tuple(traffic), tuple(rec_traffic))
