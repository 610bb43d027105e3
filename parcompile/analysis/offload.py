"""CPU offload (``parallel.offload``): what moves to host memory, the PCIe traffic of a step
and the CPU optimizer step, as DeepSpeed's ZeRO-Offload runs them.

**Where the states live.** ``offload = optimizer`` keeps each rank's optimizer states (Adam's
two moments and, for a 16-bit model, the fp32 master weights) in host memory and steps them
there, beside an fp32 copy of the rank's gradient shard (DeepSpeed's pinned fp32 gradient
partition, ``deepspeed/runtime/zero/stage_1_and_2.py`` ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``,
deepspeedai/DeepSpeed commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641); the GPU keeps the
parameters and gradients as the ZeRO stage says (:func:`offload_states`). ``offload =
params`` (ZeRO-3) also keeps the parameters' shards on the host (DeepSpeed's
``offload_param``, FSDP2's ``CPUOffloadPolicy``), copied to the GPU before each all-gather.

**Traffic and time** (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model
Training", USENIX ATC, section 4.1: per step the GPU sends the gradients, 2M bytes for M
fp16 parameters, and receives the updated 16-bit parameters, 2M bytes): per rank, its owned
elements ``n`` (the ZeRO shard) cross PCIe twice, ``dtype_bytes * n`` down and ``dtype_bytes
* n`` up (ZeRO-3 with ``params``: the shard again before each of the step's all-gathers), at
the preset's ``host_link_bw`` (PCIe Gen5 x16: 64 GB/s each way on an H100 SXM). The CPU step
(DeepSpeed's ``DeepSpeedCPUAdam``, ``deepspeed/ops/adam/cpu_adam.py``: AVX-vectorised, memory
bound: ZeRO-Offload section 5.1) moves the optimizer's bytes per element at the node's
``host_memory_bw``, shared by the node's ranks. Overlap, as DeepSpeed does it: each gradient
partition is copied down as soon as its bucket is reduced, during the backward (hidden); the
CPU step and the copy of the parameters back up run after the backward, before the next
forward (exposed); with ``params`` the shards' copies before the all-gathers overlap the
compute as FSDP2's prefetched all-gathers do: :func:`offload_step_time`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from parcompile.analysis.lora import frozen_param_bytes, is_lora, trainable
from parcompile.core.buckets import reshard_after_forward, shard_elements, stage_buckets
from parcompile.core.data_parallel import data_parallel_sharding, shard_degree
from parcompile.core.groups import rank_groups


#: optimizer-step bytes read + written per parameter held (fp32 gradient, master weight,
#: two moments, 16-bit weight; :func:`parcompile.analysis.estimate.optimizer_time`, and the
#: same step on the CPU: :func:`offload_step_time`)
OPTIMIZER_BYTES = {"adamw": (4 + 8 + 8 + 8), "adam": (4 + 8 + 8 + 8), "sgd": (4 + 8)}


def optimizer_step_bytes(cfg) -> int:
    """Bytes the optimizer step reads and writes per parameter it updates
    (:data:`OPTIMIZER_BYTES`), plus writing the 16-bit weights from the fp32 master for a
    16-bit model."""
    per = OPTIMIZER_BYTES.get(cfg.train.optimizer, OPTIMIZER_BYTES["adam"])
    return per + 2 if cfg.model.dtype_bytes < 4 else per


def owned_elements(cfg, degrees: Mapping[str, int], sp) -> int:
    """Elements of optimizer state one rank of stage ``sp`` (a
    :class:`~parcompile.analysis.params.StageParams`) owns: its ZeRO shard of every gradient
    bucket (``sum ceil(n_b / d)``, :func:`parcompile.core.buckets.shard_elements`), or all of
    its parameters without ZeRO; of the parameters that train only (LoRA: the adapters,
    :func:`parcompile.analysis.lora.trainable`; the frozen weights have no gradient or state)."""
    sp = trainable(cfg, degrees, sp)
    dps = data_parallel_sharding(cfg.parallel)
    if not dps.shards_optimizer_states:
        return sp.dense + sp.expert
    dense, expert = stage_buckets(sp, cfg.parallel.bucket_size)
    return shard_elements(dense, shard_degree(degrees)) + shard_elements(expert, degrees["expert_dp"])


def offload_states(cfg, degrees: Mapping[str, int], sp, state: tuple[int, int, int]) -> tuple[int, int, int, int]:
    """``(params, grads, optimizer, host)`` bytes of one rank: ``state`` (the GPU's
    ``(params, grads, optimizer)`` without offload, :func:`parcompile.analysis.memory.stage_state_bytes`)
    with what ``parallel.offload`` moves to host memory taken out, and the host's bytes
    (module docstring): the optimizer states and masters (an fp32 model's fp32 copy of its
    owned slices, which the host steps), plus an fp32 gradient shard (``4 * owned``), and
    with ``params`` the parameter shards too."""
    params, grads, opt = state
    mode = cfg.parallel.offload if cfg.workload == "train" else "none"
    if mode == "none":
        return params, grads, opt, 0
    n = owned_elements(cfg, degrees, sp)   # fp32 gradient shard; an fp32 model's parameter copy too
    host = opt + 4 * n + (4 * n if cfg.model.dtype_bytes == 4 else 0)
    frozen = frozen_param_bytes(cfg, degrees, sp, True) if mode == "params" and is_lora(cfg) else 0
    return (*kept_on_gpu(mode, state, frozen), host + (params - frozen if mode == "params" else 0))


def kept_on_gpu(mode: str, state, frozen: int = 0):
    """``(params, grads, optimizer)`` of ``state`` (the GPU's states without offload) that stay
    on the GPU under ``parallel.offload = mode``: the optimizer states go to host memory with
    ``optimizer`` and ``params``, the parameter shards too with ``params``, but for ``frozen``
    bytes of them (LoRA's frozen weights' shards: the program offloads what the optimizer
    steps, runtime/train/zero_frozen.py keeps the frozen ones on the device); the gradients
    stay. The rule :func:`offload_states` and the search's memory bounds
    (:mod:`parcompile.layout_search.bounds`) share."""
    params, grads, opt = state
    return (frozen if mode == "params" else params), grads, (opt if mode == "none" else 0)


@dataclass(frozen=True)
class OffloadTime:
    """The busiest rank's offload traffic and CPU step: bytes each way over PCIe, and
    seconds (``exposed``: what the step waits for, :func:`offload_step_time`)."""

    down_bytes: int
    up_bytes: int
    pcie_down: float
    pcie_up: float
    cpu_step: float
    exposed: float


def offload_step_time(cfg, degrees: Mapping[str, int], stage_params, bytes_per_element: int) -> OffloadTime:
    """:class:`OffloadTime` of the busiest stage (module docstring). ``bytes_per_element``:
    what the optimizer step reads and writes per parameter it updates
    (:func:`parcompile.analysis.estimate.optimizer_time`'s count: the same step, on the CPU).
    The CPU's memory bandwidth (``cluster.host_memory_bw``, per node) is shared by the
    node's ``gpus_per_node`` ranks, which step at once."""
    cl, par = cfg.cluster, cfg.parallel
    e = cfg.model.dtype_bytes
    regather = 2 * par.num_microbatches if reshard_after_forward(par.pp) else 1   # ZeRO-3 gathers per bucket
    worst = OffloadTime(0, 0, 0.0, 0.0, 0.0, 0.0)
    for sp in stage_params:
        n = owned_elements(cfg, degrees, sp)
        down, up = e * n, e * n * (1 + (regather if par.offload == "params" else 0))
        cpu = n * bytes_per_element / (cl.host_memory_bw / max(1, cl.gpus_per_node))
        t = OffloadTime(down, up, down / cl.host_link_bw, up / cl.host_link_bw, cpu, cpu + e * n / cl.host_link_bw)
        if t.exposed >= worst.exposed:
            worst = t
    return worst


def host_per_node(cfg, host_per_stage) -> int:
    """The most host memory one node's ranks keep (bytes): each rank's pipeline stage's
    ``host`` (``host_per_stage``, :func:`offload_states`), summed over the ``gpus_per_node``
    consecutive ranks of each node (the groups' rank order, :func:`parcompile.core.groups.rank_groups`)."""
    nodes: dict[int, int] = {}
    for group in rank_groups(cfg.parallel)["pp"]:
        for stage, rank in enumerate(group):
            nodes[rank // cfg.cluster.gpus_per_node] = nodes.get(rank // cfg.cluster.gpus_per_node, 0) \
                + host_per_stage[stage]
    return max(nodes.values(), default=0)


def offload_assumptions(cfg, degrees: Mapping[str, int], stage_params) -> dict:
    """plan.json ``estimate.assumptions.offload`` (empty without offload): the busiest rank's
    PCIe bytes and seconds each way, the CPU step, what the step waits for, and how it was
    priced (module docstring)."""
    if cfg.workload != "train" or cfg.parallel.offload == "none" or not stage_params:
        return {}
    t = offload_step_time(cfg, degrees, stage_params, optimizer_step_bytes(cfg))
    cl = cfg.cluster
    return {"offload": {
        "mode": cfg.parallel.offload, "pcie_down_bytes": t.down_bytes, "pcie_up_bytes": t.up_bytes,
        "pcie_down": t.pcie_down, "pcie_up": t.pcie_up, "cpu_step": t.cpu_step, "exposed": t.exposed,
        "host_link_bw": cl.host_link_bw, "host_memory_bw": cl.host_memory_bw,
        "overlap": "gradients copied to host during the backward as their buckets are reduced (hidden); the CPU "
                   "optimizer step and the parameters' copy back run after it (the breakdown's optimizer); "
                   "DeepSpeed ZeRO-Offload (Ren et al. 2021)"}}


__all__ = ["OPTIMIZER_BYTES", "optimizer_step_bytes", "owned_elements", "offload_states", "kept_on_gpu", "OffloadTime",
           "offload_step_time", "host_per_node", "offload_assumptions"]
