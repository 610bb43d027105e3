"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision
Training"; the defaults of Megatron-LM's DynamicGradScaler).

fp16 has 5 exponent bits: small gradients underflow to zero. The loss is multiplied by
``scale`` before the backward, so every gradient (and every gradient sent between
pipeline stages) is scaled too; the fp32 main gradients are divided by ``scale`` before
clipping and the update. If any gradient on any rank is inf or NaN the step is skipped
and the scale halves; after ``growth_interval`` clean steps it doubles. Whether a rank
overflowed is agreed with a max all-reduce over tp, pp and dp_cp (which together span
every rank); the plan lists them as ``found_inf``.
"""

from __future__ import annotations

import torch

from parcompile.core.axes import FOUND_INF_AXES
from parcompile.runtime.distributed.comm import all_reduce
from parcompile.runtime.distributed.context import ParallelContext


class DynamicLossScaler:
    """The scale, and the rule that changes it (module docstring)."""

    def __init__(self, initial: float = 2.0 ** 16, growth_interval: int = 1000, minimum: float = 1.0):
        self.scale = float(initial)
        self.growth_interval = growth_interval
        self.minimum = minimum
        self.good_steps = 0
        self.skipped = 0   # steps skipped for an overflow (the optimizer did not step)

    def found_inf(self, grads: list[torch.Tensor], ctx: ParallelContext) -> bool:
        """True when any gradient of any rank is not finite (all ranks agree)."""
        bad = torch.zeros(1, dtype=torch.float32, device=ctx.device)
        for g in grads:
            if g is not None and not torch.isfinite(g).all():
                bad.fill_(1.0)
                break
        for axis in FOUND_INF_AXES:
            all_reduce(bad, ctx.axes[axis], "max")
        return bool(bad.item())

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale / 2, self.minimum)
            self.good_steps = 0
            self.skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps so a resumed run scales and steps as an uninterrupted one."""
        return {"loss_scale": torch.tensor(self.scale, dtype=torch.float64),
                "good_steps": torch.tensor(self.good_steps, dtype=torch.int64),
                "skipped_steps": torch.tensor(self.skipped, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.scale = float(state["loss_scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state["skipped_steps"])
