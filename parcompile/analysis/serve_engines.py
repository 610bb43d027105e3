"""The serving engines a ``serve`` plan's estimate assumes (``serve.engine``): what each one
spends per step beyond the arithmetic and the bytes of its kernels, its default scheduler
budgets and how it all-reduces a decode step's small messages. The step costs
(:mod:`parcompile.analysis.serve_steps`) and the workload's steady state
(:mod:`parcompile.analysis.serve_workload`) read them; ``docs/clusters.md`` ("Serving
engines") lists every constant with its source.

The GPU's own rates are the preset's (:mod:`parcompile.analysis.efficiency`): weights and
the KV cache stream at ``eff.memory`` of ``hbm_bw`` (the STREAM-like fraction the training
estimate uses), GEMMs at ``eff.matmul`` of the peak (FP8 GEMMs at the same fraction of the
FP8 peak), attention at the engine's attention kernel's rate. What an engine adds:

* ``step_overhead``: seconds of each engine step the GPU waits for the host (scheduling, the
  step's inputs, sampling, output processing, what CUDA graphs and asynchronous
  scheduling do not hide);
* ``op_overhead``: seconds per graph op of a step beyond its roofline time (kernel launch
  gaps inside a CUDA graph, the ramp and tail of small kernels), so a deep model's step
  costs more than its bytes;
* ``request_overhead``: seconds each request spends in the API server before its prompt
  reaches the engine and after its first token leaves it (HTTP, tokenization, the
  first token's detokenization and streaming): added to the time to first token;
* ``allreduce_latency``: seconds of one small all-reduce of a decode step inside a
  tensor-parallel group on NVLink (vLLM's and SGLang's custom all-reduce: one-shot below
  :attr:`oneshot_bytes`, two-shot to :attr:`custom_max_bytes`, NCCL above:
  :func:`parcompile.analysis.network.serve_allreduce_time`);
* ``max_num_batched_tokens``, ``max_num_seqs``: the scheduler's default token budget per
  step (chunked prefill) and sequences per step, by GPU memory where the engine decides so.
"""

from __future__ import annotations

from dataclasses import dataclass

#: GiB: vLLM's and SGLang's defaults change with the GPU's memory
_GIB = 2 ** 30


@dataclass(frozen=True)
class ServeEngine:
    """One serving engine (module docstring). Times in seconds, budgets in tokens."""

    name: str
    description: str
    step_overhead: float
    op_overhead: float
    request_overhead: float
    allreduce_latency: float
    #: the scheduler's token budget per step on a GPU of at least ``large_gpu`` bytes / below
    budget_large: int
    budget_small: int
    seqs_large: int
    seqs_small: int
    large_gpu: int
    #: custom all-reduce: one-shot below this many bytes (groups of at most 4; half for 8), two-shot up to
    #: ``custom_max_bytes[n]`` for a group of n, NCCL (or torch's symmetric-memory all-reduce, NVLS-based
    #: like NCCL's) beyond
    oneshot_bytes: int = 512 * 1024
    custom_max_bytes: tuple[tuple[int, int], ...] = ((2, 8 * 2 ** 20), (4, 8 * 2 ** 20), (6, 512 * 1024),
                                                     (8, 256 * 1024))
    #: whether the engine runs its own all-reduce for small tensor-parallel messages on NVLink
    custom_allreduce: bool = True
    #: the graph ops' host cost is the cluster's ``op_overhead`` (the parcompile engine: eager
    #: PyTorch on the host that runs the graph op by op) instead of :attr:`op_overhead`
    host_ops: bool = False
    source: str = ""

    def budget(self, memory: int, a100: bool = False) -> int:
        """The default token budget of a step (chunked prefill) on a GPU of ``memory`` bytes."""
        return self.budget_large if memory >= self.large_gpu and not a100 else self.budget_small

    def custom_limit(self, n: int) -> int:
        """Bytes below which a group of ``n`` ranks takes the engine's custom all-reduce (0: never)."""
        return dict(self.custom_max_bytes).get(n, 0) if self.custom_allreduce else 0

    def max_seqs(self, memory: int, a100: bool = False) -> int:
        """The default most sequences of a step on a GPU of ``memory`` bytes."""
        return self.seqs_large if memory >= self.large_gpu and not a100 else self.seqs_small


#: ``serve.engine`` -> :class:`ServeEngine`; the constants marked "fitted" are fitted to the
#: three calibration rows of :mod:`parcompile.analysis.serve_calibration` (issue 45) and
#: nothing else
SERVE_ENGINES: dict[str, ServeEngine] = {
    "vllm": ServeEngine(
        "vllm", "vLLM V1: CUDA graphs, chunked prefill, custom all-reduce, asynchronous output processing",
        step_overhead=1.6e-3, op_overhead=0.0, request_overhead=5.5e-3, allreduce_latency=26e-6,
        budget_large=8192, budget_small=2048, seqs_large=1024, seqs_small=256, large_gpu=70 * _GIB,
        source="budgets: vllm/engine/arg_utils.py _set_default_args (OpenAI server: 8192 tokens and 1024 "
               "sequences on GPUs of >= 70 GiB but the A100, else 2048 and 256; vllm-project/vllm @99d7eb5d6a512cfcc5a2b104f24ebf2d6cda772b); "
               "all-reduce: csrc/custom_all_reduce.cuh (one-shot below 512 KiB for <= 4 ranks, 256 KiB for 8; "
               "two-shot above; @c9eabec7), custom_all_reduce.py (8 MiB at most) and all_reduce_utils.py "
               "CUSTOM_ALL_REDUCE_MAX_SIZES for Hopper with symmetric memory on (its default: 8 MiB at 2 and 4 "
               "ranks, 512 KiB at 6, 256 KiB at 8; larger messages to torch's symmetric-memory all-reduce; @00d618aa); "
               "step_overhead 1.6 ms, allreduce_latency 26 us (op_overhead 0): fitted to the three rows of "
               "analysis/serve_calibration.py by least squares on the relative TPOT errors over a grid (t0 0-2.4 ms, "
               "0-4 us per op, 8-40 us per all-reduce): the 2024 build's Llama 3.1 8B row is 12% slower per token than "
               "vLLM 0.30.0's Qwen3-8B row on the same bytes, which no per-op or per-layer cost explains, and the "
               "70B tp 4 row's 160 all-reduces a step take ~26 us each under CUDA graphs, 3x the ~9 us vLLM's custom "
               "all-reduce takes alone at 128 KB on 4 H100s (sgl-project/sglang PR #2904's table), the "
               "synchronisation of the ranks at each one included; request_overhead 5.5 ms: the rest of the Qwen3-8B "
               "row's TTFT (p95 34.3 ms) beyond its 1,024-token prefill step"),
    "sglang": ServeEngine(
        "sglang", "SGLang: CUDA graphs, chunked prefill, overlap scheduler, custom all-reduce",
        step_overhead=1.6e-3, op_overhead=0.0, request_overhead=5.5e-3, allreduce_latency=26e-6,
        budget_large=8192, budget_small=4096, seqs_large=1024, seqs_small=256, large_gpu=60 * _GIB,
        custom_max_bytes=((2, 8 * 2 ** 20), (4, 8 * 2 ** 20), (6, 8 * 2 ** 20), (8, 8 * 2 ** 20)),
        source="budgets: python/sglang/srt/server_args.py _handle_gpu_memory_settings (chunked_prefill_size "
               "8192 on 60-160 GB GPUs, 4096 on 35-60 GB); all-reduce: its custom all-reduce adapted from "
               "vLLM's (8 MiB at most); per-step and per-request times: assumed as vllm's (no SGLang row "
               "handed to calibrate on)"),
    "parcompile": ServeEngine(
        "parcompile", "parcompile's own engine (parcompile serve): eager PyTorch, paged KV cache, continuous "
                      "batching; the host runs the graph op by op",
        step_overhead=0.0, op_overhead=10e-6, request_overhead=0.0, allreduce_latency=0.0,
        budget_large=0, budget_small=0, seqs_large=0, seqs_small=0, large_gpu=0,
        custom_allreduce=False, custom_max_bytes=(), host_ops=True,
        source="the host's cost per graph op: the cluster's op_overhead where it models the host (the cpu "
               "preset, frontend/host.py), else 10 us per op (eager PyTorch's dispatch and launch, Horace He, "
               "'Making Deep Learning Go Brrrr From First Principles', 2022: ~10 us of overhead per op); the "
               "engine's own host work per step (paged cache, layout, sampling): analysis/serve_steps.py; no "
               "token budget by default (serve.max_prefill_tokens)"),
}


def serve_engine(cfg) -> ServeEngine:
    """The :class:`ServeEngine` of a serve spec (``serve.engine``)."""
    name = cfg.serve.engine or ("parcompile" if cfg.cluster.preset == "cpu" else "vllm")
    return SERVE_ENGINES[name]


__all__ = ["SERVE_ENGINES", "ServeEngine", "serve_engine"]
