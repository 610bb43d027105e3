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
    ``layer_windows`` (sliding-window layers take ``rope_local_base_freq``)
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

A mixture-of-experts layer (``experts > 0``, every layer from ``dense_layers`` on)
replaces the MLP by::

    mlp_norm -> mlp.router (softmax top-k, fp32 probabilities)
             -> mlp.dispatch (tokens to their top_k experts: all-to-all over ep)
             -> mlp.experts (grouped expert MLPs) -> mlp.combine (all-to-all back,
                weighted sum over the top_k) [+ mlp.shared.* (shared experts, one MLP of
                width shared_experts * expert_ffn_hidden) -> mlp.shared_add] -> mlp_residual

The routed expert weights are stacked parameters ``layers.i.mlp.experts.w1.weight`` of
dims ``(experts, expert_ffn, hidden)`` marked ``expert`` (the runtime holds them as one
tensor per expert, ``layers.i.mlp.experts.<e>.w1.weight``, as Hugging Face Mixtral does).

Parameter names equal the runtime's (``layers.3.attn.wq.weight``); a tied LM head reads
``embedding.weight``. Dims: ``batch``, ``seq``, ``hidden``, ``q`` (heads * head_dim, in
units of head_dim), ``kv``, ``ffn``, ``vocab`` (unpadded here; the tensor-parallel pass
pads it).
"""

from __future__ import annotations

from parcompile.config.schema import ModelConfig
from parcompile.core.model import GATED_ACTIVATIONS, ROUTER_DEFAULTS, attention_scale, rope_scaling
from parcompile.ir.graph import Graph
from parcompile.ir.ops import Param
from parcompile.ir.types import Dim, TensorType


def lower(model: ModelConfig, batch: int = 1, origin=None) -> Graph:
    """Build the forward graph of ``model`` for one micro-batch of ``batch`` sequences
    (global over data-parallel ranks; the data-parallel pass splits it).

    ``origin`` (a Span) is recorded on every op.
    """
    m = model
    g = Graph()
    dt = m.dtype
    B, S, H = Dim("batch", batch), Dim("seq", m.seq_len), Dim("hidden", m.hidden)
    Q = Dim("q", m.heads * m.head_dim, m.head_dim)
    KV = Dim("kv", m.kv_heads * m.head_dim, m.head_dim)
    F = Dim("ffn", m.ffn_hidden)
    V = Dim("vocab", m.vocab)
    rep = "replicated"
    # Gemma's RMSNorm: x / rms(x) * (1 + w) (an attribute only where set: other graphs print as before)
    centered = {"zero_centered": True} if m.zero_centered_gamma else {}
    # gpt-oss's clamped SwiGLU
    clamp = ({"swiglu_alpha": m.swiglu_alpha, "swiglu_limit": m.swiglu_limit}
             if m.swiglu_limit is not None or m.swiglu_alpha is not None else {})
    # DeepSeek-V3's router (runtime/moe.py: route), attributes only where not the softmax top-k's;
    # the groups only with noaux_tc (whose correction bias (E,) fp32 is a buffer: no parameter)
    router_kind = {k: getattr(m, k) for k, default in ROUTER_DEFAULTS.items() if getattr(m, k) != default
                   and (m.topk_method == "noaux_tc" or k not in ("n_group", "topk_group"))}

    def T(*dims: Dim) -> TensorType:
        return TensorType(tuple(dims), dt)

    def norm(name: str, x: str, layer: int | None) -> str:
        ps = [Param(f"{name}.weight", T(H))]
        if m.norm == "layernorm":
            ps.append(Param(f"{name}.bias", T(H)))
        return g.add_op(name, "norm", [x], {"norm": m.norm, "eps": m.norm_eps, "tp": "residual", **centered},
                        params=ps, layer=layer, origin=origin)

    def qk_norm(name: str, x: str, layer: int) -> str:
        # one (head_dim,) RMSNorm weight shared by every head of q (or k): tp-local
        return g.add_op(name, "qk_norm", [x], {"eps": m.norm_eps, "head_dim": m.head_dim, "tp": "per_head",
                                               **centered},
                        params=[Param(f"{name}.weight", T(Dim("head_dim", m.head_dim)))], layer=layer,
                        origin=origin)

    def linear(name: str, x: str, in_dim: Dim, out_dim: Dim, bias: bool, style: str,
               layer: int | None, weight_name: str | None = None) -> str:
        ps = [Param(weight_name or f"{name}.weight", T(out_dim, in_dim))]
        if bias:
            ps.append(Param(f"{name}.bias", T(out_dim)))
        return g.add_op(name, "linear", [x], {"in_dim": in_dim, "out_dim": out_dim, "bias": bias, "tp": style},
                        params=ps, layer=layer, origin=origin)

    def mlp(prefix: str, h2: str, F: Dim, i: int) -> str:
        if m.activation in GATED_ACTIVATIONS:   # act(gate) * up
            gate = linear(f"{prefix}.w1", h2, H, F, m.bias, "column", i)
            up = linear(f"{prefix}.w3", h2, H, F, m.bias, "column", i)
            act = g.add_op(f"{prefix}.act", m.activation, [gate, up], {"tp": "shard_last", **clamp}, layer=i,
                           origin=origin)
        else:
            f1 = linear(f"{prefix}.w1", h2, H, F, m.bias, "column", i)
            act = g.add_op(f"{prefix}.act", "act", [f1], {"fn": m.activation, "tp": "shard_last"},
                           layer=i, origin=origin)
        return linear(f"{prefix}.w2", act, F, H, m.bias, "row", i)

    def moe(prefix: str, h2: str, i: int) -> str:
        # token-wise ops: like residual-stream ops, split on seq over tp with sequence
        # parallelism (Megatron-Core dispatches sequence-parallel tokens)
        E, K = Dim("experts", m.experts), Dim("topk", m.top_k)
        FE = Dim("expert_ffn", m.expert_ffn_hidden)
        common = {"experts": m.experts, "top_k": m.top_k, "tp": "residual"}
        # the router runs in fp32: a 16-bit model's router keeps an fp32 copy of its input
        rps = [Param(f"{prefix}.router.weight", T(E, H))] + ([Param(f"{prefix}.router.bias", T(E))]
                                                              if m.router_bias else [])
        router = g.add_op(f"{prefix}.router", "router", [h2],
                          {**common, "in_dim": H, "out_dim": E, "fp32_input": m.dtype != "fp32", **router_kind},
                          params=rps, layer=i, origin=origin)
        routed = g.add_op(f"{prefix}.dispatch", "moe_dispatch", [h2, router], {**common, "topk_dim": K},
                          layer=i, origin=origin)
        mats = ["w1", "w3", "w2"] if m.activation in GATED_ACTIVATIONS else ["w1", "w2"]
        eps = [Param(f"{prefix}.experts.{w}.weight", T(E, H, FE) if w == "w2" else T(E, FE, H), expert=True)
               for w in mats]
        if m.bias:   # gpt-oss: every expert matrix has a bias
            eps += [Param(f"{prefix}.experts.{w}.bias", T(E, H) if w == "w2" else T(E, FE), expert=True)
                    for w in mats]
        out = g.add_op(f"{prefix}.experts", "experts", [routed],
                       {**common, "ffn": m.expert_ffn_hidden, "activation": m.activation, **clamp}, params=eps,
                       layer=i, origin=origin)
        y = g.add_op(f"{prefix}.combine", "moe_combine", [out, router], common, layer=i, origin=origin)
        if m.shared_experts:
            shared = mlp(f"{prefix}.shared", h2, Dim("shared_ffn", m.shared_experts * m.expert_ffn_hidden), i)
            y = g.add_op(f"{prefix}.shared_add", "add", [y, shared], {"tp": "residual"}, layer=i, origin=origin)
        return y

    tokens = g.add_op("tokens", "input", [], {"dims": (B, S), "dtype": "int64", "tp": rep}, origin=origin)
    scale = {"scale": m.hidden ** 0.5} if m.scale_embeddings else {}   # Gemma: times sqrt(hidden)
    x = g.add_op("embedding", "embedding", [tokens], {"out_dim": H, "dtype": dt, "tp": "vocab_embedding", **scale},
                 params=[Param("embedding.weight", T(V, H))], origin=origin)
    if m.position == "learned":
        pos = g.add_op("pos_embedding", "embedding", [tokens],
                       {"out_dim": H, "dtype": dt, "tp": "residual", "positional": True},
                       params=[Param("pos_embedding.weight", T(Dim("position", m.max_positions), H))], origin=origin)
        # positions join the residual stream: split on seq with sequence parallelism, so
        # the word embedding's partial sum is reduce-scattered once (no all-reduce)
        x = g.add_op("embedding.pos_add", "add", [x, pos], {"tp": "residual"}, origin=origin)

    rope = m.position == "rope"
    windows = m.layer_windows
    # Gemma 3: the sliding-window layers have a RoPE base of their own
    local_theta = m.rope_local_base_freq if m.rope_local_base_freq is not None else m.rope_theta
    scaling = rope_scaling(m)
    scale = attention_scale(m)
    scores = {"scale": scale} if scale is not None else {}
    if m.attn_logit_softcapping is not None:   # Gemma 2: cap * tanh(scores / cap), before the mask
        scores["softcap"] = m.attn_logit_softcapping

    def mla(p: str, h: str, i: int) -> str:
        # multi-head latent attention (DeepSeek-V2/V3; module docstring): the down projections
        # and their norms replicated over tp, the up projections column-parallel by heads,
        # the RoPE key shared by every head (its gradient a partial sum over tp)
        nope, rd, vd = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        QK = Dim("q", m.heads * (nope + rd), nope + rd)
        latent_norm = {"eps": m.norm_eps, "tp": "replicated"}
        if m.q_lora_rank:
            QL = Dim("q_lora", m.q_lora_rank)
            qa = linear(f"{p}.attn.wq_a", h, H, QL, m.qkv_bias, "replicated", i)
            qa = g.add_op(f"{p}.attn.q_a_norm", "norm", [qa], {"norm": "rmsnorm", **latent_norm},
                          params=[Param(f"{p}.attn.q_a_norm.weight", T(QL))], layer=i, origin=origin)
            q = linear(f"{p}.attn.wq_b", qa, QL, QK, False, "column", i)
        else:
            q = linear(f"{p}.attn.wq", h, H, QK, False, "column", i)
        KVA = Dim("kv_a", m.kv_lora_rank + rd)
        KVL = Dim("kv_lora", m.kv_lora_rank)
        KVB = Dim("kv_b", m.heads * (nope + vd), nope + vd)
        kva = linear(f"{p}.attn.wkv_a", h, H, KVA, m.qkv_bias, "replicated", i)
        c = g.add_op(f"{p}.attn.kv_a_norm", "latent_norm", [kva], {"out_dim": KVL, **latent_norm},
                     params=[Param(f"{p}.attn.kv_a_norm.weight", T(KVL))], layer=i, origin=origin)
        ra = {"theta": m.rope_theta, "rope_dim": rd, "tp": "replicated", **interleave}
        if scaling is not None:
            ra["scaling"] = tuple(sorted(scaling.items()))
        kr = g.add_op(f"{p}.attn.rope_k", "latent_rope", [kva], {**ra, "out_dim": Dim("rope_k", rd)},
                      layer=i, origin=origin)
        q = g.add_op(f"{p}.attn.rope_q", "rope", [q], {**ra, "tp": "shard_last", "start": nope}, layer=i,
                     origin=origin)
        kv = linear(f"{p}.attn.wkv_b", c, KVL, KVB, False, "column", i)
        k = g.add_op(f"{p}.attn.key", "mla_key", [kv, kr], {"nope": nope, "out_dim": Dim("k", QK.size, QK.unit),
                                                          "tp": "mla_key"}, layer=i, origin=origin)
        v = g.add_op(f"{p}.attn.value", "mla_value", [kv], {"nope": nope, "out_dim": Dim("v", m.heads * vd, vd),
                                                          "tp": "shard_last"}, layer=i, origin=origin)
        a = g.add_op(f"{p}.attn.core", "attention", [q, k, v], {
            "heads": m.heads, "kv_heads": m.heads, "head_dim": nope + rd, "v_head_dim": vd, "seq_len": m.seq_len,
            "window": windows[i], "impl": m.attention, "dropout": m.dropout, "causal": True,
            "tp": "shard_last", **scores,
        }, layer=i, origin=origin)
        return linear(f"{p}.attn.wo", a, Dim("v", m.heads * vd, vd), H, m.bias, "row", i)

    def mha(p: str, h: str, i: int) -> str:
        # multi-head (grouped-query) attention: wq, wk, wv column-parallel, wo row-parallel
        q = linear(f"{p}.attn.wq", h, H, Q, m.qkv_bias, "column", i)
        k = linear(f"{p}.attn.wk", h, H, KV, m.qkv_bias, "column", i)
        v = linear(f"{p}.attn.wv", h, H, KV, m.qkv_bias, "column", i)
        if m.qk_norm:
            q, k = qk_norm(f"{p}.attn.q_norm", q, i), qk_norm(f"{p}.attn.k_norm", k, i)
        if rope:
            local = bool(windows[i]) and m.rope_local_base_freq is not None
            ra = {"theta": local_theta if windows[i] else m.rope_theta, "fraction": m.rotary_fraction,
                  "tp": "shard_last"}
            if scaling is not None and not local:   # scaling of the rope_theta layers
                ra["scaling"] = tuple(sorted(scaling.items()))
            q = g.add_op(f"{p}.attn.rope_q", "rope", [q], ra, layer=i, origin=origin)
            k = g.add_op(f"{p}.attn.rope_k", "rope", [k], ra, layer=i, origin=origin)
        sinks = [Param(f"{p}.attn.sinks", T(Dim("heads", m.heads)))] if m.attention_sinks else []
        a = g.add_op(f"{p}.attn.core", "attention", [q, k, v], {
            "heads": m.heads, "kv_heads": m.kv_heads, "head_dim": m.head_dim, "seq_len": m.seq_len,
            "window": windows[i], "impl": m.attention, "dropout": m.dropout, "causal": True,
            "tp": "shard_last", **scores, **({"sinks": True} if sinks else {}),
        }, params=sinks, layer=i, origin=origin)
        return linear(f"{p}.attn.wo", a, Q, H, m.bias, "row", i)

    interleave = {"interleave": True} if m.rope_interleave else {}
    for i in range(m.layers):
        p = f"layers.{i}"
        h = norm(f"{p}.attn_norm", x, i)
        o = mla(p, h, i) if m.kv_lora_rank else mha(p, h, i)
        if m.sandwich_norm:
            o = norm(f"{p}.attn_post_norm", o, i)
        r1 = g.add_op(f"{p}.attn_residual", "add", [x, o], {"dropout": m.dropout, "tp": "residual"},
                      layer=i, origin=origin)
        h2 = norm(f"{p}.mlp_norm", x if m.parallel_residual else r1, i)
        if m.experts > 0 and i >= m.dense_layers:
            d = moe(f"{p}.mlp", h2, i)
        else:
            d = mlp(f"{p}.mlp", h2, F, i)
        if m.sandwich_norm:
            d = norm(f"{p}.mlp_post_norm", d, i)
        x = g.add_op(f"{p}.mlp_residual", "add", [r1, d], {"dropout": m.dropout, "tp": "residual"},
                     layer=i, origin=origin)

    fn = norm("final_norm", x, None)
    head_weight = "embedding.weight" if m.tie_embeddings else "lm_head.weight"
    logits = linear("lm_head", fn, H, V, False, "column", None, weight_name=head_weight)
    if m.tie_embeddings:
        nd = g.node(logits)
        g.set_params(logits, [Param("embedding.weight", nd.params[0].type, tied_to="embedding.weight")])
    if m.final_logit_softcapping is not None:   # Gemma 2: cap * tanh(logits / cap), per vocab shard
        logits = g.add_op("lm_head.softcap", "softcap", [logits], {"cap": m.final_logit_softcapping,
                                                                  "tp": "shard_last"}, origin=origin)
    labels = g.add_op("labels", "input", [], {"dims": (B, S), "dtype": "int64", "tp": rep}, origin=origin)
    g.add_op("loss", "cross_entropy", [logits, labels], {"tp": "vocab_loss"}, origin=origin)
    return g
