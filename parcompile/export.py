"""``parcompile export``: the same plan for the engines people already run.

Six targets, each a pure function of a compiled :class:`~parcompile.plan.Plan` (its config
and plan.json dict), each returning an :class:`Export`: the text, the notes about what the
target expresses differently, the errors (what it cannot run without training or serving a
different model or layout: the CLI exits 1), and a launch line.

Training specs:

- ``megatron`` (Megatron-LM core_v0.19): a shell command, the environment
  ``validate_args`` requires (:func:`megatron_env`), ``torchrun ... pretrain_gpt.py`` and
  Megatron-LM's arguments, one per line; notes and errors are ``#`` comments.
- ``megatron-bridge`` (Megatron-Bridge 0.3.1): a Python module whose ``config()`` returns the
  ``ConfigContainer``, the Megatron-LM arguments renamed (:data:`MEGATRON_BRIDGE_FIELDS`).
- ``torchtitan``: for torchtitan 0.3 (the default) a config registry module (Python) that
  registers the spec's model as a llama3 flavor and defines the ``Trainer.Config``, run with
  ``torchtitan.train --module ... --config ...``; for 0.2 a TOML job config.
- ``deepspeed`` (0.19): a DeepSpeed JSON config; JSON has no comments, so the notes (with
  the topology / mpu that makes DeepSpeed's data-parallel size the plan's) and the
  ``deepspeed`` launcher line are in :attr:`Export.notes` / :attr:`Export.launch`.

Serve specs: ``vllm`` (a ``vllm serve`` command) and ``sglang`` (``python -m
sglang.launch_server``), with the plan's parallel sizes, context, concurrent sequences, KV
cache dtype and memory fraction (:func:`serve_memory_fraction`).

A serve spec for a training engine, or a training spec for a serving one, is refused with a
:class:`~parcompile.diagnostics.SpecError` (:func:`export`). The output is deterministic:
the same spec gives the same bytes. ``docs/export.md`` has the full mapping.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from parcompile.analysis.fp8 import gathers_fp8
from parcompile.config.schema import DEFAULT_BUCKET_SIZE
from parcompile.core.dtypes import GRAD_BYTES
from parcompile.config.text import plural
from parcompile.diagnostics import Diagnostic, SpecError
from parcompile.plan import Plan

#: training engines
TRAIN_TARGETS = ("megatron", "megatron-bridge", "torchtitan", "deepspeed")
#: serving engines, and their names for messages
SERVE_TARGETS = {"vllm": "vLLM", "sglang": "SGLang"}
TARGETS = TRAIN_TARGETS + tuple(SERVE_TARGETS)
#: torchtitan releases the export writes for: 0.3 (config registry, what pip installs), 0.2 (TOML)
TORCHTITAN_VERSIONS = ("0.3", "0.2")

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
    ``filename`` (a conventional name for the file), ``errors`` (what the target cannot
    express without training a different model or layout: the export is then refused)."""

    target: str
    text: str
    notes: list[str] = field(default_factory=list)
    launch: str = ""
    filename: str = ""
    #: what would make the export train a different model or layout than the plan (the CLI
    #: prints them as ``error:`` lines, writes nothing and exits 1; ``text`` stays here, from
    #: Python, as a starting point)
    errors: list[str] = field(default_factory=list)


def export(plan: Plan, target: str, torchtitan_version: str = "0.3") -> Export:
    """Export ``plan`` for ``target`` (one of :data:`TARGETS`): a training spec for
    Megatron-LM, Megatron-Bridge, torchtitan or DeepSpeed; a serve spec for vLLM or SGLang.
    ``torchtitan_version``: ``"0.3"`` (a config registry module, the default) or ``"0.2"``
    (a TOML job config).

    Raises:
        ValueError: an unknown target or torchtitan version.
        SpecError: a ``serve`` spec for a training engine, or a training spec for a serving one.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown export target {target!r}; choose one of {', '.join(TARGETS)}")
    if torchtitan_version not in TORCHTITAN_VERSIONS:
        raise ValueError(f"unknown torchtitan version {torchtitan_version!r}; choose one of "
                         f"{', '.join(TORCHTITAN_VERSIONS)}")
    cfg = plan.config
    if target in SERVE_TARGETS:
        if cfg.workload != "serve":
            raise SpecError([Diagnostic(
                "error", f"`export --to {target}` needs a serve spec; this spec has a `train` block",
                cfg.span("train"),
                help="export the spec that serves the model (a `serve` block), or export this one --to "
                     "megatron, megatron-bridge, torchtitan or deepspeed",
                note=f"{SERVE_TARGETS[target]} is an inference server: it has no training run to map this plan to",
                code="export-train")])
        return _serve(plan, target)
    if cfg.workload != "train":
        raise SpecError([Diagnostic(
            "error", f"`export --to {target}` needs a training spec; this spec has a `serve` block",
            cfg.span("serve"),
            help="export it --to vllm or --to sglang (the serving engines), or export the spec that trains "
                 "the model",
            note="Megatron-LM's pretrain_gpt.py, Megatron-Bridge's ConfigContainer, torchtitan's train config "
                 "and DeepSpeed's JSON config describe training runs; none of them has an inference deployment "
                 "to map this plan to",
            code="export-serve")])
    if target == "torchtitan":
        return _torchtitan3(plan) if torchtitan_version == "0.3" else _torchtitan(plan)
    return {"megatron": _megatron, "megatron-bridge": _megatron_bridge, "deepspeed": _deepspeed}[target](plan)


# ---------------------------------------------------------------------------------------------
# shared facts


def _degrees(plan: Plan) -> dict:
    return plan.data["degrees"]


def _common_notes(plan: Plan, target: str) -> list[str]:
    """Notes every target shares: data and the model code are the engine's own. A path is
    quoted with JSON's escapes: a line break or quotes in a file name cannot end the comment
    or docstring the note becomes (a command in a shell script, code in a module)."""
    cfg = plan.config
    notes = []
    if cfg.train.data != "synthetic":
        notes.append(f"data: the spec reads {json.dumps(cfg.train.data)}; point the {target} run at your own "
                     "tokenized dataset")
    group = cfg.parallel.microbatch_group_size
    if group is not None and target != "Megatron-LM":
        notes.append(f"microbatch_group_size {group}: {target} has no round size for its interleaved schedule "
                     "(Megatron-Core's --microbatch-group-size-per-virtual-pipeline-stage); not expressible")
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
    split = _stage_split(plan)
    accounted = megatron_accounted_split(split, deg["pp"]) if len(set(split)) > 1 else None
    if deg["virtual_stages"] > 1:
        add("--num-virtual-stages-per-pipeline-rank", deg["virtual_stages"])
        slots = m.layers + sum(accounted or ())   # the embedding and the loss count as layers
        notes.append("Megatron-LM releases before core 0.11 take "
                     f"--num-layers-per-virtual-pipeline-stage {slots // (deg['pp'] * deg['virtual_stages'])} "
                     "instead of --num-virtual-stages-per-pipeline-rank")
        if par.microbatch_group_size is not None:
            add("--microbatch-group-size-per-virtual-pipeline-stage", par.microbatch_group_size)
    if sched == "gpipe":
        notes.append("schedule gpipe: Megatron-LM has no GPipe schedule; it runs 1F1B (the same bubble, "
                     "fewer micro-batches in flight)")
    elif sched == "zero_bubble":
        notes.append("schedule zero_bubble: mainline Megatron-LM has no zero-bubble schedule (the sail-sg "
                     "zero-bubble fork adds one); exported as 1F1B")
    elif sched == "interleaved_1f1b" and deg["virtual_stages"] == 1:
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
    # ZeRO
    if par.zero >= 1:
        if par.zero <= 2:
            add("--use-distributed-optimizer")
        if par.zero == 2:
            notes.append("zero 2: Megatron's distributed optimizer shards optimizer states and reduce-scatters "
                         "gradients, but keeps a full gradient buffer per rank (ZeRO-1 memory)")
        if par.zero == 3:
            # core_v0.19.0 validate_args: FSDP2 needs no gradient-accumulation fusion, a
            # torch_dist / torch_dcp checkpoint format (torch_dist is the default)
            add("--use-torch-fsdp2")
            add("--no-gradient-accumulation-fusion")
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
        if m.rope_type == "llama3":   # Megatron-Core RotaryEmbedding._apply_scaling (Llama 3.x)
            add("--use-rope-scaling")
            add("--rope-scaling-factor", _num(m.rope_scaling_factor))
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
    for key, where in (("attn_logit_softcapping", "the scores in its unfused Gemma2DotProductAttention"),
                       ("final_logit_softcapping", "the logits in its Gemma2OutputLayer")):   # Gemma 2
        if getattr(m, key) is not None:
            notes.append(f"{key} {getattr(m, key)}: pretrain_gpt.py has no soft-capping argument (Megatron-Bridge's "
                         f"Gemma2ModelProvider caps {where}: gemma2_provider.py@d9f7643b)")
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
    if tr.precision == "fp8":
        # Megatron-Core core_v0.19.0 (5be9626) TransformerConfig: fp8 (--fp8-format e4m3 | hybrid),
        # fp8_recipe (--fp8-recipe tensorwise | delayed | mxfp8 | blockwise | custom; "tensorwise" is
        # Transformer Engine's per-tensor current scaling); arguments.py --fp8-param-gather
        add("--fp8-format", "e4m3")
        if tr.fp8_recipe in ("tensorwise", "mxfp8"):
            add("--fp8-recipe", tr.fp8_recipe)
        if gathers_fp8(cfg):
            add("--fp8-param-gather")
        notes.append("precision fp8: E4M3 for weights, activations and gradients (torchao's recipes; "
                     "--fp8-format hybrid would take E5M2 gradients); every layer in FP8 (--first-last-layers-bf16 "
                     "off, its default)")
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
    env = megatron_env(plan)
    launch = "".join(f"{k}={v} " for k, v in env.items())
    launch += f"torchrun --nnodes {cl.nodes} --nproc-per-node {cl.gpus_per_node}"
    if cl.nodes > 1:
        launch += ' --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"'
        notes.append("multi-node: run the same command on every node with MASTER_ADDR/MASTER_PORT set")
    launch += " pretrain_gpt.py"
    errors = megatron_errors(plan)
    lines = [f"# Megatron-LM (core_v0.19) arguments for `{cfg.name}`: {_layout(plan)}",
             "# (exported by parcompile; run from a Megatron-LM checkout)"]
    lines += [f"# error: {e}" for e in errors]
    lines += [f"# note: {n}" for n in notes]
    lines.append(launch + " \\")
    body = [f"    {flag}" + ("" if v is None else f" {shlex.quote(v)}") for flag, v in args]
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
    deg = _degrees(plan)
    env = {}
    if (deg["tp"] > 1 or deg["cp"] > 1) and plan.config.parallel.zero != 3:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    env.update({var: value for var, value, _ in plan.config.cluster.accelerator.launch_env})
    return env


def megatron_errors(plan: Plan) -> list[str]:
    """What Megatron-LM core_v0.19's ``validate_args`` refuses for this plan (so the export
    cannot run the plan's layout): ``--use-torch-fsdp2`` (zero 3) with pipeline or expert
    parallelism, with fp16, or with tied embeddings (megatron/training/arguments.py,
    the ``if args.use_torch_fsdp2:`` block); and RoPE scalings its flags cannot state
    (linear or YaRN outside multi-latent attention, Llama 3 scaling with other than its
    fixed low/high frequency factors and 8192 original positions)."""
    cfg = plan.config
    deg = _degrees(plan)
    errors = []
    m = cfg.model
    if m.position == "rope" and m.rope_type == "llama3" and (
            float(m.rope_low_freq_factor), float(m.rope_high_freq_factor),
            m.rope_original_max_positions or 8192) != (1.0, 4.0, 8192):
        # megatron/core/models/common/embeddings/rotary_pos_embedding.py: _apply_scaling is called
        # with the factor only; low 1, high 4, original 8192 are fixed
        errors.append(f"rope_type llama3 with low_freq_factor {_num(m.rope_low_freq_factor)}, high_freq_factor "
                      f"{_num(m.rope_high_freq_factor)}, original max positions {m.rope_original_max_positions}: "
                      "Megatron-Core's --use-rope-scaling fixes them at 1, 4 and 8192")
    if m.position == "rope" and m.rope_type in ("linear", "yarn") and not m.kv_lora_rank:
        errors.append(f"rope_type {m.rope_type}: pretrain_gpt.py's RoPE flags scale as Llama 3.x "
                      "(--use-rope-scaling) only for this model; it would train unscaled RoPE")
    if cfg.parallel.zero == 3:
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
    if cfg.train.precision == "fp8" and cfg.train.fp8_recipe == "rowwise":
        errors.append("fp8_recipe rowwise: Megatron-Core's --fp8-recipe has tensorwise, delayed, mxfp8 and blockwise "
                      "(1x128 and 128x128 blocks) scaling, none per row; use fp8_recipe tensorwise or mxfp8, or "
                      "export --to torchtitan --torchtitan-version 0.2")
    return errors


# ---------------------------------------------------------------------------------------------
# Megatron-Bridge (0.3.1): the Megatron-LM arguments as its ConfigContainer


class _Code(str):
    """A Python expression written as is in an exported module (``F.silu``)."""


#: Megatron-LM argument -> the Megatron-Bridge 0.3.1 ``ConfigContainer`` fields it sets
#: (``megatron/bridge/training/config.py``; the model's fields are Megatron-Core's
#: ``TransformerConfig``'s, through ``GPTModelProvider``): ``(section, field, value)`` with
#: value ``int``/``float``/``str`` (the argument's, converted), a constant for a switch, a
#: :class:`_Code` expression, ``"AttnBackend"`` (the enum member) or ``"layer-list"`` (the
#: MoE layer pattern as a list). ``None``: implied by another argument. An argument absent
#: from this table has no Bridge field in parcompile: the export is refused.
MEGATRON_BRIDGE_FIELDS: dict[str, list[tuple[str, str, object]] | None] = {
    "--tensor-model-parallel-size": [("model", "tensor_model_parallel_size", int)],
    "--pipeline-model-parallel-size": [("model", "pipeline_model_parallel_size", int)],
    "--context-parallel-size": [("model", "context_parallel_size", int)],
    "--expert-model-parallel-size": [("model", "expert_model_parallel_size", int)],
    "--expert-tensor-parallel-size": [("model", "expert_tensor_parallel_size", int)],
    "--sequence-parallel": [("model", "sequence_parallel", True)],
    "--num-virtual-stages-per-pipeline-rank": [("model", "virtual_pipeline_model_parallel_size", int)],
    # ModelParallelConfig's field (a base of GPTModelProvider): megatron-core 0.16.1
    # megatron/core/model_parallel_config.py line 343 (NVIDIA/Megatron-LM tag core_v0.16.1)
    "--microbatch-group-size-per-virtual-pipeline-stage": [("model", "microbatch_group_size_per_vp_stage", int)],
    "--decoder-first-pipeline-num-layers": [("model", "num_layers_in_first_pipeline_stage", int)],
    "--decoder-last-pipeline-num-layers": [("model", "num_layers_in_last_pipeline_stage", int)],
    "--account-for-embedding-in-pipeline-split": [("model", "account_for_embedding_in_pipeline_split", True)],
    "--account-for-loss-in-pipeline-split": [("model", "account_for_loss_in_pipeline_split", True)],
    "--use-distributed-optimizer": [("ddp", "use_distributed_optimizer", True),
                                    ("optimizer", "use_distributed_optimizer", True)],
    "--use-torch-fsdp2": [("dist", "use_torch_fsdp2", True)],
    "--no-gradient-accumulation-fusion": [("model", "gradient_accumulation_fusion", False)],
    "--overlap-grad-reduce": [("ddp", "overlap_grad_reduce", True)],
    "--ddp-bucket-size": [("ddp", "bucket_size", int)],
    "--grad-reduce-in-bf16": [("ddp", "grad_reduce_in_fp32", False)],
    "--recompute-granularity": [("model", "recompute_granularity", str)],
    "--recompute-method": [("model", "recompute_method", str)],
    "--recompute-num-layers": [("model", "recompute_num_layers", int)],
    "--micro-batch-size": [("train", "micro_batch_size", int)],
    "--global-batch-size": [("train", "global_batch_size", int)],
    "--num-layers": [("model", "num_layers", int)],
    "--hidden-size": [("model", "hidden_size", int)],
    "--ffn-hidden-size": [("model", "ffn_hidden_size", int)],
    "--num-attention-heads": [("model", "num_attention_heads", int)],
    "--kv-channels": [("model", "kv_channels", int)],
    "--group-query-attention": None,   # num_query_groups
    "--num-query-groups": [("model", "num_query_groups", int)],
    "--seq-length": [("model", "seq_length", int), ("dataset", "seq_length", int)],
    "--max-position-embeddings": None,   # GPTModel takes seq_length (checked in megatron_bridge_config)
    "--normalization": [("model", "normalization", str)],
    "--norm-epsilon": [("model", "layernorm_epsilon", float)],
    "--swiglu": [("model", "gated_linear_unit", True), ("model", "activation_func", _Code("F.silu"))],
    "--position-embedding-type": [("model", "position_embedding_type", str)],
    "--rotary-base": [("model", "rotary_base", float)],
    "--rotary-percent": [("model", "rotary_percent", float)],
    "--use-rope-scaling": [("model", "rope_scaling", True)],
    "--rope-scaling-factor": [("model", "rope_scaling_factor", float)],
    "--disable-bias-linear": [("model", "add_bias_linear", False)],
    "--add-qkv-bias": [("model", "add_qkv_bias", True)],
    "--untie-embeddings-and-output-weights": [("model", "share_embeddings_and_output_weights", False)],
    "--attention-backend": [("model", "attention_backend", "AttnBackend")],
    "--attention-dropout": [("model", "attention_dropout", float)],
    "--hidden-dropout": [("model", "hidden_dropout", float)],
    "--qk-layernorm": [("model", "qk_layernorm", True)],
    "--num-experts": [("model", "num_moe_experts", int)],
    "--moe-router-topk": [("model", "moe_router_topk", int)],
    "--moe-ffn-hidden-size": [("model", "moe_ffn_hidden_size", int)],
    "--moe-aux-loss-coeff": [("model", "moe_aux_loss_coeff", float)],
    "--moe-router-score-function": [("model", "moe_router_score_function", str)],
    "--moe-router-pre-softmax": [("model", "moe_router_pre_softmax", True)],
    "--moe-router-enable-expert-bias": [("model", "moe_router_enable_expert_bias", True)],
    "--moe-router-num-groups": [("model", "moe_router_num_groups", int)],
    "--moe-router-group-topk": [("model", "moe_router_group_topk", int)],
    "--moe-router-topk-scaling-factor": [("model", "moe_router_topk_scaling_factor", float)],
    "--moe-shared-expert-intermediate-size": [("model", "moe_shared_expert_intermediate_size", int)],
    "--moe-layer-freq": [("model", "moe_layer_freq", "layer-list")],
    "--tokenizer-type": [("tokenizer", "tokenizer_type", str)],
    "--vocab-size": [("tokenizer", "vocab_size", int), ("model", "vocab_size", int)],
    "--make-vocab-size-divisible-by": [("model", "make_vocab_size_divisible_by", int)],
    "--bf16": [("container", "mixed_precision", "bf16_mixed")],
    "--fp16": [("container", "mixed_precision", "fp16_mixed")],
    "--optimizer": [("optimizer", "optimizer", str)],
    "--adam-beta1": [("optimizer", "adam_beta1", float)],
    "--adam-beta2": [("optimizer", "adam_beta2", float)],
    "--adam-eps": [("optimizer", "adam_eps", float)],
    "--lr": [("optimizer", "lr", float)],
    "--min-lr": [("optimizer", "min_lr", float)],
    "--weight-decay": [("optimizer", "weight_decay", float)],
    "--clip-grad": [("optimizer", "clip_grad", float)],
    "--lr-decay-style": [("scheduler", "lr_decay_style", str)],
    "--lr-warmup-iters": [("scheduler", "lr_warmup_iters", int)],
    "--train-iters": [("train", "train_iters", int)],
    "--seed": [("rng", "seed", int)],
    "--log-interval": [("logger", "log_interval", int)],
    "--mock-data": None,   # the dataset is MockGPTDatasetConfig
    "--save": [("checkpoint", "save", str)],
    "--save-interval": [("checkpoint", "save_interval", int)],
}
#: the ConfigContainer's sections in the order the module writes them, and their classes
MEGATRON_BRIDGE_SECTIONS = {
    "model": "GPTModelProvider", "train": "TrainingConfig", "optimizer": "OptimizerConfig",
    "scheduler": "SchedulerConfig", "ddp": "DistributedDataParallelConfig", "dist": "DistributedInitConfig",
    "dataset": "MockGPTDatasetConfig", "tokenizer": "TokenizerConfig", "logger": "LoggerConfig",
    "checkpoint": "CheckpointConfig", "rng": "RNGConfig",
}


def megatron_bridge_config(plan: Plan) -> tuple[dict[str, dict[str, object]], list[str], list[str]]:
    """The Megatron-Bridge 0.3.1 ``ConfigContainer`` for ``plan`` as ``{section: {field:
    value}}`` (the sections of :data:`MEGATRON_BRIDGE_SECTIONS`, plus ``"container"`` for the
    container's own ``mixed_precision``), the notes and the errors. It is the Megatron-LM
    arguments of :func:`megatron_args` (one rule for what Megatron runs) renamed through
    :data:`MEGATRON_BRIDGE_FIELDS`; an argument with no field there, and what
    :func:`megatron_errors` refuses, are errors."""
    args, notes = megatron_args(plan)
    errors = list(megatron_errors(plan))
    m = plan.config.model
    out: dict[str, dict[str, object]] = {k: {} for k in ("container", *MEGATRON_BRIDGE_SECTIONS)}
    # Megatron-LM's defaults where GPTModelProvider's differ (its arguments state only the
    # change); Megatron-LM pads the vocabulary to make_vocab_size_divisible_by x tp, the
    # provider only with should_pad_vocab (gpt_provider.py provide())
    out["model"].update(share_embeddings_and_output_weights=True, add_bias_linear=True, should_pad_vocab=True)
    out["dataset"].update(random_seed=plan.config.train.seed, reset_attention_mask=False, reset_position_ids=False,
                          eod_mask_loss=False)
    out["scheduler"]["lr_decay_iters"] = plan.config.train.steps
    out["container"]["mixed_precision"] = None
    unmapped = []
    for flag, value in args:
        if flag not in MEGATRON_BRIDGE_FIELDS:
            unmapped.append(flag)
            continue
        for section, name, kind in MEGATRON_BRIDGE_FIELDS[flag] or ():
            if kind in (int, float, str):
                v = kind(value)
            elif kind == "AttnBackend":
                v = _Code(f"AttnBackend.{value}")
            elif kind == "layer-list":   # "([0]*3+[1]*25)": which layers are MoE
                v = [0] * m.dense_layers + [1] * (m.layers - m.dense_layers)
            else:
                v = kind
            out[section][name] = v
    if m.position == "learned" and m.max_positions != m.seq_len:
        errors.append(f"max_positions {m.max_positions}: Megatron-Bridge's GPTModelProvider sizes learned position "
                      f"embeddings by seq_length ({m.seq_len})")
    if unmapped:
        errors.append(f"{', '.join(unmapped)}: parcompile maps no Megatron-Bridge GPTModelProvider field to "
                      + ("this Megatron-LM argument" if len(unmapped) == 1 else "these Megatron-LM arguments")
                      + (" (multi-latent attention needs Megatron-Bridge's MLAModelProvider)" if m.kv_lora_rank
                         else "") + "; export --to megatron")
    if m.dtype == "fp32":
        notes.append("dtype fp32: no mixed-precision recipe (mixed_precision=None)")
    return out, notes, errors


def _megatron_bridge(plan: Plan) -> Export:
    cfg = plan.config
    sections, notes, errors = megatron_bridge_config(plan)
    cl = cfg.cluster
    module = f"{_py_name(cfg.name)}_megatron_bridge"
    launch = "".join(f"{k}={v} " for k, v in megatron_env(plan).items())
    launch += f"torchrun --nnodes {cl.nodes} --nproc-per-node {cl.gpus_per_node}"
    if cl.nodes > 1:
        launch += ' --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"'
    launch += f" {module}.py"

    def value(v) -> str:
        return str(v) if isinstance(v, _Code) else repr(v)

    lines = [f'"""Megatron-Bridge 0.3.1 recipe for `{cfg.name}` (exported by parcompile): {_layout(plan)}.',
             "",
             "A ConfigContainer as NVIDIA's Megatron-Bridge recipes build them, from the arguments of",
             "`parcompile export --to megatron` (mock data, a NullTokenizer of the spec's vocabulary).",
             f"Launch: {launch}"]
    lines += [""] + [f"error: {e}" for e in errors] if errors else []
    lines += [""] + [f"note: {n}" for n in notes] if notes else []
    lines += ['"""', "", "import torch.nn.functional as F", "",
              "from megatron.bridge.models import GPTModelProvider",
              "from megatron.bridge.training.config import (",
              "    CheckpointConfig, ConfigContainer, DistributedDataParallelConfig, DistributedInitConfig,",
              "    LoggerConfig, MockGPTDatasetConfig, OptimizerConfig, RNGConfig, SchedulerConfig, TokenizerConfig,",
              "    TrainingConfig,",
              ")",
              "from megatron.bridge.training.gpt_step import forward_step",
              "from megatron.bridge.training.pretrain import pretrain",
              "from megatron.core.transformer.enums import AttnBackend",
              "", "",
              "def config() -> ConfigContainer:",
              f'    """`{cfg.name}` as a Megatron-Bridge ConfigContainer."""',
              "    return ConfigContainer("]
    for section, cls in MEGATRON_BRIDGE_SECTIONS.items():
        fields = sections[section]
        if not fields:
            lines.append(f"        {section}={cls}(),")
            continue
        lines.append(f"        {section}={cls}(")
        lines += [f"            {k}={value(v)}," for k, v in fields.items()]
        lines.append("        ),")
    lines += [f"        {k}={value(v)}," for k, v in sections["container"].items()]
    lines += ["    )", "", "",
              'if __name__ == "__main__":',
              "    pretrain(config(), forward_step)"]
    return Export("megatron-bridge", "\n".join(lines) + "\n", notes, launch, f"{module}.py", errors)


def _layout(plan: Plan) -> str:
    d = _degrees(plan)
    s = plan.data["schedule"]
    ep = f" x ep {d['ep']}" if d["ep"] > 1 else ""
    if plan.config.workload == "serve":
        sv = plan.data["serve"]
        return (f"{plan.data['world_size']} ranks, dp {d['dp']} x tp {d['tp']} x pp {d['pp']} x cp {d['cp']}{ep}, "
                f"{sv['replicas']} x {sv['batch_per_replica']} concurrent sequences")
    return (f"{plan.data['world_size']} ranks, dp {d['dp']} x tp {d['tp']} x pp {d['pp']} x cp {d['cp']}{ep}, "
            f"{s['name']}, {s['num_microbatches']} micro-batches")


# ---------------------------------------------------------------------------------------------
# torchtitan


def _torchtitan02_ffn(dim: int, multiple_of: int, ffn_dim_multiplier: float) -> int:
    """torchtitan 0.2.2's SwiGLU width (``FeedForward.__init__``, from ``hidden_dim = 4 * dim``):
    2/3 of it, times ``ffn_dim_multiplier``, rounded up to ``multiple_of``."""
    hidden = int(ffn_dim_multiplier * int(2 * 4 * dim / 3))
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


#: torchtitan 0.2's llama3 flavors as the model they build, field by field: torchtitan v0.2.2
#: (pytorch/torchtitan commit 73a0e6979dd10b6b1904098eb3c8f62c18ab87ce)
#: torchtitan/models/llama3/__init__.py ``llama3_args`` over the defaults of
#: model/args.py ``TransformerModelArgs`` (vocab_size 128256, norm_eps 1e-5) and
#: ``RoPEScalingArgs`` (scaling_factor 8, low_freq_factor 1, high_freq_factor 4,
#: original_max_position_embeddings 8192), which model/model.py ``precompute_freqs_cis``
#: always applies (Llama 3.1 RoPE); untied output, head_dim = dim / n_heads. 0.2's TOML names
#: a flavor and overrides none of it (job_config.py ``Model``: name, flavor, paths, converters).
TORCHTITAN02_FLAVORS: dict[str, dict] = {
    name: {"n_layers": layers, "dim": dim, "n_heads": heads, "n_kv_heads": 8,
           "hidden_dim": _torchtitan02_ffn(dim, multiple_of, mult), "vocab_size": 128256,
           "rope_theta": 500000.0, "norm_eps": 1e-5, "rope_scaling": ("llama3", 8.0, 1.0, 4.0, 8192),
           "tie_embeddings": False}
    for name, layers, dim, heads, multiple_of, mult in (("8B", 32, 4096, 32, 1024, 1.3),
                                                        ("70B", 80, 8192, 64, 4096, 1.3),
                                                        ("405B", 126, 16384, 128, 4096, 1.2))
}


def torchtitan02_flavor(plan: Plan) -> tuple[str | None, list[str]]:
    """The torchtitan 0.2 llama3 flavor (:data:`TORCHTITAN02_FLAVORS`) with the spec's layers
    and hidden size, and every field where that flavor is another model than the spec's
    (``"vocab_size 128256 (the spec: 32000)"``); ``(None, [])`` when no flavor has that depth
    and width."""
    m = plan.config.model
    name = next((n for n, f in TORCHTITAN02_FLAVORS.items() if (f["n_layers"], f["dim"]) == (m.layers, m.hidden)),
                None)
    if name is None:
        return None, []
    f = TORCHTITAN02_FLAVORS[name]
    rope = (m.rope_type, float(m.rope_scaling_factor), float(m.rope_low_freq_factor),
            float(m.rope_high_freq_factor), m.rope_original_max_positions)
    spec = {"n_heads": m.heads, "n_kv_heads": m.kv_heads, "hidden_dim": m.ffn_hidden, "vocab_size": m.vocab,
            "rope_theta": float(m.rope_theta), "norm_eps": float(m.norm_eps), "rope_scaling": rope,
            "tie_embeddings": bool(m.tie_embeddings)}

    def show(key, v):
        if key == "rope_scaling":
            return ("Llama 3.1 RoPE scaling (factor {1:g}, low_freq_factor {2:g}, high_freq_factor {3:g}, "
                    "original_max_position_embeddings {4})".format(*v) if v[0] == "llama3" else
                    f"RoPE scaling {v[0]}" if v[0] != "default" else "no RoPE scaling")
        return f"{key} {_num(v) if isinstance(v, float) else v}"

    return name, [f"{show(k, f[k])} (the spec: {show(k, v).removeprefix(k + ' ')})" for k, v in spec.items()
                  if v != f[k]]


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

    name, fl = "llama3", torchtitan02_flavor(plan)[0] or "debugmodel"
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

    replicate, shard, reshard = _torchtitan_fsdp(par.zero, deg, notes, "0.2")
    if deg["cp"] > 1 and par.zero == 0:
        notes.append("cp: torchtitan's context parallelism runs under FSDP; parameters are sharded over dp x cp")

    schedule = _torchtitan_schedule(sched, v, notes)

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
    if deg["pp"] > 1:   # torchtitan counts the embedding and the output as a layer each by default
        par_t["pipeline_parallel_first_stage_less_layers"] = 0
        par_t["pipeline_parallel_last_stage_less_layers"] = 0
    if deg["pp"] > 1 and len(set(split)) == 1:
        par_t["pipeline_parallel_layers_per_stage"] = split[0]
    elif deg["pp"] > 1:
        par_t["module_fqns_per_model_part"] = torchtitan_model_parts(split, "output")
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
        # torchtitan 0.2.2 job_config.py: mixed_precision_reduce is Literal["float32"]
        "mixed_precision_reduce": "float32",
        "dataset": "c4_test",
    }
    if _reduce_dtype(plan) != "fp32":
        notes.append(f"reduce_dtype {_reduce_dtype(plan)}: torchtitan 0.2 reduces gradients in float32 only "
                     "(training.mixed_precision_reduce)")
    if m.dtype == "bf16" and shard == 1 and deg["cp"] == 1 and deg["tp"] == deg["pp"] == 1:
        # torchtitan 0.2.2 distributed/utils.py maybe_enable_amp: DDP or one device: torch.autocast
        notes.append("dtype bf16 without sharding: torchtitan 0.2 trains under torch.autocast(bfloat16) "
                     "(parameters kept in float32, matmuls in bfloat16)")
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
    if tr.precision == "fp8":
        # torchtitan v0.2.2 job_config.py Quantize: the converters registered as
        # quantize.linear.float8 (torchao Float8Linear: tensorwise, rowwise) and quantize.linear.mx
        # (MXLinear); the LM head ("output") kept in bf16, as the plan assumes
        if tr.fp8_recipe == "mxfp8":
            config["model"]["converters"] = ["quantize.linear.mx"]
            config["quantize.linear.mx"] = {"recipe_name": "mxfp8_cublas", "filter_fqns": ["output"]}
        else:
            config["model"]["converters"] = ["quantize.linear.float8"]
            f8: dict = {"filter_fqns": ["output"]}
            if tr.fp8_recipe == "rowwise":
                f8["recipe_name"] = "rowwise"   # v0.2.2 refuses a recipe_name with FP8 all-gather
            elif gathers_fp8(cfg):
                f8.update(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
            config["quantize.linear.float8"] = f8
        notes.append("precision fp8: torchtitan's float8 converters need torch.compile for their speed "
                     "(--compile.enable; docs/float8.md) and an SM89+ GPU")
    return config, notes


# torchtitan 0.3: a config registry module (Python), run with --module/--config


def torchtitan_errors(plan: Plan) -> list[str]:
    """What torchtitan 0.3's llama3 model (``torchtitan.models.llama3``: RMSNorm, SwiGLU,
    RoPE, no biases, head_dim = dim / n_heads) cannot express without training a different
    model; the export is refused with these reasons."""
    m = plan.config.model
    errors = []
    if m.experts > 0:
        errors.append(f"experts {m.experts}: parcompile exports dense llama3-family models to torchtitan; its MoE "
                      "models (deepseek_v3, qwen3) need a flavor registered by hand")
    if m.norm != "rmsnorm" or m.activation != "swiglu" or m.position != "rope":
        errors.append(f"model: torchtitan's llama3 is RMSNorm + SwiGLU + RoPE; this model has {m.norm}, "
                      f"{m.activation}, {m.position} positions")
    if m.bias or m.qkv_bias:
        errors.append("bias: torchtitan's llama3 linear layers have no biases")
    if m.qk_norm:
        errors.append("qk_norm: torchtitan's llama3 has no q/k norm (its qwen3 model has one)")
    if m.kv_lora_rank:
        errors.append("multi-head latent attention: torchtitan's llama3 has none (its deepseek_v3 model has)")
    if m.sliding_window:
        errors.append(f"sliding_window {m.sliding_window}: torchtitan's llama3 attends to the whole context")
    if m.parallel_residual:
        errors.append("parallel_residual: torchtitan's llama3 block is sequential")
    if m.head_dim != m.hidden // m.heads:
        errors.append(f"head_dim {m.head_dim}: torchtitan's llama3 uses dim / n_heads = {m.hidden // m.heads}")
    if m.position == "rope" and m.rope_type not in ("default", "llama3"):
        errors.append(f"rope_type {m.rope_type}: torchtitan's llama3 RoPE scales as none or llama (Llama 3.1)")
    if m.dtype == "fp16":   # TrainingConfig.dtype / mixed_precision_param: Literal["bfloat16", "float32"]
        errors.append("dtype fp16: torchtitan trains in bfloat16 or float32 only (training.mixed_precision_param, "
                      "training.dtype); use dtype bf16 or fp32 in the spec")
    return errors


def _torchtitan_fsdp(zero: int, deg: dict, notes: list[str], version: str) -> tuple[int, int, str]:
    """torchtitan's FSDP2 settings for ZeRO stage ``zero``: (data_parallel_replicate_degree,
    data_parallel_shard_degree, fsdp_reshard_after_forward); appends the notes.

    zero 0 replicates the states over dp (0.3's llama3 applies fully_shard over
    dp_replicate x dp_shard, so dp_shard = 1 is DDP's memory and reduction); torchtitan 0.2
    refuses data_parallel_replicate alone with tp, pp or cp ("DDP has not supported > 1D
    parallelism"), so there it is FSDP over dp. zero 1 and 2 shard with FSDP2 and keep the
    parameters gathered from forward to backward ("never"); zero 3 uses "default": parcompile's
    own policy (parcompile.core.buckets.reshard_after_forward: resharded after forward
    without pp, kept across micro-batches with pp)."""
    if zero == 0:
        if version == "0.2" and (deg["tp"] > 1 or deg["pp"] > 1 or deg["cp"] > 1):
            notes.append("zero 0 with tp, pp or cp: torchtitan 0.2 replicates (DDP) only without other "
                         "parallelism; exported as FSDP over dp (data_parallel_shard_degree = dp), which shards "
                         "the states")
            return 1, deg["dp"], "default"
        return deg["dp"], 1, "default"
    if zero in (1, 2):
        notes.append(f"zero {zero}: torchtitan shards with FSDP2 (data_parallel_shard_degree = dp), which "
                     "also shards the parameters between steps (ZeRO-3 storage); fsdp_reshard_after_forward "
                     "= \"never\" keeps them gathered from forward to backward, ZeRO-2-like communication")
        return 1, deg["dp"], "never"
    return 1, deg["dp"], "default"


def _torchtitan_schedule(sched: str, v: int, notes: list[str]) -> str:
    """torchtitan's ``pipeline_parallel_schedule`` for the plan's schedule with ``v`` model
    chunks per rank; appends a note where torch.distributed.pipelining runs another one."""
    if sched == "zero_bubble" and v == 1:
        notes.append("schedule zero_bubble with one stage per rank (ZB-H1): torch.distributed.pipelining's "
                     "zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble) need two or more stages per "
                     "rank; exported as 1F1B")
    if sched == "gpipe" and v > 1:
        notes.append("schedule gpipe with virtual stages: exported as LoopedBFS (GPipe over looped stages)")
    return TORCHTITAN_SCHEDULE[(sched, v > 1)]

def torchtitan_registry(plan: Plan) -> tuple[dict, list[str]]:
    """The torchtitan 0.3 settings for ``plan`` and the notes: ``{"model": {...},
    "training": {...}, "parallelism": {...}, "activation_checkpoint": ..., ...}``, the field
    names of torchtitan 0.3's ``Trainer.Config`` sections (``torchtitan/config/configs.py``).

    Layers: torchtitan counts the embedding and the output as layers of the first and last
    stage (``pipeline_parallel_first/last_stage_less_layers``, 1 each by default); parcompile
    places them beside the stage's transformer layers, so both are 0 and
    ``pipeline_parallel_layers_per_stage`` is the plan's chunk (or, for uneven chunks,
    ``module_fqns_per_model_part`` names each chunk's modules)."""
    cfg = plan.config
    par, m, tr = cfg.parallel, cfg.model, cfg.train
    deg = _degrees(plan)
    sched = plan.data["schedule"]["name"]
    mb = plan.data["schedule"]["num_microbatches"]
    v = deg["virtual_stages"]
    notes = _common_notes(plan, "torchtitan")

    replicate, shard, reshard = _torchtitan_fsdp(par.zero, deg, notes, "0.3")
    schedule = _torchtitan_schedule(sched, v, notes)
    parallelism: dict = {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "fsdp_reshard_after_forward": reshard,
        "tensor_parallel_degree": deg["tp"],
        "enable_sequence_parallel": bool(par.sequence_parallel or deg["tp"] == 1),
        "pipeline_parallel_degree": deg["pp"],
        "pipeline_parallel_schedule": schedule,
        "pipeline_parallel_microbatch_size": par.micro_batch,
        "context_parallel_degree": deg["cp"],
        "expert_parallel_degree": deg["ep"],
    }
    split = _stage_split(plan)
    if deg["pp"] > 1:
        parallelism["pipeline_parallel_first_stage_less_layers"] = 0
        parallelism["pipeline_parallel_last_stage_less_layers"] = 0
        if len(set(split)) == 1:
            parallelism["pipeline_parallel_layers_per_stage"] = split[0]
        else:
            parallelism["module_fqns_per_model_part"] = torchtitan_model_parts(split, "lm_head")
    if par.order != "tp-cp-ep-dp-pp":
        notes.append(f"order {par.order}: torchtitan's device mesh orders pp, dp_replicate, dp_shard, cp, tp "
                     "(tp fastest); other orders are not expressible")
    if _reduces_over_dp(plan) and par.bucket_size != DEFAULT_BUCKET_SIZE:
        notes.append(f"bucket_size {par.bucket_size}: torchtitan has no gradient bucket size setting (FSDP2 "
                     "reduce-scatters each transformer block's gradients as one group)")

    # batch: with pp, one step's micro-batches are the pipeline micro-batches of one local
    # batch; without pp, torchtitan accumulates global / (local * dp) local batches
    training = {
        "local_batch_size": par.micro_batch * mb if deg["pp"] > 1 else par.micro_batch,
        "global_batch_size": par.global_batch,
        "seq_len": m.seq_len,
        "steps": tr.steps,
        "max_norm": tr.grad_clip,
        "dtype": "float32",
        "mixed_precision_param": "bfloat16" if m.dtype == "bf16" else "float32",
        "mixed_precision_reduce": "float32",
    }
    if deg["pp"] > 1:   # Trainer.Config: "CUDA graphs do not support pipeline parallelism yet"
        training["disable_cuda_graphs"] = True
    if _reduce_dtype(plan) != "fp32":
        notes.append(f"reduce_dtype {_reduce_dtype(plan)}: torchtitan 0.3 reduces gradients in float32 only "
                     "(training.mixed_precision_reduce)")
    if par.recompute == "selective":
        notes.append("recompute selective: torchtitan's op-level selective checkpointing (SelectiveAC) saves "
                     "matmul outputs and recomputes the rest, not only the attention core")
    if tr.optimizer == "sgd":
        notes.append("optimizer sgd: exported as torch.optim.SGD in torchtitan's param group")
    if m.dropout:
        notes.append(f"dropout {m.dropout}: torchtitan's llama3 has no dropout")
    if cfg.train.data == "synthetic":
        notes.append("dataset: c4_test is torchtitan's bundled sample; parcompile's spec trains on synthetic tokens")
    rope = {"theta": float(m.rope_theta), "max_seq_len": m.max_positions, "scaling": "none"}
    if m.rope_type == "llama3":
        rope.update(scaling="llama", scaling_factor=float(m.rope_scaling_factor),
                    low_freq_factor=float(m.rope_low_freq_factor), high_freq_factor=float(m.rope_high_freq_factor),
                    original_max_position_embeddings=m.rope_original_max_positions or m.max_positions)
    model = {"n_layers": m.layers, "dim": m.hidden, "n_heads": m.heads, "n_kv_heads": m.kv_heads,
             "hidden_dim": m.ffn_hidden, "vocab_size": m.vocab, "norm_eps": float(m.norm_eps),
             "tie_embeddings": bool(m.tie_embeddings), "rope": rope}
    if tr.optimizer == "sgd":
        opt = ("SGD", {"lr": tr.lr, "weight_decay": tr.weight_decay})
    else:
        opt = ("AdamW" if tr.optimizer == "adamw" else "Adam",
               {"lr": tr.lr, "betas": tuple(tr.betas), "eps": tr.eps, "weight_decay": tr.weight_decay})
    lr = {"warmup_steps": tr.warmup_steps,
          "decay_ratio": None if tr.lr_schedule != "constant" else 0.0,
          "decay_type": "cosine" if tr.lr_schedule == "cosine" else "linear",
          "min_lr_factor": tr.min_lr / tr.lr if tr.lr else 0.0}
    config = {"model": model, "training": training, "parallelism": parallelism,
              "activation_checkpoint": {"none": None, "full": "FullAC", "selective": "SelectiveAC"}[par.recompute],
              "optimizer": opt, "lr_scheduler": lr, "log_freq": tr.log_every, "seed": tr.seed}
    if tr.checkpoint_dir and tr.checkpoint_every:
        config["checkpoint"] = {"enable": True, "folder": tr.checkpoint_dir, "interval": tr.checkpoint_every}
    if tr.precision == "fp8":
        # torchtitan v0.2.2 job_config.py Quantize: the converters registered as
        # quantize.linear.float8 (torchao Float8Linear: tensorwise, rowwise) and quantize.linear.mx
        # (MXLinear); the LM head ("output") kept in bf16, as the plan assumes
        if tr.fp8_recipe == "mxfp8":
            config["model"]["converters"] = ["quantize.linear.mx"]
            config["quantize.linear.mx"] = {"recipe_name": "mxfp8_cublas", "filter_fqns": ["output"]}
        else:
            config["model"]["converters"] = ["quantize.linear.float8"]
            f8: dict = {"filter_fqns": ["output"]}
            if tr.fp8_recipe == "rowwise":
                f8["recipe_name"] = "rowwise"   # v0.2.2 refuses a recipe_name with FP8 all-gather
            elif gathers_fp8(cfg):
                f8.update(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
            config["quantize.linear.float8"] = f8
        notes.append("precision fp8: torchtitan's float8 converters need torch.compile for their speed "
                     "(--compile.enable; docs/float8.md) and an SM89+ GPU")
    return config, notes


def torchtitan_model_parts(split: list[int], output: str) -> list[list[str]]:
    """torchtitan's ``module_fqns_per_model_part`` for chunks of ``split`` layers in model
    order: the embedding (``tok_embeddings``) on the first chunk, the final norm and the
    output projection (``output``: ``lm_head`` in 0.3, ``output`` in 0.2) on the last."""
    parts, first = [], 0
    for i, n in enumerate(split):
        part = ["tok_embeddings"] if i == 0 else []
        part += [f"layers.{k}" for k in range(first, first + n)]
        part += ["norm", output] if i == len(split) - 1 else []
        parts.append(part)
        first += n
    return parts


def _py_name(name: str) -> str:
    """A Python identifier from a spec name (``llama3-8b`` -> ``llama3_8b``)."""
    out = "".join(c if c.isalnum() else "_" for c in name)
    return out if out and not out[0].isdigit() else f"spec_{out}"


def _torchtitan3(plan: Plan) -> Export:
    cfg = plan.config
    config, notes = torchtitan_registry(plan)
    errors = torchtitan_errors(plan)
    if cfg.train.precision == "fp8":
        errors.append("precision fp8: parcompile writes torchtitan's float8 converters in 0.2's TOML "
                      "([quantize.linear.float8] / [quantize.linear.mx]) only; export --torchtitan-version 0.2")
    fn = _py_name(cfg.name)
    module = f"{fn}_torchtitan"
    cl = cfg.cluster
    launch = (f"PYTHONPATH=. torchrun --nnodes {cl.nodes} --nproc-per-node {cl.gpus_per_node}"
              + (' --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"' if cl.nodes > 1 else "")
              + f" -m torchtitan.train --module {module} --config {fn}")
    md, tr_, pa = config["model"], config["training"], config["parallelism"]
    r = md["rope"]
    opt_name, opt_kwargs = config["optimizer"]
    ac = config["activation_checkpoint"]
    lines = [
        f'"""torchtitan 0.3 config registry for `{cfg.name}` (exported by parcompile): {_layout(plan)}.',
        "",
        "Launch from the root of a torchtitan source checkout with this file copied there (torchtitan reads",
        "the c4_test sample and the tokenizer from ./tests/assets there, which its pip wheel does not ship;",
        "with your own data and tokenizer, from any directory holding this file, overriding",
        f"--hf-assets-path and --dataloader.dataset): {launch}",
        "(command-line overrides such as --training.steps 20 go after --config).",
    ]
    lines += [""] + [f"error: {e}" for e in errors] if errors else []
    lines += [""] + [f"note: {n}" for n in notes] if notes else []
    lines += [
        '"""',
        "",
        "from torchtitan.components.checkpoint import CheckpointManager",
        "from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss",
        "from torchtitan.components.metrics import MetricsProcessor",
        "from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer",
        "from torchtitan.components.optimizer.optimizer import ParamGroupConfig",
        "from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig",
        "from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC",
        "from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader",
        "from torchtitan.models import llama3",
        "from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm",
        "from torchtitan.trainer import Trainer",
        "",
        f"FLAVOR = {cfg.name!r}",
        "",
        "",
        'def _model(attn_backend: str = "flex", tp_gemm_backend: str = "default") -> llama3.Llama3Model.Config:',
        f'    """The model of `{cfg.name}`: torchtitan\'s llama3 with this spec\'s shape."""',
        f"    dim, vocab_size = {md['dim']}, {md['vocab_size']}",
        "    layers = llama3._build_llama3_layers(",
        f"        fuse_qkv=True, n_layers={md['n_layers']}, dim=dim, n_heads={md['n_heads']}, "
        f"n_kv_heads={md['n_kv_heads']}, hidden_dim={md['hidden_dim']},",
        f"        rope=ComplexRoPE.Config(dim=dim // {md['n_heads']}, max_seq_len={r['max_seq_len']}, "
        f"theta={r['theta']!r}, scaling={r['scaling']!r}"
        + "".join(f", {k}={r[k]!r}" for k in ("scaling_factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings") if k in r) + "),",
        "        attn_backend=attn_backend, tp_gemm_backend=tp_gemm_backend)",
        "    for block in layers:",
        f"        block.attention_norm.eps = block.ffn_norm.eps = {md['norm_eps']!r}",
        "    return llama3.Llama3Model.Config(",
        "        dim=dim, vocab_size=vocab_size," + (" enable_weight_tying=True," if md["tie_embeddings"] else ""),
        "        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim, "
        "param_init=llama3._EMBEDDING_INIT),",
        f"        norm=RMSNorm.Config(normalized_shape=dim, eps={md['norm_eps']!r}, param_init=llama3._NORM_INIT),",
        "        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, "
        "param_init=llama3._output_linear_init(dim)),",
        "        layers=layers)",
        "",
        "",
        "llama3.llama3_configs[FLAVOR] = _model   # a registered flavor, as torchtitan's own are",
        "",
        "",
        f"def {fn}() -> Trainer.Config:",
        f'    """`{cfg.name}` for torchtitan.train (--module {module} --config {fn})."""',
        "    model_spec = llama3.model_registry(FLAVOR)",
        "    return Trainer.Config(",
        "        model_spec=model_spec,",
        "        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size="
        f"{md['vocab_size']})),",
        "        optimizer=OptimizersContainer.Config(param_groups=[ParamGroupConfig(",
        f"            pattern=r\".*\", optimizer_name={opt_name!r}, optimizer_kwargs={opt_kwargs!r})]),",
        "        lr_scheduler=LRSchedulersContainer.Config(" + ", ".join(
            f"{k}={v!r}" for k, v in config["lr_scheduler"].items()) + "),",
        "        training=TrainingConfig(" + ", ".join(f"{k}={v!r}" for k, v in tr_.items()) + "),",
        "        parallelism=ParallelismConfig(",
    ]
    lines += [f"            {k}={v!r}," for k, v in pa.items()]
    lines += [
        "        ),",
        f"        activation_checkpoint={'None' if ac is None else ac + '.Config()'},",
        '        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test"),',
        f"        metrics=MetricsProcessor.Config(log_freq={config['log_freq']}),",
        f"        debug=DebugConfig(seed={config['seed']}),",
    ]
    ck = config.get("checkpoint")
    lines.append("        checkpoint=CheckpointManager.Config(" + (
        f"enable=True, folder={ck['folder']!r}, interval={ck['interval']}" if ck else "enable=False") + "),")
    lines.append("    )")
    return Export("torchtitan", "\n".join(lines) + "\n", notes, launch, f"{module}.py", errors)


def _toml_value(x) -> str:
    """A TOML scalar (booleans, integers, floats, strings)."""
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return repr(x) if x == x and x not in (float("inf"), float("-inf")) else "nan"
    if isinstance(x, list):      # (nested) arrays of strings: JSON's arrays are valid TOML arrays
        return json.dumps(x)
    return json.dumps(str(x))   # a JSON string is a valid TOML basic string


def _torchtitan(plan: Plan) -> Export:
    cfg = plan.config
    config, notes = torchtitan_config(plan)
    errors = torchtitan_errors(plan)
    if config["model"]["flavor"] == "debugmodel" and not cfg.model.experts:
        errors.append(f"model: torchtitan 0.2 takes the model's shape from a registered flavor and this shape "
                      f"({cfg.model.layers} layers, hidden {cfg.model.hidden}) is none of llama3's 8B, 70B, 405B; "
                      "export for torchtitan 0.3, which registers the spec's own flavor")
    notes = [n for n in notes if not n.startswith("model: torchtitan takes the model's shape")]
    fl, differs = torchtitan02_flavor(plan)
    if differs and not cfg.model.experts:
        errors.append(f"model: torchtitan 0.2's llama3 flavor {fl} (torchtitan v0.2.2 models/llama3) is another "
                      f"model than the spec's: {'; '.join(differs)}; 0.2's TOML names a flavor and overrides none "
                      "of its fields: export for torchtitan 0.3, which registers the spec's own shape")
    deg, p = _degrees(plan), config["parallelism"]
    if (cfg.model.dtype == "bf16" and p["data_parallel_shard_degree"] == 1 and deg["cp"] == 1
            and (deg["tp"] > 1 or deg["pp"] > 1)):
        # torchtitan 0.2.2: fully_shard casts to mixed_precision_param only when FSDP is on
        # (ParallelDims.fsdp_enabled: dp_shard > 1 or cp > 1); distributed/utils.py
        # maybe_enable_amp turns mixed precision off under tp or pp otherwise
        errors.append(f"dtype bf16 with dp {deg['dp']} and tp {deg['tp']} x pp {deg['pp']}: torchtitan 0.2 applies "
                      "mixed_precision_param only through FSDP (data_parallel_shard_degree > 1 or cp > 1) and "
                      "disables mixed precision under tp or pp without it, so this run would train in float32 "
                      "(FSDP cannot shard over one data-parallel rank); export for torchtitan 0.3, whose FSDP "
                      "wrapper installs the bf16 policy at any degree")
    cl = cfg.cluster
    launch = (f"CONFIG_FILE={cfg.name}_torchtitan.toml NGPU={cl.gpus_per_node} ./run_train.sh"
              if cl.nodes == 1 else
              f"torchrun --nnodes {cl.nodes} --nproc-per-node {cl.gpus_per_node} --rdzv-backend c10d "
              f'--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" -m torchtitan.train '
              f"--job.config_file {cfg.name}_torchtitan.toml")
    lines = [f"# torchtitan 0.2 job config for `{cfg.name}` (exported by parcompile)",
             f"# launch: {launch}"]
    lines += [f"# error: {e}" for e in errors]
    lines += [f"# note: {n}" for n in notes]
    for table, keys in config.items():
        lines += ["", f"[{table}]"] + [f"{k} = {_toml_value(v)}" for k, v in keys.items()]
    return Export("torchtitan", "\n".join(lines) + "\n", notes, launch, f"{cfg.name}_torchtitan.toml", errors)


# ---------------------------------------------------------------------------------------------
# DeepSpeed


def deepspeed_config(plan: Plan) -> tuple[dict, list[str], list[str]]:
    """The DeepSpeed (0.19) JSON config for ``plan``, the notes and the errors (what DeepSpeed
    would run as another layout)."""
    cfg = plan.config
    par, m, tr = cfg.parallel, cfg.model, cfg.train
    deg = _degrees(plan)
    sched = plan.data["schedule"]["name"]
    notes = _common_notes(plan, "DeepSpeed")
    errors: list[str] = []
    if tr.precision == "fp8":
        errors.append("precision fp8: DeepSpeed's config has no FP8 training (its fp16 and bf16 sections are the "
                      "16-bit ones); export --to megatron or --to torchtitan")
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
        # no "partition": DeepSpeed's engine never reads it; PipelineModule's partition_method splits
        c["pipeline"] = {"stages": deg["pp"],
                         "activation_checkpoint_interval": 1 if par.recompute == "full" else 0}
        # PipelineModule(num_stages=pp) alone makes dp = world / pp (deepspeed/runtime/pipe/module.py),
        # every tp rank a data-parallel replica; the topology gives DeepSpeed dp = world / (pp * tp)
        notes.append(f"pipeline: build deepspeed.pipe.PipelineModule(layers, topology="
                     f"deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology(num_pp={deg['pp']}, "
                     f"num_mp={deg['tp']}, num_dp={deg['dp']}), partition_method=\"type:<your block class>\") "
                     f"with layers = [embedding, {plan.config.model.layers} blocks, final norm, output head] and train "
                     "with engine.train_batch(); DeepSpeed then takes dp from the topology's data axis, and "
                     "\"type:\" balances the blocks alone (\"uniform\" counts the embedding, norm and head as "
                     "layers and splits the blocks unevenly)")
        if sched != "1f1b":
            notes.append(f"schedule {sched}: DeepSpeed's pipeline engine runs only its own 1F1B schedule "
                         "(TrainSchedule)" + ("; virtual stages are not expressible" if deg["virtual_stages"] > 1
                                              else ""))
        if par.zero >= 2:   # deepspeed/runtime/pipe/engine.py PipelineEngine.__init__ asserts it
            errors.append(f"zero {par.zero} with pp {deg['pp']}: DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3 "
                          "(\"incompatible with pipeline parallelism\"); use zero 0 or 1")
        if par.stage_layers is not None and len(set(_stage_split(plan))) > 1:
            notes.append(f"stage_layers {_stage_split(plan)}: DeepSpeed's PipelineModule has no partition method "
                         "for given boundaries (only uniform, parameters and type:REGEX); subclass it and override "
                         "_partition_layers to set self.parts to these layer counts")
    if deg["tp"] > 1:
        if deg["pp"] == 1:
            c["tensor_parallel"] = {"autotp_size": deg["tp"]}
            # without an mpu DeepSpeedConfig counts every rank as data parallel (runtime/config.py)
            notes.append(f"tp {deg['tp']}: DeepSpeed AutoTP training (tensor_parallel.autotp_size) splits the linear "
                         "layers of a Hugging Face-style model (nn.Linear projections); call "
                         "deepspeed.utils.groups._init_tp_mesh_device(tensor_model_parallel_size="
                         f"{deg['tp']}) and pass mpu=deepspeed.utils.groups to deepspeed.initialize, so that "
                         f"DeepSpeed's data-parallel size is world / tp = {deg['dp']} (without an mpu it counts "
                         "every rank)")
        else:
            # deepspeed 0.19.8: AutoTP's groups are a (data, tensor) mesh over every rank
            # (utils/groups.py _init_tp_mesh_device), with no pipeline axis; a PipelineModule's
            # tensor parallelism is the model code's own (Megatron-DeepSpeed's mpu)
            errors.append(f"tp {deg['tp']} with pp {deg['pp']}: DeepSpeed's config cannot state tensor parallelism "
                          "inside a pipeline: AutoTP (tensor_parallel.autotp_size) builds a data x tensor mesh over "
                          "every rank (deepspeed.utils.groups._init_tp_mesh_device) with no pipeline axis, so this "
                          f"config would train tp 1; the model code must provide tensor-parallel layers and an mpu "
                          f"(Megatron-DeepSpeed's mpu, or PipeModelDataParallelTopology(num_pp={deg['pp']}, "
                          f"num_mp={deg['tp']}, num_dp={deg['dp']}) handed to PipelineModule) that DeepSpeed only "
                          "reads the groups from; use Megatron-LM or torchtitan for this layout, or tp 1 with pp, "
                          "or pp 1 with AutoTP")
        if par.sequence_parallel:
            notes.append("sequence_parallel: AutoTP has no Megatron-style sequence parallelism")
    if par.recompute != "none":
        c["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False,
                                         "cpu_checkpointing": False}
        notes.append("recompute: the model code checkpoints each layer with deepspeed.checkpointing.checkpoint"
                     + ("; selective (attention-core) recomputation is not expressible in the config"
                        if par.recompute == "selective" else ""))
    if deg["cp"] > 1:
        errors.append(f"cp {deg['cp']}: DeepSpeed has no context parallelism with all-gathered keys and values "
                      "(DeepSpeed-Ulysses splits the sequence with all-to-all over heads instead); it would make "
                      "the cp ranks data-parallel replicas")
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
    return c, notes, errors


def _deepspeed(plan: Plan) -> Export:
    cfg = plan.config
    c, notes, errors = deepspeed_config(plan)
    cl = cfg.cluster
    name = f"{cfg.name}_deepspeed.json"
    launch = (f"deepspeed --num_nodes {cl.nodes} --num_gpus {cl.gpus_per_node}"
              + (" --hostfile hostfile" if cl.nodes > 1 else "")
              + f" train.py --deepspeed --deepspeed_config {name}")
    notes.append(f"model: train.py builds the {cfg.model.layers}-layer model ({plan.data['model']['params']:,} "
                 "parameters) and calls deepspeed.initialize with this config")
    if cl.nodes > 1:   # deepspeed/launcher/runner.py fetch_hostfile: a missing file means this machine only
        notes.append(f"hostfile: write `hostfile` in the launch directory, one line per node, "
                     f"`<hostname> slots={cl.gpus_per_node}` ({cl.nodes} lines, reachable by passwordless ssh); "
                     f"without it DeepSpeed's runner only warns and trains on this machine alone, not on "
                     f"{cl.nodes} nodes")
    return Export("deepspeed", json.dumps(c, sort_keys=True, indent=2) + "\n", notes, launch, name, errors)


# ---------------------------------------------------------------------------------------------
# vLLM and SGLang (serve specs)

#: the plan's KV-cache dtype -> the servers' --kv-cache-dtype when it differs from the model's
#: ("auto": the model's dtype); both take fp8_e4m3 and fp8_e5m2 (vLLM: CacheDType in
#: vllm/config/cache.py; SGLang: --kv-cache-dtype in sglang/srt/server_args.py)
KV_CACHE_DTYPE = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
#: the model dtype -> the servers' --dtype
SERVE_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def serve_memory_fraction(plan: Plan, with_workspace: bool) -> float:
    """The fraction of one GPU's memory the plan's memory model gives the server: weights,
    KV cache and (``with_workspace``) the activation workspace per rank over the GPU's memory
    (``plan.json`` ``serve``), rounded up to 0.01. vLLM's ``--gpu-memory-utilization`` bounds
    everything vLLM allocates (weights, activations at its profiling run, KV cache); SGLang's
    ``--mem-fraction-static`` bounds weights and the KV pool (its activations come on top)."""
    s = plan.data["serve"]
    used = s["weights_bytes_per_rank"] + s["kv_cache_bytes_per_rank"]
    if with_workspace:
        used += s["workspace_bytes_per_rank"]
    return min(1.0, -(-100 * used // plan.config.cluster.memory) / 100)



def serve_fraction_sequences(plan: Plan, with_workspace: bool) -> int:
    """Sequences of ``prompt_len + max_new_tokens`` tokens whose KV cache fits in the memory
    fraction ``serve_memory_fraction`` gives (the same ``with_workspace``): that fraction of
    the GPU's memory less the weights (and the workspace) per rank, over one sequence's KV
    cache per rank (``kv_cache_bytes_per_rank / batch_per_replica``)."""
    s = plan.data["serve"]
    left = serve_memory_fraction(plan, with_workspace) * plan.config.cluster.memory - s["weights_bytes_per_rank"]
    if with_workspace:
        left -= s["workspace_bytes_per_rank"]
    per_sequence = s["kv_cache_bytes_per_rank"] / s["batch_per_replica"]
    return int(left // per_sequence) if per_sequence else 0

def serve_args(plan: Plan, target: str) -> tuple[list[tuple[str, str | None]], list[str], list[str]]:
    """The server arguments for a serve ``plan`` (``target`` ``vllm`` or ``sglang``) as
    ``(flag, value or None)`` pairs, the notes and the errors."""
    cfg = plan.config
    m, sv = cfg.model, cfg.serve
    deg = _degrees(plan)
    s = plan.data["serve"]
    notes, errors = [], []
    kv = "auto" if sv.kv_dtype == m.dtype else KV_CACHE_DTYPE.get(sv.kv_dtype)
    if kv is None:
        errors.append(f"kv_dtype {sv.kv_dtype}: {SERVE_TARGETS[target]} keeps the KV cache in the model's dtype "
                      f"({m.dtype}) or fp8; not {sv.kv_dtype}")
        kv = "auto"
    max_len = sv.prompt_len + sv.max_new_tokens
    if deg["cp"] > 1:
        errors.append(f"cp {deg['cp']}: {SERVE_TARGETS[target]} has no context parallelism for decoding")
    if deg["ep"] > 1 and deg["ep"] != deg["tp"] * deg["dp"]:
        errors.append(f"ep {deg['ep']}: expert parallelism spans tp x dp ({deg['tp'] * deg['dp']}) ranks in "
                      f"{SERVE_TARGETS[target]}")
    a: list[tuple[str, str | None]] = []
    if target == "vllm":
        a += [("--tensor-parallel-size", str(deg["tp"])), ("--pipeline-parallel-size", str(deg["pp"]))]
        if deg["dp"] > 1:
            a.append(("--data-parallel-size", str(deg["dp"])))
        if deg["ep"] > 1:
            a.append(("--enable-expert-parallel", None))
        a += [("--max-model-len", str(max_len)), ("--max-num-seqs", str(s["batch_per_replica"])),
              ("--kv-cache-dtype", kv), ("--gpu-memory-utilization", f"{serve_memory_fraction(plan, True):.2f}"),
              ("--dtype", SERVE_DTYPE[m.dtype]), ("--seed", str(sv.seed))]
    else:
        a += [("--tp-size", str(deg["tp"])), ("--pp-size", str(deg["pp"]))]
        if deg["dp"] > 1:
            a.append(("--dp-size", str(deg["dp"])))
        if deg["ep"] > 1:
            a.append(("--ep-size", str(deg["ep"])))
        a += [("--context-length", str(max_len)), ("--max-running-requests", str(s["batch_per_replica"])),
              ("--kv-cache-dtype", kv), ("--mem-fraction-static", f"{serve_memory_fraction(plan, False):.2f}"),
              ("--dtype", SERVE_DTYPE[m.dtype]), ("--random-seed", str(sv.seed))]
    if s.get("max_concurrent_sequences", 0) > s["batch_per_replica"]:
        flag, fraction = a[[k for k, _ in a].index(
            "--gpu-memory-utilization" if target == "vllm" else "--mem-fraction-static")]
        notes.append(f"{flag} {fraction} sizes the KV cache for about {serve_fraction_sequences(plan, target == 'vllm')} "
                     f"sequences of {max_len} tokens (the plan's {s['batch_per_replica']} per replica, the fraction "
                     f"rounded up); the GPU's free memory would hold {s['max_concurrent_sequences']}: raise {flag} "
                     "to serve more at once")
    if cfg.cluster.nodes > 1:
        notes.append("multi-node: see the server's multi-node launch (Ray for vLLM, --nnodes/--node-rank for SGLang)")
    return a, notes, errors


def _serve(plan: Plan, target: str) -> Export:
    cfg = plan.config
    args, notes, errors = serve_args(plan, target)
    weights = cfg.serve.weights or "MODEL"
    if not cfg.serve.weights:
        notes.append("weights: the spec names no checkpoint; put the model's Hugging Face directory for MODEL")
    head = (["vllm", "serve", weights] if target == "vllm" else
            ["python", "-m", "sglang.launch_server", "--model-path", weights])
    launch = " ".join(shlex.quote(w) for w in head)
    lines = [f"# {SERVE_TARGETS[target]} server for `{cfg.name}`: {_layout(plan)} (exported by parcompile)"]
    lines += [f"# error: {e}" for e in errors] + [f"# note: {n}" for n in notes]
    lines.append(launch + " \\")
    body = [f"    {flag}" + ("" if v is None else f" {shlex.quote(v)}") for flag, v in args]
    lines += [b + " \\" for b in body[:-1]] + [body[-1]]
    return Export(target, "\n".join(lines) + "\n", notes, launch, f"{cfg.name}_{target}.sh", errors)
