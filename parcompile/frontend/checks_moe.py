"""The mixture-of-experts checks of a spec (SPEC 1 `model.experts`, `parallel.ep`,
`expert_tp`): the expert layout (:func:`check_experts`) and the router's keys
(:func:`check_router`, :data:`ROUTER_KEYS`). Run by
:func:`parcompile.frontend.checks.check_config` (its :data:`~parcompile.frontend.checks.CHECKS`).
"""

from __future__ import annotations

from typing import Any

from parcompile.config.schema import SpecConfig
from parcompile.config.text import divisors
from parcompile.frontend.check_context import CheckContext, may_be


def check_experts(cfg: SpecConfig, ctx: CheckContext) -> None:
    """The expert layout: ep dividing ``experts`` (and only with experts), ``top_k`` and
    ``dense_layers`` in range, sequence parallelism with tp, expert_tp x ep dividing the
    dense data-parallel group, no expert_tp with expert biases in training."""
    m, p = cfg.model, cfg.parallel
    if not ctx.ok("parallel.ep", "model.experts"):
        return
    ep_span = ctx.span("parallel.ep")
    if m.experts > 0 and m.bias and p.expert_tp > 1 and ctx.ok("parallel.expert_tp", "model.bias") \
            and cfg.workload != "serve":   # serving: w2's bias on one rank of the partial sums (GroupedExperts)
        ctx.bag.error(f"expert_tp = {p.expert_tp} with expert biases (bias = true) is not supported: each "
                      "expert_tp rank would add w2's bias to its partial sum", ctx.span("parallel.expert_tp", "parallel.tp"),
                      help="split the experts over ep instead (expert_tp = 1), as gpt-oss deployments do")
    if m.experts == 0 and p.ep > 1:
        ctx.bag.error(f"ep = {p.ep} needs a mixture-of-experts model, but experts = 0", ep_span,
                      help="set `experts` in the `model` block, or `ep = 1`")
    if m.experts > 0:
        if m.experts % p.ep:
            eps = divisors(m.experts)
            fold = ""
            if ctx.ok("parallel.expert_tp", "parallel.tp", "parallel.cp", "parallel.dp"):
                dense = p.tp * p.cp * p.dp
                fitting = [e for e in eps if dense % (p.expert_tp * e) == 0]
                if fitting and fitting != eps:
                    eps = fitting
                    fold = (f" (dividing experts = {m.experts}, with expert_tp({p.expert_tp}) * ep dividing "
                            f"tp({p.tp}) * cp({p.cp}) * dp({p.dp}) = {dense})")
            ctx.bag.error(f"ep = {p.ep} does not divide experts = {m.experts}", ep_span,
                          help=f"ep may be {may_be(eps)}{fold}",
                          note="each expert-parallel rank holds experts / ep whole experts")
        if ctx.ok("model.top_k") and m.top_k > m.experts:
            ctx.bag.error(f"top_k = {m.top_k} exceeds experts = {m.experts}", ctx.span("model.top_k"),
                          help=f"route each token to at most {m.experts} experts, or add experts")
        if ctx.ok("parallel.tp", "parallel.sequence_parallel") and p.tp > 1 and not p.sequence_parallel \
                and cfg.workload != "serve":   # serving routes replicated tokens on every tp rank (vLLM)
            # Megatron-Core's rule: MoE with tensor parallelism dispatches sequence-parallel tokens
            ctx.bag.error(f"a mixture-of-experts model with tp = {p.tp} needs sequence_parallel = true",
                          ctx.span("parallel.tp"), help="set sequence_parallel = true in the `parallel` block",
                          note="each tp rank routes its own part of the sequence (Megatron-Core requires sequence "
                               "parallelism for MoE with tensor parallelism)")
    if m.dense_layers > m.layers and ctx.ok("model.dense_layers", "model.layers"):
        ctx.bag.error(f"dense_layers = {m.dense_layers} exceeds layers = {m.layers}", ctx.span("model.dense_layers"),
                      help=f"keep at most {m.layers} leading layers dense (`dense_layers = {m.layers}`: no MoE layer)")
    if ctx.ok("parallel.expert_tp", "parallel.tp", "parallel.cp", "parallel.dp"):
        folded = p.expert_tp * p.ep
        dense = p.tp * p.cp * p.dp
        if dense % folded:
            if dense % p.expert_tp == 0:
                eps = [e for e in divisors(dense // p.expert_tp) if m.experts == 0 or m.experts % e == 0]
                help = f"with expert_tp = {p.expert_tp}, ep may be {may_be(eps)}"
            else:
                help = f"expert_tp may be {may_be(divisors(dense))}, and expert_tp * ep must divide {dense}"
            ctx.bag.error(f"expert_tp({p.expert_tp}) * ep({p.ep}) = {folded} does not divide "
                          f"tp({p.tp}) * cp({p.cp}) * dp({p.dp}) = {dense}",
                          ctx.span("parallel.ep", "parallel.expert_tp"), help=help,
                          note="experts fold onto the tp * cp * dp ranks of each stage: "
                               "expert_dp = tp * cp * dp / (expert_tp * ep)")


#: the model keys of the router (runtime/model/moe.py: route); a dense model warns for each written
ROUTER_KEYS = ("norm_topk_prob", "scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor")


def value_words(v: Any) -> str:
    """A key's value as the spec writes it (``true``, ``sigmoid``, ``2.5``)."""
    return str(v).lower() if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


def check_router(cfg: SpecConfig, ctx: CheckContext) -> None:
    """DeepSeek-V3's router keys (runtime/model/moe.py: route): ``noaux_tc`` scores by sigmoid
    (DeepSeek-V3's modeling_deepseek.py supports no other; transformers' DeepseekV3TopkRouter
    hard-codes both); its groups split the experts evenly, each of at least two (a group
    scores the sum of its top 2); ``topk_group <= n_group``; the kept groups hold at least
    ``top_k`` experts. With ``greedy`` the groups have no effect (a warning where written)."""
    m = cfg.model
    if m.experts == 0 or not ctx.ok("model.experts", "model.scoring_func", "model.topk_method"):
        return
    E, G, TG = m.experts, m.n_group, m.topk_group
    if m.topk_method == "noaux_tc" and m.scoring_func != "sigmoid":
        ctx.bag.error(f"topk_method = noaux_tc needs scoring_func = sigmoid, got scoring_func = {m.scoring_func}",
                      ctx.span("model.topk_method", "model.scoring_func"),
                      help="set scoring_func = sigmoid (DeepSeek-V3), or topk_method = greedy for a softmax router",
                      note="noaux_tc adds a per-expert correction bias to sigmoid scores to choose the experts "
                           "(DeepSeek-V3's auxiliary-loss-free balancing)")
    if m.topk_method == "greedy":
        for key in ("n_group", "topk_group"):
            if ctx.given(f"model.{key}") and ctx.ok(f"model.{key}") and getattr(m, key) != 1:
                ctx.bag.warning(f"{key} = {getattr(m, key)} has no effect with topk_method = greedy",
                                ctx.span(f"model.{key}"),
                                help=f"set topk_method = noaux_tc (DeepSeek-V3's group-limited routing), "
                                     f"or remove `{key}`",
                                note="the experts are chosen within groups only with topk_method = noaux_tc")
        return
    if not ctx.ok("model.n_group"):
        return
    groups_ok = [d for d in divisors(E) if E // d >= 2]
    if E % G or E // G < 2:
        why = (f"n_group = {G} does not divide experts = {E}" if E % G else
               f"n_group = {G} leaves experts({E}) / n_group({G}) = {E // G} expert per group")
        ctx.bag.error(why, ctx.span("model.n_group"),
                      help=f"n_group may be {may_be(groups_ok)}" if groups_ok else "use at least 2 experts",
                      note="noaux_tc splits the experts into n_group equal groups and scores each by the sum "
                           "of its 2 best corrected scores")
        return
    if not ctx.ok("model.topk_group"):
        return
    if TG > G:
        ctx.bag.error(f"topk_group = {TG} exceeds n_group = {G}", ctx.span("model.topk_group"),
                      help=f"topk_group may be 1 to {G} (the groups each token may choose from)")
        return
    kept = TG * E // G
    if ctx.ok("model.top_k") and kept < m.top_k <= E:   # (top_k > experts: check_experts)
        need = -(-m.top_k * G // E)
        ctx.bag.error(f"top_k = {m.top_k} exceeds the experts of the kept groups: topk_group({TG}) * "
                      f"experts({E}) / n_group({G}) = {kept}", ctx.span("model.top_k", "model.topk_group"),
                      help=f"lower top_k to at most {kept}, or raise topk_group to {need}",
                      note="each token chooses its top_k experts within its topk_group best groups")
