"""Typed models of ``plan.json`` (SPEC 3, with parcompile's extensions) and its JSON Schema.

:class:`PlanJSON` is what :func:`parcompile.driver.compile_config` builds plan.json from,
section by section (:func:`plan_dict` turns it into the dict ``Plan.data`` holds and
``Plan.to_json`` writes); ``validate_plan(json.loads(text))`` checks a plan.json file. Every
model forbids keys it does not know, so a new key of the plan is a field here first. The
extensions beyond SPEC 3 are marked "extension" in the field descriptions.

:func:`json_schema` renders the published schema, ``docs/plan.schema.json``
(``parcompile schema`` prints it; ``pytest tests/test_plan_schema.py --update-goldens``
rewrites the committed file).
"""

from __future__ import annotations

import json
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from parcompile.core.axes import GROUP_AXES
from parcompile.core.schedule import SUPPORTED as SCHEDULE_NAMES

#: the ``$id`` of the published schema
SCHEMA_ID = "https://parcompile.dev/schemas/plan.schema.json"

Axis = Literal[GROUP_AXES]  # every group of the plan (parcompile.core.axes)
RankGroups = list[list[int]]


class _Strict(BaseModel):
    """Unknown keys are errors: the schema describes plan.json exactly."""

    model_config = ConfigDict(extra="forbid")


class Degrees(_Strict):
    """``degrees``: every parallel degree, resolved (``expert_tp``, ``expert_dp`` and
    ``virtual_stages`` are extensions)."""

    dp: int = Field(ge=1)
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    cp: int = Field(ge=1)
    ep: int = Field(ge=1)
    expert_tp: int = Field(ge=1, description="tensor-parallel degree inside the experts (extension)")
    expert_dp: int = Field(ge=1, description="data-parallel degree of the experts: tp*cp*dp / (expert_tp*ep) (extension)")
    virtual_stages: int = Field(ge=1, description="model chunks per pipeline rank (interleaved_1f1b)")


class Groups(_Strict):
    """``groups``: for each axis, every group of that axis as a sorted list of ranks."""

    tp: RankGroups
    cp: RankGroups
    dp: RankGroups
    pp: RankGroups
    dp_cp: RankGroups
    ep: RankGroups
    expert_tp: RankGroups
    expert_dp: RankGroups
    embedding: RankGroups = Field(description="first and last pipeline rank of each pipeline (tied embeddings)")
    dp_shard: Optional[RankGroups] = Field(
        default=None, description="HSDP (parallel.dp_replicate > 1) only: the groups states are sharded over, "
                                  "dp_shard * cp consecutive members of a dp_cp group (extension)")
    dp_replicate: Optional[RankGroups] = Field(
        default=None, description="HSDP only: the groups the shards are replicated over (extension)")


class Model(_Strict):
    """``model``: parameter counts and the model's shape (the shape keys are extensions)."""

    params: int = Field(ge=0)
    active_params: int = Field(ge=0, description="parameters one token passes through (MoE: top_k experts)")
    padded_vocab: int = Field(ge=1)
    kv_heads_per_rank: int = Field(ge=1)
    kv_head_replicas: int = Field(ge=1, description="ranks of a tp group holding the same kv head (extension)")
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    ffn_hidden: int = Field(ge=1)
    vocab: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    dtype: Literal["fp32", "bf16", "fp16"]
    tie_embeddings: bool


class Stage(_Strict):
    """One pipeline rank: ``layers`` of all its chunks; ``chunks`` (extension) one list
    per virtual stage in model order."""

    index: int = Field(ge=0)
    layers: list[int]
    chunks: list[list[int]] = Field(description="layer ids of each model chunk of this stage (extension)")
    ranks: list[int]
    params_per_rank: int = Field(ge=0)


class Action(_Strict):
    """One step of a pipeline rank's schedule (``backward_input`` / ``backward_weight``:
    the zero-bubble schedule's split backward)."""

    op: Literal["forward", "backward", "backward_input", "backward_weight",
                "recv_forward", "send_forward", "recv_backward", "send_backward"]
    microbatch: int = Field(ge=0)
    chunk: int = Field(ge=0)


class Schedule(_Strict):
    """``schedule``: the pipeline schedule and the ordered actions of every pipeline rank."""

    name: Literal[SCHEDULE_NAMES]   # parcompile.core.schedule.SCHEDULES
    num_microbatches: int = Field(ge=1)
    bubble_fraction: float = Field(ge=0)
    in_flight: list[Union[int, float]] = Field(
        description="per pipeline rank, the micro-batches in flight at its peak, counted through all of "
                    "the rank's layers (fractional with virtual stages)")
    microbatch_group_size: Optional[int] = Field(
        default=None, ge=1,
        description="interleaved_1f1b with virtual stages only: micro-batches per round through each local "
                    "chunk (parallel.microbatch_group_size, default pp; Megatron-Core's "
                    "--microbatch-group-size-per-virtual-pipeline-stage) (extension)")
    actions: list[list[Action]]


class StageMemory(_Strict):
    """Bytes per rank of one stage (the maximum over its ranks)."""

    stage: int = Field(ge=0)
    params: int = Field(ge=0)
    grads: int = Field(ge=0)
    optimizer: int = Field(ge=0)
    activations: int = Field(ge=0)
    kv_cache: int = Field(ge=0)
    buffers: int = Field(ge=0, description="temporary buffers at their peak, part of total (extension): the sum "
                                           "of buffer_parts, the larger of logits and recompute (never alive at once)")
    buffer_parts: dict[str, int] = Field(description="buffers itemised by what they hold (extension)")
    total: int = Field(ge=0)
    allocator: Optional[int] = Field(
        default=None, ge=0,
        description="what PyTorch's caching allocator holds beyond the live tensors at the stage's peak "
                    "(extension; not part of total): with expandable segments the largest buffer part, "
                    "without them the sum of the buffer parts")
    host: Optional[int] = Field(
        default=None, ge=0, description="bytes this rank keeps in host memory: parallel.offload's optimizer "
                                        "states, fp32 gradient shard and (offload = params) parameter shard; not part "
                                        "of total (extension; offloading plans only)")
    activations_per_layer: list[list[int]] = Field(
        default_factory=list,
        description="[layer, bytes] per decoder layer of the stage: what one micro-batch keeps for backward "
                    "on one rank after recomputation, as the program measures it with saved-tensor hooks "
                    "(extension; empty for serve)")


class Memory(_Strict):
    """``memory``: per stage, the peak, the usable capacity and whether the peak fits."""

    per_stage: list[StageMemory]
    peak: int = Field(ge=0)
    capacity: int = Field(ge=0)
    fits: bool
    reserved_peak: Optional[int] = Field(
        default=None, ge=0,
        description="the largest total + allocator over the stages: what torch.cuda.max_memory_reserved would "
                    "show (extension; training plans)")
    device_memory: Optional[int] = Field(default=None, ge=0, description="cluster.memory, bytes (extension)")
    host_per_node: Optional[int] = Field(
        default=None, ge=0, description="parallel.offload: the most host memory one node's ranks keep, bytes "
                                        "(the sum of their stages' host; extension; offloading plans only)")
    host_memory: Optional[int] = Field(default=None, ge=0, description="cluster.host_memory: host memory per node, "
                                                                       "bytes (extension; offloading plans only)")
    expandable_segments: Optional[bool] = Field(
        default=None, description="cluster.expandable_segments: the allocator mode the allocator term assumes "
                                  "(extension)")


class PerStep(_Strict):
    """Bytes the busiest rank of each axis sends per step (ring algorithms)."""

    tp: int = Field(ge=0)
    dp: int = Field(ge=0)
    pp: int = Field(ge=0)
    cp: int = Field(ge=0)
    ep: int = Field(ge=0)


class Collective(_Strict):
    """One row of ``comm.collectives`` (``stage``, ``phase``, ``routed``,
    ``bytes_per_row`` and ``program_bytes`` are extensions)."""

    op: Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv"]
    axis: Axis
    bytes: int = Field(ge=0, description="size of the tensor the collective produces")
    count: int = Field(ge=0, description="runs per step")
    where: str
    stage: int = Field(ge=0)
    phase: Literal["forward", "backward", "recompute", "step"]
    routed: Optional[bool] = Field(default=None, description="MoE token traffic sized by the router")
    bytes_per_row: Optional[int] = Field(default=None, ge=0, description="bytes one routed token row adds")
    program_bytes: Optional[int] = Field(
        default=None, ge=0, description="where the generated program moves another size than `bytes` (it "
                                        "gathers FP8 tp inputs in 16 bits): that size, what verify measures")


class GradBucket(_Strict):
    """One gradient bucket of a rank (parcompile/analysis/buckets.py)."""

    chunk: int = Field(ge=0, description="local chunk (virtual stage) of the pipeline rank")
    elements: int = Field(ge=1, description="fp32 gradient elements")
    units: list[str] = Field(description="its layers in gradient-ready order (output, layers.N, embedding, "
                                         "tied_embedding, tied_head)")


class StageBuckets(_Strict):
    """The gradient buckets of one rank of a stage, in launch order."""

    stage: int = Field(ge=0)
    dense: list[GradBucket] = Field(description="reduced over dp_cp")
    expert: list[GradBucket] = Field(description="MoE expert weights, reduced over expert_dp")


class GradBuckets(_Strict):
    """``comm.grad_buckets`` (extension, training only): how each rank's gradients are
    grouped for the data-parallel reduction."""

    bucket_size: int = Field(ge=0, description="fp32 gradient bytes at which a bucket closes; 0: one per chunk")
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="parallel.reduce_dtype: the dtype of the full buckets reduce-scattered per "
                            "micro-batch (zero 2, 3), added into the fp32 gradient shard")
    per_stage: list[StageBuckets]


class Comm(_Strict):
    """``comm``: bytes per axis per step and the list of collectives."""

    per_step: PerStep
    collectives: list[Collective]
    grad_buckets: Optional[GradBuckets] = None


class Compute(_Strict):
    """``compute``: FLOPs per step, matmuls only, without (model) and with (hardware)
    recomputation."""

    model_flops_per_step: int = Field(ge=0)
    hardware_flops_per_step: int = Field(ge=0)


class Breakdown(BaseModel):
    """Seconds of one step by cause; adds up to ``step_time``. The SPEC's keys are
    required; further causes (``memory_bound``, ``recompute``, ``optimizer``...) may follow."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, float]

    compute: float
    tp_comm: float
    pp_comm: float
    dp_comm: float
    bubble: float


class NetworkCollective(_Strict):
    """The algorithm the network model picks for one collective op of an axis."""

    algorithm: Literal["ring", "tree", "nvls", "nvls_tree", "alltoall", "p2p"] = Field(
        description="NCCL's algorithm: ring, tree (double binary tree across nodes), nvls (NVLink SHARP inside "
                    "a node), nvls_tree (NVLS inside, tree across nodes), alltoall, p2p (send/recv)")
    bus_bw: float = Field(ge=0, description="nccl-tests bus bandwidth at large messages, bytes/s per GPU")


class NetworkAxis(_Strict):
    """Where one axis's groups sit and what the network model gives their collectives."""

    ranks_per_node: int = Field(ge=1, description="the fewest ranks of a group on one NVLink domain (node)")
    nodes: int = Field(ge=1, description="the most NVLink domains (nodes) one group spans")
    collectives: dict[str, NetworkCollective] = Field(description="per collective op of the axis")


class Fp8Assumptions(_Strict):
    """``train.precision = fp8``: what the estimate assumed of FP8 training (parcompile/analysis/fp8.py)."""

    recipe: Literal["tensorwise", "rowwise", "mxfp8"]
    recipe_source: str
    fp8_gemms: str = Field(description="the GEMMs that run in FP8")
    bf16_gemms: str = Field(description="the GEMMs (and other matmul work) that stay in 16 bits")
    bf16_layers: list[int] = Field(default_factory=list, description="decoder layers (global indices) whose GEMMs "
                                   "all stay in 16 bits (train.fp8_bf16_layers_start / _end, Megatron-LM "
                                   "--first-last-layers-bf16)")
    fp8_peak: float = Field(gt=0, description="FLOP/s per GPU of the FP8 (or MXFP8) GEMMs at the datasheet peak")
    fp8_matmul_efficiency: float = Field(gt=0, description="achievable fraction of fp8_peak (fitted to the FP8 "
                                                           "calibration rows)")
    fp8_efficiency_source: str
    casts: str
    amax_all_reduces_tp: str = Field(description="the scalar amax all-reduces over tp (tensorwise scales of "
                                                 "tp-sharded tensors)")
    fp8_all_gather: bool = Field(description="ZeRO-3 parameter all-gathers move FP8 weights")
    tp_all_gathers: str = Field(description="what a layer's tensor-parallel all-gathers move: FP8 or 16-bit")
    saved_activations: str
    weight_copies: str


class OffloadAssumptions(_Strict):
    """``parallel.offload``: what the estimate assumed of CPU offload (parcompile/analysis/offload.py)."""

    mode: Literal["optimizer", "params"]
    pcie_down_bytes: int = Field(ge=0, description="bytes the busiest rank sends to host memory per step "
                                                   "(its gradient shard)")
    pcie_up_bytes: int = Field(ge=0, description="bytes it receives per step (its updated parameter shard; "
                                                 "offload = params: also before each all-gather)")
    pcie_down: float = Field(ge=0, description="seconds of pcie_down_bytes at host_link_bw")
    pcie_up: float = Field(ge=0, description="seconds of pcie_up_bytes at host_link_bw")
    cpu_step: float = Field(ge=0, description="seconds of the optimizer step on the CPU (memory bound, the node's "
                                              "host_memory_bw shared by its GPUs)")
    exposed: float = Field(ge=0, description="seconds the step waits for: the CPU step and the parameters' copy "
                                             "back (the breakdown's optimizer)")
    host_link_bw: float = Field(gt=0, description="cluster.host_link_bw, bytes/s per GPU and direction")
    host_memory_bw: float = Field(gt=0, description="cluster.host_memory_bw, bytes/s per node")
    overlap: str


class GemmRateAssumptions(_Strict):
    """``estimate.assumptions.gemm_rate``: the GEMM-rate model that timed the GEMMs
    (parcompile/analysis/gemm.py); where present, ``matmul_efficiency`` prices only the rest
    (the tp overlap)."""

    kernels: Literal["ampere", "hopper", "blackwell"] = Field(description="the GPU generation's kernel facts")
    sms: int = Field(gt=0, description="streaming multiprocessors the output tiles spread over")
    clock: float = Field(gt=0, description="the 16-bit GEMMs' clock in a training step over the isolated "
                                           "measurements' (eff.gemm_clock times the spec's peak over the datasheet's)")
    fp8_clock: Optional[float] = Field(default=None, gt=0, description="FP8 training only: the FP8 GEMMs' clock")
    fp8_format: Optional[str] = Field(default=None, description="FP8 training only: the FP8 GEMMs' scaling")
    source: str


class Assumptions(_Strict):
    """What the time estimate assumed (extension)."""

    matmul_efficiency: float
    memory_efficiency: float
    link_efficiency: float
    efficiency_source: str
    overlap: str
    collectives: str
    pipeline: str
    links: dict[str, Literal["intra-node", "inter-node"]] = Field(
        description="for each axis with more than one rank: whether its groups cross nodes")
    network: Optional[dict[str, NetworkAxis]] = Field(
        default=None, description="the network model per axis: ranks per node, nodes spanned, and each collective's "
                                  "algorithm and bus bandwidth (docs/clusters.md)")
    offload: Optional[OffloadAssumptions] = Field(default=None, description="parallel.offload plans only")
    gemm_rate: Optional[GemmRateAssumptions] = Field(
        default=None, description="clusters with GEMM kernel facts only: how the GEMMs were timed")
    moe_routing: Optional[str] = Field(
        default=None, description="mixture-of-experts models only: how token routing was costed")
    engine: Optional[Literal["megatron", "eager", "compile", "automodel"]] = Field(
        default=None, description="the training engine whose kernels the estimate assumes (`cluster.engine`): "
                                  "megatron = Megatron-Core with Transformer Engine, eager = eager PyTorch with "
                                  "FSDP2 (torchtitan), compile = torchtitan with torch.compile, automodel = "
                                  "NeMo AutoModel (Transformer Engine kernels, FSDP2)")
    kernels: Optional[str] = Field(default=None, description="what the engine runs, in words")
    attention_efficiency: Optional[float] = Field(
        default=None, description="fraction of the dense peak the engine's fused attention kernel reaches at "
                                  "head dim 128 (forward and backward; causal kernels skip the masked blocks)")
    elementwise_traffic: Optional[float] = Field(
        default=None, description="bytes the engine's non-matmul kernels move over the fused count")
    overlap_slowdown: Optional[float] = Field(
        default=None, description="share of an overlapped data-parallel collective's time the compute beneath "
                                  "it loses (NCCL's kernels take streaming multiprocessors)")
    expert_gemm_streams: Optional[int] = Field(
        default=None, ge=0, description="mixture-of-experts models only: how the grouped expert GEMMs run: 0, one "
                                        "grouped kernel over every local expert; s > 0, one GEMM kernel per expert "
                                        "on s streams (Transformer Engine's GroupedLinear)")
    expert_host: Optional[float] = Field(
        default=None, ge=0, description="mixture-of-experts models only: seconds the GPU waits on the host per "
                                        "local expert in each MoE layer's forward (the token dispatcher's "
                                        "device-to-host synchronisation precedes the experts' per-expert work)")
    cluster_figures: Optional[str] = Field(
        default=None, description="`cpu` preset only: where its memory, compute and bandwidth came from (this "
                                  "machine's probe, pinned by PARCOMPILE_CPU_PROBE, or the fixed figures)")
    fp8: Optional[Fp8Assumptions] = Field(
        default=None, description="`precision = fp8` only: the recipe, which GEMMs run in FP8, their rate, the "
                                  "casts and amax collectives, FP8 all-gather")


class GradReduction(_Strict):
    """One stage's bucketed data-parallel gradient reduction, as the estimate simulates it."""

    stage: int = Field(ge=0)
    buckets: int = Field(ge=0, description="dense and expert buckets reduced per step")
    seconds: float = Field(ge=0, description="time of all the buckets' collectives")
    hidden: float = Field(ge=0, description="the part overlapped with the last micro-batch's backward")
    exposed: float = Field(ge=0, description="the part after the backward ends")


class Estimate(_Strict):
    """``estimate``: step time, throughput, utilisation and the breakdown."""

    step_time: float = Field(ge=0)
    tokens_per_s: float = Field(ge=0)
    tflops_per_gpu: float = Field(ge=0)
    mfu: float = Field(ge=0)
    breakdown: Breakdown
    assumptions: Assumptions
    grad_reduction: Optional[list[GradReduction]] = Field(
        default=None, description="per stage, the gradient buckets' reduction time, hidden and exposed "
                                  "(extension, training only)")


class PrefillPoolSection(_Strict):
    """``serve.prefill_pool`` (disaggregated serve specs): the prefill instances, each
    ``tp`` GPUs, and what a prompt costs there (analysis/serve.py prefill_pool)."""

    replicas: int = Field(ge=1)
    tp: int = Field(ge=1)
    gpus: int = Field(ge=1)
    weights_bytes_per_rank: int = Field(ge=0)
    workspace_bytes_per_rank: int = Field(ge=0)
    fits: bool
    prompt_time: float = Field(ge=0, description="seconds of one prompt's prefill on an instance")
    kv_transfer_time: float = Field(ge=0, description="seconds of one prompt's KV cache to the decode pool")
    kv_transfer_bytes: int = Field(ge=0)
    max_requests_per_s: float = Field(ge=0, description="prompts per second the pool prefills at most")


class ServeWorkload(_Strict):
    """``serve.workload``: the workload whose steady state ``ttft``, ``tpot`` and ``tokens_per_s``
    are (analysis/serve_workload.py)."""

    kind: Literal["closed_loop", "open_loop", "burst"]
    concurrency: Optional[int] = Field(None, ge=1, description="closed-loop clients")
    request_rate: Optional[float] = Field(None, gt=0, description="open-loop requests per second")
    requests: Optional[int] = Field(None, ge=1, description="a burst's requests, sent at once")


class Serve(_Strict):
    """``serve`` (serve specs only): KV cache, memory and latency of the deployment."""

    batch: int = Field(ge=1)
    batch_per_replica: int = Field(ge=1)
    replicas: int = Field(ge=1)
    prompt_len: int = Field(ge=1)
    max_new_tokens: int = Field(ge=0)
    engine: Literal["vllm", "sglang", "parcompile"] = Field(
        description="the serving engine the estimate assumes (analysis/serve_engines.py)")
    weight_dtype: Literal["model", "fp8", "mxfp4", "int4"] = Field(
        description="how the weights are stored: the model's dtype or a quantized family (core/quant.py)")
    weight_format: Optional[str] = Field(None, description="the quantized weights' stored format (core/quant.py "
                                         "FORMATS: fp8-block, fp8-tensor, fp8-channel, mxfp4, int4-awq, "
                                         "int4-gptq); absent: the model's dtype")
    kv_dtype: Literal["fp32", "bf16", "fp16", "fp8"]
    kv_heads_per_rank: int = Field(ge=1)
    kv_head_replicas: int = Field(ge=1)
    kv_bytes_per_token: int = Field(ge=0, description="KV cache one token adds on the most loaded rank")
    kv_bytes_per_token_per_stage: list[int]
    kv_cache_bytes_per_rank: int = Field(ge=0)
    weights_bytes_per_rank: int = Field(ge=0)
    workspace_bytes_per_rank: int = Field(ge=0)
    max_concurrent_tokens: int = Field(ge=0)
    max_concurrent_sequences: int = Field(ge=0)
    block_size: int = Field(ge=1, description="tokens per block of the server's paged KV cache")
    kv_cache_tokens: int = Field(ge=0, description="tokens the server's paged KV cache holds (whole blocks)")
    kv_blocks: int = Field(ge=0, description="blocks of the server's paged KV cache: kv_cache_tokens / block_size")
    prefix_caching: bool = Field(True, description="the server shares cached prompt prefixes (full KV blocks) "
                                                   "between requests")
    max_prefill_tokens: Optional[int] = Field(None, ge=1, description="prompt tokens one server step may prefill "
                                              "(chunked prefill); absent: whole prompts")
    compile: Optional[bool] = Field(None, description="true: the server's engine runs its steps torch.compile'd "
                                    "(inductor, dynamic shapes), warmed up over the step layouts before it is "
                                    "ready; absent: eager")
    stream_interval: Optional[int] = Field(None, ge=1, description="the server sends a request's tokens in groups "
                                           "of this many (the first and the last at once); absent: 1, each token "
                                           "the step it is made")
    waiting_served_ratio: Optional[float] = Field(None, ge=0, description="waiting requests join a running batch "
                                                  "once they are this fraction of the running sequences (or "
                                                  "max_waiting_steps have passed, or nothing runs); absent with "
                                                  "max_waiting_steps: at once")
    max_waiting_steps: Optional[int] = Field(None, ge=0, description="the engine steps waiting requests may be "
                                             "held while a batch runs, to gather several prompts into one step; "
                                             "absent: 0, at once")
    fits: bool
    gpus: int = Field(ge=1, description="GPUs the deployment holds: the layout's world size, and a disaggregated "
                      "spec's prefill pool")
    workload: ServeWorkload
    ttft: float = Field(ge=0, description="mean time to first token of the workload's steady state (queueing "
                        "included), seconds")
    tpot: float = Field(ge=0, description="mean time per output token after the first, seconds")
    decode_tokens_per_s: float = Field(ge=0, description="tokens/s of a decode-only step of the running "
                                       "sequences, all replicas")
    tokens_per_s: float = Field(ge=0, description="output tokens/s of the workload, all replicas")
    tokens_per_s_per_user: float = Field(ge=0, description="1 / tpot: the rate one request's tokens come at")
    e2e_latency: Optional[float] = Field(None, ge=0, description="mean time from a request's send to its last "
                                         "token, seconds")
    request_throughput: Optional[float] = Field(None, ge=0, description="requests completed per second, all "
                                                "replicas")
    running: Optional[float] = Field(None, ge=0, description="sequences running in a step (mean), all replicas")
    running_limit: Optional[int] = Field(None, ge=0, description="the most sequences a step holds: batch, or "
                                         "what the KV cache holds at the mean context; all replicas")
    prefill_steps: Optional[int] = Field(None, ge=1, description="steps a request's prompt takes (chunked "
                                         "prefill: the engine's token budget per step)")
    prefill_chunk: Optional[float] = Field(None, ge=0, description="prompt tokens per chunk")
    mixed_share: Optional[float] = Field(None, ge=0, le=1, description="share of a request's decode steps that "
                                         "also prefill other requests' prompt chunks")
    prefill_pool: Optional[PrefillPoolSection] = Field(None, description="disaggregated deployments: the prefill "
                                                       "instances (the plan's layout is the decode pool)")
    breakdown: dict[str, float]


class Lora(_Strict):
    """``train.lora`` (extension, ``train.method = lora`` only): the adapters' settings."""

    rank: int = Field(ge=1, description="lora_rank: r, the inner width of A (r, in) and B (out, r)")
    alpha: float = Field(description="lora_alpha: the adapter's output is scaled by alpha / r")
    dropout: float = Field(ge=0, lt=1, description="lora_dropout: on the adapter's input")
    targets: list[str] = Field(description="the adapted linears' Hugging Face module names (PEFT's "
                               "target_modules), in layer order")
    adapted_linears: int = Field(ge=1, description="linear layers of the whole model that carry an adapter")


class Train(_Strict):
    """``train`` (extension, training plans only): what the run trains. Counts are of the
    whole model (all ranks together, no padding), not per rank."""

    method: Literal["full", "lora"] = Field(description="train.method")
    trainable_params: int = Field(ge=0, description="parameters with gradients and optimizer states: the whole "
                                  "model (full), the adapters' A and B (lora)")
    frozen_params: int = Field(ge=0, description="parameters without gradients: the base model under lora, 0 full")
    lora: Optional[Lora] = Field(default=None, description="method = lora only")


class Search(_Strict):
    """``search`` (extension, specs with ``auto`` layout keys only): the search that chose
    the layout (:func:`parcompile.layout_search.resolve`)."""

    auto: list[str] = Field(description="the parallel keys written `auto`, and a serve spec's serve keys as "
                            "`serve.KEY`, sorted")
    chosen: str = Field(description="the chosen layout's degrees, as `parcompile search` prints them")
    enumerated: int = Field(ge=0, description="layouts enumerated")
    valid: int = Field(ge=0, description="layouts the checks accept")
    fitting: int = Field(ge=0, description="valid layouts that fit memory")


class PlanJSON(_Strict):
    """A whole ``plan.json`` (format ``parcompile.plan/1``)."""

    model_config = ConfigDict(extra="forbid", title="parcompile plan.json")

    format: Literal["parcompile.plan/1"]
    version: str
    name: str = Field(description="the spec file's stem (extension)")
    workload: Literal["train", "serve"] = Field(description="extension")
    world_size: int = Field(ge=1)
    degrees: Degrees
    order: str = Field(pattern=r"^(tp|cp|ep|dp|pp)(-(tp|cp|ep|dp|pp)){4}$")
    groups: Groups
    model: Model
    stages: list[Stage]
    schedule: Schedule
    memory: Memory
    comm: Comm
    compute: Compute
    estimate: Estimate
    train: Optional[Train] = Field(default=None, description="training specs only (extension)")
    serve: Optional[Serve] = Field(default=None, description="serve specs only")
    search: Optional[Search] = Field(default=None, description="specs with `auto` layout keys only (extension)")


def plan_dict(plan: PlanJSON, key_order: dict[tuple[str, ...], list[str]] | None = None) -> dict:
    """The plan.json dict of ``plan``: the keys it was built with (a default not given,
    such as ``serve`` of a training plan or ``routed`` of a dense collective, is left out),
    each section in its model's field order, each value as its model holds it (a number
    given to a ``float`` field is a float).

    ``key_order`` maps the path of a map whose keys an analysis orders (``("comm",
    "per_step")``, ``("estimate", "breakdown")``: report.md lists them in that order) to
    that order; those maps keep it (keys it does not name follow, in the model's order).
    """
    data = plan.model_dump(exclude_unset=True)
    for path, keys in (key_order or {}).items():
        *outer, last = path
        node = data
        for k in outer:
            node = node[k]
        ordered = {k: node[last][k] for k in keys if k in node[last]}
        ordered.update((k, v) for k, v in node[last].items() if k not in ordered)
        node[last] = ordered
    return data


def validate_plan(data: dict) -> PlanJSON:
    """Validate a plan.json dict; raises :class:`pydantic.ValidationError` naming the path
    of every key that does not match."""
    return PlanJSON.model_validate(data, strict=True)


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of plan.json, from :class:`PlanJSON`."""
    schema = PlanJSON.model_json_schema(mode="validation")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID, **schema}


def json_schema_text() -> str:
    """``docs/plan.schema.json``, byte for byte: sorted keys, 2-space indent, trailing newline."""
    return json.dumps(json_schema(), sort_keys=True, indent=2) + "\n"
