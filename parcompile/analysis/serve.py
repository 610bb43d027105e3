"""The serving analysis (SPEC 1 `serve`, SPEC 3 `serve`): memory and time of a deployment
that serves a workload of requests with a KV cache, as its engine (``serve.engine``) runs.

Layout. Attention heads and the KV cache split by kv head over tp (``kv_heads / tp`` per
rank, or one kv head replicated on ``tp / kv_heads`` ranks when tp is a multiple of
kv_heads, as vLLM does); layers and their cache split over pp; dp makes independent
replicas, each running at most ``ceil(batch / dp)`` sequences at once
(``batch_per_replica``: :func:`running_limit`, with open-loop arrivals and no ``batch`` the
engine's default; the serve program and the front decode as many) and serving ``1 / dp`` of
the workload.

Memory per rank of pipeline stage ``s`` (bytes):

* weights: ``params_per_rank * dtype_bytes`` (the plan's stage parameters, padded vocab),
  the quantized ones as ``serve.weight_dtype`` stores them (:mod:`parcompile.core.quant`:
  FP8 with its scales, MXFP4 experts, INT4 groups; the embedding, the LM head, routers and
  norms stay 16-bit: :attr:`~parcompile.analysis.serve_steps.StageSteps.held`);
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
  sharded graph (:mod:`parcompile.analysis.serve_memory`; measured with torch.profiler on the
  serve program: tests/test_serve_memory.py);
* ``max_concurrent_tokens``: ``(capacity - weights - workspace) // kv_bytes_per_token``,
  the smallest over the stages: how many tokens of context fit the remaining capacity.

Time. A step of any mix of rows (decode rows, prompt chunks) is costed per stage from the
sharded graph the plan compiled (:mod:`parcompile.analysis.serve_steps`: the GEMMs' FLOPs
and the weights they read, each attention core's (query, key) pairs and the cache it reads,
the other ops' traffic, the collectives by the engine's all-reduce for their size, the
engine's fixed costs: :mod:`parcompile.analysis.serve_engines`); a replica's step passes its
pipeline stages one after another, as every token passes every stage (Pope et al. 2022,
"Efficiently Scaling Transformer Inference", section 2). The workload
(:mod:`parcompile.analysis.serve_workload`: ``concurrency`` closed-loop clients, an open-loop
``request_rate``, or a burst of ``batch`` requests) sets which steps run: TTFT, TPOT, output
tokens/s are its steady state's means, with the engine's token budget per step (chunked
prefill: ``serve.max_prefill_tokens``, else the engine's default) and queueing once
``batch_per_replica`` sequences run or the cache is full.

Multi-head latent attention is costed in the absorbed form the serve program runs (the
serving graph's, :func:`parcompile.ir.lower.mla_absorbed`; DeepSeek-V2, arXiv 2405.04434,
section 2.1.1 and appendix B; vLLM's "data-movement friendly approach" of
vllm-project/vllm ``vllm/attention/backends/mla/common.py`` at commit 15daa36e): the cache a
decode step reads is ``(c + r) * kv_bytes`` per token and layer, shared by every head.

Mixture of experts (``experts > 0``; layers ``i >= dense_layers``), served tensor parallel
as vLLM does by default (no expert parallelism: every rank holds every expert, each
expert's inner width ``f_x`` split over tp, the router replicated): a step reads only the
experts its tokens chose, at most ``min(E, tokens * top_k)`` of the E per layer (the balanced
worst case; vLLM's fused MoE kernel reads only the experts that received tokens); the graph
says so (``shard-experts``): the router replicated, a local dispatch, the experts' and the
combine's partial sums over tp, one all-reduce over tp after the sum.

Collectives are timed by the network model (algorithm and link where the group sits,
:func:`parcompile.analysis.network.collective_time`), a tensor-parallel all-reduce by the
engine's choice for its size (:func:`parcompile.analysis.network.serve_allreduce`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from parcompile.analysis.efficiency import attention_efficiency
from parcompile.analysis.estimate import axis_link, efficiency
from parcompile.analysis.kv import cache_heads, kv_bytes_per_sequence, kv_bytes_per_token, stage_layers
from parcompile.analysis.kv import kv_dtype as cache_dtype
from parcompile.analysis.memory import MemoryReport, StageMemory
from parcompile.analysis.serve_engines import SERVE_ENGINES, serve_engine
from parcompile.analysis.serve_memory import engine_budget, prefill_step, received_bytes, serve_workspace
from parcompile.analysis.serve_steps import Rates, Segment, StageSteps, Step, stage_steps
from parcompile.analysis.serve_workload import (Overloaded, PrefillPool, Workload, WorkloadTimes, disaggregated_state,
                                                steady_state)
from parcompile.config.presets import CLUSTER_PRESETS, accelerator, fp8_peak, fp8_storage
from parcompile.core.dtypes import DTYPE_BYTES
from parcompile.core.heads import kv_heads_per_rank
from parcompile.core.quant import QuantFormat, weight_format
from parcompile.core.units import bytes_text
from parcompile.ir.graph import Graph
from parcompile.ir.types import ShardingError

#: the largest tp degree suggested in a "does not fit" help line
_MAX_TP_HINT = 64

@dataclass(frozen=True)
class ServeStage:
    """One rank of pipeline stage ``stage``: bytes (module docstring)."""

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


@dataclass(frozen=True)
class ServeReport:
    """The plan's ``serve`` section and the serving memory per stage; ``times`` the
    workload's steady state on one replica (None when not one sequence fits)."""

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
    block_size: int = 16
    #: the most tokens the cache may hold, memory aside (:func:`kv_cache_limit`); None: no bound
    kv_cache_cap: int | None = None
    prefix_caching: bool = True
    max_prefill_tokens: int | None = None
    compile: bool = False
    stream_interval: int = 1
    waiting_served_ratio: float = 0.0
    max_waiting_steps: int = 0
    engine: str = "vllm"
    weight_dtype: str = "model"
    weight_format: str | None = None
    concurrency: int = 1
    request_rate: float | None = None
    times: WorkloadTimes | None = None
    prefill_pool: "PrefillSide | None" = None
    #: GPUs the deployment holds (the layout's, and a disaggregated spec's prefill pool's)
    gpus: int = 1
    #: ``(requests/s asked, requests/s carried at most, sequences a step of a replica holds)`` of an
    #: open-loop rate with no steady state
    overload: tuple[float, float, int] | None = None

    def timed(self, times: WorkloadTimes) -> "ServeReport":
        """This report with the workload's steady state."""
        return replace(self, times=times)

    @property
    def ttft(self) -> float:
        """Mean time to first token, seconds (queueing included)."""
        return self.times.ttft if self.times is not None else 0.0

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first, seconds."""
        return self.times.tpot if self.times is not None else 0.0

    @property
    def breakdown(self) -> dict[str, float]:
        """The parts of the decode step and of a request's prefill, seconds (plan.json
        ``serve.breakdown``): ``decode_weights`` (the GEMMs: their weights read, or their
        FLOPs where those take longer), ``decode_kv`` (attention: the cached context read, or
        its FLOPs), ``decode_activations``, ``decode_tp_comm``, ``decode_pp_comm``,
        ``decode_overhead`` (the engine's fixed costs) of a decode-only step of the running
        sequences; ``decode_prefill_share`` what other requests' prompt chunks add to TPOT;
        ``prefill_compute``, ``prefill_tp_comm``, ``prefill_pp_comm``, ``prefill_overhead``
        of a request's own prompt steps; ``request_overhead`` the engine's per-request time;
        ``queue`` the time a request waits before its prompt starts."""
        t = self.times
        if t is None:
            return {}
        d, p, k = t.decode_parts, t.prefill_parts, t.prefill_steps
        out = {
            "decode_weights": d.get("gemm", 0.0), "decode_kv": d.get("attention", 0.0),
            "decode_activations": d.get("activations", 0.0), "decode_tp_comm": d.get("tp_comm", 0.0),
            "decode_pp_comm": d.get("pp_comm", 0.0), "decode_overhead": d.get("overhead", 0.0),
            "decode_prefill_share": t.tpot - t.decode_step,
            "prefill_compute": k * (p.get("gemm", 0.0) + p.get("attention", 0.0) + p.get("activations", 0.0)),
            "prefill_tp_comm": k * p.get("tp_comm", 0.0), "prefill_pp_comm": k * p.get("pp_comm", 0.0),
            "prefill_overhead": k * p.get("overhead", 0.0),
            "request_overhead": self.engine_request_overhead, "queue": t.queue,
        }
        pool = self.prefill_pool
        if pool is not None:   # the prompt runs on the prefill pool, its cache crosses to the decode pool
            out.update({"prefill_compute": pool.prompt_s, "prefill_tp_comm": 0.0, "prefill_pp_comm": 0.0,
                        "prefill_overhead": 0.0, "kv_transfer": pool.transfer_s,
                        "prefill_queue": max(t.ttft - t.queue - self.engine_request_overhead - pool.prompt_s
                                             - pool.transfer_s, 0.0)})
        return out

    @property
    def engine_request_overhead(self) -> float:
        """The engine's time per request (:attr:`ServeEngine.request_overhead`), seconds."""
        return SERVE_ENGINES[self.engine].request_overhead

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the server's paged KV cache holds (``parcompile serve``; SPEC 4):
        :func:`paged_cache_tokens` of ``kv_cache_cap`` (:func:`kv_cache_limit`) and
        ``max_concurrent_tokens``."""
        return paged_cache_tokens(self.kv_cache_cap, self.max_concurrent_tokens, self.block_size)

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
    def request_tokens(self) -> int:
        """Tokens of paged cache one request takes at its longest: ``prompt_len +
        max_new_tokens`` in whole ``block_size`` blocks."""
        return -(-self.context // self.block_size) * self.block_size

    @property
    def one_sequence_fits(self) -> bool:
        """Whether one request of ``prompt_len + max_new_tokens`` tokens fits beside the
        weights and workspace on every stage, and in the paged cache's whole blocks."""
        return all(s.free_for_kv >= s.kv_per_sequence for s in self.stages) and \
            self.kv_cache_tokens >= self.request_tokens

    @property
    def batch_fits(self) -> bool:
        return all(s.free_for_kv >= s.kv_cache for s in self.stages)

    @property
    def running(self) -> float:
        """Sequences running in a step, over all replicas (the steady state's)."""
        return self.times.running * self.replicas if self.times is not None else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second while decoding: every running sequence one token each
        decode-only step, over all replicas."""
        t = self.times
        return self.running / t.decode_step if t is not None and t.decode_step > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of the workload, over all replicas."""
        t = self.times
        return t.request_rate * self.max_new_tokens * self.replicas if t is not None else 0.0

    @property
    def tokens_per_s_per_user(self) -> float:
        """Output tokens per second one request sees while it decodes: ``1 / tpot``."""
        return 1.0 / self.tpot if self.tpot > 0 else 0.0

    def memory(self) -> MemoryReport:
        """The plan's ``memory`` section for serving: weights as ``params``, the workspace as
        ``activations``, the KV cache as ``kv_cache`` (no gradients or optimizer states)."""
        per = tuple(StageMemory(s.stage, s.weights, 0, 0, s.workspace, s.kv_cache) for s in self.stages)
        peak = max(x.total for x in per)
        return MemoryReport(per, peak, self.capacity, peak <= self.capacity)

    def to_dict(self) -> dict:
        """The plan.json ``serve`` section (bytes are integers, times seconds)."""
        t = self.times
        return {
            "batch": self.batch,
            "batch_per_replica": self.batch_per_replica,
            "replicas": self.replicas,
            "prompt_len": self.prompt_len,
            "max_new_tokens": self.max_new_tokens,
            "engine": self.engine,
            "weight_dtype": self.weight_dtype,
            **({"weight_format": self.weight_format} if self.weight_format else {}),
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
            "gpus": self.gpus + (self.prefill_pool.replicas * self.prefill_pool.tp if self.prefill_pool else 0),
            "workload": self.workload_dict(),
            "ttft": self.ttft,
            "tpot": self.tpot,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_user": self.tokens_per_s_per_user,
            **({"e2e_latency": t.e2e, "request_throughput": t.request_rate * self.replicas,
                "running": self.running, "running_limit": t.running_limit * self.replicas,
                "prefill_steps": t.prefill_steps, "prefill_chunk": t.chunk, "mixed_share": t.mixed_share}
               if t is not None else {}),
            **({"prefill_pool": self.prefill_pool.to_dict()} if self.prefill_pool is not None else {}),
            "breakdown": dict(self.breakdown),
        }

    def workload_dict(self) -> dict:
        """plan.json ``serve.workload``: what the times are the steady state of."""
        if self.request_rate is None:
            return {"kind": "closed_loop", "concurrency": self.concurrency}
        if math.isinf(self.request_rate):
            return {"kind": "burst", "requests": self.concurrency}
        return {"kind": "open_loop", "request_rate": self.request_rate}



@dataclass(frozen=True)
class StepCost:
    """One uniform step (``batch`` rows of ``tokens`` new tokens attending ``context``) of one
    replica on one rank of a pipeline stage (:func:`step_costs`): ``flops`` the matmuls'
    forward FLOPs, ``attn_flops`` the attention cores' (causal), ``weight_bytes`` the weights
    the step reads, ``act_bytes`` the matmuls' operands and the other ops' traffic, ``ops``
    graph ops, ``collectives`` ``(op, axis, bytes)`` of every collective the serve program
    runs in the step on this rank, ``kv_layers`` per attention core ``(window, bytes of cache
    per token)``."""

    flops: float
    attn_flops: float
    weight_bytes: float
    act_bytes: float
    ops: int
    collectives: tuple[tuple[str, str, int], ...]
    kv_layers: tuple[tuple[int, int], ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token of context adds to this rank's cache, every layer of the stage."""
        return sum(nb for _, nb in self.kv_layers)


def gemm_recipe(fmt: QuantFormat | None) -> str:
    """The FP8 peak (:func:`parcompile.config.presets.fp8_peak`'s recipe) the GEMMs of
    ``fmt``'s weights run at where a part has it: ``tensorwise`` (FP8 W8A8: vLLM's
    ``cutlass_scaled_mm`` and block-scaled kernels), ``mxfp8`` for MXFP4 (Blackwell's MX
    tensor cores: vLLM's FlashInfer MXFP4 x MXFP8 MoE kernels)."""
    return "mxfp8" if fmt is not None and fmt.family == "mxfp4" else "tensorwise"


def quant_of(cfg) -> tuple[QuantFormat | None, bool]:
    """``(stored format of the quantized weights, whether their GEMMs run at an FP8 rate)``
    of a serve spec: FP8 W8A8 formats on a part with FP8 tensor cores (its preset has an FP8
    peak), MXFP4 on a part with MX tensor cores (an MXFP8 peak: Blackwell); weight-only
    formats and the others dequantize to 16 bits inside the kernel (Marlin, Machete, Triton's
    ``matmul_ogs`` on Hopper), at the 16-bit rate on their stored bytes."""
    sv = cfg.serve
    if sv is None:
        return None, False
    fmt = weight_format(sv.weight_dtype, sv.weight_format)
    fast = fmt is not None and (fmt.w8a8 or fmt.family == "mxfp4") and fp8_peak(cfg.cluster.preset, gemm_recipe(fmt))
    return fmt, bool(fast)


def step_costs(cfg, graph: Graph, degrees: Mapping[str, int], batch: int, tokens: int,
               context: int) -> list[StepCost]:
    """Per pipeline stage, one uniform step of ``batch`` sequences of ``tokens`` new tokens
    each attending ``context`` keys (a prefill: ``context == tokens``; a decode step:
    ``tokens == 1``), from :func:`~parcompile.analysis.serve_steps.stage_steps`' model of
    the graph (:class:`StepCost`)."""
    stages = stage_steps(cfg, graph, degrees, *quant_of(cfg))
    step = Step((Segment(batch, tokens, context - tokens),))
    return [_uniform_cost(st, step) for st in stages]


def _uniform_cost(st: StageSteps, step: Step) -> StepCost:
    t, r = step.tokens, step.rows
    f16, f8, attn = st.flops(step)
    colls = tuple((op, axis, int(round(nb * per))) for coll, per in ((st.colls_token, t), (st.colls_row, r))
                  for op, axis, nb, count in coll for _ in range(count))
    act = st.operands_token * t + st.operands_row * r + st.act_token * t + st.act_row * r \
        + sum(c.bytes_per_pair * step.pairs(c.window) for c in st.attention)
    return StepCost(f16 + f8, attn, st.weights_read(t), act, st.ops, colls, st.kv_layers)


def step_collective_counts(step: StepCost) -> dict[tuple[str, str, int], int]:
    """``(op, axis, bytes) -> count`` of a step's collectives (the serve program's
    ``rt.COUNTER`` keys, ``recv`` included)."""
    counts: dict[tuple[str, str, int], int] = {}
    for c in step.collectives:
        counts[c] = counts.get(c, 0) + 1
    return counts


def serve_rates(cfg, groups: Mapping | None, degrees: Mapping[str, int], fp8_gemm: bool, links: Mapping | None = None) -> Rates:
    """The rates a replica of ``cfg`` runs its steps at (:class:`~parcompile.analysis.
    serve_steps.Rates`): GEMMs at ``eff.matmul`` of the peak (quantized FP8 W8A8 GEMMs at the
    same fraction of the preset's FP8 peak, scaled as ``peak_flops`` is), attention at the
    engine's fused kernel's fraction (the host's GEMM rate for the parcompile engine), the
    weights and the cache at ``eff.memory`` of ``hbm_bw``; the links of the plan's groups;
    the engine's per-op time (the host's ``cluster.op_overhead`` for the parcompile engine
    where the preset models the host). ``links``: per axis, where the groups fall, when
    ``groups`` are not built (the sizing search: :func:`~parcompile.analysis.network.links_of`)."""
    cl = cfg.cluster
    eff = efficiency(cl)
    eng = serve_engine(cfg)
    if links is None:
        links = {a: axis_link(cl, groups, a, eff) for a in ("tp", "pp", "ep", "expert_tp")}
    gemm = eff.matmul * cl.peak_flops
    fp8 = gemm
    if fp8_gemm:
        preset = CLUSTER_PRESETS.get(cl.preset or "")
        base = preset.peak_flops[cfg.model.dtype] if preset is not None else cl.peak_flops
        fp8 = eff.matmul * fp8_peak(cl.preset, gemm_recipe(quant_of(cfg)[0])) * cl.peak_flops / base
    attention = gemm if eng.host_ops else attention_efficiency(cl) * cl.peak_flops
    per_op = (getattr(cl, "op_overhead", 0.0) or eng.op_overhead) if eng.host_ops else eng.op_overhead
    return Rates(gemm, fp8, attention, eff.memory * cl.hbm_bw, links, dict(degrees), eng, per_op,
                 host=eng.host_ops, nccl=accelerator(cl.preset).collectives in ("NCCL", "RCCL"),
                 replica_ranks=degrees.get("tp", 1) * cfg.parallel.pp)


def step_seconds(stages: Sequence[StageSteps], rates: Rates, step: Step) -> tuple[float, dict[str, float]]:
    """Seconds of ``step`` through a replica's stages, one after another, and its parts
    summed over the stages."""
    parts: dict[str, float] = {}
    for st in stages:
        for k, v in st.time(step, rates).items():
            parts[k] = parts.get(k, 0.0) + v
    return sum(parts.values()), parts


#: sequences a step of the parcompile engine holds under open-loop arrivals when the spec gives
#: no ``batch`` (vLLM's default ``max_num_seqs`` below 70 GiB)
OPEN_LOOP_SEQS = 256


def running_limit(cfg, dp: int) -> int:
    """The most sequences a step of one of ``dp`` replicas holds: ``ceil(batch / dp)``; with
    open-loop arrivals and no ``batch`` given, the engine's default (vLLM's ``max_num_seqs``:
    :meth:`~parcompile.analysis.serve_engines.ServeEngine.max_seqs`)."""
    sv = cfg.serve
    rate = sv.request_rate
    if rate is not None and not math.isinf(rate) and "serve.batch" not in cfg.spans:
        cl = cfg.cluster
        return serve_engine(cfg).max_seqs(cl.memory, a100=(cl.preset or "").startswith("a100")) or OPEN_LOOP_SEQS
    return -(-sv.batch // dp)


def kv_cache_limit(cfg, dp: int) -> int:
    """The most tokens the server's paged KV cache of one of ``dp`` replicas holds, memory
    aside: the spec's ``kv_cache_tokens`` when given, else what the running sequences can
    use at once, :func:`running_limit` sequences of ``prompt_len + max_new_tokens`` tokens
    each rounded up to whole ``block_size`` blocks (blocks beyond it would only keep finished
    requests' prefixes). Issue 47: the default had been all the memory left, 38,690,561
    tokens for a 107k-parameter model on the `cpu` preset (a 19 GB rank). vLLM sizes its
    GPU cache by memory alone (``get_num_blocks``: available memory // page size; and
    ``check_enough_kv_cache_memory``: one ``max_model_len`` request must fit;
    vllm-project/vllm vllm/v1/core/kv_cache_utils.py @ 001cabc1be16a59a70d720ed61a13b678c060a18)
    and its CPU cache to 4 GiB unless ``VLLM_CPU_KVCACHE_SPACE`` says otherwise
    (vllm/platforms/cpu.py @ 0031bf29e940804ee8235f2b2da9536556f231e6); the bound here
    holds every running sequence at its longest, so the scheduler never preempts."""
    sv = cfg.serve
    if sv.kv_cache_tokens is not None:
        return sv.kv_cache_tokens
    return running_tokens(cfg, dp)


def running_tokens(cfg, dp: int) -> int:
    """Tokens of paged cache the running sequences of one of ``dp`` replicas take at their
    longest (:func:`kv_cache_limit`'s default): :func:`running_limit` sequences of
    ``prompt_len + max_new_tokens`` tokens, each in whole ``block_size`` blocks,
    ``seqs * ceil(context / block_size) * block_size``."""
    sv = cfg.serve
    return running_limit(cfg, dp) * -(-(sv.prompt_len + sv.max_new_tokens) // sv.block_size) * sv.block_size


def paged_cache_tokens(limit: int | None, memory_tokens: int, block_size: int) -> int:
    """Tokens of the paged KV cache the plan gives the server (plan.json
    ``serve.kv_cache_tokens``; ``kv_blocks`` = this / ``block_size`` is what each rank
    allocates): ``limit`` (:func:`kv_cache_limit`; None: none) and at most the
    ``memory_tokens`` that fit beside the weights and workspace, rounded down to whole
    blocks."""
    tokens = memory_tokens if limit is None else min(limit, memory_tokens)
    return max(tokens, 0) // block_size * block_size


def replica_workload(cfg, kv_tokens: int, dp: int) -> Workload:
    """One replica's :class:`~parcompile.analysis.serve_workload.Workload` of serve spec
    ``cfg`` (its ``kv_tokens`` of cache): ``1 / dp`` of the clients or of the rate, at most
    ``ceil(batch / dp)`` sequences a step, the token budget ``serve.max_prefill_tokens`` or
    the engine's default for the GPU's memory (none for the parcompile engine: whole
    prompts), the engine's time per request. With open-loop arrivals and no ``batch`` given,
    a step holds as many sequences as the engine's default (vLLM's ``max_num_seqs``)."""
    sv = cfg.serve
    eng = serve_engine(cfg)
    budget = sv.max_prefill_tokens or engine_budget(cfg)
    rate = sv.request_rate
    max_seqs = running_limit(cfg, dp)
    return Workload(prompt=sv.prompt_len, output=sv.max_new_tokens, clients=sv.clients / dp,
                    rate=None if rate is None else (rate if math.isinf(rate) else rate / dp),
                    max_seqs=max_seqs, kv_tokens=kv_tokens, budget=budget, block_size=sv.block_size,
                    request_overhead=eng.request_overhead)


def serve_report(cfg, chunks: Sequence[Sequence[int]], groups: Mapping,
                 graph: Graph, degrees: Mapping[str, int], prefill: tuple | None = None) -> ServeReport:
    """Memory and time of serving ``cfg`` (a SpecConfig with a ``serve`` block).

    ``chunks``: layer ids per model chunk (``split-pipeline-stages``' result);
    ``groups``: the plan's rank groups (for which links the collectives use);
    ``graph``, ``degrees``: the sharded graph the plan compiled and its mesh: the steps are
    costed from its nodes (:func:`~parcompile.analysis.serve_steps.stage_steps`);
    ``prefill``: with ``serve.disaggregated``, the prefill instance's ``(config, graph,
    degrees, groups)`` (:func:`prefill_config`, compiled by the driver):
    the steady state is then :func:`~parcompile.analysis.serve_workload.disaggregated_state`'s.

    Raises ValueError when not one sequence fits the cache (the driver reports it first)."""
    m, par, cl, sv = cfg.model, cfg.parallel, cfg.cluster, cfg.serve
    tp, pp, dp = par.tp, par.pp, par.dp
    kv_dtype = cache_dtype(cfg)
    kv_tokens = kv_bytes_per_token(cfg, chunks)
    kv_seqs = kv_bytes_per_sequence(cfg, chunks, sv.prompt_len + sv.max_new_tokens)
    kv_local, replicas_kv = cache_heads(m, tp)
    b = running_limit(cfg, dp)   # the sequences a step holds: the program and the front decode as many
    capacity = int(cl.memory * (1 - cl.memory_reserve))
    fmt, fp8_gemm = quant_of(cfg)
    steps = stage_steps(cfg, graph, degrees, fmt, fp8_gemm)
    workspace = serve_workspace(cfg, graph, degrees, *prefill_step(cfg))
    stages = []
    for s, ids in enumerate(stage_layers(chunks, pp, par.pipeline_schedule.placement)):
        if steps[s].kv_bytes_per_token != kv_tokens[s]:   # the graph's cached operands are the cache the plan holds
            raise AssertionError(f"stage {s}: the graph's attention cores cache {steps[s].kv_bytes_per_token} bytes "
                                 f"per token, analysis/kv.py's rule {kv_tokens[s]}")
        weights = steps[s].held_bytes   # the graph's parameters held by the stage, quantized ones as stored
        work = workspace[s].total
        stages.append(ServeStage(s, len(ids), weights, kv_tokens[s], b * kv_seqs[s], kv_seqs[s], work,
                                 capacity - weights - work))
    report = ServeReport(tuple(stages), capacity, sv.batch, b, dp, sv.prompt_len, sv.max_new_tokens, kv_dtype,
                         kv_local, replicas_kv, block_size=sv.block_size, kv_cache_cap=kv_cache_limit(cfg, dp),
                         prefix_caching=sv.prefix_caching, max_prefill_tokens=sv.max_prefill_tokens,
                         compile=sv.compile, stream_interval=sv.stream_interval,
                         waiting_served_ratio=sv.waiting_served_ratio, max_waiting_steps=sv.max_waiting_steps,
                         engine=serve_engine(cfg).name, weight_dtype=sv.weight_dtype,
                         weight_format=fmt.name if fmt is not None else None, concurrency=sv.clients,
                         request_rate=sv.request_rate, gpus=par.world_size)
    if not report.one_sequence_fits:
        return report   # the driver's error says what would fit
    rates = serve_rates(cfg, groups, degrees, fp8_gemm)
    work = replica_workload(cfg, report.kv_cache_tokens, dp)
    decode = lambda step: step_seconds(steps, rates, step)   # noqa: E731
    try:
        if sv.disaggregated and prefill is not None:
            pool, side = prefill_pool(cfg, *prefill)
            return replace(report.timed(disaggregated_state(work, pool, decode, replicas=dp)), prefill_pool=side)
        return report.timed(steady_state(work, decode))
    except Overloaded as e:   # an open-loop rate above what the deployment carries: the driver's error says so
        return replace(report, overload=(e.rate * (1 if sv.disaggregated else dp),
                                         e.capacity * (1 if sv.disaggregated else dp), e.limit))


def prefill_config(cfg):
    """The config of one prefill instance of a disaggregated serve spec: ``prefill_tp`` GPUs
    (default ``tp``), one stage, ``prefill_replicas`` instances (default 1) as its dp, the
    cluster sized to them."""
    sv, par = cfg.serve, cfg.parallel
    tp, n = sv.prefill_tp or par.tp, sv.prefill_replicas or 1
    gpn = min(cfg.cluster.gpus_per_node, tp * n)
    cl = cfg.cluster.model_copy(update={"gpus_per_node": gpn, "nodes": -(-tp * n // gpn)})
    p = par.model_copy(update={"tp": tp, "pp": 1, "dp": n, "stage_layers": None, "expert_tp": tp})
    budget = sv.max_prefill_tokens or engine_budget(cfg) or sv.prompt_len
    per = max(1, budget // sv.prompt_len)   # the prompts one budget step of an instance holds
    return cfg.model_copy(update={"parallel": p, "cluster": cl,
                                  "serve": sv.model_copy(update={"disaggregated": False, "batch": n * per})})


@dataclass(frozen=True)
class PrefillSide:
    """plan.json ``serve.prefill_pool`` of a disaggregated deployment (bytes, seconds)."""

    replicas: int
    tp: int
    weights: int
    workspace: int
    capacity: int
    prompt_s: float
    transfer_s: float
    transfer_bytes: int
    requests_per_s: float

    @property
    def fits(self) -> bool:
        return self.weights + self.workspace <= self.capacity

    def to_dict(self) -> dict:
        return {"replicas": self.replicas, "tp": self.tp, "gpus": self.replicas * self.tp,
                "weights_bytes_per_rank": self.weights, "workspace_bytes_per_rank": self.workspace,
                "fits": self.fits, "prompt_time": self.prompt_s, "kv_transfer_time": self.transfer_s,
                "kv_transfer_bytes": self.transfer_bytes, "max_requests_per_s": self.requests_per_s}


def prefill_pool(cfg, pcfg, graph: Graph, degrees: Mapping[str, int],
                 groups: Mapping) -> tuple[PrefillPool, PrefillSide]:
    """The prefill side of disaggregated ``cfg`` (``pcfg``: :func:`prefill_config`, compiled
    to ``graph`` on ``degrees`` with ``groups``): one prompt's chunks
    at the engine's budget alone on an instance, a step of the budget's tokens (the
    instance's throughput under load: several prompts' chunks at once), the prompt's KV cache
    (every layer's, every kv head: :func:`~parcompile.analysis.kv.kv_bytes_per_sequence` at
    tp 1) sent by the instance's ``tp`` ranks, each over its own NIC (NVLink when the whole
    deployment is one node: ``inter_node_latency + bytes / (tp * inter_node_bw * eff.net)``),
    and its memory: weights, the budget step's workspace."""
    fmt, fp8 = quant_of(pcfg)
    steps = stage_steps(pcfg, graph, degrees, fmt, fp8)
    rates = serve_rates(pcfg, groups, degrees, fp8)
    workspace = serve_workspace(pcfg, graph, degrees, *prefill_step(pcfg))[0].total
    return prefill_pool_from(cfg, pcfg, steps, rates, workspace)


def prefill_pool_from(cfg, pcfg, steps: Sequence[StageSteps], rates: Rates,
                      workspace: int) -> tuple[PrefillPool, PrefillSide]:
    """:func:`prefill_pool` from the prefill instance's step costs, rates and workspace."""
    sv, cl = cfg.serve, cfg.cluster
    P = sv.prompt_len
    budget = sv.max_prefill_tokens or engine_budget(pcfg) or P
    k = max(1, math.ceil(P / budget))
    chunk = P / k
    prompt_s = sum(step_seconds(steps, rates, Step((Segment(1, chunk, j * chunk),)))[0] for j in range(k))
    if budget >= P:
        step_tokens = (budget // P) * P
        step_s = step_seconds(steps, rates, Step((Segment(budget // P, P, 0),)))[0]
    else:
        step_tokens, step_s = chunk, prompt_s / k
    one = pcfg.model_copy(update={"parallel": pcfg.parallel.model_copy(update={"tp": 1, "dp": 1})})
    nbytes = kv_bytes_per_sequence(one, [list(range(cfg.model.layers))], P)[0]
    eff = efficiency(cl)
    tp = pcfg.parallel.tp
    whole = pcfg.parallel.world_size + cfg.parallel.world_size <= cl.gpus_per_node
    transfer = (cl.intra_node_latency + nbytes / (tp * cl.intra_node_bw * eff.link)) if whole else \
        (cl.inter_node_latency + nbytes / (tp * cl.inter_node_bw * eff.net))
    weights = steps[0].held_bytes
    replicas = pcfg.parallel.dp
    pool = PrefillPool(replicas, prompt_s, step_s, step_tokens, transfer)
    side = PrefillSide(replicas, tp, weights, workspace, int(cl.memory * (1 - cl.memory_reserve)), prompt_s,
                       transfer, nbytes, replicas * step_tokens / (P * step_s))
    return pool, side

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

