"""Cross-field checks of a spec (SPEC 1): degrees, divisibility, batches, schedules, MoE.

Each check reads the resolved :class:`~parcompile.config.schema.SpecConfig`, reports at
the span of the value to change (or the block header when the value came from a
default or preset) and prints every number involved, torchtitan-style::

    dp(2) * tp(4) * pp(2) * cp(1) = 16 != world_size(8) = nodes(1) * gpus_per_node(8)

A check is skipped when a value it reads was itself wrong (``CheckContext.bad``), so
that one mistake gives one error.
"""

from __future__ import annotations

import math
import os
from typing import Any

from parcompile.config.schema import ClusterConfig, ParallelConfig, SpecConfig
from parcompile.config.text import and_list, even_split, or_list, plural
from parcompile.core.axes import DEGREE_AXES
from parcompile.core.model import MAX_LAYERS as _MAX_LAYERS
from parcompile.core.schedule import group_error
# the context and the checks of each concern live in their own modules (names re-exported)
from parcompile.frontend.check_context import AUTO, CheckContext, nearest_multiples  # noqa: F401
from parcompile.frontend.checks_lora import check_lora
from parcompile.frontend.checks_fp8 import check_fp8, check_fp8_bf16_layers
from parcompile.frontend.checks_offload import check_data_parallel_mesh, check_offload
from parcompile.frontend.checks_model import (check_attention_kinds, check_heads, check_llama4, check_mla,
                                              check_widths)
from parcompile.frontend.checks_moe import ROUTER_KEYS, check_experts, check_router, value_words
from parcompile.frontend.checks_recompute import check_grad_dtype, check_recompute
from parcompile.frontend.checks_serve import check_serve


#: Longest explicit split a help line proposes.
_MAX_PROPOSED_CHUNKS = 64


# --------------------------------------------------------------------------------------
# Degrees


def resolve_dp(dp: Any, values: dict[str, Any], cluster: ClusterConfig, ctx: CheckContext, reserved: int = 0) -> int:
    """The data-parallel degree: ``dp`` itself, or ``world / (tp * pp * cp)`` for ``auto``.

    Reports ``dp * tp * pp * cp != world_size`` (or, for ``auto``, a product that does
    not divide the world size) and returns 1 in that case. ``reserved``: GPUs of the
    cluster the layout does not hold (a disaggregated serve spec's prefill pool).
    """
    tp, pp, cp = (values.get(k, 1) for k in ("tp", "pp", "cp"))
    inputs = ("cluster.nodes", "cluster.gpus_per_node", "parallel.tp", "parallel.pp", "parallel.cp")
    if not ctx.ok(*inputs, "parallel.dp"):
        return dp if isinstance(dp, int) else 1
    nodes, gpus = cluster.nodes, cluster.gpus_per_node
    if reserved >= nodes * gpus:   # a disaggregated spec's prefill pool leaves no GPU to the decode pool
        ctx.bag.error(f"the prefill pool takes {reserved} GPUs (prefill_replicas * prefill_tp), "
                      f"{'all of' if reserved == nodes * gpus else 'more than'} the cluster's {nodes * gpus} "
                      f"(nodes * gpus_per_node)",
                      ctx.span("serve.prefill_replicas", "serve.prefill_tp"),
                      help=f"leave GPUs to the decode pool (the `parallel` layout): a prefill pool of at most "
                           f"{nodes * gpus - 1} GPUs, or more nodes")
        ctx.bad.add("parallel.dp")
        return 1
    world = nodes * gpus - reserved
    world_words = f"world_size({world}) = nodes({nodes}) * gpus_per_node({gpus})" + (
        f" - {reserved} GPUs of the prefill pool (prefill_replicas * prefill_tp)" if reserved else "")
    rest = tp * pp * cp
    span = ctx.span("parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp")
    if dp is AUTO:
        if world % rest == 0:
            return world // rest
        ctx.bag.error(f"dp = auto: tp({tp}) * pp({pp}) * cp({cp}) = {rest} does not divide {world_words}",
                      span, help=f"choose tp, pp and cp whose product divides {world}")
        ctx.bad.add("parallel.dp")
        return 1
    if dp * rest != world:
        need = f"or give the cluster {dp * rest} GPUs (nodes * gpus_per_node)"
        if world % rest == 0:
            help = f"dp = {world // rest} (or `dp = auto`) fills the world size, {need}"
        else:
            help = f"tp * pp * cp = {rest} must divide world_size({world}), {need}"
        ctx.bag.error(f"dp({dp}) * tp({tp}) * pp({pp}) * cp({cp}) = {dp * rest} != {world_words}",
                      span, help=help)
    return dp


# --------------------------------------------------------------------------------------
# The checks


def _check_layers(cfg: SpecConfig, ctx: CheckContext) -> None:
    m, p = cfg.model, cfg.parallel
    if not ctx.ok("model.layers", "parallel.pp", "parallel.virtual_stages", "parallel.stage_layers"):
        return
    chunks = p.pp * p.virtual_stages
    chunk_words = f"pp({p.pp}) * virtual_stages({p.virtual_stages}) = {chunks}"
    split = f"`stage_layers = {even_split(m.layers, chunks)}`".replace("'", "") \
        if m.layers >= chunks and chunks <= _MAX_PROPOSED_CHUNKS else None
    if p.stage_layers is None:
        # layers that do not divide into the chunks are split unevenly by the compiler
        # (parcompile.layout_search.settle_split, with a note); fewer layers than chunks cannot be
        if m.layers < chunks:
            ends = None
            if chunks - 2 <= m.layers and chunks <= _MAX_PROPOSED_CHUNKS:
                # an embedding-only first chunk (and an output-only last one) fill the rest
                fill = [0] + [1] * m.layers + ([0] if m.layers == chunks - 2 else [])
                ends = "`stage_layers = [" + ", ".join(map(str, fill)) + "]`"
            ctx.bag.error(f"layers = {m.layers} cannot fill {chunk_words} model chunks",
                          ctx.span("parallel.pp", "parallel.virtual_stages"),
                          help=f"use at most {plural(m.layers, 'model chunk')}: lower pp or virtual_stages so that "
                               f"pp * virtual_stages <= layers"
                               + (f", or give the first (and the last) chunk no layer: {ends}" if ends else ""))
        return
    span = ctx.span("parallel.stage_layers")
    if len(p.stage_layers) != chunks:
        ctx.bag.error(f"stage_layers has {len(p.stage_layers)} entries, expected {chunk_words}", span,
                      help=f"one entry per model chunk, e.g. {split}" if split else None)
    elif sum(p.stage_layers) != m.layers:
        ctx.bag.error(f"stage_layers sum to {sum(p.stage_layers)}, expected layers = {m.layers}", span,
                      help=f"e.g. {split}" if split else None)
    if len(p.stage_layers) == chunks:
        # a layer-less chunk holds only the embedding (the first) or only the output layer
        # and the loss (the last): Llama 3 paper section 3.3.2; Megatron-Core's
        # --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split
        empty = [k for k, n in enumerate(p.stage_layers) if n == 0 and 0 < k < chunks - 1]
        if empty:
            k = empty[0]
            ctx.bag.error(f"stage_layers entry {k + 1} of {chunks} is 0: only the first model chunk (the "
                          "embedding) and the last one (the output layer and the loss) may hold no layers",
                          span, note="a middle model chunk with no layers would run nothing"
                          + (f" ({len(empty)} such entries)" if len(empty) > 1 else ""),
                          help="give every middle model chunk at least one layer"
                               + (f", e.g. {split}" if split else ""))


def _check_batches(cfg: SpecConfig, ctx: CheckContext) -> None:
    p = cfg.parallel
    if not ctx.ok("parallel.global_batch", "parallel.micro_batch", "parallel.dp", "parallel.tp",
                  "parallel.pp", "parallel.cp", "cluster.nodes", "cluster.gpus_per_node"):
        return
    per_step = p.micro_batch * p.dp
    gb_span = ctx.span("parallel.global_batch")
    if p.global_batch % per_step:
        ctx.bag.error(f"global_batch = {p.global_batch} is not divisible by micro_batch({p.micro_batch}) * "
                      f"dp({p.dp}) = {per_step}", gb_span,
                      help=f"nearest valid global batches: {or_list(nearest_multiples(p.global_batch, per_step))}")
        return
    num_micro = p.global_batch // per_step
    if not ctx.ok("parallel.schedule"):
        return
    sched = p.pipeline_schedule
    if sched.rounds and p.microbatch_group_size is not None:
        if ctx.ok("parallel.microbatch_group_size", "parallel.virtual_stages"):
            _check_group(cfg, num_micro, ctx)
    elif sched.rounds and num_micro % p.pp:
        ctx.bag.error(f"{p.schedule} needs the number of micro-batches to be a multiple of pp = {p.pp}, "
                      f"got m = {num_micro} = global_batch({p.global_batch}) / (micro_batch({p.micro_batch}) * "
                      f"dp({p.dp}))", ctx.span("parallel.schedule"),
                      help=f"global_batch may be "
                           f"{or_list(nearest_multiples(p.global_batch, per_step * p.pp, at_least=2))} "
                           f"(multiples of micro_batch({p.micro_batch}) * dp({p.dp}) * pp({p.pp}) = "
                           f"{per_step * p.pp}), or use schedule = 1f1b")
    if p.schedule == "1f1b" and num_micro < p.pp and cfg.workload != "serve":   # serving has no micro-batches
        ctx.bag.warning(f"1f1b with m = {plural(num_micro, 'micro-batch', 'micro-batches')} on pp = {p.pp} "
                        f"stages: the bubble grows",
                        gb_span, help=f"global_batch >= {per_step * p.pp} gives m >= pp")


def _check_group(cfg: SpecConfig, num_micro: int, ctx: CheckContext) -> None:
    """``microbatch_group_size`` as Megatron-Core runs it (:func:`parcompile.core.schedule.group_error`):
    ``pp <= N <= m`` and the last round empty or at least ``pp`` long."""
    p = cfg.parallel
    why = group_error(p.pp, num_micro, p.microbatch_group_size)
    if why is None:
        return
    fits = [n for n in range(p.pp, num_micro + 1) if group_error(p.pp, num_micro, n) is None]
    near = sorted(fits, key=lambda n: (abs(n - p.microbatch_group_size), n))[:3]
    ctx.bag.error(f"{why} (m = {num_micro} micro-batches = global_batch({p.global_batch}) / "
                  f"(micro_batch({p.micro_batch}) * dp({p.dp})))", ctx.span("parallel.microbatch_group_size"),
                  help=(f"microbatch_group_size may be {or_list(sorted(near))}" if near else
                        f"raise global_batch to at least micro_batch * dp * pp = {p.micro_batch * p.dp * p.pp}")
                  + ", or remove it (default: pp)",
                  note="Megatron-Core's interleaved schedule runs rounds of pp to m micro-batches per "
                       "virtual stage (--microbatch-group-size-per-virtual-pipeline-stage); a last round "
                       "shorter than pp leaves dependency bubbles")


def _check_schedule(cfg: SpecConfig, ctx: CheckContext) -> None:
    p = cfg.parallel
    sched = p.pipeline_schedule if ctx.ok("parallel.schedule") else None
    if p.microbatch_group_size is not None and ctx.ok("parallel.schedule", "parallel.virtual_stages") \
            and (not sched.rounds or p.virtual_stages == 1):
        ctx.bag.error(f"microbatch_group_size = {p.microbatch_group_size} needs schedule = interleaved_1f1b "
                      f"with virtual_stages > 1, not {p.schedule} with virtual_stages = {p.virtual_stages}",
                      ctx.span("parallel.microbatch_group_size"),
                      help="set `schedule = interleaved_1f1b` and `virtual_stages` > 1, or remove "
                           "`microbatch_group_size`",
                      note="only the interleaved schedule runs micro-batches in rounds per virtual stage")
    elif p.microbatch_group_size is not None and "parallel.microbatch_group_size" in ctx.provided \
            and (searched := [k for k in p.auto if k != "dp"]):
        # the keys parcompile.layout_search.needs_search searches (dp = auto alone fills the
        # world); the search chooses the group size itself (its candidates carry it, unwritten)
        ctx.bag.error(f"microbatch_group_size = {p.microbatch_group_size} with `auto` "
                      f"{or_list(searched)}: the search chooses it for each layout it ranks",
                      ctx.span("parallel.microbatch_group_size"),
                      help="fix the layout (no `auto`) to set microbatch_group_size, or remove it")
    if ctx.ok("parallel.virtual_stages", "parallel.schedule") and p.virtual_stages > 1 \
            and sched.virtual_stages is not None and p.virtual_stages != sched.virtual_stages:
        ctx.bag.error(f"virtual_stages = {p.virtual_stages} needs schedule = interleaved_1f1b, "
                      f"not {p.schedule}", ctx.span("parallel.virtual_stages"),
                      help="set `schedule = interleaved_1f1b`, or `virtual_stages = 1`")


def _check_sequence(cfg: SpecConfig, ctx: CheckContext) -> None:
    m, p = cfg.model, cfg.parallel
    if p.sequence_parallel and ctx.ok("parallel.tp"):
        if p.tp == 1:
            ctx.bag.error("sequence_parallel needs tp > 1", ctx.span("parallel.sequence_parallel"),
                          help="set tp > 1, or `sequence_parallel = false`")
        elif ctx.ok("model.seq_len") and m.seq_len % p.tp:
            ctx.bag.error(f"sequence_parallel needs tp = {p.tp} to divide seq_len = {m.seq_len}",
                          ctx.span("parallel.sequence_parallel"),
                          help=f"seq_len may be {or_list(nearest_multiples(m.seq_len, p.tp))} (multiples of "
                               f"tp = {p.tp}), or set `sequence_parallel = false`",
                          note="sequence parallelism splits each sequence into tp pieces for the norms and dropout")
        elif p.cp > 1 and ctx.ok("model.seq_len", "parallel.cp") and m.seq_len % (2 * p.cp) == 0 \
                and (m.seq_len // p.cp) % p.tp:
            unit = math.lcm(2 * p.cp, p.cp * p.tp)
            ctx.bag.error(f"sequence_parallel with cp = {p.cp} needs tp = {p.tp} to divide the "
                          f"seq_len / cp = {m.seq_len // p.cp} tokens of each cp rank",
                          ctx.span("parallel.sequence_parallel"),
                          help=f"seq_len may be {or_list(nearest_multiples(m.seq_len, unit))} (multiples of "
                               f"{unit}), or set `sequence_parallel = false`",
                          note="each cp rank's part of the sequence is split again into tp pieces for the norms "
                               "and dropout (Megatron-Core's sequence parallelism with context parallelism)")
    if p.cp > 1 and ctx.ok("parallel.cp", "model.seq_len") and m.seq_len % (2 * p.cp):
        ctx.bag.error(f"cp = {p.cp} needs seq_len = {m.seq_len} to be divisible by 2 * cp = {2 * p.cp}",
                      ctx.span("parallel.cp"),
                      help=f"seq_len may be {or_list(nearest_multiples(m.seq_len, 2 * p.cp))} "
                           f"(multiples of 2 * cp = {2 * p.cp})",
                      note="context parallelism splits each sequence into 2 * cp chunks to balance causal attention")


def _check_no_effect(cfg: SpecConfig, ctx: CheckContext) -> None:
    """Keys written in the spec that the rest of it makes meaningless: warnings, so that a
    user who believes they changed something learns that they did not."""
    m, p = cfg.model, cfg.parallel
    dense = ctx.ok("model.experts") and m.experts == 0
    if dense and ctx.given("model.top_k") and ctx.ok("model.top_k"):
        ctx.bag.warning(f"top_k = {m.top_k} has no effect: experts = 0 makes a dense model",
                        ctx.span("model.top_k"),
                        help="remove `top_k`, or set `experts` for a mixture-of-experts model")
    for key in ROUTER_KEYS:   # the router's keys (check_router)
        if dense and ctx.given(f"model.{key}") and ctx.ok(f"model.{key}"):
            ctx.bag.warning(f"{key} = {value_words(getattr(m, key))} has no effect: experts = 0 makes a "
                            "dense model", ctx.span(f"model.{key}"),
                            help=f"remove `{key}`, or set `experts` for a mixture-of-experts model")
    if dense and ctx.given("parallel.expert_tp") and ctx.ok("parallel.expert_tp"):
        ctx.bag.warning(f"expert_tp = {p.expert_tp} has no effect: the model has no experts (experts = 0)",
                        ctx.span("parallel.expert_tp"),
                        help="remove `expert_tp`, or set `experts` in the `model` block")
    if ctx.given("model.max_positions") and ctx.ok("model.max_positions", "model.position") \
            and m.position != "learned":
        ctx.bag.warning(f"max_positions = {m.max_positions} has no effect with position = {m.position}",
                        ctx.span("model.max_positions"),
                        help="remove `max_positions`, or set `position = learned`",
                        note="max_positions is the number of rows of a learned position table")
    if ctx.given("parallel.bucket_size") and ctx.ok("parallel.bucket_size", "parallel.dp", "parallel.cp") \
            and (cfg.workload == "serve" or (p.dp * p.cp == 1 and p.expert_dp <= 1)):
        why = ("a `serve` spec computes no gradients" if cfg.workload == "serve" else
               "with dp * cp = 1 no gradient is reduced over data parallelism")
        ctx.bag.warning(f"bucket_size has no effect: {why}", ctx.span("parallel.bucket_size"),
                        help="remove `bucket_size`",
                        note="bucket_size sizes the buckets in which data-parallel ranks reduce gradients")
    if ctx.given("parallel.zero") and ctx.ok("parallel.zero", "parallel.dp", "parallel.cp") \
            and cfg.workload == "train" and p.zero > 0 and p.dp * p.cp == 1 \
            and not {"dp", "cp"} & set(p.auto):   # dp = auto may grow with the cluster: no warning
        ctx.bag.warning(f"zero = {p.zero} has no effect: with dp * cp = 1 there is no data-parallel group "
                        "to shard over", ctx.span("parallel.zero"),
                        help="remove `zero`, or give dp (or cp) more than one rank",
                        note="ZeRO shards optimizer states, gradients and (zero = 3) parameters over "
                             "the dp * cp ranks that hold the same weights")
    if ctx.given("cluster.engine") and ctx.ok("cluster.engine") and cfg.workload == "serve":
        ctx.bag.warning(f"engine = {cfg.cluster.engine} has no effect: a `serve` spec's estimate does not use it",
                        ctx.span("cluster.engine"), help="remove `engine`",
                        note="engine names the training engine (megatron or eager) whose kernels the training "
                             "time estimate assumes")
    for key, what in (("rotary_fraction", "the share of each head's dims that get RoPE"),
                      ("rope_theta", "the base of RoPE's frequencies")):
        if ctx.given(f"model.{key}") and ctx.ok(f"model.{key}", "model.position") and m.position != "rope":
            ctx.bag.warning(f"{key} = {getattr(m, key):g} has no effect with position = {m.position}",
                            ctx.span(f"model.{key}"), help=f"remove `{key}`, or set `position = rope`",
                            note=f"{key} is {what}")


def _check_overlaps(cfg: SpecConfig, ctx: CheckContext) -> None:
    """``cluster.tp_comm_overlap`` and ``cluster.overlap_p2p_comm`` (analysis/estimate.py
    ``overlaps_tp``, ``p2p_blocking_share``): warnings where the rest of the spec leaves them
    nothing to do. tp_comm_overlap is Transformer Engine's userbuffers under Megatron-Core
    (``engine = megatron``), with sequence parallelism over tp > 1 (Megatron-LM asserts it);
    overlap_p2p_comm to Megatron-Core's interleaved 1F1B with virtual stages over pp > 1
    (Megatron-LM turns it off otherwise). A key some ``auto`` may still satisfy is not warned about."""
    cl, p = cfg.cluster, cfg.parallel
    auto = set(p.auto)
    if ctx.given("cluster.tp_comm_overlap") and ctx.ok("cluster.tp_comm_overlap") and cl.tp_comm_overlap:
        why = None
        if cfg.workload == "serve":
            why = "a `serve` spec's estimate does not use it"
        elif ctx.ok("cluster.engine") and cl.engine != "megatron":
            why = f"engine = {cl.engine}: it is Transformer Engine's userbuffers overlap under Megatron-Core"
        elif ctx.ok("parallel.tp") and p.tp == 1 and "tp" not in auto:
            why = "with tp = 1 there is no tensor-parallel collective"
        elif ctx.ok("parallel.sequence_parallel") and not p.sequence_parallel and "sequence_parallel" not in auto:
            why = "it overlaps sequence parallelism's all-gathers and reduce-scatters (Megatron-LM requires it)"
        if why:
            ctx.bag.warning(f"tp_comm_overlap has no effect: {why}", ctx.span("cluster.tp_comm_overlap"),
                            help="remove `tp_comm_overlap`, or use engine = megatron with sequence_parallel = true "
                                 "and tp > 1",
                            note="tp_comm_overlap overlaps the tensor-parallel collectives with the GEMMs they feed "
                                 "or drain (Megatron-Core's --tp-comm-overlap)")
    if ctx.given("cluster.overlap_p2p_comm") and ctx.ok("cluster.overlap_p2p_comm") and cl.overlap_p2p_comm:
        why = None
        if cfg.workload == "serve":
            why = "a `serve` spec's estimate does not use it"
        elif ctx.ok("cluster.engine") and cl.engine != "megatron":
            why = f"engine = {cl.engine}: it is Megatron-Core's interleaved schedule's overlap"
        elif ctx.ok("parallel.pp") and p.pp == 1 and "pp" not in auto:
            why = "with pp = 1 there is no pipeline transfer"
        elif ctx.ok("parallel.schedule", "parallel.virtual_stages") and not {"schedule", "virtual_stages"} & auto \
                and (not p.pipeline_schedule.rounds or p.virtual_stages == 1):
            why = "Megatron-LM overlaps pipeline transfers only in interleaved 1F1B with virtual stages"
        if why:
            ctx.bag.warning(f"overlap_p2p_comm has no effect: {why}", ctx.span("cluster.overlap_p2p_comm"),
                            help="remove `overlap_p2p_comm`, or use schedule = interleaved_1f1b with "
                                 "virtual_stages > 1",
                            note="overlap_p2p_comm posts the interleaved pipeline's sends and receives and waits "
                                 "only when the tensor is needed (Megatron-LM's default with virtual stages)")


def _check_reduce_dtype(cfg: SpecConfig, ctx: CheckContext) -> None:
    """``parallel.reduce_dtype`` (:func:`parcompile.analysis.buckets.bucket_element_bytes`):
    a 16-bit value must be the model's dtype (its gradients are what the buckets hold; an
    error), and takes effect only where buckets are reduce-scattered per micro-batch (zero
    2 and 3, not zero-bubble) over more than one rank (a warning otherwise: there the fp32
    buffers accumulate the step and are reduced in fp32)."""
    m, p = cfg.model, cfg.parallel
    rd = p.reduce_dtype
    if rd == "fp32" or not ctx.ok("parallel.reduce_dtype"):
        return
    span = ctx.span("parallel.reduce_dtype")
    if ctx.ok("model.dtype") and rd != m.dtype:
        ctx.bag.error(f"reduce_dtype = {rd} needs a {rd} model; the model's dtype is {m.dtype}", span,
                      help="`reduce_dtype = fp32`" + (f", or `reduce_dtype = {m.dtype}`" if m.dtype != "fp32" else
                                                       " (an fp32 model reduces its fp32 gradients)"),
                      note="a 16-bit reduce dtype holds the model's 16-bit gradients in 16-bit buckets, "
                           "reduce-scatters them in 16 bits and adds them into the fp32 gradient shard")
        return
    if not ctx.ok("parallel.zero", "parallel.schedule", "parallel.dp", "parallel.cp"):
        return
    if cfg.workload == "serve":
        why, help = "a `serve` spec computes no gradients", "remove `reduce_dtype`"
    elif "zero" not in p.auto and p.zero < 2:
        why = (f"with zero = {p.zero} the generated program accumulates gradients in fp32 buffers over the "
               "step's micro-batches and reduces them once, in fp32")
        why += (" (a plan for engine megatron on a GPU preset still counts Megatron-Core's gradient buffer "
                "in the reduce dtype, its --grad-reduce-in-bf16: analysis/estimate.py grad_element_bytes)")
        help = ("set `zero = 2` or `3` (gradient buckets reduce-scattered in every micro-batch's backward), "
                "or remove `reduce_dtype`")
    elif "schedule" not in p.auto and p.pipeline_schedule.split_backward:
        why = "the zero-bubble schedule accumulates gradients in fp32 buffers and reduces them once per step, in fp32"
        help = "use another schedule (`1f1b`, `interleaved_1f1b`, `gpipe`), or remove `reduce_dtype`"
    elif p.dp * p.cp == 1 and p.expert_dp <= 1 and not {"dp", "cp"} & set(p.auto):
        why, help = "with dp * cp = 1 no gradient is reduced over data parallelism", "remove `reduce_dtype`"
    else:
        return
    ctx.bag.warning(f"reduce_dtype = {rd} has no effect: {why}", span, help=help,
                    note="reduce_dtype applies to the gradient buckets ZeRO 2 and 3 reduce-scatter in every "
                         "micro-batch's backward")


def _check_order(cfg: SpecConfig, ctx: CheckContext) -> None:
    order = cfg.parallel.order
    parts = order.split("-")
    if sorted(parts) != sorted(DEGREE_AXES):   # SPEC 1 `parallel.order`: a permutation of them
        missing = [a for a in DEGREE_AXES if a not in parts]
        extra = sorted({x for x in parts if x not in DEGREE_AXES or parts.count(x) > 1})
        notes = ([f"missing {and_list(missing, quote=True)}"] if missing else []) + \
                ([f"unexpected or repeated {and_list(extra, quote=True)}"] if extra else [])
        ctx.bag.error(f"order `{order}` is not a permutation of tp, cp, ep, dp and pp",
                      ctx.span("parallel.order"),
                      help='the five axes joined by `-`, fastest-varying first, e.g. "tp-cp-ep-dp-pp"',
                      note="; ".join(notes))


def _check_train(cfg: SpecConfig, ctx: CheckContext) -> None:
    if cfg.workload != "train":
        return
    t = cfg.train
    if ctx.ok("train.min_lr", "train.lr") and t.min_lr > t.lr:
        ctx.bag.error(f"min_lr = {t.min_lr:g} exceeds lr = {t.lr:g}", ctx.span("train.min_lr"),
                      help=f"the schedule decays from lr to min_lr: use a min_lr of at most {t.lr:g}")
    if ctx.ok("train.warmup_steps", "train.steps") and t.warmup_steps > t.steps:
        ctx.bag.warning(f"warmup_steps = {t.warmup_steps} exceeds steps = {t.steps}: the learning rate "
                        f"never leaves warmup", ctx.span("train.warmup_steps"))
    if t.checkpoint_every > 0 and t.checkpoint_dir is None:
        ctx.bag.error(f"checkpoint_every = {t.checkpoint_every} needs `checkpoint_dir`",
                      ctx.span("train.checkpoint_every"), help='add `checkpoint_dir = "checkpoints"`')
    if ctx.ok("train.data", "model.vocab", "train.tokenizer") and t.data != "synthetic" \
            and t.tokenizer == "bytes" and cfg.model.vocab < 256:
        # the bytes tokenizer: token ids 0..255 (runtime/data/dataset.py)
        ctx.bag.error(f'data = "{t.data}" is read as bytes'
                      f", which needs vocab >= 256; the model has "
                      f"vocab = {cfg.model.vocab}", ctx.span("train.data", "model.vocab"),
                      help='use vocab >= 256, a Hugging Face `tokenizer`, or data = "synthetic" '
                           '(random tokens below vocab)')
    check_fp8(cfg, ctx)
    check_fp8_bf16_layers(cfg, ctx)
    check_lora(cfg, ctx)
    _check_tokenizer(cfg, ctx)
    _check_init_from(cfg, ctx)
    _check_outputs(cfg, ctx)


def _check_outputs(cfg: SpecConfig, ctx: CheckContext) -> None:
    """Where the run writes (:mod:`parcompile.core.outputs`): ``hf_output`` replaces only an
    empty directory or an earlier output of parcompile, never the checkpoints; the
    ``checkpoint_dir`` can be created and written. Its free space needs the plan's bytes:
    :func:`parcompile.driver.compile_config` checks it."""
    from parcompile.core.outputs import HF_OUTPUT_HELP, hf_output_problem, write_problem

    t = cfg.train
    if t.hf_output is not None and ctx.ok("train.hf_output"):
        problem = hf_output_problem(t.hf_output, t.checkpoint_dir)
        if problem:
            ctx.bag.error(f"hf_output: {problem}", ctx.span("train.hf_output"), help=HF_OUTPUT_HELP)
            ctx.bad.add("train.hf_output")
    if t.checkpoint_dir is not None and ctx.ok("train.checkpoint_dir"):
        problem = write_problem(t.checkpoint_dir)
        if problem:
            ctx.bag.error(f"checkpoint_dir: {problem}", ctx.span("train.checkpoint_dir"),
                          help="give a directory that can be created and written (checkpoints are saved there "
                               "during training)")
            ctx.bad.add("train.checkpoint_dir")


def _check_tokenizer(cfg: SpecConfig, ctx: CheckContext) -> None:
    """The tokenizer loads, fits the model's vocabulary, and has a chat template for `chat`."""
    t = cfg.train
    uses_text = any(d not in (None, "synthetic") for d in (t.data, t.eval_data))
    if t.data_format == "chat" and t.tokenizer == "bytes" and ctx.ok("train.data_format", "train.tokenizer"):
        ctx.bag.error("data_format = chat needs a Hugging Face tokenizer with a chat template",
                      ctx.span("train.data_format"),
                      help='set `tokenizer = "path/to/tokenizer.json"` (or a directory holding one)')
        return
    if t.tokenizer == "bytes" and t.init_from is not None and uses_text and "train.tokenizer" not in ctx.spans:
        ctx.bag.warning(f"init_from `{t.init_from}` holds no tokenizer.json: the data is read as bytes",
                        ctx.span("train.init_from"),
                        help='set `tokenizer = "path"` to the tokenizer the checkpoint was trained with, '
                             'or `tokenizer = "bytes"` to mean it')
    if t.tokenizer == "bytes" or not ctx.ok("train.tokenizer") or not uses_text:
        return
    from parcompile.runtime.data.dataset import DataError, load_tokenizer

    try:
        tok = load_tokenizer(t.tokenizer)
    except DataError as e:
        ctx.bag.error(f"tokenizer `{t.tokenizer}`: {e.message}", ctx.span("train.tokenizer"), help=e.help)
        ctx.bad.add("train.tokenizer")
        return
    if ctx.ok("model.vocab") and tok.vocab_size > cfg.model.vocab:
        ctx.bag.error(f"the tokenizer has {tok.vocab_size} tokens, more than the model's vocab = {cfg.model.vocab}",
                      ctx.span("train.tokenizer"),
                      help=f"set `vocab = {tok.vocab_size}` (or more) in the model block, or use the "
                           "tokenizer the model was trained with")
    if t.data_format == "chat" and tok.chat_template is None:
        ctx.bag.error(f"data_format = chat, but the tokenizer `{t.tokenizer}` has no chat template",
                      ctx.span("train.data_format"),
                      help="add `chat_template` to the tokenizer_config.json beside tokenizer.json "
                           "(or a chat_template.jinja), as transformers reads it")


def expected_shapes(model) -> dict[str, tuple[int, ...]]:
    """Global parameter shapes of ``model`` by our parameter name, vocabulary unpadded, a
    tied head left out: what a checkpoint loaded with ``init_from`` must hold. Taken from
    the model's graph (:func:`parcompile.ir.lower.lower`), the one place they are defined;
    the graph's stacked expert weights ``layers.i.mlp.experts.w1.weight`` (E, f, h) are one
    tensor per expert, ``layers.i.mlp.experts.<e>.w1.weight`` (f, h), as programs hold them."""
    from parcompile.ir.lower import lower

    out: dict[str, tuple[int, ...]] = {}
    for _, p in lower(model, batch=1).params():
        if p.tied_to is not None:
            continue
        shape = tuple(d.size for d in p.type.dims)
        if p.expert:   # the graph stacks the experts; programs and checkpoints hold one tensor each
            stem, rest = p.name.split(".experts.", 1)
            for e in range(shape[0]):
                out[f"{stem}.experts.{e}.{rest}"] = shape[1:]
        else:
            out[p.name] = shape
    return out


def _check_init_from(cfg: SpecConfig, ctx: CheckContext) -> None:
    """A checkpoint to start from holds this model's tensors, each of this model's shape."""
    t = cfg.train
    if t.init_from is None or not ctx.ok("train.init_from", "model.layers", "model.hidden", "model.vocab"):
        return
    from parcompile.core.hf_weights import HFWeightsError, check_checkpoint, init_from_kind

    expected = expected_shapes(cfg.model)
    try:
        kind = init_from_kind(t.init_from)
    except HFWeightsError:
        kind = "hf"   # check_checkpoint reports what the directory lacks
    problems = _dcp_problems(t.init_from, expected) if kind == "dcp" else \
        check_checkpoint(t.init_from, expected, cfg.model)
    for problem in problems:
        ctx.bag.error(f"init_from: {problem.message}", ctx.span("train.init_from"), help=problem.help)


def _dcp_problems(directory: str, expected: dict[str, tuple[int, ...]]) -> list:
    """A training program's checkpoint (DCP) against this model's global shapes: a missing
    parameter or another shape (the vocabulary rows may be padded for another tp: only
    at least ``vocab`` rows are needed). Reads the checkpoint's metadata, a pickle, with
    a reader that resolves only the names a DCP metadata holds and never runs code
    (:func:`parcompile.runtime.state.weights.read_dcp_metadata`); not its tensors."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from parcompile.core.hf_weights import Problem
    from parcompile.runtime.state.weights import WeightsError, dcp_metadata_path, read_dcp_metadata

    try:
        root = dcp_metadata_path(directory).parent
        meta = {k: v for k, v in read_dcp_metadata(root).state_dict_metadata.items()
                if isinstance(v, TensorStorageMetadata)}
    except WeightsError as e:
        return [Problem(e.message, e.help)]
    help = "was the checkpoint written for another model? the spec's model must be the one that trained it"
    out = []
    for name, shape in expected.items():
        if name not in meta:
            out.append(Problem(f"the checkpoint {root} has no `{name}` (this model's {shape})", help))
            continue
        got = tuple(meta[name].size)
        vocab_rows = name in ("embedding.weight", "lm_head.weight")
        ok = got == shape or (vocab_rows and got[1:] == shape[1:] and got[0] >= shape[0])
        if not ok:
            out.append(Problem(f"`{name}`: the checkpoint {root} has shape {got}, this model {shape}", help))
    return out[:8] + ([Problem(f"... and {len(out) - 8} more")] if len(out) > 8 else [])


def _check_positions(cfg: SpecConfig, ctx: CheckContext) -> None:
    """A learned position table has ``max_positions`` rows: a longer sequence has no row
    for its last positions (Hugging Face GPT-2 fails the same way past ``n_positions``).

    With RoPE, a ``seq_len`` written above the ``max_positions`` the model's source gives
    (Hugging Face ``max_position_embeddings``: the context the checkpoint was trained or
    extended to) is a warning; an error when the source's RoPE scaling (``yarn``,
    ``llama3``) cannot reach it: those reach ``rope_original_max_positions *
    rope_scaling_factor`` (transformers' ``_compute_yarn_parameters`` /
    ``_compute_llama3_parameters``: ``original_max_position_embeddings * factor``)."""
    m = cfg.model
    if m.position == "rope" and m.max_positions is not None and ctx.given("model.seq_len") \
            and not ctx.given("model.max_positions") \
            and ctx.ok("model.seq_len", "model.max_positions", "model.rope_type", "model.rope_scaling_factor",
                       "model.rope_original_max_positions") and m.seq_len > m.max_positions:
        scaled = m.rope_type in ("yarn", "llama3") and m.rope_original_max_positions is not None
        reach = int(m.rope_original_max_positions * m.rope_scaling_factor) if scaled else None
        source = "max_positions comes from the model's `from` source (max_position_embeddings)"
        if scaled and m.seq_len > reach:
            factor = -(-m.seq_len // m.rope_original_max_positions)
            ctx.bag.error(f"seq_len = {m.seq_len} is beyond what the model's RoPE scaling reaches: rope_type = "
                          f"{m.rope_type} extends rope_original_max_positions = {m.rope_original_max_positions} "
                          f"by rope_scaling_factor = {m.rope_scaling_factor:g} to {reach} positions",
                          ctx.span("model.seq_len"),
                          help=f"use seq_len <= {max(reach, m.max_positions)}, or write `rope_scaling_factor = "
                               f"{factor}` (a longer extension, to be fine-tuned)", note=source)
        else:
            how = (f"RoPE scaling ({m.rope_type}) reaches {reach}, but the checkpoint was not trained past "
                   f"{m.max_positions}" if scaled else "positions past it were never seen in training")
            ctx.bag.warning(f"seq_len = {m.seq_len} is above the model's max_positions = {m.max_positions}: {how}",
                            ctx.span("model.seq_len"),
                            help=f"use seq_len <= {m.max_positions}, or extend the context with RoPE scaling "
                                 f"(`rope_type = yarn`, `rope_original_max_positions = {m.max_positions}`, "
                                 f"`rope_scaling_factor = {-(-m.seq_len // m.max_positions)}`) and fine-tune",
                            note=source)
    if m.position != "learned" or not ctx.ok("model.seq_len", "model.max_positions", "model.position"):
        return
    if m.seq_len > m.max_positions:
        given = ctx.given("model.max_positions")
        ctx.bag.error(f"seq_len = {m.seq_len} exceeds max_positions = {m.max_positions}, the rows of the "
                      f"learned position table", ctx.span("model.seq_len", "model.max_positions"),
                      help=f"use seq_len <= {m.max_positions}, or write `max_positions = {m.seq_len}` "
                           f"(a larger table)",
                      note=None if given else "max_positions comes from the model's `from` source "
                                              "(n_positions / max_position_embeddings)")


def _has_entries(directory: str) -> bool:
    """Whether ``directory`` holds anything (False when it cannot be listed)."""
    try:
        with os.scandir(directory) as it:
            return next(it, None) is not None
    except OSError:
        return False


def _check_serve_weights(cfg: SpecConfig, ctx: CheckContext) -> None:
    """A serve spec's Hugging Face ``weights`` hold this model's tensors, each of this model's
    shape; a quantized one (its config.json's quantization_config) with every scale its format
    stores, of the dtype and shape the format gives (:func:`parcompile.core.hf_weights.
    check_checkpoint`, headers only); a training program's checkpoint (DCP) by its metadata
    (:func:`_dcp_problems`, as ``init_from``). A directory that does not exist yet (the builder
    warns) or is empty is not read here."""
    s = cfg.serve
    if s is None or s.weights is None or not ctx.ok("serve.weights", "model.layers", "model.hidden", "model.vocab"):
        return
    from parcompile.core.hf_weights import HFWeightsError, check_checkpoint, init_from_kind

    try:
        kind = init_from_kind(s.weights)
    except HFWeightsError as e:
        if _has_entries(s.weights):   # an empty directory is one a training run will fill
            # a config.json alone plans a deployment before the download; `run` and `serve`
            # make this an error (cli.STARTS_ONLY_WITHOUT)
            ctx.bag.warning(f"weights: {e.problem.message}", ctx.span("serve.weights"),
                            help=e.problem.help + "; `serve` and `run` need them", code="no-weights")
        return
    expected = expected_shapes(cfg.model)
    problems = _dcp_problems(s.weights, expected) if kind == "dcp" else \
        check_checkpoint(s.weights, expected, cfg.model)
    for problem in problems:
        ctx.bag.error(f"weights: {problem.message}", ctx.span("serve.weights"), help=problem.help)


#: What parcompile plans at most (the largest published runs are far below): beyond these,
#: the graph, the groups or the simulated schedule would take minutes to build.
MAX_LAYERS = _MAX_LAYERS   # parcompile.core.model: the config.json import holds to it too
MAX_WORLD_SIZE = 131_072
MAX_SCHEDULE_CHUNKS = 65_536


def _check_limits(cfg: SpecConfig, ctx: CheckContext) -> None:
    """Sizes beyond what a plan can be built for in seconds: too many layers, ranks or
    micro-batch x chunk steps of the pipeline schedule."""
    m, p, c = cfg.model, cfg.parallel, cfg.cluster
    if ctx.ok("model.layers") and m.layers > MAX_LAYERS:
        ctx.bag.error(f"layers = {m.layers} is more than parcompile plans (at most {MAX_LAYERS})",
                      ctx.span("model.layers"), note="the largest published dense models have under 200 layers",
                      help=f"use at most {MAX_LAYERS} layers")
    if ctx.ok("cluster.nodes", "cluster.gpus_per_node") and c.nodes * c.gpus_per_node > MAX_WORLD_SIZE:
        ctx.bag.error(f"world_size({c.nodes * c.gpus_per_node}) = nodes({c.nodes}) * gpus_per_node("
                      f"{c.gpus_per_node}) is more than parcompile plans (at most {MAX_WORLD_SIZE} ranks)",
                      ctx.span("cluster.gpus_per_node", "cluster.nodes"),
                      help=f"use at most {MAX_WORLD_SIZE // c.gpus_per_node:,} nodes of {c.gpus_per_node} GPUs")
    if ctx.ok("parallel.global_batch", "parallel.micro_batch", "parallel.dp", "parallel.pp",
              "parallel.virtual_stages") and p.global_batch % (p.micro_batch * p.dp) == 0:
        num_micro = p.global_batch // (p.micro_batch * p.dp)
        chunks = num_micro * p.pp * p.virtual_stages
        if chunks > MAX_SCHEDULE_CHUNKS:
            ctx.bag.error(f"m({num_micro}) * pp({p.pp}) * virtual_stages({p.virtual_stages}) = {chunks} "
                          f"micro-batch steps per optimizer step is more than the pipeline schedule is "
                          f"simulated for (at most {MAX_SCHEDULE_CHUNKS})",
                          ctx.span("parallel.global_batch", "parallel.micro_batch"),
                          help=f"raise micro_batch (m = global_batch / (micro_batch * dp) = "
                               f"{p.global_batch} / ({p.micro_batch} * {p.dp})) or lower global_batch")


def _check_cluster(cfg: SpecConfig, ctx: CheckContext) -> None:
    """The cluster's shape: an NVLink domain holds whole nodes (a GB200 NVL72 rack: 18 trays
    of 4 GPUs) or a node holds whole domains (NVLink-bridged pairs of PCIe GPUs), so the
    network model's groups of ``domain_size`` consecutive ranks fall on real boundaries."""
    c = cfg.cluster
    d, gpn = c.nvlink_domain, c.gpus_per_node
    if d is not None and gpn % d and d % gpn and ctx.ok("cluster.nvlink_domain", "cluster.gpus_per_node"):
        above = (d // gpn + 1) * gpn
        below = (d // gpn) * gpn if d > gpn else max(k for k in range(1, d) if gpn % k == 0)
        ctx.bag.error(f"nvlink_domain = {d} is neither a divisor nor a multiple of gpus_per_node = {gpn}: "
                      "a domain would split a node", ctx.span("cluster.nvlink_domain", "cluster.gpus_per_node"),
                      help=f"nvlink_domain = {below} or {above}, or remove it (a domain is then the node)",
                      note="an NVLink domain holds whole nodes (GB200 NVL72: 72 = 18 trays of 4) or a node holds "
                           "whole domains (NVLink-bridged pairs: 2)")


CHECKS = (
    _check_limits,
    check_heads,
    check_widths,
    check_attention_kinds,
    check_mla,
    check_llama4,
    _check_layers,
    _check_batches,
    _check_schedule,
    _check_sequence,
    check_experts,
    check_router,
    _check_no_effect,
    _check_overlaps,
    _check_reduce_dtype,
    check_recompute,
    check_grad_dtype,
    _check_order,
    _check_train,
    _check_positions,
    _check_serve_weights,
    check_serve,
    _check_cluster,
    check_data_parallel_mesh,
    check_offload,
)

#: The layout fields (:class:`ParallelConfig`'s, its properties spelled out) each check of
#: :data:`CHECKS` reads, for a caller that checks many layouts of one spec:
#: :func:`parcompile.layout_search.search` runs a check once per distinct value of its fields. A
#: check without an entry is taken to read every field. ``tests/test_search_checks.py``
#: derives each entry from the check's source (a new check needs its row there).
LAYOUT_READS = {
    _check_limits: ("dp", "global_batch", "micro_batch", "pp", "virtual_stages"),
    check_heads: ("tp",),
    check_widths: ("expert_tp",),
    check_attention_kinds: (),
    check_mla: ("cp",),
    check_llama4: (),
    _check_layers: ("pp", "stage_layers", "virtual_stages"),
    _check_batches: ("dp", "global_batch", "micro_batch", "microbatch_group_size", "pp", "schedule"),
    _check_schedule: ("auto", "microbatch_group_size", "schedule", "virtual_stages"),
    _check_sequence: ("cp", "sequence_parallel", "tp"),
    check_experts: ("cp", "dp", "ep", "expert_tp", "sequence_parallel", "tp"),
    check_router: (),
    _check_no_effect: ("auto", "cp", "dp", "ep", "expert_tp", "tp", "zero"),
    _check_overlaps: ("auto", "pp", "schedule", "sequence_parallel", "tp", "virtual_stages"),
    _check_reduce_dtype: ("auto", "cp", "dp", "ep", "expert_tp", "reduce_dtype", "schedule", "tp", "zero"),
    check_recompute: ("recompute",),
    check_grad_dtype: ("grad_dtype", "reduce_dtype"),
    _check_order: ("order",),
    _check_train: ("auto", "tp", "zero"),
    _check_positions: (),
    _check_serve_weights: (),
    check_serve: ("cp", "ep", "expert_tp", "pp", "tp", "virtual_stages"),
    _check_cluster: (),
    check_data_parallel_mesh: ("dp", "dp_replicate", "zero"),
    check_offload: ("auto", "offload", "zero"),
}


def check_config(cfg: SpecConfig, ctx: CheckContext) -> None:
    """Run every cross-field check on ``cfg``, adding diagnostics to ``ctx.bag``."""
    for check in CHECKS:
        check(cfg, ctx)


def does_not_fit_help(p: ParallelConfig, model_dtype: str = "fp32") -> str:
    """What a plan that does not fit memory could change, leaving out what the layout
    already does (ZeRO at its stage, a 16-bit reduce dtype, full recomputation).
    ``model_dtype``: the model's dtype (a 16-bit model at zero >= 2 may reduce its
    gradient buckets in 16 bits, ``reduce_dtype``)."""
    steps = ["raise tp or pp"]
    if p.zero < 3:
        steps.append({0: "shard optimizer states (zero = 1)", 1: "also shard gradients (zero = 2)",
                      2: "also shard parameters (zero = 3)"}[p.zero])
    if p.zero >= 2 and not p.pipeline_schedule.split_backward and p.dp * p.cp > 1 and p.reduce_dtype == "fp32" \
            and model_dtype in ("bf16", "fp16"):
        steps.append(f"hold and reduce-scatter the gradient buckets in {model_dtype} (reduce_dtype = {model_dtype})")
    if p.recompute != "full":
        steps.append("recompute activations (recompute = " + ("selective or full" if p.recompute == "none"
                                                             else "full") + ")")
    return steps[0] if len(steps) == 1 else ", ".join(steps[:-1]) + " or " + steps[-1]
