"""CPU offload of the optimizer (``parallel.offload``, :mod:`parcompile.analysis.offload`):
:class:`HostOptimizer` keeps the optimizer's states beside host copies of the rank's owned
parameter slices and steps them there, as DeepSpeed's ZeRO-Offload (``offload_optimizer``,
``DeepSpeedCPUAdam``) and FSDP2's ``CPUOffloadPolicy`` do; :func:`offload_optimizer` puts it
under a sharded optimizer.

One step: each owned slice's gradient (the rank's fp32 gradient shard, after the clipping)
is copied into a persistent fp32 host buffer, the torch optimizer steps the host copies
(its states live only there), and the updated values are copied back into the device
slices, which the all-gathers and the forward read. Host buffers are pinned where the
device is an accelerator (page-locked, for asynchronous copies); on the CPU they are
separate buffers in the same memory, so a CPU run is bit-for-bit the run without offload:
the same fp32 values go through the same optimizer kernel (``make_optimizer``'s fused
AdamW on the CPU).
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
import torch.nn as nn


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
    optimizer (module docstring)."""

    def __init__(self, groups: list[dict], build):
        self.segs: list[nn.Parameter] = [p for g in groups for p in g["params"]]
        self.host_device = torch.device("cpu")
        pin = bool(self.segs) and self.segs[0].device.type != "cpu" and torch.cuda.is_available()
        self.host: dict[int, nn.Parameter] = {}
        self.grads: dict[int, torch.Tensor] = {}
        for p in self.segs:
            h = torch.empty(p.shape, dtype=torch.float32, pin_memory=pin)
            h.copy_(p.detach())
            self.host[id(p)] = nn.Parameter(h)
            self.grads[id(p)] = torch.zeros(p.shape, dtype=torch.float32, pin_memory=pin)
        self.inner = build([{**g, "params": [self.host[id(p)] for p in g["params"]]} for g in groups])
        self.state = _HostState(self)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @torch.no_grad()
    def step(self) -> None:
        """Gradients down, the step on the host, the updated slices back up."""
        for p in self.segs:
            h = self.host[id(p)]
            if p.grad is None:
                h.grad = None
                continue
            buf = self.grads[id(p)]
            buf.copy_(p.grad.reshape(buf.shape))
            h.grad = buf
        self.inner.step()
        for p in self.segs:
            p.data.copy_(self.host[id(p)].data, non_blocking=True)
            self.host[id(p)].grad = None
        if self.segs and self.segs[0].device.type == "cuda":
            torch.cuda.current_stream().synchronize()   # the copies back land before the all-gathers

    @torch.no_grad()
    def reload(self) -> None:
        """Copy the device slices into the host copies (after a checkpoint restored them)."""
        for p in self.segs:
            self.host[id(p)].data.copy_(p.data)

    def state_bytes(self) -> int:
        """Bytes of the optimizer's states (moments), all on the host."""
        return sum(t.numel() * t.element_size() for st in self.inner.state.values()
                   for t in st.values() if torch.is_tensor(t) and t.dim() > 0)

    def host_bytes(self) -> int:
        """Bytes this optimizer keeps in host memory: its states, the fp32 copies of the
        slices it steps (the master weights) and the fp32 gradient buffers, the plan's
        ``host`` (:func:`parcompile.analysis.offload.offload_states`)."""
        return self.state_bytes() + sum(2 * h.numel() * h.element_size() for h in self.host.values())


def offload_optimizer(opt, build) -> None:
    """Step a :class:`~parcompile.runtime.train.zero.ShardedOptimizer` ``opt`` on the host:
    its torch optimizer replaced by a :class:`HostOptimizer` over the same groups, built by
    ``build``."""
    opt.optimizer = HostOptimizer([{k: v for k, v in g.items()} for g in opt.optimizer.param_groups], build)


def split_host_bytes(optimizer, out: dict[str, int]) -> dict[str, int]:
    """``out`` (a rank's ``params``, ``grads``, ``optimizer`` bytes, as
    :meth:`~parcompile.runtime.train.zero_states.ShardStates.state_bytes` counts them) with
    a :class:`HostOptimizer`'s states moved from ``optimizer`` to ``host`` (with its other
    host buffers); unchanged otherwise. A 16-bit model's fp32 master slices stay on the
    device too (the slices the step copies back), counted in ``optimizer``."""
    if not isinstance(optimizer, HostOptimizer):
        return out
    return {**out, "optimizer": out["optimizer"] - optimizer.state_bytes(), "host": optimizer.host_bytes()}


__all__ = ["HostOptimizer", "offload_optimizer", "split_host_bytes"]
