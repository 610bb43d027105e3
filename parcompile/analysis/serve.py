"""The serving analysis (SPEC 1 `serve`, SPEC 3 `serve`): memory and time of a plan that
prefills ``batch`` prompts and then generates token by token with a KV cache.

Layout. Attention heads and the KV cache split by kv head over tp (``kv_heads / tp`` per
rank, or one kv head replicated on ``tp / kv_heads`` ranks when tp is a multiple of
kv_heads, as vLLM does); layers and their cache split over pp; dp makes independent
replicas, each serving ``ceil(batch / dp)`` of the sequences (``batch_per_replica``).

Memory per rank of pipeline stage ``s`` (bytes):

* weights: ``params_per_rank * dtype_bytes`` (the plan's stage parameters, padded vocab);
* KV bytes per token: ``2 * layers_s * kv_heads_per_rank * head_dim * kv_bytes`` (K and V;
  ``kv_bytes`` 4/2/2/1 for fp32/bf16/fp16/fp8); under multi-head latent attention
  ``layers_s * (kv_lora_rank + qk_rope_head_dim) * kv_bytes``, the latent and the RoPE key,
  once per token for every head and the same on every tp rank (:mod:`parcompile.analysis.kv`;
  DeepSeek-V3: 61 x (512 + 64) x 2 = 70,272 bytes in bf16). SPEC 3's
  ``serve.kv_bytes_per_token`` is the largest over the stages (the most loaded rank);
* KV cache: ``batch_per_replica * (prompt_len + max_new_tokens) * kv_bytes_per_token_s``,
  less where a sliding-window layer keeps only its window (:mod:`parcompile.analysis.kv`);
* activation workspace (prefill, the larger phase; nothing is kept for a backward): the
  peak bytes of live activations on the rank while the largest prefill step the program
  runs (``ceil(batch / dp)`` rows of ``prompt_len`` tokens, or of ``serve.max_prefill_tokens``
  attending the whole prompt: :func:`prefill_step`) passes the stage, computed from the
  sharded graph (:mod:`parcompile.analysis.serve_memory`): a liveness walk of each decoder layer's nodes at
  the step's local types, each op's forward scratch from the op table
  (:attr:`parcompile.ir.ops.OpSpec.scratch`: the attention core's repeated kv heads and
  additive mask, or unfused its scores and fp32 softmax; RMSNorm's fp32 copies; RoPE's
  temporaries; the router's fp32 logits), the largest over the stage's layers, beside the
  step's masks and RoPE tables; the last stage's head (the last hidden state and the
  sampled rows' logits, fp32, gathered over tp: :func:`~parcompile.analysis.serve_memory.logits_bytes`) after the layers;
  with pp > 1 the received hidden state (``b T h e``) beside both. Measured with
  torch.profiler on the serve program: tests/test_serve_memory.py;
* ``max_concurrent_tokens``: ``(capacity - weights - workspace) // kv_bytes_per_token``,
  the smallest over the stages: how many tokens of context fit the remaining capacity.

Time (one replica; pipeline stages run one after another for a single batch, as every
token passes through every stage; Pope et al. 2022, "Efficiently Scaling Transformer
Inference", section 2). Each step is costed from the sharded graph the plan compiled
(:func:`step_costs`: every node at its local types for the step's shapes, the op table's
FLOPs and traffic, its local parameters, its collectives), so the local sizes and the
collectives are those of training's rules and of the program (tests/test_serve.py holds
the collectives equal to what each rank of the serve program counts):

* prefill (``b`` sequences of ``P`` tokens; the final norm and LM head on the last
  position only, as the program samples it) per stage: ``max((F + A) / (matmul_eff *
  peak_flops), (W + X) / (memory_eff * hbm_bw))`` with F the matmuls' FLOPs, A the
  attention cores' (causal share, :func:`parcompile.analysis.compute.causal_share`), W the
  weight bytes read, X the operands' and other ops' traffic; plus the step's collectives
  (tp all-reduces, the logits' all-gather, one pp send of ``b P h e`` per stage boundary and
  the sampled tokens' broadcast);
* decode (one token per sequence) is memory-bandwidth-bound: per stage ``max(W / (memory_eff
  * hbm_bw), (F + A) / (matmul_eff * peak_flops))`` (``decode_weights``: the embedding table
  is not read, a lookup reads b rows), the cache at the mean context ``P + max_new_tokens /
  2`` (a sliding-window layer's at most its window; ``decode_kv``: each attention core's
  cached operands per token, read off the graph, :attr:`StepCost.kv_layers`), the
  activations' traffic (``decode_activations``) and the step's collectives;
* multi-head latent attention is costed in the absorbed form the serve program runs (the
  serving graph's, :func:`parcompile.ir.lower.mla_absorbed`; DeepSeek-V2, arXiv 2405.04434,
  section 2.1.1 and appendix B; vLLM's "data-movement friendly approach" of
  vllm-project/vllm ``vllm/attention/backends/mla/common.py`` at commit 15daa36e, which
  vLLM runs in decode and this program in prefill too): per token and head
  ``2 n c`` FLOPs for ``q_nope W_uk``, ``2 L (c + r) + 2 L c`` for the scores over the ``L``
  cached ``[latent, RoPE key]`` and the weighted latents, ``2 c v`` for ``W_uv`` (n/r/v the
  nope/rope/value head dims, c kv_lora_rank); wkv_b's weights are read once; the cache a
  decode step reads is ``(c + r) * kv_bytes`` per token and layer, shared by every head
  (not ``2 * heads * head_dim``: the non-absorbed form's keys and values);
* ``cluster.op_overhead`` (the host's cost per graph op, the ``cpu`` preset's): the graph's
  ops per step times it (``prefill_overhead``, ``decode_overhead``; left out where 0), and
  the engine's own host work per step, in prefill and decode alike (``engine_overhead``:
  the step plan's broadcast to the replica's ranks, the step's layout, the paged cache's
  writes and reads, the sampling: :func:`engine_overhead`; left out where 0);
* ``ttft`` (time to first token) is the prefill; ``tpot`` (time per output token) a decode
  step; ``decode_tokens_per_s = dp * b / tpot``; ``tokens_per_s`` the generated tokens over
  the whole request, ``dp * b * max_new_tokens / (ttft + (max_new_tokens - 1) * tpot)``.

Mixture of experts (``experts > 0``; layers ``i >= dense_layers``), served tensor parallel
as vLLM does by default (no expert parallelism: every rank holds every expert, each
expert's inner width ``f_x`` split over tp, the router replicated):

* weights: the plan's stage parameters as above (all E experts ``/ tp``, the router whole);
* time: a step reads only the experts its tokens chose: at most ``min(E, rows top_k)`` of
  the E per layer (rows = ``b`` in a decode step, ``b P`` in a prefill), the balanced worst
  case (vLLM's fused MoE kernel reads only the experts that received tokens);
* the graph says so (``shard-experts``): the router replicated, a local dispatch, the
  experts' and the combine's partial sums over tp, the shared experts' added, one
  all-reduce over tp after the sum; costed from its nodes like any layer;
* workspace of a MoE layer: the same walk; the program's experts run one at a time on the
  rows that chose them (at most every token of the step: the bound holds any routing;
  the op table's scratch of the dispatch, the experts and the combine, ir/scratch.py).

Collectives are timed by the network model (algorithm and link where the group sits,
:func:`parcompile.analysis.estimate.collective_time`), with the cluster's efficiencies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from parcompile.analysis.compute import GEMM_KINDS, causal_share, counts_as_op
from parcompile.analysis.estimate import axis_link, collective_time, efficiency
from parcompile.analysis.kv import cache_heads, kv_bytes_per_sequence, kv_bytes_per_token, stage_layers
from parcompile.analysis.kv import kv_dtype as cache_dtype
from parcompile.analysis.memory import MemoryReport, StageMemory
from parcompile.analysis.serve_memory import StepBytes, prefill_step, received_bytes, serve_workspace
from parcompile.core.dtypes import DTYPE_BYTES
from parcompile.core.heads import kv_heads_per_rank
from parcompile.core.model import STEP_PLAN_BYTES
from parcompile.config.presets import fp8_storage
from parcompile.core.units import bytes_text
from parcompile.ir.graph import Graph
from parcompile.ir.ops import op_collectives, spec
from parcompile.ir.types import ShardingError, TensorType

#: the largest tp degree suggested in a "does not fit" help line
_MAX_TP_HINT = 64


@dataclass(frozen=True)
class ServeStage:
    """One rank of pipeline stage ``stage``: bytes and seconds (module docstring)."""

    stage: int
    layers: int
    weights: int
    kv_bytes_per_token: int
    kv_cache: int
    #: the cache of one sequence of the plan's context (sliding-window layers hold at most
    #: their window: :func:`parcompile.analysis.kv.kv_bytes_per_sequence`)
    kv_per_sequence: int
    workspace: int
    free_for_kv: int
    prefill_s: float
    decode_s: float


@dataclass(frozen=True)
class ServeReport:
    """The plan's ``serve`` section and the serving memory per stage."""

    stages: tuple[ServeStage, ...]
    capacity: int
    batch: int
    batch_per_replica: int
    replicas: int
    prompt_len: int
    max_new_tokens: int
    kv_dtype: str
    kv_heads_per_rank: int
    kv_head_replicas: int
    ttft: float
    tpot: float
    breakdown: dict[str, float] = field(default_factory=dict)
    block_size: int = 16
    kv_cache_cap: int | None = None
    prefix_caching: bool = True
    max_prefill_tokens: int | None = None
    compile: bool = False
    stream_interval: int = 1
    waiting_served_ratio: float = 0.0
    max_waiting_steps: int = 0

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the server's paged KV cache holds (``parcompile serve``; SPEC 4): the
        spec's ``kv_cache_tokens`` when given, at most ``max_concurrent_tokens``, rounded
        down to whole blocks of ``block_size``."""
        cap = self.max_concurrent_tokens if self.kv_cache_cap is None else min(self.kv_cache_cap,
                                                                               self.max_concurrent_tokens)
        return cap // self.block_size * self.block_size

    @property
    def context(self) -> int:
        """Tokens of cache one sequence needs: ``prompt_len + max_new_tokens``."""
        return self.prompt_len + self.max_new_tokens

    @property
    def kv_bytes_per_token(self) -> int:
        """SPEC 3: the KV bytes one token adds on the most loaded rank."""
        return max(s.kv_bytes_per_token for s in self.stages)

    @property
    def max_concurrent_tokens(self) -> int:
        """Tokens of cache that fit beside the weights and workspace on every stage."""
        return min(max(s.free_for_kv, 0) // s.kv_bytes_per_token if s.kv_bytes_per_token else 0
                   for s in self.stages)

    @property
    def one_sequence_fits(self) -> bool:
        return all(s.free_for_kv >= s.kv_per_sequence for s in self.stages)

    @property
    def batch_fits(self) -> bool:
        return all(s.free_for_kv >= s.kv_cache for s in self.stages)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second while decoding: every one of the ``batch`` sequences (over all
        replicas; a replica with fewer than ``batch_per_replica`` is not slower) each ``tpot``."""
        return self.batch / self.tpot if self.tpot > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second over a whole request of the ``batch`` sequences."""
        total = self.ttft + (self.max_new_tokens - 1) * self.tpot
        return self.batch * self.max_new_tokens / total if total > 0 else 0.0

    def memory(self) -> MemoryReport:
        """The plan's ``memory`` section for serving: weights as ``params``, the workspace as
        ``activations``, the KV cache as ``kv_cache`` (no gradients or optimizer states)."""
        per = tuple(StageMemory(s.stage, s.weights, 0, 0, s.workspace, s.kv_cache) for s in self.stages)
        peak = max(x.total for x in per)
        return MemoryReport(per, peak, self.capacity, peak <= self.capacity)

    def to_dict(self) -> dict:
        """The plan.json ``serve`` section (bytes are integers, times seconds)."""
        return {
            "batch": self.batch,
            "batch_per_replica": self.batch_per_replica,
            "replicas": self.replicas,
            "prompt_len": self.prompt_len,
            "max_new_tokens": self.max_new_tokens,
            "kv_dtype": self.kv_dtype,
            "kv_heads_per_rank": self.kv_heads_per_rank,
            "kv_head_replicas": self.kv_head_replicas,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_token_per_stage": [s.kv_bytes_per_token for s in self.stages],
            "kv_cache_bytes_per_rank": max(s.kv_cache for s in self.stages),
            "weights_bytes_per_rank": max(s.weights for s in self.stages),
            "workspace_bytes_per_rank": max(s.workspace for s in self.stages),
            "max_concurrent_tokens": self.max_concurrent_tokens,
            "block_size": self.block_size,
            "kv_cache_tokens": self.kv_cache_tokens,
            "kv_blocks": self.kv_cache_tokens // self.block_size,
            "prefix_caching": self.prefix_caching,
            **({"max_prefill_tokens": self.max_prefill_tokens} if self.max_prefill_tokens else {}),
            **({"compile": True} if self.compile else {}),
            **({"stream_interval": self.stream_interval} if self.stream_interval > 1 else {}),
            **({"waiting_served_ratio": self.waiting_served_ratio, "max_waiting_steps": self.max_waiting_steps}
               if self.max_waiting_steps else {}),
            "max_concurrent_sequences": min(max(s.free_for_kv, 0) // s.kv_per_sequence if s.kv_per_sequence else 0
                                            for s in self.stages),
            "fits": self.batch_fits,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "tokens_per_s": self.tokens_per_s,
            "breakdown": dict(self.breakdown),
        }


@dataclass(frozen=True)
class StepCost:
    """One prefill or decode step of one replica on one rank of a pipeline stage, summed
    from the sharded graph's nodes at the step's local types (:func:`step_costs`).

    ``flops``: the matmuls' (linear, router, experts) forward FLOPs; ``attn_flops``: the
    attention cores' (causal share applied in a prefill); ``weight_bytes``: the weights the
    step reads (each local parameter once, the embedding table but its looked-up rows,
    the experts the step's tokens can choose); ``act_bytes``: the matmuls' operands and
    results and the other ops' traffic (``OpSpec.traffic``); ``ops``: graph ops run (for
    ``cluster.op_overhead``); ``collectives``: ``(op, axis, bytes)`` of every collective
    the serve program runs in the step on this rank, in graph order (the graph's forward
    collectives, the vocab-parallel loss's replaced by the logits' all-gather over tp on
    the last stage, and the sampled tokens' broadcast over pp); ``kv_layers``: per
    attention core of the stage, ``(window, bytes)``: its attention window (0: full) and
    the cache bytes one token of context holds on this rank (its cached operands' local
    sizes per token in the cache dtype: k and v, or MLA's latent and RoPE key)."""

    flops: float
    attn_flops: float
    weight_bytes: float
    act_bytes: float
    ops: int
    collectives: tuple[tuple[str, str, int], ...]
    kv_layers: tuple[tuple[int, int], ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token of context adds to this rank's cache, every layer of the stage
        (while no sliding window is full)."""
        return sum(nb for _, nb in self.kv_layers)


#: the module names of the ops after the last decoder layer, which a serve step runs on the
#: last position only (serve.py.j2: ``final_norm(x[:, -1:])``, then the LM head)
HEAD_MODULES = frozenset({"final_norm", "lm_head"})
#: bytes of one sampled token id the last stage broadcasts over pp (int64)
TOKEN_BYTES = 8


def step_costs(cfg, graph: Graph, degrees: Mapping[str, int], batch: int, tokens: int,
               context: int) -> list[StepCost]:
    """Per pipeline stage, what one step of the serve program costs on one rank
    (:class:`StepCost`): ``batch`` sequences of this replica, ``tokens`` new tokens each
    (the prompt in a prefill, 1 in a decode step), attending ``context`` keys (``tokens``
    in a prefill, the cached context in a decode step).

    Every number comes from the graph the plan compiled (one micro-batch, sharded): each
    node's global input and output types with their ``batch`` dim resized to ``batch * dp``
    (the data-parallel split gives each replica ``batch``) and their ``seq`` dim to
    ``tokens`` (1 for :data:`HEAD_MODULES`), made local by the node's sharding, then the op
    table's rules (:func:`parcompile.ir.ops.spec`: ``fwd_flops``, ``traffic``; an
    attention core's ``seq_len`` attribute set to ``context``) and its collectives
    (:func:`parcompile.ir.ops.op_collectives`, forward phase). A MoE layer's expert
    weights count ``min(E, rows * top_k) / E`` of their bytes (the experts a step's rows can
    choose at most; vLLM's fused MoE kernel reads only those). The KV cache a decode step
    reads is each attention core's cached operands per token (``kv_layers``): k and v of
    the rank's kv heads, or under multi-head latent attention (the serving graph's absorbed
    form, module docstring) the latent and the RoPE key, once for every head.

    Limits: with ``sequence_parallel`` the graph's sequence-split collectives are counted,
    which the serve program does not run."""
    m, pp = cfg.model, cfg.parallel.pp
    kv_bytes = DTYPE_BYTES[cache_dtype(cfg)]
    step = StepBytes(cfg, graph, degrees, batch, tokens, context)     # the nodes' local types
    kv1 = step.kv1                                                    # one kv head where tp replicates them
    out: list[dict] = [dict(flops=0.0, attn=0.0, weights=0.0, act=0.0, ops=0, colls=[], seen=set(), kv=[])
                       for _ in range(pp)]
    for nd in graph.nodes():
        if nd.kind in ("input", "step_collective", "cross_entropy"):
            continue
        head = nd.op.module in HEAD_MODULES
        seq = 1 if head else tokens
        ins, local = step.types(nd, seq)
        st = out[nd.stage or 0]
        a = nd.op.attr_map
        s = spec(nd.kind)
        if counts_as_op(nd):
            st["ops"] += 1
        if nd.kind == "attention":
            attrs = {**a, "seq_len": context}
            share = causal_share(attrs) if tokens > 1 else 1.0
            st["attn"] += s.fwd_flops(attrs, ins, local) * share
            st["act"] += s.traffic(attrs, ins, local)
            st["kv"].append((a.get("window") or 0, _cached_per_token(ins[1:3]) * kv_bytes))
        else:
            st["flops"] += s.fwd_flops(a, ins, local)
            st["act"] += s.traffic(a, ins, local)
        if nd.kind in GEMM_KINDS:
            operands = ins[0].nbytes + local.nbytes
            for p in nd.params:
                if p.name in st["seen"]:
                    continue
                st["seen"].add(p.name)
                nb = kv1(p.sharding.local_type(p.type, degrees)).nbytes
                if nd.kind == "experts":
                    rows = ins[0].numel // ins[0].dims[-1].size // max(m.top_k, 1)
                    nb *= min(m.experts, rows * m.top_k) / m.experts
                st["weights"] += nb
            st["act"] += operands
        elif nd.kind != "embedding":   # the norms' weights (an embedding reads its rows: traffic)
            for p in nd.params:
                if p.name not in st["seen"]:
                    st["seen"].add(p.name)
                    st["weights"] += kv1(p.sharding.local_type(p.type, degrees)).nbytes
        for c in op_collectives(nd, degrees, ins, local):
            if c.phase == "forward" and c.per == "microbatch" and degrees.get(c.axis, 1) > 1:
                out[c.stage if c.stage is not None else (nd.stage or 0)]["colls"].append((c.op, c.axis, c.bytes))
        if nd.kind == "linear" and nd.op.module == "lm_head" and degrees.get("tp", 1) > 1:
            # the last position's vocab-split logits, gathered in fp32 (runtime/generate.py gather_vocab)
            st["colls"].append(("all_gather", "tp", local.numel * degrees["tp"] * 4))
    if pp > 1:   # the sampled tokens, from the last stage to every stage (broadcast_from_last)
        for st in out:
            st["colls"].append(("broadcast", "pp", batch * TOKEN_BYTES))
    return [StepCost(st["flops"], st["attn"], st["weights"], st["act"], st["ops"], tuple(st["colls"]),
                     tuple(st["kv"])) for st in out]


def _cached_per_token(cached: Sequence[TensorType]) -> int:
    """Elements one token adds to an attention core's cache on this rank: its cached
    operands (k and v; MLA's absorbed core: the latent and the RoPE key), local types,
    per (sequence, token)."""
    return sum(t.numel // (t.dim("batch").size * t.dim("seq").size) for t in cached)


def step_collective_counts(step: StepCost) -> dict[tuple[str, str, int], int]:
    """``(op, axis, bytes) -> count`` of a step's collectives (the serve program's
    ``rt.COUNTER`` keys, ``recv`` included)."""
    counts: dict[tuple[str, str, int], int] = {}
    for c in step.collectives:
        counts[c] = counts.get(c, 0) + 1
    return counts


#: host work of the serve engine beyond the graph's ops, in units of ``cluster.op_overhead``
#: (one graph op of the program's forward: config/host.py's probe). Timed on this machine
#: (2-core Xeon VM, torch 2.13, one thread, best of 5 x 200 calls) beside the probe's figure
#: (17.9 us per op then): the paged KV cache's write of a layer's new keys and values and its
#: read of their context (runtime/paged.py ``PagedKVCache.store``: index_copy_ twice, two
#: gathers, two cats; 119 us at one sequence, 135 us at 32), per attention layer
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


def engine_overhead(cfg, layers: int, first: bool, last: bool, degrees: Mapping[str, int], link,
                    per_op: float) -> float:
    """Seconds of one engine step on the critical path through a rank of a stage with
    ``layers`` decoder layers that the graph's ops do not hold (runtime/paged.py
    ``serve_requests`` / ``run_step``): on the ``first`` stage the step's plan broadcast from
    the replica's leader to its other ranks (``broadcast_plan``: one broadcast of
    :data:`~parcompile.core.model.STEP_PLAN_BYTES` over the tp x pp ranks on ``link``, timed
    as one send from the leader, as the sampled tokens' broadcast is) and the step's layout
    (:data:`STEP_LAYOUT_OPS`; a later stage lays out its step while the earlier ones
    compute); on every stage the paged cache's work per attention layer
    (:data:`PAGED_CACHE_OPS`); on the ``last`` the sampling (:data:`SAMPLE_OPS`); each op at
    ``per_op`` seconds (``cluster.op_overhead``). 0 where ``per_op`` is 0: a preset that
    does not model the host (the GPU presets) leaves the engine's host work out as it
    leaves out the ops' (module docstring)."""
    if not per_op:
        return 0.0
    ranks = degrees.get("tp", 1) * cfg.parallel.pp
    plan = collective_time("send", STEP_PLAN_BYTES, 2, link) if first and ranks > 1 else 0.0
    ops = (STEP_LAYOUT_OPS if first else 0.0) + PAGED_CACHE_OPS * layers + (SAMPLE_OPS if last else 0.0)
    return plan + ops * per_op


def step_comm(step: StepCost, last: bool, degrees: Mapping[str, int], links: Mapping) -> tuple[float, float]:
    """(tp-side seconds, pp seconds) of a step's collectives on one rank of a stage
    (``last``: the last stage), each timed by the network model on its axis' link
    (``links``: per axis, :func:`parcompile.analysis.estimate.axis_link`; an axis without
    one on tp's): a pp transfer is timed on its sender (the sampled tokens' broadcast on
    the last stage, as one send)."""
    tpc = ppc = 0.0
    for op, axis, nb in step.collectives:
        if axis == "pp":
            if op == "send" or (op == "broadcast" and last):
                ppc += collective_time("send", nb, 2, links["pp"])
        else:
            tpc += collective_time(op, nb, degrees.get(axis, 1), links.get(axis) or links["tp"])
    return tpc, ppc


def serve_report(cfg, chunks: Sequence[Sequence[int]], stage_params: Sequence, groups: Mapping,
                 graph: Graph, degrees: Mapping[str, int]) -> ServeReport:
    """Memory and time of serving ``cfg`` (a SpecConfig with a ``serve`` block).

    ``chunks``: layer ids per model chunk (``split-pipeline-stages``' result);
    ``stage_params``: the parameter report's per-stage counts (``.total``, ``.embedding``);
    ``groups``: the plan's rank groups (for which links the collectives use);
    ``graph``, ``degrees``: the sharded graph the plan compiled and its mesh: the prefill
    and decode steps are costed from its nodes (:func:`step_costs`).
    """
    m, par, cl, sv = cfg.model, cfg.parallel, cfg.cluster, cfg.serve
    tp, pp, dp = par.tp, par.pp, par.dp
    e = m.dtype_bytes
    kv_dtype = cache_dtype(cfg)
    kv_tokens = kv_bytes_per_token(cfg, chunks)
    kv_seqs = kv_bytes_per_sequence(cfg, chunks, sv.prompt_len + sv.max_new_tokens)
    kv_local, replicas_kv = cache_heads(m, tp)
    b = -(-sv.batch // dp)
    P, G = sv.prompt_len, sv.max_new_tokens
    mean_ctx = P + G / 2
    eff = efficiency(cl)
    capacity = int(cl.memory * (1 - cl.memory_reserve))
    links = {a: axis_link(cl, groups, a, eff) for a in ("tp", "pp", "ep", "expert_tp")}
    matmul_rate = eff.matmul * cl.peak_flops
    mem_rate = eff.memory * cl.hbm_bw
    per_op = getattr(cl, "op_overhead", 0.0) or 0.0
    prefill = step_costs(cfg, graph, degrees, b, P, P)
    workspace = serve_workspace(cfg, graph, degrees, *prefill_step(cfg))
    decode = step_costs(cfg, graph, degrees, b, 1, P + G // 2)   # attending the mean context

    stages = []
    keys = ["prefill_compute", "prefill_tp_comm", "prefill_pp_comm", "decode_weights", "decode_kv",
            "decode_activations", "decode_tp_comm", "decode_pp_comm"]
    if per_op:
        keys += ["prefill_overhead", "decode_overhead", "engine_overhead"]
    replica_link = links["pp"] if pp > 1 else links["tp"]
    parts = {k: 0.0 for k in keys}
    for s, ids in enumerate(stage_layers(chunks, pp)):
        layers = len(ids)
        last = s == pp - 1
        weights = stage_params[s].total * e
        kv_tok = kv_tokens[s]
        kv_cache = b * kv_seqs[s]
        work = workspace[s].total
        free = capacity - weights - work
        pf, dc = prefill[s], decode[s]
        if dc.kv_bytes_per_token != kv_tok:   # the graph's cached operands are the cache the plan holds
            raise AssertionError(f"stage {s}: the graph's attention cores cache {dc.kv_bytes_per_token} bytes per "
                                 f"token, analysis/kv.py's rule {kv_tok}")
        pf_compute = max((pf.flops + pf.attn_flops) / matmul_rate, (pf.weight_bytes + pf.act_bytes) / mem_rate)
        pf_tp, pf_pp = step_comm(pf, last, degrees, links)
        dec_w = max(dc.weight_bytes / mem_rate, (dc.flops + dc.attn_flops) / matmul_rate)
        # the cache a decode step reads at the mean context, each attention core its cached
        # operands per token; a sliding-window layer at most its window (core/model.cached_tokens)
        dec_kv = b * sum(nb * (min(mean_ctx, w) if w else mean_ctx) for w, nb in dc.kv_layers) / mem_rate
        dec_act = dc.act_bytes / mem_rate
        dec_tp, dec_pp = step_comm(dc, last, degrees, links)
        pf_ovh, dec_ovh = pf.ops * per_op, dc.ops * per_op
        eng = engine_overhead(cfg, layers, s == 0, last, degrees, replica_link, per_op)    # per step, prefill or decode
        for k, v in (("prefill_compute", pf_compute), ("prefill_tp_comm", pf_tp), ("prefill_pp_comm", pf_pp),
                     ("decode_weights", dec_w), ("decode_kv", dec_kv), ("decode_activations", dec_act),
                     ("decode_tp_comm", dec_tp), ("decode_pp_comm", dec_pp),
                     ("prefill_overhead", pf_ovh), ("decode_overhead", dec_ovh), ("engine_overhead", eng)):
            if k in parts:
                parts[k] += v
        stages.append(ServeStage(s, layers, weights, kv_tok, kv_cache, kv_seqs[s], work, free,
                                 pf_compute + pf_tp + pf_pp + pf_ovh + eng,
                                 dec_w + dec_kv + dec_act + dec_tp + dec_pp + dec_ovh + eng))
    ttft = sum(x.prefill_s for x in stages)
    tpot = sum(x.decode_s for x in stages)
    return ServeReport(tuple(stages), capacity, sv.batch, b, dp, P, G, kv_dtype, kv_local, replicas_kv,
                       ttft, tpot, parts, sv.block_size, sv.kv_cache_tokens, sv.prefix_caching,
                       sv.max_prefill_tokens, sv.compile, sv.stream_interval, sv.waiting_served_ratio,
                       sv.max_waiting_steps)


def fit_advice(cfg, rep: ServeReport, graph: Graph, degrees: Mapping[str, int]) -> list[str]:
    """What would make one sequence fit (for the error's help): more tp, more pp (the weights
    and cache split further, estimated by scaling this plan's bytes), a shorter context,
    an fp8 cache (where the devices have an FP8 type: :func:`parcompile.config.presets.fp8_storage`).
    The workspace of a suggestion is the graph's rule at its degrees (:func:`serve_workspace`
    on ``graph``, the plan's sharded graph, with tp raised; a deeper pipeline adds the
    received hidden state to the worst stage's); the rest is checked with the same formulas,
    scaled."""
    m, par = cfg.model, cfg.parallel
    worst = max(rep.stages, key=lambda s: s.weights + s.workspace + s.kv_per_sequence)
    step = prefill_step(cfg)
    out = []
    cands = []
    for tp2 in (2 ** i for i in range(1, 8)):
        t = par.tp * tp2
        if t > _MAX_TP_HINT or (m.heads % t):
            break
        more = {**degrees, "tp": t}   # (experts served with ep = 1 are split over tp in the graph)
        try:
            work = serve_workspace(cfg, graph, more, *step)[worst.stage].total
        except ShardingError:       # a dim the graph splits over tp does not divide by t
            break
        # (an MLA cache is the same on every tp rank: more tp does not shrink it)
        kv_scale = 1 if m.kv_lora_rank else kv_heads_per_rank(m.kv_heads, t) / rep.kv_heads_per_rank
        n2 = worst.weights / tp2 + work + worst.kv_per_sequence * kv_scale
        if n2 <= rep.capacity:
            cands.append(f"tp = {t}")
            break
    ws = serve_workspace(cfg, graph, degrees, *step)[worst.stage]
    deeper = max(ws.layer, ws.head) + received_bytes(cfg, *step[:2]) + ws.step   # a stage after the first
    for pp2 in range(2, 65):
        if par.pp * pp2 > m.layers:
            break
        n2 = (worst.weights + worst.kv_per_sequence) / pp2 + deeper
        if n2 <= rep.capacity:
            cands.append(f"pp = {par.pp * pp2}")
            break
    if cands:
        out.append(" or ".join(cands) + " (the weights and the cache split further)")
    room = rep.capacity - worst.weights - worst.workspace
    if room > 0 and worst.kv_bytes_per_token:
        tokens = room // worst.kv_bytes_per_token
        if tokens >= 1:
            out.append(f"a context of at most {tokens:,} tokens (prompt_len + max_new_tokens; now {rep.context:,})")
        kvb = DTYPE_BYTES[rep.kv_dtype]
        if kvb > 1 and room >= worst.kv_per_sequence // kvb and fp8_storage(cfg.cluster.preset):
            out.append("kv_dtype = fp8 (1 byte per value)")
    elif room <= 0:
        out.append(f"the weights and workspace alone need {bytes_text(worst.weights + worst.workspace)} per GPU")
    return out

