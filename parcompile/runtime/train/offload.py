"""CPU offload (``parallel.offload``, :mod:`parcompile.analysis.offload`, which plans the
same placement): :class:`HostOptimizer` keeps the optimizer's states beside fp32 host copies
of the rank's owned parameter slices and steps them there, as DeepSpeed's ZeRO-Offload
(``offload_optimizer``, ``DeepSpeedCPUAdam``) and FSDP2's ``CPUOffloadPolicy`` do;
:func:`offload_optimizer` puts it under a sharded optimizer.

**Where each tensor lives** (:func:`split_host_bytes` measures it so):

- ``offload = optimizer``: in host memory the optimizer's states, the fp32 master slices
  (a 16-bit model's masters *are* the host copies: the sharded optimizer's segments share
  their storage, so no master is left on the device, as ZeRO-Offload keeps the fp32
  masters with the CPU optimizer) and an fp32 gradient buffer per slice; on the device the
  parameters and gradients as the ZeRO stage keeps them (an fp32 model's segments, views
  of its parameters or, at zero 3, its parameter shard);
- ``offload = params`` (zero 3) moves the parameter shard too: the 16-bit slices the
  all-gathers send (an fp32 model: its fp32 segments) are kept in host memory, copied to
  the device before each all-gather
  (:meth:`~parcompile.runtime.train.zero_gather.ParamGather._fill_shard`), as DeepSpeed's
  ``offload_param`` and FSDP2's ``CPUOffloadPolicy`` (``fully_shard(...,
  offload_policy=CPUOffloadPolicy())``: sharded parameters on the CPU, copied to the device
  for the all-gather) do.

One step: each owned slice's gradient (the rank's fp32 gradient shard, reduce-scattered on
the device, after the clipping) is copied into its fp32 host buffer, the torch optimizer
steps the host copies (its states live only there), and an fp32 model's updated values are
copied back into the device slices, which the all-gathers and the forward read (a 16-bit
model's low-precision slices are cast from the host masters by the sharded optimizer). Host
buffers are pinned where the device is an accelerator (page-locked, for asynchronous
copies); on the CPU they are separate buffers in the same memory (:data:`HOST` is the
device), so a CPU run is bit-for-bit the run without offload: the same fp32 values go
through the same optimizer kernel (``make_optimizer``'s fused AdamW on the CPU).
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
import torch.nn as nn

from parcompile.runtime.train.grads import segment_grad

#: host memory, where offloaded tensors are allocated
HOST = torch.device("cpu")


class _HostState(MutableMapping):
    """The host optimizer's ``state`` keyed by the device slices (what the checkpoints of
    :class:`~parcompile.runtime.train.zero_states.ShardStates` read and write); tensors set
    through it move to the host."""

    def __init__(self, owner: "HostOptimizer"):
        self.owner = owner

    def __getitem__(self, seg):
        return self.owner.inner.state[self.owner.host[id(seg)]]

    def __setitem__(self, seg, value: dict) -> None:
        self.owner.inner.state[self.owner.host[id(seg)]] = {
            k: v.to(self.owner.host_device) if torch.is_tensor(v) else v for k, v in value.items()}

    def __delitem__(self, seg) -> None:
        del self.owner.inner.state[self.owner.host[id(seg)]]

    def __iter__(self):
        return iter(self.owner.segs)

    def __len__(self) -> int:
        return len(self.owner.segs)

    def values(self):
        return [self.owner.inner.state.get(h, {}) for h in self.owner.host.values()]


class HostOptimizer:
    """A torch optimizer over host copies of the device parameter slices of ``groups``
    (``[{"params": [...], ...}, ...]``, the sharded optimizer's groups), built by
    ``build(host_groups)`` (:func:`parcompile.runtime.train.optim.make_optimizer`); the same
    ``step``, ``param_groups`` and ``state`` (keyed by the device slices) as a torch
    optimizer (module docstring). ``masters``: the slices are a 16-bit model's fp32 master
    weights, which move to the host (their storage becomes the host copies', nothing is
    copied back after the step). ``mode``: ``parallel.offload`` (``"params"``: the
    parameter shard is kept in host memory too, :attr:`offload_params`)."""

    def __init__(self, groups: list[dict], build, masters: bool = False, mode: str = "optimizer"):
        self.segs: list[nn.Parameter] = [p for g in groups for p in g["params"]]
        self.host_device = HOST
        self.masters, self.offload_params = masters, mode == "params"
        pin = bool(self.segs) and self.segs[0].device.type != "cpu" and torch.cuda.is_available()
        self.host: dict[int, nn.Parameter] = {}
        self.grads: dict[int, torch.Tensor] = {}
        for p in self.segs:
            h = torch.empty(p.shape, dtype=torch.float32, pin_memory=pin)
            h.copy_(p.detach())
            if masters:
                p.data = h   # the master lives on the host: the segment is a view of it
            self.host[id(p)] = nn.Parameter(h)
            self.grads[id(p)] = torch.zeros(p.shape, dtype=torch.float32, pin_memory=pin)
        self.inner = build([{**g, "params": [self.host[id(p)] for p in g["params"]]} for g in groups])
        self.state = _HostState(self)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @torch.no_grad()
    def step(self) -> None:
        """Gradients down, the step on the host, an fp32 model's updated slices back up."""
        for p in self.segs:
            h, g = self.host[id(p)], segment_grad(p)
            if g is None:
                h.grad = None
                continue
            buf = self.grads[id(p)]
            buf.copy_(g.reshape(buf.shape))
            h.grad = buf
        self.inner.step()
        for p in self.segs:
            if not self.masters:
                p.data.copy_(self.host[id(p)].data, non_blocking=True)
            self.host[id(p)].grad = None
        if self.segs and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()   # the copies back land before the all-gathers

    @torch.no_grad()
    def reload(self) -> None:
        """Copy the device slices into the host copies (after a checkpoint restored them;
        nothing to copy where the slices are the host masters)."""
        for p in self.segs:
            if not self.masters:
                self.host[id(p)].data.copy_(p.data)

    def state_bytes(self) -> int:
        """Bytes of the optimizer's states (moments), all on the host."""
        return sum(t.numel() * t.element_size() for st in self.inner.state.values()
                   for t in st.values() if torch.is_tensor(t) and t.dim() > 0)

    def master_bytes(self) -> int:
        """Bytes of the device slices whose storage is their host copy's (a 16-bit model's
        fp32 masters, ``masters``): what left the device for host memory."""
        return sum(p.numel() * p.element_size() for p in self.segs
                   if p.data.untyped_storage().data_ptr() == self.host[id(p)].untyped_storage().data_ptr())

    def host_bytes(self) -> int:
        """Bytes this optimizer keeps in host memory: its states, the fp32 copies of the
        slices it steps (the master weights) and the fp32 gradient buffers, the plan's
        ``host`` without the parameter shard (:func:`parcompile.analysis.offload.offload_states`)."""
        return self.state_bytes() + sum(2 * h.numel() * h.element_size() for h in self.host.values())


def offload_optimizer(opt, build, mode: str = "optimizer") -> None:
    """Step a :class:`~parcompile.runtime.train.zero.ShardedOptimizer` ``opt`` on the host:
    its torch optimizer replaced by a :class:`HostOptimizer` over the same groups, built by
    ``build``; ``mode`` (``parallel.offload``): ``"params"`` (zero 3) also keeps the
    parameter shard in host memory (module docstring): an fp32 model's segments and
    padding move there, a 16-bit model's low-precision slices are kept there from now on
    (``opt.offload``, which :meth:`~parcompile.runtime.train.zero_gather.ParamGather._keep_low_shards`
    reads)."""
    opt.offload = mode
    if mode == "params" and not opt.mixed:
        with torch.no_grad():
            for *_, seg in opt.segments + opt.padding:
                seg.data = seg.data.to(HOST)
    opt.optimizer = HostOptimizer([{k: v for k, v in g.items()} for g in opt.optimizer.param_groups], build,
                                  masters=opt.mixed, mode=mode)
    if mode == "params" and opt.low_shards is not None:
        opt._keep_low_shards()   # the 16-bit shard, now in host memory


def split_host_bytes(optimizer, out: dict[str, int], shard: int = 0) -> dict[str, int]:
    """``out`` (a rank's ``params``, ``grads``, ``optimizer`` bytes, as
    :meth:`~parcompile.runtime.train.zero_states.ShardStates.state_bytes` counts them, the
    ZeRO-3 parameter shard's ``shard`` bytes in ``params``, a 16-bit model's fp32 masters in
    ``optimizer``) with what a :class:`HostOptimizer` keeps in host memory moved to
    ``host`` (module docstring): the states, and the masters that are its host copies
    (:meth:`HostOptimizer.master_bytes`, found by their storage); its host copies and
    gradient buffers; with ``offload = params`` the shard, which
    :func:`offload_optimizer` allocates on :data:`HOST`. Unchanged without offload. (On the
    CPU the host is the device: the placement is what the program allocates there, the
    plan's :func:`~parcompile.analysis.offload.offload_states`.)"""
    if not isinstance(optimizer, HostOptimizer):
        return out
    moved = {**out, "optimizer": out["optimizer"] - optimizer.state_bytes() - optimizer.master_bytes(),
             "host": optimizer.host_bytes()}
    if optimizer.offload_params:
        moved["params"] -= shard
        moved["host"] += shard
    return moved


__all__ = ["HOST", "HostOptimizer", "offload_optimizer", "split_host_bytes"]
