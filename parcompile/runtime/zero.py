"""ZeRO over the data-parallel group (Rajbhandari et al. 2020; Megatron-LM's distributed
optimizer; torchtitan's FSDP + PP shape: parameters stay gathered across the
micro-batches of a step).

A pipeline stage's parameters, in module order, form one flat buffer of N elements,
padded to ``S * d`` with ``S = ceil(N / d)`` over the ``dp_cp`` group of d ranks; rank i
owns elements ``[i S, (i + 1) S)``. One step:

1. the backward accumulates full gradients (fp32) into ``p.grad`` over the micro-batches;
2. one reduce-scatter of the flat gradient gives each rank the sum of its shard (divided
   by d, the data-parallel average);
3. the gradient norm is summed over the shards (all-reduce over dp_cp, then tp and pp);
4. the optimizer updates the owned shard only: its states are ``S`` elements;
5. one all-gather of the updated shards rebuilds the parameters.

Stages: ``zero = 1`` keeps full gradients and parameters between steps; ``zero = 2``
frees the full gradients after the reduce-scatter (only the shard's gradient is kept);
``zero = 3`` also frees the full parameters after the update and all-gathers them at the
start of the next step (the one all-gather of the step moves from its end to its start).
The collectives are the plan's ``grads`` reduce-scatter and ``params`` all-gather
(``comm.collectives``), one each per step.

fp32 models update their parameters in place through views (no master copy); the
optimizer's states are then 8 bytes per owned element (Adam), as SPEC accounts.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from parcompile.runtime.comm import COUNTER, _nbytes, all_reduce
from parcompile.runtime.context import ParallelContext
from parcompile.runtime.grads import enable_main_grads, main_grad, set_main_grad


class ShardedOptimizer:
    """The optimizer of a stage under ``zero`` 1, 2 or 3 (see module docstring).

    ``make_optimizer(groups)`` builds the torch optimizer from parameter groups
    (``[{"params": [...], "weight_decay": wd}, ...]``); the groups hold this rank's
    segments of the parameters (one segment per parameter that overlaps the shard), so
    the update of every element equals the unsharded optimizer's.
    """

    def __init__(self, model: nn.Module, ctx: ParallelContext, zero: int, weight_decay: float,
                 make_optimizer):
        self.model, self.ctx, self.zero = model, ctx, zero
        self.axis = ctx.axes["dp_cp"]
        self.params = [p for p in model.parameters()]
        enable_main_grads(model)
        from parcompile.runtime.train import _scaler_for

        self.scaler = _scaler_for(self.params)
        self.mixed = self.params[0].dtype != torch.float32
        self.numels = [p.numel() for p in self.params]
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        total = self.offsets[-1]
        d = self.axis.size
        self.shard = math.ceil(total / d)
        lo_own, hi_own = self.axis.index * self.shard, (self.axis.index + 1) * self.shard
        self.segments: list[tuple[nn.Parameter, int, int, nn.Parameter]] = []  # (param, lo, hi, segment)
        decay, no_decay = [], []
        for p, off, n in zip(self.params, self.offsets, self.numels):
            lo, hi = max(off, lo_own), min(off + n, hi_own)
            if lo >= hi:
                continue
            flat = p.data.view(-1)[lo - off:hi - off]
            # fp32: a view of the parameter (zero 3: its own copy); 16-bit: an fp32 master copy
            seg = nn.Parameter(flat.float().clone() if (zero == 3 or self.mixed) else flat)
            seg.counts_in_norm = not getattr(p, "tied_copy", False) and (
                getattr(p, "shard_dim", None) is not None or ctx.tp.index == 0)
            self.segments.append((p, lo, hi, seg))
            (decay if p.ndim >= 2 else no_decay).append(seg)
        self.optimizer = make_optimizer([{"params": decay, "weight_decay": weight_decay},
                                         {"params": no_decay, "weight_decay": 0.0}])
        self._own = (lo_own, hi_own)
        self._grad_shard = None
        if zero == 3:
            self._free_params()

    # -- the step -------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
            set_main_grad(p, None)
        for *_, seg in self.segments:
            seg.grad = None
        self._grad_shard = None

    def begin_step(self) -> None:
        """Before the first forward of a step: rebuild full parameters (zero 3)."""
        if self.zero == 3:
            self._all_gather_params()

    def reduce_gradients(self) -> None:
        """Reduce-scatter the flat gradient; attach the owned shard to the segments."""
        d = self.axis.size
        flat = torch.zeros(self.shard * d, dtype=torch.float32, device=self.ctx.device)
        for p, off, n in zip(self.params, self.offsets, self.numels):
            if main_grad(p) is not None:
                flat[off:off + n] = main_grad(p).reshape(-1).float()
        out = torch.empty(self.shard, dtype=torch.float32, device=self.ctx.device)
        COUNTER.record("reduce_scatter", self.axis.name, _nbytes(out))
        dist.reduce_scatter_tensor(out, flat, group=self.axis.group)
        out /= d
        del flat
        lo_own = self._own[0]
        for p, lo, hi, seg in self.segments:
            seg.grad = out[lo - lo_own:hi - lo_own].view_as(seg)
        self._grad_shard = out
        if self.zero >= 2:
            for p in self.params:
                set_main_grad(p, None)

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before the backward (fp16; 1 otherwise)."""
        return self.scaler.scale if self.scaler else 1.0

    def unscale(self) -> bool:
        """Unscale the owned gradient shard; False (step skipped) when a rank overflowed."""
        from parcompile.runtime.train import _unscale

        def drop():
            self.zero_grad()
            if self.zero == 3:
                self._free_params()

        return _unscale(self.scaler, [self._grad_shard], self.ctx, drop)

    def grad_norm(self) -> torch.Tensor:
        """Global gradient norm from the shards: all-reduce over dp_cp, then tp and pp."""
        sq = torch.zeros(1, dtype=torch.float32, device=self.ctx.device)
        for _, _, _, seg in self.segments:
            if seg.counts_in_norm:
                sq += seg.grad.float().pow(2).sum()
        all_reduce(sq, self.axis)
        all_reduce(sq, self.ctx.tp)
        all_reduce(sq, self.ctx.pp)
        return sq.sqrt()[0]

    def clip(self, norm: torch.Tensor, max_norm: float) -> None:
        if max_norm and max_norm > 0:
            coef = float(max_norm) / (float(norm) + 1e-6)
            if coef < 1.0:
                self._grad_shard.mul_(coef)

    def step(self) -> None:
        """Update the owned shard, then rebuild the parameters (zero 1, 2) or free them (3)."""
        self.optimizer.step()
        for *_, seg in self.segments:
            seg.grad = None
        if self.zero < 2:
            self._grad_shard = None   # zero 1 keeps full gradients; the shard was a scratch copy
        if self.zero == 3:
            self._free_params()
        else:
            self._all_gather_params()

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    # -- parameters -----------------------------------------------------------------------
    def _all_gather_params(self) -> None:
        d = self.axis.size
        dtype = self.params[0].dtype
        mine = torch.zeros(self.shard, dtype=dtype, device=self.ctx.device)
        lo_own = self._own[0]
        for _, lo, hi, seg in self.segments:
            mine[lo - lo_own:hi - lo_own] = seg.data.view(-1).to(dtype)
        full = torch.empty(self.shard * d, dtype=dtype, device=self.ctx.device)
        COUNTER.record("all_gather", self.axis.name, _nbytes(full))
        dist.all_gather_into_tensor(full, mine, group=self.axis.group)
        for p, off, n in zip(self.params, self.offsets, self.numels):
            if p.data.numel() != n:
                p.data = torch.empty(p.global_local_shape, dtype=dtype, device=self.ctx.device)
            p.data.view(-1).copy_(full[off:off + n])

    def _free_params(self) -> None:
        for p in self.params:
            if not hasattr(p, "global_local_shape"):
                p.global_local_shape = tuple(p.shape)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def gather_for_export(self) -> None:
        """Rebuild full parameters outside the measured step (checkpoints, verify dumps)."""
        if self.zero == 3 and self.params[0].data.numel() == 0:
            enabled, COUNTER.enabled = COUNTER.enabled, False
            try:
                self._all_gather_params()
            finally:
                COUNTER.enabled = enabled

    def dump_gradients(self) -> dict:
        """The data-parallel-averaged full gradients with their layout (verify's first-step
        dump), rebuilt by an all-gather that is not counted as the step's traffic."""
        from parcompile.runtime.train import shards

        saved = [main_grad(p) for p in self.params]
        self._full_gradients()
        out = shards(self.model, self.ctx, grads=True)
        for p, g in zip(self.params, saved):
            set_main_grad(p, g)
        return out

    def _full_gradients(self) -> None:
        d = self.axis.size
        enabled, COUNTER.enabled = COUNTER.enabled, False
        try:
            full = torch.empty(self.shard * d, dtype=torch.float32, device=self.ctx.device)
            dist.all_gather_into_tensor(full, self._grad_shard.contiguous(), group=self.axis.group)
        finally:
            COUNTER.enabled = enabled
        for p, off, n in zip(self.params, self.offsets, self.numels):
            shape = getattr(p, "global_local_shape", tuple(p.shape))
            set_main_grad(p, full[off:off + n].view(shape).clone())

    # -- checkpoints ----------------------------------------------------------------------
    def export_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """Optimizer states gathered into their parameter's layout, by ``id(param)`` (an
        all-gather per state over dp_cp, not counted as step traffic)."""
        d, lo_own = self.axis.size, self._own[0]
        keys = sorted({k for *_, seg in self.segments for k, v in self.optimizer.state.get(seg, {}).items()
                       if torch.is_tensor(v) and v.dim() > 0})
        if self.mixed:
            keys.append("master")
        if dist.is_initialized() and self.axis.group is not None:   # every rank needs the same keys
            found = [None] * d
            dist.all_gather_object(found, keys, group=self.axis.group)
            keys = sorted(set().union(*map(set, found)))
        out: dict[int, dict[str, torch.Tensor]] = {id(p): {} for p in self.params}
        enabled, COUNTER.enabled = COUNTER.enabled, False
        try:
            for key in keys:
                mine = torch.zeros(self.shard, dtype=torch.float32, device=self.ctx.device)
                for _, lo, hi, seg in self.segments:
                    v = seg.data if key == "master" else self.optimizer.state.get(seg, {}).get(key)
                    if v is not None:
                        mine[lo - lo_own:hi - lo_own] = v.reshape(-1).float()
                full = torch.empty(self.shard * d, dtype=torch.float32, device=self.ctx.device)
                dist.all_gather_into_tensor(full, mine, group=self.axis.group)
                for p, off, n in zip(self.params, self.offsets, self.numels):
                    shape = getattr(p, "global_local_shape", tuple(p.shape))
                    out[id(p)][key] = full[off:off + n].view(shape).clone()
        finally:
            COUNTER.enabled = enabled
        return out

    def import_states(self, states: dict[int, dict[str, torch.Tensor]], step: int) -> None:
        """Restore the owned slices of what :meth:`export_states` wrote (any sharding)."""
        with torch.no_grad():
            for p, lo, hi, seg in self.segments:
                off = self.offsets[self.params.index(p)]
                st = states.get(id(p), {})
                part = slice(lo - off, hi - off)
                if "master" in st:
                    seg.data.copy_(st["master"].reshape(-1)[part])
                elif self.mixed or self.zero == 3:
                    seg.data.copy_(p.data.reshape(-1)[part].float())
                rest = {k: v.reshape(-1)[part].clone() for k, v in st.items() if k != "master"}
                if rest:
                    self.optimizer.state[seg] = {"step": torch.tensor(float(step)), **rest}
        if self.zero == 3:
            self._free_params()

    # -- measurement ----------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: parameters, gradients, optimizer states."""
        params = sum(p.data.numel() * p.element_size() for p in self.params)
        segs = sum(seg.numel() * seg.element_size() for *_, seg in self.segments)
        if self.mixed:
            masters = segs                      # fp32 master shard: an optimizer state
        else:
            masters, params = 0, params + (segs if self.zero == 3 else 0)
        grads = sum(main_grad(p).numel() * main_grad(p).element_size()
                    for p in self.params if main_grad(p) is not None)
        if self._grad_shard is not None:
            grads += self._grad_shard.numel() * self._grad_shard.element_size()
        optimizer = masters + sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                                  for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": optimizer}
