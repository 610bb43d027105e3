"""The FP8 training checks of a spec (SPEC `train.precision = fp8` and its keys): the
cluster's FP8 GEMMs and the recipe's keys (:func:`check_fp8`), the layers kept in 16 bits
(:func:`check_fp8_bf16_layers`). Run by the train check of :mod:`parcompile.frontend.checks`.
"""

from __future__ import annotations


from parcompile.config.presets import fp8_peak, fp8_presets
from parcompile.config.schema import SpecConfig
from parcompile.config.text import or_list
from parcompile.frontend.check_context import CheckContext


def check_fp8(cfg: SpecConfig, ctx: CheckContext) -> None:
    """`train.precision = fp8` and its keys (SPEC `train`): the cluster must have the recipe's
    FP8 GEMMs (:func:`parcompile.config.presets.fp8_peak`); `fp8_recipe` and `fp8_all_gather`
    do nothing without FP8; FP8 all-gather needs ZeRO-3 and the tensorwise recipe."""
    t, c, p = cfg.train, cfg.cluster, cfg.parallel
    if t.precision != "fp8":
        for key in ("fp8_recipe", "fp8_all_gather", "fp8_bf16_layers_start", "fp8_bf16_layers_end"):
            if ctx.given(f"train.{key}") and ctx.ok(f"train.{key}", "train.precision"):
                ctx.bag.warning(f"{key} has no effect with precision = {t.precision}", ctx.span(f"train.{key}"),
                                help=f"set `precision = fp8`, or remove `{key}`")
        return
    if not ctx.ok("train.precision", "train.fp8_recipe"):
        return
    if fp8_peak(c.preset, t.fp8_recipe) is None:
        have = fp8_presets(t.fp8_recipe)
        recipe = "MXFP8" if t.fp8_recipe == "mxfp8" else "FP8"
        where = f"cluster preset `{c.preset}` has no {recipe} GEMM peak" if c.preset else \
            f"a cluster without a preset has no {recipe} GEMM peak"
        key = "train.fp8_recipe" if t.fp8_recipe == "mxfp8" and ctx.given("train.fp8_recipe") else "train.precision"
        ctx.bag.error(f"{'fp8_recipe = mxfp8' if key == 'train.fp8_recipe' else 'precision = fp8'} needs "
                      f"{recipe} tensor cores: {where}", ctx.span(key),
                      help=f"use a cluster `from` {or_list(have, quote=True)}"
                           + (", or fp8_recipe = tensorwise or rowwise" if t.fp8_recipe == "mxfp8" else "")
                           + ", or remove `precision`",
                      note="the presets' FP8 and MXFP8 peaks are their datasheets' (config/presets.py)")
    if t.fp8_all_gather and ctx.ok("train.fp8_all_gather"):
        if t.fp8_recipe == "rowwise":
            ctx.bag.error("fp8_all_gather = true needs fp8_recipe = tensorwise or mxfp8",
                          ctx.span("train.fp8_all_gather"),
                          help="set `fp8_recipe = tensorwise`, or remove `fp8_all_gather`",
                          note="torchao gathers FP8 weights with one scale per tensor only; with rowwise scaling "
                               "all communication is in 16 bits (torchtitan docs/float8.md)")
        elif p.zero < 3 and "zero" not in p.auto and ctx.ok("parallel.zero"):
            ctx.bag.warning(f"fp8_all_gather has no effect with zero = {p.zero}: only ZeRO-3 all-gathers "
                            "parameters", ctx.span("train.fp8_all_gather"),
                            help="set `zero = 3` in `parallel`, or remove `fp8_all_gather`")


def check_fp8_bf16_layers(cfg: SpecConfig, ctx: CheckContext) -> None:
    """`train.fp8_bf16_layers_start` / `_end` (SPEC `train`, ir/fp8.py ``bf16_layers``):
    each at most `model.layers` (an error: there are no more layers to keep); together
    covering every layer is a warning (no GEMM left in FP8). Megatron-Core's own bound, at
    most the layers of one pipeline stage each, is the megatron export's
    (export/megatron.py)."""
    t, layers = cfg.train, cfg.model.layers
    if t.precision != "fp8" or not ctx.ok("train.precision", "model.layers"):
        return
    keys = [k for k in ("fp8_bf16_layers_start", "fp8_bf16_layers_end") if ctx.ok(f"train.{k}")]
    bad = False
    for key in keys:
        n = getattr(t, key)
        if n > layers:
            bad = True
            ctx.bag.error(f"{key} = {n} exceeds the model's {layers} layers", ctx.span(f"train.{key}"),
                          help=f"keep at most {layers} layers in 16 bits, or remove `{key}`")
    given = [k for k in keys if ctx.given(f"train.{k}")]
    if not bad and len(keys) == 2 and given and t.fp8_bf16_layers_start + t.fp8_bf16_layers_end >= layers:
        ctx.bag.warning(f"fp8_bf16_layers_start + fp8_bf16_layers_end = "
                        f"{t.fp8_bf16_layers_start + t.fp8_bf16_layers_end} keeps all {layers} layers in 16 bits: "
                        "no GEMM runs in FP8", ctx.span(f"train.{given[0]}"),
                        help="lower them, or remove `precision = fp8`")
