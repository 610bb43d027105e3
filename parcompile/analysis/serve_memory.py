"""The activation workspace of a serving step (SPEC 3 ``serve.stages[].workspace``): the peak
bytes of live activations on one rank of a pipeline stage while the largest prefill step the
program runs passes it (:func:`prefill_step`), from the sharded graph the plan compiled
(:func:`serve_workspace`): a liveness walk of each decoder layer's nodes at the step's local
types (:func:`at_step`, :func:`one_kv_head`), each op's forward scratch from the op table
(:attr:`parcompile.ir.ops.OpSpec.scratch`), the last stage's head (:func:`logits_bytes`) and
the received hidden state (:func:`received_bytes`). The serving analysis
(:mod:`parcompile.analysis.serve`) adds it to each stage's memory; measured with
torch.profiler on the serve program: tests/test_serve_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from parcompile.analysis.kv import kv_dtype as cache_dtype
from parcompile.analysis.serve_engines import serve_engine
from parcompile.core.heads import kv_heads_replicated
from parcompile.ir.graph import Graph
from parcompile.ir.ops import Trait, spec
from parcompile.ir.types import Dim, TensorType


def at_step(t: TensorType, batch: int, seq: int) -> TensorType:
    """``t`` with its ``batch`` and ``seq`` dims resized (a type without them unchanged)."""
    for name, size in (("batch", batch), ("seq", seq)):
        if t.has_dim(name):
            d = t.dim(name)
            t = t.replace_dim(name, Dim(name, size, d.unit))
    return t


def one_kv_head(t: TensorType) -> TensorType:
    """A local type whose ``kv`` dim the graph keeps unsplit, as one rank of a serving plan
    that replicates kv heads holds it: one kv head (:mod:`parcompile.core.heads`; the
    parameter report's rule, :func:`parcompile.analysis.params.stage_params`)."""
    if t.has_dim("kv"):
        d = t.dim("kv")
        t = t.replace_dim("kv", Dim("kv", d.unit, d.unit))
    return t


@dataclass(frozen=True)
class Workspace:
    """The activation workspace of one rank of a pipeline stage in a prefill step, bytes
    (:func:`serve_workspace`): ``layer`` the peak of live activations while the stage's
    largest layer (``layer_id``) runs, its input included; ``head`` (last stage) the peak
    while the final norm, the LM head and the sampler run: the last layer's output and the
    sampled rows' logits (:func:`logits_bytes`); ``received`` (stages after the first)
    the hidden state received from the previous stage, held for the whole step; ``step``
    what every layer of the step reads (:func:`step_inputs_bytes`)."""

    layer: int
    layer_id: int | None
    head: int
    received: int
    step: int = 0

    @property
    def total(self) -> int:
        """The step's peak: the layers and the head run one after the other, the received
        hidden state and the step's inputs live beside both."""
        return max(self.layer, self.head) + self.received + self.step


def prefill_step(cfg) -> tuple[int, int, int]:
    """``(rows, tokens, context)`` of the largest prefill step a replica runs: ``rows`` the
    sequences of the replica (``ceil(batch / dp)``; the server's ``max_seqs``), each with
    ``tokens`` new tokens, attending ``context`` keys. Without ``serve.max_prefill_tokens``
    a step prefills whole prompts, ``tokens = context = prompt_len``; with it the server
    (runtime/serve/scheduler.py ``Scheduler.next_step``) prefills at most that many prompt tokens
    per step: ``tokens = min(prompt_len, max_prefill_tokens)`` for every row, the last chunk
    of a prompt attending all ``prompt_len`` keys; a GPU engine (vLLM, SGLang: its default
    token budget per step, :func:`engine_budget`) computes at most its budget's tokens a step,
    ``budget // tokens`` rows of ``min(prompt_len, budget)``. A bound: the engine packs a step's tokens
    (runtime/serve/paged.py ``paged_step``), its linear layers see the real tokens only and its
    attention pads only the rows of more than one token, to their own longest, so a
    step's ``rows x tokens`` never exceeds this one's."""
    sv = cfg.serve
    rows = -(-sv.batch // cfg.parallel.dp)
    P = sv.prompt_len
    tokens = min(P, sv.max_prefill_tokens) if sv.max_prefill_tokens else P
    budget = engine_budget(cfg)
    if budget is not None and not sv.max_prefill_tokens:   # the engine's token budget bounds a step's tokens
        tokens = min(P, budget)
        rows = max(1, min(rows, budget // tokens))
    return rows, tokens, P


def engine_budget(cfg) -> int | None:
    """The tokens a step of ``cfg``'s serving engine computes at most by default
    (:meth:`~parcompile.analysis.serve_engines.ServeEngine.budget`: vLLM's
    ``max_num_batched_tokens``, SGLang's ``chunked_prefill_size``), None for the parcompile
    engine (``serve.max_prefill_tokens``, else whole prompts)."""
    eng = serve_engine(cfg)
    if eng.host_ops:
        return None
    cl = cfg.cluster
    return eng.budget(cl.memory, a100=(cl.preset or "").startswith("a100"))


def serve_workspace(cfg, graph: Graph, degrees: Mapping[str, int], batch: int, tokens: int,
                    context: int, stage_of: Callable[[int], int] | None = None) -> list[Workspace]:
    """Per pipeline stage, the activation workspace of one rank in a step of ``batch``
    sequences of ``tokens`` new tokens attending ``context`` keys (:func:`prefill_step`),
    from the sharded graph the plan compiled, bytes (:class:`Workspace`).

    Local types as :func:`step_costs` makes them (each node's global types with ``batch``
    resized to ``batch * dp`` and ``seq`` to ``tokens``, made local by the node's sharding;
    one kv head where tp replicates them). For each decoder layer, a liveness walk in graph
    order: a value is live from its producer (the layer's input: from the start) until its
    last consumer in the layer (the layer's output: to the end); a layout op without a
    forward collective is a view of its input, one with a collective a new tensor (the
    runtime all-reduces a clone: runtime/distributed/comm.py ``_ReduceFromRegion``). At each op the
    live values, its output and the op's forward scratch (:attr:`parcompile.ir.ops.OpSpec.scratch`:
    the attention core's expanded keys and values and, unfused, its scores and fp32
    softmax; RoPE's temporaries; the router's fp32 logits) are summed; the layer's
    workspace is the largest sum, the stage's the largest over its layers (each layer kind
    its own: dense and MoE layers, sliding-window and global ones).

    The head (last stage): the last layer's output and :func:`logits_bytes`; the received
    hidden state (stages after the first): ``batch x tokens x h`` in the model dtype.

    Left out (the band of tests/test_serve_memory.py): the norms' fp32 statistics per
    token, the attention kernel's and the CPU's 16-bit GEMM's internal buffers, allocator
    rounding; the MoE bound holds any routing, so a measured step is below it by the
    difference between its busiest expert and all N tokens.

    ``stage_of``: the stage of each decoder layer when ``graph`` is a one-stage graph
    costed as ``cfg.parallel.pp`` stages (the sizing search)."""
    return stage_workspaces(cfg, workspace_parts(cfg, graph, degrees, batch, tokens, context), stage_of)


@dataclass(frozen=True)
class WorkspaceParts:
    """What :func:`serve_workspace` is made of for one step shape: per decoder layer its
    graph stage and liveness peak, the head's bytes, the step's shared inputs, the hidden
    state a later stage receives (bytes)."""

    layers: tuple[tuple[int, int, int], ...]   # (layer id, its nodes' stage, peak)
    head: int
    step: int
    received: int


def workspace_parts(cfg, graph: Graph, degrees: Mapping[str, int], batch: int, tokens: int,
                    context: int) -> WorkspaceParts:
    """The liveness walk of each decoder layer (:func:`_live_bytes`) and the head's, step's
    and received bytes of :func:`serve_workspace`'s step, before they are put on stages."""
    bytes_of = StepBytes(cfg, graph, degrees, batch, tokens, context)
    layers: dict[int, list] = {}
    for nd in graph.nodes():
        if nd.op.layer is not None and nd.op.module.startswith("layers."):   # (not the embedding's all-reduce)
            layers.setdefault(nd.op.layer, []).append(nd)
    peaks = []
    for layer_id, nodes in sorted(layers.items()):
        live = _live_bytes(graph, nodes, lambda src: bytes_of.output(graph.node(src)), bytes_of.out_and_scratch)
        peaks.append((layer_id, nodes[0].stage or 0, max(live)))
    # the last layer's output (the final norm reads its last position) and the logits
    last_hidden = graph.inputs("final_norm")[0]
    head = bytes_of.output(graph.node(last_hidden)) + logits_bytes(cfg, graph, degrees, batch)
    return WorkspaceParts(tuple(peaks), head, step_inputs_bytes(cfg, graph, batch, tokens, context),
                          received_bytes(cfg, batch, tokens))


def stage_workspaces(cfg, parts: WorkspaceParts, stage_of: Callable[[int], int] | None = None) -> list[Workspace]:
    """Per pipeline stage of ``cfg``, its :class:`Workspace` from ``parts``: the largest
    peak of its layers (a layer's stage its nodes', or ``stage_of(layer)``), the head on the
    last stage, the received hidden state on the later ones."""
    pp = cfg.parallel.pp
    per_stage: list[tuple[int, int | None]] = [(0, None)] * pp
    for layer_id, stage, peak in parts.layers:
        s = stage if stage_of is None else stage_of(layer_id)
        if peak > per_stage[s][0]:
            per_stage[s] = (peak, layer_id)
    return [Workspace(per_stage[s][0], per_stage[s][1], parts.head if s == pp - 1 else 0,
                      parts.received if s > 0 else 0, parts.step) for s in range(pp)]


class StepBytes:
    """The bytes of each graph node of a serving step on one rank (:func:`serve_workspace`):
    ``batch`` sequences (per replica) of ``tokens`` new tokens attending ``context`` keys,
    at the node's local types under ``degrees`` (one kv head where tp replicates them)."""

    def __init__(self, cfg, graph: Graph, degrees: Mapping[str, int], batch: int, tokens: int, context: int):
        m = cfg.model
        self.cfg, self.graph, self.degrees = cfg, graph, degrees
        self.batch, self.tokens, self.context = batch, tokens, context
        self.rows = batch * degrees.get("dp", 1)
        one_kv = kv_heads_replicated(m.kv_heads, degrees.get("tp", 1)) and not m.kv_lora_rank
        self.kv1 = one_kv_head if one_kv else (lambda t: t)
        self.max_len = cfg.serve.prompt_len + cfg.serve.max_new_tokens   # the one-shot cache's length

    def types(self, nd, seq: int | None = None) -> tuple[list[TensorType], TensorType]:
        """The local types of ``nd``'s inputs and of its output in the step, their ``seq`` dim
        ``seq`` (default the step's ``tokens``; the estimate's step costs give the LM head 1)."""
        seq = self.tokens if seq is None else seq
        ins = [self.kv1(r.local_type(at_step(t, self.rows, seq), self.degrees))
               for r, t in zip(nd.requires, self.graph.input_types(nd.name))]
        return ins, self.kv1(nd.sharding.local_type(at_step(nd.type, self.rows, seq), self.degrees))

    def output(self, nd) -> int:
        """Bytes of ``nd``'s local output in the step."""
        return self.types(nd)[1].nbytes

    def out_and_scratch(self, nd) -> tuple[int | None, int]:
        """(bytes of the node's output, None for a view of its input; its scratch)."""
        if nd.has_trait(Trait.CONVERSION) and not nd.op.attr("fwd"):
            return None, 0
        ins, local = self.types(nd)
        a = nd.op.attr_map
        if nd.has_trait(Trait.ATTENTION):
            window = a.get("window") or 0
            a = {**a, "seq_len": self.context,
                 "kv_copy": (self.context > self.tokens or 0 < window < self.max_len
                             or cache_dtype(self.cfg) != self.cfg.model.dtype)}
        return local.nbytes, spec(nd.kind).scratch(a, ins, local)


def received_bytes(cfg, batch: int, tokens: int) -> int:
    """The hidden state a stage after the first receives for a step (runtime/serve/generate.py
    ``pipeline_pass``: ``recv`` of (batch, tokens, h) in the model dtype), bytes."""
    return batch * tokens * cfg.model.hidden * cfg.model.dtype_bytes


def step_inputs_bytes(cfg, graph: Graph, batch: int, tokens: int, context: int) -> int:
    """Bytes of what every layer of a step reads, made once per step (runtime/serve/generate.py
    ``Requests.step``, ``rope_at``; runtime/serve/paged.py ``paged_step``): per attention window
    of the graph's cores the boolean mask (batch, 1, tokens, context), and per RoPE table of
    its rope ops (base and scaling) the fp32 cos and sin at the tokens' positions (batch,
    tokens, rot) each, ``rot`` the rotated dims of a head (``rope_dim``, or ``fraction`` of
    head_dim)."""
    windows, tables = set(), {}
    for nd in graph.nodes():
        a = nd.op.attr_map
        if nd.has_trait(Trait.ATTENTION):
            windows.add(a.get("window") or 0)
        elif nd.has_trait(Trait.ROTARY):
            rot = a.get("rope_dim") or round(a.get("fraction", 1.0) * cfg.model.head_dim)
            key = (a.get("theta"), repr(a.get("scaling")))
            tables[key] = max(tables.get(key, 0), rot)
    return batch * tokens * (len(windows) * context + sum(2 * 4 * rot for rot in tables.values()))


def _live_bytes(graph: Graph, nodes: Sequence, outer_bytes, out_and_scratch) -> list[int]:
    """Per op of one decoder layer (``nodes``, in graph order), the bytes live while it runs
    (:func:`serve_workspace`'s walk): the values made before it and read by it or later,
    its output and its scratch. ``outer_bytes(name)``: the bytes of a value made outside the
    layer (its input: held by the caller for the whole layer); ``out_and_scratch(node)``:
    (its output's bytes, None for a view of its first input; its scratch).

    When a value dies: read by one op of ``Trait.EXPRESSION`` (its operand a temporary), with it (a temporary of
    one expression, or rebound); read by several ops (a named local of the module's
    ``forward``) or by any other op (an argument or local of the module that runs it), at
    the last op of the reading op's module (Python holds a function's arguments and locals
    until it returns); never read, with its maker."""
    names = {nd.name for nd in nodes}
    end = {nd.op.module: i for i, nd in enumerate(nodes)}     # each module's last op
    value: dict[str, str] = {}     # node -> the tensor it is (itself, or a view's source)
    size: dict[str, int] = {}
    made: dict[str, int] = {}
    last: dict[str, int] = {}
    scratch: list[int] = []
    for i, nd in enumerate(nodes):
        for src in graph.inputs(nd.name):
            v = value.get(src, src)
            if src not in names and v not in size:   # the layer's input: the caller holds it
                size[v], made[v], last[v] = outer_bytes(src), -1, len(nodes)
        nb, sc = out_and_scratch(nd)
        scratch.append(sc)
        if nb is None:
            src = graph.inputs(nd.name)[0]
            value[nd.name] = value.get(src, src)
        else:
            value[nd.name] = nd.name
            size[nd.name], made[nd.name] = nb, i
    readers: dict[str, list[int]] = {}
    for i, nd in enumerate(nodes):
        if value[nd.name] == nd.name:                # a view reads nothing itself
            for src in graph.inputs(nd.name):
                readers.setdefault(value.get(src, src), []).append(i)
    for v, rs in readers.items():
        alone = len(rs) == 1 and nodes[rs[0]].has_trait(Trait.EXPRESSION)
        last[v] = max(last.get(v, -1), rs[0] if alone else max(end[nodes[r].op.module] for r in rs))
    for v in size:
        last.setdefault(v, made[v])
    last[value[nodes[-1].name]] = len(nodes)        # the layer's output
    return [sum(b for v, b in size.items() if made[v] <= i <= last[v]) + scratch[i] for i in range(len(nodes))]


#: bytes per (row, vocabulary entry) the sampler (runtime/serve/generate.py ``pick_tokens``) holds
#: beside the logits it reads, measured with torch.profiler on the CPU: 7 greedy (the
#: finiteness check: an fp32 ``abs`` and three boolean masks), 12 with a temperature, 24 with
#: top-p (the sorted probabilities, their int64 order, the cumulative sums, the masks); the
#: server samples each request with its own parameters, so the workspace holds the largest
SAMPLER_BYTES = 24


def logits_bytes(cfg, graph: Graph, degrees: Mapping[str, int], rows: int) -> int:
    """Bytes of the logits of a step's ``rows`` sampled positions on one rank of the last
    stage while the sampler runs (the serve program's ``Stage.forward``, ``gather_vocab``,
    ``pick_tokens``): the LM head's output at one position (its graph type, ``rows x V'/tp``)
    in fp32, which the caller keeps; with tp > 1 the all-gathered fp32 logits ``rows x V'``;
    and the sampler's working set, :data:`SAMPLER_BYTES` per ``rows x V'``."""
    dp, tp = degrees.get("dp", 1), degrees.get("tp", 1)
    nd = graph.node("lm_head")
    local = nd.sharding.local_type(at_step(nd.type, rows * dp, 1), degrees).numel
    full = local * tp
    return 4 * local + (4 * full if tp > 1 else 0) + SAMPLER_BYTES * full
