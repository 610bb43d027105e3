"""``parcompile export --to torchtitan`` (0.3, the default): a config registry module (Python)
that registers the spec's model as a llama3 flavor and defines the ``Trainer.Config``, run
with ``torchtitan.train --module ... --config ...``; and what 0.3 and 0.2
(:mod:`parcompile.exporters.torchtitan02`) share: the model's errors, the FSDP settings for a
ZeRO stage, the pipeline schedule and the model parts of uneven stages."""

from __future__ import annotations

from parcompile.core.recompute import is_module_list, recompute_words
from parcompile.config.schema import DEFAULT_BUCKET_SIZE
from parcompile.core.data_parallel import DataParallelSharding
from parcompile.core.schedule import Schedule as PipelineSchedule
from parcompile.exporters.common import (Export, common_notes, degrees, dp_sharding, grad_reduce_dtype, layout_line, py_name,
                                      py_kwargs, reduces_over_dp, stage_split)
from parcompile.exporters.lora import torchtitan_lora
from parcompile.exporters.model_keys import model_key_errors
from parcompile.exporters.offload_hsdp import torchtitan_offload, torchtitan_offload_errors
from parcompile.plan import Plan

#: parcompile schedule -> torch.distributed.pipelining schedule name (torchtitan), for one
#: stage per rank (``virtual_stages == 1``) and for several
TORCHTITAN_SCHEDULE = {
    ("gpipe", False): "GPipe", ("1f1b", False): "1F1B", ("zero_bubble", False): "1F1B",
    ("gpipe", True): "LoopedBFS", ("1f1b", True): "Interleaved1F1B",
    ("interleaved_1f1b", True): "Interleaved1F1B", ("zero_bubble", True): "InterleavedZeroBubble",
    ("interleaved_1f1b", False): "1F1B",
}
#: the torchtitan schedules that place model chunks the ``v`` way (torchtitan 0.3.0
#: ``torchtitan/distributed/pipeline_parallel.py`` ``_get_pp_rank_to_stage_indices_mapping``:
#: ScheduleZBVZeroBubble and ScheduleDualPipeV; every other one ``loop``)
TORCHTITAN_V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def torchtitan_errors(plan: Plan) -> list[str]:
    """The values of model keys torchtitan carries that its llama3 model
    (``torchtitan.models.llama3``) cannot take without training a different model: RoPE scalings
    other than none and Llama 3.1's, fp16. The keys it does not carry at all (norms,
    activations, biases, MLA, experts, ...) are refused first by the allowlist
    (:data:`parcompile.exporters.model_keys.TORCHTITAN`, :func:`torchtitan_model_errors`)."""
    m = plan.config.model
    errors = []
    if m.position == "rope" and m.rope_type not in ("default", "llama3"):
        errors.append(f"rope_type {m.rope_type}: torchtitan's llama3 RoPE scales as none or llama (Llama 3.1)")
    if m.dtype == "fp16":   # TrainingConfig.dtype / mixed_precision_param: Literal["bfloat16", "float32"]
        errors.append("dtype fp16: torchtitan trains in bfloat16 or float32 only (training.mixed_precision_param, "
                      "training.dtype); use dtype bf16 or fp32 in the spec")
    par = plan.config.parallel
    if is_module_list(par.recompute):
        errors.append(f"recompute {recompute_words(par.recompute)}: torchtitan's activation checkpointing is "
                      "per layer (full), per other layer or per op (selective); Megatron-Core's module list is not "
                      "expressible: use recompute = selective or full, or export --to megatron")
    sched = par.pipeline_schedule
    name = TORCHTITAN_SCHEDULE[(sched.name, par.virtual_stages > 1)]
    style = "v" if name in TORCHTITAN_V_SCHEDULES else "loop"   # torchtitan's own rule
    if par.pp > 1 and style != sched.placement.name:
        errors.append(f"schedule {sched.name}: torchtitan's {name} places the model chunks on the pipeline ranks "
                      f"the {style} way, the plan the {sched.placement.name} way")
    return errors + torchtitan_offload_errors(plan)


def torchtitan_model_errors(plan: Plan, version: str) -> list[str]:
    """The model's errors for torchtitan ``version`` (``"0.3"``, ``"0.2"``): the keys it does
    not carry (:func:`parcompile.exporters.model_keys.model_key_errors`), then
    :func:`torchtitan_errors`, then LoRA's (:func:`parcompile.exporters.lora.torchtitan_lora`)."""
    return (model_key_errors(plan, "torchtitan" if version == "0.3" else "torchtitan-0.2") + torchtitan_errors(plan)
            + torchtitan_lora(plan, version)[2])


def torchtitan_fsdp(sharding: DataParallelSharding, deg: dict, notes: list[str],
                    version: str) -> tuple[int, int, str]:
    """torchtitan's FSDP2 settings for the plan's data-parallel ``sharding`` (ZeRO stage
    ``zero``): (data_parallel_replicate_degree, data_parallel_shard_degree,
    fsdp_reshard_after_forward); appends the notes. HSDP (``sharding.replicate > 1``):
    ``dp_replicate`` x ``dp / dp_replicate``, resharded as the stage says.

    zero 0 replicates the states over dp (0.3's llama3 applies fully_shard over
    dp_replicate x dp_shard, so dp_shard = 1 is DDP's memory and reduction); torchtitan 0.2
    refuses data_parallel_replicate alone with tp, pp or cp ("DDP has not supported > 1D
    parallelism"), so there it is FSDP over dp. zero 1 and 2 shard with FSDP2 and keep the
    parameters gathered from forward to backward ("never"); zero 3 uses "default": parcompile's
    own policy (parcompile.core.buckets.reshard_after_forward: resharded after forward
    without pp, kept across micro-batches with pp)."""
    zero = sharding.stage   # for the notes, which name the spec's key
    if sharding.replicate > 1:   # HSDP (parallel.dp_replicate): FSDP2's 2-D mesh, sharded over dp_shard
        return sharding.replicate, deg["dp"] // sharding.replicate, "default" if sharding.shards_parameters else "never"
    if not sharding.shards_optimizer_states:
        if version == "0.2" and (deg["tp"] > 1 or deg["pp"] > 1 or deg["cp"] > 1):
            notes.append("zero 0 with tp, pp or cp: torchtitan 0.2 replicates (DDP) only without other "
                         "parallelism; exported as FSDP over dp (data_parallel_shard_degree = dp), which shards "
                         "the states")
            return 1, deg["dp"], "default"
        return deg["dp"], 1, "default"
    if not sharding.shards_parameters:
        notes.append(f"zero {zero}: torchtitan shards with FSDP2 (data_parallel_shard_degree = dp), which "
                     "also shards the parameters between steps (ZeRO-3 storage); fsdp_reshard_after_forward "
                     "= \"never\" keeps them gathered from forward to backward, ZeRO-2-like communication")
        return 1, deg["dp"], "never"
    return 1, deg["dp"], "default"


def torchtitan_schedule(sched: PipelineSchedule, v: int, notes: list[str]) -> str:
    """torchtitan's ``pipeline_parallel_schedule`` for the plan's schedule with ``v`` model
    chunks per rank; appends a note where torch.distributed.pipelining runs another one (a
    schedule torchtitan places otherwise is :func:`torchtitan_errors`'s)."""
    name = TORCHTITAN_SCHEDULE[(sched.name, v > 1)]
    if sched.split_backward and v == 1:
        notes.append("schedule zero_bubble with one stage per rank (ZB-H1): torch.distributed.pipelining's "
                     "zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble) need two or more stages per "
                     "rank; exported as 1F1B")
    if sched.forwards_first and v > 1:
        notes.append(f"schedule {sched.name} with virtual stages: exported as LoopedBFS (GPipe over looped stages)")
    return name

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
    par, tr = cfg.parallel, cfg.train
    notes = common_notes(plan, "torchtitan")
    parallelism = _torchtitan3_parallelism(plan, notes)
    training = _torchtitan3_training(plan, notes)
    model = _torchtitan3_model(plan)
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
              "activation_checkpoint": {"none": None, "full": "FullAC", "selective": "SelectiveAC"}.get(par.recompute),
              "optimizer": opt, "lr_scheduler": lr, "log_freq": tr.log_every, "seed": tr.seed}
    if tr.checkpoint_dir and tr.checkpoint_every:
        config["checkpoint"] = {"enable": True, "folder": tr.checkpoint_dir, "interval": tr.checkpoint_every}
    config["lora"], lora_notes, _ = torchtitan_lora(plan, "0.3")   # LoRAConverter's settings, or None
    model["fuse_qkv"] = config["lora"] is None   # one adapter per projection: q, k, v unfused (exporters/lora.py)
    return config, notes + lora_notes


def _torchtitan3_parallelism(plan: Plan, notes: list[str]) -> dict:
    """``Trainer.Config.parallelism``: FSDP for the ZeRO stage, the degrees, the pipeline
    schedule and stage split; notes where torchtitan runs another layout."""
    par = plan.config.parallel
    deg = degrees(plan)
    sched = par.pipeline_schedule
    v = deg["virtual_stages"]
    replicate, shard, reshard = torchtitan_fsdp(dp_sharding(plan), deg, notes, "0.3")
    schedule = torchtitan_schedule(sched, v, notes)
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
    split = stage_split(plan)
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
    if reduces_over_dp(plan) and par.bucket_size != DEFAULT_BUCKET_SIZE:
        notes.append(f"bucket_size {par.bucket_size}: torchtitan has no gradient bucket size setting (FSDP2 "
                     "reduce-scatters each transformer block's gradients as one group)")
    return parallelism


def _torchtitan3_training(plan: Plan, notes: list[str]) -> dict:
    """``Trainer.Config.training``: batch sizes, steps, clipping, precision; notes on what
    torchtitan 0.3 trains differently (reduce dtype, recomputation, optimizer, dropout, data)."""
    cfg = plan.config
    par, m, tr = cfg.parallel, cfg.model, cfg.train
    deg = degrees(plan)
    mb = plan.data["schedule"]["num_microbatches"]
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
        **torchtitan_offload(plan),
    }
    if deg["pp"] > 1:   # Trainer.Config: "CUDA graphs do not support pipeline parallelism yet"
        training["disable_cuda_graphs"] = True
    if grad_reduce_dtype(plan) != "fp32":
        notes.append(f"reduce_dtype {grad_reduce_dtype(plan)}: torchtitan 0.3 reduces gradients in float32 only "
                     "(training.mixed_precision_reduce)")
    if par.recompute == "selective":
        notes.append("recompute selective: torchtitan's op-level selective checkpointing (SelectiveAC) saves "
                     "matmul outputs and recomputes the rest, not only the attention core")
    if tr.optimizer == "sgd":
        notes.append("optimizer sgd: exported as torch.optim.SGD in torchtitan's param group")
    if cfg.train.data == "synthetic":
        notes.append("dataset: c4_test is torchtitan's bundled sample; parcompile's spec trains on synthetic tokens")
    return training


def _torchtitan3_model(plan: Plan) -> dict:
    """The llama3 model's shape and RoPE for the registered flavor."""
    m = plan.config.model
    rope = {"theta": float(m.rope_theta), "max_seq_len": m.max_positions, "scaling": "none"}
    if m.rope_type == "llama3":
        rope.update(scaling="llama", scaling_factor=float(m.rope_scaling_factor),
                    low_freq_factor=float(m.rope_low_freq_factor), high_freq_factor=float(m.rope_high_freq_factor),
                    original_max_position_embeddings=m.rope_original_max_positions or m.max_positions)
    model = {"n_layers": m.layers, "dim": m.hidden, "n_heads": m.heads, "n_kv_heads": m.kv_heads,
             "hidden_dim": m.ffn_hidden, "vocab_size": m.vocab, "norm_eps": float(m.norm_eps),
             "tie_embeddings": bool(m.tie_embeddings), "rope": rope}
    return model


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



def torchtitan3_export(plan: Plan) -> Export:
    """``--to torchtitan`` (0.3): a config registry module registering the spec's llama3
    flavor (:func:`torchtitan_registry`) with :func:`torchtitan_model_errors` in its docstring."""
    cfg = plan.config
    config, notes = torchtitan_registry(plan)
    errors = torchtitan_model_errors(plan, "0.3")
    if cfg.train.precision == "fp8":
        errors.append("precision fp8: parcompile writes torchtitan's float8 converters in 0.2's TOML "
                      "([quantize.linear.float8] / [quantize.linear.mx]) only; export --torchtitan-version 0.2")
    fn = py_name(cfg.name)
    module = f"{fn}_torchtitan"
    cl = cfg.cluster
    launch = (f"PYTHONPATH=. torchrun --nnodes {cl.nodes} --nproc-per-node {cl.gpus_per_node}"
              + (' --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"' if cl.nodes > 1 else "")
              + f" -m torchtitan.train --module {module} --config {fn}")
    lines = [
        f'"""torchtitan 0.3 config registry for `{cfg.name}` (exported by parcompile): {layout_line(plan)}.',
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
        *(["from torchtitan.components.lora import LoRAConverter"] if config["lora"] is not None else []),
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
    ]
    lines += _torchtitan3_model_lines(cfg.name, config["model"])
    lines += ["", "", "llama3.llama3_configs[FLAVOR] = _model   # a registered flavor, as torchtitan's own are", "", ""]
    lines += _torchtitan3_trainer_lines(cfg.name, fn, module, config)
    return Export("torchtitan", "\n".join(lines) + "\n", notes, launch, f"{module}.py", errors)


def _torchtitan3_model_lines(name: str, md: dict) -> list[str]:
    """The exported module's ``_model()``: torchtitan's llama3 ``Llama3Model.Config`` with the
    shape ``md`` (:func:`torchtitan_registry`'s ``"model"``) of spec ``name``."""
    r = md["rope"]
    return [
        'def _model(attn_backend: str = "flex", tp_gemm_backend: str = "default") -> llama3.Llama3Model.Config:',
        f'    """The model of `{name}`: torchtitan\'s llama3 with this spec\'s shape."""',
        f"    dim, vocab_size = {md['dim']}, {md['vocab_size']}",
        "    layers = llama3._build_llama3_layers(",
        f"        fuse_qkv={md['fuse_qkv']}, n_layers={md['n_layers']}, dim=dim, n_heads={md['n_heads']}, "
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
    ]


def _torchtitan3_trainer_lines(name: str, fn: str, module: str, config: dict) -> list[str]:
    """The exported module's ``Trainer.Config`` function ``fn`` (module ``module``) from
    :func:`torchtitan_registry`'s ``config`` for spec ``name``."""
    md, tr_, pa = config["model"], config["training"], config["parallelism"]
    opt_name, opt_kwargs = config["optimizer"]
    ac = config["activation_checkpoint"]
    lines = [
        f"def {fn}() -> Trainer.Config:",
        f'    """`{name}` for torchtitan.train (--module {module} --config {fn})."""',
        "    model_spec = llama3.model_registry(FLAVOR" + ("" if config["lora"] is None else ", converters=["
                                                      f"LoRAConverter.Config({py_kwargs(config['lora'])})]") + ")",
        "    return Trainer.Config(",
        "        model_spec=model_spec,",
        "        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size="
        f"{md['vocab_size']})),",
        "        optimizer=OptimizersContainer.Config(param_groups=[ParamGroupConfig(",
        f"            pattern=r\".*\", optimizer_name={opt_name!r}, optimizer_kwargs={opt_kwargs!r})]),",
        "        lr_scheduler=LRSchedulersContainer.Config(" + py_kwargs(config["lr_scheduler"]) + "),",
        "        training=TrainingConfig(" + py_kwargs(tr_) + "),",
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
    return lines
