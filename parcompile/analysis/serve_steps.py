"""What one serving step costs on one rank of a pipeline stage, for any mix of rows: decode
rows of one token, prompt chunks of many (chunked prefill), at any context.

:func:`stage_steps` walks the sharded graph the plan compiled once, each node at its local
types for one token of one sequence (:class:`~parcompile.analysis.serve_memory.StepBytes`),
and keeps per pipeline stage what a step's cost is made of (:class:`StageSteps`): the bytes of
weights every step reads once (stored as ``serve.weight_dtype`` says:
:mod:`parcompile.core.quant`), the experts of each MoE layer (a step reads those its tokens
choose), the GEMM FLOPs, operand bytes and other ops' traffic per token (per sampled row for
the final norm and the LM head, which run on each row's last position), each attention
core's FLOPs per (query, key) pair and the cache bytes one token of context holds, and the
collectives with their bytes per token or per row. All of those are linear in the step's
tokens and rows (the op table's rules at a node's local types are), so a :class:`Step` of
any rows (:class:`Segment`) costs :meth:`StageSteps.time`:

* GEMMs: ``max(F / (eff.matmul * peak), W / (eff.memory * hbm_bw))`` with F the step's FLOPs
  (quantized FP8 layers' at the FP8 peak where the part has one and the format is W8A8) and
  W the weights read (the dense ones once, ``min(E, tokens * top_k) / E`` of each MoE
  layer's experts: vLLM's fused MoE kernel reads only the experts that got tokens), plus
  their operands' traffic;
* attention: ``max(A / attention rate, KV / (eff.memory * hbm_bw))``: A the cores' FLOPs
  over the step's (query, key) pairs (a row's new tokens each attend every earlier position
  of its context and itself, a sliding-window core at most its window), KV the cached
  context the step's rows read (:meth:`Step.cached`);
* the other ops' traffic at ``eff.memory * hbm_bw``;
* the collectives: a tp all-reduce by the engine's choice for its size
  (:func:`~parcompile.analysis.network.serve_allreduce`), the rest by the network model;
  pp transfers on their sender;
* the engine's fixed costs (:mod:`parcompile.analysis.serve_engines`): its per-step time
  on the first stage, its per-op time for every graph op of the stage; for the parcompile
  engine on a host that runs the graph op by op (the ``cpu`` preset's ``op_overhead``), the
  ops and the engine's own host work (:func:`host_overhead`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Mapping, Sequence

from parcompile.analysis.compute import counts_as_op
from parcompile.analysis.kv import kv_dtype as cache_dtype
from parcompile.analysis.network import Link, collective_time, serve_allreduce
from parcompile.analysis.serve_memory import StepBytes, received_bytes
from parcompile.core.dtypes import DTYPE_BYTES
from parcompile.core.model import STEP_PLAN_BYTES
from parcompile.core.quant import QuantFormat, quantized_param
from parcompile.ir.graph import Graph
from parcompile.ir.ops import Trait, op_collectives, spec

#: the module names of the ops after the last decoder layer, which a serve step runs on the
#: last position of each row only (serve.py.j2: ``final_norm(x[:, -1:])``, then the LM head)
HEAD_MODULES = frozenset({"final_norm", "lm_head"})
#: bytes of one sampled token id the last stage broadcasts over pp (int64)
TOKEN_BYTES = 8


# --------------------------------------------------------------------------- a step's rows


@dataclass(frozen=True)
class Segment:
    """``rows`` sequences of a step, each computing ``tokens`` new tokens after ``start``
    tokens already in its cache (a decode row: 1 token after its context so far; a prompt
    chunk: its tokens after the chunks before it). ``rows`` and ``start`` may be means."""

    rows: float
    tokens: float
    start: float

    def pairs(self, window: int) -> float:
        """(query, key) pairs the segment's new tokens attend under a causal mask, each at
        most ``window`` keys (0: all): ``rows * sum_{i=1..T} min(start + i, window)``."""
        s, t = self.start, self.tokens
        if not window or s + t <= window:
            return self.rows * (t * s + t * (t + 1) / 2)
        if s >= window:
            return self.rows * t * window
        a = window - s   # the new tokens whose position is still within the window
        return self.rows * (a * s + a * (a + 1) / 2 + (t - a) * window)

    def cached(self, window: int) -> float:
        """Tokens of cached context the segment's rows read (each row its ``start`` tokens,
        a sliding-window core at most its window)."""
        return self.rows * (min(self.start, window) if window else self.start)


@dataclass(frozen=True)
class Step:
    """One engine step of a replica: its :class:`Segment` s."""

    segments: tuple[Segment, ...]

    @property
    def rows(self) -> float:
        """Sequences in the step (each samples a token, or is a chunk of a prompt)."""
        return sum(s.rows for s in self.segments)

    @property
    def tokens(self) -> float:
        """New tokens the step computes."""
        return sum(s.rows * s.tokens for s in self.segments)

    def pairs(self, window: int) -> float:
        return sum(s.pairs(window) for s in self.segments)

    def cached(self, window: int) -> float:
        return sum(s.cached(window) for s in self.segments)


def decode_step(rows: float, context: float) -> Step:
    """A step of ``rows`` decode rows at ``context`` tokens of context each (the new token
    included)."""
    return Step((Segment(rows, 1, max(context - 1, 0)),))


# --------------------------------------------------------------------------- the stage model


@dataclass(frozen=True)
class AttentionCore:
    """One attention core of a stage on one rank: its ``window`` (0: full), its forward
    FLOPs per (query, key) pair, its traffic per pair (an unfused core's scores; 0 fused)
    and the cache bytes one token of context holds for it (its cached operands' local sizes
    in the cache dtype: k and v, or MLA's latent and RoPE key)."""

    window: int
    flops_per_pair: float
    bytes_per_pair: float
    kv_per_token: int


@dataclass(frozen=True)
class StageSteps:
    """What a step costs on one rank of pipeline stage ``stage`` (module docstring): bytes,
    FLOPs and collectives per token (``*_token``) or per sampled row (``*_row``)."""

    stage: int
    layers: int
    weights: float
    experts: tuple[tuple[float, int, int], ...]
    gemm_flops_token: float
    gemm_flops_row: float
    fp8_flops_token: float
    operands_token: float
    operands_row: float
    act_token: float
    act_row: float
    attention: tuple[AttentionCore, ...]
    #: ``(op, axis, bytes per token or per row, count)``: the step's collectives of each size
    colls_token: tuple[tuple[str, str, float, int], ...]
    colls_row: tuple[tuple[str, str, float, int], ...]
    ops: int
    first: bool
    last: bool
    #: ``(parameter, bytes)`` of every local parameter the rank holds, as stored (quantized
    #: ones in their format; one kv head where tp replicates them): the stage's weights memory
    held: tuple[tuple[str, int], ...] = ()

    @cached_property
    def held_bytes(self) -> int:
        """Bytes of the weights one rank of the stage holds (each parameter once)."""
        return sum(dict(self.held).values())

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token adds on this rank (every attention core of the stage)."""
        return sum(c.kv_per_token for c in self.attention)

    @property
    def kv_layers(self) -> tuple[tuple[int, int], ...]:
        """``(window, bytes per token)`` per attention core."""
        return tuple((c.window, c.kv_per_token) for c in self.attention)

    def weights_read(self, tokens: float) -> float:
        """Weight bytes a step of ``tokens`` tokens reads: the dense weights, and of each MoE
        layer's E experts the ``min(E, tokens * top_k)`` its tokens can choose."""
        return self.weights + sum(nb * min(e, tokens * k) / e for nb, e, k in self.experts)

    @cached_property
    def by_window(self) -> tuple[tuple[int, float, float, float], ...]:
        """The attention cores summed per window: ``(window, FLOPs per pair, bytes per pair,
        cache bytes per token)``."""
        acc: dict[int, list[float]] = {}
        for c in self.attention:
            a = acc.setdefault(c.window, [0.0, 0.0, 0.0])
            a[0] += c.flops_per_pair
            a[1] += c.bytes_per_pair
            a[2] += c.kv_per_token
        return tuple((w, *v) for w, v in acc.items())

    def flops(self, step: Step) -> tuple[float, float, float]:
        """``(GEMM FLOPs at the 16-bit rate, GEMM FLOPs at the FP8 rate, attention FLOPs)``."""
        t, r = step.tokens, step.rows
        attn = sum(f * step.pairs(w) for w, f, _b, _k in self.by_window)
        return (self.gemm_flops_token - self.fp8_flops_token) * t + self.gemm_flops_row * r, \
            self.fp8_flops_token * t, attn

    def time(self, step: Step, rates: "Rates") -> dict[str, float]:
        """Seconds of ``step`` on this stage by part (``gemm``: the GEMMs' weights or FLOPs;
        ``attention``: the cached context read or the cores' FLOPs, and unfused scores;
        ``activations``: the GEMMs' operands and the other ops' traffic; ``tp_comm``,
        ``pp_comm``, ``overhead``; module docstring)."""
        t, r = step.tokens, step.rows
        f16, f8, attn = self.flops(step)
        bw = rates.memory
        gemm = max(f16 / rates.gemm + f8 / rates.fp8, self.weights_read(t) / bw)
        kv = sum(k * step.cached(w) for w, _f, _b, k in self.by_window)
        pair_bytes = sum(b * step.pairs(w) for w, _f, b, _k in self.by_window)
        attention = max(attn / rates.attention, kv / bw) + pair_bytes / bw
        act = (self.operands_token * t + self.operands_row * r + self.act_token * t + self.act_row * r) / bw
        tpc = ppc = 0.0
        for coll, per in ((self.colls_token, t), (self.colls_row, r)):
            for op, axis, nb, count in coll:
                if axis == "pp":
                    if op == "send" or (op == "broadcast" and self.last):
                        ppc += count * collective_time("send", nb * per, 2, rates.links["pp"])
                elif op == "all_reduce":
                    link = rates.links.get(axis) or rates.links["tp"]
                    tpc += count * serve_allreduce(nb * per, rates.degrees.get(axis, 1), link, rates.engine,
                                                   rates.nccl)[1]
                else:
                    tpc += count * collective_time(op, nb * per, rates.degrees.get(axis, 1),
                                                   rates.links.get(axis) or rates.links["tp"])
        return {"gemm": gemm, "attention": attention, "activations": act, "tp_comm": tpc, "pp_comm": ppc,
                "overhead": rates.overhead(self, r)}


@dataclass(frozen=True)
class Rates:
    """The rates a replica's steps run at (bytes/s, FLOP/s), its links and its engine's
    fixed costs (:mod:`parcompile.analysis.serve_engines`); :func:`parcompile.analysis.serve.serve_rates` makes it."""

    gemm: float
    fp8: float
    attention: float
    memory: float
    links: Mapping[str, Link]
    degrees: Mapping[str, int]
    engine: object
    #: seconds per graph op of a step (the engine's, or the host's for an engine that runs
    #: the graph op by op)
    per_op: float
    #: the engine's host work beyond the graph's ops (the parcompile engine on a host it
    #: models: :func:`host_overhead`), else 0
    host: bool = False
    #: the collective library is NCCL (or RCCL), with its latency-bound LL protocol
    nccl: bool = True
    replica_ranks: int = 1

    def overhead(self, st: StageSteps, rows: float) -> float:
        """The engine's fixed time of one step on stage ``st`` (module docstring)."""
        out = st.ops * self.per_op
        if st.first:
            out += self.engine.step_overhead
        if self.host:
            out += host_overhead(st, self.links, self.replica_ranks, self.per_op)
        return out


#: host work of the parcompile engine beyond the graph's ops, in units of the host's cost per
#: graph op (``cluster.op_overhead``: frontend/host.py's probe). Timed on this machine (2-core
#: Xeon VM, torch 2.13, one thread, best of 5 x 200 calls) beside the probe's figure (17.9 us
#: per op then): the paged KV cache's write of a layer's new keys and values and its read of
#: their context (runtime/serve/paged.py ``PagedKVCache.store``: index_copy_ twice, two gathers, two
#: cats; 119 us at one sequence, 135 us at 32), per attention layer
PAGED_CACHE_OPS = 7.0
#: ... the step's layout on every rank (``paged_step``: token ids, slots, positions, masks;
#: 252 us at one sequence, 461 us at 32)
STEP_LAYOUT_OPS = 14.0
#: ... the sampling of the step's rows on the last stage (``sample_rows``, greedy: 50 us at
#: one sequence, 195 us at 32)
#: Each count is its one-sequence time over the probe's 17.9 us, rounded (119 / 17.9 = 6.6,
#: 252 / 17.9 = 14.1, 50 / 17.9 = 2.8). The counts do not grow with the step's rows: at 32
#: sequences the same timings give 7.5, 25.8 and 10.9, so a large batch's host work is
#: underestimated (layout and sampling by about 2x and 4x)
SAMPLE_OPS = 3.0


def host_overhead(st: StageSteps, links: Mapping[str, Link], ranks: int, per_op: float) -> float:
    """Seconds of one parcompile engine step on the critical path through a rank of stage
    ``st`` that the graph's ops do not hold (runtime/serve/paged.py ``serve_requests`` /
    ``run_step``): on the first stage the step's plan broadcast from the replica's leader to
    its other ``ranks - 1`` ranks (``broadcast_plan``: one broadcast of
    :data:`~parcompile.core.model.STEP_PLAN_BYTES`, timed as one send from the leader over
    the replica's link) and the step's layout (:data:`STEP_LAYOUT_OPS`; a later stage lays
    out its step while the earlier ones compute); on every stage the paged cache's work per
    attention layer (:data:`PAGED_CACHE_OPS`); on the last the sampling
    (:data:`SAMPLE_OPS`); each op at ``per_op`` seconds."""
    link = links["pp"] if not st.first or not st.last else links["tp"]
    plan = collective_time("send", STEP_PLAN_BYTES, 2, link) if st.first and ranks > 1 else 0.0
    ops = (STEP_LAYOUT_OPS if st.first else 0.0) + PAGED_CACHE_OPS * len(st.attention) \
        + (SAMPLE_OPS if st.last else 0.0)
    return plan + ops * per_op


def _counted(colls: list[tuple[str, str, float]]) -> tuple[tuple[str, str, float, int], ...]:
    """``(op, axis, bytes)`` entries as ``(op, axis, bytes, count)``, in first-seen order."""
    counts: dict[tuple[str, str, float], int] = {}
    for c in colls:
        counts[c] = counts.get(c, 0) + 1
    return tuple((*c, n) for c, n in counts.items())


def node_stage(nd, pp: int, stage_of: Callable[[int], int] | None) -> int:
    """The pipeline stage of graph node ``nd``: the graph's own (``nd.stage``), or, with
    ``stage_of`` (a decoder layer's stage: the search's restaging of a one-stage graph), the
    embedding's on the first, the head's on the last, a layer's ``stage_of(layer)``."""
    if stage_of is None:
        return nd.stage or 0
    if nd.op.module.startswith("layers.") and nd.op.layer is not None:
        return stage_of(nd.op.layer)
    return pp - 1 if nd.op.module in HEAD_MODULES else 0


def stage_steps(cfg, graph: Graph, degrees: Mapping[str, int], fmt: QuantFormat | None = None,
                fp8_gemm: bool = False, stage_of: Callable[[int], int] | None = None) -> list[StageSteps]:
    """Per pipeline stage, what a step costs on one rank (:class:`StageSteps`), from the
    sharded ``graph`` on its mesh ``degrees``: every node at its local types for one token
    of one sequence of a replica (its ``batch`` dim ``dp``, its ``seq`` dim 1), through the op
    table (``fwd_flops``, ``traffic``, its local parameters, :func:`op_collectives`).
    ``fmt``: the stored format of the quantized weights (:func:`parcompile.core.quant.
    quantized_param` says which); ``fp8_gemm``: their GEMMs run at the FP8 rate;
    ``stage_of``: the stage of each decoder layer when ``graph`` is a one-stage graph costed
    as ``cfg.parallel.pp`` stages (:func:`node_stage`).

    The serve program's collectives beyond the graph's layers: the hidden state of each
    step's tokens sent from a stage to the next (:func:`~parcompile.analysis.serve_memory.
    received_bytes` per token: the graph's ``send_recv`` rule, which a pp graph's nodes hold
    and tests/test_serve.py pins), the last position's vocab-split logits all-gathered over
    tp in fp32 (runtime/serve/generate.py ``gather_vocab``), the sampled tokens broadcast from the
    last stage over pp. Limits: with ``sequence_parallel`` the graph's sequence-split
    collectives are counted, which the serve program does not run."""
    pp = cfg.parallel.pp
    units = layer_units(cfg, graph, degrees, fmt, fp8_gemm, stage=lambda nd: node_stage(nd, pp, stage_of), count=pp)
    return [combine(cfg, [u], i, pp) for i, u in enumerate(units)]


def layer_units(cfg, graph: Graph, degrees: Mapping[str, int], fmt: QuantFormat | None = None,
                fp8_gemm: bool = False, stage: Callable | None = None, count: int | None = None,
                types: dict | None = None) -> list[StageSteps]:
    """The :class:`StageSteps` records of ``graph``'s nodes grouped by ``stage(node)`` into
    ``count`` units (default: the embedding, each decoder layer, the head: ``layers + 2``
    units of a one-stage graph, which :func:`combine` sums into any split; the sizing
    search), without the pipeline's collectives (:func:`combine` adds them). ``types``: a
    dict the nodes' local types at one token are kept in, shared by calls on the same
    graph and mesh (they depend on neither the format nor the cache dtype)."""
    m = cfg.model
    if stage is None:
        count = m.layers + 2
        stage = lambda nd: (nd.op.layer + 1 if nd.op.module.startswith("layers.") and nd.op.layer is not None  # noqa: E731
                            else count - 1 if nd.op.module in HEAD_MODULES else 0)
    kv_bytes = DTYPE_BYTES[cache_dtype(cfg)]
    unit = StepBytes(cfg, graph, degrees, 1, 1, 1)   # the nodes' local types for one token
    kv1 = unit.kv1                                   # one kv head where tp replicates them
    acc = [dict(weights=0.0, experts=[], f_tok=0.0, f_row=0.0, f8=0.0, op_tok=0.0, op_row=0.0, act_tok=0.0,
                act_row=0.0, attn=[], c_tok=[], c_row=[], ops=0, layers=set(), seen=set(), held={})
           for _ in range(count)]
    for nd in graph.nodes():
        if nd.has_trait(Trait.NOT_AN_OP) or nd.has_trait(Trait.LOSS):
            continue
        head = nd.op.module in HEAD_MODULES
        if types is None:
            ins, local = unit.types(nd, 1)
        else:
            got = types.get(nd.name)
            if got is None:
                got = types[nd.name] = unit.types(nd, 1)
            ins, local = got
        st = acc[stage(nd)]
        if nd.op.module.startswith("layers."):
            st["layers"].add(nd.op.layer)
        a = nd.op.attr_map
        s = spec(nd.kind)
        per = "row" if head else "tok"
        if counts_as_op(nd):
            st["ops"] += 1
        for p in nd.params:
            if p.name not in st["held"]:
                st["held"][p.name] = _stored(nd, p, kv1(p.sharding.local_type(p.type, degrees)), fmt)[1]
        if nd.has_trait(Trait.ATTENTION):
            core, per_token = _attention_core(s, a, ins, local, kv_bytes)
            st["attn"].append(core)
            st["act_tok"] += per_token
        else:
            st["f_" + per] += s.fwd_flops(a, ins, local)
            st["act_" + per] += s.traffic(a, ins, local)
        if nd.has_trait(Trait.GEMM):
            st["op_" + per] += ins[0].nbytes + local.nbytes
            quantized = False
            for p in nd.params:
                if p.name not in st["seen"]:
                    st["seen"].add(p.name)
                    q, nb = _stored(nd, p, kv1(p.sharding.local_type(p.type, degrees)), fmt)
                    quantized |= q
                    if nd.kind == "experts":
                        st["experts"].append((nb, m.experts, max(m.top_k, 1)))
                    else:
                        st["weights"] += nb
            if quantized and fp8_gemm:
                st["f8"] += s.fwd_flops(a, ins, local)
        elif not nd.has_trait(Trait.EMBEDDING):   # the norms' weights (an embedding reads its rows: traffic)
            for p in nd.params:
                if p.name not in st["seen"]:
                    st["seen"].add(p.name)
                    st["weights"] += kv1(p.sharding.local_type(p.type, degrees)).nbytes
        for c in op_collectives(nd, degrees, ins, local):
            if c.phase == "forward" and c.per == "microbatch" and degrees.get(c.axis, 1) > 1:
                st["c_" + per].append((c.op, c.axis, float(c.bytes)))
        if nd.kind == "linear" and nd.op.module == "lm_head" and degrees.get("tp", 1) > 1:
            # the last position's vocab-split logits, gathered in fp32 (runtime/serve/generate.py gather_vocab)
            st["c_row"].append(("all_gather", "tp", float(local.numel * degrees["tp"] * 4)))
    return [StageSteps(i, len(st["layers"]), st["weights"], tuple(st["experts"]), st["f_tok"], st["f_row"], st["f8"],
                       st["op_tok"], st["op_row"], st["act_tok"], st["act_row"], tuple(st["attn"]),
                       _counted(st["c_tok"]), _counted(st["c_row"]), st["ops"], False, False,
                       tuple(st["held"].items()))
            for i, st in enumerate(acc)]


def with_cache_dtype(units: Sequence[StageSteps], old: int, new: int) -> list[StageSteps]:
    """``units`` with their attention cores' cache bytes per token for a cache of ``new``
    bytes per element instead of ``old`` (the cached elements are the same)."""
    from dataclasses import replace as _replace
    return [_replace(u, attention=tuple(_replace(c, kv_per_token=c.kv_per_token // old * new) for c in u.attention))
            for u in units]


def _attention_core(s, a, ins, local, kv_bytes: int) -> tuple[AttentionCore, float]:
    """An attention node's :class:`AttentionCore` (its op spec ``s``, attributes ``a``, local
    types at one token) and its traffic per token: the op table's FLOPs and traffic at one
    and two keys tell the per-pair part (an unfused core's scores) from the per-token part
    (q, k, v and the output); the cache per token is its cached operands (k and v; MLA's
    latent and RoPE key) per (sequence, token) in the cache dtype."""
    one, two = {**a, "seq_len": 1}, {**a, "seq_len": 2}
    t1, t2 = s.traffic(one, ins, local), s.traffic(two, ins, local)
    cached = sum(t.numel // (t.dim("batch").size * t.dim("seq").size) for t in ins[1:3]) * kv_bytes
    return AttentionCore(a.get("window") or 0, s.fwd_flops(one, ins, local), t2 - t1, cached), t1 - (t2 - t1)


def _stored(nd, p, local, fmt: QuantFormat | None) -> tuple[bool, int]:
    """``(quantized, bytes)`` of parameter ``p`` of node ``nd`` at its ``local`` type as
    ``fmt`` stores it (:func:`parcompile.core.quant.quantized_param`)."""
    if quantized_param(nd.kind, nd.op.module, p.name, len(local.dims), fmt):
        return True, fmt.weight_bytes(tuple(d.size for d in local.dims))
    return False, local.nbytes


def combine(cfg, units: Sequence[StageSteps], stage: int, pp: int) -> StageSteps:
    """Pipeline stage ``stage`` of ``pp`` made of ``units`` (:func:`layer_units`): their
    costs summed (a parameter held by two units, a tied embedding, once), and the pipeline's
    collectives (:func:`stage_steps`' docstring)."""
    c_tok = [(op, ax, nb) for u in units for op, ax, nb, n in u.colls_token for _ in range(n)]
    c_row = [(op, ax, nb) for u in units for op, ax, nb, n in u.colls_row for _ in range(n)]
    if pp > 1:
        hidden = float(received_bytes(cfg, 1, 1))
        if stage < pp - 1:
            c_tok.append(("send", "pp", hidden))
        if stage > 0:
            c_tok.append(("recv", "pp", hidden))
        c_row.append(("broadcast", "pp", float(TOKEN_BYTES)))   # the sampled tokens, to every stage
    held: dict[str, int] = {}
    for u in units:
        held.update(u.held)
    return StageSteps(stage, sum(u.layers for u in units), sum(u.weights for u in units),
                      tuple(e for u in units for e in u.experts),
                      sum(u.gemm_flops_token for u in units), sum(u.gemm_flops_row for u in units),
                      sum(u.fp8_flops_token for u in units), sum(u.operands_token for u in units),
                      sum(u.operands_row for u in units), sum(u.act_token for u in units),
                      sum(u.act_row for u in units), tuple(a for u in units for a in u.attention),
                      _counted(c_tok), _counted(c_row), sum(u.ops for u in units), stage == 0, stage == pp - 1,
                      tuple(held.items()))


def split_units(cfg, units: Sequence[StageSteps], counts: Sequence[int]) -> list[StageSteps]:
    """The stages of a one-stage graph's :func:`layer_units` split into ``len(counts)``
    pipeline stages of ``counts[s]`` decoder layers each (the embedding on the first, the
    head on the last)."""
    pp = len(counts)
    out, first = [], 1
    for s, n in enumerate(counts):
        part = list(units[first:first + n])
        if s == 0:
            part.insert(0, units[0])
        if s == pp - 1:
            part.append(units[-1])
        out.append(combine(cfg, part, s, pp))
        first += n
    return out


__all__ = ["AttentionCore", "HEAD_MODULES", "PAGED_CACHE_OPS", "Rates", "SAMPLE_OPS", "STEP_LAYOUT_OPS", "Segment",
           "StageSteps", "Step", "TOKEN_BYTES", "decode_step", "host_overhead", "stage_steps",
           "combine", "layer_units", "with_cache_dtype", "node_stage", "split_units"]
