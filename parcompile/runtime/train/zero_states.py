"""What :class:`parcompile.runtime.train.zero.ShardedOptimizer` writes and reads outside the
step (:class:`ShardStates`, a part of it): the full gradients for ``verify``'s dump, the
optimizer states gathered into their parameters' layout for checkpoints and restored into
any sharding, and the bytes a rank holds, as the plan's
:class:`~parcompile.core.data_parallel.DataParallelSharding` shards them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parcompile.runtime.train.buckets import BucketLayout, local_numel
from parcompile.runtime.train.grads import main_grad, set_main_grad
from parcompile.runtime.train.offload import split_host_bytes
from parcompile.runtime.train.optim import shards


class ShardStates:
    """Checkpoints, gradient dumps and measurements of
    :class:`parcompile.runtime.train.zero.ShardedOptimizer` (module docstring), reading its
    layout (``buckets``, ``segments``, ``padding``), its torch ``optimizer`` and its
    ``sharding``."""

    def dump_gradients(self) -> dict:
        """The data-parallel-averaged full gradients with their layout (verify's first-step
        dump), rebuilt by all-gathers that are not counted as the step's traffic."""
        saved = [main_grad(p) for p in self.params]
        self.full_gradients()
        out = shards(self.model, self.ctx, grads=True)
        for p, g in zip(self.params, saved):
            set_main_grad(p, g)
        return out

    def full_gradients(self) -> None:
        """Set every parameter's gradient to the full data-parallel-averaged gradient,
        all-gathered (not counted as step traffic) from the owned slices."""

        def fill(b: BucketLayout, mine: torch.Tensor) -> None:
            mine.copy_(self._grad_shards[b.index])

        for b, full in zip(self.buckets.buckets, self._gather(fill, torch.float32, counted=False)):
            for p, off in zip(b.params, b.offsets):
                shape = getattr(p, "global_local_shape", tuple(p.shape))
                set_main_grad(p, full[off:off + local_numel(p)].view(shape).clone())

    # -- checkpoints ----------------------------------------------------------------------
    def export_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """Optimizer states gathered into their parameter's layout, by ``id(param)`` (an
        all-gather per state and bucket over dp_cp, not counted as step traffic)."""
        d = self.axis.size
        keys = sorted({k for *_, seg in self.segments for k, v in self.optimizer.state.get(seg, {}).items()
                       if torch.is_tensor(v) and v.dim() > 0})
        if self.mixed:
            keys.append("master")
        if dist.is_initialized() and self.axis.group is not None:   # every rank needs the same keys
            found = [None] * d
            dist.all_gather_object(found, keys, group=self.axis.group)
            keys = sorted(set().union(*map(set, found)))
        out: dict[int, dict[str, torch.Tensor]] = {id(p): {} for p in self.params}
        for key in keys:
            def fill(b: BucketLayout, mine: torch.Tensor, key=key) -> None:
                lo_own = self._own_lo(b)
                for p, lo, hi, seg in self._segments_of(b):
                    v = seg.data if key == "master" else self.optimizer.state.get(seg, {}).get(key)
                    if v is not None:
                        mine[lo - lo_own:hi - lo_own] = v.reshape(-1).float()

            for b, full in zip(self.buckets.buckets, self._gather(fill, torch.float32, counted=False)):
                for p, off in zip(b.params, b.offsets):
                    shape = getattr(p, "global_local_shape", tuple(p.shape))
                    out[id(p)][key] = full[off:off + local_numel(p)].view(shape).clone()
        return out

    def import_states(self, states: dict[int, dict[str, torch.Tensor]], step: int) -> None:
        """Restore the owned slices of what :meth:`export_states` wrote (any sharding)."""
        with torch.no_grad():
            for b, p, lo, hi, seg in self.segments:
                off = self.buckets.offset_of[id(p)]
                st = states.get(id(p), {})
                part = slice(lo - off, hi - off)
                if "master" in st:
                    seg.data.copy_(st["master"].reshape(-1)[part])
                elif self.mixed or self.sharding.shards_parameters:
                    seg.data.copy_(p.data.reshape(-1)[part].float())
                rest = {k: v.reshape(-1)[part].clone() for k, v in st.items() if k != "master"}
                if rest:
                    self.optimizer.state[seg] = {"step": torch.tensor(float(step)), **rest}
        getattr(self.optimizer, "reload", lambda: None)()   # offloaded: the host copies too
        if self.sharding.shards_parameters:
            self._keep_low_shards()
            self._free_params()

    # -- measurement ----------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: parameters, gradients, optimizer states, and
        with ``parallel.offload`` what it keeps in host memory (``host``,
        :func:`~parcompile.runtime.train.offload.split_host_bytes`)."""
        params = sum(p.data.numel() * p.element_size() for p in self.params)
        segs = sum(seg.numel() * seg.element_size() for *_, seg in self.segments)
        segs += sum(pad.numel() * pad.element_size() for *_, pad in self.padding)
        if self.low_shards is not None:         # zero 3, 16-bit: the kept 16-bit slices
            shard = sum(t.numel() * t.element_size() for t in self.low_shards)
        else:                                   # zero 3, fp32: the segments are the shard
            shard = segs if self.sharding.shards_parameters and not self.mixed else 0
        masters = segs if self.mixed else 0     # fp32 master slices: an optimizer state
        grads = self.buckets.buffer_bytes()   # zero 1: the full (padded) buffers; 2, 3: none
        grads += sum(g.numel() * g.element_size() for g in self._grad_shards or [])
        optimizer = masters + sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                                  for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
        return split_host_bytes(self.optimizer, {"params": params + shard, "grads": grads, "optimizer": optimizer},
                                shard=shard)


__all__ = ["ShardStates"]
