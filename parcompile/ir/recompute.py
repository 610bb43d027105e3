"""Which ops of a decoder layer each Megatron-Core recompute module covers
(:mod:`parcompile.core.recompute`), read off the op's name and kind: the one place the
memory model (:func:`parcompile.analysis.memory.saved_bytes`), the time model
(:func:`parcompile.analysis.compute.recomputed`) and the communication model read it.

Megatron-Core (NVIDIA/Megatron-LM d98e8a6) wraps, per layer: ``core_attn`` the attention
core; ``layernorm`` ``input_layernorm`` and ``pre_mlp_layernorm`` (parcompile's
``attn_norm`` and ``mlp_norm``); ``mla_up_proj`` the MLA up projections of q and kv and the
RoPE applied to them (``wq_b`` or ``wq``, ``wkv_b``, ``rope_q``, ``rope_k``, ``key``, ``value``);
``mlp`` a dense layer's MLP; ``moe`` an MoE layer's MLP (router, dispatch, experts, combine,
shared experts); ``shared_experts`` the shared experts; ``moe_act`` the experts' activation,
inside the ``experts`` op (part of it: :func:`parcompile.analysis.memory.saved_bytes` drops
the activation's output, what ``linear_fc2`` would keep).
"""

from __future__ import annotations

from parcompile.ir.ops import Trait

#: the parts of an MoE layer's ``mlp`` module (``layers.3.mlp.router``, ...)
MOE_PARTS = frozenset({"router", "dispatch", "experts", "combine", "shared", "shared_add"})

#: MLA's up projections and the RoPE applied to their outputs (``mla_up_proj``): Megatron-Core's
#: ``qkv_up_proj_and_rope_apply`` (NVIDIA/Megatron-LM 003b4ce ``megatron/core/transformer/
#: multi_latent_attention.py``) runs ``linear_q_up_proj``, or ``linear_q_proj`` without the
#: query latent (parcompile's ``wq``), ``linear_kv_up_proj``, the RoPE of q and of the shared key
#: and the per-head key and value
MLA_UP_PARTS = frozenset({"wq_b", "wq", "wkv_b", "rope_q", "rope_k", "key", "value"})

#: the norms ``layernorm`` recomputes (Megatron-Core's ``input_layernorm``, ``pre_mlp_layernorm``)
LAYER_NORMS = frozenset({"attn_norm", "mlp_norm"})


def node_modules(nd) -> frozenset[str]:
    """The recompute modules (Megatron-Core's names) whose region holds the op ``nd`` (a graph
    Node): empty outside decoder layers and for the pipeline's transfers. ``moe_act`` holds
    the ``experts`` op (its activation)."""
    if nd.op.layer is None or nd.has_trait(Trait.STAGE_TRANSFER):
        return frozenset()
    parts = nd.name.split(".")
    if nd.has_trait(Trait.ATTENTION):
        return frozenset({"core_attn"})
    if len(parts) == 3 and parts[2] in LAYER_NORMS and nd.kind == "norm":
        return frozenset({"layernorm"})
    if len(parts) >= 4 and parts[2] == "attn" and parts[3] in MLA_UP_PARTS:
        # rope_q and rope_k of a non-MLA layer too: the checks allow mla_up_proj only with MLA
        return frozenset({"mla_up_proj"})
    if len(parts) >= 4 and parts[2] == "mlp":
        if parts[3] not in MOE_PARTS:
            return frozenset({"mlp"})
        out = {"moe"}
        if parts[3] == "shared":
            out.add("shared_experts")
        if parts[3] == "experts":
            out.add("moe_act")
        return frozenset(out)
    return frozenset()


__all__ = ["MOE_PARTS", "MLA_UP_PARTS", "LAYER_NORMS", "node_modules"]
