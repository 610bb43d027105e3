"""Lowering: a :class:`ModelConfig` becomes the graph of one micro-batch of the
decoder-only model (forward ops; backward is implied by the op table).

The graph, per micro-batch of ``batch`` sequences of ``seq_len`` tokens::

    tokens -> embedding (+ pos_embedding, when position = learned)
    per layer i (prefix layers.i):
        attn_norm -> attn.wq, attn.wk, attn.wv (-> attn.q_norm, attn.k_norm: qk_norm)
        (-> attn.rope_q, attn.rope_k) -> attn.core
        -> attn.wo -> attn_residual (+ x)
        mlp_norm (reads attn_residual; reads x with parallel_residual, as GPT-NeoX)
        -> mlp.w1 (-> mlp.w3) -> mlp.act -> mlp.w2 -> mlp_residual
    sandwich_norm (Gemma 2/3) adds attn_post_norm after attn.wo and mlp_post_norm after the
    MLP, each before its residual add; a layer's attention window and RoPE base follow
    ``layer_windows`` (sliding-window layers take ``rope_local_base_freq``). Llama 4 adds
    attn.q_l2_norm, attn.k_l2_norm (``l2_norm``, after RoPE) and attn.q_temperature
    (``attn_temperature``) to every layer; per layer (attributes) a NoPE layer's RoPE and L2
    norm pass through, a RoPE layer's temperature does, and its core attends within chunks
    final_norm -> lm_head (-> lm_head.softcap: final_logit_softcapping) -> loss (cross-entropy, with labels)

Multi-head latent attention (MLA, DeepSeek-V2/V3: ``kv_lora_rank > 0``) replaces the
attention between ``attn_norm`` and ``attn.wo``::

    attn_norm -> attn.wq_a -> attn.q_a_norm -> attn.wq_b (or attn.wq alone: q_lora_rank 0)
              -> attn.rope_q (RoPE on the last qk_rope_head_dim of each head)
    attn_norm -> attn.wkv_a (kv_lora_rank + qk_rope_head_dim: the latent and the RoPE key)
              -> attn.kv_a_norm (RMSNorm of the latent) -> attn.wkv_b (per head nope + v)
              -> attn.rope_k (RoPE on the key part, one head shared by all)
    attn.key (per head [k_nope, rope key]), attn.value -> attn.core -> attn.wo

wq_a, wkv_a and the latent norms are replicated over tp; wq_b, wkv_b column-parallel by
heads, wo row-parallel (Megatron-Core's MLASelfAttention). What a serving cache keeps is
the normed latent and the RoPE key (:mod:`parcompile.analysis.kv`).

A serving graph (``lower(..., serve=True)``) lowers MLA in its absorbed form (rule
``mla_absorbed``; DeepSeek-V2 section 2.1.1 and appendix B, vLLM's MLA backend): wkv_b is
not applied to the latent; its key rows are absorbed into each head's query and its value
rows into the output, and the core attends the cached latent and RoPE key::

    ... -> attn.rope_q -> attn.wkv_b (mla_absorb: [q_nope W_uk, q_rope] per head, c + r wide)
    attn.kv_a_norm (latent, c), attn.rope_k (RoPE key, r) -> attn.core (attention, ``latent``:
        one shared "kv head" of c + r, values the latent: per head c wide)
    -> attn.value_up (mla_value_up: y W_uv per head, v wide) -> attn.wo

A mixture-of-experts layer (``experts > 0``, every layer from ``dense_layers`` on; Llama 4:
every ``interleave_moe_layer_step``-th of them, :func:`parcompile.core.model.moe_layer`)
replaces the MLP by::

    mlp_norm -> mlp.router (softmax top-k, fp32 probabilities)
             -> mlp.dispatch (tokens to their top_k experts: all-to-all over ep)
             -> mlp.experts (grouped expert MLPs) -> mlp.combine (all-to-all back,
                weighted sum over the top_k) [+ mlp.shared.* (shared experts, one MLP of
                width shared_experts * expert_ffn_hidden) -> mlp.shared_add] -> mlp_residual

The routed expert weights are stacked parameters ``layers.i.mlp.experts.w1.weight`` of
dims ``(experts, expert_ffn, hidden)`` marked ``expert`` (the runtime holds them as one
tensor per expert, ``layers.i.mlp.experts.<e>.w1.weight``, as Hugging Face Mixtral does).

Lowering rules. ``lower`` is a sequence of named rules, each a function of this module,
chosen from the model keys alone by :func:`select_rules` (the keys are the one declaration
of a model: a family module of :mod:`parcompile.core.families` maps its config.json to
them, and every family of the same structure gets the same rules; a model no family
claims lowers the same way)::

    slot       rule       keys that choose it
    embedding  tokens     position != learned
               learned    position = learned (GPT-2): + pos_embedding
    attention  mha        kv_lora_rank = 0: MHA/GQA (qk_norm, RoPE, sinks, windows as attributes)
               mla        kv_lora_rank > 0 (DeepSeek-V3)
    mlp        gated      activation swiglu/geglu: w1, w3 -> act -> w2
               ungated    other activations: w1 -> act -> w2
               moe        experts > 0, layers from dense_layers on, every interleave_moe_layer_step-th
                          (+ shared experts)
    norms      pre        attn_norm and mlp_norm before each branch
               sandwich   sandwich_norm (Gemma 2/3): + a post norm after each branch
    residual   sequential the MLP reads the attention residual
               parallel   parallel_residual (GPT-NeoX): the MLP reads the layer input
    head       untied     lm_head.weight
               tied       tie_embeddings: lm_head reads embedding.weight
    logits     plain      no final_logit_softcapping
               softcap    final_logit_softcapping (Gemma 2)

A structure no rule builds is a new rule here, chosen by a new model key; a new family of a
known structure is its module and a registry line only.

Parameter names equal the runtime's (``layers.3.attn.wq.weight``); a tied LM head reads
``embedding.weight``. Dims: ``batch``, ``seq``, ``hidden``, ``q`` (heads * head_dim, in
units of head_dim), ``kv``, ``ffn``, ``vocab`` (unpadded here; the tensor-parallel pass
pads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from parcompile.config.schema import ModelConfig
from parcompile.core.model import (GATED_ACTIVATIONS, ROUTER_DEFAULTS, attention_scale, moe_layer, rope_layer,
                                   rope_scaling)
from parcompile.ir.graph import Graph
from parcompile.ir.ops import Param
from parcompile.ir.types import Dim, TensorType


@dataclass(frozen=True)
class Rules:
    """The lowering rules of a model, by name (module docstring's table):
    :func:`select_rules` chooses them from the model keys."""

    embedding: str   # "tokens" | "learned"
    attention: str   # "mha" | "mla" | "mla_absorbed" (serving)
    mlp: str         # the dense layers': "gated" | "ungated"
    moe: bool        # layers from dense_layers on are "moe"
    norms: str       # "pre" | "sandwich"
    residual: str    # "sequential" | "parallel"
    head: str        # "untied" | "tied"
    logits: str      # "plain" | "softcap"

    def layer_mlp(self, m: ModelConfig, i: int) -> str:
        """The MLP rule of layer ``i``: "moe" where :func:`parcompile.core.model.moe_layer`
        (from ``dense_layers`` on, every ``interleave_moe_layer_step``-th), else :attr:`mlp`."""
        return "moe" if self.moe and moe_layer(m, i) else self.mlp


def select_rules(m: ModelConfig, serve: bool = False) -> Rules:
    """The lowering rules of model ``m``, chosen from its keys alone (module docstring);
    ``serve``: the serving graph's (MLA in its absorbed form)."""
    return Rules(
        embedding="learned" if m.position == "learned" else "tokens",
        attention=("mla_absorbed" if serve else "mla") if m.kv_lora_rank else "mha",
        mlp="gated" if m.activation in GATED_ACTIVATIONS else "ungated",
        moe=m.experts > 0,
        norms="sandwich" if m.sandwich_norm else "pre",
        residual="parallel" if m.parallel_residual else "sequential",
        head="tied" if m.tie_embeddings else "untied",
        logits="plain" if m.final_logit_softcapping is None else "softcap",
    )


class Lowering:
    """What every rule builds with: the model ``m``, its :class:`Rules`, the graph ``g``
    being built, the dims of one micro-batch of ``batch`` sequences and the spec
    ``origin`` recorded on every op; :meth:`op` adds one op, :meth:`norm`,
    :meth:`qk_norm` and :meth:`linear` the ops every rule shares."""

    def __init__(self, m: ModelConfig, batch: int, origin: Any, serve: bool = False):
        self.m, self.g, self.origin, self.rules = m, Graph(), origin, select_rules(m, serve)
        self.B, self.S, self.H = Dim("batch", batch), Dim("seq", m.seq_len), Dim("hidden", m.hidden)
        self.Q = Dim("q", m.heads * m.head_dim, m.head_dim)
        self.KV = Dim("kv", m.kv_heads * m.head_dim, m.head_dim)
        self.F = Dim("ffn", m.ffn_hidden)
        self.V = Dim("vocab", m.vocab)
        # Gemma's RMSNorm: x / rms(x) * (1 + w) (an attribute only where set: other graphs print as before)
        self.centered = {"zero_centered": True} if m.zero_centered_gamma else {}

    def T(self, *dims: Dim) -> TensorType:
        """A tensor of ``dims`` in the model's dtype."""
        return TensorType(tuple(dims), self.m.dtype)

    def op(self, name: str, kind: str, inputs: list[str], attrs: dict, params: list[Param] | None = None,
           layer: int | None = None) -> str:
        """Add op ``name`` of ``kind`` (:meth:`parcompile.ir.graph.Graph.add_op`) with the origin."""
        return self.g.add_op(name, kind, inputs, attrs, params=params or [], layer=layer, origin=self.origin)

    def norm(self, name: str, x: str, layer: int | None) -> str:
        """The model's norm of the residual stream ``x`` (LayerNorm has a bias)."""
        m = self.m
        ps = [Param(f"{name}.weight", self.T(self.H))]
        if m.norm == "layernorm":
            ps.append(Param(f"{name}.bias", self.T(self.H)))
        return self.op(name, "norm", [x], {"norm": m.norm, "eps": m.norm_eps, "tp": "residual", **self.centered},
                       ps, layer)

    def qk_norm(self, name: str, x: str, layer: int) -> str:
        """One (head_dim,) RMSNorm weight shared by every head of q (or k): tp-local."""
        m = self.m
        return self.op(name, "qk_norm", [x], {"eps": m.norm_eps, "head_dim": m.head_dim, "tp": "per_head",
                                              **self.centered},
                       [Param(f"{name}.weight", self.T(Dim("head_dim", m.head_dim)))], layer)

    def linear(self, name: str, x: str, in_dim: Dim, out_dim: Dim, bias: bool, style: str,
               layer: int | None, weight_name: str | None = None) -> str:
        """``x @ W.T (+ b)``, W ``(out_dim, in_dim)``, tensor-parallel ``style``."""
        ps = [Param(weight_name or f"{name}.weight", self.T(out_dim, in_dim))]
        if bias:
            ps.append(Param(f"{name}.bias", self.T(out_dim)))
        return self.op(name, "linear", [x], {"in_dim": in_dim, "out_dim": out_dim, "bias": bias, "tp": style},
                       ps, layer)

    def scores(self) -> dict[str, Any]:
        """The attention scores' attributes: the scale (where not 1/sqrt(head_dim)) and
        Gemma 2's soft cap ``cap * tanh(scores / cap)``, before the mask."""
        scale = attention_scale(self.m)
        out: dict[str, Any] = {"scale": scale} if scale is not None else {}
        if self.m.attn_logit_softcapping is not None:
            out["softcap"] = self.m.attn_logit_softcapping
        return out


# --------------------------------------------------------------------------- embedding


def embed_tokens(L: Lowering, tokens: str) -> str:
    """Rule ``tokens``: the word embedding (Gemma: times sqrt(hidden))."""
    m = L.m
    scale = {"scale": m.hidden ** 0.5} if m.scale_embeddings else {}
    return L.op("embedding", "embedding", [tokens],
                {"out_dim": L.H, "dtype": m.dtype, "tp": "vocab_embedding", **scale},
                [Param("embedding.weight", L.T(L.V, L.H))])


def embed_learned(L: Lowering, tokens: str) -> str:
    """Rule ``learned`` (GPT-2): the word embedding plus a learned position embedding."""
    x = embed_tokens(L, tokens)
    pos = L.op("pos_embedding", "embedding", [tokens],
               {"out_dim": L.H, "dtype": L.m.dtype, "tp": "residual", "positional": True},
               [Param("pos_embedding.weight", L.T(Dim("position", L.m.max_positions), L.H))])
    # positions join the residual stream: split on seq with sequence parallelism, so
    # the word embedding's partial sum is reduce-scattered once (no all-reduce)
    return L.op("embedding.pos_add", "add", [x, pos], {"tp": "residual"})


# --------------------------------------------------------------------------- attention


def mha(L: Lowering, p: str, h: str, i: int) -> str:
    """Rule ``mha``: multi-head (grouped-query) attention of layer ``i`` (prefix ``p``)
    on ``h``: wq, wk, wv column-parallel (qk_norm, RoPE with the layer's base, sinks,
    the layer's window), wo row-parallel."""
    m = L.m
    window = m.layer_windows[i]
    q = L.linear(f"{p}.attn.wq", h, L.H, L.Q, m.qkv_bias, "column", i)
    k = L.linear(f"{p}.attn.wk", h, L.H, L.KV, m.qkv_bias, "column", i)
    v = L.linear(f"{p}.attn.wv", h, L.H, L.KV, m.qkv_bias, "column", i)
    if m.qk_norm:
        q, k = L.qk_norm(f"{p}.attn.q_norm", q, i), L.qk_norm(f"{p}.attn.k_norm", k, i)
    # Llama 4: every layer has the same ops; a NoPE layer's RoPE and L2 norm are marked `nope`
    # (a per-layer attribute: they pass q and k through), its core scales q by position
    nope = {} if rope_layer(m, i) else {"nope": True}
    if m.position == "rope":
        # Gemma 3: the sliding-window layers have a RoPE base of their own, unscaled
        local = bool(window) and m.rope_local_base_freq is not None
        local_theta = m.rope_local_base_freq if m.rope_local_base_freq is not None else m.rope_theta
        ra = {"theta": local_theta if window else m.rope_theta, "fraction": m.rotary_fraction, "tp": "shard_last",
              **nope}
        scaling = rope_scaling(m)
        if scaling is not None and not local:   # scaling of the rope_theta layers
            ra["scaling"] = tuple(sorted(scaling.items()))
        if m.rope_interleave:   # Llama 4's complex pairs: q and k permuted alike, their dot products unchanged
            ra.update(start=0, interleave=True)
        q = L.op(f"{p}.attn.rope_q", "rope", [q], ra, layer=i)
        k = L.op(f"{p}.attn.rope_k", "rope", [k], ra, layer=i)
    if m.qk_l2_norm:   # Llama 4: after RoPE, no weight
        l2 = {"eps": m.norm_eps, "head_dim": m.head_dim, "tp": "shard_last", **nope}
        q, k = (L.op(f"{p}.attn.{n}_l2_norm", "l2_norm", [x], l2, layer=i) for n, x in (("q", q), ("k", k)))
    if m.attn_temperature_tuning and m.nope_layer_interval:   # Llama 4: q on the NoPE layers
        q = L.op(f"{p}.attn.q_temperature", "attn_temperature", [q], {
            "floor_scale": m.floor_scale, "attn_scale": m.attn_scale, "tp": "shard_last",
            **({} if nope else {"rope": True})}, layer=i)
    chunk = m.attention_chunk_size if not nope else 0
    sinks = [Param(f"{p}.attn.sinks", L.T(Dim("heads", m.heads)))] if m.attention_sinks else []
    a = L.op(f"{p}.attn.core", "attention", [q, k, v], {
        "heads": m.heads, "kv_heads": m.kv_heads, "head_dim": m.head_dim, "seq_len": m.seq_len,
        "window": window, "impl": m.attention, "dropout": m.dropout, "causal": True,
        "tp": "shard_last", **L.scores(), **({"sinks": True} if sinks else {}),
        **({"chunk": chunk} if chunk else {}),
    }, sinks, i)
    return L.linear(f"{p}.attn.wo", a, L.Q, L.H, m.bias, "row", i)


def _mla_inputs(L: Lowering, p: str, h: str, i: int, latent_head: bool = False) -> tuple[str, str, str, str]:
    """What both MLA rules share: the query (wq_a -> q_a_norm -> wq_b, or wq; RoPE on each
    head's last qk_rope_head_dim), the latent (wkv_a, its first kv_lora_rank normed) and the
    RoPE key (wkv_a's last qk_rope_head_dim, rotated, one head shared by all). Returns
    (query, wkv_a's output, latent, RoPE key); the query's RoPE is added after the key's.
    ``latent_head``: the latent is one head (its dim's unit the whole latent), as the
    absorbed core reads it."""
    m = L.m
    nope, rd = m.qk_nope_head_dim, m.qk_rope_head_dim
    QK = Dim("q", m.heads * (nope + rd), nope + rd)
    latent_norm = {"eps": m.norm_eps, "tp": "replicated"}
    if m.q_lora_rank:
        QL = Dim("q_lora", m.q_lora_rank)
        qa = L.linear(f"{p}.attn.wq_a", h, L.H, QL, m.qkv_bias, "replicated", i)
        qa = L.op(f"{p}.attn.q_a_norm", "norm", [qa], {"norm": "rmsnorm", **latent_norm},
                  [Param(f"{p}.attn.q_a_norm.weight", L.T(QL))], i)
        q = L.linear(f"{p}.attn.wq_b", qa, QL, QK, False, "column", i)
    else:
        q = L.linear(f"{p}.attn.wq", h, L.H, QK, False, "column", i)
    KVL = Dim("kv_lora", m.kv_lora_rank, m.kv_lora_rank if latent_head else 1)
    kva = L.linear(f"{p}.attn.wkv_a", h, L.H, Dim("kv_a", m.kv_lora_rank + rd), m.qkv_bias, "replicated", i)
    c = L.op(f"{p}.attn.kv_a_norm", "latent_norm", [kva], {"out_dim": KVL, **latent_norm},
             [Param(f"{p}.attn.kv_a_norm.weight", L.T(KVL))], i)
    ra = {"theta": m.rope_theta, "rope_dim": rd, "tp": "replicated",
          **({"interleave": True} if m.rope_interleave else {})}
    scaling = rope_scaling(m)
    if scaling is not None:
        ra["scaling"] = tuple(sorted(scaling.items()))
    kr = L.op(f"{p}.attn.rope_k", "latent_rope", [kva], {**ra, "out_dim": Dim("rope_k", rd)}, layer=i)
    q = L.op(f"{p}.attn.rope_q", "rope", [q], {**ra, "tp": "shard_last", "start": nope}, layer=i)
    return q, kva, c, kr


def mla(L: Lowering, p: str, h: str, i: int) -> str:
    """Rule ``mla``: multi-head latent attention (DeepSeek-V2/V3; module docstring) of
    layer ``i``: the down projections and their norms replicated over tp, the up
    projections column-parallel by heads, the RoPE key shared by every head (its gradient
    a partial sum over tp)."""
    m = L.m
    nope, rd, vd = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    q, _, c, kr = _mla_inputs(L, p, h, i)
    QK = L.g.node(q).type.dim("q")
    KVL = L.g.node(c).type.dim("kv_lora")
    kv = L.linear(f"{p}.attn.wkv_b", c, KVL, Dim("kv_b", m.heads * (nope + vd), nope + vd), False, "column", i)
    k = L.op(f"{p}.attn.key", "mla_key", [kv, kr], {"nope": nope, "out_dim": Dim("k", QK.size, QK.unit),
                                                   "tp": "mla_key"}, layer=i)
    v = L.op(f"{p}.attn.value", "mla_value", [kv], {"nope": nope, "out_dim": Dim("v", m.heads * vd, vd),
                                                   "tp": "shard_last"}, layer=i)
    a = L.op(f"{p}.attn.core", "attention", [q, k, v], {
        "heads": m.heads, "kv_heads": m.heads, "head_dim": nope + rd, "v_head_dim": vd, "seq_len": m.seq_len,
        "window": m.layer_windows[i], "impl": m.attention, "dropout": m.dropout, "causal": True,
        "tp": "shard_last", **L.scores(),
    }, layer=i)
    return L.linear(f"{p}.attn.wo", a, Dim("v", m.heads * vd, vd), L.H, m.bias, "row", i)


def mla_absorbed(L: Lowering, p: str, h: str, i: int) -> str:
    """Rule ``mla_absorbed``: the serving form of multi-head latent attention (module
    docstring; DeepSeek-V2 section 2.1.1 "the absorbed form", vLLM's MLA backend). Per head
    (H heads, split over tp like ``mla``'s), with n/r/v the nope/rope/value head dims and c
    kv_lora_rank: ``attn.wkv_b`` (``mla_absorb``) holds wkv_b (H (n + v), c), column-parallel
    by heads, and turns each query (n + r) into ``[q_nope W_uk, q_rope]`` (c + r); the core
    (``attention`` with ``latent`` c) attends keys ``[latent, RoPE key]`` (c + r, one head
    shared by all, what the cache keeps per token) and values the latent (c); ``attn.value_up``
    (``mla_value_up``) applies W_uv per head (c -> v). The parameters are ``mla``'s."""
    m = L.m
    nope, rd, vd, c_rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    q, _, c, kr = _mla_inputs(L, p, h, i, latent_head=True)
    QK = L.g.node(q).type.dim("q")
    KVL = L.g.node(c).type.dim("kv_lora")
    KVB = Dim("kv_b", m.heads * (nope + vd), nope + vd)
    QL = Dim("q_latent", m.heads * (c_rank + rd), c_rank + rd)
    ql = L.op(f"{p}.attn.wkv_b", "mla_absorb", [q], {
        "in_dim": KVL, "out_dim": KVB, "q_dim": QK, "latent_dim": QL, "nope": nope, "v_head_dim": vd,
        "tp": "mla_absorb"}, [Param(f"{p}.attn.wkv_b.weight", L.T(KVB, KVL))], i)
    YL = Dim("y_latent", m.heads * c_rank, c_rank)
    y = L.op(f"{p}.attn.core", "attention", [ql, c, kr], {
        "heads": m.heads, "kv_heads": 1, "head_dim": c_rank + rd, "v_head_dim": c_rank, "latent": c_rank,
        "out_dim": YL, "seq_len": m.seq_len, "window": m.layer_windows[i], "impl": m.attention,
        "dropout": m.dropout, "causal": True, "tp": "latent_core",
        # the scores' scale stays the query's (n + r), not the latent key's width
        **L.scores(), "scale": attention_scale(m) or (nope + rd) ** -0.5,
    }, layer=i)
    V = Dim("v", m.heads * vd, vd)
    v = L.op(f"{p}.attn.value_up", "mla_value_up", [y], {
        "weight": "wkv_b", "nope": nope, "latent": c_rank, "out_dim": V, "tp": "shard_last"}, layer=i)
    return L.linear(f"{p}.attn.wo", v, V, L.H, m.bias, "row", i)


# --------------------------------------------------------------------------- MLP


def _clamp(m: ModelConfig) -> dict[str, Any]:
    """gpt-oss's clamped SwiGLU attributes (none where unset)."""
    return ({"swiglu_alpha": m.swiglu_alpha, "swiglu_limit": m.swiglu_limit}
            if m.swiglu_limit is not None or m.swiglu_alpha is not None else {})


def gated_mlp(L: Lowering, prefix: str, x: str, width: Dim, i: int) -> str:
    """Rule ``gated``: ``w2(act(w1 x) * w3 x)``, w1 and w3 column-parallel, w2 row-parallel."""
    m = L.m
    gate = L.linear(f"{prefix}.w1", x, L.H, width, m.bias, "column", i)
    up = L.linear(f"{prefix}.w3", x, L.H, width, m.bias, "column", i)
    act = L.op(f"{prefix}.act", m.activation, [gate, up], {"tp": "shard_last", **_clamp(m)}, layer=i)
    return L.linear(f"{prefix}.w2", act, width, L.H, m.bias, "row", i)


def ungated_mlp(L: Lowering, prefix: str, x: str, width: Dim, i: int) -> str:
    """Rule ``ungated``: ``w2(act(w1 x))``, w1 column-parallel, w2 row-parallel."""
    m = L.m
    f1 = L.linear(f"{prefix}.w1", x, L.H, width, m.bias, "column", i)
    act = L.op(f"{prefix}.act", "act", [f1], {"fn": m.activation, "tp": "shard_last"}, layer=i)
    return L.linear(f"{prefix}.w2", act, width, L.H, m.bias, "row", i)


def _router_kind(m: ModelConfig) -> dict[str, Any]:
    """DeepSeek-V3's router (runtime/model/moe.py: route), attributes only where not the softmax
    top-k's; the groups only with noaux_tc (whose correction bias (E,) fp32 is a buffer);
    ``norm_topk_prob`` only where false."""
    out = {k: getattr(m, k) for k, default in ROUTER_DEFAULTS.items() if getattr(m, k) != default
           and (m.topk_method == "noaux_tc" or k not in ("n_group", "topk_group"))}
    if not m.norm_topk_prob:   # the chosen weights as they are (Qwen3-MoE's norm_topk_prob = false)
        out["norm_topk_prob"] = False
    return out


def moe(L: Lowering, prefix: str, x: str, width: Dim, i: int) -> str:
    """Rule ``moe``: router -> dispatch -> grouped experts -> combine (module docstring),
    plus the shared experts as one dense MLP of ``shared_experts * expert_ffn_hidden``.
    Token-wise ops split on seq over tp like the residual stream with sequence parallelism
    (Megatron-Core dispatches sequence-parallel tokens). ``width`` is unused (the experts'
    is ``expert_ffn_hidden``)."""
    m = L.m
    E, FE = Dim("experts", m.experts), Dim("expert_ffn", m.expert_ffn_hidden)
    common = {"experts": m.experts, "top_k": m.top_k, "tp": "residual"}
    # the router runs in fp32: a 16-bit model's router keeps an fp32 copy of its input
    rps = [Param(f"{prefix}.router.weight", L.T(E, L.H))] + ([Param(f"{prefix}.router.bias", L.T(E))]
                                                            if m.router_bias else [])
    router = L.op(f"{prefix}.router", "router", [x],
                  {**common, "in_dim": L.H, "out_dim": E, "fp32_input": m.dtype != "fp32", **_router_kind(m)},
                  rps, i)
    on_input = {"probs_on_input": True} if m.moe_apply_probs_on_input else {}   # Llama 4
    routed = L.op(f"{prefix}.dispatch", "moe_dispatch", [x, router],
                  {**common, "topk_dim": Dim("topk", m.top_k), **on_input}, layer=i)
    mats = ["w1", "w3", "w2"] if m.activation in GATED_ACTIVATIONS else ["w1", "w2"]
    eps = [Param(f"{prefix}.experts.{w}.weight", L.T(E, L.H, FE) if w == "w2" else L.T(E, FE, L.H), expert=True)
           for w in mats]
    if m.bias:   # gpt-oss: every expert matrix has a bias
        eps += [Param(f"{prefix}.experts.{w}.bias", L.T(E, L.H) if w == "w2" else L.T(E, FE), expert=True)
                for w in mats]
    out = L.op(f"{prefix}.experts", "experts", [routed],
               {**common, "ffn": m.expert_ffn_hidden, "activation": m.activation, **_clamp(m)}, eps, i)
    y = L.op(f"{prefix}.combine", "moe_combine", [out, router], {**common, **on_input}, layer=i)
    if m.shared_experts:
        dense = MLP[L.rules.mlp]
        shared = dense(L, f"{prefix}.shared", x, Dim("shared_ffn", m.shared_experts * m.expert_ffn_hidden), i)
        y = L.op(f"{prefix}.shared_add", "add", [y, shared], {"tp": "residual"}, layer=i)
    return y


# --------------------------------------------------------------------------- layer, head

EMBEDDING: dict[str, Callable[[Lowering, str], str]] = {"tokens": embed_tokens, "learned": embed_learned}
ATTENTION: dict[str, Callable[[Lowering, str, str, int], str]] = {"mha": mha, "mla": mla,
                                                                   "mla_absorbed": mla_absorbed}
MLP: dict[str, Callable[[Lowering, str, str, Dim, int], str]] = {
    "gated": gated_mlp, "ungated": ungated_mlp, "moe": moe}


def decoder_layer(L: Lowering, x: str, i: int) -> str:
    """Layer ``i`` on the residual stream ``x``: the norms (``pre``, or ``sandwich``: a post
    norm after each branch, before its residual add), the attention rule, the residual
    (``sequential``, or ``parallel``: the MLP's norm reads ``x``), the layer's MLP rule."""
    m, r, p = L.m, L.rules, f"layers.{i}"
    o = ATTENTION[r.attention](L, p, L.norm(f"{p}.attn_norm", x, i), i)
    if r.norms == "sandwich":
        o = L.norm(f"{p}.attn_post_norm", o, i)
    r1 = L.op(f"{p}.attn_residual", "add", [x, o], {"dropout": m.dropout, "tp": "residual"}, layer=i)
    h2 = L.norm(f"{p}.mlp_norm", x if r.residual == "parallel" else r1, i)
    d = MLP[r.layer_mlp(m, i)](L, f"{p}.mlp", h2, L.F, i)
    if r.norms == "sandwich":
        d = L.norm(f"{p}.mlp_post_norm", d, i)
    return L.op(f"{p}.mlp_residual", "add", [r1, d], {"dropout": m.dropout, "tp": "residual"}, layer=i)


def head(L: Lowering, x: str) -> str:
    """The final norm and the LM head (rule ``untied``, or ``tied``: it reads
    ``embedding.weight``), then logits rule ``softcap`` (Gemma 2: ``cap * tanh(logits /
    cap)``, per vocab shard) or ``plain``. Returns the logits."""
    fn = L.norm("final_norm", x, None)
    tied = L.rules.head == "tied"
    logits = L.linear("lm_head", fn, L.H, L.V, False, "column", None,
                      weight_name="embedding.weight" if tied else "lm_head.weight")
    if tied:
        nd = L.g.node(logits)
        L.g.set_params(logits, [Param("embedding.weight", nd.params[0].type, tied_to="embedding.weight")])
    if L.rules.logits == "softcap":
        logits = L.op("lm_head.softcap", "softcap", [logits], {"cap": L.m.final_logit_softcapping,
                                                               "tp": "shard_last"})
    return logits


def lower(model: ModelConfig, batch: int = 1, origin=None, serve: bool = False) -> Graph:
    """Build the forward graph of ``model`` for one micro-batch of ``batch`` sequences
    (global over data-parallel ranks; the data-parallel pass splits it) from the rules
    :func:`select_rules` chooses; ``serve``: the serving graph (the same parameters; MLA
    in its absorbed form, rule ``mla_absorbed``).

    ``origin`` (a Span) is recorded on every op.
    """
    L = Lowering(model, batch, origin, serve)
    rep = "replicated"
    tokens = L.op("tokens", "input", [], {"dims": (L.B, L.S), "dtype": "int64", "tp": rep})
    x = EMBEDDING[L.rules.embedding](L, tokens)
    for i in range(model.layers):
        x = decoder_layer(L, x, i)
    logits = head(L, x)
    labels = L.op("labels", "input", [], {"dims": (L.B, L.S), "dtype": "int64", "tp": rep})
    L.op("loss", "cross_entropy", [logits, labels], {"tp": "vocab_loss"})
    return L.g
