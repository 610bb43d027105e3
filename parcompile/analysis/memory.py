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

(params + fp32 gradients + optimizer: fp32 master weights for 16-bit models and 4 bytes
per optimizer state: 2 for Adam/AdamW, 0 for SGD.)

Activations (rough): the bytes one micro-batch saves for backward on the rank
(Korthikanti et al. 2022: the tensors each op keeps, counted once per tensor, plus
softmax and dropout masks), times the schedule's ``in_flight`` peak. ``recompute = full``
keeps only each layer's input plus one layer's working set; ``selective`` drops the
attention core's ``s x s`` tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from parcompile.analysis.params import StageParams
from parcompile.ir.graph import Graph
from parcompile.ir.ops import spec

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one rank of pipeline stage ``stage``."""

    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int
    kv_cache: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.kv_cache


@dataclass(frozen=True)
class MemoryReport:
    """``per_stage``, ``peak`` (largest total), ``capacity`` (memory minus the reserve),
    ``fits`` (``peak <= capacity``)."""

    per_stage: tuple[StageMemory, ...]
    peak: int
    capacity: int
    fits: bool


def state_bytes(n: int, dtype_bytes: int, zero: int, d: int, optimizer: str = "adamw") -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes for ``n`` parameters on one rank (module table)."""
    k = OPTIMIZER_STATES[optimizer]
    shard = math.ceil(n / d) if d > 1 else n
    opt_per = 4 * k + (4 if dtype_bytes < 4 else 0)
    params = dtype_bytes * (shard if zero >= 3 else n)
    grads = 4 * (shard if zero >= 2 else n)
    opt = opt_per * (shard if zero >= 1 else n)
    return params, grads, opt


def _alias(graph: Graph, name: str) -> str:
    """The tensor a name stands for: layout ops without forward communication are views."""
    nd = graph.node(name)
    while nd.kind == "redistribute" and not nd.op.attr("fwd"):
        name = graph.inputs(name)[0]
        nd = graph.node(name)
    return name


def saved_bytes_per_chunk(graph: Graph, degrees: Mapping[str, int], num_chunks: int, recompute: str,
                          ) -> list[int]:
    """Bytes one micro-batch keeps for backward on one rank, per model chunk."""
    tensors: list[dict[str, int]] = [{} for _ in range(num_chunks)]   # chunk -> tensor -> bytes
    extra = [0] * num_chunks
    layer_bytes: dict[int, int] = {}
    layer_input: dict[int, int] = {}
    for nd in graph.nodes():
        s = spec(nd.kind)
        c = nd.chunk or 0
        a = nd.op.attr_map
        ins = graph.inputs(nd.name)
        local_in = [r.local_type(graph.node(u).type, degrees) for r, u in zip(nd.requires, ins)]
        local_out = nd.sharding.local_type(nd.type, degrees)
        own = 0
        for i in s.saves(a):
            t = _alias(graph, ins[i])
            if t not in tensors[c]:
                pu = graph.node(t)
                b = pu.sharding.local_type(pu.type, degrees).nbytes
                tensors[c][t] = b
                own += b
        x = s.saved_extra(a, local_in, local_out)
        if recompute == "selective" and s.selective_recompute and a.get("impl") == "unfused":
            x = 0
        extra[c] += x
        own += x
        if nd.op.layer is not None:
            layer_bytes[nd.op.layer] = layer_bytes.get(nd.op.layer, 0) + own
            if nd.kind == "norm" and nd.name.endswith("attn_norm"):
                layer_input[nd.op.layer] = local_in[0].nbytes
    out = [sum(t.values()) + e for t, e in zip(tensors, extra)]
    if recompute == "full" and layer_bytes:
        # keep each layer's input; one layer at a time is rebuilt during backward
        chunk_of_layer = {nd.op.layer: nd.chunk or 0 for nd in graph.nodes() if nd.op.layer is not None}
        for layer, b in layer_bytes.items():
            out[chunk_of_layer[layer]] -= b - layer_input.get(layer, 0)
    return out


def memory_report(graph: Graph, cfg, degrees: Mapping[str, int], stage_params: Sequence[StageParams],
                  in_flight: Sequence, kv_bytes_per_token: Sequence[int] | None = None) -> MemoryReport:
    """Build the :class:`MemoryReport` for ``cfg`` (a SpecConfig)."""
    par, model = cfg.parallel, cfg.model
    pp, v = par.pp, par.virtual_stages
    e = model.dtype_bytes
    serve = cfg.workload == "serve"
    per_chunk = saved_bytes_per_chunk(graph, degrees, pp * v, par.recompute)
    full_layer = 0
    if par.recompute == "full":
        full_layer = _one_layer_bytes(graph, degrees)
    stages = []
    for s, sp in enumerate(stage_params):
        if serve:
            params, grads, opt = e * sp.total, 0, 0
            acts = 0
            kv = 0
            if kv_bytes_per_token is not None and cfg.serve is not None:
                kv = cfg.serve.batch * (cfg.serve.prompt_len + cfg.serve.max_new_tokens) * kv_bytes_per_token[s]
        else:
            pd = state_bytes(sp.dense, e, par.zero, degrees["dp_cp"], cfg.train.optimizer)
            pe = state_bytes(sp.expert, e, par.zero, degrees["expert_dp"], cfg.train.optimizer)
            params, grads, opt = (x + y for x, y in zip(pd, pe))
            mb = sum(per_chunk[c * pp + s] for c in range(v))
            acts = int(in_flight[s] * mb) + full_layer
            kv = 0
        stages.append(StageMemory(s, params, grads, opt, acts, kv))
    peak = max(x.total for x in stages)
    cap = int(cfg.cluster.memory * (1 - cfg.cluster.memory_reserve))
    return MemoryReport(tuple(stages), peak, cap, peak <= cap)


def _one_layer_bytes(graph: Graph, degrees: Mapping[str, int]) -> int:
    """Saved bytes of layer 0 without recomputation (the working set of one rebuilt layer)."""
    total = 0
    for nd in graph.nodes():
        if nd.op.layer != 0:
            continue
        s = spec(nd.kind)
        ins = graph.inputs(nd.name)
        for i in s.saves(nd.op.attr_map):
            pu = graph.node(ins[i])
            total += pu.sharding.local_type(pu.type, degrees).nbytes
        local_in = [r.local_type(graph.node(u).type, degrees) for r, u in zip(nd.requires, ins)]
        total += s.saved_extra(nd.op.attr_map, local_in, nd.sharding.local_type(nd.type, degrees))
    return total
