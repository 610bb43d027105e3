"""``parcompile export --to deepspeed``: a DeepSpeed (0.19) JSON config; JSON has no comments,
so the notes (with the topology / mpu that makes DeepSpeed's data-parallel size the plan's)
and the ``deepspeed`` launcher line are in :attr:`Export.notes` / :attr:`Export.launch`."""

from __future__ import annotations

import json

from parcompile.core.recompute import is_module_list, recompute_words
from parcompile.exporters.common import (Export, common_notes, degrees, dp_sharding, grad_reduce_dtype, placement_errors,
                                      reduces_over_dp, stage_split)
from parcompile.exporters.lora import deepspeed_lora_note
from parcompile.exporters.model_keys import model_key_errors, set_model_keys, show
from parcompile.exporters.offload_hsdp import deepspeed_offload_hsdp
from parcompile.plan import Plan


def deepspeed_config(plan: Plan) -> tuple[dict, list[str], list[str]]:
    """The DeepSpeed (0.19) JSON config for ``plan``, the notes and the errors (what DeepSpeed
    would run as another layout)."""
    notes = common_notes(plan, "DeepSpeed")
    errors = model_key_errors(plan, "deepspeed")
    if plan.config.train.precision == "fp8":
        errors.append("precision fp8: DeepSpeed's config has no FP8 training (its fp16 and bf16 sections are the "
                      "16-bit ones); export --to megatron, or --to torchtitan --torchtitan-version 0.2 (the torchtitan "
                      "TOML parcompile writes FP8 converters for)")
    c = _deepspeed_base(plan)
    _deepspeed_optimizer(plan, c, notes, errors)
    _deepspeed_pipeline(plan, c, notes, errors)
    _deepspeed_tensor_parallel(plan, c, notes, errors)
    _deepspeed_features(plan, c, notes, errors)
    deepspeed_offload_hsdp(plan, c, notes, errors)
    notes += deepspeed_lora_note(plan)   # LoRA: PEFT wraps train.py's model (exporters/lora.py)
    return c, notes, errors


def _deepspeed_base(plan: Plan) -> dict:
    """The batch, gradient clipping, ZeRO stage and buckets, and precision sections."""
    par, m, tr = plan.config.parallel, plan.config.model, plan.config.train
    dps = dp_sharding(plan)
    c: dict = {
        "train_batch_size": par.global_batch,
        "train_micro_batch_size_per_gpu": par.micro_batch,
        "gradient_accumulation_steps": plan.data["schedule"]["num_microbatches"],
        "gradient_clipping": tr.grad_clip,
        "steps_per_print": tr.log_every,
        # reduce_bucket_size counts elements; bucket_size = 0 (one bucket, after the backward):
        # a bucket as large as the largest stage, without overlap
        "zero_optimization": {"stage": dps.stage,   # DeepSpeed's stages are ZeRO's
                              "reduce_bucket_size": (-(-par.bucket_size // 4) if par.bucket_size else
                                                     max(s["params_per_rank"] for s in plan.data["stages"])),
                              "overlap_comm": bool(dps.shards_optimizer_states and par.bucket_size > 0)},
        "bf16": {"enabled": m.dtype == "bf16"},
        "fp16": {"enabled": m.dtype == "fp16"},
    }
    if m.dtype != "fp32" and reduces_over_dp(plan):
        # DeepSpeed reduces in the model's dtype unless told; the plan's reduce dtype
        c["communication_data_type"] = grad_reduce_dtype(plan)
    return c


def _deepspeed_optimizer(plan: Plan, c: dict, notes: list[str], errors: list[str]) -> None:
    """The optimizer and the learning-rate scheduler (``optimizer``, ``scheduler``)."""
    tr = plan.config.train
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


def _deepspeed_pipeline(plan: Plan, c: dict, notes: list[str], errors: list[str]) -> None:
    """Pipeline parallelism (``pipeline``): the PipelineModule and topology to build, the schedule,
    ZeRO stages the pipeline engine refuses, uneven stage splits."""
    par = plan.config.parallel
    deg = degrees(plan)
    sched = par.pipeline_schedule
    errors += placement_errors(plan, "DeepSpeed")
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
        if sched.name != "1f1b":
            notes.append(f"schedule {sched.name}: DeepSpeed's pipeline engine runs only its own 1F1B schedule "
                         "(TrainSchedule)" + ("; virtual stages are not expressible" if deg["virtual_stages"] > 1
                                              else ""))
        if dp_sharding(plan).shards_gradients:   # deepspeed/runtime/pipe/engine.py PipelineEngine.__init__ asserts it
            errors.append(f"zero {par.zero} with pp {deg['pp']}: DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3 "
                          "(\"incompatible with pipeline parallelism\"); use zero 0 or 1")
        if par.stage_layers is not None and len(set(stage_split(plan))) > 1:
            notes.append(f"stage_layers {stage_split(plan)}: DeepSpeed's PipelineModule has no partition method "
                         "for given boundaries (only uniform, parameters and type:REGEX); subclass it and override "
                         "_partition_layers to set self.parts to these layer counts")


def _deepspeed_tensor_parallel(plan: Plan, c: dict, notes: list[str], errors: list[str]) -> None:
    """Tensor parallelism: AutoTP (``tensor_parallel``) without a pipeline; refused inside one."""
    par = plan.config.parallel
    deg = degrees(plan)
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


def _deepspeed_features(plan: Plan, c: dict, notes: list[str], errors: list[str]) -> None:
    """Recomputation, context parallelism, experts, gradient buckets without ZeRO, fp16 loss
    scaling and the rank order."""
    par, m = plan.config.parallel, plan.config.model
    deg = degrees(plan)
    if is_module_list(par.recompute):
        errors.append(f"recompute {recompute_words(par.recompute)}: DeepSpeed checkpoints whole layers "
                      "(deepspeed.checkpointing.checkpoint); Megatron-Core's module list is not expressible: use "
                      "recompute = full, or export --to megatron")
    elif par.recompute != "none":
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
    if reduces_over_dp(plan) and not dp_sharding(plan).shards_optimizer_states and par.bucket_size:
        notes.append(f"bucket_size {par.bucket_size}: reduce_bucket_size counts elements ({-(-par.bucket_size // 4)}); "
                     "DeepSpeed overlaps the gradient reduction with the backward (overlap_comm) under ZeRO "
                     "stages 1-3 only")
    if m.dtype == "fp16":
        c["fp16"].update({"loss_scale": 0, "initial_scale_power": 16})
    if par.order != "tp-cp-ep-dp-pp":
        notes.append(f"order {par.order}: DeepSpeed places pp outermost and dp inside it; other orders are not "
                     "expressible")


def deepspeed_export(plan: Plan) -> Export:
    """``--to deepspeed``: :func:`deepspeed_config` as sorted JSON; the launcher line and the
    model / hostfile notes beside it."""
    cfg = plan.config
    c, notes, errors = deepspeed_config(plan)
    cl = cfg.cluster
    name = f"{cfg.name}_deepspeed.json"
    launch = (f"deepspeed --num_nodes {cl.nodes} --num_gpus {cl.gpus_per_node}"
              + (" --hostfile hostfile" if cl.nodes > 1 else "")
              + f" train.py --deepspeed --deepspeed_config {name}")
    keys = ", ".join(f"{k} {show(v)}" for k, v in set_model_keys(cfg.model).items() if k != "dtype")
    notes.append(f"model: train.py builds the {cfg.model.layers}-layer model ({plan.data['model']['params']:,} "
                 "parameters) and calls deepspeed.initialize with this config; DeepSpeed's config has no model "
                 f"section, so train.py must build these model keys (the others at their defaults): {keys}")
    if cl.nodes > 1:   # deepspeed/launcher/runner.py fetch_hostfile: a missing file means this machine only
        notes.append(f"hostfile: write `hostfile` in the launch directory, one line per node, "
                     f"`<hostname> slots={cl.gpus_per_node}` ({cl.nodes} lines, reachable by passwordless ssh); "
                     f"without it DeepSpeed's runner only warns and trains on this machine alone, not on "
                     f"{cl.nodes} nodes")
    return Export("deepspeed", json.dumps(c, sort_keys=True, indent=2) + "\n", notes, launch, name, errors)
