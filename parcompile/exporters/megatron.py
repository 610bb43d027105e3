"""``parcompile export --to megatron``: Megatron-LM (core_v0.19) ``pretrain_gpt.py`` arguments
as a ``torchrun`` shell command (:func:`megatron_args`, :func:`megatron_env`,
:func:`megatron_errors`)."""

from __future__ import annotations

import shlex
from typing import Callable

from parcompile.core.recompute import is_module_list
from parcompile.config.schema import DEFAULT_BUCKET_SIZE
from parcompile.exporters.common import (Export, comments, common_notes, degrees, dp_sharding, fmt_num, grad_reduce_dtype, layout_line,
                                      placement_errors,
                                      reduces_over_dp, stage_split)
from parcompile.exporters.model_keys import model_key_errors
from parcompile.exporters.offload_hsdp import megatron_offload_hsdp, megatron_offload_hsdp_errors
from parcompile.ir.fp8 import gathers_fp8
from parcompile.ir.ops import Trait
from parcompile.ir.ops.attention import attention_kernel_for
from parcompile.plan import Plan

#: ``add(flag, value=None)``: appends one argument (:func:`megatron_args`)
_Add = Callable[..., None]


def megatron_accounted_split(split: list[int], pp: int) -> tuple[bool, bool] | None:
    """``(embedding, loss)``: Megatron-Core's ``--account-for-embedding-in-pipeline-split``
    and ``--account-for-loss-in-pipeline-split`` that give exactly ``split`` (decoder
    layers per model chunk, model order, ``pp * v`` entries), or None when no pair does.

    Source: Megatron-LM ``megatron/core/transformer/transformer_block.py``
    ``get_num_layers_to_build`` (core_v0.16.1, 55ac7082517c3878ae653c07c09c534b8aed49f6; the
    same at d98e8a64ddf34856e74b24714e3bedb2f5a39553): the embedding (the loss) counts as one
    layer, ``layers + e + l`` is split evenly over the pipeline ranks and their ``v``
    virtual stages, and the first (last) model chunk builds one decoder layer fewer, so
    Llama 3.1 405B's 126 layers on pp 16 x v 8 give ``[0, 1, ..., 1, 0]`` (Llama 3 paper,
    section 3.3.2). The decoder-first/last flags cannot say 0 (``num_layers_in_first_pipeline_stage
    must be larger than 0``, transformer_config.py) and with ``v > 1`` set whole stages."""
    chunks = len(split)
    if chunks < 2 or chunks % pp:
        return None
    for e, l in ((True, True), (True, False), (False, True)):
        total = sum(split) + e + l
        if total % chunks:
            continue
        q = total // chunks
        want = [q] * chunks
        want[0] -= e
        want[-1] -= l
        if want == list(split) and min(want) >= 0:
            return e, l
    return None


def megatron_layout(split: list[int]) -> str:
    """Megatron-Core's ``--pipeline-model-parallel-layout`` string for ``split`` (decoder
    layers per model chunk, model order): ``E`` the embedding, ``t`` a decoder layer, ``L``
    the loss (with the final norm and the output layer), chunks split by ``|``
    (arguments.py's help, d98e8a64ddf34856e74b24714e3bedb2f5a39553)."""
    parts = ["t" * n for n in split]
    parts[0] = "E" + parts[0]
    parts[-1] += "L"
    return "|".join(parts)



def megatron_args(plan: Plan) -> tuple[list[tuple[str, str | None]], list[str]]:
    """Megatron-LM ``pretrain_gpt.py`` arguments for ``plan`` as ``(flag, value or None)``
    pairs in a fixed order, and the notes: the steps below in turn, each adding its flags
    (``add(flag, value)``) and notes."""
    a: list[tuple[str, str | None]] = []
    notes = common_notes(plan, "Megatron-LM")

    def add(flag: str, value=None) -> None:
        # a tuple: an argument of several values (``nargs``), written as separate words
        a.append((flag, None if value is None else tuple(map(str, value)) if isinstance(value, tuple) else str(value)))

    _megatron_parallel_flags(plan, add, notes)
    _megatron_pipeline_flags(plan, add, notes)
    _megatron_memory_flags(plan, add, notes)
    add("--micro-batch-size", plan.config.parallel.micro_batch)   # batch
    add("--global-batch-size", plan.config.parallel.global_batch)
    _megatron_model_flags(plan, add, notes)
    _megatron_mla_flags(plan, add, notes)
    _megatron_moe_flags(plan, add, notes)
    _megatron_vocab_flags(plan, add, notes)
    _megatron_precision_flags(plan, add, notes)
    _megatron_optimizer_flags(plan, add, notes)
    _megatron_run_flags(plan, add, notes)
    return a, notes


def _megatron_parallel_flags(plan: Plan, add: _Add, notes: list[str]) -> None:
    """The parallel sizes: tensor, pipeline, context, expert; sequence parallelism."""
    par, m = plan.config.parallel, plan.config.model
    deg = degrees(plan)
    add("--tensor-model-parallel-size", deg["tp"])
    add("--pipeline-model-parallel-size", deg["pp"])
    add("--context-parallel-size", deg["cp"])
    if m.experts > 0 or deg["ep"] > 1:
        add("--expert-model-parallel-size", deg["ep"])
        add("--expert-tensor-parallel-size", deg["expert_tp"])
    if par.sequence_parallel:
        add("--sequence-parallel")
    # cluster.tp_comm_overlap: Transformer Engine's userbuffers (ModelParallelConfig.tp_comm_overlap,
    # a flag through ArgumentGroupFactory; arguments.py asserts sequence parallelism with it,
    # core_v0.19.0): the estimate overlaps only where it applies (estimate.overlaps_tp)
    if plan.config.cluster.tp_comm_overlap:
        if par.sequence_parallel and deg["tp"] > 1:
            add("--tp-comm-overlap")
        else:
            notes.append("tp_comm_overlap: off (Megatron-LM overlaps tensor-parallel communication only with "
                         "sequence parallelism and tp > 1)")


def _megatron_pipeline_flags(plan: Plan, add: _Add, notes: list[str]) -> None:
    """The pipeline: virtual stages, the schedule, uneven stage splits, the rank order."""
    par, m = plan.config.parallel, plan.config.model
    deg = degrees(plan)
    sched = par.pipeline_schedule
    split = stage_split(plan)
    accounted = megatron_accounted_split(split, deg["pp"]) if len(set(split)) > 1 else None
    if deg["virtual_stages"] > 1:
        add("--num-virtual-stages-per-pipeline-rank", deg["virtual_stages"])
        slots = m.layers + sum(accounted or ())   # the embedding and the loss count as layers
        notes.append("Megatron-LM releases before core 0.11 take "
                     f"--num-layers-per-virtual-pipeline-stage {slots // (deg['pp'] * deg['virtual_stages'])} "
                     "instead of --num-virtual-stages-per-pipeline-rank")
        if par.microbatch_group_size is not None:
            add("--microbatch-group-size-per-virtual-pipeline-stage", par.microbatch_group_size)
        # overlap_p2p_comm is Megatron-LM's default with virtual stages (--no-overlap-p2p-communication,
        # arguments.py core_v0.19.0); without it interleaving needs pp > 2 there
        if not plan.config.cluster.overlap_p2p_comm and deg["pp"] > 2:
            add("--no-overlap-p2p-communication")
        elif not plan.config.cluster.overlap_p2p_comm:
            notes.append("overlap_p2p_comm = false: Megatron-LM overlaps the interleaved pipeline's transfers with "
                         "compute at pp 2 (it refuses --no-overlap-p2p-communication there); the estimate kept them "
                         "blocking: set cluster.overlap_p2p_comm = true to estimate what it runs")
    elif plan.config.cluster.overlap_p2p_comm and deg["pp"] > 1:
        notes.append("overlap_p2p_comm: Megatron-LM overlaps pipeline transfers only with virtual stages "
                     "(interleaved 1F1B); this 1F1B run blocks on them, as the estimate assumed")
    if sched.forwards_first:
        notes.append("schedule gpipe: Megatron-LM has no GPipe schedule; it runs 1F1B (the same bubble, "
                     "fewer micro-batches in flight)")
    elif sched.split_backward:
        notes.append("schedule zero_bubble: mainline Megatron-LM has no zero-bubble schedule (the sail-sg "
                     "zero-bubble fork adds one); exported as 1F1B")
    elif sched.rounds and deg["virtual_stages"] == 1:
        notes.append("schedule interleaved_1f1b with one virtual stage is 1F1B")
    if par.stage_layers is not None and len(set(split)) > 1:
        middle = split[1:-1]
        if deg["virtual_stages"] == 1 and len(set(middle)) <= 1 and len(split) > 1 and min(split) > 0:
            add("--decoder-first-pipeline-num-layers", split[0])
            add("--decoder-last-pipeline-num-layers", split[-1])
        elif accounted is not None:
            if accounted[0]:
                add("--account-for-embedding-in-pipeline-split")
            if accounted[1]:
                add("--account-for-loss-in-pipeline-split")
        else:
            notes.append(f"stage_layers {split}: express this split with --pipeline-model-parallel-layout "
                         f"{megatron_layout(split)!r} (Megatron-Core 0.13+); first/last-stage flags cannot")
    if par.order != "tp-cp-ep-dp-pp":
        notes.append(f"order {par.order}: Megatron-LM's default rank order is tp-cp-ep-dp-pp "
                     "(--use-tp-pp-dp-mapping gives tp-cp-ep-pp-dp); other orders are not expressible")


def _megatron_memory_flags(plan: Plan, add: _Add, notes: list[str]) -> None:
    """ZeRO (the distributed optimizer, FSDP2), the gradient buckets and recomputation."""
    par = plan.config.parallel
    deg = degrees(plan)
    # ZeRO: Megatron's distributed optimizer (states sharded) or, with sharded parameters, FSDP2
    dps = dp_sharding(plan)
    if dps.shards_optimizer_states:
        if not dps.shards_parameters:
            add("--use-distributed-optimizer")
        if dps.shards_gradients and not dps.shards_parameters:
            notes.append("zero 2: Megatron's distributed optimizer shards optimizer states and reduce-scatters "
                         "gradients, but keeps a full gradient buffer per rank (ZeRO-1 memory)")
        if dps.shards_parameters:
            # core_v0.19.0 validate_args: FSDP2 needs no gradient-accumulation fusion, a
            # torch_dist / torch_dcp checkpoint format (torch_dist is the default)
            add("--use-torch-fsdp2")
            add("--no-gradient-accumulation-fusion")
            notes.append("zero 3: exported as --use-torch-fsdp2 (parameters, gradients and optimizer states "
                         "sharded); it does not work with pipeline parallelism" if deg["pp"] > 1 else
                         "zero 3: exported as --use-torch-fsdp2 (parameters, gradients and optimizer states sharded)")
    megatron_offload_hsdp(plan, add)   # HSDP's optimizer instances, optimizer offload (exporters/offload_hsdp.py)
    # gradient buckets: Megatron's DDP counts --ddp-bucket-size in elements and overlaps the
    # reduction with the backward only with --overlap-grad-reduce
    if reduces_over_dp(plan) and not dps.shards_parameters:
        if par.bucket_size:
            add("--overlap-grad-reduce")
            add("--ddp-bucket-size", -(-par.bucket_size // 4))   # elements, rounded up
        else:
            notes.append("bucket_size 0: without --overlap-grad-reduce Megatron-LM reduces the gradients after "
                         "the backward, in one bucket")
    elif reduces_over_dp(plan) and par.bucket_size != DEFAULT_BUCKET_SIZE:
        notes.append(f"bucket_size {par.bucket_size}: torch FSDP2 (zero 3) reduce-scatters each wrapped layer's "
                     "gradients on its own; --ddp-bucket-size does not apply")
    # recompute
    if par.recompute == "full":
        add("--recompute-granularity", "full")
        add("--recompute-method", "uniform")
        add("--recompute-num-layers", 1)
    elif par.recompute == "selective":
        add("--recompute-granularity", "selective")
    elif is_module_list(par.recompute):
        # Megatron-Core's module list (transformer_config.py recompute_modules, read with granularity selective)
        add("--recompute-granularity", "selective")
        add("--recompute-modules", tuple(par.recompute))


#: the kernels of the plan's attention choice (parcompile.core.attention ATTENTION_KERNELS, engine
#: megatron) -> Megatron-Core's ``AttnBackend`` member that runs it (megatron/core/transformer/
#: enums.py at core_v0.19.0 5be9626: ``fused`` is Transformer Engine's cuDNN fused attention,
#: ``unfused`` the spelled-out softmax)
MEGATRON_ATTN_BACKENDS = {"cudnn": "fused", "unfused": "unfused"}


def attention_backend(plan: Plan) -> str:
    """``--attention-backend`` for ``plan``: the kernel the plan priced for Megatron-LM, the one
    decision of the attention op (:func:`parcompile.ir.ops.attention.attention_kernel_for`
    with engine ``megatron``), for the first layer's attention core (every layer's core is the
    same kernel under Megatron: the windows and sinks Megatron refuses are errors of
    :data:`parcompile.exporters.model_keys.MEGATRON`). No attention op: ``unfused``."""
    for nd in plan.graph.nodes():
        if nd.has_trait(Trait.ATTENTION):
            return MEGATRON_ATTN_BACKENDS[attention_kernel_for(nd.op.attr_map, "megatron").name]
    return "unfused"


def _megatron_model_flags(plan: Plan, add: _Add, notes: list[str]) -> None:
    """The dense model: shape, attention, norms, activation, positions, biases, dropout."""
    m = plan.config.model
    # model
    add("--num-layers", m.layers)
    add("--hidden-size", m.hidden)
    add("--ffn-hidden-size", m.ffn_hidden)
    add("--num-attention-heads", m.heads)
    if m.head_dim != m.hidden // m.heads and not m.kv_lora_rank:   # (MLA's head widths: below)
        add("--kv-channels", m.head_dim)
    if m.kv_heads != m.heads:
        add("--group-query-attention")
        add("--num-query-groups", m.kv_heads)
    add("--seq-length", m.seq_len)
    add("--max-position-embeddings", m.max_positions)
    add("--normalization", "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm")
    add("--norm-epsilon", m.norm_eps)
    if m.activation == "swiglu":
        add("--swiglu")
    if m.zero_centered_gamma:   # TransformerConfig.layernorm_zero_centered_gamma, whose argparse_meta names
        add("--apply-layernorm-1p")   # this flag (transformer_config.py line 199, core_v0.19.0 5be9626)
    if m.position == "rope":
        add("--position-embedding-type", "rope")
        add("--rotary-base", fmt_num(m.rope_theta))
        if m.rope_type == "llama3":   # Megatron-Core RotaryEmbedding._apply_scaling (Llama 3.x)
            add("--use-rope-scaling")
            add("--rope-scaling-factor", fmt_num(m.rope_scaling_factor))
        if m.rotary_fraction != 1.0:
            add("--rotary-percent", m.rotary_fraction)
    elif m.position == "learned":
        add("--position-embedding-type", "learned_absolute")
    else:
        add("--position-embedding-type", "none")
    if not m.bias:
        add("--disable-bias-linear")
        if m.qkv_bias:
            add("--add-qkv-bias")
    if not m.tie_embeddings:
        add("--untie-embeddings-and-output-weights")
    add("--attention-backend", attention_backend(plan))
    add("--attention-dropout", m.dropout)
    add("--hidden-dropout", m.dropout)
    # parallel_residual, sliding windows, soft-capping, ...: refused (model_keys.MEGATRON)
    if m.qk_norm:   # Megatron-Core's q_layernorm / k_layernorm over head_dim, of --normalization's kind
        add("--qk-layernorm")


def _megatron_mla_flags(plan: Plan, add: _Add, notes: list[str]) -> None:
    """Multi-latent attention (Megatron-Core's MLASelfAttention) and its YaRN RoPE."""
    m = plan.config.model
    if m.kv_lora_rank:   # Megatron-Core's MLASelfAttention; its --qk-layernorm is the latents' norms
        add("--multi-latent-attention")
        if m.q_lora_rank:
            add("--q-lora-rank", m.q_lora_rank)
        add("--kv-lora-rank", m.kv_lora_rank)
        add("--qk-head-dim", m.qk_nope_head_dim)
        add("--qk-pos-emb-head-dim", m.qk_rope_head_dim)
        add("--v-head-dim", m.v_head_dim)
        add("--qk-layernorm")
        if m.rope_type == "yarn":
            add("--rotary-scaling-factor", fmt_num(m.rope_scaling_factor))
            if m.rope_mscale:
                add("--mscale", fmt_num(m.rope_mscale))
            if m.rope_mscale_all_dim:
                add("--mscale-all-dim", fmt_num(m.rope_mscale_all_dim))
        if m.rope_interleave:
            notes.append("rope_interleave: Megatron-Core's MLA rotates the halves; a DeepSeek checkpoint's "
                         "interleaved RoPE rows are permuted by Megatron-Bridge's converter")


def _megatron_moe_flags(plan: Plan, add: _Add, notes: list[str]) -> None:
    """The mixture of experts: experts, router, shared experts, dense layers first."""
    m = plan.config.model
    if m.experts > 0:
        add("--num-experts", m.experts)
        add("--moe-router-topk", m.top_k)
        add("--moe-ffn-hidden-size", m.expert_ffn_hidden)
        add("--moe-aux-loss-coeff", m.router_aux_loss)
        if m.scoring_func == "sigmoid":
            # Megatron-Core: sigmoid scores, the top-k renormalised exactly when k > 1 (a
            # norm_topk_prob that says otherwise: megatron_errors)
            add("--moe-router-score-function", "sigmoid")
        elif not m.norm_topk_prob or m.top_k == 1:
            # the softmax over every expert, then the top-k, not renormalised (moe_utils.py
            # topk_routing_with_score_function, core_v0.19.0 5be9626): Megatron-Core's default (the
            # softmax over the top-k logits) renormalises, and at top_k 1 TransformerConfig.__post_init__
            # refuses it ("Please use --moe-router-pre-softmax when topk is 1", transformer_config.py
            # line 2328); parcompile's route gives a single expert its p (Switch), as pre-softmax does
            add("--moe-router-pre-softmax")
        if m.topk_method == "noaux_tc":   # DeepSeek-V3: the correction bias and group-limited top-k
            add("--moe-router-enable-expert-bias")
            notes.append("topk_method noaux_tc: --moe-router-enable-expert-bias also updates the bias between "
                         "steps (--moe-router-bias-update-rate); parcompile holds it fixed")
            if m.n_group > 1:
                add("--moe-router-num-groups", m.n_group)
                add("--moe-router-group-topk", m.topk_group)
        if m.routed_scaling_factor != 1.0:
            add("--moe-router-topk-scaling-factor", fmt_num(m.routed_scaling_factor))
        if m.shared_experts:
            add("--moe-shared-expert-intermediate-size", m.shared_experts * m.expert_ffn_hidden)
        if m.dense_layers:
            add("--moe-layer-freq", f"([0]*{m.dense_layers}+[1]*{m.layers - m.dense_layers})")


def _megatron_vocab_flags(plan: Plan, add: _Add, notes: list[str]) -> None:
    """The vocabulary: a NullTokenizer of the spec's size and its padding."""
    m = plan.config.model
    add("--tokenizer-type", "NullTokenizer")
    add("--vocab-size", m.vocab)
    add("--make-vocab-size-divisible-by", m.vocab_multiple)
    notes.append(f"vocabulary: NullTokenizer with --vocab-size {m.vocab} stands in for your tokenizer; Megatron "
                 f"pads the vocabulary to a multiple of {m.vocab_multiple} x tp ({plan.data['model']['padded_vocab']})")


def _megatron_bf16_layer_flags(plan: Plan, add: _Add) -> str:
    """`train.fp8_bf16_layers_start` / `_end` as Megatron-LM's ``--first-last-layers-bf16
    --num-layers-at-start-in-bf16 N --num-layers-at-end-in-bf16 M`` (TransformerConfig fields
    ``first_last_layers_bf16`` (default False), ``num_layers_at_start_in_bf16`` and
    ``num_layers_at_end_in_bf16`` (default 1 each: both are always written),
    ``megatron/core/transformer/transformer_config.py`` lines 628-637 at core_v0.19.0
    (NVIDIA/Megatron-LM 5be9626709af2722333bf54797c954c09edeada3; the same at d98e8a64, lines
    649-658), flags made from the fields by ``ArgumentGroupFactory(TransformerConfig)``,
    ``megatron/training/arguments.py`` line 2290 there, not excluded); the flags only when a
    layer is kept. Returns the note."""
    tr = plan.config.train
    start, end = tr.fp8_bf16_layers_start, tr.fp8_bf16_layers_end
    if not start and not end:
        return "every layer in FP8 (--first-last-layers-bf16 off, its default)"
    add("--first-last-layers-bf16")
    add("--num-layers-at-start-in-bf16", str(start))
    add("--num-layers-at-end-in-bf16", str(end))
    return f"the first {start} and last {end} layers' GEMMs in bf16 (--first-last-layers-bf16)"


def _megatron_precision_flags(plan: Plan, add: _Add, notes: list[str]) -> None:
    """The precision: the model's dtype and the dtype gradients are reduced in."""
    m = plan.config.model
    if m.dtype == "bf16":
        add("--bf16")
    elif m.dtype == "fp16":
        add("--fp16")
    tr = plan.config.train
    if tr is not None and tr.precision == "fp8":
        # Megatron-Core core_v0.19.0 (5be9626) TransformerConfig: fp8 (--fp8-format e4m3 | hybrid),
        # fp8_recipe (--fp8-recipe tensorwise | delayed | mxfp8 | blockwise | custom; "tensorwise" is
        # Transformer Engine's per-tensor current scaling); arguments.py --fp8-param-gather
        add("--fp8-format", "e4m3")
        if tr.fp8_recipe in ("tensorwise", "mxfp8"):
            add("--fp8-recipe", tr.fp8_recipe)
        if gathers_fp8(plan.config):
            add("--fp8-param-gather")
        kept = _megatron_bf16_layer_flags(plan, add)
        notes.append("precision fp8: E4M3 for weights, activations and gradients (torchao's recipes; "
                     "--fp8-format hybrid would take E5M2 gradients); " + kept)
    if plan.config.parallel.grad_dtype == "bf16":
        # parallel.grad_dtype: Megatron-Core's grad buffer in bf16 (param_and_grad_buffer.py grad_dtype)
        add("--grad-reduce-in-bf16")
    elif plan.config.parallel.reduce_dtype == "bf16":
        # Megatron-Core's grad buffer is in the parameters' dtype without grad_reduce_in_fp32, at
        # every ZeRO level (param_and_grad_buffer.py group_params_for_buffers, analysis/estimate.py
        # grad_element_bytes): the plan of engine megatron counts it so
        add("--grad-reduce-in-bf16")
        notes.append("reduce_dtype bf16: --grad-reduce-in-bf16 keeps Megatron-LM's gradient buffer in bf16 "
                     "across the micro-batches (the plan's engine megatron counts it so); the generated program "
                     + ("adds each micro-batch's reduced bf16 gradients into fp32 shards"
                        if grad_reduce_dtype(plan) == "bf16" else "keeps fp32 buffers at this zero level"))
    elif grad_reduce_dtype(plan) == "fp16":
        notes.append("reduce_dtype fp16: Megatron-LM reduces fp16 models' gradients in fp32 (its main_grad "
                     "buffer); not expressible")


def _megatron_optimizer_flags(plan: Plan, add: _Add, notes: list[str]) -> None:
    """The optimizer, the learning-rate schedule and gradient clipping."""
    tr = plan.config.train
    # optimizer and schedule
    if tr.optimizer == "sgd":
        add("--optimizer", "sgd")
    else:
        add("--optimizer", "adam")
        add("--adam-beta1", tr.betas[0])
        add("--adam-beta2", tr.betas[1])
        add("--adam-eps", tr.eps)
        if tr.optimizer == "adam":
            notes.append("optimizer adam: Megatron's adam decays weights decoupled (AdamW); parcompile's adam "
                         "adds weight decay to the gradient (L2)")
    add("--lr", tr.lr)
    add("--min-lr", tr.min_lr)
    add("--lr-decay-style", tr.lr_schedule)
    add("--lr-warmup-iters", tr.warmup_steps)
    add("--weight-decay", tr.weight_decay)
    add("--clip-grad", tr.grad_clip)


def _megatron_run_flags(plan: Plan, add: _Add, notes: list[str]) -> None:
    """The run: steps, seed, logging, data, checkpoints."""
    tr = plan.config.train
    add("--train-iters", tr.steps)
    add("--seed", tr.seed)
    add("--log-interval", tr.log_every)
    if tr.data == "synthetic":
        add("--mock-data")
    if tr.checkpoint_dir and tr.checkpoint_every:
        add("--save", tr.checkpoint_dir)
        add("--save-interval", tr.checkpoint_every)


def megatron_export(plan: Plan) -> Export:
    """``--to megatron``: the environment, ``torchrun ... pretrain_gpt.py`` and
    :func:`megatron_args` as a shell command; notes and errors (the model keys Megatron-LM does
    not carry, :func:`parcompile.exporters.model_keys.model_key_errors`, then
    :func:`megatron_errors`) as comments."""
    cfg = plan.config
    args, notes = megatron_args(plan)
    cl = cfg.cluster
    env = megatron_env(plan)
    launch = "".join(f"{k}={v} " for k, v in env.items())
    launch += f"torchrun --nnodes {cl.nodes} --nproc-per-node {cl.gpus_per_node}"
    if cl.nodes > 1:
        launch += ' --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"'
        notes.append("multi-node: run the same command on every node with MASTER_ADDR/MASTER_PORT set")
    launch += " pretrain_gpt.py"
    errors = model_key_errors(plan, "megatron") + megatron_errors(plan)
    lines = [f"# Megatron-LM (core_v0.19) arguments for `{cfg.name}`: {layout_line(plan)}",
             "# (exported by parcompile; run from a Megatron-LM checkout)"]
    lines += comments("error", errors)
    lines += comments("note", notes)
    lines.append(launch + " \\")
    body = [f"    {flag}" + ("" if v is None else " " + " ".join(map(shlex.quote, v)) if isinstance(v, tuple)
                              else f" {shlex.quote(v)}") for flag, v in args]
    lines += [b + " \\" for b in body[:-1]] + [body[-1]]
    return Export("megatron", "\n".join(lines) + "\n", notes, launch, f"{cfg.name}_megatron.sh", errors)


def megatron_env(plan: Plan) -> dict[str, str]:
    """The environment Megatron-LM's ``validate_args`` (core_v0.19.0,
    megatron/training/arguments.py) requires as launched: ``CUDA_DEVICE_MAX_CONNECTIONS=1``
    with tensor or context parallelism on GPUs before Blackwell (it asserts it there; on
    Blackwell it is harmless), except under ``--use-torch-fsdp2`` (zero 3), which asserts the
    opposite (the variable not ``1``) and only warns about tp/cp. Then what the cluster's
    software stack exports in parcompile's own launchers (config/presets.py ``ACCELERATORS``
    ``launch_env``: on Ascend, ``HCCL_CONNECT_TIMEOUT``)."""
    deg = degrees(plan)
    env = {}
    if (deg["tp"] > 1 or deg["cp"] > 1) and not dp_sharding(plan).shards_parameters:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    env.update({var: value for var, value, _ in plan.config.cluster.accelerator.launch_env})
    return env


def megatron_model_errors(m) -> list[str]:
    """The values of model keys Megatron-LM carries that its flags cannot state: RoPE
    scalings (linear or YaRN outside multi-latent attention; Llama 3 scaling with other than
    its fixed low/high frequency factors and 8192 original positions; MLA's YaRN with other
    than 4096 original positions), an MLP other than GeLU or SwiGLU, and top-k sigmoid scores
    normalised otherwise than Megatron-Core's (exactly when top_k > 1)."""
    errors = []
    if m.position == "rope" and m.rope_type == "llama3" and (
            float(m.rope_low_freq_factor), float(m.rope_high_freq_factor),
            m.rope_original_max_positions or 8192) != (1.0, 4.0, 8192):
        # megatron/core/models/common/embeddings/rotary_pos_embedding.py: _apply_scaling is called
        # with the factor only; low 1, high 4, original 8192 are fixed
        errors.append(f"rope_type llama3 with rope_low_freq_factor {fmt_num(m.rope_low_freq_factor)}, "
                      f"rope_high_freq_factor {fmt_num(m.rope_high_freq_factor)}, rope_original_max_positions "
                      f"{m.rope_original_max_positions}: Megatron-Core's --use-rope-scaling fixes them at 1, 4 "
                      "and 8192")
    if m.position == "rope" and m.rope_type in ("linear", "yarn") and not m.kv_lora_rank:
        errors.append(f"rope_type {m.rope_type}: pretrain_gpt.py's RoPE flags scale as Llama 3.x "
                      "(--use-rope-scaling) only for this model; it would train unscaled RoPE")
    if m.kv_lora_rank and m.rope_type == "yarn" and (m.rope_original_max_positions or 4096) != 4096:
        # MLATransformerConfig.original_max_position_embeddings = 4096 has no flag (transformer_config.py,
        # core_v0.19.0 5be9626; _add_mla_args writes none)
        errors.append(f"rope_original_max_positions {m.rope_original_max_positions}: Megatron-Core's multi-latent "
                      "attention YaRN fixes its original positions at 4096 (MLATransformerConfig, no flag)")
    if m.activation in ("geglu", "relu"):
        # arguments.py core_v0.19.0: --swiglu, --squared-relu, --quick-geglu; activation_func has no flag
        errors.append(f"activation {m.activation}: pretrain_gpt.py's MLP is GeLU (the default), --swiglu, "
                      "--squared-relu or --quick-geglu; it has no " + ("GeGLU with tanh GeLU" if m.activation == "geglu"
                                                                       else "plain ReLU"))
    if m.experts and m.scoring_func == "sigmoid" and m.norm_topk_prob != (m.top_k > 1):
        # moe_utils.py topk_routing_with_score_function (core_v0.19.0 5be9626): the sigmoid top-k
        # divided by its sum exactly when topk > 1; parcompile's route whenever norm_topk_prob
        errors.append(f"norm_topk_prob = {'true' if m.norm_topk_prob else 'false'} with top_k {m.top_k} and "
                      "sigmoid scores: Megatron-Core renormalises the top-k sigmoid scores exactly when top_k > 1 "
                      f"(no flag); set norm_topk_prob = {'false' if m.norm_topk_prob else 'true'} for its weights")
    return errors


def megatron_errors(plan: Plan) -> list[str]:
    """What Megatron-LM core_v0.19's ``validate_args`` refuses for this plan (so the export
    cannot run the plan's layout): ``--use-torch-fsdp2`` (zero 3) with pipeline or expert
    parallelism, with fp16, or with tied embeddings (megatron/training/arguments.py,
    the ``if args.use_torch_fsdp2:`` block); and the values of carried model keys its flags
    cannot state (:func:`megatron_model_errors`). The model keys it does not carry at all are
    :data:`parcompile.exporters.model_keys.MEGATRON`'s."""
    cfg = plan.config
    deg = degrees(plan)
    errors = megatron_model_errors(cfg.model) + placement_errors(plan, "Megatron-LM") + megatron_offload_hsdp_errors(plan)
    if dp_sharding(plan).shards_parameters:
        if deg["pp"] > 1:
            errors.append(f"zero 3 with pp {deg['pp']}: Megatron-LM's --use-torch-fsdp2 is not supported with "
                          "pipeline parallelism (validate_args); use zero 1 or 2 (--use-distributed-optimizer)")
        if deg["ep"] > 1:
            errors.append(f"zero 3 with ep {deg['ep']}: --use-torch-fsdp2 is not supported with expert parallelism")
        if cfg.model.dtype == "fp16":
            errors.append("zero 3 with dtype fp16: --use-torch-fsdp2 does not support fp16; use bf16")
        if cfg.model.tie_embeddings:
            errors.append("zero 3 with tie_embeddings: --use-torch-fsdp2 requires "
                          "--untie-embeddings-and-output-weights, a different model")
    if cfg.train is not None and cfg.train.precision == "fp8":
        per_stage = cfg.model.layers // max(1, deg["pp"])
        for key, flag in (("fp8_bf16_layers_start", "--num-layers-at-start-in-bf16"),
                          ("fp8_bf16_layers_end", "--num-layers-at-end-in-bf16")):
            n = getattr(cfg.train, key)
            if n > per_stage:
                # Megatron-Core TransformerConfig.__post_init__ (transformer_config.py lines 1411-1420
                # at core_v0.19.0, 5be9626):
                # each count "must be between 0 and number of layers per pipeline stage"
                errors.append(f"{key} {n}: Megatron-Core allows {flag} up to the layers per pipeline stage "
                              f"(layers // pp = {per_stage}); keep fewer layers in bf16")
    if cfg.train is not None and cfg.train.precision == "fp8" and cfg.train.fp8_recipe == "rowwise":
        errors.append("fp8_recipe rowwise: Megatron-Core's --fp8-recipe has tensorwise, delayed, mxfp8 and blockwise "
                      "(1x128 and 128x128 blocks) scaling, none per row; use fp8_recipe tensorwise or mxfp8, or "
                      "export --to torchtitan --torchtitan-version 0.2")
    return errors
