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
from parcompile.core.process import PROCESS_GROUP_TIMEOUT_S  # HCCL_CONNECT_TIMEOUT matches it

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
    #: GPUs that share one NVLink / NVSwitch domain, when more than a node's
    #: (``cluster.nvlink_domain``: 72 on a GB200 NVL72 rack of 18 four-GPU trays)
    nvlink_domain: int | None = None
    #: the vendor's software stack (:data:`ACCELERATORS`): which torch device type the program
    #: runs on, which collective library, and what the launchers say
    stack: str = "cuda"
    #: dense FP8 tensor-core peak, FLOP/s per GPU (E4M3/E5M2 GEMMs with per-tensor or per-row
    #: scales: torchao's tensorwise and rowwise recipes run at it); None where the part has no
    #: FP8 GEMM (:func:`fp8_peak`: `train.precision = fp8` prices the linear layers' GEMMs at it)
    fp8_flops: float | None = None
    #: dense MXFP8 peak (OCP microscaling: E8M0 scales per 32 elements, block-scaled GEMMs in
    #: hardware: Blackwell), FLOP/s per GPU; None where the part has none
    mxfp8_flops: float | None = None
    #: whether the part holds FP8 tensors (E4M3 / E5M2 storage, converted to 16 bits in
    #: software where it has no FP8 GEMM: vLLM keeps an FP8 KV cache so on Ampere); False
    #: where it has no FP8 type at all (:func:`fp8_storage`; a part with ``fp8_flops`` has one)
    fp8_storage: bool = True
    #: streaming multiprocessors (compute units) per GPU, the datasheets' and whitepapers' count:
    #: what the GEMM-rate model spreads a GEMM's output tiles over (:mod:`parcompile.analysis.gemm`);
    #: 0 where unknown or not a GPU
    sms: int = 0
    #: CPU offload (analysis/offload.py): each GPU's link to host memory (bytes/s, one
    #: direction), the node's host memory bandwidth (bytes/s) and size (bytes); defaults DGX
    #: H100's: H100 SXM datasheet "PCIe Gen5: 128 GB/s" (both ways: 64 GB/s each), DGX H100
    #: datasheet "2TB" system memory on two Xeon Platinum 8480C, eight DDR5-4800 channels
    #: each (2 x 8 x 38.4 GB/s = 614.4 GB/s)
    host_link_bw: float = 64e9
    host_memory_bw: float = 614.4e9
    host_memory: int = 2 * 10**12

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
            **({"nvlink_domain": self.nvlink_domain} if self.nvlink_domain else {}),
            "host_link_bw": self.host_link_bw, "host_memory_bw": self.host_memory_bw, "host_memory": self.host_memory,
        }


def _peaks(half: str, fp32: str) -> dict[str, float]:
    return {"bf16": q(half), "fp16": q(half), "fp32": q(fp32)}


@dataclass(frozen=True)
class Accelerator:
    """What differs between the vendors' software stacks for a generated program and its
    launchers (docs/clusters.md, "Accelerators"). The process-group backend of a device type
    is the runtime's rule (``parcompile/runtime/machine/device.py`` ``BACKENDS``); this says what the
    compiler writes around it.

    Attributes:
        device: the torch device type the program runs on (``DEVICE``): ROCm's torch calls
            its GPUs ``cuda`` too.
        name: the devices, in words.
        collectives: the library behind the backend (NCCL, RCCL, HCCL, gloo).
        visible_devices: the variables that restrict the devices a node's processes see, by
            layer of the stack (none on the CPU): within a layer the first one set is read,
            the others ignored; each layer restricts what the one before it exposes (ROCm:
            ROCR_VISIBLE_DEVICES in the ROCm runtime, then HIP_VISIBLE_DEVICES, or
            CUDA_VISIBLE_DEVICES when it is unset, in HIP). launch.sh checks that each
            restricted layer names enough of them (:meth:`visible_devices_text` says so).
        alloc_conf: the caching allocator's settings variables the program sets (before
            torch starts the device), most general first.
        comm_env: ``(variable, what it does)`` for the collective library's settings a
            launcher lists (not set: they depend on the site's network).
        launch_env: ``(variable, value, why)`` the launchers export unless already set.
        slurm_gpus: SLURM allocates these devices as ``--gpus-per-node`` (gres ``gpu``).
        setup: the shell line that loads the stack's environment, or None.
        sources: where the variables are documented.
        k8s_resource: the extended resource a Kubernetes pod requests the devices by (its vendor's
            device plugin advertises it: NVIDIA/k8s-device-plugin ``nvidia.com/gpu``,
            ROCm/k8s-device-plugin ``amd.com/gpu``, Ascend/ascend-device-plugin
            ``huawei.com/Ascend910``); None on the CPU (:mod:`parcompile.codegen.k8s`).
    """

    device: str
    name: str
    collectives: str
    visible_devices: tuple[tuple[str, ...], ...]
    alloc_conf: tuple[str, ...]
    comm_env: tuple[tuple[str, str], ...] = ()
    launch_env: tuple[tuple[str, str, str], ...] = ()
    slurm_gpus: bool = False
    setup: str | None = None
    sources: str = ""
    k8s_resource: str | None = None

    def visible_devices_text(self) -> str:
        """:attr:`visible_devices` in words, a line of the launchers' headers ("" on the CPU)."""
        names = ", then ".join(" (or else ".join(layer) + ")" * (len(layer) - 1) for layer in self.visible_devices)
        verb = "names" if len(self.visible_devices) == 1 else "name"
        return f"{names}, when set, {verb} the devices this node's processes use" if names else ""


_NCCL_ENV = (
    ("NCCL_SOCKET_IFNAME", "the network interface of NCCL's bootstrap and socket transport"),
    ("NCCL_IB_HCA", "the InfiniBand / RoCE adapters NCCL uses"),
    ("NCCL_DEBUG", "INFO logs the rings, trees and transports it chose"),
)

#: the software stacks of the cluster presets (``ClusterPreset.stack``)
ACCELERATORS: dict[str, Accelerator] = {
    "cuda": Accelerator(
        device="cuda", name="NVIDIA GPUs", collectives="NCCL", visible_devices=(("CUDA_VISIBLE_DEVICES",),),
        alloc_conf=("PYTORCH_CUDA_ALLOC_CONF",), comm_env=_NCCL_ENV, slurm_gpus=True,
        k8s_resource="nvidia.com/gpu",
        sources="NCCL docs, Environment Variables; PyTorch docs, CUDA semantics (PYTORCH_CUDA_ALLOC_CONF)",
    ),
    "rocm": Accelerator(
        device="cuda", name="AMD GPUs (ROCm)", collectives="RCCL",
        visible_devices=(("ROCR_VISIBLE_DEVICES",), ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")),
        alloc_conf=("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"),
        comm_env=tuple((v, w + " (RCCL reads NCCL's names)") for v, w in _NCCL_ENV), slurm_gpus=True,
        k8s_resource="amd.com/gpu",
        sources="ROCm docs, RCCL environment variables; ROCm docs, GPU isolation techniques (ROCR_, HIP_, "
                "CUDA_VISIBLE_DEVICES; torch.cuda._parse_visible_devices reads them so); torch's c10 reads "
                "PYTORCH_HIP_ALLOC_CONF on ROCm builds",
    ),
    "cann": Accelerator(
        device="npu", name="Ascend NPUs (CANN, torch_npu)", collectives="HCCL",
        visible_devices=(("ASCEND_RT_VISIBLE_DEVICES",),), alloc_conf=("PYTORCH_NPU_ALLOC_CONF",),
        comm_env=(
            ("HCCL_IF_IP", "the host address HCCL reaches the root node from when it creates a communicator"),
            ("HCCL_SOCKET_IFNAME", "the host network interface, where HCCL_IF_IP is unset"),
            ("HCCL_EXEC_TIMEOUT", "s a device waits inside one collective before it reports a failure"),
        ),
        launch_env=(("HCCL_CONNECT_TIMEOUT", str(PROCESS_GROUP_TIMEOUT_S),
                     f"s HCCL waits for every rank when it links a communicator (its default 120, range "
                     f"120-7200): the {PROCESS_GROUP_TIMEOUT_S} s the program's process groups wait"),),
        k8s_resource="huawei.com/Ascend910",
        setup="source /usr/local/Ascend/ascend-toolkit/set_env.sh   # CANN's libraries and HCCL, before torch_npu",
        sources="CANN environment variable reference (HCCL_CONNECT_TIMEOUT, HCCL_IF_IP, HCCL_SOCKET_IFNAME); "
                "Ascend/pytorch docs/zh/environment_variable_reference/PYTORCH_NPU_ALLOC_CONF.md",
    ),
    "cpu": Accelerator(
        device="cpu", name="CPU processes", collectives="gloo", visible_devices=(),
        alloc_conf=("PYTORCH_CUDA_ALLOC_CONF",),   # unread on the CPU: kept so a cpu plan's program reads like a GPU one's
    ),
}


# NVLink/NCCL latencies: a few microseconds in-node, about 10 us across InfiniBand.
_NVLINK_LATENCY = q("5 us")
_IB_LATENCY = q("10 us")

CLUSTER_PRESETS: dict[str, ClusterPreset] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB): 312 TFLOPS bf16, 156 TFLOPS TF32,
    # 1,555 GB/s HBM2; NVLink 3 600 GB/s bidirectional; DGX A100: 8 x 200 Gb/s HDR per node.
    # No FP8 (Ampere's tensor cores stop at bf16 / int8). 108 SMs (NVIDIA A100 Tensor Core GPU
    # Architecture whitepaper, Table 1: A100 SXM4, 1,410 MHz boost).
    "a100-40gb": ClusterPreset(
        gpus_per_node=8, memory=int(q("40 GiB")), peak_flops=_peaks("312 TFLOPS", "156 TFLOPS"),
        hbm_bw=q("1555 GB/s"), intra_node_bw=q("300 GB/s"), inter_node_bw=q("200 Gb/s"),
        intra_node_latency=_NVLINK_LATENCY, inter_node_latency=_IB_LATENCY, sms=108,
    ),
    # NVIDIA A100 datasheet (SXM4 80GB): 2,039 GB/s HBM2e; DGX A100 80GB: 8 x 200 Gb/s HDR.
    "a100-80gb": ClusterPreset(
        gpus_per_node=8, memory=int(q("80 GiB")), peak_flops=_peaks("312 TFLOPS", "156 TFLOPS"),
        hbm_bw=q("2039 GB/s"), intra_node_bw=q("300 GB/s"), inter_node_bw=q("200 Gb/s"),
        intra_node_latency=_NVLINK_LATENCY, inter_node_latency=_IB_LATENCY, sms=108,
    ),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOPS bf16 dense, 494.7 TFLOPS TF32 dense, 1,979
    # TFLOPS FP8 dense (3,958 with sparsity), 3.35 TB/s HBM3; NVLink 4 900 GB/s bidirectional;
    # DGX H100: 8 x 400 Gb/s NDR (ConnectX-7), one per GPU on a rail-optimised fabric; four
    # third-generation NVSwitches with NVLink SHARP. 132 SMs (NVIDIA H100 Tensor Core GPU Architecture
    # whitepaper, Table 3: H100 SXM5).
    "h100-sxm": ClusterPreset(
        gpus_per_node=8, memory=int(q("80 GiB")), peak_flops=_peaks("989 TFLOPS", "494.7 TFLOPS"),
        hbm_bw=q("3.35 TB/s"), intra_node_bw=q("450 GB/s"), inter_node_bw=q("400 Gb/s"),
        intra_node_latency=_NVLINK_LATENCY, inter_node_latency=_IB_LATENCY, nvls=True,
        fp8_flops=q("1979 TFLOPS"), sms=132,
    ),
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s; the H100's GH100 compute (989
    # TFLOPS bf16, 494.7 TF32, 1,979 FP8 dense: the sheet prints 1,979 / 3,958 with sparsity)
    # and NVLink 4 (900 GB/s); DGX H200: 8 x 400 Gb/s ConnectX-7, NVSwitch 3 with NVLink SHARP.
    "h200": ClusterPreset(
        gpus_per_node=8, memory=int(q("141 GiB")), peak_flops=_peaks("989 TFLOPS", "494.7 TFLOPS"),
        hbm_bw=q("4.8 TB/s"), intra_node_bw=q("450 GB/s"), inter_node_bw=q("400 Gb/s"),
        intra_node_latency=_NVLINK_LATENCY, inter_node_latency=_IB_LATENCY, nvls=True,
        fp8_flops=q("1979 TFLOPS"), sms=132,
    ),
    # NVIDIA DGX B200 datasheet: 1,440 GB HBM3e per 8 GPUs (180 GB each) at 64 TB/s (8 TB/s
    # each; NVIDIA's HGX B200 page now prints 62 TB/s, 7.7 each), 72 PFLOPS FP8 training per 8
    # GPUs with sparsity; HGX B200 per GPU: 2.25 PFLOPS bf16 / fp16 dense, 1.1 PFLOPS TF32
    # dense (2.2 sparse), 4.5 PFLOPS FP8 dense (9 sparse; MXFP8 the same: Blackwell's tensor
    # cores scale 32-element blocks in hardware at the FP8 rate); NVLink 5 1.8 TB/s
    # bidirectional; 8 x 400 Gb/s ConnectX-7; fifth-generation NVLink switches with SHARP. 148 SMs:
    # two dies of 80 SMs each with 74 enabled (Chips and Cheese, "Nvidia's B200: Keeping the CUDA
    # Juggernaut Rolling", 2025-12, chipsandcheese.com/p/nvidias-b200-keeping-the-cuda-juggernaut;
    # cudaDeviceProp.multiProcessorCount 148 on B200s in published profiles, e.g. Nsight Compute's
    # "NVIDIA B200, 148 SMs"), as analysis/efficiency.py's softmax_dim uses.
    "b200": ClusterPreset(
        gpus_per_node=8, memory=int(q("180 GiB")), peak_flops=_peaks("2250 TFLOPS", "1100 TFLOPS"),
        hbm_bw=q("8 TB/s"), intra_node_bw=q("900 GB/s"), inter_node_bw=q("400 Gb/s"),
        intra_node_latency=_NVLINK_LATENCY, inter_node_latency=_IB_LATENCY, nvls=True,
        fp8_flops=q("4500 TFLOPS"), mxfp8_flops=q("4500 TFLOPS"), sms=148,
        # DGX B200: two Xeon Platinum 8570 (eight DDR5-5600 channels each: 716.8 GB/s), 4 TB
        host_memory_bw=q("716.8 GB/s"), host_memory=4 * 10**12,
    ),
    # NVIDIA GB200 NVL72 datasheet: 72 Blackwell GPUs and 36 Grace CPUs in one NVLink domain
    # (130 TB/s of NVLink: 1.8 TB/s per GPU both ways, through nine NVLink switch trays with
    # SHARP); per GPU 186 GB HBM3e at 8 TB/s (13.4 TB and 576 TB/s per rack), 5 PFLOPS FP8 /
    # MXFP8 dense (720 PFLOPS per rack with sparsity), 2.5 PFLOPS bf16 / fp16 dense, 1.25
    # PFLOPS TF32 dense (1,200 W against HGX B200's 1,000 W). A node is one compute tray: two
    # Grace CPUs, four GPUs, four 400 Gb/s ConnectX-7 (one per GPU) to the scale-out network.
    # 148 SMs: the B200's two-die configuration (assumed; no GB200-specific SM count was found).
    "gb200-nvl72": ClusterPreset(
        gpus_per_node=4, memory=int(q("186 GiB")), peak_flops=_peaks("2500 TFLOPS", "1250 TFLOPS"),
        hbm_bw=q("8 TB/s"), intra_node_bw=q("900 GB/s"), inter_node_bw=q("400 Gb/s"),
        intra_node_latency=_NVLINK_LATENCY, inter_node_latency=_IB_LATENCY, nvls=True,
        nics_per_node=4, nvlink_domain=72, fp8_flops=q("5000 TFLOPS"), mxfp8_flops=q("5000 TFLOPS"), sms=148,
        # GB200 datasheet: each Grace's LPDDR5X, up to 480 GB at up to 512 GB/s, reached by its
        # two GPUs over NVLink-C2C (900 GB/s both ways: 225 GB/s per GPU each way); two per tray
        host_link_bw=q("225 GB/s"), host_memory_bw=q("1024 GB/s"), host_memory=960 * 10**9,
    ),
    # AMD Instinct MI300X datasheet: 192 GB HBM3 at 5.3 TB/s, 1,307.4 TFLOPS bf16 / fp16
    # dense, 653.7 TFLOPS TF32, 2,614.9 TFLOPS FP8 dense (5,229.8 with sparsity; OCP FP8,
    # no MX formats: those came with CDNA 4's MI350); Infinity Fabric 7 x 128 GB/s (896 GB/s
    # peak aggregate), 64 GB/s per direction to each of the 7 peers; typical platforms: one
    # 400 Gb/s NIC per GPU; no in-switch reduction. 304 compute units (the datasheet).
    "mi300x": ClusterPreset(
        gpus_per_node=8, memory=int(q("192 GiB")), peak_flops=_peaks("1307.4 TFLOPS", "653.7 TFLOPS"),
        hbm_bw=q("5.3 TB/s"), intra_node_bw=q("448 GB/s"), inter_node_bw=q("400 Gb/s"),
        intra_node_latency=_NVLINK_LATENCY, inter_node_latency=_IB_LATENCY, stack="rocm",
        fp8_flops=q("2614.9 TFLOPS"), sms=304,
        # typical platform: two EPYC 9004 (twelve DDR5-4800 channels each: 921.6 GB/s), PCIe Gen5
        host_memory_bw=q("921.6 GB/s"),
    ),
    # Huawei Ascend 910B (Atlas 800T A2 server, 8 NPUs): 64 GB HBM2e at about 1.6 TB/s,
    # about 313 TFLOPS fp16/bf16 dense (figures vary by SKU); HCCS about 196 GB/s per
    # direction (7 links of 56 GB/s both ways); one 200 Gb/s RoCE port per NPU. No TF32: fp32 at
    # the fp16 rate / 4 (assumed). No FP8 type at all, so neither FP8 GEMMs nor an FP8 KV cache
    # (Ascend's FP8 / MXFP8 arrive with the 950 series).
    "ascend-910b": ClusterPreset(
        gpus_per_node=8, memory=int(q("64 GiB")), peak_flops=_peaks("313 TFLOPS", "78 TFLOPS"),
        hbm_bw=q("1.6 TB/s"), intra_node_bw=q("196 GB/s"), inter_node_bw=q("200 Gb/s"),
        intra_node_latency=q("10 us"), inter_node_latency=q("20 us"), stack="cann", fp8_storage=False,
        host_link_bw=q("32 GB/s"),   # PCIe Gen4 x16 (host memory: DGX H100's, assumed)
    ),
    # This machine: 8 processes on the CPU with gloo (SPEC 1). Rough, dtype-independent
    # numbers that only need to be in proportion: about 1 TFLOPS, 20 GB/s memory, gloo over
    # shared memory / loopback TCP, 20 us of eager PyTorch per op (frontend/host.py's probe
    # measures 15-25 us on a 2-core EPYC VM with torch 2.13). frontend/host.py replaces them
    # with this machine's figures unless PARCOMPILE_CPU_PROBE=fixed. FP8 (tensorwise, rowwise):
    # runtime/model/fp8.py runs the GEMMs on the CPU as fp32 GEMMs of the E4M3 values, no faster than
    # 16 bits, so the same peak. MXFP8 likewise: the cpu preset is the one part without a
    # datasheet, a stand-in for running the program on CPU processes, and runtime/model/fp8.py
    # emulates MX blocks exactly (dequantized blocks, fp32 GEMM), so `fp8_recipe = mxfp8`
    # plans, compiles and verifies here (verify's miniatures run on this preset) while the
    # GPU presets keep the datasheet rule (MXFP8 on Blackwell only).
    "cpu": ClusterPreset(
        gpus_per_node=8, memory=int(q("16 GiB")),
        peak_flops={d: q("1 TFLOPS") for d in ("bf16", "fp16", "fp32")}, fp8_flops=q("1 TFLOPS"),
        mxfp8_flops=q("1 TFLOPS"),
        hbm_bw=q("20 GB/s"), intra_node_bw=q("2 GB/s"), inter_node_bw=q("1 GB/s"),
        intra_node_latency=q("50 us"), inter_node_latency=q("100 us"), op_overhead=q("20 us"), stack="cpu",
        host_link_bw=q("20 GB/s"), host_memory_bw=q("20 GB/s"), host_memory=int(q("128 GiB")),   # the same memory
    ),
}

MODEL_PRESET_NAMES: tuple[str, ...] = tuple(MODEL_PRESETS)
CLUSTER_PRESET_NAMES: tuple[str, ...] = tuple(CLUSTER_PRESETS)


def model_preset(name: str) -> dict[str, Any] | None:
    """A copy of the `model` keys of preset ``name`` (SI units), or None if there is none."""
    values = MODEL_PRESETS.get(name)
    return dict(values) if values is not None else None


def accelerator(preset: str | None) -> Accelerator:
    """The software stack of cluster preset ``preset`` (:data:`ACCELERATORS`); NVIDIA's
    CUDA for a cluster without a preset (or an unknown name: the spec checks names)."""
    found = CLUSTER_PRESETS.get(preset) if preset is not None else None
    return ACCELERATORS[found.stack if found is not None else "cuda"]


def cluster_preset(name: str, dtype: str) -> dict[str, Any] | None:
    """The `cluster` keys of preset ``name`` for a model of ``dtype``, or None if there is none."""
    preset = CLUSTER_PRESETS.get(name)
    return preset.values(dtype) if preset is not None else None


def fp8_peak(preset: str | None, recipe: str) -> float | None:
    """Dense FLOP/s per GPU of cluster preset ``preset`` for the FP8 GEMMs of ``recipe``
    (``train.fp8_recipe``): ``mxfp8_flops`` for ``mxfp8``, ``fp8_flops`` for ``tensorwise``
    and ``rowwise`` (a per-tensor or per-row scale is applied in the GEMM's epilogue, at the
    FP8 rate). None where the preset has no such GEMM, or for a cluster without a preset
    (its datasheet is unknown: the checks refuse FP8 there, :func:`fp8_presets`)."""
    found = CLUSTER_PRESETS.get(preset) if preset is not None else None
    if found is None:
        return None
    return found.mxfp8_flops if recipe == "mxfp8" else found.fp8_flops


def fp8_storage(preset: str | None) -> bool:
    """Whether cluster preset ``preset``'s devices hold FP8 tensors: what an FP8 KV cache
    (``serve.kv_dtype = fp8``, storage cast to 16 bits for attention) needs, where FP8
    training needs FP8 GEMMs (:func:`fp8_peak`). Every part with an FP8 GEMM has the type;
    one without may still store it (vLLM's ``kv_cache_dtype = "fp8"`` runs on Ampere,
    converting in its kernels; vLLM docs, Quantized KV Cache); False only where
    ``ClusterPreset.fp8_storage`` says the part has no FP8 type (Ascend 910B). A cluster
    without a preset is taken to have one (a GPU stack)."""
    found = CLUSTER_PRESETS.get(preset) if preset is not None else None
    return found is None or found.fp8_storage or found.fp8_flops is not None


def fp8_storage_presets() -> tuple[str, ...]:
    """The cluster presets whose devices hold FP8 tensors (:func:`fp8_storage`), in preset
    order: what a diagnostic refusing an FP8 KV cache names."""
    return tuple(name for name in CLUSTER_PRESETS if fp8_storage(name))


def fp8_presets(recipe: str) -> tuple[str, ...]:
    """The cluster presets that run ``recipe``'s FP8 GEMMs (:func:`fp8_peak` not None), in
    preset order: what a diagnostic refusing FP8 on another cluster names."""
    return tuple(name for name in CLUSTER_PRESETS if fp8_peak(name, recipe) is not None)
