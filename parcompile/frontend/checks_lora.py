"""The LoRA checks of a spec (SPEC "New names": ``train.method = lora`` and its keys),
run by the train check of :mod:`parcompile.frontend.checks`. What a target is and how
adapters split over tp is :mod:`parcompile.core.lora`'s.
"""

from __future__ import annotations

from parcompile.config.schema import SpecConfig
from parcompile.config.text import or_list
from parcompile.core.lora import ALL_LINEAR, lora_linears, target_names, targeted, unknown_targets
from parcompile.frontend.check_context import CheckContext

#: the keys that mean something only with ``method = lora``
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "lora_merge")


def check_lora(cfg: SpecConfig, ctx: CheckContext) -> None:
    """``train.method`` and the ``lora_*`` keys: a ``lora_*`` key with ``method = full`` is
    an error (the spec would train every weight, not the adapters it describes); under
    ``method = lora`` the targets must name linear layers the model has, the rank must
    be at most the smallest side of a targeted weight (a larger one is no longer low rank:
    ``r (in + out)`` exceeds ``in * out``) and a multiple of tp (Megatron-Bridge splits A
    and B over tp: :mod:`parcompile.core.lora`)."""
    t = cfg.train
    if not ctx.ok("train.method"):
        return
    if t.method != "lora":
        for key in LORA_KEYS:
            if ctx.given(f"train.{key}"):
                ctx.bag.error(f"{key} needs method = lora; this spec has method = {t.method}",
                              ctx.span(f"train.{key}"),
                              help=f"add `method = lora` to `train` to train adapters, or remove `{key}`")
        return
    if not ctx.ok("train.lora_targets") or not ctx.ok("model.hidden", "model.layers", "model.heads"):
        return
    model = cfg.model
    if not lora_linears(model):
        ctx.bag.error("method = lora: the model has no linear layer an adapter can take",
                      ctx.span("train.method"), help="use method = full")
        return
    unknown = unknown_targets(model, t.lora_targets)
    if unknown or not t.lora_targets:
        names = sorted(target_names(model))
        what = (f"lora_targets names {or_list(unknown, quote=True)}, which the model does not have" if unknown
                else "lora_targets is empty")
        ctx.bag.error(what, ctx.span("train.lora_targets"),
                      help=f'use "{ALL_LINEAR}" or some of {", ".join(names)}')
        return
    if not ctx.ok("train.lora_rank"):
        return
    _check_rank(cfg, ctx)


def _check_rank(cfg: SpecConfig, ctx: CheckContext) -> None:
    """``lora_rank`` against the targeted weights and tp (:func:`check_lora`)."""
    t, tp = cfg.train, cfg.parallel.tp
    lins = targeted(cfg.model, t.lora_targets)
    smallest = min(lins, key=lambda lin: min(lin.in_features, lin.out_features))
    side = min(smallest.in_features, smallest.out_features)
    if t.lora_rank > side:
        ctx.bag.error(f"lora_rank = {t.lora_rank} exceeds {side}, the smaller side of {smallest.leaf} "
                      f"({smallest.out_features} x {smallest.in_features})", ctx.span("train.lora_rank"),
                      help=f"use a rank of at most {side} (LoRA's rank is far below the hidden size: 8 to 64 is usual)")
        return
    if isinstance(tp, int) and ctx.ok("parallel.tp") and t.lora_rank % tp:
        ctx.bag.error(f"lora_rank = {t.lora_rank} is not a multiple of tp = {tp}", ctx.span("train.lora_rank"),
                      help=f"use a multiple of {tp}",
                      note="the adapters' A and B split over tp along the rank as Megatron-Bridge's "
                           "ParallelLinearAdapter splits them")
