"""The checks of ``parallel.recompute`` as a list of Megatron-Core modules and of
``parallel.grad_dtype`` (SPEC 1, `parallel`; :mod:`parcompile.core.recompute`).

:func:`convert_module_list` reads the list itself (each name known, given once, no mode
inside it); :func:`check_recompute` holds the list against the model (a module the model
lacks is an error, as Megatron-Core's ``TransformerConfig.__post_init__`` refuses
``mla_up_proj`` without MLA; one that recomputes nothing in this model is a warning);
:func:`check_grad_dtype` the gradient dtype against the model's dtype.
"""

from __future__ import annotations

from typing import Any

from parcompile.config.schema import SpecConfig
from parcompile.config.text import did_you_mean, or_list
from parcompile.core.model import moe_layer
from parcompile.core.recompute import is_module_list
from parcompile.diagnostics import DiagnosticBag
from parcompile.frontend.check_context import CheckContext

_EXAMPLE = "[moe_act, layernorm]"


def convert_module_list(bag: DiagnosticBag, key: str, modes: tuple, modules: tuple[str, ...], v: Any
                        ) -> tuple[str, ...] | None:
    """``recompute = [m, ...]`` (an ``ast.List``) as a tuple of module names in the order
    written, or None after reporting each bad entry: not a name, an unknown name (with the
    nearest one), a mode (``full``, ``selective``, ``none``: a list is selective
    recomputation of the modules it names), a name given twice, an empty list."""
    if not v.items:
        bag.error(f"{key} = [] names no module", v.span,
                  help=f"write `{key} = none`, or name modules, e.g. `{key} = {_EXAMPLE}`")
        return None
    out: list[str] = []
    ok = True
    for item in v.items:
        word = getattr(item, "value", None)
        if not isinstance(word, str):
            bag.error(f"expected a module name, got `{item.text}`", item.span,
                      help=f"{key} lists modules: {or_list(modules, quote=True)}")
            ok = False
        elif word in modes:
            what = ("full recomputes whole layers" if word == "full" else
                    "a list is selective recomputation of the modules it names" if word == "selective" else
                    "a list names what is recomputed")
            bag.error(f"`{word}` cannot be combined with a list of modules: {what}", item.span,
                      help=f"write `{key} = {word}` alone, or list modules only, e.g. `{key} = {_EXAMPLE}` "
                           "(`selective` is `[core_attn]`)")
            ok = False
        elif word not in modules:
            bag.error(f"unknown recompute module `{word}`", item.span,
                      help=f"{did_you_mean(word, modules, case_note='names are lowercase')}Megatron-Core's "
                           f"--recompute-modules names are {or_list(modules, quote=True)}")
            ok = False
        elif word in out:
            bag.error(f"recompute module `{word}` given twice", item.span, help="name each module once")
            ok = False
        else:
            out.append(word)
    return tuple(out) if ok else None


def _lacks(cfg: SpecConfig, module: str) -> tuple[str, str] | None:
    """``(error, help)`` when the model has no ``module`` (its message), else None."""
    m = cfg.model
    if module == "mla_up_proj" and not m.kv_lora_rank:
        return ("recompute module `mla_up_proj` needs multi-latent attention (MLA), but kv_lora_rank = 0",
                "remove `mla_up_proj`, or use an MLA model (kv_lora_rank > 0, as DeepSeek-V3)")
    if module in ("moe", "moe_act") and not m.experts:
        return (f"recompute module `{module}` needs a mixture-of-experts model, but experts = 0",
                f"remove `{module}` (a dense MLP is `mlp`), or set `experts`")
    if module == "shared_experts" and not m.shared_experts:
        return ("recompute module `shared_experts` needs shared experts, but shared_experts = 0",
                "remove `shared_experts`" + (" (the routed experts are `moe`)" if m.experts else ""))
    if module == "mlp" and all(moe_layer(m, i) for i in range(m.layers)):
        return ("recompute module `mlp` recomputes dense MLPs, but every layer of this model is a "
                "mixture-of-experts layer", "remove `mlp`, or recompute the MoE layers with `moe` or `moe_act`")
    return None


def check_recompute(cfg: SpecConfig, ctx: CheckContext) -> None:
    """``recompute = [...]``: every module exists in the model (an error, at the module's
    entry); ``moe`` with ``moe_act`` or ``shared_experts`` (whole MoE layers recomputed: the
    others add nothing, a warning); a list in a ``serve`` spec (a warning: nothing is
    recomputed without a backward)."""
    rc = cfg.parallel.recompute
    if not is_module_list(rc) or not ctx.ok("parallel.recompute"):
        return
    for i, module in enumerate(rc):
        span = ctx.span(f"parallel.recompute[{i}]", "parallel.recompute")
        lack = _lacks(cfg, module) if ctx.ok("model.experts", "model.shared_experts", "model.kv_lora_rank") else None
        if lack:
            ctx.bag.error(lack[0], span, help=lack[1])
        elif module in ("moe_act", "shared_experts") and "moe" in rc:
            ctx.bag.warning(f"recompute module `{module}` is inside `moe`, which recomputes the whole MoE layer",
                            span, help=f"remove `{module}`")
    if cfg.workload == "serve":
        ctx.bag.warning("a `serve` spec computes no backward: recompute does nothing", ctx.span("parallel.recompute"),
                        help="remove `recompute`")


def check_grad_dtype(cfg: SpecConfig, ctx: CheckContext) -> None:
    """``grad_dtype = bf16`` needs a bf16 model (Megatron-Core's grad buffer takes the
    parameters' dtype, ``param_and_grad_buffer.py`` ``grad_dtype = torch.float if
    grad_reduce_in_fp32 else param.dtype``), and disagrees with an explicit ``reduce_dtype =
    fp32`` (the bf16 buffers are what is reduced); a warning in a ``serve`` spec."""
    m, p = cfg.model, cfg.parallel
    if p.grad_dtype == "fp32" or not ctx.ok("parallel.grad_dtype"):
        return
    span = ctx.span("parallel.grad_dtype")
    if cfg.workload == "serve":
        ctx.bag.warning("a `serve` spec computes no gradients: grad_dtype does nothing", span,
                        help="remove `grad_dtype`")
        return
    if ctx.ok("model.dtype") and m.dtype != "bf16":
        ctx.bag.error(f"grad_dtype = bf16 needs a bf16 model; the model's dtype is {m.dtype}", span,
                      help="`grad_dtype = fp32`, or `dtype = bf16` in the `model` block",
                      note="bf16 gradient buffers hold the bf16 parameters' gradients, as Megatron-Core's "
                           "--grad-reduce-in-bf16 does")
    elif ctx.given("parallel.reduce_dtype") and ctx.ok("parallel.reduce_dtype") and p.reduce_dtype != "bf16":
        ctx.bag.error(f"grad_dtype = bf16 reduces its bf16 gradient buffers in bf16, but reduce_dtype = "
                      f"{p.reduce_dtype}", ctx.span("parallel.reduce_dtype"),
                      help="remove `reduce_dtype` (grad_dtype = bf16 implies it), or `grad_dtype = fp32`")


__all__ = ["convert_module_list", "check_recompute", "check_grad_dtype"]
