"""The op table's program rows (issue 31): per op kind, how a generated program runs it
(:class:`Code`), read by :func:`parcompile.ir.ops.code_of` and written by
:mod:`parcompile.codegen.blocks`. Kept beside :mod:`parcompile.ir.ops` (the cost rules);
the op table attaches each row to its kind (``OpSpec.code``). A constant row may instead be
written in the kind's own ``OpSpec`` (``code=``: Gemma 2's ``softcap``), so that a new
op is one entry; a kind never has both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

#: the collectives a conversion or an op may run (``parcompile.ir.ops.convert``'s kinds
#: that move data; ``split`` is local)
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Code:
    """How a generated program runs one op of this kind: what codegen writes for it
    (:mod:`parcompile.codegen.blocks`), with no code of its own per kind.

    ``build`` is the constructor expression of the module the op's class builds in its
    ``__init__`` as ``self.<attr> = <build>`` (``<attr>``: the op's name in its module,
    ``w1``), or None (a plain function). Its fields are the op's facts, read off the
    sharded graph: ``{name}`` the parameter prefix (``f"layers.{i}.mlp.w1"``),
    ``{in_features}``/``{out_features}`` the global sizes of ``in_dim``/``out_dim`` (as the
    program's constants), ``{dim}`` the global size of the output's last dim, ``{bias}``,
    ``{local}`` the per-rank shape of the op's first parameter (the runtime checks it
    against the shard it makes), ``{reduce}`` the collective of the conversion after the
    op that it runs itself (``fold_after``), ``{a[key]}`` an op attribute, ``{fp8}`` the
    keyword of an FP8 GEMM's recipe (``, fp8="tensorwise"``; empty for a 16-bit one:
    ``OpData.fp8``), ``{param}`` the first parameter's name (quoted), ``{attr}`` the
    module's attribute, ``{scatter}`` whether the conversion it runs after it
    reduce-scatters (sequence parallelism). A row may also read the graph facts
    :func:`parcompile.codegen.blocks.program_attrs` adds to the attributes (``_gathers``,
    ``_seq_split``, ``_split_dim``, ``_tied_to``, ``_tied_by``, ``_out_local``,
    ``_axes``, ``_bias``), ``{op}`` the op's own name (``f"layers.{i}.mlp.experts"``),
    ``{top_k}`` the program's constant for a router's top-k.

    ``call`` is the forward expression: ``{self}`` the built module (``self.w1``), ``{0}``,
    ``{1}``, ... (and ``{x}``: ``{0}``) the operands, ``{a[key]}`` an attribute;
    ``serve_call`` the serving program's (None: the same; its operands ``pos``: the step's
    :class:`~parcompile.runtime.serve.generate.LayerStep`, the cache and the RoPE tables at the
    tokens' positions). ``serve_init``: the serving program's ``init`` (None: the same).
    ``comment`` says what it does.
    ``inline``: its value may be written inside its consumer's expression (False: a
    statement of its own, where the shape comment goes). ``operands``: names for the
    variables holding its operands (``gate``, ``up``). ``var``: the name of its own value.
    ``init``: lines its class's ``__init__`` needs once (``self.drop = nn.Dropout(DROPOUT)``;
    ``{t[key]}``: the program's per-layer expression of a fact that is no attribute,
    ``LAYER_FP8[i]``). An attribute its kind declares per-layer (``OpSpec.per_layer``) that
    differs between layers is written ``self.<attribute>``, set from the program's table
    (codegen/blocks.py ``LayerValue``): a row writes ``{a[key]!r}`` and never decides on it.
    ``var = ""``: its value keeps its operand's name (``q = rt.apply_rope(q, ...)``).
    ``fold_after``: the op runs the conversion after it itself (a row-parallel linear's
    reduction, before its bias). ``keep_split``: the op may run inside the
    ``keep_split_input`` block of a sequence-parallel conversion marked ``regather``.

    ``module``/``args`` (per-head ops of the attention: qk-norm) name the runtime class and
    the attributes passed by keyword; codegen writes ``rt.<module>(name, <arg>=..., seed=SEED,
    tp=tp)`` for them.
    """

    module: str | None = None
    args: tuple[str, ...] = ()
    call: str = "{self}({x})"
    serve_call: str | None = None
    comment: str = ""
    build: str | None = None
    inline: bool = True
    operands: tuple[str, ...] = ()
    var: str = "h"
    init: tuple[str, ...] = ()
    fold_after: bool = False
    keep_split: bool = False
    #: the op transforms one per-head tensor (q, k or v) between the projections and the core
    per_head: bool = False
    #: its operands are per-head (B, T, heads, head_dim) tensors: a flat projection output
    #: feeding it is unflattened by its head size (the dim's unit); ``heads_out``: so is its value
    heads_in: bool = False
    heads_out: bool = False
    #: more format fields from the op's attributes (and ``_gathers``: the axes it all-gathers
    #: operands over itself, from its collectives; ``_out_local``: its output's per-rank
    #: shape; ``_axes``: every axis its collectives cross; ``_bias``: it has a bias
    #: parameter), ``init`` lines and comment ``notes`` of its own
    facts: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    serve_init: tuple[str, ...] | None = None


_LINEAR_CODE = {
    # Megatron-LM's tensor-parallel layers (runtime/model/layers.py): the weight's local shape from the graph
    "column": Code(build="rt.ColumnParallelLinear({name}, {in_features}, {out_features}, {bias}, tp, SEED, "
                         "local={local}{fp8})", keep_split=True),
    "row": Code(build="rt.RowParallelLinear({name}, {in_features}, {out_features}, {bias}, tp, SEED, OUT_STD, "
                      "reduce={reduce}, local={local}{fp8})", fold_after=True),
    # MLA's down projections: every rank holds the whole weight, its gradient whole
    "replicated": Code(build="rt.whole_grad(rt.ReplicatedLinear({name}, {in_features}, {out_features}, {bias}, "
                             "tp, SEED{fp8}))", keep_split=True),
}
#: serving with tp a multiple of kv_heads (vLLM): a kv projection whose heads the graph keeps
#: whole (attribute ``kv_replicas``, shard-tensor-parallel's mark); each rank holds kv head
#: ``tp.index // KV_REPLICAS``
_KV_REPLICATED_CODE = Code(build="rt.ColumnParallelLinear({name}, {in_features}, {out_features}, {bias}, tp, SEED, "
                                 "shard_index=tp.index // KV_REPLICAS, num_shards=KV_HEADS, local={local})")


def _attention_facts(a) -> dict:
    """The attention core's keyword arguments (runtime/model/layers.py ``attention``): context
    parallelism's k/v gather where the op all-gathers over cp (its collectives), selective
    recomputation where the pass marked it (``recompute``), Gemma's score scale and soft-cap, sinks.
    The window and the scale may differ between layers (the op kind's ``per_layer``): written
    as given (a literal, or ``self.window`` where they differ), never decided on."""
    # a soft-capped core is never one fused kernel in the program (core/attention.py: unfused)
    kw = f", fused={a['impl'] == 'flash' and a.get('softcap') is None}"
    if "cp" in a.get("_gathers", ()):
        kw += ", gather_kv=self.cp"
    notes = []
    if a.get("recompute") == "selective":
        kw += ", recompute=True"
        notes.append("selective recomputation (Korthikanti et al. 2022): keeps its inputs, runs again in backward")
    if a.get("scale") is not None:
        kw += f", scale={a['scale']!r}"
    if a.get("softcap") is not None:   # Gemma 2: the scores capped before the softmax (no fused SDPA)
        kw += f", softcap={a['softcap']!r}"
    if a.get("chunk") is not None:   # Llama 4's chunked attention (its RoPE layers)
        kw += f", chunk={a['chunk']!r}"
    init = []
    if a.get("sinks"):
        kw += ", sinks=self.sinks"
        init.append('self.sinks = rt.make_param(f"layers.{{i}}.attn.sinks", (HEADS,), SEED, 0.02, tp, 0, '
                    'local={local})')
    return {"kw": kw, "init": tuple(init), "notes": tuple(notes)}


def _linear_code(a) -> Code:
    if a.get("kv_replicas"):
        return _KV_REPLICATED_CODE
    if getattr(a.get("out_dim"), "name", None) == "vocab":   # the LM head: its rows the padded vocabulary
        return _head_code(a)
    return _LINEAR_CODE[a["tp"]]


def _head_code(a) -> Code:
    """The LM head (a linear layer onto the padded vocabulary, column-parallel): the Stage's
    ``head_weight()`` (its own weight, or tied: the embedding's where this rank holds it,
    else a copy kept equal by summing gradients, Megatron-LM); its padded rows stay zero."""
    call = "rt.linear({x}, self.head_weight())"
    build = ("rt.ColumnParallelLinear({name}, {in_features}, {out_features}, {bias}, tp, SEED, valid_rows=VOCAB, "
             "local={local})")
    if not a.get("_tied_to"):
        return Code(build=build, call=call, keep_split=True, serve_init=())
    copy = "self.{attr} = " + build.replace("{name}", f'"{a["_tied_to"]}"')   # the embedding's weight, by its name
    return Code(call=call, keep_split=True, init=(
        "if not self.has_first:   # tied head on another stage: a copy, kept equal by summing grads (Megatron-LM)",
        "    " + copy, "    self.{attr}.weight.tied = self.{attr}.weight.tied_copy = True"),
        serve_init=("if not self.has_first:   # the tied head on another stage: a copy of the embedding",
                    "    " + copy))


def _embedding_code(a) -> Code:
    """The token embedding (rows of the padded vocabulary over tp; it runs the conversion
    after it: an all-reduce, or a reduce-scatter along the sequence) and GPT-2's learned
    position embedding (the rows of this rank's token positions; serving: the step's)."""
    if a.get("positional"):
        rows = "self.positions.chunk(self.tp.size)[self.tp.index]" if "tp" in a["_seq_split"] else "self.positions"
        return Code(build="nn.Module()", call="{self}.weight[" + rows + "]", serve_call="{self}.weight[pos.positions]",
                    init=("self.{attr}.weight = rt.make_param({param}, (MAX_POSITIONS, {dim}), SEED, 0.02, tp, None)",),
                    # inline: the add reads the token embedding first, whose call gathers a ZeRO-3
                    # bucket holding this table too (runtime/train/optim.py LayerGather's pre-hook)
                    comment="the positions' rows")
    scale = f", scale={a['scale']!r}" if a.get("scale") is not None else ""
    tied = ("if not self.has_last:   # the LM head on the last stage reads this weight",
            "    self.{attr}.weight.tied = True") if a.get("_tied_by") else ()
    return Code(build="rt.VocabParallelEmbedding({name}, PADDED_VOCAB, VOCAB, {dim}, tp, SEED, "
                      "sequence_parallel={scatter}" + scale + ", local={local})",
                serve_call="{self}({x}).to(DTYPE)", fold_after=True, init=tied, serve_init=())


def _norm_code(a) -> Code:
    # the residual stream's norms: the program's Norm (RMSNorm or LayerNorm, Gemma's (1 + w)
    # form); MLA's latent norms replicated, run on the whole sequence: their gradient whole
    if a.get("tp") == "replicated":
        return Code(build="rt.whole_grad(rt.RMSNorm({name}, {dim}, NORM_EPS, SEED, tp))")
    return Code(build="Norm({name}, {dim}, NORM_EPS, SEED, tp)")


def _rope_code(a) -> Code:
    common = dict(comment="RoPE at the tokens' global positions",
                  per_head=True, inline=False, var="", heads_in=True, heads_out=True)
    skip = "{x} if {a[nope]!r} else " if "nope" in a else ""   # Llama 4's NoPE layers: a per-layer attribute
    if "start" in a:   # MLA's query: the rotary dims after the first ``start`` of each head (Llama 4: 0)
        inter = ", interleave=True" if a.get("interleave") else ""
        return Code(call=skip + "rt.rope_tail({x}, {a[start]}, *pos.rope" + inter + ")",
                    serve_call="rt.rope_tail_at({x}, {a[start]}, *pos.rope" + inter + ")", **common)
    return Code(call=skip + "rt.apply_rope({x}, *pos.rope)", serve_call="gen.apply_rope_at({x}, *pos.rope)", **common)


def _add_code(a) -> Code:
    # the residual adds drop out the branch they add (attribute ``dropout``, 0 included)
    if "dropout" in a:
        return Code(call="{0} + self.drop({1})", var="x", init=("self.drop = nn.Dropout(DROPOUT)",),
                    serve_call="{0} + {1}", serve_init=())
    return Code(call="{0} + {1}", var="y")


def _redistribute_code(a) -> Code:
    """A conversion inside a decoder layer as a runtime call, by its collectives
    (:func:`convert`'s rule): entering a tensor-parallel region replicated (its gradient
    all-reduced) or sequence-parallel (all-gathered, the gradient reduce-scattered); a
    partial sum all-reduced or reduce-scattered (when no op before it runs it itself)."""
    fwd = tuple((k, ax) for k, ax in a["fwd"] if k in COMM_KINDS)
    bwd = tuple((k, ax) for k, ax in a["bwd"] if k in COMM_KINDS)
    splits = [ax for k, ax in a["fwd"] if k == "split"]
    if not fwd and not bwd and len(splits) == 1 and a.get("_split_dim") is not None:
        # a replicated value split locally (each rank keeps its slice; no collective)
        ax, d = splits[0], a["_split_dim"]
        return Code(call=f"{{x}}.chunk(self.{ax}.size, dim={d})[self.{ax}.index]", var="",
                    comment=f"this rank's slice over {ax}")
    calls = {
        ((), (("all_reduce", "tp"),)): "rt.copy_to_tp({x}, self.tp)",
        ((("all_gather", "tp"),), (("reduce_scatter", "tp"),)): "rt.enter_tp({x}, self.tp, sequence_parallel=True)",
        ((("all_reduce", "tp"),), ()): "rt.reduce_from_tp({x}, self.tp)",
        ((("reduce_scatter", "tp"),), (("all_gather", "tp"),)): "rt.leave_tp({x}, self.tp, sequence_parallel=True)",
        # MLA's replicated down projections under sequence parallelism: the gradient is whole
        # on every rank, so the backward keeps this rank's slice (no collective)
        ((("all_gather", "tp"),), ()): "rt.gather_replicated({x}, self.tp, sequence_parallel=True)",
    }
    if (fwd, bwd) not in calls:
        raise ValueError(f"no program code for the conversion forward {list(fwd)}, backward {list(bwd)}")
    return Code(call=calls[(fwd, bwd)], inline=False, var="")


def _latent_rope_code(a) -> Code:
    inter = ", interleave=True" if a.get("interleave") else ""
    return Code(call="rt.rope_key({0}, {a[rope_dim]}, *pos.rope" + inter + ")", inline=False, operands=("kva",),
                serve_call="rt.rope_key_at({0}, {a[rope_dim]}, *pos.rope" + inter + ")",
                var="k_rope", heads_out=True, comment="the RoPE key, one head shared by all")


def _heads(a) -> dict:
    """``{heads}``: the heads this rank holds, read off the op's local output (``_out_local``,
    the sharded graph's) by its per-head width (MLA's absorbed serving ops, which the
    runtime checks against the weights)."""
    unit = (a.get("latent_dim") or a["out_dim"]).unit
    return {"heads": a["_out_local"][-1] // unit}


def _latent_core_facts(a) -> dict:
    return {**_attention_facts(a), **_heads(a)}


def _attention_code(a) -> Code:
    """The attention core: training's over the step's k and v, serving's over the KV cache;
    MLA's absorbed core (``latent``: serving graphs) over the latent cache (runtime/model/mla.py)."""
    if a.get("latent"):
        return Code(call="rt.latent_attention({0}, {1}, {2}, pos, {a[window]!r}, heads={heads}{kw})",
                    inline=False, operands=("q", "latent", "k_rope"), var="y", heads_in=True, heads_out=True,
                    facts=_latent_core_facts,
                    comment="attends the cached [latent, RoPE key] (one head shared by all); values: the latent")
    return _ATTENTION_CODE


_ATTENTION_CODE = Code(call="rt.attention({0}, {1}, {2}{kw}, dropout=DROPOUT, training=self.training, "
                            "window={a[window]!r}, pos=pos)",
                       inline=False, operands=("q", "k", "v"), var="y", heads_in=True, facts=_attention_facts,
                       comment="causal attention",
                       # serving: k, v stored into the KV cache, the queries attend the cache so far
                       serve_call="gen.serve_attention({0}, {1}, {2}, pos, window={a[window]!r}{kw})")

_PER_HEAD = dict(per_head=True, inline=False, var="", heads_in=True, heads_out=True)

#: the router's keywords beyond the softmax top-k's, by the op's attributes (ir/lower.py sets
#: them only where not the default: DeepSeek-V3's sigmoid, group-limited choice, scaling;
#: Qwen3-MoE's unnormalised weights)
_ROUTER_KEYS = ("norm_topk_prob", "scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor")


def router_keywords(a, bias: bool) -> str:
    """The runtime router's keywords beyond the softmax top-k's (``, scoring_func='sigmoid',
    ...``) from a router op's attributes ``a``; ``bias``: the op has a bias (gpt-oss)."""
    return "".join(f", {k}={a[k]!r}" for k in _ROUTER_KEYS if k in a) + (", router_bias=True" if bias else "")


def experts_keywords(a, bias: bool) -> str:
    """The runtime experts' keywords (``, bias=True, swiglu_clamp=(alpha, limit)``) from an
    experts op's attributes ``a``; ``bias``: its matrices have biases (gpt-oss)."""
    kw = ", bias=True" if bias else ""
    if a.get("swiglu_limit") is not None:   # gpt-oss's clamped SwiGLU
        kw += f", swiglu_clamp=({a['swiglu_alpha']!r}, {a['swiglu_limit']!r})"
    return kw


def _router_facts(a) -> dict:
    return {"kw": router_keywords(a, bool(a.get("_bias")))}


def _moe_axes_facts(a) -> dict:
    """The expert axes the dispatch moves rows over, from its collectives (``_axes``): the
    all-to-alls over ep, the all-gather over expert_tp."""
    axes = a.get("_axes", ())
    kw = "".join(f", {ax}=self.{ax}" for ax in ("ep", "expert_tp") if ax in axes)
    return {"kw": kw + _on_input(a)}


def _on_input(a) -> str:
    """Llama 4's ``probs_on_input``: the dispatch scales each row by its router weight, the
    combine sums the rows unweighted."""
    return ", probs_on_input=True" if a.get("probs_on_input") else ""


def _experts_facts(a) -> dict:
    """The experts' keywords and their axes: the MoE module's ``experts`` (ep, expert_tp),
    or, where the graph splits each expert's inner width over tp (serving with ep = 1:
    ``ffn_axis``), every expert on every tp rank (``rt.ExpertAxes.tensor_parallel``)."""
    axes = "rt.ExpertAxes.tensor_parallel(tp)" if a.get("ffn_axis") == "tp" else "experts"
    return {"kw": experts_keywords(a, bool(a.get("_bias"))), "axes": axes}

#: each op kind's row (a Code, or a function of the op's attributes giving one; rows written
#: in their OpSpec aside: ``softcap``); the loss (the Stage's ``loss``) has none
CODES: dict[str, Any] = {
    "embedding": _embedding_code,
    "add": _add_code,
    "norm": _norm_code,
    "linear": _linear_code,
    "redistribute": _redistribute_code,
    "act": Code(call='rt.ACTIVATIONS["{a[fn]}"]({x})', inline=False),
    "swiglu": Code(call="rt.swiglu({0}, {1})", inline=False, operands=("gate", "up"), comment="silu(gate) * up"),
    "geglu": Code(call="rt.geglu({0}, {1})", inline=False, operands=("gate", "up"), comment="gelu_tanh(gate) * up"),
    # per-head ops between the projections and the core (q, k or v: (B, T, heads, head_dim))
    "rope": _rope_code,
    "qk_norm": Code("QKNorm", ("head_dim", "eps", "zero_centered"), comment="RMSNorm over head_dim, each head alone",
                    **_PER_HEAD),
    "attention": _attention_code,
    # multi-head latent attention (runtime/model/layers.py: rope_key, rope_tail, mla_key)
    "latent_norm": Code(build="rt.whole_grad(rt.RMSNorm({name}, {out_features}, NORM_EPS, SEED, tp))",
                        call="{self}({0}[..., :{a[out_dim].size}])", operands=("kva",), var="latent",
                        comment="the latent, normed"),
    "latent_rope": _latent_rope_code,
    "mla_key": Code(call="rt.mla_key({0}, {1}, {a[nope]})", inline=False, operands=("kv", "k_rope"), var="k",
                    heads_in=True, heads_out=True, comment="[k_nope, rope key] per head"),
    # a MoE layer's routed experts (runtime/model/moe.py; Megatron-Core's all-to-all token dispatcher)
    "router": Code(build="rt.Router({name}, {in_features}, {out_features}, {top_k}, tp, SEED{kw}, "
                         "local={local})",
                   facts=_router_facts, inline=False, var="route",
                   comment="fp32 scores; each token's top-k experts and their weights"),
    "moe_dispatch": Code(call="rt.dispatch({0}, {1}, local_experts={a[local_experts]}{kw})", facts=_moe_axes_facts,
                         inline=False, operands=("x", "route"), var="rows",
                         comment="(token, choice) rows to their experts' ranks, grouped by local expert "
                                 "(as many as the router sends: the shape is the balanced estimate)"),
    "experts": Code(build='rt.GroupedExperts({op}, EXPERTS, HIDDEN, EXPERT_FFN, "{a[activation]}", {axes}, SEED, '
                          "OUT_STD{kw}, local={local}{fp8})",
                    facts=_experts_facts, inline=False, var="",
                    comment="each local expert's MLP on its rows (a grouped GEMM)"),
    "moe_combine": Code(call="rt.combine({0}, {1}, AUX_LOSS_SCALE if self.training else 0.0{kw})",
                        serve_call="rt.combine({0}, {1}{kw})", inline=False, operands=("rows", "route"), var="y",
                        facts=lambda a: {"kw": _on_input(a)},
                        comment="rows back to their tokens, weighted by the router"),
    "mla_value": Code(call="{0}[..., {a[nope]}:].contiguous()", inline=False, operands=("kv",), var="v",
                      heads_in=True, heads_out=True, comment="v per head, its own storage"),
    # MLA's absorbed serving form (ir/lower.py mla_absorbed): the op holding wkv_b turns each
    # head's query into [q_nope W_uk, q_rope]; after the core, W_uv turns its latents into values
    "mla_absorb": Code(build="rt.ColumnParallelLinear({name}, {in_features}, {out_features}, False, tp, SEED, "
                             "local={local})",
                       call="rt.mla_absorb_query({x}, {self}.weight, heads={heads}, nope={a[nope]}, "
                            "v_dim={a[v_head_dim]}, latent={a[in_dim].size})",
                       inline=False, operands=("q",), var="q", heads_in=True, heads_out=True, facts=_heads,
                       comment="[q_nope W_uk, q_rope] per head: wkv_b's key rows absorbed"),
    "mla_value_up": Code(call="rt.mla_value_up({x}, self.{a[weight]}.weight, heads={heads}, nope={a[nope]}, "
                              "v_dim={a[out_dim].unit}, latent={a[latent]})",
                         inline=False, var="y", heads_in=True, facts=_heads,
                         comment="each head's latents times wkv_b's value rows (W_uv)"),
}


__all__ = ["CODES", "COMM_KINDS", "Code", "experts_keywords", "router_keywords"]
