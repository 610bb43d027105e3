"""The accelerator a generated program runs on: the one module of the runtime that knows
device types (docs/clusters.md, "Accelerators").

A plan names a device type (``DEVICE`` in program.py: ``cuda`` for NVIDIA and AMD GPUs,
whose ROCm build of torch also calls its device ``cuda``; ``npu`` for Ascend through
``torch_npu``; ``cpu``), from its cluster preset. Everything the program asks of the device
goes through here:

- :func:`choose_backend`: the process-group backend (:data:`BACKENDS`) and this rank's
  device, selected before the process group exists (torch's rule);
- :func:`synchronize`, :func:`allocator_peaks`, :func:`device_count`: through
  ``torch.accelerator`` (synchronize, device index and count; the caching allocator's peaks
  where this torch has ``torch.accelerator.max_memory_allocated``, as 2.13 does) where it
  serves the device type, else the device type's own module (``torch.cuda``, ``torch.npu`` from torch_npu, ``torch.xpu``, or the module a
  ``privateuse1`` backend registers with ``torch._register_device_module``).

No function here names ``torch.cuda``: a device type reaches its module only by name
(``getattr(torch, device_type)``), so a run on an NPU, an XPU or a registered stand-in
never calls into CUDA (tests/test_accelerators.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch
import torch.distributed as dist

#: the torch.distributed backend per device type: NCCL (RCCL under ROCm, which keeps the
#: name) on ``cuda``, HCCL on Ascend's ``npu`` (registered by torch_npu), XCCL on Intel's
#: ``xpu``, gloo on the CPU and on Apple's ``mps`` (torch.distributed has no MPS backend;
#: gloo moves its tensors through the host). torch's own defaults agree:
#: ``dist.Backend.default_device_backend_map`` (cpu gloo, cuda nccl, xpu xccl, mps gloo).
#: A device type not listed takes the backend its extension registered there, else gloo.
BACKENDS: dict[str, str] = {"cuda": "nccl", "npu": "hccl", "xpu": "xccl", "cpu": "gloo", "mps": "gloo"}

#: device types that exist only once a package is imported (it registers the device, its
#: ``torch.<type>`` module and its backend): Ascend's torch_npu
DEVICE_PLUGINS: dict[str, str] = {"npu": "torch_npu"}

#: device types whose Adam / AdamW run torch's fused kernel here (``fused=True``): torch
#: has it for more (``torch.utils._foreach_utils._get_fused_kernels_supported_devices``), but
#: these two are the ones the runtime's results are checked on; elsewhere the per-parameter
#: loop, the same update up to rounding
FUSED_OPTIMIZER_DEVICES: tuple[str, ...] = ("cpu", "cuda")

#: ``torch.accelerator`` name -> the device module's name for the same call
_MODULE_NAMES = {"set_device_index": "set_device", "current_device_index": "current_device"}

#: per device type: whether ``torch.accelerator`` serves it (decided once, :func:`_via_accelerator`)
_SERVED: dict[str, bool] = {}


def backend_for(device_type: str) -> str:
    """The process-group backend for ``device_type`` (:data:`BACKENDS`; an unlisted type:
    the backend its extension registered in ``dist.Backend.default_device_backend_map``,
    else ``gloo``)."""
    if device_type in BACKENDS:
        return BACKENDS[device_type]
    registered = getattr(dist.Backend, "default_device_backend_map", {})
    return registered.get(device_type, "gloo")


def device_module(device_type: str):
    """``torch.<device_type>`` (``torch.cuda``, ``torch.npu`` once torch_npu is imported,
    ``torch.xpu``, a registered ``privateuse1`` module), or None."""
    return getattr(torch, device_type, None) if device_type != "cpu" else None


def _accelerator_is(device_type: str) -> bool:
    """Whether ``torch.accelerator``'s current accelerator is of ``device_type``."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or not hasattr(acc, "current_accelerator"):
        return False
    current = acc.current_accelerator()
    return current is not None and current.type == device_type


def _via_accelerator(device_type: str) -> bool:
    """Whether ``torch.accelerator`` serves ``device_type``: it is the current accelerator
    and its device guard answers (a ``privateuse1`` backend registered from Python alone has
    a device module but no guard: "PyTorch is not linked with support for ... devices").
    Probed once per type."""
    if device_type not in _SERVED:
        served = False
        if _accelerator_is(device_type):
            try:
                torch.accelerator.current_device_index()
                served = True
            except (RuntimeError, AttributeError, NotImplementedError):
                served = False
        _SERVED[device_type] = served
    return _SERVED[device_type]


def _function(device_type: str, name: str):
    """The function ``name`` of ``torch.accelerator`` where it serves ``device_type``, else
    the device module's (its own name for it: :data:`_MODULE_NAMES`), or None."""
    if _via_accelerator(device_type):
        fn = getattr(torch.accelerator, name, None)
        if fn is not None:
            return fn
    return getattr(device_module(device_type), _MODULE_NAMES.get(name, name), None)


def is_available(device_type: str) -> bool:
    """Whether this process sees a device of ``device_type`` (False for ``cpu``, which is
    always there but is no accelerator)."""
    if device_type == "cpu":
        return False
    if _accelerator_is(device_type):
        return bool(torch.accelerator.is_available())
    fn = getattr(device_module(device_type), "is_available", None)
    return bool(fn()) if fn is not None else False


def device_count(device_type: str) -> int:
    """How many devices of ``device_type`` this process sees (0 on the CPU or where none is)."""
    if not is_available(device_type):
        return 0
    fn = _function(device_type, "device_count")
    return int(fn()) if fn is not None else 0


def set_device(device: torch.device) -> None:
    """Make ``device`` (with its index) this process's current device."""
    if device.type == "cpu":
        return
    fn = _function(device.type, "set_device_index")
    if fn is None:
        raise RuntimeError(f"torch has no way to select a {device.type} device (torch.accelerator "
                           f"does not serve it and torch.{device.type} has no set_device)")
    fn(device.index or 0)


def synchronize(device: torch.device) -> None:
    """Wait for every kernel queued on ``device`` (a step's time is taken after it); nothing
    on the CPU, whose work is done when the call returns. Errors of the device's queued work
    surface here and are raised, not swallowed."""
    if device.type == "cpu":
        return
    fn = _function(device.type, "synchronize")
    if fn is not None:
        fn(device)


def allocator_peaks(device: torch.device) -> dict[str, int] | None:
    """This process's peak bytes ``{"allocated": ..., "reserved": ...}`` on ``device`` from
    the accelerator's caching allocator: ``torch.accelerator``'s ``max_memory_allocated`` /
    ``max_memory_reserved`` (every device type whose allocator registers with it, in the
    torch versions that have them), else the device module's; None on the CPU (no caching allocator) or where the device
    has neither (the caller then reports the process's peak resident set)."""
    if device.type == "cpu":
        return None
    sources = ([torch.accelerator] if _via_accelerator(device.type) else []) + [device_module(device.type)]
    for mod in sources:
        alloc = getattr(mod, "max_memory_allocated", None)
        reserved = getattr(mod, "max_memory_reserved", None)
        if alloc is None or reserved is None:
            continue
        try:
            return {"allocated": int(alloc(device)), "reserved": int(reserved(device))}
        except (RuntimeError, TypeError, ValueError, AssertionError, NotImplementedError):
            continue   # an allocator that is not torch.accelerator's DeviceAllocator: the module's
    return None


def missing_plugin(device: str) -> str | None:
    """The package (:data:`DEVICE_PLUGINS`) a plan on ``device`` devices needs that this
    Python cannot import, or None: none needed, it is installed, or ``PARCOMPILE_DEVICE=cpu``
    runs the plan with gloo on the CPU. :func:`choose_backend` raises in every rank for the
    same case; a launcher asks first, so that it refuses before any rank starts."""
    if os.environ.get("PARCOMPILE_DEVICE") == "cpu" or device == "cpu":
        return None
    plugin = DEVICE_PLUGINS.get(device)
    return plugin if plugin is not None and importlib.util.find_spec(plugin) is None else None


#: the packages through which DeepSpeed's accelerator detection finds a device that torch
#: itself does not report (Ascend, Tecorigin SDAA, Habana, Cambricon, Biren, Kunlunxin), in
#: DeepSpeed 0.19.8 deepspeed/accelerator/real_accelerator.py ``get_accelerator``; its
#: other probes are torch's own (``torch.xpu``, ``torch.mps``, ``torch.cuda``)
DEEPSPEED_DEVICE_PACKAGES: tuple[str, ...] = ("torch_npu", "torch_sdaa", "habana_frameworks", "torch_mlu",
                                              "torch_supa", "torch_xmlir")


def quiet_deepspeed_on_cpu() -> bool:
    """Set ``DS_ACCELERATOR=cpu`` where this machine has no accelerator DeepSpeed would find,
    before anything imports DeepSpeed; returns whether it was set.

    transformers imports DeepSpeed where it is installed (the test extra installs it), and
    DeepSpeed's auto-detection then logs "Setting accelerator to CPU. If you have GPU or other
    accelerator, we were unable to detect it." as a WARNING on every such import
    (real_accelerator.py ``get_accelerator``, DeepSpeed 0.19.8); its documented override
    ``DS_ACCELERATOR`` chooses the same CPU accelerator without the warning. Left alone: a
    ``DS_ACCELERATOR`` already set, a device torch sees (``cuda``, ``xpu``, ``mps``), or an
    installed package of :data:`DEEPSPEED_DEVICE_PACKAGES`."""
    if "DS_ACCELERATOR" in os.environ or any(is_available(t) for t in ("cuda", "xpu", "mps")):
        return False
    if any(importlib.util.find_spec(name) is not None for name in DEEPSPEED_DEVICE_PACKAGES):
        return False
    os.environ["DS_ACCELERATOR"] = "cpu"
    return True


def choose_backend(force_cpu: bool = False, device: str = "cuda") -> tuple[str, torch.device]:
    """The process-group backend and this rank's device, chosen at run time from the plan's
    device type ``device``, and that device selected (before the process group exists, as
    torch requires):

    - ``cpu``, ``force_cpu`` or ``PARCOMPILE_DEVICE=cpu``: gloo on the CPU;
    - a type that needs a package (:data:`DEVICE_PLUGINS`: ``npu`` needs torch_npu): it is
      imported first;
    - the device present: :func:`backend_for` (NCCL, HCCL, XCCL, ...) on device
      ``LOCAL_RANK`` (torchrun's local rank; one process per device);
    - none present: gloo on the CPU, so that a GPU plan can be tried on this machine.

    Raises:
        RuntimeError: the device type's package (torch_npu) is not installed.
    """
    if os.environ.get("PARCOMPILE_DEVICE") == "cpu" or force_cpu or device == "cpu":
        return "gloo", torch.device("cpu")
    plugin = DEVICE_PLUGINS.get(device)
    if plugin is not None:
        try:
            importlib.import_module(plugin)   # registers the device type, torch.<type> and its backend
        except ImportError:
            raise RuntimeError(f"this plan runs on {device} devices (Ascend: cluster ascend-910b) but {plugin} is "
                               f"not installed: pip install {plugin.replace('_', '-')}, or set "
                               "PARCOMPILE_DEVICE=cpu to run with gloo on the CPU") from None
    if not is_available(device):
        return "gloo", torch.device("cpu")
    mine = torch.device(device, int(os.environ.get("LOCAL_RANK", "0")))
    set_device(mine)
    return backend_for(device), mine
