"""The validated, resolved configuration of a spec (pydantic).

This is the contract between the front end (which builds it from a parsed `.par` file,
with presets, units converted and defaults filled) and everything after it (graph,
passes, codegen). Every field is in SI base units: bytes, seconds, FLOP/s, bytes/s.

After :func:`parcompile.frontend.build.build_config` returns, no field is ``None`` where the
SPEC gives a default, and every parallel degree is a concrete integer (``dp = auto`` is
resolved to ``world_size / (tp * pp * cp)``); ``ParallelConfig.auto`` remembers which
keys the user left to the compiler.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from parcompile.config.presets import Accelerator, accelerator
from parcompile.config.text import even_split
from parcompile.core.dtypes import DTYPE_BYTES
from parcompile.core.model import ModelKeys, derived_defaults, layer_windows, padded_vocab
from parcompile.core.schedule import SUPPORTED as SUPPORTED_SCHEDULES, Schedule as PipelineSchedule, lookup as lookup_schedule
from parcompile.core.sources import BUILTIN_SOURCES  # `train.data` texts that ship with Python (the runtime reads them too)
from parcompile.diagnostics import Span

KvDtype = Literal["fp32", "bf16", "fp16", "fp8"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _model_fields() -> dict[str, tuple]:
    """pydantic's ``(type, default)`` of each model key, from the one declaration
    (:class:`parcompile.core.model.ModelKeys`'s fields, in its order): an enum key
    (``KeyCheck.choices``) as a ``Literal`` of its choices, ``Optional`` when its default
    is None; a key without a default required (``...``)."""
    hints = typing.get_type_hints(ModelKeys)
    out = {}
    for f in dataclasses.fields(ModelKeys):
        check = f.metadata.get("check")
        kind = Literal[check.choices] if check is not None and check.choices else hints[f.name]
        out[f.name] = (kind, ... if f.default is dataclasses.MISSING else f.default)
    return out


#: the fields of :class:`ModelConfig`, built from :class:`~parcompile.core.model.ModelKeys`
ModelFields = create_model("ModelFields", __base__=_Frozen, __module__=__name__, **_model_fields())


class ModelConfig(ModelFields):
    """A decoder-only transformer (SPEC 1, `model`), validated: the keys, their order,
    defaults and choices are :class:`parcompile.core.model.ModelKeys`' (documented there).
    Widths are counts, not bytes."""

    @model_validator(mode="after")
    def _fill_defaults(self) -> "ModelConfig":
        # frozen model: use object.__setattr__ to fill the derived defaults once
        # (the rule: parcompile.core.model.derived_defaults, shared with the runtime's ModelKeys)
        for k, v in derived_defaults(self.__dict__).items():
            object.__setattr__(self, k, v)
        return self

    def padded_vocab(self, tp: int) -> int:
        """Megatron-LM's rule (:func:`parcompile.core.model.padded_vocab`)."""
        return padded_vocab(self.vocab, self.vocab_multiple, tp)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's attention window in tokens, 0: full (:func:`parcompile.core.model.layer_windows`)."""
        return layer_windows(self.layers, self.sliding_window, self.sliding_window_pattern)


class ClusterConfig(_Frozen):
    """The machines (SPEC 1, `cluster`). Bandwidths are per GPU, one direction."""

    name: str = "cluster"
    preset: Optional[str] = None
    nodes: int = 1
    gpus_per_node: int = 8
    memory: int = 80 * 10**9          # bytes
    peak_flops: float = 989e12        # FLOP/s, dense, model dtype
    hbm_bw: float = 3.35e12           # bytes/s
    intra_node_bw: float = 450e9      # bytes/s
    inter_node_bw: float = 50e9       # bytes/s
    intra_node_latency: float = 5e-6  # s
    inter_node_latency: float = 10e-6 # s
    #: s of host work per graph op of a micro-batch's forward beyond its arithmetic (the
    #: eager program's Python, dispatcher and autograd; the backward counts twice): the
    #: `cpu` preset's (frontend/host.py); 0 elsewhere (analysis/estimate.py)
    op_overhead: float = 0.0
    memory_reserve: float = 0.10      # fraction of memory
    #: CPU offload (``parallel.offload``, analysis/offload.py): each GPU's link to host memory
    #: (bytes/s, one direction: PCIe Gen5 x16, 64 GB/s), the node's host memory bandwidth
    #: (bytes/s, shared by its GPUs) and host memory (bytes per node); defaults: DGX H100's
    #: (config/presets.py)
    host_link_bw: float = 64e9
    host_memory_bw: float = 614.4e9
    host_memory: int = 2 * 10**12
    #: the training engine the time estimate assumes (analysis/estimate.py ENGINES):
    #: Megatron-Core with Transformer Engine, eager PyTorch with FSDP2 (torchtitan), torchtitan
    #: with torch.compile, or NeMo AutoModel (Transformer Engine kernels with FSDP2)
    engine: Literal["megatron", "eager", "compile", "automodel"] = "megatron"
    #: where the `cpu` preset's memory, compute and bandwidth came from (frontend/host.py);
    #: None for the other presets (their datasheets, presets.py)
    figures: Optional[str] = None
    #: the network model (analysis/estimate.py Link; docs/clusters.md): GPUs that share one
    #: NVLink / NVSwitch domain (None: the node; 72 for a GB200 NVL72 rack), network adapters
    #: per node (None: one per GPU, rail-optimised; ``inter_node_bw`` is each GPU's share of
    #: them: analysis/estimate.py ``nic_share``), and whether the NVSwitches reduce and multicast (NVLink SHARP: NCCL's
    #: NVLS algorithms; H100/H200/B200 with third-generation NVSwitch or later)
    nvlink_domain: Optional[int] = None
    nics_per_node: Optional[int] = None
    nvls: bool = False
    #: PyTorch's caching allocator with expandable segments
    #: (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, as torchtitan's run_train.sh and
    #: the generated program set it): what it holds beyond the live tensors
    #: (analysis/memory.py ``allocator_bytes``)
    expandable_segments: bool = True
    #: the engine overlaps the tensor-parallel all-gathers and reduce-scatters of sequence
    #: parallelism with the GEMMs they feed or drain (Megatron-Core's ``--tp-comm-overlap``:
    #: Transformer Engine's userbuffers; ``engine = megatron``), and the interleaved pipeline's
    #: sends and receives with compute (``overlap_p2p_comm``, Megatron-Core's default with
    #: virtual stages, ``--no-overlap-p2p-communication`` turns it off): what the time estimate
    #: assumes and the Megatron exports set (analysis/estimate.py ``chunk_times``,
    #: ``pipeline_makespan``); the generated program runs them unoverlapped
    tp_comm_overlap: bool = False
    overlap_p2p_comm: bool = False

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def domain_size(self) -> int:
        """GPUs per NVLink domain: ``nvlink_domain``, else ``gpus_per_node``."""
        return self.nvlink_domain or self.gpus_per_node

    @property
    def accelerator(self) -> Accelerator:
        """The preset's software stack (config/presets.py ``ACCELERATORS``): device type,
        collective library, what the launchers set and say; NVIDIA's without a preset."""
        return accelerator(self.preset)

    @property
    def device_kind(self) -> str:
        """The torch device type programs run on: ``cpu`` (gloo), ``npu`` (Ascend, HCCL
        through torch_npu) or ``cuda`` (NVIDIA and AMD GPUs: NCCL / RCCL), from the preset."""
        return self.accelerator.device

    @property
    def is_cpu(self) -> bool:
        """True for the `cpu` preset: programs run with gloo on this machine."""
        return self.preset == "cpu"


Schedule = Literal[SUPPORTED_SCHEDULES]   # the names of parcompile.core.schedule.SCHEDULES

#: ``parallel.bucket_size`` default: 160 MB of fp32 gradients = 40M elements (Megatron-LM)
DEFAULT_BUCKET_SIZE = 160 * 10**6


class ParallelConfig(_Frozen):
    """Degrees and layout (SPEC 1, `parallel`), resolved to integers.

    ``auto`` lists the keys that were ``auto`` in the spec (resolved here anyway).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    expert_tp: Optional[int] = None
    sequence_parallel: bool = False
    zero: Literal[0, 1, 2, 3] = 0
    micro_batch: int = 1
    global_batch: Optional[int] = None
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    #: interleaved 1F1B: micro-batches per round through each local chunk (Megatron-Core's
    #: ``--microbatch-group-size-per-virtual-pipeline-stage``); None: ``pp``, its default
    #: (:mod:`parcompile.core.schedule`)
    microbatch_group_size: Optional[int] = None
    stage_layers: Optional[tuple[int, ...]] = None
    #: a mode, or a tuple of Megatron-Core's ``--recompute-modules`` names
    #: (:mod:`parcompile.core.recompute`)
    recompute: Union[Literal["none", "selective", "full"], tuple[str, ...]] = "none"
    order: str = "tp-cp-ep-dp-pp"
    #: fp32 gradient bytes per data-parallel reduction bucket (``parallel.bucket_size``):
    #: a bucket closes once it holds at least this many; 0 means one bucket per model
    #: chunk, reduced after the backward (no overlap). The default, 160 MB, is 40M fp32
    #: elements, Megatron-LM's ``--ddp-bucket-size`` default (:mod:`parcompile.analysis.buckets`)
    bucket_size: int = DEFAULT_BUCKET_SIZE
    #: dtype gradient buckets are held and reduce-scattered in when reduced per micro-batch
    #: (``parallel.reduce_dtype``; zero 2, 3): fp32 (Megatron-LM's and torchtitan's default),
    #: or the model's 16-bit dtype, added into the fp32 gradient shard
    #: (:func:`parcompile.analysis.buckets.bucket_element_bytes`)
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    #: dtype of the gradient buffers (``parallel.grad_dtype``): fp32, or bf16 as Megatron-Core's
    #: ``--grad-reduce-in-bf16`` (``DistributedDataParallelConfig.grad_reduce_in_fp32 = False``):
    #: gradients accumulated and reduced in bf16, cast to fp32 for the optimizer
    #: (:func:`parcompile.analysis.estimate.grad_element_bytes`)
    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    #: HSDP (``parallel.dp_replicate``): the data-parallel ranks form ``dp_replicate`` x
    #: ``dp_shard`` (:attr:`dp_shard`), states sharded over the shard group only and
    #: replicated over the replicate group (torchtitan's ``data_parallel_replicate_degree``;
    #: :mod:`parcompile.core.data_parallel`); 1: plain ZeRO over all of dp
    dp_replicate: int = 1
    #: CPU offload (``parallel.offload``): ``optimizer`` keeps the optimizer states (and fp32
    #: masters) in host memory and steps them on the CPU (DeepSpeed's ``offload_optimizer``,
    #: ZeRO-Offload); ``params`` also the parameters' shards (``offload_param``, FSDP2's
    #: ``CPUOffloadPolicy``); :mod:`parcompile.analysis.offload`
    offload: Literal["none", "optimizer", "params"] = "none"
    auto: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _fill_defaults(self) -> "ParallelConfig":
        if self.expert_tp is None:
            object.__setattr__(self, "expert_tp", self.tp)
        if self.global_batch is None:
            object.__setattr__(self, "global_batch", self.micro_batch * self.dp)
        return self

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def dp_shard(self) -> int:
        """HSDP's shard degree, ``dp / dp_replicate`` (``parallel.dp_shard``; dp when there is
        no replication); the checker guarantees it is whole."""
        return self.dp // self.dp_replicate

    @property
    def num_microbatches(self) -> int:
        """m = global_batch / (micro_batch * dp); the checker guarantees it is whole."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def pipeline_schedule(self) -> PipelineSchedule:
        """``schedule`` as a value (:class:`parcompile.core.schedule.Schedule`: its placement,
        virtual stages, rounds, split backward), what every reader asks instead of the name."""
        return lookup_schedule(self.schedule)

    def rank_chunks(self, r: int) -> tuple[int, ...]:
        """Pipeline rank ``r``'s model chunks in local order (``virtual_stages`` of them), by
        the schedule's placement (:class:`parcompile.core.schedule.Placement`)."""
        return self.pipeline_schedule.placement.chunks(r, self.pp, self.virtual_stages)

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel degree: ``tp * cp * dp / (expert_tp * ep)`` (parallel folding)."""
        return (self.tp * self.cp * self.dp) // (self.expert_tp * self.ep)

    def layers_per_chunk(self, layers: int) -> tuple[int, ...]:
        """Layers of each model chunk in model order (``pp * virtual_stages`` entries):
        ``stage_layers`` when set, else the even split (larger chunks first when ``layers``
        does not divide, as :func:`parcompile.passes.split_pipeline_stages.chunk_layers`
        cuts it; the compiler normally sets ``stage_layers`` for such a layout first,
        :func:`parcompile.layout_search.settle_split`)."""
        if self.stage_layers is not None:
            return tuple(self.stage_layers)
        return tuple(even_split(layers, self.pp * self.virtual_stages))


class TrainConfig(_Frozen):
    """The training workload (SPEC 1, `train`). ``lr`` is per step, ``steps`` a count."""

    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    steps: int = 10
    seed: int = 1234
    data: str = "synthetic"
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    log_every: int = 1
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    #: `model`: every GEMM in the model's dtype; `fp8`: the linear layers' GEMMs in FP8
    #: (analysis/fp8.py: which GEMMs, the recipe's casts, scales and collectives), master
    #: weights and optimizer as with `model`
    precision: Literal["model", "fp8"] = "model"
    #: the FP8 scaling recipe: `tensorwise` (one scale per tensor, torchao's default and
    #: Transformer Engine's current scaling), `rowwise` (one per row, torchao's `rowwise`),
    #: `mxfp8` (OCP microscaling, one E8M0 scale per 32 elements, on presets with `mxfp8_flops`)
    fp8_recipe: Literal["tensorwise", "rowwise", "mxfp8"] = "tensorwise"
    #: ZeRO-3 parameters all-gathered in FP8 (torchao's `enable_fsdp_float8_all_gather`,
    #: Megatron-Core's `--fp8-param-gather`): 1 byte per FP8 linear weight element, plus scales
    fp8_all_gather: bool = False
    #: decoder layers kept in 16 bits under `precision = fp8`: the first `fp8_bf16_layers_start`
    #: and the last `fp8_bf16_layers_end` (Megatron-LM's `--first-last-layers-bf16` with
    #: `--num-layers-at-start-in-bf16` / `--num-layers-at-end-in-bf16`; ir/fp8.py bf16_layers)
    fp8_bf16_layers_start: int = 0
    fp8_bf16_layers_end: int = 0
    # real training jobs (SPEC "Real training jobs"); paths are absolute once built
    #: "bytes" or a Hugging Face tokenizer (tokenizer.json or a directory holding one); a
    #: spec that names none gets its init_from directory's tokenizer when it has one
    tokenizer: str = "bytes"
    eval_data: Optional[str] = None
    text_field: str = "text"
    data_format: Literal["text", "prompt_completion", "chat"] = "text"
    init_from: Optional[str] = None
    eval_every: int = 0
    #: global batches of eval samples per evaluation; None: all of them
    eval_batches: Optional[int] = None
    hf_output: Optional[str] = None
    # LoRA (SPEC "New names"; parcompile/core/lora.py: targets, adapter shapes, tp split)
    #: `full`: every weight trains; `lora`: the weights are frozen and low-rank adapters train
    method: Literal["full", "lora"] = "full"
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    #: module names (ours such as `wq`, Hugging Face's such as `q_proj`) or `all-linear`
    lora_targets: tuple[str, ...] = ("all-linear",)
    #: hf_output holds the merged weights (and the PEFT adapter in `adapter/`), not the adapter alone
    lora_merge: bool = False


class ServeConfig(_Frozen):
    """The inference workload (SPEC 1, `serve`)."""

    batch: int = 1
    prompt_len: int = 128
    max_new_tokens: int = 128
    kv_dtype: Optional[KvDtype] = None
    weights: Optional[str] = None
    seed: int = 1234          # sampling, and the weights' initialisation when `weights` is not given
    temperature: float = 0.0  # 0: greedy decoding
    top_k: int = 0            # sample from the k likeliest tokens (0: all)
    prompt: Optional[str] = None
    block_size: int = 16      # tokens per block of the server's paged KV cache
    kv_cache_tokens: Optional[int] = None  # the server's paged cache, in tokens (None: the running batch's, at most all that fits)
    prefix_caching: bool = True  # the server shares cached prompt prefixes between requests (vLLM v1's default)
    max_prefill_tokens: Optional[int] = None  # the server's prompt tokens per step (chunked prefill; None: whole prompts)
    compile: bool = False     # the server's engine runs torch.compile'd steps, warmed up before it is ready
    stream_interval: int = 1  # the server streams a request's tokens in groups of this many (SGLang's, vLLM's)
    # when waiting requests join a running batch (text-generation-inference's router; Scheduler.admit_now);
    # defaults: huggingface/text-generation-inference launcher/src/main.rs @ 009c4e0b945b2c111368afdc2c9813c32db0a9b7
    waiting_served_ratio: float = 0.3   # TGI's --waiting-served-ratio default
    max_waiting_steps: int = 20         # TGI's --max-waiting-tokens default; 0: at once
    #: the serving engine the estimate assumes (analysis/serve_engines.py SERVE_ENGINES); the
    #: builder resolves None: `parcompile` on the `cpu` preset, `vllm` elsewhere
    engine: Optional[Literal["vllm", "sglang", "parcompile"]] = None
    #: how the weights are stored (core/quant.py): the model's dtype, or a quantized family
    weight_dtype: Literal["model", "fp8", "mxfp4", "int4"] = "model"
    #: the stored format within the family (core/quant.py FORMATS: `fp8-block`, `fp8-tensor`, ...),
    #: read from the checkpoint's quantization_config by the builder; None: the family's default
    weight_format: Optional[str] = None
    #: the `weights` checkpoint's own quantization_config gave weight_format (a server reads it as published);
    #: False when the weights are quantized on load
    quantized_checkpoint: bool = False
    #: the workload: closed-loop clients (each sends its next request when its last ends; None:
    #: `batch`), or open-loop arrivals in requests/s (math.inf: every request at once, a burst
    #: of `batch`, as vLLM's benchmark_latency and `bench serve --request-rate inf`)
    concurrency: Optional[int] = None
    request_rate: Optional[float] = None
    #: mean latency targets a sizing search must meet (s)
    ttft_target: Optional[float] = None
    tpot_target: Optional[float] = None
    #: prefill and decode on separate GPU pools (the parallel block is the decode pool; the
    #: prefill pool is `prefill_replicas` instances of `prefill_tp` GPUs), the KV cache sent
    #: from one to the other over the network
    disaggregated: bool = False
    prefill_replicas: Optional[int] = None
    prefill_tp: Optional[int] = None
    #: the serve keys given as `auto` (filled by `parcompile search`)
    auto: tuple[str, ...] = ()

    @property
    def clients(self) -> int:
        """Concurrent requests in the system: ``concurrency``, else ``batch``."""
        return self.concurrency if self.concurrency is not None else self.batch

    @property
    def burst(self) -> bool:
        """Every request arrives at once (``request_rate = inf``)."""
        return self.request_rate is not None and self.request_rate == float("inf")


class SpecConfig(_Frozen):
    """A whole spec: one model, one cluster, one layout, one workload.

    ``name`` is the spec file's stem (``"spec"`` for source text without a file name);
    ``source_dir`` the directory `from "x.json"` and `data` paths are resolved against
    (never written into plan.json). ``spans`` maps ``"block.key"`` (e.g.
    ``"parallel.tp"``) to the span of that key's value, and ``"block"`` to the block
    header, so that later stages can report errors at the user's text.
    """

    name: str = "spec"
    filename: str = "<spec>"
    source_dir: Optional[str] = None
    model: ModelConfig
    cluster: ClusterConfig
    parallel: ParallelConfig
    workload: Literal["train", "serve"] = "train"
    train: TrainConfig = Field(default_factory=TrainConfig)
    serve: Optional[ServeConfig] = None
    spans: dict[str, Span] = Field(default_factory=dict)

    def span(self, key: str) -> Span:
        """The span of ``"block.key"``, else of ``"block"``, else line 1 of the file."""
        if key in self.spans:
            return self.spans[key]
        block = key.split(".")[0]
        return self.spans.get(block, Span.unknown(self.filename))
