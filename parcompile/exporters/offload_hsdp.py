"""HSDP (``parallel.dp_replicate``) and CPU offload (``parallel.offload``) in the exports: what
each engine's config says for them, and what it cannot say (an error naming the engine's
rule). The engines' other settings are their exporters' (:mod:`parcompile.exporters.deepspeed`,
:mod:`~parcompile.exporters.torchtitan`, :mod:`~parcompile.exporters.megatron`).

- DeepSpeed (``deepspeed/runtime/zero/config.py`` ``DeepSpeedZeroConfig``, deepspeedai/DeepSpeed
  commit 1b88ac366fc922254d56abda5cf6b1f266556d19): ``offload_optimizer`` ("Valid for ZeRO
  stage 1, 2, 3") and ``offload_param`` ("Valid only with stage 3"), each ``{"device": "cpu",
  "pin_memory": true}``. HSDP was MiCS (``mics_shard_size`` ranks holding the ZeRO-3 states,
  replicated across groups: ``deepspeed/runtime/zero/mics.py`` ``MiCS_Init``), which DeepSpeed
  0.19 removed: its ``deepspeed/runtime/config.py`` (0.19.8, line 121) refuses
  ``mics_shard_size`` ("MiCS ZeRO-3 sharding has been removed", DeepSpeed issue 8489);
  ZeRO++'s hpZ (``zero_hpz_partition_size``) is not HSDP: it keeps a secondary copy of the
  parameters only, the optimizer states stay sharded over all ranks. HSDP is refused.
- torchtitan (``data_parallel_replicate_degree`` x ``data_parallel_shard_degree``: its
  exporter's :func:`~parcompile.exporters.torchtitan.torchtitan_fsdp`); offload is
  ``training.enable_cpu_offload``, FSDP2's ``CPUOffloadPolicy``, which offloads "parameters,
  gradients, and optimizer states" (torchtitan 0.3.0 ``torchtitan/config/configs.py`` line 61,
  ``TrainingConfig``; v0.2.2 ``torchtitan/config/job_config.py``
  ``Training``, commit 73a0e6979dd10b6b1904098eb3c8f62c18ab87ce; main's
  ``torchtitan/config/configs.py``, commit b5bcd76c66d0acb1a08b176d9639425bc55e0b2a): offload
  = params; the optimizer alone has no flag.
- Megatron-LM core_v0.19.0 (``megatron/training/arguments.py``, 5be9626709af2722333bf54797c954c09edeada3):
  ``--num-distributed-optimizer-instances`` (line 3049: "Number of Distributed Optimizer copies
  across Data Parallel domain"; ``megatron/core/parallel_state.py`` lines 922-992: each
  instance's ranks are consecutive members of the dp-cp group, as the plan's ``dp_shard``) for
  the distributed optimizer (zero 1, 2); ``--optimizer-cpu-offload`` (line 2781, Megatron-Core's
  HybridDeviceOptimizer) with ``--use-precision-aware-optimizer``, which validate_args requires
  with it (lines 1803-1807); no parameter offload.
"""

from __future__ import annotations

from parcompile.exporters.common import degrees, dp_sharding
from parcompile.plan import Plan

_CPU = {"device": "cpu", "pin_memory": True}


def deepspeed_offload_hsdp(plan: Plan, c: dict, notes: list[str], errors: list[str]) -> None:
    """DeepSpeed's ``zero_optimization`` keys for offload; HSDP refused (module docstring)."""
    par = plan.config.parallel
    dps = dp_sharding(plan)
    z = c["zero_optimization"]
    if par.offload != "none":
        z["offload_optimizer"] = dict(_CPU)
        if par.offload == "params":
            z["offload_param"] = dict(_CPU)
        notes.append(f"offload {par.offload}: DeepSpeed steps the optimizer with DeepSpeedCPUAdam on the CPU "
                     "(build the optimizer from the config, or pass deepspeed.ops.adam.DeepSpeedCPUAdam)")
    if dps.replicate > 1:
        errors.append(f"dp_replicate {dps.replicate}: DeepSpeed 0.19 has no HSDP: it removed MiCS (its config refuses "
                      "zero_optimization.mics_shard_size), and ZeRO++'s hpZ (zero_hpz_partition_size) keeps a second "
                      "copy of the parameters only, the optimizer states sharded over all ranks; export --to "
                      "torchtitan (data_parallel_replicate_degree), or --to megatron with zero 1 or 2")


def torchtitan_offload(plan: Plan) -> dict:
    """torchtitan's ``training`` keys for offload: ``enable_cpu_offload`` for ``offload =
    params`` (module docstring); empty otherwise."""
    return {"enable_cpu_offload": True} if plan.config.parallel.offload == "params" else {}


def torchtitan_offload_errors(plan: Plan) -> list[str]:
    """``offload = optimizer``: torchtitan has no flag for it (module docstring)."""
    if plan.config.parallel.offload != "optimizer":
        return []
    return ["offload optimizer: torchtitan's training.enable_cpu_offload (FSDP2's CPUOffloadPolicy) offloads the "
            "parameters and gradients too; use offload = params, or export --to deepspeed (offload_optimizer)"]


def megatron_offload_hsdp(plan: Plan, add) -> None:
    """Megatron-LM's flags for HSDP with the distributed optimizer and for optimizer offload
    (module docstring); ``add(flag, value=None)`` appends one. What it cannot express is
    :func:`megatron_offload_hsdp_errors`'."""
    dps = dp_sharding(plan)
    if dps.replicate > 1 and not dps.shards_parameters:
        add("--num-distributed-optimizer-instances", dps.replicate)
    if plan.config.parallel.offload == "optimizer" and not dps.shards_parameters:
        add("--optimizer-cpu-offload")
        add("--use-precision-aware-optimizer")


def megatron_offload_hsdp_errors(plan: Plan) -> list[str]:
    """What Megatron-LM core_v0.19 cannot run of HSDP and offload: HSDP and offload with
    ``--use-torch-fsdp2`` (zero 3), parameter offload."""
    dps, par = dp_sharding(plan), plan.config.parallel
    errors = []
    if dps.replicate > 1 and dps.shards_parameters:
        errors.append(f"dp_replicate {dps.replicate} with zero 3: Megatron-LM's --num-distributed-optimizer-instances "
                      "replicates its distributed optimizer (zero 1, 2), not --use-torch-fsdp2; use zero 1 or 2, or "
                      "export --to torchtitan")
    if par.offload == "params":
        errors.append("offload params: Megatron-LM has no parameter offload (--optimizer-cpu-offload moves the "
                      "optimizer only); export --to deepspeed (offload_param) or --to torchtitan (enable_cpu_offload)")
    elif par.offload == "optimizer" and dps.shards_parameters:
        errors.append("offload optimizer with zero 3: Megatron-LM's --optimizer-cpu-offload (HybridDeviceOptimizer) "
                      "wraps its distributed optimizer (zero 1, 2), not --use-torch-fsdp2; use zero 1 or 2, or "
                      "export --to deepspeed")
    return errors


__all__ = ["deepspeed_offload_hsdp", "torchtitan_offload", "torchtitan_offload_errors", "megatron_offload_hsdp",
           "megatron_offload_hsdp_errors"]
