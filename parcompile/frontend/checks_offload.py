"""The checks of HSDP and CPU offload (SPEC `parallel.dp_replicate`, `dp_shard`, `offload`):
:func:`resolve_dp_shard` turns a written ``dp_shard`` into ``dp_replicate`` while the spec is
built, :func:`check_data_parallel_mesh` and :func:`check_offload` run with the other
cross-field checks of :mod:`parcompile.frontend.checks`.

What the engines require (and the checks hold the spec to):

- HSDP shards states over the shard group, so it needs a ZeRO stage to shard (torchtitan's
  ``data_parallel_replicate_degree`` x ``data_parallel_shard_degree`` is FSDP2's 2-D mesh,
  torchtitan 0.3.0 ``torchtitan/distributed/parallel_dims.py``); ``dp_replicate`` must divide
  ``dp``. Expert weights shard over ``expert_dp`` (parallel folding), which HSDP does not
  split: MoE models are refused.
- ``offload = optimizer`` is DeepSpeed's ``offload_optimizer``, "Valid for ZeRO stage 1, 2,
  3"; ``offload = params`` its ``offload_param``, "Valid only with stage 3"
  (deepspeedai/DeepSpeed ``deepspeed/runtime/zero/config.py``, commit
  1b88ac366fc922254d56abda5cf6b1f266556d19, ``DeepSpeedZeroConfig``); FSDP2's
  ``CPUOffloadPolicy`` offloads ``fully_shard``'s sharded parameters, gradients and optimizer
  states alike.
"""

from __future__ import annotations

from parcompile.config.schema import SpecConfig
from parcompile.config.text import divisors
from parcompile.frontend.check_context import AUTO, CheckContext, may_be

#: the ZeRO stage each offload needs, and the engine rule it follows (module docstring)
OFFLOAD_MIN_ZERO = {"optimizer": (1, "DeepSpeed's offload_optimizer is valid for ZeRO stages 1, 2 and 3"),
                    "params": (3, "DeepSpeed's offload_param is valid only with ZeRO stage 3, and FSDP2's "
                                  "CPUOffloadPolicy offloads fully_shard's sharded parameters")}


def auto_dp_shard(values: dict, ctx: CheckContext) -> None:
    """``dp_shard = auto`` in the `parallel` ``values`` (as written) is ``dp_replicate = auto``
    (the search chooses HSDP's degrees, ``parcompile.layout_search.space.hsdp_replicas``);
    beside a numeric ``dp_replicate`` it is an error at ``dp_shard`` (that fixes the shard
    degree already). Changes ``values`` in place."""
    if values.get("dp_shard") is not AUTO:
        return
    del values["dp_shard"]
    if values.get("dp_replicate", AUTO) is not AUTO:
        ctx.bag.error(f"dp_shard = auto with dp_replicate = {values['dp_replicate']}: the shard degree is "
                      "dp / dp_replicate already", ctx.span("parallel.dp_shard"),
                      help="remove `dp_shard`, or write `dp_replicate = auto`")
        ctx.bad.add("parallel.dp_shard")
    values.setdefault("dp_replicate", AUTO)
    if "parallel.dp_replicate" not in ctx.spans:
        ctx.spans["parallel.dp_replicate"] = ctx.span("parallel.dp_shard")


def resolve_dp_shard(values: dict, ctx: CheckContext, searched: bool = False) -> None:
    """Replace ``dp_shard`` in the `parallel` ``values`` (as written, ``dp`` resolved or
    ``AUTO``) by the ``dp_replicate`` it implies, ``dp / dp_shard``; report a ``dp_shard``
    that does not divide ``dp``, disagrees with a written ``dp_replicate``, or comes with a
    ``dp`` the search chooses (``searched``: some other degree is ``auto``), marking
    ``parallel.dp_shard`` bad; keeps a serve spec's ``dp_replicate = auto`` (``AUTO``, which the
    builder drops with a warning). Changes ``values`` in place."""
    if "dp_shard" not in values:
        return
    shard, dp = values.pop("dp_shard"), values.get("dp", 1)
    key = "parallel.dp_shard"
    if not ctx.ok(key) or (not searched and not ctx.ok("parallel.dp")):
        return
    if searched or dp is AUTO or not isinstance(dp, int):
        ctx.bag.error(f"dp_shard = {shard} needs a numeric dp", ctx.span(key),
                      help="give `dp`, or write `dp_replicate` (the shard degree is then dp / dp_replicate)")
        ctx.bad.add(key)
    elif dp % shard:
        ctx.bag.error(f"dp_shard = {shard} does not divide dp = {dp}", ctx.span(key),
                      help=f"dp_shard may be {may_be(divisors(dp))}")
        ctx.bad.add(key)
    elif values.get("dp_replicate", AUTO) is not AUTO and values["dp_replicate"] * shard != dp:
        ctx.bag.error(f"dp_replicate * dp_shard = {values['dp_replicate']} * {shard} is not dp = {dp}",
                      ctx.span(key), help=f"use dp_shard = {dp // values['dp_replicate']}, or remove one of them"
                      if dp % values["dp_replicate"] == 0 else "remove `dp_replicate` or `dp_shard`")
        ctx.bad.add(key)
    else:
        values.setdefault("dp_replicate", dp // shard)   # equal to a written one


def check_data_parallel_mesh(cfg: SpecConfig, ctx: CheckContext) -> None:
    """``dp_replicate`` (HSDP, module docstring): divides ``dp``; needs ``zero`` >= 1 and a
    model without experts (a `serve` spec has none: the builder drops it with a warning)."""
    p = cfg.parallel
    key = "parallel.dp_replicate"
    if p.dp_replicate == 1 or not ctx.ok(key, "parallel.dp_shard", "parallel.dp"):
        return
    if p.dp % p.dp_replicate:
        ctx.bag.error(f"dp_replicate = {p.dp_replicate} does not divide dp = {p.dp}", ctx.span(key),
                      help=f"dp_replicate may be {may_be(divisors(p.dp))}",
                      note="HSDP splits the dp ranks into dp_replicate groups of dp_shard = dp / dp_replicate")
    elif p.zero == 0 and ctx.ok("parallel.zero"):   # an `auto` zero: bad while built, good in the search
        ctx.bag.error(f"dp_replicate = {p.dp_replicate} needs zero = 1, 2 or 3: with zero = 0 nothing is sharded",
                      ctx.span(key, "parallel.dp_shard"),
                      help="set `zero = 3` (FSDP2's HSDP), or remove `dp_replicate`",
                      note="HSDP shards states over dp_shard ranks and replicates them over dp_replicate")
    elif cfg.model.experts and ctx.ok("model.experts"):
        ctx.bag.error(f"dp_replicate = {p.dp_replicate} is not supported with experts: expert weights shard over "
                      "expert_dp, which HSDP does not split", ctx.span(key, "parallel.dp_shard"),
                      help="remove `dp_replicate`")


def check_offload(cfg: SpecConfig, ctx: CheckContext) -> None:
    """``offload`` (module docstring): ``optimizer`` needs ``zero`` >= 1, ``params`` needs
    ``zero = 3`` (an error naming the engine's rule); no effect in a `serve` spec (a warning)."""
    p = cfg.parallel
    auto = "offload" in p.auto   # "none" until the search, and not ok (the builder marks `auto` keys)
    if cfg.workload == "serve" and (auto or (p.offload != "none" and ctx.ok("parallel.offload"))):
        ctx.bag.warning(f"offload = {'auto' if auto else p.offload} has no effect: a `serve` spec has no optimizer",
                        ctx.span("parallel.offload"), help="remove `offload`")
        return
    if p.offload == "none" or not ctx.ok("parallel.offload"):
        return
    need, rule = OFFLOAD_MIN_ZERO[p.offload]
    if p.zero < need and ctx.ok("parallel.zero"):   # an `auto` zero: bad while built, good in the search
        ctx.bag.error(f"offload = {p.offload} needs zero >= {need}, not zero = {p.zero}: {rule}",
                      ctx.span("parallel.offload"),
                      help=f"set `zero = {3 if need == 3 else '1, 2 or 3'}`, or remove `offload`")


__all__ = ["OFFLOAD_MIN_ZERO", "auto_dp_shard", "resolve_dp_shard", "check_data_parallel_mesh", "check_offload"]
