"""Published measurements the cost model is checked against, and Korthikanti's formulas.

Rows (all GPT-style: layernorm, gelu, learned positions, biases, dropout 0.1, tied
embeddings, unfused attention; fp16, s = 2048, V = 51,200, A100-80GB, Adam):

* Megatron-LM, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM", Table 1 (full recomputation; micro-batch sizes and
  virtual stages from Megatron-LM's ``examples/sc21/run_table_1.sh``). The paper gives
  TFLOP/s per GPU; the step time is derived with its own FLOP count
  ``F = 96 B s l h^2 (1 + s/6h + V/16lh)``: ``t = F / (n * X)``. The same script (commit
  de7dc40) runs the 1.7B-18B rows with ``--DDP-impl torch`` (torch DDP: gradient buckets
  overlapping the backward) and the 39B-1T rows with ``--DDP-impl local`` (Megatron-LM's
  local DDP: ``train_step`` all-reduces the contiguous gradient buffer after the whole
  backward): ``bucket_size = 0`` (:attr:`PublishedRow.ddp`).
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Table 5: seconds per iteration with full recomputation and with sequence
  parallelism + selective recomputation (configurations from their Table 3).

``calibration`` rows are what the efficiencies of :mod:`parcompile.analysis.estimate`
were tuned to; ``held_out`` rows were not looked at while tuning.

H100-era rows (:data:`H100_ROWS`, bf16, :func:`h100_config`), what the H100 numbers and the
engines of :mod:`parcompile.analysis.estimate` were calibrated on (:data:`FITTED` names each
fitted number and its rows: the torchtitan rows none, the Megatron-Bridge row
``ENGINES["megatron"].expert_host``, the Llama 3 row the H100's ``matmul`` (the flat rule's),
all of them its ``gemm_clock`` (the GEMM-rate model's, :mod:`parcompile.analysis.gemm`), the two NeMo
AutoModel rows ``ENGINES["automodel"].elementwise``):

1. torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (commit 31a17bf), Table 1,
   row "FSDP": Llama 3.1 8B, 8 GPUs, FSDP 8, local batch 2, global batch 16, seq 8192,
   selective activation checkpointing (torchtitan's op-level policy), eager (no
   torch.compile): 5,762 tokens/s per GPU, 82.4 GiB (the largest ``max_reserved`` of the
   GPUs). The GPUs are Grand Teton's H100 with 96 GB of HBM2e at 2.4 TB/s and a 500 W
   power limit, not the SXM5 80 GB part of the ``h100-sxm`` preset: modelled with
   cluster overrides (``memory = 96 GB``, ``hbm_bw = 2.4 TB/s``, ``engine = eager``) and a
   peak for the power limit: the page's footnote 2 puts it "between SXM and NVL" (989 and
   835 TFLOPS dense bf16) without a value; with dynamic power ``~ f V^2`` and the voltage
   following the clock, the clock scales as the cube root of the power: ``989 x (500 /
   700)^(1/3) = 884 TFLOPS``.
2. Megatron-Bridge performance summary, release 26.04.01, GPT-OSS 120B on DGX-H100, BF16:
   64 GPUs, GBS 1280, MBS 1, seq 4096, TP 1, PP 4, EP 8 (``scripts/performance/configs/
   gpt_oss``: ``GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V2``: distributed optimizer with
   overlapped gradient reduce-scatter and parameter all-gather, gradients reduced in bf16,
   forced load balancing, no virtual pipeline): 5,824 tokens/s per GPU (158 TFLOP/s per
   GPU by Megatron's count). Its recomputation of the norms and the expert activation
   (``recompute_modules = ["layernorm", "moe_act"]``, elementwise work) is not modelled:
   ``recompute = none``.
3. Llama 3 paper (Llama Team, "The Llama 3 Herd of Models", 2024), Table 4, first row:
   405B on 8,192 H100 SXM, TP 8, CP 1, PP 16, DP 64, seq 8192, 16M tokens per batch (32
   sequences per data-parallel rank): 430 TFLOP/s per GPU. As section 3.3.2 states it:
   interleaved 1F1B, one-layer model chunks with the embedding and the output layer as
   chunks of their own (126 layers + 2 = 16 x 8: 8 virtual stages, :data:`META_405B_SPLIT`),
   sequence parallelism, no recomputation at seq 8192, ZeRO-2 (the paper's FSDP shards
   optimizer states and gradients, reduce-scattered and accumulated in fp32, and does not
   reshard parameters after the forward). Not published, assumed here: micro-batch 1 (m =
   32 micro-batches) and the round size N of its Fig. 6 schedule (N contiguous micro-batches
   per stage, "tunable"; the figure's N = 5 on 4 ranks is an illustration): N = pp = 16,
   Megatron-Core's default (``--microbatch-group-size-per-virtual-pipeline-stage``), the
   fewest micro-batches in flight of the round sizes Megatron-Core accepts (16 or 32 here).
   The published step time is the row's model FLOPs per step (parcompile's count,
   ``compute.model_flops_per_step``: ``6 N`` plus attention without causal halving, the
   convention of Megatron's and torchtitan's MFU) over ``8192 x 430 TFLOP/s``. The plan
   does not fit the 80 GB part (78.0 GiB of 72 usable; 88.0 GiB with the 4 even virtual
   stages this row had before): stage 1 keeps 141 one-layer chunk-forwards in flight
   (``2 (pp - 2) + (v - 1) N + 1``), 0.497 GiB each, where 128 would fit
   (``tests/test_cost_model.py``). The H100's ``matmul`` was fitted with this row at 4 even
   virtual stages (+0.1%); with the paper's split (a bubble of ``(pp - 1) / (v m)`` at v = 8
   instead of 4) the same constant estimates 3.8% under the published time: not refitted.

2025-26 rows (issue 29), each with its source commit (:attr:`H100Row.commit`) and what
was assumed where the source is silent (:attr:`H100Row.assumed`):

4. torchtitan ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (added in commit
   2887250, unchanged since; the runs used torchtitan 820504e): "Llama3 70b on 256 H100s
   with FSDP=32, TP=8, torch.compile, full AC, local batch size 16", vanilla TP, bf16:
   597.3 tokens/s (per GPU, torchtitan's ``tps``). Same Grand Teton hardware as row 1
   (96 GB HBM2e at 2.4 TB/s, 500 W, 400 Gb/s RDMA per GPU: the page's own hardware list).
   From torchtitan 820504e: ``llama3_70b.toml`` gives seq 8192; ``global_batch_size``
   defaults to local x data-parallel (no accumulation): global batch 512;
   ``parallelize_llama`` pairs TP with sequence parallelism on the norms and loss
   parallelism; ``apply_compile`` compiles each TransformerBlock and ``components/loss.py``
   the loss: ``engine = compile``. No memory published.
5. The same file: "Llama3 8b on 64 H100s with FSDP=8, TP=8, torch.compile, per op SAC,
   local batch size 12": 4,378 tokens/s per GPU; seq 8192 (``llama3_8b.toml``), global
   batch 96, ``recompute = selective`` as torchtitan's op-level policy.
6. NeMo AutoModel ``docs/performance-summary.mdx`` (commit 36044ad; the rows date from
   89e3a9f, October 2025, Qwen3 re-measured in 8d9bfb9), DGX-H100, BF16: GPT-OSS 20B, 8
   GPUs, GBS 256, LBS 2, GA 16, seq 4096, FSDP 8: 10.04 s per step. The table leaves EP as
   "-"; its recipe ``examples/benchmark/configs/gptoss_20b_te_deepep.yaml`` at 8d9bfb9 (the
   configuration the table links) has ``ep_size 8``, ``activation_checkpointing: true``
   (whole-block checkpoints: ``recompute = full``), FlexAttention, TE linears and RMSNorm,
   DeepEP, a fake balanced gate, torch Adam, bf16 loss: ``engine = automodel``.
7. The same table: Qwen3 MoE 30B (Qwen3-30B-A3B), 8 GPUs, GBS 512, LBS 4, GA 16, seq
   4096, FSDP 8, EP 8: 21.773 s per step; its recipe (``qwen3_moe_30b_te_deepep.yaml``)
   as row 6 with TE attention.

FP8 rows (issue 32, :data:`FP8_ROWS`, ``precision = fp8``; :mod:`parcompile.analysis.fp8`), what
``EFFICIENCY["h100-sxm"].fp8`` and ``fp8_rowwise`` were fitted to, and nothing else:

8. torchtitan ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (commit 2887250, runs at
   820504e with torchao 6243040), the "float8 tensorwise" and "float8 rowwise" rows of the
   Llama 3 70B table, vanilla TP: 809.8 and 599.6 tokens/s per GPU (bf16: row 4's 597.3), the
   layout of row 4. torchtitan 820504e's ``llama3_70b.toml`` ``[float8]`` section:
   ``enable_fsdp_float8_all_gather = false``, ``filter_fqns = ["output"]`` (no FP8 all-gather;
   the LM head in bf16); tensorwise runs torchtitan's Float8 TP plan (FP8 all-gathers of the
   sequence-parallel inputs), rowwise the plain one.
9. The same file, Llama 3 8B table: 5,078.1 (tensorwise) and 3,708.5 (rowwise) tokens/s per
   GPU (bf16: row 5's 4,378), the layout of row 5; op-level selective recomputation, whose
   save list (``parallelize_llama.py`` at 820504e) saves ``aten.mm`` outputs but not
   ``aten._scaled_mm``'s: every FP8 linear is recomputed (:func:`parcompile.analysis.compute.op_sac`).
10. Megatron-Bridge ``docs/performance-summary-archive.md`` (commit 4ab94df), "26.04.01 NeMo
    Container", pre-training LLAMA3_70B, DGX-H100, FP8: 64 GPUs, GBS 256, MBS 1, seq 8192,
    FSDP 0, TP 4, PP 8, CP 1, VP 5: 1,664 tokens/s per GPU (731 model TFLOP/s per GPU). FP8
    here is Transformer Engine's current scaling (per-tensor: ``fp8_recipe = tensorwise``). Its
    recipe at the same commit, ``src/megatron/bridge/perf_recipes/llama/h100/llama3.py``
    ``llama3_70b_pretrain_64gpu_h100_fp8cs_config``: ``pipeline_model_parallel_layout =
    "Et*2|(t*2|)*34,t*3|(t*2|)*3,tL"`` (two layers per model chunk but three in chunk 35,
    rank 3's last, and one beside the loss in chunk 39: :data:`LLAMA3_70B_H100_FP8_SPLIT`),
    sequence parallelism, ``tp_comm_overlap_cfg = userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192``
    on the base recipe's ``CommOverlapConfig(tp_comm_overlap=True)``
    (``src/megatron/bridge/recipes/llama/h100/llama3.py`` ``llama3_70b_pretrain_32gpu_h100_bf16_config``:
    also ``recompute_granularity = None``, ``fine_grained_activation_offloading = False``,
    ``cross_entropy_loss_fusion = True`` with Transformer Engine's implementation, the
    distributed optimizer), ``CommOverlapConfig`` turning ``overlap_p2p_comm`` on with virtual
    stages (``src/megatron/bridge/training/comm_overlap.py``), ``first_last_layers_bf16 =
    False`` and ``grad_reduce_in_fp32 = False`` (``src/megatron/bridge/perf_recipes/_common.py``):
    ``cluster.tp_comm_overlap`` and ``cluster.overlap_p2p_comm`` (:func:`parcompile.analysis.
    estimate.tp_exposed`, :func:`~parcompile.analysis.estimate.p2p_blocking_share`). Its 16-bit
    gradient buffer (NVIDIA/Megatron-LM ``megatron/core/distributed/param_and_grad_buffer.py``
    ``group_params_for_buffers`` at d98e8a6: ``grad_dtype = torch.float if grad_reduce_in_fp32
    else param.dtype``) is the row's ``reduce_dtype = bf16``: under engine megatron the plan holds
    the zero-1 gradient buffers in bf16 too (:func:`parcompile.analysis.estimate.
    grad_element_bytes`; the generated program keeps fp32 ones), so the plan fits the 72 GiB
    usable; with fp32 buffers it would not (tests/test_cost_model.py).

A row's spec is
:func:`row_config`; :func:`parcompile.passes.manager.cost_without_schedule` costs it (running the
passes belongs to the driver: the analyses import no pass).

:func:`layer_activation_bytes` is Korthikanti's Table 2 (bytes per layer, 16-bit);
:func:`stage_activation_bytes` their whole-stage value (section 4.3: the layers of the
first stage times the micro-batches in flight, plus the embedding dropout mask; the
output layer ``4sbh/t (1 + V/h)`` on the last stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from parcompile.config.presets import cluster_preset, model_preset
from parcompile.config.schema import ClusterConfig, ModelConfig, ParallelConfig, SpecConfig, TrainConfig


@dataclass(frozen=True)
class PublishedRow:
    """One published configuration and its measured seconds per step."""

    name: str
    source: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    micro_batch: int
    step_time: float
    virtual_stages: int = 1
    recompute: str = "full"
    sequence_parallel: bool = False
    held_out: bool = False
    #: the row's data-parallel gradient reduction: ``torch`` (torch DDP, buckets overlapping
    #: the backward) or ``local`` (Megatron-LM's local DDP: one all-reduce of the contiguous
    #: gradient buffer after the whole backward, ``bucket_size = 0``)
    ddp: str = "torch"

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


def _megatron(name, a, h, L, t, p, n, B, b, tflops, v=1, held_out=False, ddp="torch") -> PublishedRow:
    s, V = 2048, 51200
    flops = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return PublishedRow(name, f"Megatron-LM 2021 Table 1 ({tflops} TFLOP/s per GPU)", a, h, L, t, p, n, B, b,
                        flops / (n * tflops * 1e12), v, held_out=held_out, ddp=ddp)


def _korthikanti(name, a, h, L, p, n, B, full, present, v=1, b=1, held_out=False) -> list[PublishedRow]:
    src = "Korthikanti et al. 2022 Table 5"
    return [PublishedRow(f"{name} full recompute", src, a, h, L, 8, p, n, B, b, full, v, "full", False, held_out),
            PublishedRow(f"{name} SP + selective", src, a, h, L, 8, p, n, B, b, present, v, "selective", True,
                         held_out)]


ROWS: tuple[PublishedRow, ...] = (
    _megatron("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 137),
    _megatron("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 138, held_out=True),
    _megatron("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 142, held_out=True),
    _megatron("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 135),
    _megatron("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 138, held_out=True, ddp="local"),
    _megatron("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 140, v=3, held_out=True, ddp="local"),
    _megatron("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 148, v=2, ddp="local"),
    _megatron("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 155, v=2, held_out=True, ddp="local"),
    _megatron("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 163, v=3, held_out=True, ddp="local"),
    _megatron("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 163, ddp="local"),
    *_korthikanti("22B", 64, 6144, 48, 1, 8, 4, 1.42, 1.10, b=4),
    *_korthikanti("175B", 96, 12288, 96, 8, 64, 64, 18.13, 13.75, held_out=True),
    *_korthikanti("530B", 128, 20480, 105, 35, 280, 280, 49.05, 37.83, v=3),
    *_korthikanti("1T", 160, 25600, 128, 64, 512, 512, 94.42, 71.49, held_out=True),
)


def row_config(row: PublishedRow) -> SpecConfig:
    """The spec of a published row (module docstring)."""
    model = ModelConfig(name=f"gpt_{row.name.split()[0]}", layers=row.layers, hidden=row.hidden, heads=row.heads,
                        vocab=51200, seq_len=2048, norm="layernorm", activation="gelu", position="learned",
                        bias=True, dropout=0.1, tie_embeddings=True, attention="unfused", dtype="fp16")
    cl = cluster_preset("a100-80gb", "fp16")
    cl.update(nodes=max(1, row.gpus // 8), gpus_per_node=min(8, row.gpus))
    cluster = ClusterConfig(name="selene", preset="a100-80gb", **cl)
    par = ParallelConfig(dp=row.dp, tp=row.tp, pp=row.pp, micro_batch=row.micro_batch,
                         global_batch=row.global_batch, recompute=row.recompute,
                         sequence_parallel=row.sequence_parallel, virtual_stages=row.virtual_stages,
                         schedule="interleaved_1f1b" if row.virtual_stages > 1 else "1f1b",
                         **({"bucket_size": 0} if row.ddp == "local" else {}))
    return SpecConfig(name=model.name, model=model, cluster=cluster, parallel=par,
                      train=TrainConfig(optimizer="adam"))


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none") -> Fraction:
    """Korthikanti et al. 2022, Table 2: activation bytes of one GPT layer (16-bit).

    none: ``sbh(34 + 5as/h)``; tensor parallel: ``sbh(10 + 24/t + 5as/(ht))``; + sequence
    parallel: ``sbh/t (34 + 5as/h)``; + selective recompute: ``34 sbh/t`` (tensor parallel
    only: ``sbh(10 + 24/t)``); full recompute: ``2sbh`` (``2sbh/t`` with sequence
    parallelism, where Megatron keeps the layer input split).
    """
    sbh = Fraction(s * b * h)
    attn = Fraction(5 * a * s, h)
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if recompute == "selective":
        attn = Fraction(0)
    if sequence_parallel:
        return sbh / t * (34 + attn)
    return sbh * (10 + Fraction(24, t) + attn / t)


def stage_activation_bytes(row_cfg: SpecConfig, stage: int, in_flight: Fraction | int) -> Fraction:
    """Korthikanti's whole-stage value for ``stage`` of a GPT spec: its layers times the
    micro-batches in flight, plus the embedding dropout mask (first stage, ``sbh/t`` with
    sequence parallelism, else ``sbh``) and the output layer ``4sbh/t (1 + V/h)`` (last
    stage; ``V`` padded)."""
    m, par = row_cfg.model, row_cfg.parallel
    s, b, h, a, t = m.seq_len, par.micro_batch, m.hidden, m.heads, par.tp
    counts = par.layers_per_chunk(m.layers)
    layers = sum(counts[k] for k in par.rank_chunks(stage))
    one = layer_activation_bytes(s, b, h, a, t, par.sequence_parallel, par.recompute)
    total = Fraction(in_flight) * layers * one
    split = t if par.sequence_parallel else 1
    if stage == 0 and m.dropout > 0:
        total += Fraction(in_flight) * s * b * h / split
    if stage == par.pp - 1:
        total += Fraction(4 * s * b * h, split) + Fraction(4 * s * b * m.padded_vocab(t), t)
    return total


@dataclass(frozen=True)
class H100Row:
    """One published H100-era measurement (module docstring): the spec's blocks as keys
    (``model`` a preset and its overrides, ``cluster`` overrides of ``h100-sxm``,
    ``parallel``), and what was published: tokens per second per GPU, or TFLOP/s per GPU
    (then the step time comes from the row's own model FLOPs), and the peak memory (GiB)."""

    name: str
    source: str
    model: str
    model_keys: tuple[tuple[str, object], ...]
    cluster: tuple[tuple[str, object], ...]
    parallel: tuple[tuple[str, object], ...]
    tokens_per_s_per_gpu: float | None = None
    tflops_per_gpu: float | None = None
    peak_gib: float | None = None
    #: published seconds per step (rows that give it directly)
    step_time: float | None = None
    #: the source's commit (or release) the row was read at
    commit: str = ""
    #: what was assumed where the source leaves a value open
    assumed: str = ""
    #: `train` keys beyond ``optimizer = adamw`` (the FP8 rows: ``precision``, ``fp8_recipe``)
    train: tuple[tuple[str, object], ...] = ()
    #: the name of the row of :data:`H100_ROWS` with the same layout in bf16, where one was
    #: published beside this one (an FP8 row)
    bf16_row: str | None = None

    def layout(self) -> str:
        """The layout in words: ``dp=8 zero=3 mb=2 gbs=16 recompute=selective``."""
        return " ".join(f"{k}={v}" if k != "stage_layers" else f"{k}=[{v[0]}, ..., {v[-1]}]"
                        for k, v in self.parallel if k != "sequence_parallel" or v)

    def published_step_time(self, model_flops_per_step: float) -> float:
        """Seconds per step as published (:attr:`step_time`), else from the published rate:
        tokens per second per GPU, or TFLOP/s per GPU over ``model_flops_per_step`` (the
        row's own count)."""
        if self.step_time is not None:
            return self.step_time
        par = dict(self.parallel)
        world = dict(self.cluster)["nodes"] * 8
        tokens = par["global_batch"] * dict(self.model_keys)["seq_len"]
        if self.tokens_per_s_per_gpu is not None:
            return tokens / (self.tokens_per_s_per_gpu * world)
        return model_flops_per_step / (world * self.tflops_per_gpu * 1e12)


#: Llama 3 paper section 3.3.2: "the first model chunk on the first stage has only the embedding,
#: and the last model chunk on the last stage has only output projection and loss calculation":
#: 126 layers in 16 x 8 one-layer chunk slots, the first and the last without a layer (as
#: examples/llama3_405b_meta_16k_h100.par)
META_405B_SPLIT: tuple[int, ...] = (0,) + (1,) * 126 + (0,)

#: Meta's Grand Teton H100 (rows 1, 4, 5): 96 GB HBM2e at 2.4 TB/s, 500 W (module docstring)
GRAND_TETON: tuple[tuple[str, object], ...] = (("memory", 96 * 10**9), ("hbm_bw", 2.4e12), ("peak_flops", 884e12))

H100_ROWS: tuple[H100Row, ...] = (
    H100Row("Llama 3.1 8B FSDP", "torchtitan llama3_h100_202412 Table 1", "llama3-8b", (("seq_len", 8192),),
            (("nodes", 1), *GRAND_TETON, ("engine", "eager")),
            (("dp", 8), ("zero", 3), ("micro_batch", 2), ("global_batch", 16), ("recompute", "selective")),
            tokens_per_s_per_gpu=5762, peak_gib=82.4, commit="31a17bf",
            assumed="peak 884 TFLOPS for the 500 W limit (cube root of the power)"),
    H100Row("GPT-OSS 120B", "Megatron-Bridge perf summary", "gpt-oss-120b", (("seq_len", 4096),),
            (("nodes", 8),),
            (("tp", 1), ("pp", 4), ("ep", 8), ("dp", 16), ("zero", 1), ("micro_batch", 1), ("global_batch", 1280),
             ("recompute", "none"), ("reduce_dtype", "bf16")),
            tokens_per_s_per_gpu=5824, commit="release 26.04.01",
            assumed="its norm and expert-activation recomputation (elementwise) not modelled: recompute none; "
                    "gradients reduced and held in bf16 (Megatron-Bridge 4ab94df perf_recipes/_common.py "
                    "_benchmark_common: grad_reduce_in_fp32 = False, as gpt_oss/h100/gpt_oss.py calls it: "
                    "reduce_dtype bf16, Megatron-Core's grad buffer in bf16 at zero 1)"),
    H100Row("Llama 3.1 405B", "Llama 3 paper Table 4", "llama3.1-405b", (("seq_len", 8192),),
            (("nodes", 1024),),
            (("tp", 8), ("pp", 16), ("dp", 64), ("zero", 2), ("micro_batch", 1), ("global_batch", 2048),
             ("schedule", "interleaved_1f1b"), ("virtual_stages", 8), ("stage_layers", META_405B_SPLIT),
             ("microbatch_group_size", 16), ("sequence_parallel", True), ("recompute", "none")),
            tflops_per_gpu=430, commit="arXiv 2407.21783",
            assumed="micro-batch 1; 8 virtual stages of one layer slot with a layer-less first and last chunk "
                    "(section 3.3.2: 126 layers + the embedding and output chunks = 16 x 8); rounds of N = pp = 16 "
                    "micro-batches (the paper tunes N but does not give it: Megatron-Core's default, the fewest in "
                    "flight of the N it accepts, 16 or 32 at m = 32); sequence parallel, no recompute; ZeRO-2 "
                    "(section 3.3.2: its FSDP shards optimizer states and gradients, parameters not resharded "
                    "after forward)"),
    H100Row("Llama 3.1 70B FSDP+TP", "torchtitan asyncTP_llama3_h100_2025-06", "llama3-70b", (("seq_len", 8192),),
            (("nodes", 32), *GRAND_TETON, ("engine", "compile")),
            (("tp", 8), ("dp", 32), ("zero", 3), ("sequence_parallel", True), ("micro_batch", 16),
             ("global_batch", 512), ("recompute", "full")),
            tokens_per_s_per_gpu=597.3, commit="2887250 (runs at 820504e)",
            assumed="seq 8192 and no gradient accumulation (torchtitan 820504e defaults); peak 884 TFLOPS as row 1"),
    H100Row("Llama 3.1 8B FSDP+TP", "torchtitan asyncTP_llama3_h100_2025-06", "llama3-8b", (("seq_len", 8192),),
            (("nodes", 8), *GRAND_TETON, ("engine", "compile")),
            (("tp", 8), ("dp", 8), ("zero", 3), ("sequence_parallel", True), ("micro_batch", 12),
             ("global_batch", 96), ("recompute", "selective")),
            tokens_per_s_per_gpu=4378, commit="2887250 (runs at 820504e)",
            assumed="seq 8192 and no gradient accumulation (torchtitan 820504e defaults); peak 884 TFLOPS as row 1"),
    H100Row("GPT-OSS 20B FSDP+EP", "NeMo AutoModel performance-summary", "gpt-oss-20b", (("seq_len", 4096),),
            (("nodes", 1), ("engine", "automodel")),
            (("dp", 8), ("ep", 8), ("zero", 3), ("micro_batch", 2), ("global_batch", 256), ("recompute", "full")),
            step_time=10.04, commit="36044ad (row 89e3a9f)",
            assumed="EP 8 and full activation checkpointing from its recipe at 89e3a9f and 8d9bfb9 (the table "
                    "prints EP '-'); "
                    "FSDP2 without reshard after forward modelled as zero 3; its sink attention as "
                    "FlexAttention at 0.87 of the engine's attention rate (core/attention.py); balanced routing "
                    "(its fake balanced gate)"),
    H100Row("Qwen3-30B-A3B FSDP+EP", "NeMo AutoModel performance-summary", "qwen3-30b-a3b", (("seq_len", 4096),),
            (("nodes", 1), ("engine", "automodel")),
            (("dp", 8), ("ep", 8), ("zero", 3), ("micro_batch", 4), ("global_batch", 512), ("recompute", "full")),
            step_time=21.773, commit="36044ad (row 8d9bfb9)",
            assumed="full activation checkpointing = whole-block checkpoints (its apply_ac); FSDP2 without "
                    "reshard after forward modelled as zero 3; balanced routing (its fake balanced gate)"),
)


def h100_config(row: H100Row) -> SpecConfig:
    """The spec of an H100-era row: its model preset with ``model_keys``, the ``h100-sxm``
    cluster preset (bf16) with ``cluster``, and ``parallel`` (module docstring)."""
    values = {**model_preset(row.model), **dict(row.model_keys)}
    values.setdefault("max_positions", values["seq_len"])
    model = ModelConfig(name=row.model.replace("-", "_").replace(".", "_"), **values)
    cl = {**cluster_preset("h100-sxm", "bf16"), **dict(row.cluster)}
    cluster = ClusterConfig(name="h100", preset="h100-sxm", **cl)
    par = ParallelConfig(**dict(row.parallel))
    return SpecConfig(name=model.name, model=model, cluster=cluster, parallel=par,
                      train=TrainConfig(optimizer="adamw", **dict(row.train)))


#: Megatron-Bridge's ``pipeline_model_parallel_layout`` of its Llama 3 70B H100 FP8 recipe
#: (module docstring, row 10), ``"Et*2|(t*2|)*34,t*3|(t*2|)*3,tL"``: decoder layers per model
#: chunk in model order (chunk ``c * pp + r`` on rank ``r``; the embedding on chunk 0, the
#: loss with the final norm and the output layer on chunk 39), 80 layers in 8 x 5 chunks
LLAMA3_70B_H100_FP8_SPLIT: tuple[int, ...] = (2,) * 35 + (3,) + (2,) * 3 + (1,)

_TT_FP8 = ("float8 rows of the same tables as rows 4 and 5, vanilla TP; torchtitan 820504e's llama3_{8b,70b}.toml "
           "[float8]: enable_fsdp_float8_all_gather = false, filter_fqns = ['output'] (fp8_all_gather false, the "
           "LM head in bf16); seq 8192, no gradient accumulation, peak 884 TFLOPS (FP8 1,769 at the same 500 W "
           "ratio) as row 4")
#: the FP8 rows (issue 32; module docstring, rows 8-10): what :attr:`parcompile.analysis.estimate.Efficiency.fp8`
#: and ``fp8_rowwise`` of the h100-sxm preset were fitted to, and nothing else
FP8_ROWS: tuple[H100Row, ...] = (
    H100Row("Llama 3.1 70B FSDP+TP fp8 tensorwise", "torchtitan asyncTP_llama3_h100_2025-06", "llama3-70b",
            (("seq_len", 8192),), (("nodes", 32), *GRAND_TETON, ("engine", "compile")),
            (("tp", 8), ("dp", 32), ("zero", 3), ("sequence_parallel", True), ("micro_batch", 16),
             ("global_batch", 512), ("recompute", "full")),
            tokens_per_s_per_gpu=809.8, commit="2887250 (runs at 820504e, torchao 6243040)", assumed=_TT_FP8,
            train=(("precision", "fp8"), ("fp8_recipe", "tensorwise")), bf16_row="Llama 3.1 70B FSDP+TP"),
    H100Row("Llama 3.1 70B FSDP+TP fp8 rowwise", "torchtitan asyncTP_llama3_h100_2025-06", "llama3-70b",
            (("seq_len", 8192),), (("nodes", 32), *GRAND_TETON, ("engine", "compile")),
            (("tp", 8), ("dp", 32), ("zero", 3), ("sequence_parallel", True), ("micro_batch", 16),
             ("global_batch", 512), ("recompute", "full")),
            tokens_per_s_per_gpu=599.6, commit="2887250 (runs at 820504e, torchao 6243040)", assumed=_TT_FP8,
            train=(("precision", "fp8"), ("fp8_recipe", "rowwise")), bf16_row="Llama 3.1 70B FSDP+TP"),
    H100Row("Llama 3.1 8B FSDP+TP fp8 tensorwise", "torchtitan asyncTP_llama3_h100_2025-06", "llama3-8b",
            (("seq_len", 8192),), (("nodes", 8), *GRAND_TETON, ("engine", "compile")),
            (("tp", 8), ("dp", 8), ("zero", 3), ("sequence_parallel", True), ("micro_batch", 12),
             ("global_batch", 96), ("recompute", "selective")),
            tokens_per_s_per_gpu=5078.1, commit="2887250 (runs at 820504e, torchao 6243040)", assumed=_TT_FP8,
            train=(("precision", "fp8"), ("fp8_recipe", "tensorwise")), bf16_row="Llama 3.1 8B FSDP+TP"),
    H100Row("Llama 3.1 8B FSDP+TP fp8 rowwise", "torchtitan asyncTP_llama3_h100_2025-06", "llama3-8b",
            (("seq_len", 8192),), (("nodes", 8), *GRAND_TETON, ("engine", "compile")),
            (("tp", 8), ("dp", 8), ("zero", 3), ("sequence_parallel", True), ("micro_batch", 12),
             ("global_batch", 96), ("recompute", "selective")),
            tokens_per_s_per_gpu=3708.5, commit="2887250 (runs at 820504e, torchao 6243040)", assumed=_TT_FP8,
            train=(("precision", "fp8"), ("fp8_recipe", "rowwise")), bf16_row="Llama 3.1 8B FSDP+TP"),
    H100Row("Llama 3 70B TP4 PP8 VP5 fp8", "Megatron-Bridge performance-summary-archive", "llama3-70b",
            (("seq_len", 8192),), (("nodes", 8), ("tp_comm_overlap", True), ("overlap_p2p_comm", True)),
            (("tp", 4), ("pp", 8), ("dp", 2), ("zero", 1), ("sequence_parallel", True), ("micro_batch", 1),
             ("global_batch", 256), ("schedule", "interleaved_1f1b"), ("virtual_stages", 5),
             ("stage_layers", LLAMA3_70B_H100_FP8_SPLIT), ("recompute", "none"), ("reduce_dtype", "bf16")),
            tokens_per_s_per_gpu=1664, commit="4ab94df (docs/performance-summary-archive.md, 26.04.01 NeMo "
                                             "Container, LLAMA3_70B pre-training, DGX-H100 FP8)",
            assumed="FP8 = Transformer Engine's current scaling (per-tensor: fp8_recipe tensorwise); FSDP 0, "
                    "CP 1 and 64 GPUs give dp 2; from its recipe at 4ab94df (perf_recipes/llama/h100/llama3.py "
                    "llama3_70b_pretrain_64gpu_h100_fp8cs_config and the recipes it builds on): the distributed "
                    "optimizer (zero 1), sequence parallelism, no recomputation, every layer in FP8 "
                    "(first_last_layers_bf16 = False), its pipeline layout Et*2|(t*2|)*34,t*3|(t*2|)*3,tL "
                    "(stage_layers), tp_comm_overlap (userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192) and "
                    "overlap_p2p_comm (on with virtual stages), gradients reduced in bf16 "
                    "(_benchmark_common and _perf_precision in perf_recipes/_common.py: grad_reduce_in_fp32 = False "
                    "for ddp and mixed_precision, over the base recipe's True: reduce_dtype bf16, Megatron-Core's "
                    "grad buffer in bf16 at zero 1, param_and_grad_buffer.py group_params_for_buffers at "
                    "NVIDIA/Megatron-LM d98e8a6); not modelled: fp8_param_gather = True "
                    "(training/mixed_precision.py bf16_with_fp8_current_scaling_mixed: FP8 primary weights, "
                    "1-byte parameter buffer and all-gathers; the plan keeps bf16 weights and their FP8 cache, "
                    "more memory and gather bytes than the run)",
            train=(("precision", "fp8"), ("fp8_recipe", "tensorwise"))),
)


@dataclass(frozen=True)
class Fitted:
    """One number of :mod:`parcompile.analysis.estimate` fitted to published rows (every
    other number there is a measurement or a datasheet ratio named in its ``source``):
    where it lives (``table``, ``key``, ``field``: ``EFFICIENCY[key].field`` or
    ``ENGINES[key].field``) and the rows (:data:`ROWS` / :data:`H100_ROWS` names) it was
    fitted to."""

    table: str
    key: str
    field: str
    rows: tuple[str, ...]

    def value(self) -> float:
        """The number as the estimate uses it now."""
        from parcompile.analysis import estimate
        return getattr(getattr(estimate, self.table)[self.key], self.field)

    def label(self) -> str:
        return f"{self.table}[{self.key!r}].{self.field}"


#: the fitted numbers (``python benchmarks/cost_model.py`` prints them with their rows)
FITTED: tuple[Fitted, ...] = (
    Fitted("EFFICIENCY", "a100-80gb", "matmul", tuple(r.name for r in ROWS if not r.held_out)),
    Fitted("EFFICIENCY", "a100-80gb", "overlap", tuple(r.name for r in ROWS if not r.held_out)),
    Fitted("EFFICIENCY", "h100-sxm", "matmul", ("Llama 3.1 405B",)),
    Fitted("ENGINES", "megatron", "expert_host", ("GPT-OSS 120B",)),
    Fitted("ENGINES", "automodel", "elementwise", ("GPT-OSS 20B FSDP+EP", "Qwen3-30B-A3B FSDP+EP")),
    Fitted("EFFICIENCY", "h100-sxm", "fp8", tuple(r.name for r in FP8_ROWS if r.bf16_row and
                                                   dict(r.train)["fp8_recipe"] == "tensorwise")),
    Fitted("EFFICIENCY", "h100-sxm", "fp8_rowwise",
           tuple(r.name for r in FP8_ROWS if dict(r.train)["fp8_recipe"] == "rowwise")),
    # the clocks of the GEMM-rate model (analysis/gemm.py) the step estimate's GEMMs run at
    Fitted("EFFICIENCY", "a100-80gb", "gemm_clock", tuple(r.name for r in ROWS if not r.held_out)),
    Fitted("EFFICIENCY", "h100-sxm", "gemm_clock", tuple(r.name for r in H100_ROWS)),
    Fitted("EFFICIENCY", "h100-sxm", "fp8_clock", tuple(r.name for r in FP8_ROWS
                                                        if dict(r.train)["fp8_recipe"] == "tensorwise")),
    Fitted("EFFICIENCY", "h100-sxm", "fp8_rowwise_clock",
           tuple(r.name for r in FP8_ROWS if dict(r.train)["fp8_recipe"] == "rowwise")),
)
