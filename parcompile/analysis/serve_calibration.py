"""Published GPU serving runs the serving estimate is calibrated on (issue 45): each row's
source, configuration (read from its files, with the commit), what was assumed where the
source is silent, the published figures, and the spec that plans it. The constants of
:data:`parcompile.analysis.serve_engines.SERVE_ENGINES` marked "fitted" were fitted to
these three rows and nothing else; ``benchmarks/serve_gpu.py`` prints the plan beside each.

1. vLLM's nightly performance benchmark, buildkite ``vllm/performance-benchmark`` build 9555,
   latency test ``latency_llama8B_tp1`` on H100: ``.buildkite/performance-benchmarks/tests/
   latency-tests.json`` (vllm-project/vllm @e5fd201a) runs ``meta-llama/Meta-Llama-3.1-8B-
   Instruct``, tp 1, ``load_format: dummy``, 5 warm-up and 15 timed iterations of ``vllm bench
   latency`` with its defaults (``vllm/benchmarks/latency.py`` @00cae075: input 32, output 128,
   batch 8, ``ignore_eos``, prefix caching off): one ``LLM.generate`` of 8 random prompts,
   timed end to end: 997.5 ms (7.79 ms per output token).
2. The same build, ``latency_llama70B_tp4``: Llama 3.1 70B Instruct, tp 4 on 4 H100s, the same
   workload: 2,444.5 ms (19.10 ms per output token).
3. silybench-data (GitHub ``tgarg01/silybench-data``, run
   ``20260924T125045Z_h100-80gbx1_qwen3-8b_bf16``, ``runs/.../result.json`` @893db451): vLLM
   0.30.0 (``vllm/vllm-openai:v0.30.0``), Qwen/Qwen3-8B bf16 on one H100 SXM (GCP
   a3-highgpu-1g), ``--max-model-len 16384 --gpu-memory-utilization 0.9``, no
   ``--max-num-seqs`` or ``--max-num-batched-tokens`` (vLLM's defaults); ``vllm bench serve``
   of random prompts of 1,024 tokens and 128 output tokens (``--ignore-eos``,
   ``--random-range-ratio 0``), ``--max-concurrency 1``: TTFT p95 34.3 ms, ITL median 6.89 ms
   (each the median of 3 repeats).

Assumed: Llama 3.1 8B / 70B have the ``llama3-8b`` / ``llama3-70b`` presets' shapes (3.1
changed the RoPE scaling and the context length, neither of which changes a 160-token
request's cost); the latency benchmark's ``LLM`` class budget (16,384 tokens) does not matter
for its 256 prompt tokens; its per-output-token figure is the end-to-end latency over 128
(the plan's: the last request's ``ttft + 127 tpot`` of a burst of 8, ``request_rate = inf``);
the silybench row's ITL median is a decode step (at concurrency 1 every step is one), its TTFT
p95 compared with the plan's mean TTFT (at concurrency 1 the spread is small: its p99 is 35.1
ms); ``max_model_len`` 16,384 as the model's ``seq_len``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeRow:
    """One published serving run: ``spec`` plans it; ``published`` maps a figure (``tpot``:
    seconds per output token, ``ttft``: seconds) to its value; ``metric`` how the plan's
    ``tpot`` compares (``e2e``: end-to-end latency over the output tokens)."""

    name: str
    source: str
    commit: str
    spec: str
    published: dict
    assumed: str
    metric: str = "tpot"
    #: the run's configuration, in words (from its files)
    configuration: str = ""

    def planned(self, serve: dict) -> dict:
        """The plan's figures for :attr:`published`' keys (seconds), from the plan.json
        ``serve`` section of :attr:`spec`; ``tokens_per_s`` too."""
        out = {"tpot": serve["e2e_latency"] / serve["max_new_tokens"] if self.metric == "e2e" else serve["tpot"]}
        if "ttft" in self.published:
            out["ttft"] = serve["ttft"]
        out["tokens_per_s"] = serve["tokens_per_s"]
        return out


def _spec(model: str, gpus: int, serve: str, seq: int = 8192) -> str:
    return (f'model m from "{model}" {{ seq_len = {seq} }}\n'
            f'cluster c from "h100-sxm" {{ nodes = 1, gpus_per_node = {gpus} }}\n'
            f"parallel {{ tp = {gpus} }}\nserve {{ {serve} }}\n")


_LATENCY = "batch = 8, prompt_len = 32, max_new_tokens = 128, request_rate = inf"
_BUILDKITE = "buildkite vllm/performance-benchmark build 9555 (latency-tests.json @e5fd201a)"

#: the three rows issue 45 hands over (module docstring)
SERVE_ROWS: tuple[ServeRow, ...] = (
    ServeRow("latency_llama8B_tp1", _BUILDKITE, "vllm-project/vllm@e5fd201ab77b993462f5b1cc3e55c74dc74bed95",
             _spec("llama3-8b", 1, _LATENCY), {"tpot": 997.5e-3 / 128},
             "llama3-8b's shapes for Llama 3.1 8B; the end-to-end latency of one LLM.generate of 8 prompts over 128",
             metric="e2e", configuration="meta-llama/Meta-Llama-3.1-8B-Instruct, bf16, 1 H100, tp 1, load_format "
                                         "dummy; vllm bench latency defaults: batch 8, input 32, output 128"),
    ServeRow("latency_llama70B_tp4", _BUILDKITE, "vllm-project/vllm@e5fd201ab77b993462f5b1cc3e55c74dc74bed95",
             _spec("llama3-70b", 4, _LATENCY), {"tpot": 2444.5e-3 / 128},
             "llama3-70b's shapes for Llama 3.1 70B; 4 GPUs of one node (NVLink, the custom all-reduce)",
             metric="e2e", configuration="meta-llama/Meta-Llama-3.1-70B-Instruct, bf16, 4 H100, tp 4, load_format "
                                         "dummy; vllm bench latency defaults: batch 8, input 32, output 128"),
    ServeRow("silybench qwen3-8b c1", "tgarg01/silybench-data runs/20260924T125045Z_h100-80gbx1_qwen3-8b_bf16",
             "tgarg01/silybench-data@893db45107f431f132318c8e70e0de2fb01d3c83",
             _spec("qwen3-8b", 1, "batch = 1, prompt_len = 1024, max_new_tokens = 128, concurrency = 1", seq=16384),
             {"tpot": 6.89e-3, "ttft": 34.3e-3},
             "ITL median as the decode step; TTFT p95 against the plan's mean; vLLM 0.30.0's default budget",
             configuration="vLLM 0.30.0, Qwen/Qwen3-8B bf16, 1 H100 SXM (GCP a3-highgpu-1g), --max-model-len 16384 "
                           "--gpu-memory-utilization 0.9; vllm bench serve random 1,024 in / 128 out, "
                           "--max-concurrency 1, median of 3 repeats"),
)


__all__ = ["SERVE_ROWS", "ServeRow"]
