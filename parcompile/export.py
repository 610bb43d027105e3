"""``parcompile export``: the same training plan for the engines people already run.

Three targets, each a pure function of a compiled :class:`~parcompile.plan.Plan` (its
config and plan.json dict), each returning an :class:`Export`: the text, the notes about
what the target cannot express (or expresses differently), and a launch line.

- ``megatron``: a shell command, ``torchrun ... pretrain_gpt.py`` followed by Megatron-LM's
  arguments (``--tensor-model-parallel-size`` ...), one per line; notes are ``#`` comments.
- ``torchtitan``: a torchtitan 0.2 job config (TOML: ``[parallelism]``, ``[training]``,
  ``[activation_checkpoint]``...); notes are ``#`` comments.
- ``deepspeed``: a DeepSpeed JSON config (``train_batch_size``, ``zero_optimization``,
  ``pipeline``...); JSON has no comments, so the notes and the ``deepspeed`` launcher line
  are in :attr:`Export.notes` / :attr:`Export.launch` (the CLI prints them on stderr).

Only training specs export: the three targets are training engines, so a ``serve`` spec
is refused with a :class:`~parcompile.diagnostics.SpecError` at its ``serve`` block
(:func:`export`). The output is deterministic: the same spec gives the same bytes.

What maps to what (``docs/export.md`` has the full table): ZeRO 1 is Megatron's
``--use-distributed-optimizer``, DeepSpeed's ``zero_optimization.stage`` takes the stage
as is, and torchtitan shards with FSDP2 (``data_parallel_shard_degree = dp``) for any
stage >= 1 (FSDP shards parameters too, so it is ZeRO-3 storage; the note says so).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from parcompile.config.schema import DEFAULT_BUCKET_SIZE
from parcompile.core.dtypes import GRAD_BYTES
from parcompile.config.text import plural
from parcompile.diagnostics import Diagnostic, SpecError
from parcompile.plan import Plan

TARGETS = ("megatron", "torchtitan", "deepspeed")

#: parcompile schedule -> torch.distributed.pipelining schedule name (torchtitan), for one
#: stage per rank (``virtual_stages == 1``) and for several
TORCHTITAN_SCHEDULE = {
    ("gpipe", False): "GPipe", ("1f1b", False): "1F1B", ("zero_bubble", False): "1F1B",
    ("gpipe", True): "LoopedBFS", ("1f1b", True): "Interleaved1F1B",
    ("interleaved_1f1b", True): "Interleaved1F1B", ("zero_bubble", True): "InterleavedZeroBubble",
    ("interleaved_1f1b", False): "1F1B",
}


@dataclass
class Export:
    """One export: ``text`` (the file), ``notes`` (what the target cannot express or
    expresses differently, one sentence each), ``launch`` (the command that runs it),
    ``filename`` (a conventional name for the file)."""

    target: str
    text: str
    notes: list[str] = field(default_factory=list)
    launch: str = ""
    filename: str = ""


def export(plan: Plan, target: str) -> Export:
    """Export ``plan`` for ``target`` (one of :data:`TARGETS`).

    Raises:
        ValueError: an unknown target.
        SpecError: a ``serve`` spec (the targets are training engines).
    """
    if target not in TARGETS:
        raise ValueError(f"unknown export target {target!r}; choose one of {', '.join(TARGETS)}")
    cfg = plan.config
    if cfg.workload != "train":
        raise SpecError([Diagnostic(
            "error", f"`export --to {target}` needs a training spec; this spec has a `serve` block",
            cfg.span("serve"),
            help=f"export the spec that trains the model (a `train` block); serve it with `parcompile run`",
            note="Megatron-LM's pretrain_gpt.py, torchtitan's train config and DeepSpeed's JSON config "
                 "describe training runs; none of them has an inference deployment to map this plan to",
            code="export-serve")])
    return {"megatron": _megatron, "torchtitan": _torchtitan, "deepspeed": _deepspeed}[target](plan)


# ---------------------------------------------------------------------------------------------
# shared facts


def _degrees(plan: Plan) -> dict:
    return plan.data["degrees"]


def _common_notes(plan: Plan, target: str) -> list[str]:
    """Notes every target shares: data and the model code are the engine's own."""
    cfg = plan.config
    notes = []
    if cfg.train.data != "synthetic":
        notes.append(f"data: the spec reads `{cfg.train.data}`; point the {target} run at your own "
                     "tokenized dataset")
    return notes


def _reduces_over_dp(plan: Plan) -> bool:
    """Whether some gradient is reduced over data parallelism (dp * cp or expert_dp > 1)."""
    deg = plan.data["degrees"]
    return deg["dp"] * deg["cp"] > 1 or deg.get("expert_dp", 1) > 1


def _reduce_dtype(plan: Plan) -> str:
    """The dtype the plan reduce-scatters gradient buckets in: ``parallel.reduce_dtype`` where
    it applies (zero 2, 3 reducing per micro-batch), else fp32
    (:func:`parcompile.analysis.buckets.bucket_element_bytes`)."""
    from parcompile.analysis.buckets import bucket_element_bytes

    par = plan.config.parallel
    return "fp32" if bucket_element_bytes(par.zero, par.schedule, par.reduce_dtype) == GRAD_BYTES else par.reduce_dtype


def _stage_split(plan: Plan) -> list[int]:
    """Layers per model chunk in model order (``pp * virtual_stages`` entries)."""
    par = plan.config.parallel
    return list(par.layers_per_chunk(plan.config.model.layers))


# ---------------------------------------------------------------------------------------------
# Megatron-LM


def megatron_args(plan: Plan) -> tuple[list[tuple[str, str | None]], list[str]]:
    """Megatron-LM ``pretrain_gpt.py`` arguments for ``plan`` as ``(flag, value or None)``
    pairs in a fixed order, and the notes."""
    cfg = plan.config
    par, m, tr = cfg.parallel, cfg.model, cfg.train
    deg = _degrees(plan)
    sched = plan.data["schedule"]["name"]
    a: list[tuple[str, str | None]] = []
    notes = _common_notes(plan, "Megatron-LM")

    def add(flag: str, value=None) -> None:
        a.append((flag, None if value is None else str(value)))

    # parallelism
    add("--tensor-model-parallel-size", deg["tp"])
    add("--pipeline-model-parallel-size", deg["pp"])
    add("--context-parallel-size", deg["cp"])
    if m.experts > 0 or deg["ep"] > 1:
        add("--expert-model-parallel-size", deg["ep"])
        add("--expert-tensor-parallel-size", deg["expert_tp"])
    if par.sequence_parallel:
        add("--sequence-parallel")
    if deg["virtual_stages"] > 1:
        add("--num-virtual-stages-per-pipeline-rank", deg["virtual_stages"])
        notes.append("Megatron-LM releases before core 0.11 take "
                     f"--num-layers-per-virtual-pipeline-stage {m.layers // (deg['pp'] * deg['virtual_stages'])} "
                     "instead of --num-virtual-stages-per-pipeline-rank")
    if sched == "gpipe":
        notes.append("schedule gpipe: Megatron-LM has no GPipe schedule; it runs 1F1B (the same bubble, "
                     "fewer micro-batches in flight)")
    elif sched == "zero_bubble":
        notes.append("schedule zero_bubble: mainline Megatron-LM has no zero-bubble schedule (the sail-sg "
                     "zero-bubble fork adds one); exported as 1F1B")
    elif sched == "interleaved_1f1b" and deg["virtual_stages"] == 1:
        notes.append("schedule interleaved_1f1b with one virtual stage is 1F1B")
    split = _stage_split(plan)
    if par.stage_layers is not None and len(set(split)) > 1:
        middle = split[1:-1]
        if deg["virtual_stages"] == 1 and len(set(middle)) <= 1 and len(split) > 1:
            add("--decoder-first-pipeline-num-layers", split[0])
            add("--decoder-last-pipeline-num-layers", split[-1])
        else:
            notes.append(f"stage_layers {split}: express this split with --pipeline-model-parallel-layout "
                         "(Megatron-Core 0.13+); first/last-stage flags cannot")
    if par.order != "tp-cp-ep-dp-pp":
        notes.append(f"order {par.order}: Megatron-LM's default rank order is tp-cp-ep-dp-pp "
                     "(--use-tp-pp-dp-mapping gives tp-cp-ep-pp-dp); other orders are not expressible")
    # ZeRO
    if par.zero >= 1:
        if par.zero <= 2:
            add("--use-distributed-optimizer")
        if par.zero == 2:
            notes.append("zero 2: Megatron's distributed optimizer shards optimizer states and reduce-scatters "
                         "gradients, but keeps a full gradient buffer per rank (ZeRO-1 memory)")
        if par.zero == 3:
            add("--use-torch-fsdp2")
            notes.append("zero 3: exported as --use-torch-fsdp2 (parameters, gradients and optimizer states "
                         "sharded); it does not work with pipeline parallelism" if deg["pp"] > 1 else
                         "zero 3: exported as --use-torch-fsdp2 (parameters, gradients and optimizer states sharded)")
    # gradient buckets: Megatron's DDP counts --ddp-bucket-size in elements and overlaps the
    # reduction with the backward only with --overlap-grad-reduce
    if _reduces_over_dp(plan) and par.zero <= 2:
        if par.bucket_size:
            add("--overlap-grad-reduce")
            add("--ddp-bucket-size", -(-par.bucket_size // 4))   # elements, rounded up
        else:
            notes.append("bucket_size 0: without --overlap-grad-reduce Megatron-LM reduces the gradients after "
                         "the backward, in one bucket")
    elif _reduces_over_dp(plan) and par.bucket_size != DEFAULT_BUCKET_SIZE:
        notes.append(f"bucket_size {par.bucket_size}: torch FSDP2 (zero 3) reduce-scatters each wrapped layer's "
                     "gradients on its own; --ddp-bucket-size does not apply")
    # recompute
    if par.recompute == "full":
        add("--recompute-granularity", "full")
        add("--recompute-method", "uniform")
        add("--recompute-num-layers", 1)
    elif par.recompute == "selective":
        add("--recompute-granularity", "selective")
    # batch
    add("--micro-batch-size", par.micro_batch)
    add("--global-batch-size", par.global_batch)
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
    elif m.activation == "geglu":
        notes.append("activation geglu: pretrain_gpt.py's arguments have no GeGLU (--swiglu is the only gated MLP)")
    elif m.activation == "relu":
        notes.append("activation relu: pretrain_gpt.py's arguments have no plain ReLU (GeLU is the default)")
    if m.position == "rope":
        add("--position-embedding-type", "rope")
        add("--rotary-base", _num(m.rope_theta))
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
    add("--attention-backend", "flash" if m.attention == "flash" else "unfused")
    add("--attention-dropout", m.dropout)
    add("--hidden-dropout", m.dropout)
    if m.parallel_residual:
        notes.append("parallel_residual: pretrain_gpt.py has no parallel attention/MLP residual flag")
    if m.sliding_window:
        notes.append(f"sliding_window {m.sliding_window}: set --window-size for Transformer Engine attention")
    if m.qk_norm:   # Megatron-Core's q_layernorm / k_layernorm over head_dim, of --normalization's kind
        add("--qk-layernorm")
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
            add("--rotary-scaling-factor", _num(m.rope_scaling_factor))
            if m.rope_mscale:
                add("--mscale", _num(m.rope_mscale))
            if m.rope_mscale_all_dim:
                add("--mscale-all-dim", _num(m.rope_mscale_all_dim))
        if m.rope_interleave:
            notes.append("rope_interleave: Megatron-Core's MLA rotates the halves; a DeepSeek checkpoint's "
                         "interleaved RoPE rows are permuted by Megatron-Bridge's converter")
    if m.experts > 0:
        add("--num-experts", m.experts)
        add("--moe-router-topk", m.top_k)
        add("--moe-ffn-hidden-size", m.expert_ffn_hidden)
        add("--moe-aux-loss-coeff", m.router_aux_loss)
        if m.scoring_func == "sigmoid":
            # Megatron-Core: sigmoid scores, the top-k renormalised whenever k > 1
            add("--moe-router-score-function", "sigmoid")
            if not m.norm_topk_prob and m.top_k > 1:
                notes.append("norm_topk_prob = false with sigmoid scores: Megatron-Core always renormalises "
                             "the top-k sigmoid scores")
        elif not m.norm_topk_prob and m.top_k > 1:   # softmax over all experts, then top-k, not renormalised
            add("--moe-router-pre-softmax")
        if m.topk_method == "noaux_tc":   # DeepSeek-V3: the correction bias and group-limited top-k
            add("--moe-router-enable-expert-bias")
            notes.append("topk_method noaux_tc: --moe-router-enable-expert-bias also updates the bias between "
                         "steps (--moe-router-bias-update-rate); parcompile holds it fixed")
            if m.n_group > 1:
                add("--moe-router-num-groups", m.n_group)
                add("--moe-router-group-topk", m.topk_group)
        if m.routed_scaling_factor != 1.0:
            add("--moe-router-topk-scaling-factor", _num(m.routed_scaling_factor))
        if m.shared_experts:
            add("--moe-shared-expert-intermediate-size", m.shared_experts * m.expert_ffn_hidden)
        if m.dense_layers:
            add("--moe-layer-freq", f"([0]*{m.dense_layers}+[1]*{m.layers - m.dense_layers})")
    add("--tokenizer-type", "NullTokenizer")
    add("--vocab-size", m.vocab)
    add("--make-vocab-size-divisible-by", m.vocab_multiple)
    notes.append(f"vocabulary: NullTokenizer with --vocab-size {m.vocab} stands in for your tokenizer; Megatron "
                 f"pads the vocabulary to a multiple of {m.vocab_multiple} x tp ({plan.data['model']['padded_vocab']})")
    if m.dtype == "bf16":
        add("--bf16")
    elif m.dtype == "fp16":
        add("--fp16")
    if _reduce_dtype(plan) == "bf16":
        add("--grad-reduce-in-bf16")
        notes.append("reduce_dtype bf16: --grad-reduce-in-bf16 also keeps Megatron-LM's gradient buffer in bf16 "
                     "across the micro-batches; parcompile adds each micro-batch's reduced bf16 gradients into "
                     "fp32 shards")
    elif _reduce_dtype(plan) == "fp16":
        notes.append("reduce_dtype fp16: Megatron-LM reduces fp16 models' gradients in fp32 (its main_grad "
                     "buffer); not expressible")
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
    add("--train-iters", tr.steps)
    add("--seed", tr.seed)
    add("--log-interval", tr.log_every)
    if tr.data == "synthetic":
        add("--mock-data")
    if tr.checkpoint_dir and tr.checkpoint_every:
        add("--save", tr.checkpoint_dir)
        add("--save-interval", tr.checkpoint_every)
    return a, notes


def _num(x: float) -> str:
    """A float without a trailing ``.0`` when it is whole (``500000``, ``0.5``)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _megatron(plan: Plan) -> Export:
    cfg = plan.config
    args, notes = megatron_args(plan)
    cl = cfg.cluster
    launch = f"torchrun --nnodes {cl.nodes} --nproc-per-node {cl.gpus_per_node}"
    if cl.nodes > 1:
        launch += ' --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"'
        notes.append("multi-node: run the same command on every node with MASTER_ADDR/MASTER_PORT set")
    launch += " pretrain_gpt.py"
    lines = [f"# Megatron-LM arguments for `{cfg.name}`: {_layout(plan)}",
             "# (exported by parcompile; run from a Megatron-LM checkout)"]
    lines += [f"# note: {n}" for n in notes]
    lines.append(launch + " \\")
    body = [f"    {flag}" + ("" if v is None else f" {shlex.quote(v)}") for flag, v in args]
    lines += [b + " \\" for b in body[:-1]] + [body[-1]]
    return Export("megatron", "\n".join(lines) + "\n", notes, launch, f"{cfg.name}_megatron.sh")


def _layout(plan: Plan) -> str:
    d = _degrees(plan)
    s = plan.data["schedule"]
    ep = f" x ep {d['ep']}" if d["ep"] > 1 else ""
    return (f"{plan.data['world_size']} ranks, dp {d['dp']} x tp {d['tp']} x pp {d['pp']} x cp {d['cp']}{ep}, "
            f"{s['name']}, {s['num_microbatches']} micro-batches")


# ---------------------------------------------------------------------------------------------
# torchtitan


def torchtitan_config(plan: Plan) -> tuple[dict, list[str]]:
    """The torchtitan 0.2 job config for ``plan`` as nested dicts (TOML tables in order),
    and the notes."""
    cfg = plan.config
    par, m, tr = cfg.parallel, cfg.model, cfg.train
    deg = _degrees(plan)
    sched = plan.data["schedule"]["name"]
    mb = plan.data["schedule"]["num_microbatches"]
    notes = _common_notes(plan, "torchtitan")
    v = deg["virtual_stages"]

    flavor = {(32, 4096): ("llama3", "8B"), (80, 8192): ("llama3", "70B"), (126, 16384): ("llama3", "405B")}
    name, fl = flavor.get((m.layers, m.hidden), ("llama3", "debugmodel"))
    if m.experts > 0:   # torchtitan's mixture-of-experts models live under deepseek_v3 (also llama4, qwen3)
        name, fl = "deepseek_v3", "debugmodel"
        notes.append(f"experts: register a deepseek_v3 flavor with {m.experts} routed experts, top_k {m.top_k}, "
                     f"{m.shared_experts} shared experts, moe_inter_dim {m.expert_ffn_hidden}, "
                     f"{plural(m.dense_layers, 'dense layer')} first")
    if fl == "debugmodel":
        notes.append(f"model: torchtitan takes the model's shape from a registered flavor; register one with "
                     f"dim {m.hidden}, n_layers {m.layers}, n_heads {m.heads}, n_kv_heads {m.kv_heads}, "
                     f"vocab_size {m.vocab}, ffn hidden {m.ffn_hidden}, rope_theta {_num(m.rope_theta)} "
                     "(debugmodel is a placeholder)")
    if m.norm != "rmsnorm" or m.activation != "swiglu" or m.position != "rope":
        notes.append(f"model: torchtitan's llama3 is RMSNorm + SwiGLU + RoPE; this model has {m.norm}, "
                     f"{m.activation}, {m.position} positions")
    if m.tie_embeddings:
        notes.append("tie_embeddings: torchtitan's llama3 keeps the output projection separate")
    if m.qk_norm:
        notes.append("qk_norm: torchtitan's llama3 has no q/k norm; its qwen3 model has one (register a flavor there)")

    # ZeRO: FSDP2 shards over data_parallel_shard_degree
    # zero 3: "default" is parcompile's own policy (analysis/buckets.reshard_after_forward):
    # layers resharded after forward without PP, kept across micro-batches with PP
    replicate, shard, reshard = (deg["dp"], 1, "default") if par.zero == 0 else (1, deg["dp"], "default")
    if par.zero in (1, 2):
        reshard = "never"
        notes.append(f"zero {par.zero}: torchtitan shards with FSDP2 (data_parallel_shard_degree = dp), which "
                     "also shards the parameters between steps (ZeRO-3 storage); fsdp_reshard_after_forward "
                     "= \"never\" keeps them gathered from forward to backward, ZeRO-2-like communication")
    if deg["cp"] > 1 and par.zero == 0:
        notes.append("cp: torchtitan's context parallelism runs under FSDP; parameters are sharded over dp x cp")

    schedule = TORCHTITAN_SCHEDULE[(sched, v > 1)]
    if sched == "zero_bubble" and v == 1:
        notes.append("schedule zero_bubble with one stage per rank (ZB-H1): torch.distributed.pipelining's "
                     "zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble) need two or more stages per "
                     "rank; exported as 1F1B")
    if sched == "gpipe" and v > 1:
        notes.append("schedule gpipe with virtual stages: exported as LoopedBFS (GPipe over looped stages)")

    par_t: dict = {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "fsdp_reshard_after_forward": reshard,
        "tensor_parallel_degree": deg["tp"],
        "enable_async_tensor_parallel": False,
        "pipeline_parallel_degree": deg["pp"],
        "pipeline_parallel_schedule": schedule,
        "pipeline_parallel_microbatch_size": par.micro_batch,
        "context_parallel_degree": deg["cp"],
        "expert_parallel_degree": deg["ep"],
    }
    if m.experts > 0:
        par_t["expert_tensor_parallel_degree"] = deg["expert_tp"]
    split = _stage_split(plan)
    if deg["pp"] > 1 and len(set(split)) == 1:
        par_t["pipeline_parallel_layers_per_stage"] = split[0]
    elif deg["pp"] > 1:
        notes.append(f"stage_layers {split}: torchtitan splits layers evenly (pipeline_parallel_layers_per_stage); "
                     "set module_fqns_per_model_part for this split")
    if deg["tp"] > 1 and not par.sequence_parallel:
        notes.append("sequence_parallel = false: torchtitan's tensor parallelism always splits norms along the "
                     "sequence (Megatron-style sequence parallelism)")
    if par.order != "tp-cp-ep-dp-pp":
        notes.append(f"order {par.order}: torchtitan's device mesh orders pp, dp_replicate, dp_shard, cp, tp "
                     "(tp fastest); other orders are not expressible")
    if _reduces_over_dp(plan) and par.bucket_size != DEFAULT_BUCKET_SIZE:
        notes.append(f"bucket_size {par.bucket_size}: torchtitan has no gradient bucket size setting (FSDP2 "
                     "reduce-scatters each transformer block's gradients as one group; replicate uses PyTorch "
                     "DDP's 25 MB buckets)")

    # batch: with pp, one step's micro-batches are torchtitan's pipeline micro-batches; without pp,
    # torchtitan accumulates gradients over global / (local * dp) forward passes
    local = par.micro_batch * mb if deg["pp"] > 1 else par.micro_batch
    training = {
        "local_batch_size": local,
        "global_batch_size": par.global_batch,
        "seq_len": m.seq_len,
        "steps": tr.steps,
        "max_norm": tr.grad_clip,
        "mixed_precision_param": "bfloat16" if m.dtype == "bf16" else "float32",
        "mixed_precision_reduce": "bfloat16" if _reduce_dtype(plan) == "bf16" else "float32",
        "dataset": "c4_test",
    }
    if m.dtype == "fp16":
        notes.append("dtype fp16: torchtitan's FSDP mixed precision takes bfloat16 or float32; exported as float32"
                     + (" (reduce_dtype fp16 too)" if _reduce_dtype(plan) == "fp16" else ""))
    if m.dtype == "bf16" and shard == 1:
        notes.append("dtype bf16: torchtitan applies mixed_precision_param through FSDP only; without sharding "
                     "(zero = 0) training runs in float32")
    notes.append("dataset: c4_test is torchtitan's bundled sample; set training.dataset to yours")

    ac = {"mode": par.recompute}
    if par.recompute == "selective":
        ac["selective_ac_option"] = "op"
        notes.append("recompute selective: torchtitan's op-level selective checkpointing saves matmul outputs "
                     "and recomputes the rest, not only the attention core")

    if tr.optimizer == "sgd":
        notes.append("optimizer sgd: torchtitan builds Adam or AdamW; exported as AdamW")
    opt = {"name": "Adam" if tr.optimizer == "adam" else "AdamW", "lr": tr.lr, "beta1": tr.betas[0],
           "beta2": tr.betas[1], "eps": tr.eps, "weight_decay": tr.weight_decay}
    sched_t = {"warmup_steps": tr.warmup_steps,
               "decay_ratio": 0.0 if tr.lr_schedule == "constant" else 1.0,
               "decay_type": "linear" if tr.lr_schedule != "cosine" else "cosine",
               "min_lr_factor": tr.min_lr / tr.lr if tr.lr else 0.0}
    config = {
        "job": {"description": f"{cfg.name}: {_layout(plan)} (exported by parcompile)"},
        "model": {"name": name, "flavor": fl},
        "optimizer": opt,
        "lr_scheduler": sched_t,
        "training": training,
        "parallelism": par_t,
        "activation_checkpoint": ac,
        "metrics": {"log_freq": tr.log_every},
    }
    if tr.checkpoint_dir and tr.checkpoint_every:
        config["checkpoint"] = {"enable": True, "folder": tr.checkpoint_dir, "interval": tr.checkpoint_every}
    return config, notes


def _toml_value(x) -> str:
    """A TOML scalar (booleans, integers, floats, strings)."""
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return repr(x) if x == x and x not in (float("inf"), float("-inf")) else "nan"
    return json.dumps(str(x))   # a JSON string is a valid TOML basic string


def _torchtitan(plan: Plan) -> Export:
    cfg = plan.config
    config, notes = torchtitan_config(plan)
    cl = cfg.cluster
    launch = (f"CONFIG_FILE={cfg.name}_torchtitan.toml NGPU={cl.gpus_per_node} ./run_train.sh"
              if cl.nodes == 1 else
              f"torchrun --nnodes {cl.nodes} --nproc-per-node {cl.gpus_per_node} --rdzv-backend c10d "
              f'--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" -m torchtitan.train '
              f"--job.config_file {cfg.name}_torchtitan.toml")
    lines = [f"# torchtitan 0.2 job config for `{cfg.name}` (exported by parcompile)",
             f"# launch: {launch}"]
    lines += [f"# note: {n}" for n in notes]
    for table, keys in config.items():
        lines += ["", f"[{table}]"] + [f"{k} = {_toml_value(v)}" for k, v in keys.items()]
    return Export("torchtitan", "\n".join(lines) + "\n", notes, launch, f"{cfg.name}_torchtitan.toml")


# ---------------------------------------------------------------------------------------------
# DeepSpeed


def deepspeed_config(plan: Plan) -> tuple[dict, list[str]]:
    """The DeepSpeed JSON config for ``plan`` and the notes."""
    cfg = plan.config
    par, m, tr = cfg.parallel, cfg.model, cfg.train
    deg = _degrees(plan)
    sched = plan.data["schedule"]["name"]
    notes = _common_notes(plan, "DeepSpeed")
    c: dict = {
        "train_batch_size": par.global_batch,
        "train_micro_batch_size_per_gpu": par.micro_batch,
        "gradient_accumulation_steps": plan.data["schedule"]["num_microbatches"],
        "gradient_clipping": tr.grad_clip,
        "steps_per_print": tr.log_every,
        # reduce_bucket_size counts elements; bucket_size = 0 (one bucket, after the backward):
        # a bucket as large as the largest stage, without overlap
        "zero_optimization": {"stage": par.zero,
                              "reduce_bucket_size": (-(-par.bucket_size // 4) if par.bucket_size else
                                                     max(s["params_per_rank"] for s in plan.data["stages"])),
                              "overlap_comm": bool(par.zero >= 1 and par.bucket_size > 0)},
        "bf16": {"enabled": m.dtype == "bf16"},
        "fp16": {"enabled": m.dtype == "fp16"},
    }
    if m.dtype != "fp32" and _reduces_over_dp(plan):
        # DeepSpeed reduces in the model's dtype unless told; the plan's reduce dtype
        c["communication_data_type"] = _reduce_dtype(plan)
    if tr.optimizer == "sgd":
        c["optimizer"] = {"type": "SGD", "params": {"lr": tr.lr, "weight_decay": tr.weight_decay}}
    else:
        c["optimizer"] = {"type": "AdamW" if tr.optimizer == "adamw" else "Adam",
                          "params": {"lr": tr.lr, "betas": list(tr.betas), "eps": tr.eps,
                                     "weight_decay": tr.weight_decay}}
    if tr.lr_schedule == "constant":
        if tr.warmup_steps:
            c["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": tr.lr,
                                                              "warmup_num_steps": tr.warmup_steps,
                                                              "warmup_type": "linear"}}
    elif tr.lr_schedule == "linear":
        c["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": tr.lr,
                                                               "warmup_num_steps": tr.warmup_steps,
                                                               "total_num_steps": tr.steps,
                                                               "warmup_type": "linear"}}
        if tr.min_lr:
            notes.append("lr_schedule linear: DeepSpeed's WarmupDecayLR decays to 0, not to min_lr")
    else:
        c["scheduler"] = {"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.0,
                                                                "warmup_num_steps": tr.warmup_steps,
                                                                "total_num_steps": tr.steps,
                                                                "cos_min_ratio": tr.min_lr / tr.lr if tr.lr else 0.0}}
    if deg["pp"] > 1:
        c["pipeline"] = {"stages": deg["pp"], "partition": "uniform",
                         "activation_checkpoint_interval": 1 if par.recompute == "full" else 0}
        notes.append(f"pipeline: wrap the model in deepspeed.pipe.PipelineModule(num_stages={deg['pp']}, "
                     "partition_method=\"uniform\") and train with engine.train_batch()")
        if sched != "1f1b":
            notes.append(f"schedule {sched}: DeepSpeed's pipeline engine runs only its own 1F1B schedule "
                         "(TrainSchedule)" + ("; virtual stages are not expressible" if deg["virtual_stages"] > 1
                                              else ""))
        if par.zero >= 2:
            notes.append(f"zero {par.zero}: DeepSpeed's pipeline engine supports ZeRO stages 0 and 1 only")
        if par.stage_layers is not None and len(set(_stage_split(plan))) > 1:
            notes.append(f"stage_layers {_stage_split(plan)}: give PipelineModule partition_method=\"custom\" "
                         "boundaries for this split")
    if deg["tp"] > 1:
        c["tensor_parallel"] = {"autotp_size": deg["tp"]}
        notes.append(f"tp {deg['tp']}: DeepSpeed AutoTP training (tensor_parallel.autotp_size, DeepSpeed 0.16.4+) "
                     "splits the linear layers; Megatron-DeepSpeed takes tp from its own arguments instead")
        if par.sequence_parallel:
            notes.append("sequence_parallel: AutoTP has no Megatron-style sequence parallelism")
    if par.recompute != "none":
        c["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False,
                                         "cpu_checkpointing": False}
        notes.append("recompute: the model code checkpoints each layer with deepspeed.checkpointing.checkpoint"
                     + ("; selective (attention-core) recomputation is not expressible in the config"
                        if par.recompute == "selective" else ""))
    if deg["cp"] > 1:
        notes.append(f"cp {deg['cp']}: DeepSpeed has no context parallelism with all-gathered keys and values "
                     "(DeepSpeed-Ulysses splits the sequence with all-to-all over heads instead)")
    if m.experts > 0:
        notes.append(f"experts: build the MoE layers with deepspeed.moe.layer.MoE(num_experts={m.experts}, "
                     f"ep_size={deg['ep']}, k={m.top_k})" + (f"; expert_tp {deg['expert_tp']} is not expressible"
                                                              if deg["expert_tp"] > 1 else ""))
    if _reduces_over_dp(plan) and par.zero == 0 and par.bucket_size:
        notes.append(f"bucket_size {par.bucket_size}: reduce_bucket_size counts elements ({-(-par.bucket_size // 4)}); "
                     "DeepSpeed overlaps the gradient reduction with the backward (overlap_comm) under ZeRO "
                     "stages 1-3 only")
    if m.dtype == "fp16":
        c["fp16"].update({"loss_scale": 0, "initial_scale_power": 16})
    if par.order != "tp-cp-ep-dp-pp":
        notes.append(f"order {par.order}: DeepSpeed places pp outermost and dp inside it; other orders are not "
                     "expressible")
    return c, notes


def _deepspeed(plan: Plan) -> Export:
    cfg = plan.config
    c, notes = deepspeed_config(plan)
    cl = cfg.cluster
    name = f"{cfg.name}_deepspeed.json"
    launch = (f"deepspeed --num_nodes {cl.nodes} --num_gpus {cl.gpus_per_node}"
              + (" --hostfile hostfile" if cl.nodes > 1 else "")
              + f" train.py --deepspeed --deepspeed_config {name}")
    notes.append(f"model: train.py builds the {cfg.model.layers}-layer model ({plan.data['model']['params']:,} "
                 "parameters) and calls deepspeed.initialize with this config")
    return Export("deepspeed", json.dumps(c, sort_keys=True, indent=2) + "\n", notes, launch, name)
