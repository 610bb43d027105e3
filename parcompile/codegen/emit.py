"""Lowering a plan to files: ``program.py`` (jinja2), ``launch.sh``, ``plan.json``, ``report.md``.

Decisions are made here, in Python, as plain data; the templates only format them
(DESIGN: codegen first turns the plan into data). Everything about the layout (local
sizes, shape comments, which collective runs where, by the plan's name for it) comes from
the sharded graph after the passes (:mod:`parcompile.codegen.program_data`); settings
(dtypes, paths, optimizer) from the validated config. Nothing a user typed reaches the
program unchecked: strings are written with ``repr`` and numbers come from the validated
config or the graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from typing import Protocol
import shutil
import tempfile
from pathlib import Path

import jinja2

from parcompile.ir.fp8 import enabled as fp8_enabled, gathers_fp8
from parcompile.config.schema import SpecConfig
from parcompile.core.data_parallel import DataParallelSharding
from parcompile.core.dtypes import TORCH_NAMES
from parcompile.core.lora import lora_settings
from parcompile.core.model import LLAMA4_KEYS, rotary_dim
from parcompile.core.quant import quantized_param, weight_format, weight_key
from parcompile.codegen.blocks import DIM_CONSTANTS, MLA_CONSTANTS, Methods, Submodule, calls_comment, describe, methods, mlp_doc, module_methods
from parcompile.codegen.classes import serve_classes, train_classes
from parcompile.codegen.stage import (constant_lines, layer_table_rows, norm_definition, rope_bases, serve_constants,
                                      serve_positions, stage_code, train_constants, train_positions)
from parcompile.codegen.program_data import LayerData, ProgramData, program_data
from parcompile.core.version import version
from parcompile.diagnostics import Diagnostic
from parcompile.ir.graph import Graph
from parcompile.ir.ops import Trait, has_trait

TEMPLATES = Path(__file__).parent / "templates"

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATES)),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
)


# What the plan models but the generated program does not run yet: (config key, test,
# what the program does instead, the issue that brings it, refused). Serving runs the routed
# experts since issue 18 (runtime/model/moe.py: Router, dispatch, GroupedExperts, combine). A refused gap is an error for
# `compile` too: no program is written (a program that silently trained in 16 bits would be
# measured against an FP8 plan).
_NOT_IN_PROGRAM: tuple = (
    # FP8 training (issue 32) runs its linear layers' GEMMs in FP8 (runtime/model/fp8.py,
    # torch._scaled_mm, tensorwise, rowwise and mxfp8); what it does not run yet is refused
    ("train.fp8_all_gather", lambda cfg: gathers_fp8(cfg) and cfg.train.fp8_recipe == "mxfp8",
     "MXFP8 all-gather (fp8_all_gather with fp8_recipe = mxfp8)", "ZeRO-3's FP8 all-gather (runtime/train/zero_gather.py) "
     "casts each weight with one scale, not in MX blocks: `parcompile plan`, `search`, `check` and `export` work "
     "on this spec; to generate a program now, remove `fp8_all_gather` or use fp8_recipe = tensorwise", 32, True),
    # disaggregated serving (issue 45) is planned and exported (two servers, vLLM's NIXL connector or
    # SGLang's disaggregation mode), not run by the serve program, whose ranks prefill and decode alike
    ("serve.disaggregated", lambda cfg: cfg.serve is not None and cfg.serve.disaggregated,
     "disaggregated prefill and decode pools", "the serve program prefills and decodes on the decode pool's "
     "layout; `parcompile plan`, `search` and `export --to vllm|sglang` (a prefill and a decode server) describe "
     "the pools", 45, False),
    # CPU offload (issue 49): the program offloads its sharded optimizer (runtime/train/offload.py)
    ("parallel.offload", lambda cfg: cfg.serve is None and cfg.parallel.offload != "none"
     and cfg.parallel.dp * cfg.parallel.cp == 1,
     "offload without a data-parallel group (dp * cp = 1)", "the program offloads its sharded (ZeRO) optimizer, "
     "which needs dp * cp > 1: `parcompile plan`, `search` and `export --to deepspeed` work on this spec; to "
     "generate a program now, give dp (or cp) more than one rank, or remove `offload`", 49, True),
    # Llama 4's layers (issue 46) are trained, not served: the serving attention over the KV
    # cache has no chunked mask, NoPE layers, temperature tuning or L2 qk-norm yet
    ("model.nope_layer_interval", lambda cfg: cfg.serve is not None and any(
        getattr(cfg.model, k) != v for k, v in LLAMA4_KEYS.items()),
     "Llama 4's layers while serving (NoPE layers, chunked attention, temperature tuning, the L2 qk-norm, "
     "interleaved MoE layers)", "the serve program's cached attention has none of them yet: `parcompile plan`, "
     "`search` and `export --to vllm|sglang` work on this spec; train it, or serve it with vLLM or SGLang", 46, True),
    # LoRA (issue 49) runs in the program (runtime/model/lora.py) but for what is refused here,
    # each at the key that asks for it
    ("train.precision", lambda cfg: _lora(cfg) and fp8_enabled(cfg), "LoRA adapters with FP8",
     "the adapters and their frozen bases run 16-bit GEMMs (runtime/model/lora.py): `parcompile plan`, `search` "
     "and `check` work on this spec; to generate a program, remove `precision = fp8`", 49, True),
    ("parallel.schedule", lambda cfg: _lora(cfg) and cfg.parallel.schedule == "zero_bubble",
     "LoRA adapters with the zero-bubble schedule", "the adapters' weight gradients are computed in the "
     "backward, not deferred to the schedule's W passes: `parcompile plan`, `search` and `check` work on this "
     "spec; to generate a program, use schedule = 1f1b or interleaved_1f1b", 49, True),
    ("parallel.zero", lambda cfg: _lora(cfg) and cfg.parallel.zero == 3 and cfg.model.experts > 0,
     "LoRA with zero = 3 on an MoE model", "the program shards the frozen weights over the dense "
     "data-parallel group only (runtime/train/zero_frozen.py), not the experts' over expert_dp: `parcompile "
     "plan`, `search` and `check` work on this spec; to generate a program, use zero = 1 or 2", 49, True),
    ("model.kv_lora_rank", lambda cfg: _lora(cfg) and cfg.model.kv_lora_rank > 0,
     "LoRA adapters with multi-head latent attention", "the adapters take the attention and MLP projections "
     "of Llama-like layers, not MLA's down and up projections: `parcompile plan`, `search` and `check` work "
     "on this spec", 49, True),
)


def _lora(cfg: SpecConfig) -> bool:
    return cfg.workload == "train" and cfg.train.method == "lora"


def _fp8(cfg: SpecConfig) -> bool:
    return fp8_enabled(cfg)


def program_gaps(cfg: SpecConfig, severity: str = "warning") -> list[Diagnostic]:
    """Features of ``cfg`` that the plan accounts for but the generated program does not run
    yet, one diagnostic each (a warning for `compile`, an error for `run` and `verify`; an
    error everywhere for a gap the program cannot stand in for: FP8 training, issue 32),
    at the span of the key that asks for the feature.

    The plan's memory and traffic figures describe the full feature; the program runs
    without it, so its measured memory and collectives differ from the plan's.
    """
    out = []
    for key, test, what, instead, issue, refused in _NOT_IN_PROGRAM:
        if test(cfg):
            if refused:
                out.append(Diagnostic("error", f"the generated program does not run {what} yet", cfg.span(key),
                                      help=instead, note=f"the plan's figures assume {what} (issue {issue})"))
            else:
                out.append(Diagnostic(severity, f"the generated program does not run {what} yet", cfg.span(key),
                                      note=f"{instead}; the plan's figures assume {what} (issue {issue})"))
    return out


def comment_text(text: str) -> str:
    """``text`` made safe inside a Python docstring and a shell comment line.

    Spec names come from file names, which may hold anything but ``/``: a quote, a
    backslash or a line break could close the program's docstring or start a new line of
    ``launch.sh``. Those characters (and every other non-printable one) become ``?``;
    printable unicode stays. String *values* that programs use are never written this
    way: they go through :func:`repr`.
    """
    return "".join("?" if (not ch.isprintable() or ch in '"\\`$') else ch for ch in text)


def torchrun_command(cfg: SpecConfig, script: str = "program.py") -> str:
    """The exact torchrun line for this plan (single node: standalone rendezvous)."""
    c = cfg.cluster
    if c.nodes == 1:
        return f"torchrun --standalone --nproc-per-node {c.gpus_per_node} {script}"
    return (f"torchrun --nnodes {c.nodes} --nproc-per-node {c.gpus_per_node} "
            f"--rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT {script}")


def allocator_env(cfg: SpecConfig) -> list[tuple[str, str]]:
    """``(variable, value)``: the caching allocator's mode a training program runs with, one
    entry per settings variable of the cluster's stack (``Accelerator.alloc_conf``), each
    ``expandable_segments:True`` or ``:False`` as ``cluster.expandable_segments`` says (PyTorch
    docs, CUDA semantics, "Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF"). program.py
    sets them before torch starts the device (a value the caller set kept); the Kubernetes
    manifests carry them in the pod's environment (:mod:`parcompile.codegen.k8s`). Serving
    programs set none."""
    value = f"expandable_segments:{cfg.cluster.expandable_segments}"
    return [(var, value) for var in cfg.cluster.accelerator.alloc_conf]


def _data_path(data: str | None, out_dir: Path | None) -> str | None:
    """A data source, tokenizer or checkpoint path as the program should open it: relative
    to the program's directory when that is known (so generated files hold no absolute
    paths); names (``synthetic``, ``bytes``, ``builtin:...``) stay as they are.

    The program resolves a relative path against its own directory, symbolic links resolved
    (``HERE = Path(__file__).resolve().parent``, then
    :func:`parcompile.runtime.data.loader.resolve_source`), so the path is taken between the
    two directories as they lie on disk (``os.path.realpath``): an output or data directory
    reached through a symbolic link (``build -> /scratch/build``) still names the same file
    however the program is started (its ``..`` climb the real directories, not the link's
    parents). The file's own name is kept (a data file that is itself a link stays one). The
    front end resolved the spec's paths against the spec's directory."""
    if data is None or data in ("synthetic", "bytes") or data.startswith("builtin:") or out_dir is None:
        return data
    where = os.path.abspath(data)
    real = os.path.join(os.path.realpath(os.path.dirname(where)), os.path.basename(where))
    return os.path.relpath(real, os.path.realpath(out_dir))


def program_paths(cfg: SpecConfig, out_dir: Path | None = None) -> dict[str, str]:
    """The files and directories the generated program opens or writes, by the spec key that
    names each (``train.data``, ``train.eval_data``, ``train.tokenizer``, ``train.init_from``,
    ``train.checkpoint_dir``, ``train.hf_output``; a serve program's ``serve.weights``), as the
    program holds them (:func:`_data_path`: relative to ``out_dir``, the program's directory),
    unset keys and names (``synthetic``, ``bytes``, ``builtin:...``) left out: the one list the
    program's constants and the Kubernetes workspace (``k8s.workspace_layout``) read."""
    if cfg.workload == "serve":
        keys = {"serve.weights": cfg.serve.weights}
    else:
        t = cfg.train
        keys = {"train.data": t.data, "train.eval_data": t.eval_data, "train.tokenizer": t.tokenizer,
                "train.init_from": t.init_from, "train.checkpoint_dir": t.checkpoint_dir,
                "train.hf_output": t.hf_output}
    return {k: _data_path(v, out_dir) for k, v in keys.items()
            if v and v not in ("synthetic", "bytes") and not v.startswith("builtin:")}


class CompiledPlan(Protocol):
    """What codegen reads of a compiled :class:`parcompile.plan.Plan` (not imported here:
    ``Plan.write`` renders its files through this module, so plan.py sits above codegen)."""

    config: SpecConfig
    graph: Graph
    data: dict
    degrees: dict[str, int]
    passes: object   # parcompile.passes.results.PassResults: ``data_parallel`` is read


def _graph_data(plan: CompiledPlan) -> tuple[ProgramData, dict]:
    """The sharded graph of ``plan`` (after the passes) as :class:`ProgramData`, and the
    plan.json dict.

    Raises:
        TypeError: ``plan`` is not a compiled :class:`~parcompile.plan.Plan` (a plan.json
            dict has no graph to generate from).
    """
    if not isinstance(getattr(plan, "graph", None), Graph):
        raise TypeError(f"codegen needs the compiled Plan (its sharded graph), not {type(plan).__name__}")
    cfg = plan.config
    return program_data(plan.graph, plan.degrees, cfg.train.fp8_recipe if fp8_enabled(cfg) else None), plan.data




def _layer_table(layer: LayerData | None) -> list[str]:
    """The ops of one decoder layer in graph order, one line each: name (``{i}`` for the
    layer), kind, local shape, layout and collectives (the Block docstring)."""
    if layer is None:
        return []
    prefix = f"layers.{layer.index}."
    rows = [(o.name.removeprefix(prefix), o.kind, o.shape_comment(), o.sharding,
             describe(o.collectives)) for o in layer.ops]
    w = [max(len(r[k]) for r in rows) for k in range(4)]
    return [f"{a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {d:<{w[3]}}  {e}".rstrip() for a, b, c, d, e in rows]


def program_context(cfg: SpecConfig, plan: CompiledPlan, out_dir: Path | None = None) -> dict:
    """The plain data the program template formats (see module docstring): local sizes,
    shapes and collectives from the sharded graph (:mod:`parcompile.codegen.program_data`),
    the model's code written from it (:func:`_train_model`), the training settings from
    the config (:func:`_train_settings`, :func:`_step_notes`)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    pd, data_dict = _graph_data(plan)
    z = pd.sizes
    return {
        **_train_model(cfg, pd, data_dict["model"]["padded_vocab"]),
        **_train_settings(cfg, out_dir),
        **_step_notes(p, plan.passes.data_parallel, pd.sequence_parallel),
        "sp": pd.sequence_parallel,
        "t_attn": z.t_attn,
        "act_shape": ", ".join(str(n) for n in z.boundary),
        "name": comment_text(cfg.name),
        "version": version(),
        "spec_file": comment_text(Path(cfg.filename).name),
        "world": p.world_size,
        "torchrun_cmd": torchrun_command(cfg),
        "p": p,
        "t": t,
        "num_microbatches": p.num_microbatches,
        "expandable_segments": cfg.cluster.expandable_segments,
        "device": cfg.cluster.device_kind,
        "device_comment": _device_comment(cfg.cluster.accelerator),
        "alloc_env": allocator_env(cfg),
        # precision, not the model: fp16 skips a step whose gradients overflowed (loss scaling)
        "loss_scaled": m.dtype == "fp16",
        "weights_note": "16-bit weights; fp32 gradients and master weights live with the optimizer"
                        if m.dtype != "fp32" else "fp32 weights",
    }


def _train_model(cfg: SpecConfig, pd: ProgramData, padded: int) -> dict:
    """The training program's model, written from the sharded graph: the constants, Norm,
    the classes (:mod:`parcompile.codegen.classes`), the Stage's walk over the ops outside
    the layers and what it gives the layers (:mod:`parcompile.codegen.stage`)."""
    m, p = cfg.model, cfg.parallel
    z = pd.sizes
    moe = pd.moe_layer is not None
    # the ranks that split one sequence's tokens outside the tensor-parallel region
    # (sequence parallelism): each routes its own tokens, so its aux-loss gradient is scaled down
    seq_ranks = z.t_attn // z.t_residual
    aux = m.router_aux_loss / (p.num_microbatches * seq_ranks) if moe else 0.0
    layer = pd.dense_layer or pd.moe_layer
    c = _classes(pd, m.interleave_moe_layer_step)
    kinds = _layer_kinds(pd, c)
    sizes = {"heads_local": z.heads, "kv_local": z.kv_heads, "experts_local": z.experts or 0,
             "expert_ffn_local": z.expert_ffn or 0, "mla_grads": _mla_grads(pd, layer) or "none (tp = 1)",
             "aux_loss_scale": repr(aux), "seq_ranks": seq_ranks}
    tables = {"dense": _layer_table(pd.dense_layer), "moe": _layer_table(pd.moe_layer)}
    loss = pd.ops.get("loss")
    return {
        "model_constants": train_constants(m, pd, kinds, padded, rotary_dim(m), TORCH_NAMES[m.dtype],
                                           repr(0.02 / math.sqrt(2 * m.layers)), sizes),
        "norm_def": norm_definition(pd),
        "model_classes": train_classes(m, pd, c, tables, sizes),
        **stage_code(pd),
        **train_positions(pd, kinds["rope_thetas"]),
        "block_args": ", rt.ExpertAxes.of(ctx)" if moe else "",
        "x_shape": layer.op("attn_norm").shape_comment(),
        "loss_doc": ("; vocab-parallel: " + calls_comment(loss, none="no collective (tp = 1)"))
                    if loss is not None and loss.collectives else "",
        # with experts, the ranks holding one copy of each shard include expert_dp's first
        "shard_owner": ' or ctx.axes["expert_dp"].index == 0' if moe else "",
    }


def _mla_grads(pd: ProgramData, layer: LayerData) -> str:
    """MLA: the latents and the RoPE key entering the heads, each all-reduced in backward
    (the attention's docstring)."""
    i = layer.index
    grads = "; ".join(calls_comment(layer.conversion_into(n), i) for n in ("attn.wq_b", "attn.wkv_b")
                      if layer.conversion_into(n) is not None)
    key_in = layer.op("attn.key")
    if key_in is not None and len(key_in.inputs) > 1 and key_in.inputs[1] in pd.ops \
            and has_trait(pd.ops[key_in.inputs[1]].kind, Trait.CONVERSION):
        grads += ("; " if grads else "") + calls_comment(pd.ops[key_in.inputs[1]], i)
    return grads


def _train_settings(cfg: SpecConfig, out_dir: Path | None) -> dict:
    """The training settings the program holds as constants (paths relative to the
    program's directory: :func:`_data_path`), each written with ``repr``."""
    m, t = cfg.model, cfg.train
    paths = program_paths(cfg, out_dir)
    train = {
        "optimizer": t.optimizer, "lr": t.lr, "weight_decay": t.weight_decay, "grad_clip": t.grad_clip,
        "steps": t.steps, "lr_schedule": t.lr_schedule, "warmup_steps": t.warmup_steps,
        "min_lr": t.min_lr, "betas": list(t.betas), "eps": t.eps, "log_every": max(t.log_every, 1),
        "checkpoint_dir": paths.get("train.checkpoint_dir", t.checkpoint_dir), "checkpoint_every": t.checkpoint_every,
        "eval_every": t.eval_every, "eval_batches": t.eval_batches,
        # ZeRO-3 FP8 all-gather (runtime/train/zero_gather.py ParamGather): only when on, so that
        # other programs read as before
        **({"fp8_all_gather": True} if gathers_fp8(cfg) else {}),
    }
    data_format = {"tokenizer": paths.get("train.tokenizer", t.tokenizer), "data_format": t.data_format,
                   "text_field": t.text_field}
    return {
        "train_repr": repr(train),
        "data_repr": repr(paths.get("train.data", cfg.train.data)),
        "eval_data_repr": repr(paths.get("train.eval_data", t.eval_data)),
        "data_format_repr": repr(data_format),
        "init_from_repr": repr(paths.get("train.init_from", t.init_from)),
        "hf_output_repr": repr(paths.get("train.hf_output", t.hf_output)),
        "model_keys_repr": repr(_model_keys(m)),
        "peak_flops_repr": repr(cfg.cluster.peak_flops),
        "lora_repr": repr(lora_settings(cfg)) if t.method == "lora" else "",
    }


def _step_notes(p, dps: DataParallelSharding, sp: bool) -> dict:
    """The comments of the training step on ZeRO and the gradient buckets (the program's
    ``DP_SHARDING``, the plan's :class:`~parcompile.core.data_parallel.DataParallelSharding`
    ``dps``, and ``BUCKET_SIZE`` decide what runs)."""
    states = [name for name, on in (("optimizer states", dps.shards_optimizer_states),
                                    ("gradients", dps.shards_gradients), ("parameters", dps.shards_parameters)) if on]
    return {
        "dp_sharding": f"rt.DataParallelSharding(stage={dps.stage}, shard={dps.shard}, "
                       f"per_microbatch={dps.per_microbatch}"
                       + (f", replicate={dps.replicate}, shard_group={dps.shard_group!r}, "
                          f"replicate_group={dps.replicate_group!r}" if dps.replicate > 1 else "") + ")",
        "zero_comment": f"ZeRO-{dps.stage}: {', '.join(states[:-1])}{' and ' if len(states) > 1 else ''}"
                        f"{states[-1]} sharded over " + ("dp_shard, replicated over dp_replicate (HSDP)"
                                                         if dps.replicate > 1 else "dp") if states else "replicated over dp: all-reduce of gradients",
        "begin_step_note": "" if dps.parameter_gather != "before_use" else " " * 40 + "# ZeRO-3: " + (
            "every bucket gathered just in time" if p.pp == 1 else
            "gather the embedding/output buckets; layer buckets just in time"),
        "reduce_note": f"finish the buckets' {dps.gradient_reduction.replace('_', '-')}s over dp; then tied "
                       f"embedding{' and tp-replicated (sequence parallel)' if sp else ''} gradients",
        "step_note": " " * 46 + "# then all-gather the updated shards" if dps.parameter_gather == "after_step" else "",
        "bucket_note": " (0: one per chunk, after the backward)" if not p.bucket_size else ", launched during the backward",
    }


def _fp8_table(pd: ProgramData, serve: bool = False) -> dict:
    """FP8 GEMMs in some layers only (train.fp8_bf16_layers_*): the classes' per-layer table
    entry, each layer's recipe from ``LAYER_FP8``; serving: none."""
    return {"fp8": "LAYER_FP8[i]"} if pd.layer_fp8 and not serve else {}


def _experts_on_tp(pd: ProgramData) -> bool:
    """Every expert on every tp rank (serving with ep = 1): the experts op's ``ffn_axis``
    (``shard-experts``)."""
    return pd.moe_layer.op("mlp.experts").attr("ffn_axis", None) == "tp"


def _mlp_classes(pd: ProgramData, serve: bool = False) -> dict:
    """The dense MLP's and a MoE layer's shared experts' class bodies and docs, where the
    graph has them (empty strings where not)."""
    out = {"mlp_doc": "", "mlp_class": "", "shared_doc": "", "shared_class": ""}
    for key, layer, prefix in (("mlp", pd.dense_layer, "mlp"), ("shared", pd.moe_layer, "mlp.shared")):
        if layer is not None and layer.op(f"{prefix}.w1") is not None:
            out[f"{key}_doc"] = mlp_doc(layer, prefix)
            out[f"{key}_class"] = module_methods(layer, prefix, pd.ops, _fp8_table(pd, serve), serve=serve,
                                                 per_layer=pd.layer_tables).text("i: int, tp: rt.Axis")
    return out


def _moe_methods(pd: ProgramData, serve: bool = False) -> str:
    """The MoE module of a MoE layer, written op by op from its ops named ``mlp.*``
    (:func:`methods`): the router, the token dispatch, the grouped experts and the combine
    (runtime/model/moe.py, each from its op-table row: local expert count and shard shapes, the
    axes the rows cross, off the sharded graph) and, where the graph has them, the shared
    experts' MLP and their sum. ``serve``: the serving program's (the same dispatch,
    decode-sized: top-k is its ``EXPERTS_PER_TOKEN``, no auxiliary loss)."""
    layer = pd.moe_layer
    full = f"layers.{layer.index}.mlp."
    shared = layer.op("mlp.shared.w1")
    subs = {"shared": Submodule("shared", _checkpointed("SharedMLP(i, tp)", shared, "shared_experts"))} \
        if shared is not None else {}
    ops = tuple(o for o in layer.ops if o.name.startswith(full))
    constants = {**DIM_CONSTANTS, "topk": "EXPERTS_PER_TOKEN"} if serve else DIM_CONSTANTS
    whole = _experts_on_tp(pd)   # every expert on every tp rank: no expert axes
    return methods(ops, layer.index, full, pd.ops, subs, _fp8_table(pd, serve), constants=constants, serve=serve,
                   per_layer=pd.layer_tables).text("i: int, tp: rt.Axis" + ("" if whole else ", experts: rt.ExpertAxes"))


def _classes(pd: ProgramData, moe_step: int) -> dict:
    """The decoder-layer classes written op by op from the graph (:mod:`parcompile.codegen.blocks`):
    the dense MLP, a MoE layer's shared experts, and Block's ``__init__`` and ``forward``
    (one Block for both layer kinds: only its ``mlp`` module differs; ``moe_step``: the
    model's ``interleave_moe_layer_step``, :func:`_block_methods`)."""
    out = _mlp_classes(pd)
    layer = pd.dense_layer or pd.moe_layer
    constants = MLA_CONSTANTS if layer.op("attn.wkv_a") is not None else DIM_CONSTANTS
    out["attn_class"] = module_methods(layer, "attn", pd.ops, _fp8_table(pd), constants,
                                       per_layer=pd.layer_tables).text("i: int, tp: rt.Axis, cp: rt.Axis")
    out["moe_class"] = _moe_methods(pd) if pd.moe_layer is not None else ""
    # the routed rows are all-gathered over expert_tp where the dispatch's collectives say so
    out["moe_expert_tp"] = pd.moe_layer is not None and any(
        c.axis == "expert_tp" for c in pd.moe_layer.op("mlp.dispatch").collectives)
    block = _block_methods(pd, "Attention(i, tp, cp)", "MoE(i, tp, experts)", moe_step=moe_step)
    sig = "i: int, tp: rt.Axis, cp: rt.Axis" + (", experts: rt.ExpertAxes" if pd.moe_layer is not None else "")
    out["block_methods"] = block.text(sig)
    return out


def _block_methods(pd: ProgramData, attn: str, moe: str, serve: bool = False, moe_step: int = 1) -> Methods:
    """Block's ``__init__`` and ``forward`` written from the graph's layers (one class for
    both layer kinds: only its ``mlp`` module differs, ``MLP(i, tp)`` or ``moe``); ``attn``
    builds the attention module; ``serve``: the serving program's (:func:`methods`). Layer i
    is MoE by :func:`parcompile.core.model.moe_layer` spelt with the program's constants
    (``MOE_LAYER_STEP``, written when ``moe_step`` > 1: codegen/stage.py).

    Raises:
        ValueError: a dense and a MoE layer that differ outside their MLP."""
    kinds = []
    if pd.dense_layer is not None:
        dense_mlp = _checkpointed("MLP(i, tp)", pd.dense_layer.op("mlp.w1"), "mlp")
    if pd.moe_layer is not None:
        moe = _checkpointed(moe, pd.moe_layer.op("mlp.router"), "moe")
    for layer, mlp in ((pd.dense_layer, "MLP(i, tp)"), (pd.moe_layer, moe)):
        if layer is not None:
            mlp = dense_mlp if mlp == "MLP(i, tp)" else mlp
            subs = {"attn": Submodule("attn", attn, ", pos"), "mlp": Submodule("mlp", mlp)}
            kinds.append(methods(layer.ops, layer.index, f"layers.{layer.index}.", pd.ops, subs, serve=serve,
                                 per_layer=pd.layer_tables))
    block = kinds[0]
    if len(kinds) == 2:
        dense, moe_kind = kinds
        mlp_line, moe_line = f"self.mlp = {dense_mlp}", f"self.mlp = {moe}"
        if [ln for ln in dense.init if ln != mlp_line] != [ln for ln in moe_kind.init if ln != moe_line] \
                or dense.forward != moe_kind.forward:
            raise ValueError(f"layers {pd.dense_layer.index} and {pd.moe_layer.index} differ outside their MLP; "
                             "the program writes one Block class")
        # Llama 4: dense layers between MoE ones, every MOE_LAYER_STEP-th layer MoE (core/model.py moe_layer)
        when = "i >= DENSE_LAYERS" + (" and (i + 1) % MOE_LAYER_STEP == 0" if moe_step > 1 else "")
        block = dataclasses.replace(moe_kind, init=tuple(
            f"self.mlp = {moe} if {when} else {dense_mlp}" if ln == mlp_line else ln for ln in dense.init))
    norm = (pd.dense_layer or pd.moe_layer).op("attn_norm")
    if not serve and norm is not None and dict(norm.attrs).get("recompute") == "layernorm":
        # recompute = [layernorm]: the norms' outputs freed once attention / the MLP ran (runtime/model/discard.py)
        block = dataclasses.replace(block, init=block.init + (
            "rt.discard_between(self.attn_norm, self.attn)", "rt.discard_between(self.mlp_norm, self.mlp)"))
    return block


def _checkpointed(build: str, op, module: str) -> str:
    """``build`` wrapped in ``rt.checkpointed`` where the graph marks ``op`` (one of the
    module's ops) recomputed as ``module`` (``recompute = [mlp]``, ``[moe]``,
    ``[shared_experts]``: passes/insert_collectives.py ``_mark_modules``)."""
    return f"rt.checkpointed({build})" if op is not None and dict(op.attrs).get("recompute") == module else build


def _serve_classes(pd: ProgramData) -> dict:
    """The serving program's decoder-layer classes written op by op from the serve plan's
    sharded graph with the rows' serving forms (:func:`methods` ``serve``): the attention
    over the KV cache (multi-head latent attention in the serving graph's absorbed form:
    ``ir/lower.py`` ``mla_absorbed``), the dense MLP and Block."""
    layer = pd.dense_layer or pd.moe_layer
    constants = MLA_CONSTANTS if layer.op("attn.wkv_a") is not None else DIM_CONSTANTS
    out = {**_mlp_classes(pd, serve=True), "attn_class": ""}
    out["moe_class"], out["moe_doc"], moe, out["block_args"] = "", "", "MoE(i, tp)", ""
    if pd.moe_layer is not None:
        out.update(_serve_moe(pd))
        if out["moe_expert_parallel"]:
            moe, out["block_args"] = "MoE(i, tp, experts)", ", rt.ExpertAxes.of(ctx)"
    out["attn_class"] = module_methods(layer, "attn", pd.ops, {}, constants, serve=True,
                                       per_layer=pd.layer_tables).text("i: int, tp: rt.Axis")
    sig = "i: int, tp: rt.Axis" + (", experts: rt.ExpertAxes" if out["block_args"] else "")
    out["block_methods"] = _block_methods(pd, "Attention(i, tp)", moe, serve=True).text(sig)
    return out


def _serve_moe(pd: ProgramData) -> dict:
    """The serving program's MoE module, training's router, dispatch, experts and combine at
    decode size (:func:`_moe_methods`), laid out as the graph's ops say: experts split over ep
    (the dispatch's all-to-all over ep), or every expert on every rank, each expert's inner
    width split over tp as vLLM serves it (the experts op's ``ffn_axis``: a local dispatch,
    partial sums, with the shared experts' one all-reduce). ``moe_expert_parallel``: the
    module takes the plan's expert axes."""
    whole = _experts_on_tp(pd)
    doc = ("every expert on every rank, tensor parallel as vLLM serves it:\n    tokens routed alike on each rank "
           "(no all-to-all), the partial sums all-reduced once" if whole else
           "training's dispatch at decode size:\n    each (token, expert) row goes by all-to-all over ep to the rank "
           "holding its expert, the rows return weighted by the router")
    return {"moe_expert_parallel": not whole, "moe_class": _moe_methods(pd, serve=True), "moe_doc": doc}


#: the emitted class bodies (emit's ``_classes`` / ``_serve_classes``) that may read a per-layer table
_CLASS_KEYS = ("attn_class", "mlp_class", "shared_class", "moe_class", "block_methods")


def _layer_kinds(pd: ProgramData, classes: dict, serve: bool = False) -> dict:
    """What differs between the decoder layers one class serves, as the program's constants:
    the per-layer tables of the op attributes declared per-layer that differ
    (``layer_tables``: :func:`parcompile.codegen.stage.layer_table_rows`, each read by the
    written ``classes`` or by the serving cache), the RoPE tables per base
    (:func:`parcompile.codegen.stage.rope_bases`), the FP8 recipe per layer. ``window`` /
    ``window_table``: the serving cache's window (``serve``: the cache reads it), or the name
    of the layers' table of them."""
    windows = pd.table("attn.core", "window")
    table = windows.name if windows is not None else "WINDOW"
    written = "\n".join([classes.get(k, "") for k in _CLASS_KEYS] + ([table] if serve else []))
    return {
        "window": (pd.dense_layer or pd.moe_layer).op("attn.core").attr("window"),
        "window_table": table,
        "layer_tables": layer_table_rows(pd, written),
        "layer_fp8": repr(pd.layer_fp8) if pd.layer_fp8 else None,
        **rope_bases(pd),
    }


def _model_keys(m) -> dict:
    """The resolved model block as plain values (``hf_output`` builds its config.json from it)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in m.model_dump().items()}


def _device_comment(acc) -> str:
    """What ``DEVICE`` means, for its comment in program.py (``acc``: the cluster's
    :class:`~parcompile.config.presets.Accelerator`)."""
    if acc.device == "cpu":
        return "gloo on CPU processes, even where a GPU exists"
    return f"{acc.collectives} on {acc.name}; gloo on the CPU where none is present"


def render_program(cfg: SpecConfig, plan: CompiledPlan, out_dir: Path | None = None) -> str:
    """The text of ``program.py`` for a training plan (a :class:`~parcompile.plan.Plan`:
    its sharded graph gives every local size and collective; see :func:`program_context`)."""
    return _env.get_template("program.py.j2").render(**program_context(cfg, plan, out_dir))


def program_name(cfg: SpecConfig) -> str:
    """The generated program's file name: ``program.py`` (train) or ``serve.py`` (serve)."""
    return "serve.py" if cfg.workload == "serve" else "program.py"


def _launcher_context(cfg: SpecConfig) -> dict:
    """What ``launch.sh`` and ``slurm.sbatch`` both say: the header, the program and its
    layout on the nodes (``world = nodes * gpus_per_node``, one process per device;
    ``devices`` names them, None on CPUs)."""
    c = cfg.cluster
    script = program_name(cfg)
    return dict(
        name=comment_text(cfg.name), version=version(), spec_file=comment_text(Path(cfg.filename).name),
        nodes=c.nodes, gpus_per_node=c.gpus_per_node, world=c.world_size, script=script,
        devices={"cuda": "GPUs", "npu": "NPUs", "cpu": None}[c.device_kind],
        example_args=("--prompt 'Once upon a time' --max-new-tokens 32" if script == "serve.py"
                      else "--steps 10 --metrics-dir out/"),
        **_accelerator_lines(c.accelerator),
    )


def _accelerator_lines(acc) -> dict:
    """What the launchers say and set for the cluster's software stack (``acc``: an
    :class:`~parcompile.config.presets.Accelerator`): ``accel_comments`` (header lines: the
    devices, the variable that restricts them, the stack's setup line, the collective
    library's settings a site may need), ``accel_exports`` (``export VAR="${VAR:-value}"``
    lines, a value set by the caller kept) and ``visible_devices`` (the variables, by layer, that
    launch.sh checks name enough devices; none on the CPU)."""
    comments = [f"Accelerator: {acc.name}; collectives through {acc.collectives}."]
    if acc.visible_devices:
        comments += [acc.visible_devices_text(),
                     "(local rank i takes the i-th): at least one per process."]
    if acc.setup:
        comments.append(f"Load the stack's environment first: {acc.setup}")
    if acc.comm_env:
        comments.append(f"{acc.collectives} settings a site may need (not set here):")
        comments += [f"  {var}: {what}" for var, what in acc.comm_env]
    exports = [f'export {var}="${{{var}:-{value}}}"   # {why}' for var, value, why in acc.launch_env]
    return dict(accel_comments=comments, accel_exports=exports, visible_devices=acc.visible_devices)


def render_launch(cfg: SpecConfig) -> str:
    """``launch.sh``: torchrun on one node; for a multi-node plan, one node of the
    rendezvous per run (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` from the
    environment) or, with ``NNODES=1``, every process of the plan on this machine.

    The program is found beside the script (``BASH_SOURCE``) and runs in the caller's
    directory; torchrun missing from ``PATH``, or a Python without parcompile, stops it with
    a one-line message (``_python_env.sh.j2``)."""
    return _env.get_template("launch.sh.j2").render(**_launcher_context(cfg))


def render_slurm(cfg: SpecConfig) -> str:
    """``slurm.sbatch``: one task per node, ``srun torchrun`` with c10d rendezvous on the
    allocation's first node (``scontrol show hostnames``).

    sbatch runs a copy of the script from its spool directory, so the program's directory
    is, in order: ``PARCOMPILE_DIR``; the script's own directory (run outside sbatch); the
    directory of the script as submitted (``scontrol show job``'s ``Command=``, relative to
    ``SLURM_SUBMIT_DIR``, checked on SLURM 22.05); the job's working directory. The job
    keeps sbatch's working directory (``--chdir``). Generated files hold no absolute path."""
    gpu_line = f"--gpus-per-node={cfg.cluster.gpus_per_node}" if cfg.cluster.accelerator.slurm_gpus else None
    job = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in cfg.name)[:64] or "parcompile"
    return _env.get_template("slurm.sbatch.j2").render(**_launcher_context(cfg), gpu_line=gpu_line, job_name=job)


def serve_context(cfg: SpecConfig, plan: CompiledPlan, out_dir: Path | None = None) -> dict:
    """The plain data the serve template formats (see module docstring); local sizes from
    the sharded graph, the kv heads a rank holds from the plan (a replicated kv head is
    unsplit in the graph: ``core/heads.py``)."""
    m, p, s = cfg.model, cfg.parallel, cfg.serve
    graph = getattr(plan, "graph", None)
    pd, plan = _graph_data(plan)
    layer = pd.dense_layer or pd.moe_layer
    sv = plan["serve"]
    weights = program_paths(cfg, out_dir).get("serve.weights", s.weights)
    kv_local, replicas = plan["model"]["kv_heads_per_rank"], plan["model"]["kv_head_replicas"]
    quant = _serve_quant(cfg, graph)
    model = _serve_model(cfg, pd, plan["model"]["padded_vocab"], kv_local)
    model["model_constants"] = model["model_constants"] + quant["quant_constants"]
    weights_doc = comment_text(weights) if weights else f"drawn from seed {s.seed} (the training init)"
    return {
        "name": comment_text(cfg.name),
        "version": version(),
        "spec_file": comment_text(Path(cfg.filename).name),
        "world": p.world_size,
        "torchrun_cmd": torchrun_command(cfg, "serve.py"),
        "m": m,
        "p": p,
        "s": s,
        "batch_per_replica": sv["batch_per_replica"],
        "padded_vocab": plan["model"]["padded_vocab"],
        **model,
        "quant_args": quant["quant_args"],
        **_cache_layout(layer, kv_local, replicas),
        "kv_bytes_per_token": sv["kv_bytes_per_token"],
        "kv_dtype": s.kv_dtype or m.dtype,
        "device": cfg.cluster.device_kind,
        "device_comment": _device_comment(cfg.cluster.accelerator),
        "prompt_repr": repr(s.prompt),
        "weights_repr": repr(weights),
        "weights_doc": weights_doc + quant["weights_note"],
    }


def _serve_quant(cfg: SpecConfig, graph) -> dict:
    """A serve program of quantized weights (``serve.weight_dtype``; core/quant.py): the
    constants WEIGHT_FORMAT and QUANTIZED_WEIGHTS (the weights the plan holds quantized,
    :func:`parcompile.core.quant.quantized_param` over the serving graph, by
    :func:`parcompile.core.quant.weight_key`), the arguments that pass them to
    ``load_weights`` and a note for the docstring; nothing for the model's own dtype."""
    s = cfg.serve
    fmt = weight_format(s.weight_dtype, s.weight_format)
    if fmt is None:
        return {"quant_constants": [], "quant_args": "", "weights_note": ""}
    keys = sorted({weight_key(p.name) for nd in graph.nodes() for p in nd.params
                   if quantized_param(nd.kind, nd.op.module, p.name, len(p.type.dims), fmt)})
    listed = "(" + ", ".join(f'"{k}"' for k in keys) + ("," if len(keys) == 1 else "") + ")"
    rows = [("WEIGHT_FORMAT", f'"{fmt.name}"', f"{fmt.description} (core/quant.py)"),
            ("QUANTIZED_WEIGHTS", listed, "held quantized, dequantized inside each layer's forward")]
    return {"quant_constants": constant_lines(rows),
            "quant_args": ", weight_format=WEIGHT_FORMAT, quantized=QUANTIZED_WEIGHTS, dtype=DTYPE",
            "weights_note": f"; {fmt.name} weights held quantized (runtime/model/quant.py)"}


def _serve_model(cfg: SpecConfig, pd: ProgramData, padded: int, kv_local: int) -> dict:
    """The serving program's model written from the serve plan's sharded graph: constants,
    Norm, the classes and the Stage's walk (:func:`_train_model`'s, with the rows' serving
    forms)."""
    m, s = cfg.model, cfg.serve
    z = pd.sizes
    classes = _serve_classes(pd)
    kinds = _layer_kinds(pd, classes, serve=True)
    c = {**kinds, **classes}
    sizes = {"heads_local": z.heads, "kv_local": kv_local, "experts_local": z.experts or 0,
             "expert_ffn_local": z.expert_ffn or 0}
    stage = stage_code(pd, serve=True)
    return {
        "model_constants": serve_constants(m, pd, kinds, padded, rotary_dim(m), TORCH_NAMES[m.dtype],
                                           s.kv_dtype or m.dtype, sizes),
        "norm_def": norm_definition(pd),
        "model_classes": serve_classes(m, pd, c, sizes),
        **stage,
        **serve_positions(pd, kinds["rope_thetas"], rotary_dim(m)),
        "block_args": c["block_args"],
        "window_table": kinds["window_table"],
        "logits_all": re.sub(r"\bT=\d+", "T", stage["logits_shape"]),
        "logits_last": re.sub(r"\bT=\d+, ", "", stage["logits_shape"]),
    }


def _cache_layout(layer: LayerData, kv_local: int, replicas: int) -> dict:
    """What the KV cache of a serving rank holds per layer and token, as the program's
    constants: ``kv_local`` kv heads of HEAD_DIM for k and for v (each on ``replicas`` tp
    ranks), or under multi-head latent attention (``attn.wkv_a`` in the graph) one latent of
    KV_LORA_RANK and the shared RoPE key of QK_ROPE_HEAD_DIM (runtime/serve/generate.py KVCache's
    ``v_dim``); ``cache_header`` says so in the program's docstring. ``layout_constants``:
    KV_LOCAL (and KV_REPLICAS, which the replicated k and v projections read) for a cache of
    kv heads; none for the latent cache, which has no kv heads."""
    wkv_a = layer.op("attn.wkv_a")
    if wkv_a is not None:
        latent = wkv_a.attr("out_dim").size
        rope = layer.op("attn.rope_k")   # the shared RoPE key (latent_rope)
        header = (f"the latent ({latent - rope.local_shape[-1]}) and RoPE key ({rope.local_shape[-1]}) per token, "
                  "replicated on every tp rank")
        return {"cache_heads": "1", "cache_dim": "KV_LORA_RANK", "cache_v": ", v_dim=QK_ROPE_HEAD_DIM",
                "cache_header": header, "layout_constants": [],
                "cache_doc": "The latent cache of this rank's layers: the latent and the RoPE key, "
                             f"{latent} values per layer and token."}
    head_dim = layer.op("attn.wk").attr("out_dim").unit
    header = f"{kv_local} kv head(s) per rank" + (f", each replicated on {replicas} ranks" if replicas > 1 else "")
    layout = [("KV_LOCAL", kv_local, "kv heads per rank")]
    if replicas > 1:
        layout.append(("KV_REPLICAS", replicas, "tp ranks holding the same kv head (vLLM-style replication when "
                                                "tp > kv_heads)"))
    return {"cache_heads": "KV_LOCAL", "cache_dim": "HEAD_DIM", "cache_v": "", "cache_header": header,
            "layout_constants": constant_lines(layout),
            "cache_doc": f"The KV cache of this rank's layers: 2 x {kv_local} kv head(s) x {head_dim} values per "
                         "layer and token."}


def render_serve(cfg: SpecConfig, plan: CompiledPlan, out_dir: Path | None = None) -> str:
    """The text of ``serve.py`` for a serving plan."""
    return _env.get_template("serve.py.j2").render(**serve_context(cfg, plan, out_dir))


def write_files(out_dir: Path, files: dict[str, str], executable: tuple[str, ...] = (),
                stale: tuple[str, ...] = ()) -> None:
    """Write ``files`` (name -> text, UTF-8) into ``out_dir`` so that nothing is half-written.

    All files are written to a temporary sibling directory first. A new ``out_dir`` is
    that directory renamed into place in one atomic step; an existing one gets each file
    by an atomic rename (a reader sees each file old or new, never partly written). On any
    failure the temporary directory is removed and ``out_dir`` is left as it was (a
    directory this call would have created does not appear). Names in ``stale`` that
    ``files`` lacks are removed from an existing ``out_dir`` (outputs of an earlier plan
    that this one does not produce), and a directory of theirs that this leaves empty.

    Raises:
        OSError: the directory cannot be created or written.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for name, text in files.items():
            path = tmp / name   # a name may hold a directory (k8s/jobset.yaml)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            path.chmod(0o755 if name in executable else 0o644)
        if not out_dir.exists():
            for sub in {(tmp / name).parent for name in files} - {tmp}:
                sub.chmod(0o755)
            tmp.chmod(0o755)
            try:
                os.rename(tmp, out_dir)
                return
            except OSError:  # created meanwhile by someone else: fall back to file by file
                pass
        out_dir.mkdir(exist_ok=True)
        for sub in sorted({(out_dir / name).parent for name in files}):   # before any file is replaced
            sub.mkdir(exist_ok=True)
        for name in files:
            os.replace(tmp / name, out_dir / name)
        for name in stale:
            if name not in files and (out_dir / name).is_file():
                (out_dir / name).unlink()
        for sub in sorted({(out_dir / name).parent for name in stale} - {out_dir}):
            with contextlib.suppress(OSError):   # a directory the stale files left empty (k8s/); kept if not
                sub.rmdir()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
