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

One module per engine, each the target's rules and nothing else: :mod:`.megatron`
(Megatron-LM: :func:`megatron_args` builds the arguments in named steps, parallel, pipeline,
memory, model, MLA, MoE, vocabulary, precision, optimizer, run), :mod:`.megatron_bridge`,
:mod:`.torchtitan` (0.3, and what 0.2 shares), :mod:`.torchtitan02` (0.2's TOML),
:mod:`.deepspeed`, :mod:`.serve` (vLLM, SGLang); :mod:`.offload_hsdp` and :mod:`.lora` say what
each engine's config writes for offload, HSDP and LoRA (``train.method = lora``: Megatron-Bridge's
CanonicalLoRA, torchtitan's LoRAConverter, a PEFT note for DeepSpeed, and ``--to vllm`` of a LoRA
training spec serves its adapter); :mod:`.common` holds what they share
(:class:`Export`, the target names, the plan's degrees and common notes); :mod:`.model_keys`
declares the model keys each target carries (an allowlist per engine: every exporter refuses a
set model key its target does not carry, naming it, before its own checks). This module
dispatches (:func:`export`) and re-exports every name, so ``parcompile.exporters.megatron_args``
and the rest keep working.
"""


from parcompile.analysis.lora import is_lora
from parcompile.diagnostics import Diagnostic, SpecError
from parcompile.exporters.common import (SERVE_TARGETS, TARGETS, TORCHTITAN_VERSIONS, TRAIN_TARGETS, Export,
                                      common_notes, degrees, fmt_num, grad_reduce_dtype, layout_line, py_name,
                                      reduces_over_dp, stage_split)
from parcompile.exporters.deepspeed import deepspeed_config, deepspeed_export
from parcompile.exporters.lora import lora_errors, vllm_lora_export
from parcompile.exporters.megatron import (megatron_accounted_split, megatron_args, megatron_env, megatron_errors,
                                        megatron_export, megatron_layout)
from parcompile.exporters.megatron_bridge import (MEGATRON_BRIDGE_FIELDS, MEGATRON_BRIDGE_SECTIONS, megatron_bridge_config,
                                               megatron_bridge_export)
from parcompile.exporters.model_keys import TARGET_KEYS, Carried, TargetKeys, model_key_errors, set_model_keys
from parcompile.exporters.serve import (KV_CACHE_DTYPE, SERVE_DTYPE, serve_args, serve_export, serve_fraction_sequences,
                                     serve_memory_fraction)
from parcompile.exporters.torchtitan import (TORCHTITAN_SCHEDULE, torchtitan3_export, torchtitan_errors, torchtitan_fsdp,
                                          torchtitan_model_errors, torchtitan_model_parts, torchtitan_registry,
                                          torchtitan_schedule)
from parcompile.exporters.torchtitan02 import (TORCHTITAN02_FLAVORS, torchtitan02_export, torchtitan02_flavor,
                                            torchtitan_config)
from parcompile.plan import Plan

__all__ = ["export", "Export", "TARGETS", "TRAIN_TARGETS", "SERVE_TARGETS", "TORCHTITAN_VERSIONS",
           "TORCHTITAN_SCHEDULE", "TORCHTITAN02_FLAVORS", "MEGATRON_BRIDGE_FIELDS", "MEGATRON_BRIDGE_SECTIONS",
           "KV_CACHE_DTYPE", "SERVE_DTYPE", "megatron_accounted_split", "megatron_layout", "megatron_args",
           "megatron_env", "megatron_errors", "megatron_bridge_config", "torchtitan02_flavor", "torchtitan_config",
           "torchtitan_errors", "torchtitan_registry", "torchtitan_model_parts", "deepspeed_config",
           "serve_memory_fraction", "serve_fraction_sequences", "serve_args", "megatron_export",
           "megatron_bridge_export", "torchtitan3_export", "torchtitan02_export", "deepspeed_export", "serve_export",
           "torchtitan_fsdp", "torchtitan_schedule", "common_notes", "degrees", "fmt_num", "grad_reduce_dtype",
           "layout_line", "py_name", "reduces_over_dp", "stage_split", "TARGET_KEYS", "Carried", "TargetKeys",
           "model_key_errors", "set_model_keys", "torchtitan_model_errors"]


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
        if target == "vllm" and is_lora(plan.config):
            return vllm_lora_export(plan)   # the fine-tune's adapter on its base model (exporters/lora.py)
        if cfg.workload != "serve":
            raise SpecError([Diagnostic(
                "error", f"`export --to {target}` needs a serve spec; this spec has a `train` block",
                cfg.span("train"),
                help="export the spec that serves the model (a `serve` block), or export this one --to "
                     "megatron, megatron-bridge, torchtitan or deepspeed",
                note=f"{SERVE_TARGETS[target]} is an inference server: it has no training run to map this plan to",
                code="export-train")])
        return serve_export(plan, target)
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
        out = torchtitan3_export(plan) if torchtitan_version == "0.3" else torchtitan02_export(plan)
    else:
        engines = {"megatron": megatron_export, "megatron-bridge": megatron_bridge_export,
                   "deepspeed": deepspeed_export}
        out = engines[target](plan)
    out.errors.extend(lora_errors(plan, target))   # LoRA (issue 49): refused where the engine has none
    return out
