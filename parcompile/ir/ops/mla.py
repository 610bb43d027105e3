"""Multi-head latent attention's op kinds (DeepSeek-V2/V3; ir/lower.py ``mla`` and
``mla_absorbed``; runtime/model/mla.py): the normed latent and the RoPE key cut from ``wkv_a``'s
output, each head's key ``[k_nope, rope key]`` and value cut from ``wkv_b``'s, and the
absorbed serving form's query through ``W_uk`` and latents through ``W_uv``. The core is
:mod:`parcompile.ir.ops.attention`'s.
"""

from __future__ import annotations

from parcompile.ir.ops.base import Code, OpSpec, Trait, copy_traffic, elementwise_traffic, heads_facts
from parcompile.ir.tp import TpRule
from parcompile.ir.types import TensorType


def _latent_type(a, ins):
    """A part of the ``kv_a`` projection: the latent (``kv_lora``) or the RoPE key (``rope_k``)."""
    return TensorType(ins[0].dims[:-1] + (a["out_dim"],), ins[0].dtype)


def _latent_norm_extra(a, ins, out):
    # the fp32 reciprocal rms per token (runtime/model/layers.py's RMSNorm)
    return out.numel // out.dims[-1].size * 4


def _mla_key_type(a, ins):
    return TensorType(ins[0].dims[:-1] + (a["out_dim"],), ins[0].dtype)


def _mla_value_type(a, ins):
    return TensorType(ins[0].dims[:-1] + (a["out_dim"],), ins[0].dtype)


def _mla_key_traffic(a, ins, out):
    # read k_nope of every local head and the shared RoPE key, write the keys
    return out.nbytes * 2


def _absorb_type(a, ins):
    if ins[0].dims[-1].name != a["q_dim"].name:
        raise ValueError(f"mla_absorb expects the query's last dim {a['q_dim'].name}, got {ins[0]}")
    return TensorType(ins[0].dims[:-1] + (a["latent_dim"],), ins[0].dtype)


def _absorb_flops(a, ins, out):
    # each (token, head): q_nope (n) times W_uk (n, c); q_rope is copied
    return 2 * (out.numel // a["latent_dim"].unit) * a["nope"] * a["in_dim"].size


def _value_up_type(a, ins):
    return TensorType(ins[0].dims[:-1] + (a["out_dim"],), ins[0].dtype)


def _value_up_flops(a, ins, out):
    # each (token, head): the weighted latent (c) times W_uv (c, v)
    return 2 * out.numel * a["latent"]


# --- program rows (:class:`Code`)

def _latent_rope_code(a) -> Code:
    inter = ", interleave=True" if a.get("interleave") else ""
    return Code(call="rt.rope_key({0}, {a[rope_dim]}, *pos.rope" + inter + ")", inline=False, operands=("kva",),
                serve_call="rt.rope_key_at({0}, {a[rope_dim]}, *pos.rope" + inter + ")",
                var="k_rope", heads_out=True, comment="the RoPE key, one head shared by all")


# --- tensor-parallel styles of its own (the generic ones: :mod:`parcompile.ir.tp`)

def _mla_key_tp(attrs, in_types, out, sequence_parallel) -> TpRule:
    """MLA's keys: the per-head part split on its heads, the shared RoPE key replicated with
    its gradient partial over tp."""
    # MLA's per-head keys: k_nope split with the heads, the RoPE key shared by all of them
    # (replicated, so its gradient, summed over this rank's heads, is a partial sum)
    return TpRule(out_split=out.dims[-1].name, in_split=(in_types[0].dims[-1].name, None),
                  grad_partial=(False, True))


def _mla_absorb_tp(attrs, in_types, out, sequence_parallel) -> TpRule:
    """MLA's absorbed query: the heads split, wkv_b's rows with them."""
    # MLA's absorbed query: this rank's heads of q in, of [q_nope W_uk, q_rope] out, with
    # their rows of wkv_b (split by heads like the column-parallel wkv_b of training)
    return TpRule(out_split=attrs["latent_dim"].name, in_split=(attrs["q_dim"].name,), grad_partial=(False,),
                  param_split={"weight": attrs["out_dim"].name})


_EXPR = frozenset({Trait.EXPRESSION})

#: the op kinds of this module
DEFINITIONS = [
    OpSpec("latent_norm", _latent_type, saves=lambda a: (0,), saved_extra=_latent_norm_extra, arity=1,
           traffic=elementwise_traffic, traits=_EXPR,
           code=Code(build="rt.whole_grad(rt.RMSNorm({name}, {out_features}, NORM_EPS, SEED, tp))",
                     call="{self}({0}[..., :{a[out_dim].size}])", operands=("kva",), var="latent",
                     comment="the latent, normed")),
    OpSpec("latent_rope", _latent_type, arity=1, traffic=elementwise_traffic, per_layer=("theta", "scaling"),
           code=_latent_rope_code, traits=frozenset({Trait.EXPRESSION, Trait.ROTARY})),
    OpSpec("mla_key", _mla_key_type, arity=2, traffic=_mla_key_traffic, traits=_EXPR, tp_styles={"mla_key": _mla_key_tp},
           code=Code(call="rt.mla_key({0}, {1}, {a[nope]})", inline=False, operands=("kv", "k_rope"), var="k",
                     heads_in=True, heads_out=True, comment="[k_nope, rope key] per head")),
    OpSpec("mla_value", _mla_value_type, arity=1, traffic=copy_traffic, traits=_EXPR,
           code=Code(call="{0}[..., {a[nope]}:].contiguous()", inline=False, operands=("kv",), var="v",
                     heads_in=True, heads_out=True, comment="v per head, its own storage")),
    # MLA's absorbed serving form: the op holding wkv_b turns each head's query into
    # [q_nope W_uk, q_rope]; after the core, W_uv turns its latents into values
    OpSpec("mla_absorb", _absorb_type, fwd_flops=_absorb_flops, arity=1, traffic=copy_traffic, traits=_EXPR,
           tp_styles={"mla_absorb": _mla_absorb_tp},
           code=Code(build="rt.ColumnParallelLinear({name}, {in_features}, {out_features}, False, tp, SEED, "
                           "local={local})",
                     call="rt.mla_absorb_query({x}, {self}.weight, heads={heads}, nope={a[nope]}, "
                          "v_dim={a[v_head_dim]}, latent={a[in_dim].size})",
                     inline=False, operands=("q",), var="q", heads_in=True, heads_out=True, facts=heads_facts,
                     comment="[q_nope W_uk, q_rope] per head: wkv_b's key rows absorbed")),
    OpSpec("mla_value_up", _value_up_type, fwd_flops=_value_up_flops, arity=1, traffic=copy_traffic, traits=_EXPR,
           code=Code(call="rt.mla_value_up({x}, self.{a[weight]}.weight, heads={heads}, nope={a[nope]}, "
                          "v_dim={a[out_dim].unit}, latent={a[latent]})",
                     inline=False, var="y", heads_in=True, facts=heads_facts,
                     comment="each head's latents times wkv_b's value rows (W_uv)")),
]
