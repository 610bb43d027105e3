"""The achievable rates of a cluster and what its training engine does (the estimate's
assumptions, plan.json ``estimate.assumptions``): :class:`Efficiency`, the fractions of a
GPU's datasheet numbers each preset reaches (:data:`EFFICIENCY`, with their sources), and
:class:`Engine`, what each ``cluster.engine`` changes beyond them (:data:`ENGINES`). The
step-time estimate (:mod:`parcompile.analysis.estimate`), the network model
(:mod:`parcompile.analysis.network`) and the serving analysis read them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of a GPU's datasheet numbers: ``matmul`` of ``peak_flops``
    for the arithmetic of large dense GEMMs in training (the operand and weight traffic is
    timed apart, :func:`~parcompile.analysis.estimate.chunk_times`), ``memory`` of ``hbm_bw`` for streaming kernels,
    ``link`` of the NVLink bandwidth NCCL's rings reach (nccl-tests bus bandwidth), ``net``
    and ``nvls`` for the network and NVLink SHARP (:class:`~parcompile.analysis.network.Link`);
    ``attention`` and ``attention_fa2`` of ``peak_flops`` for a causal fused attention
    core, forward and backward together (three times the forward's FLOPs over their
    time): the fused kernel Megatron-Core runs (Transformer Engine's cuDNN / FlashAttention-3
    kernels) and PyTorch's SDPA (FlashAttention-2), what eager engines run."""

    matmul: float
    memory: float
    link: float
    source: str
    attention: float = 0.45
    attention_fa2: float = 0.45
    #: the share of an overlapped collective's time the compute beneath it loses: NCCL's
    #: ring kernels occupy up to 32 channels, one streaming multiprocessor each, and
    #: the GEMMs run on the others meanwhile (:func:`~parcompile.analysis.estimate.dp_exposed`)
    overlap: float = 0.24
    #: ``peak_flops / (4 x exponentials per second)``: the head dim at which a fused
    #: attention kernel's softmax exponentials (one per score, on the special-function
    #: units) take as long as its matmuls (4 x head_dim FLOPs per score); ``attention``
    #: and ``attention_fa2`` are measured at head dim 128 (:func:`~parcompile.analysis.estimate.chunk_times`)
    softmax_dim: float = 63.0
    #: the network model (:class:`~parcompile.analysis.network.Link`): ``net`` of ``inter_node_bw`` a GPU's rail NIC
    #: carries in NCCL's collectives (a NDR 400 Gb/s ConnectX-7 46-49 of 50 GB/s); ``nvls``
    #: of ``intra_node_bw``: the NVLS (NVLink SHARP) all-reduce's algorithm bandwidth where
    #: the cluster has it (``cluster.nvls``); ``link`` is the ring's bus bandwidth on NVLink
    net: float = 0.94
    nvls: float = 0.0
    #: ``train.precision = fp8`` (:mod:`parcompile.analysis.fp8`): the achievable fraction of
    #: the FP8 peak of the FP8 GEMMs' arithmetic, tensorwise and MXFP8 (``fp8``) and rowwise
    #: (``fp8_rowwise``: torchao's rowwise-scaled GEMM and its column-wise casts); fitted to
    #: the FP8 rows of :mod:`parcompile.analysis.calibration` only (FP8 GEMMs reach a lower
    #: share of their peak than 16-bit ones): the h100-sxm's, which every preset takes until
    #: FP8 rows of its own are handed
    fp8: float = 0.51
    fp8_rowwise: float = 0.32
    #: presets with GEMM kernel facts (:data:`parcompile.analysis.gemm.GENERATION`): the clock a
    #: training step's GEMMs sustain over the isolated measurements the GEMM-rate model is
    #: calibrated on (:func:`parcompile.analysis.gemm.gemm_pricer`: the power and thermal limits
    #: under a whole step's load, the other kernels' and the collectives' share of the SMs and
    #: L2), 16-bit (``gemm_clock``) and FP8 (``fp8_clock``, ``fp8_rowwise_clock``); the step
    #: estimate's GEMMs, where ``matmul``, ``fp8`` and ``fp8_rowwise`` stay the flat rule's
    #: fractions of the peak (presets without kernel facts, the serving model, the tp overlap)
    gemm_clock: float = 0.597
    fp8_clock: float = 0.582
    fp8_rowwise_clock: float = 0.52
    gemm_source: str = (
        "gemm_clock: fitted to the handed H100 rows of analysis/calibration.py H100_ROWS over the GEMM-rate "
        "model of analysis/gemm.py (hopper: 825 of 989 TFLOP/s for MAMF's best bf16 shape): 0.597, the value "
        "that minimises the largest error plus 0.3 times the mean (every row within 6%: the torchtitan 70B "
        "FSDP+TP row at +5.9%, the 8B at -6.0%); fp8_clock, fp8_rowwise_clock: fitted the same way to the FP8 "
        "rows (FP8_ROWS; tensorwise at 0.83 of the FP8 peak isolated, rowwise at 0.55: torchao's "
        "rowwise-scaled CUTLASS GEMM): 0.582 and 0.52; presets other than the h100-sxm take its values (no rows "
        "of their own)")
    fp8_source: str = (
        "fp8, fp8_rowwise: fitted on the h100-sxm to the torchtitan float8 rows (asyncTP_llama3_h100_2025-06 at "
        "2887250, Llama 3.1 70B and 8B, vanilla TP; analysis/calibration.py FP8_ROWS): 0.51 (tensorwise) and 0.32 "
        "(rowwise) of the FP8 peak, against the bf16 GEMMs' 0.67 of theirs; other presets take the h100-sxm's "
        "(no FP8 row of their own)")


@dataclass(frozen=True)
class Engine:
    """What the training engine the estimate assumes does beyond the GPU's rates
    (``cluster.engine``; plan.json ``estimate.assumptions.engine``):

    * ``elementwise``: bytes its non-matmul kernels move over the fused count of
      ``OpSpec.traffic`` (1: one kernel per norm, activation, RoPE, residual add and loss);
    * ``attention``: the rate class of its attention kernels (``"fused"``: :attr:`Efficiency.attention`,
      ``"fa2"``: :attr:`Efficiency.attention_fa2`); which kernel each attention variant runs, and
      its speed relative to this rate, is :data:`parcompile.core.attention.ATTENTION_KERNELS`;
    * ``expert_gemm_streams``: how its grouped expert GEMMs run
      (:func:`parcompile.analysis.gemm.grouped_gemm_seconds`): 0, one grouped kernel schedules
      every local expert's tiles together; ``s > 0``, one GEMM kernel per local expert, round-robin
      on ``s`` streams (Transformer Engine's ``GroupedLinear`` in 16-bit);
    * ``expert_host``: seconds the GPU waits on the host per local expert in each MoE layer's
      forward: the token dispatcher's device-to-host synchronisation (the row counts the
      all-to-all's split sizes and the per-expert GEMMs need) empties the queue before the
      experts, whose per-expert work the host then launches while the GPU waits
      (:func:`~parcompile.analysis.estimate.chunk_times`, in ``ep_comm``); in seconds, so
      it neither shrinks on a faster GPU nor with more tokens;
    * ``sac``: what ``recompute = selective`` recomputes: ``"core"`` (Megatron-LM's: the
      attention core, Korthikanti et al. 2022) or ``"op"`` (torchtitan's op-level policy,
      :func:`parcompile.analysis.compute.op_sac`);
    * ``fsdp2``: ZeRO-3 runs as FSDP2, which copies each all-gather's output and each
      reduce-scatter's input through a flat buffer on the compute stream (:func:`~parcompile.analysis.estimate.step_sums`);
    * ``fsdp2_shard_bytes``: what FSDP2's shards are kept in (:attr:`fsdp2_state_bytes`);
    * ``fp32_loss``: the loss upcasts the logits to fp32 (torchtitan's
      ``cross_entropy(pred.float(), ...)``), an fp32 copy beside them
      (:func:`parcompile.analysis.memory.buffer_bytes`);
    * ``dedup_dispatch``: the expert-parallel all-to-alls move a token once per
      destination rank (DeepEP), :func:`~parcompile.analysis.estimate.routed_share` of the per-expert rows;
    * ``step_grads_in_reduce_dtype``: its gradient buffers that accumulate a step (zero 0
      and 1) are held and reduced in ``parallel.reduce_dtype``, not fp32
      (:func:`~parcompile.analysis.estimate.grad_element_bytes`);
    * ``description`` and ``source``: what it stands for, and why these numbers."""

    name: str
    elementwise: float
    attention: str
    expert_gemm_streams: int
    expert_host: float
    description: str
    source: str
    sac: str = "core"
    fsdp2: bool = False
    fp32_loss: bool = False
    #: under FSDP2, bytes per element of the sharded parameters, gradients and optimizer
    #: states (:func:`parcompile.analysis.memory.state_bytes`): 4 for an fp32 model
    #: (torchtitan), 2 for a bf16 one (NeMo AutoModel)
    fsdp2_shard_bytes: int = 4
    #: the token dispatcher sends a token once per destination rank and combines its
    #: experts' outputs there (DeepEP), not once per chosen expert (:func:`~parcompile.analysis.estimate.routed_share`)
    dedup_dispatch: bool = False
    #: the buffers accumulating a step's gradients are in the reduce dtype (Megatron-Core's
    #: grad buffer: ``param.dtype`` unless ``grad_reduce_in_fp32``; :func:`~parcompile.analysis.estimate.grad_element_bytes`)
    step_grads_in_reduce_dtype: bool = False

    @property
    def fsdp2_state_bytes(self) -> int:
        """Bytes per element of FSDP2's sharded states under this engine, 0 without FSDP2
        (``state_bytes(..., fsdp2=)``)."""
        return self.fsdp2_shard_bytes if self.fsdp2 else 0


#: Transformer Engine's 16-bit ``GroupedLinear`` runs one cuBLAS GEMM per expert, GEMM ``i`` on
#: compute stream ``i % nvte_get_num_compute_streams()`` (NVIDIA/TransformerEngine d0067d0,
#: transformer_engine/common/gemm/cublaslt_gemm.cu ``multi_stream_cublas_gemm``, the default of
#: ``nvte_multi_tensor_gemm`` unless NVTE_USE_CUTLASS_GROUPED_GEMM; common/util/multi_stream.cpp:
#: 4 streams)
TE_GEMM_STREAMS = 4
#: :attr:`Engine.expert_host` of the ``megatron`` engine, seconds per local expert per MoE layer
#: forward. The mechanism: Megatron-Core's all-to-all token dispatcher copies the row counts to
#: the host and synchronises in every MoE layer's forward (NVIDIA/Megatron-LM d98e8a6,
#: megatron/core/transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher.preprocess:
#: ``cuda_sync_point = "before_ep_alltoall"`` with ep or tp > 1, else ``"before_finish"``;
#: ``_maybe_dtoh_and_synchronize``), before the experts, whose work the host issues expert by
#: expert: Transformer Engine's GroupedLinear splits its input by the host list ``m_splits`` and
#: launches one cuBLAS GEMM per expert per matrix (TE_GEMM_STREAMS), and Megatron's
#: ``TEGroupedMLP._apply_bias`` adds a biased model's fc2 bias expert by expert (torch.split, a
#: multiply and an add per expert, torch.cat: megatron/core/transformer/moe/experts.py at
#: d98e8a6); the Megatron-Bridge recipes run without CUDA graphs. The value is fitted to the
#: Megatron-Bridge GPT-OSS 120B H100 row (analysis/calibration.py, the one handed Megatron MoE
#: row: 16 local experts), not measured: it stands for the whole host-bound part of the MoE
#: layer that the row shows beyond its GEMMs, permutations and all-to-alls
MEGATRON_EXPERT_HOST = 0.34e-3

#: ``cluster.engine`` -> :class:`Engine`
ENGINES: dict[str, Engine] = {
    "megatron": Engine(
        "megatron", 1.0, "fused", TE_GEMM_STREAMS, MEGATRON_EXPERT_HOST,
        "Megatron-Core with Transformer Engine: fused norms, RoPE, SwiGLU / GeLU and cross-entropy, "
        "cuDNN fused attention (sinks too), grouped GEMMs for experts, the distributed optimizer "
        "overlapping its gradient reduce-scatters and parameter all-gathers",
        "elementwise: TE / Megatron fused kernels read their inputs and write their outputs once "
        "(the fused count of OpSpec.traffic); expert_gemm_streams: TE's GroupedLinear, one cuBLAS GEMM per "
        "expert on 4 streams (TE_GEMM_STREAMS); expert_host: fitted to the Megatron-Bridge GPT-OSS 120B "
        "row (the only Megatron mixture-of-experts row of analysis/calibration.py; MEGATRON_EXPERT_HOST); "
        "gradient "
        "buffers: one per (param dtype, grad dtype), grad dtype torch.float if grad_reduce_in_fp32 else "
        "param.dtype, for DDP and the distributed optimizer alike (group_params_for_buffers, "
        "megatron/core/distributed/param_and_grad_buffer.py at NVIDIA/Megatron-LM d98e8a6): with "
        "reduce_dtype bf16 (--grad-reduce-in-bf16) the step accumulates and is reduced in bf16",
        step_grads_in_reduce_dtype=True),
    "eager": Engine(
        "eager", 2.8, "fa2", 0, 0.0,
        "eager PyTorch with FSDP2 (torchtitan without torch.compile): one kernel per elementwise op "
        "with fp32 upcasts in the norms, RoPE and the loss, SDPA's FlashAttention-2 (FlexAttention for "
        "sliding windows and sinks: core/attention.py), FSDP2 all-gathers "
        "and reduce-scatters overlapped with compute",
        "elementwise: an eager RMSNorm moves about 36 bytes per element (float, pow, mean, rsqrt, "
        "two muls, type_as) against 4 fused, RoPE through complex fp32 about 20 against 4, SwiGLU 10 "
        "against 6, the fp32 loss about 2.5x, residual adds and the attention kernel's operands the "
        "same: weighted by a Llama 3 8B layer's fused bytes (norms 32 KB per token, RoPE 20, SwiGLU 86, "
        "adds 49, attention 20, loss 40) about 2.8x; FSDP2 copies each all-gather's output and "
        "reduce-scatter's input through its flat buffer (step_sums); "
        "attention: FlashAttention-2 on Hopper (Shah et al. 2024, FlashAttention-3, Fig. 5-7); "
        "expert_gemm_streams: torchtitan's experts run torch._grouped_mm, one grouped kernel (0); "
        "expert_host: not modelled (0: no eager MoE row was measured); selective recomputation is "
        "torchtitan's op-level policy (analysis/compute.py op_sac)",
        sac="op", fsdp2=True, fp32_loss=True),
    "compile": Engine(
        "compile", 1.0, "fa2", 0, 0.0,
        "torchtitan with torch.compile and FSDP2: each transformer block and the loss compiled "
        "(Inductor fuses their elementwise ops), SDPA's FlashAttention-2, FSDP2 all-gathers and "
        "reduce-scatters overlapped with compute",
        "elementwise: torchtitan compiles every TransformerBlock (fullgraph) and the loss "
        "(torchtitan/models/llama3/parallelize_llama.py apply_compile, components/loss.py, commit "
        "820504e): Inductor fuses each chain of norms, RoPE, SwiGLU and residual adds between two "
        "matmuls into kernels that read their inputs and write their outputs once, the fused count "
        "of OpSpec.traffic; the loss still upcasts to fp32 (an fp32 copy of the logits in memory); "
        "FSDP2's flat-buffer copies stay eager (step_sums); attention: SDPA's flash backend, "
        "FlashAttention-2, as eager; expert_gemm_streams, expert_host: as eager (no compiled MoE row); "
        "selective "
        "recomputation: torchtitan's op-level policy, as eager",
        sac="op", fsdp2=True, fp32_loss=True),
    "automodel": Engine(
        "automodel", 1.0, "fused", TE_GEMM_STREAMS, 0.0,
        "NeMo AutoModel with FSDP2: Transformer Engine linears and RMSNorm, TE's cuDNN fused "
        "attention (FlexAttention for sinks), grouped GEMMs for experts with DeepEP's dispatch",
        "elementwise: fitted to the two NeMo AutoModel rows of analysis/calibration.py (GPT-OSS 20B and "
        "Qwen3-30B-A3B on 8 H100s, docs/performance-summary.mdx): the least-squares value falls to the "
        "fused count, 1.0 (an estimate from the recipes, examples/benchmark/configs/*_te_deepep.yaml@8d9bfb9: "
        "TE norms, eager SwiGLU, router and bf16 loss, weighted as the eager engine's, gave about 1.4 and "
        "+12% on Qwen3); attention: TE's fused attention (cuDNN) as megatron, FlexAttention for sinks "
        "(core/attention.py); expert_gemm_streams: TE's GroupedLinear as megatron (its recipes' te experts "
        "backend); expert_host: 0, not fitted (DeepEP's normal dispatch waits on the host for the "
        "received counts too, but both rows plan within 6% without it); selective recomputation: "
        "torchtitan's op-level "
        "policy (Automodel's apply_ac selective reuses it); FSDP2 copies as eager; dispatch: DeepEP "
        "(deepseek-ai/DeepEP, normal kernels) sends each token once to every rank holding some of its "
        "experts and combines their outputs there (routed_share); fsdp2_shard_bytes: its MoE models are "
        "cast to bf16 (nemo_automodel/components/models/*/model.py initialize_weights(dtype=torch.bfloat16) "
        "@8d9bfb9, called by checkpointing.py) and trained with torch.optim.Adam, whose states follow the "
        "parameters' dtype: parameters, gradients and moments in bf16",
        sac="op", fsdp2=True, dedup_dispatch=True, fsdp2_shard_bytes=2),
}
DEFAULT_ENGINE = "megatron"


def engine(cluster) -> Engine:
    """The :class:`Engine` of ``cluster`` (a ClusterConfig): ``cluster.engine``."""
    return ENGINES[getattr(cluster, "engine", None) or DEFAULT_ENGINE]


def attention_efficiency(cluster) -> float:
    """The fraction of ``peak_flops`` the engine's attention kernel reaches on ``cluster``."""
    eff, eng = efficiency(cluster), engine(cluster)
    return eff.attention if eng.attention == "fused" else eff.attention_fa2


#: per cluster preset (SPEC 1 names). ``matmul`` of the H100 is fitted to the Llama 3 405B
#: row of :mod:`parcompile.analysis.calibration` (its only dense Megatron-style H100 row),
#: the A100's ``matmul`` and ``overlap`` to the Megatron-LM and Korthikanti rows; every other
#: number is a measurement or a datasheet ratio named in ``source``
#: (:data:`parcompile.analysis.calibration.FITTED` lists them with their rows).
_A100_SRC = (
    "matmul: fitted to the step times of Megatron-LM (Narayanan et al. 2021, Table 1) and Korthikanti et al. "
    "2022 (Table 5), with the GEMM operand traffic timed apart (cuBLAS fp16 GEMMs of these sizes run at "
    "240-270 of 312 TFLOP/s); memory: STREAM-like kernels reach about 80% of the HBM bandwidth; link: "
    "nccl-tests all_reduce bus bandwidth on one DGX A100 node, 231.6 of 300 GB/s (Azure ND A100 v4, 8 GB); net: "
    "an HDR 200 Gb/s NIC carries 24 of 25 GB/s in NCCL (NVIDIA/nccl#412); attention: FlashAttention-2 "
    "(Dao 2023, Fig. 4-6: about 190 of 312 TFLOP/s forward, 155 backward at head dim 128, causal) for both "
    "kernels; softmax_dim: 312 TFLOP/s / (4 x 16 exponentials per clock x 108 SMs x 1.41 GHz); overlap: "
    "fitted to the same rows (issue 29: with the network model the Megatron-LM torch-DDP rows, 1.7B-18.4B, "
    "no longer paid an exposed one-NIC all-reduce): 0.60, twice the SM share of NCCL's 32 ring channels of "
    "108 SMs (0.30), the rest standing for the HBM bandwidth the concurrent all-reduce takes from the GEMMs")
_H100_SRC = (
    "matmul: fitted to the Llama 3 405B row (Llama 3 paper, Table 4), the GEMM operand traffic timed apart, "
    "0.67 with the network model of issue 29 (0.70 before) "
    "(cuBLAS bf16 GEMMs of 8k-16k sizes sustain 650-750 of 989 TFLOP/s at 700 W); link: nccl-tests all_reduce bus "
    "bandwidth without NVLS (ring; all_gather, reduce_scatter), 370 of 450 GB/s (NVIDIA/nccl-tests#212); nvls: "
    "the NVLS all_reduce on 8 GPUs, bus bandwidth 480 GB/s = algorithm bandwidth 274 GB/s (nccl-tests#212, #347; "
    "Azure ND H200 v5: 479.98); net: an NDR 400 Gb/s ConnectX-7 carries 46-49 of 50 GB/s (nccl-tests#290, #267); "
    "attention: FlashAttention-3 / cuDNN (Shah et al. 2024, FlashAttention-3, Fig. 5 and 7: about 640 TFLOP/s forward, 500 backward at head dim "
    "128, causal, 8k), attention_fa2: FlashAttention-2 on the same plots (about 350 forward, 300 backward); "
    "softmax_dim: 989 TFLOP/s / (4 x 3.9 T exponentials/s, the multi-function units' rate FlashAttention-3 "
    "quotes); overlap: NCCL's up to 32 channels of 132 SMs")
_A100_GEMM = (
    "gemm_clock: fitted to the Megatron-LM and Korthikanti rows (ROWS) over the GEMM-rate model of "
    "analysis/gemm.py (ampere: 268 of 312 TFLOP/s for MAMF's best bf16 shape): 0.89")
EFFICIENCY: dict[str, Efficiency] = {
    "a100-80gb": Efficiency(0.83, 0.80, 0.77, _A100_SRC, attention=0.45, attention_fa2=0.45, softmax_dim=32.0,
                            overlap=0.60, net=0.96, gemm_clock=0.89, gemm_source=_A100_GEMM),
    "a100-40gb": Efficiency(0.83, 0.80, 0.77, "as a100-80gb (same SXM4 part, HBM2)", attention=0.45,
                            attention_fa2=0.45, softmax_dim=32.0, overlap=0.60, net=0.96, gemm_clock=0.89,
                            gemm_source=_A100_GEMM),
    "h100-sxm": Efficiency(0.67, 0.80, 0.82, _H100_SRC, attention=0.46, attention_fa2=0.27, softmax_dim=63.0,
                           overlap=0.24, net=0.94, nvls=0.61),
    "h200": Efficiency(0.67, 0.80, 0.82, "as h100-sxm (the same GH100 compute, SM count and NVLink)",
                       attention=0.46, attention_fa2=0.27, softmax_dim=63.0, overlap=0.24, net=0.94, nvls=0.61),
    "b200": Efficiency(
        0.76, 0.80, 0.82,
        "fractions assumed as h100-sxm until measured; softmax_dim: 2,250 TFLOP/s / (4 x 16 exponentials "
        "per clock x 148 SMs x 1.965 GHz); overlap: 32 channels of 148 SMs; nvls: h100-sxm's 0.61 times "
        "NCCL's Blackwell / Hopper NVLS efficiency (0.74 / 0.85, NVIDIA/nccl src/graph/tuning.cc)",
        attention=0.46, attention_fa2=0.27, softmax_dim=121.0, overlap=0.22, net=0.94, nvls=0.53),
    "gb200-nvl72": Efficiency(
        0.76, 0.80, 0.82,
        "as b200 (the same Blackwell GPU at 1,200 W: its clock raises the matmul and exponential rates alike); "
        "nvls: b200's, on the NVL72's NVLink switch trays (assumed)",
        attention=0.46, attention_fa2=0.27, softmax_dim=121.0, overlap=0.22, net=0.94, nvls=0.53),
    "mi300x": Efficiency(
        0.45, 0.75, 0.70,
        "matmul: published hipBLASLt bf16 GEMM measurements reach 550-650 of 1307 TFLOP/s "
        "(SemiAnalysis, 2024); attention: CK / AITER flash attention assumed at the FlashAttention-2 level; "
        "softmax_dim: 1,307 TFLOP/s / (4 x 16 transcendentals per clock x 304 CUs x 2.1 GHz); overlap: "
        "RCCL's 32 channels of 304 CUs; memory and link assumed",
        attention=0.35, attention_fa2=0.35, softmax_dim=32.0, overlap=0.11, net=0.70),
    "ascend-910b": Efficiency(0.55, 0.75, 0.70, "assumed (no public calibration)", attention=0.35,
                              attention_fa2=0.35, softmax_dim=63.0, overlap=0.2, net=0.70),
    "cpu": Efficiency(1.0, 1.0, 1.0, "the cpu preset's numbers are already rough effective ones", attention=1.0,
                      attention_fa2=1.0, softmax_dim=0.0, overlap=0.0, net=1.0),
}
DEFAULT_EFFICIENCY = Efficiency(0.76, 0.80, 0.82, "default for a cluster without a preset: as h100-sxm",
                                attention=0.46, attention_fa2=0.27, softmax_dim=63.0, overlap=0.24, net=0.94, nvls=0.61)


def efficiency(cluster) -> Efficiency:
    """The :class:`Efficiency` of ``cluster`` (a ClusterConfig): its preset's, else the default."""
    return EFFICIENCY.get(getattr(cluster, "preset", None) or "", DEFAULT_EFFICIENCY)


def fp8_efficiency(cfg) -> float:
    """The achievable fraction of the FP8 peak of ``cfg``'s recipe on its cluster
    (:attr:`Efficiency.fp8`, or ``fp8_rowwise`` for ``fp8_recipe = rowwise``)."""
    eff = efficiency(cfg.cluster)
    return eff.fp8_rowwise if cfg.train.fp8_recipe == "rowwise" else eff.fp8
