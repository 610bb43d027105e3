"""Built-in presets that `from "NAME"` names (SPEC 1, "Preset names").

A model preset gives the architecture keys of a published model, taken from its
Hugging Face ``config.json`` (``seq_len`` is ``max_position_embeddings``, as for an
imported ``config.json``); each lives in its family's module
(:mod:`parcompile.core.families`). A cluster preset gives one node's GPU and links:
memory, dense peak per model dtype, HBM bandwidth, per-GPU one-direction NVLink (or
equivalent) and network bandwidth, and message latencies; ``nodes`` and ``gpus_per_node`` may always
be overridden. Values are in SI units (bytes, FLOP/s, bytes/s, seconds), written with
:func:`~parcompile.config.units.quantity` so that they read like the datasheets.

``peak_flops`` is the dense tensor-core peak for the model's dtype: bf16 and fp16 share
one number; fp32 models are counted at the TF32 tensor-core peak (what fp32 matmuls run
at when TF32 is allowed), or the fp32 vector peak where a part has no TF32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parcompile.config.units import quantity as q
from parcompile.core.families import model_presets

# --------------------------------------------------------------------------------------
# Models

#: the published models of each family, from its module (:mod:`parcompile.core.families`)
MODEL_PRESETS: dict[str, dict[str, Any]] = model_presets()

# --------------------------------------------------------------------------------------
# Clusters


@dataclass(frozen=True)
class ClusterPreset:
    """One node's GPUs and links. ``peak_flops`` maps the model dtype to dense FLOP/s."""

    gpus_per_node: int
    memory: int                    # bytes per GPU
    peak_flops: dict[str, float]   # FLOP/s per GPU, dense, by model dtype
    hbm_bw: float                  # bytes/s
    intra_node_bw: float           # bytes/s per GPU, one direction
    inter_node_bw: float           # bytes/s per GPU, one direction
    intra_node_latency: float      # s per message
    inter_node_latency: float      # s per message
    #: network adapters per node (inter_node_bw is each GPU's share of them)
    nics_per_node: int = 8
    #: NVLink SHARP on the node's NVSwitches (NCCL's NVLS algorithms)
    nvls: bool = False
    #: s of host work per graph op of the forward beyond its arithmetic (eager Python,
    #: dispatcher, autograd; analysis/estimate.py): 0 for the GPU presets, whose host work
    #: runs ahead of the GPU's queue and is not timed
    op_overhead: float = 0.0

    def values(self, dtype: str) -> dict[str, Any]:
        """The `cluster` keys this preset sets, with the peak for a model of ``dtype``."""
        return {
            "gpus_per_node": self.gpus_per_node,
            "memory": self.memory,
            "peak_flops": self.peak_flops[dtype],
            "hbm_bw": self.hbm_bw,
            "intra_node_bw": self.intra_node_bw,
            "inter_node_bw": self.inter_node_bw,
            "intra_node_latency": self.intra_node_latency,
            "inter_node_latency": self.inter_node_latency,
            "nics_per_node": self.nics_per_node,
            "nvls": self.nvls,
            "op_overhead": self.op_overhead,
        }


def _peaks(half: str, fp32: str) -> dict[str, float]:
    return {"bf16": q(half), "fp16": q(half), "fp32": q(fp32)}


# NVLink/NCCL latencies: a few microseconds in-node, about 10 us across InfiniBand.
_NVLINK_LATENCY = q("5 us")
_IB_LATENCY = q("10 us")

CLUSTER_PRESETS: dict[str, ClusterPreset] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB): 312 TFLOPS bf16, 156 TFLOPS TF32,
    # 1,555 GB/s HBM2; NVLink 3 600 GB/s bidirectional; DGX A100: 8 x 200 Gb/s HDR per node.
    "a100-40gb": ClusterPreset(
        gpus_per_node=8, memory=int(q("40 GiB")), peak_flops=_peaks("312 TFLOPS", "156 TFLOPS"),
        hbm_bw=q("1555 GB/s"), intra_node_bw=q("300 GB/s"), inter_node_bw=q("200 Gb/s"),
        intra_node_latency=_NVLINK_LATENCY, inter_node_latency=_IB_LATENCY,
    ),
    # NVIDIA A100 datasheet (SXM4 80GB): 2,039 GB/s HBM2e; DGX A100 80GB: 8 x 200 Gb/s HDR.
    "a100-80gb": ClusterPreset(
        gpus_per_node=8, memory=int(q("80 GiB")), peak_flops=_peaks("312 TFLOPS", "156 TFLOPS"),
        hbm_bw=q("2039 GB/s"), intra_node_bw=q("300 GB/s"), inter_node_bw=q("200 Gb/s"),
        intra_node_latency=_NVLINK_LATENCY, inter_node_latency=_IB_LATENCY,
    ),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOPS bf16 dense, 494.7 TFLOPS TF32 dense, 3.35 TB/s
    # HBM3; NVLink 4 900 GB/s bidirectional; DGX H100: 8 x 400 Gb/s NDR (ConnectX-7), one per
    # GPU on a rail-optimised fabric; four third-generation NVSwitches with NVLink SHARP.
    "h100-sxm": ClusterPreset(
        gpus_per_node=8, memory=int(q("80 GiB")), peak_flops=_peaks("989 TFLOPS", "494.7 TFLOPS"),
        hbm_bw=q("3.35 TB/s"), intra_node_bw=q("450 GB/s"), inter_node_bw=q("400 Gb/s"),
        intra_node_latency=_NVLINK_LATENCY, inter_node_latency=_IB_LATENCY, nvls=True,
    ),
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, same compute and NVLink as H100;
    # DGX H200: 8 x 400 Gb/s, NVSwitch 3 with NVLink SHARP.
    "h200": ClusterPreset(
        gpus_per_node=8, memory=int(q("141 GiB")), peak_flops=_peaks("989 TFLOPS", "494.7 TFLOPS"),
        hbm_bw=q("4.8 TB/s"), intra_node_bw=q("450 GB/s"), inter_node_bw=q("400 Gb/s"),
        intra_node_latency=_NVLINK_LATENCY, inter_node_latency=_IB_LATENCY, nvls=True,
    ),
    # NVIDIA DGX B200 datasheet: 1,440 GB HBM3e per 8 GPUs (180 GB each) at 8 TB/s,
    # 2.25 PFLOPS bf16 dense, 1.1 PFLOPS TF32 dense per GPU; NVLink 5 1.8 TB/s bidirectional;
    # 8 x 400 Gb/s ConnectX-7; fifth-generation NVLink switches with NVLink SHARP.
    "b200": ClusterPreset(
        gpus_per_node=8, memory=int(q("180 GiB")), peak_flops=_peaks("2250 TFLOPS", "1100 TFLOPS"),
        hbm_bw=q("8 TB/s"), intra_node_bw=q("900 GB/s"), inter_node_bw=q("400 Gb/s"),
        intra_node_latency=_NVLINK_LATENCY, inter_node_latency=_IB_LATENCY, nvls=True,
    ),
    # AMD Instinct MI300X datasheet: 192 GB HBM3 at 5.3 TB/s, 1307.4 TFLOPS bf16 dense,
    # 653.7 TFLOPS TF32; Infinity Fabric 7 x 64 GB/s per direction to the 7 peers;
    # typical platforms: one 400 Gb/s NIC per GPU; no in-switch reduction.
    "mi300x": ClusterPreset(
        gpus_per_node=8, memory=int(q("192 GiB")), peak_flops=_peaks("1307.4 TFLOPS", "653.7 TFLOPS"),
        hbm_bw=q("5.3 TB/s"), intra_node_bw=q("448 GB/s"), inter_node_bw=q("400 Gb/s"),
        intra_node_latency=_NVLINK_LATENCY, inter_node_latency=_IB_LATENCY,
    ),
    # Huawei Ascend 910B (Atlas 800T A2 server, 8 NPUs): 64 GB HBM2e at about 1.6 TB/s,
    # about 313 TFLOPS fp16/bf16 dense (figures vary by SKU); HCCS about 196 GB/s per
    # direction; one 200 Gb/s RoCE port per NPU. No TF32: fp32 at the fp16 rate / 4 (assumed).
    "ascend-910b": ClusterPreset(
        gpus_per_node=8, memory=int(q("64 GiB")), peak_flops=_peaks("313 TFLOPS", "78 TFLOPS"),
        hbm_bw=q("1.6 TB/s"), intra_node_bw=q("196 GB/s"), inter_node_bw=q("200 Gb/s"),
        intra_node_latency=q("10 us"), inter_node_latency=q("20 us"),
    ),
    # This machine: 8 processes on the CPU with gloo (SPEC 1). Rough, dtype-independent
    # numbers that only need to be in proportion: about 1 TFLOPS, 20 GB/s memory, gloo over
    # shared memory / loopback TCP, 20 us of eager PyTorch per op (config/host.py's probe
    # measures 15-25 us on a 2-core EPYC VM with torch 2.13). config/host.py replaces them
    # with this machine's figures unless PARCOMPILE_CPU_PROBE=fixed.
    "cpu": ClusterPreset(
        gpus_per_node=8, memory=int(q("16 GiB")),
        peak_flops={d: q("1 TFLOPS") for d in ("bf16", "fp16", "fp32")},
        hbm_bw=q("20 GB/s"), intra_node_bw=q("2 GB/s"), inter_node_bw=q("1 GB/s"),
        intra_node_latency=q("50 us"), inter_node_latency=q("100 us"), op_overhead=q("20 us"),
    ),
}

MODEL_PRESET_NAMES: tuple[str, ...] = tuple(MODEL_PRESETS)
CLUSTER_PRESET_NAMES: tuple[str, ...] = tuple(CLUSTER_PRESETS)


def model_preset(name: str) -> dict[str, Any] | None:
    """A copy of the `model` keys of preset ``name`` (SI units), or None if there is none."""
    values = MODEL_PRESETS.get(name)
    return dict(values) if values is not None else None


def cluster_preset(name: str, dtype: str) -> dict[str, Any] | None:
    """The `cluster` keys of preset ``name`` for a model of ``dtype``, or None if there is none."""
    preset = CLUSTER_PRESETS.get(name)
    return preset.values(dtype) if preset is not None else None
