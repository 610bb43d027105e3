"""``parcompile export --to megatron-bridge``: a Megatron-Bridge 0.3.1 module whose ``config()``
returns the ``ConfigContainer``, the Megatron-LM arguments of
:func:`parcompile.exporters.megatron.megatron_args` renamed (:data:`MEGATRON_BRIDGE_FIELDS`)."""

from __future__ import annotations

import re

from parcompile.exporters.common import Export, layout_line, py_kwargs, py_name
from parcompile.exporters.lora import megatron_bridge_peft, megatron_bridge_pretrained
from parcompile.exporters.megatron import megatron_args, megatron_env, megatron_errors
from parcompile.exporters.model_keys import model_key_errors
from parcompile.plan import Plan


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
    # ModelParallelConfig's fields (megatron-core 0.16.1 model_parallel_config.py): Transformer
    # Engine's userbuffers; the interleaved pipeline's blocking batched transfers
    "--tp-comm-overlap": [("model", "tp_comm_overlap", True)],
    "--no-overlap-p2p-communication": [("model", "overlap_p2p_comm", False), ("model", "batch_p2p_comm", True)],
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
    # offload and HSDP (exporters/offload_hsdp.py): megatron-core 0.16.1's OptimizerConfig
    # (megatron/core/optimizer/optimizer_config.py lines 304 and 187) and
    # DistributedDataParallelConfig (megatron/core/distributed/distributed_data_parallel_config.py line 30)
    "--optimizer-cpu-offload": [("optimizer", "optimizer_cpu_offload", True)],
    "--use-precision-aware-optimizer": [("optimizer", "use_precision_aware_optimizer", True)],
    "--num-distributed-optimizer-instances": [("ddp", "num_distributed_optimizer_instances", int)],
    "--no-gradient-accumulation-fusion": [("model", "gradient_accumulation_fusion", False)],
    "--overlap-grad-reduce": [("ddp", "overlap_grad_reduce", True)],
    "--ddp-bucket-size": [("ddp", "bucket_size", int)],
    "--grad-reduce-in-bf16": [("ddp", "grad_reduce_in_fp32", False)],
    "--recompute-granularity": [("model", "recompute_granularity", str)],
    "--recompute-method": [("model", "recompute_method", str)],
    "--recompute-num-layers": [("model", "recompute_num_layers", int)],
    "--recompute-modules": [("model", "recompute_modules", list)],
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
    "--apply-layernorm-1p": [("model", "layernorm_zero_centered_gamma", True)],
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
    container's own ``mixed_precision`` and, for LoRA, ``peft``: :func:`megatron_bridge_peft`),
    the notes and the errors. It is the Megatron-LM
    arguments of :func:`megatron_args` (one rule for what Megatron runs) renamed through
    :data:`MEGATRON_BRIDGE_FIELDS`, and ``softmax_scale`` for ``query_pre_attn_scalar`` (which
    pretrain_gpt.py cannot state); the model keys Bridge does not carry
    (:data:`parcompile.exporters.model_keys.MEGATRON_BRIDGE`), an argument with no field there,
    and what :func:`megatron_errors` refuses, are errors."""
    args, notes = megatron_args(plan)
    errors = model_key_errors(plan, "megatron-bridge") + megatron_errors(plan)
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
    if plan.data["degrees"]["virtual_stages"] > 1 and plan.data["degrees"]["pp"] > 1:
        # Megatron-LM's default with virtual stages (the provider's is off): overlapped, unbatched
        # transfers (ModelParallelConfig: overlap_p2p_comm needs batch_p2p_comm off)
        out["model"].update(overlap_p2p_comm=True, batch_p2p_comm=False)
    unmapped = []
    for flag, value in args:
        if flag not in MEGATRON_BRIDGE_FIELDS:
            unmapped.append(flag)
            continue
        for section, name, kind in MEGATRON_BRIDGE_FIELDS[flag] or ():
            if kind in (int, float, str):
                v = kind(value)
            elif kind is list:   # an argument of several values (megatron.py's tuples)
                v = list(value)
            elif kind == "AttnBackend":
                v = _Code(f"AttnBackend.{value}")
            elif kind == "layer-list":   # "([0]*3+[1]*25)": which layers are MoE
                v = [0] * m.dense_layers + [1] * (m.layers - m.dense_layers)
            else:
                v = kind
            out[section][name] = v
    if m.query_pre_attn_scalar is not None:
        # TransformerConfig.softmax_scale (megatron-core 0.16.1 transformer_config.py line 116, handed to
        # the core attention by attention.py line 324), as Megatron-Bridge v0.3.1's gemma3_bridge.py sets
        # it: 1 / sqrt(query_pre_attn_scalar); pretrain_gpt.py has no flag for it
        out["model"]["softmax_scale"] = m.query_pre_attn_scalar ** -0.5
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
    peft, lora_notes, lora_errors = megatron_bridge_peft(plan)   # LoRA: exporters/lora.py
    if peft is not None:
        out["container"]["peft"] = _Code(f"CanonicalLoRA({py_kwargs(peft)})")
        out["checkpoint"]["pretrained_checkpoint"] = megatron_bridge_pretrained(plan)
    return out, [bridge_words(n) for n in notes] + lora_notes, errors + lora_errors


def bridge_words(note: str) -> str:
    """``note`` (one of :func:`megatron_args`' notes, which name pretrain_gpt.py flags) in the
    recipe's words: each ``--flag`` that :data:`MEGATRON_BRIDGE_FIELDS` maps becomes the
    ``ConfigContainer`` attribute(s) it sets (``--use-torch-fsdp2`` -> ``dist.use_torch_fsdp2``);
    a flag with no field stays as written."""
    def field(m: re.Match) -> str:
        targets = MEGATRON_BRIDGE_FIELDS.get(m.group(0))
        return " and ".join(f"{sec}.{name}" for sec, name, _ in targets) if targets else m.group(0)

    return re.sub(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", field, note)


def megatron_bridge_export(plan: Plan) -> Export:
    """``--to megatron-bridge``: a module whose ``config()`` builds :func:`megatron_bridge_config`'s
    ``ConfigContainer`` and runs ``pretrain`` when executed (``finetune`` for LoRA)."""
    cfg = plan.config
    sections, notes, errors = megatron_bridge_config(plan)
    entry = "finetune" if "peft" in sections["container"] else "pretrain"   # finetune: from a checkpoint
    cl = cfg.cluster
    module = f"{py_name(cfg.name)}_megatron_bridge"
    launch = "".join(f"{k}={v} " for k, v in megatron_env(plan).items())
    launch += f"torchrun --nnodes {cl.nodes} --nproc-per-node {cl.gpus_per_node}"
    if cl.nodes > 1:
        launch += ' --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"'
    launch += f" {module}.py"

    def value(v) -> str:
        return str(v) if isinstance(v, _Code) else repr(v)

    lines = [f'"""Megatron-Bridge 0.3.1 recipe for `{cfg.name}` (exported by parcompile): {layout_line(plan)}.',
             "",
             "A ConfigContainer as NVIDIA's Megatron-Bridge recipes build them (mock data, a NullTokenizer of",
             "the spec's vocabulary): the plan's Megatron-LM settings, those `parcompile export --to megatron`",
             "writes as pretrain_gpt.py flags, as Bridge fields" + (
                 ";\nthe LoRA adapters as Bridge's CanonicalLoRA (`peft`), which pretrain_gpt.py lacks (so `--to "
                 "megatron`\nrefuses LoRA)." if entry == "finetune" else "."),
             f"Launch: {launch}"]
    lines += [""] + [f"error: {e}" for e in errors] if errors else []
    lines += [""] + [f"note: {n}" for n in notes] if notes else []
    lines += ['"""', "", "import torch.nn.functional as F", "",
              "from megatron.bridge.models import GPTModelProvider",
              *(["from megatron.bridge.peft.canonical_lora import CanonicalLoRA"] if entry == "finetune" else []),
              "from megatron.bridge.training.config import (",
              "    CheckpointConfig, ConfigContainer, DistributedDataParallelConfig, DistributedInitConfig,",
              "    LoggerConfig, MockGPTDatasetConfig, OptimizerConfig, RNGConfig, SchedulerConfig, TokenizerConfig,",
              "    TrainingConfig,",
              ")",
              "from megatron.bridge.training.gpt_step import forward_step",
              f"from megatron.bridge.training.{entry} import {entry}",
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
              f"    {entry}(config(), forward_step)"]
    return Export("megatron-bridge", "\n".join(lines) + "\n", notes, launch, f"{module}.py", errors)
