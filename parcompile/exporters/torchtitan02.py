"""``parcompile export --to torchtitan --torchtitan-version 0.2``: a torchtitan 0.2 TOML job
config naming one of llama3's registered flavors (:data:`TORCHTITAN02_FLAVORS`)."""

from __future__ import annotations

import json

from parcompile.ir.fp8 import bf16_layers, gathers_fp8
from parcompile.config.schema import DEFAULT_BUCKET_SIZE
from parcompile.config.text import plural
from parcompile.exporters.common import (Export, comments, common_notes, degrees, dp_sharding, fmt_num, grad_reduce_dtype, layout_line,
                                      reduces_over_dp, stage_split)
from parcompile.exporters.offload_hsdp import torchtitan_offload
from parcompile.exporters.torchtitan import (torchtitan_fsdp, torchtitan_model_errors, torchtitan_model_parts,
                                          torchtitan_schedule)
from parcompile.plan import Plan


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
        return f"{key} {fmt_num(v) if isinstance(v, float) else v}"

    return name, [f"{show(k, f[k])} (the spec: {show(k, v).removeprefix(k + ' ')})" for k, v in spec.items()
                  if v != f[k]]


def torchtitan_config(plan: Plan) -> tuple[dict, list[str]]:
    """The torchtitan 0.2 job config for ``plan`` as nested dicts (TOML tables in order),
    and the notes."""
    cfg = plan.config
    par, tr = cfg.parallel, cfg.train
    notes = common_notes(plan, "torchtitan")
    name, fl = _torchtitan02_model(plan, notes)
    par_t = _torchtitan02_parallelism(plan, notes)
    training = _torchtitan02_training(plan, notes, par_t["data_parallel_shard_degree"])

    ac = {"mode": par.recompute if isinstance(par.recompute, str) else "none"}   # a module list: refused (torchtitan.py)
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
        "job": {"description": f"{cfg.name}: {layout_line(plan)} (exported by parcompile)"},
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
        _torchtitan02_fp8(plan, config, notes)
    return config, notes


def _torchtitan02_fp8(plan: Plan, config: dict, notes: list[str]) -> None:
    """``precision = fp8`` (issue 32): torchtitan v0.2.2 job_config.py Quantize: the converters
    registered as quantize.linear.float8 (torchao Float8Linear: tensorwise, rowwise) and
    quantize.linear.mx (MXLinear); the LM head ("output") kept in bf16, as the plan assumes, and
    the layers ``train.fp8_bf16_layers_*`` keep (``layers.<i>.``: torchtitan skips a module whose
    FQN contains a filter entry, ``filter_fqn in fqn``, torchtitan/components/quantization/utils.py
    ``module_filter_fn`` at pytorch/torchtitan 58ee164; the trailing dot keeps ``layers.1.`` off
    ``layers.10``)."""
    tr = plan.config.train
    filters = ["output"] + [f"layers.{i}." for i in sorted(bf16_layers(plan.config))]
    if tr.fp8_recipe == "mxfp8":
        config["model"]["converters"] = ["quantize.linear.mx"]
        config["quantize.linear.mx"] = {"recipe_name": "mxfp8_cublas", "filter_fqns": filters}
    else:
        config["model"]["converters"] = ["quantize.linear.float8"]
        f8: dict = {"filter_fqns": filters}
        if tr.fp8_recipe == "rowwise":
            f8["recipe_name"] = "rowwise"   # v0.2.2 refuses a recipe_name with FP8 all-gather
        elif gathers_fp8(plan.config):
            f8.update(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
        config["quantize.linear.float8"] = f8
    notes.append("precision fp8: torchtitan's float8 converters need torch.compile for their speed "
                 "(--compile.enable; docs/float8.md) and an SM89+ GPU")


def _torchtitan02_model(plan: Plan, notes: list[str]) -> tuple[str, str]:
    """The model name and flavor 0.2's TOML names (``[model]``), and what they leave out as notes."""
    m = plan.config.model
    name, fl = "llama3", torchtitan02_flavor(plan)[0] or "debugmodel"
    if m.experts > 0:   # torchtitan's mixture-of-experts models live under deepseek_v3 (also llama4, qwen3)
        name, fl = "deepseek_v3", "debugmodel"
        notes.append(f"experts: register a deepseek_v3 flavor with {m.experts} routed experts, top_k {m.top_k}, "
                     f"{m.shared_experts} shared experts, moe_inter_dim {m.expert_ffn_hidden}, "
                     f"{plural(m.dense_layers, 'dense layer')} first")
    if fl == "debugmodel":
        notes.append(f"model: torchtitan takes the model's shape from a registered flavor; register one with "
                     f"dim {m.hidden}, n_layers {m.layers}, n_heads {m.heads}, n_kv_heads {m.kv_heads}, "
                     f"vocab_size {m.vocab}, ffn hidden {m.ffn_hidden}, rope_theta {fmt_num(m.rope_theta)} "
                     "(debugmodel is a placeholder)")
    if m.norm != "rmsnorm" or m.activation != "swiglu" or m.position != "rope":
        notes.append(f"model: torchtitan's llama3 is RMSNorm + SwiGLU + RoPE; this model has {m.norm}, "
                     f"{m.activation}, {m.position} positions")
    if m.tie_embeddings:
        notes.append("tie_embeddings: torchtitan's llama3 keeps the output projection separate")
    if m.qk_norm:
        notes.append("qk_norm: torchtitan's llama3 has no q/k norm; its qwen3 model has one (register a flavor there)")
    return name, fl


def _torchtitan02_parallelism(plan: Plan, notes: list[str]) -> dict:
    """The ``[parallelism]`` table: FSDP for the ZeRO stage, the degrees, the pipeline schedule
    and stage split; notes where torchtitan runs another layout."""
    par, m = plan.config.parallel, plan.config.model
    deg = degrees(plan)
    sched = par.pipeline_schedule
    v = deg["virtual_stages"]
    replicate, shard, reshard = torchtitan_fsdp(dp_sharding(plan), deg, notes, "0.2")
    if deg["cp"] > 1 and not dp_sharding(plan).shards_optimizer_states:
        notes.append("cp: torchtitan's context parallelism runs under FSDP; parameters are sharded over dp x cp")

    schedule = torchtitan_schedule(sched, v, notes)

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
    split = stage_split(plan)
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
    if reduces_over_dp(plan) and par.bucket_size != DEFAULT_BUCKET_SIZE:
        notes.append(f"bucket_size {par.bucket_size}: torchtitan has no gradient bucket size setting (FSDP2 "
                     "reduce-scatters each transformer block's gradients as one group; replicate uses PyTorch "
                     "DDP's 25 MB buckets)")
    return par_t


def _torchtitan02_training(plan: Plan, notes: list[str], shard: int) -> dict:
    """The ``[training]`` table: batch sizes, steps, clipping, precision, dataset; ``shard`` is
    the data-parallel shard degree (mixed precision needs FSDP in 0.2)."""
    par, m, tr = plan.config.parallel, plan.config.model, plan.config.train
    deg = degrees(plan)
    mb = plan.data["schedule"]["num_microbatches"]
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
        **torchtitan_offload(plan),   # job_config.py Training.enable_cpu_offload (exporters/offload_hsdp.py)
    }
    if grad_reduce_dtype(plan) != "fp32":
        notes.append(f"reduce_dtype {grad_reduce_dtype(plan)}: torchtitan 0.2 reduces gradients in float32 only "
                     "(training.mixed_precision_reduce)")
    if m.dtype == "bf16" and shard == 1 and deg["cp"] == 1 and deg["tp"] == deg["pp"] == 1:
        # torchtitan 0.2.2 distributed/utils.py maybe_enable_amp: DDP or one device: torch.autocast
        notes.append("dtype bf16 without sharding: torchtitan 0.2 trains under torch.autocast(bfloat16) "
                     "(parameters kept in float32, matmuls in bfloat16)")
    notes.append("dataset: c4_test is torchtitan's bundled sample; set training.dataset to yours")
    return training


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


def torchtitan02_export(plan: Plan) -> Export:
    """``--to torchtitan --torchtitan-version 0.2``: :func:`torchtitan_config` as TOML; errors
    where 0.2's named flavor or mixed precision would train another model or precision."""
    cfg = plan.config
    config, notes = torchtitan_config(plan)
    errors = torchtitan_model_errors(plan, "0.2")
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
    deg, p = degrees(plan), config["parallelism"]
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
    lines += comments("error", errors)
    lines += comments("note", notes)
    for table, keys in config.items():
        lines += ["", f"[{table}]"] + [f"{k} = {_toml_value(v)}" for k, v in keys.items()]
    return Export("torchtitan", "\n".join(lines) + "\n", notes, launch, f"{cfg.name}_torchtitan.toml", errors)
