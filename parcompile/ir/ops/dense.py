"""The op kinds of a dense decoder layer and of the model's ends: the input, the token
embedding, the residual add, the norms, the linear layers (the LM head among them), RoPE,
qk-norm, the activations, Gemma 2's soft-cap and the loss. Each is one :class:`OpSpec`
(shape, cost, program row, traits, per-layer attributes) in :data:`DEFINITIONS`.
"""

from __future__ import annotations

from parcompile.ir.ops.base import (PER_HEAD, Code, Collective, OpSpec, Trait, elementwise_traffic, linear_flops,
                                    same_type)
from parcompile.ir.tp import TpRule
from parcompile.ir.types import TensorType


def _input_type(a, ins):
    return TensorType(tuple(a["dims"]), a["dtype"])


def _embedding_type(a, ins):
    return TensorType(ins[0].dims + (a["out_dim"],), a["dtype"])


def _linear_type(a, ins):
    x = ins[0]
    if x.dims[-1].name != a["in_dim"].name:
        raise ValueError(f"linear expects last dim {a['in_dim'].name}, got {x}")
    return TensorType(x.dims[:-1] + (a["out_dim"],), x.dtype)


def _xent_traffic(a, ins, out):
    # read the logits, write the fp32 softmax, read it again for the reductions
    return ins[0].nbytes + 2 * 4 * ins[0].numel


def _add_extra(a, ins, out):
    # dropout mask (1 byte per element) on the branch added to the residual stream
    return out.numel if a.get("dropout", 0) > 0 else 0


def _xent_type(a, ins):
    return TensorType((), "fp32")


def _xent_extra(a, ins, out):
    # the softmax of the (local) logits, kept in fp32 for the gradient
    return ins[0].numel * 4


def _head_norm_extra(a, ins, out):
    # the fp32 reciprocal rms per token and (local) head (runtime/model/layers.py's RMSNorm)
    return out.numel // a["head_dim"] * 4


# --- scratch of the serve program (:attr:`OpSpec.scratch`)

def rope_scratch(a, ins, out):
    # runtime/serve/generate.py apply_rope_at, over the rotated part (share f of each head: its
    # ``rope_dim``, or ``fraction``): the rotated copy, the two products and their sum (4 f),
    # then the sum and the rotated copy beside the concatenation that is the output
    # (2 f + 1; the output itself not counted); a 16-bit model's cos and sin cast to it
    width = out.dims[-1].unit
    rot = a["rope_dim"] if a.get("rope_dim") else round(a.get("fraction", 1.0) * width)
    f = rot / width
    casts = 2 * (out.numel // out.dims[-1].size) * rot * out.itemsize if out.itemsize < 4 else 0
    return int(out.nbytes * (max(4 * f, 2 * f + 1) - 1)) + casts


def norm_scratch(a, ins, out):
    # runtime/model/layers.py _RMSNormFunction: the fp32 input (a 16-bit model), the normalised
    # fp32 tensor and its cast (4 + 4 + e per element, beside the output); in fp32 the
    # normalised tensor only. LayerNorm: torch's fused kernel, nothing beside the output
    if a.get("norm") == "layernorm":
        return 0
    return out.numel * 8 if out.itemsize < 4 else out.nbytes


# --- program rows (:class:`Code`)

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



def _xent_collectives(node, degrees, local_in, local_out) -> list[Collective]:
    """Vocab-parallel cross-entropy (Megatron-LM): three all-reduces over tp of one fp32 per
    token (the max, the sum of exp, the target logit)."""
    if node.requires[0].axis_of("vocab") == "tp" and degrees.get("tp", 1) > 1:
        logits = local_in[0]
        nb = logits.numel // logits.dims[-1].size * 4  # one fp32 per token
        return [Collective("all_reduce", "tp", nb, "forward", node.op.module)] * 3
    return []


# --- tensor-parallel styles of its own (the generic ones: :mod:`parcompile.ir.tp`)

def _column_tp(attrs, in_types, out, sequence_parallel) -> TpRule:
    """Megatron-LM's column-parallel linear (wq, wk, wv, w1, w3, lm_head): input replicated, its
    gradient partial; output and weight split on the out dim."""
    od = attrs["out_dim"].name
    return TpRule(out_split=od, in_split=(None,), grad_partial=(True,),
                  param_split={"weight": od, "bias": od})


def _row_tp(attrs, in_types, out, sequence_parallel) -> TpRule:
    """Megatron-LM's row-parallel linear (wo, w2): input split on the in dim; output
    ``partial(tp)``; bias replicated."""
    idim = attrs["in_dim"].name
    return TpRule(out_partial=True, in_split=(idim,), grad_partial=(False,),
                  param_split={"weight": idim, "bias": None})


def _vocab_embedding_tp(attrs, in_types, out, sequence_parallel) -> TpRule:
    """The vocab-parallel embedding: weight split on vocab; output ``partial(tp)``."""
    return TpRule(out_partial=True, in_split=(None,), grad_partial=(False,),
                  param_split={"weight": "vocab"})


def _per_head_tp(attrs, in_types, out, sequence_parallel) -> TpRule:
    """qk-norm: ``shard_last`` with a weight shared by every head, so replicated, and its
    gradient (summed over this rank's heads) a partial sum over tp, all-reduced with the step
    (Megatron-Core all-reduces ``q_layernorm`` and ``k_layernorm`` gradients over tp in
    ``finalize_model_grads``)."""
    n = len(in_types)
    return TpRule(out_split=out.dims[-1].name, in_split=tuple(t.dims[-1].name for t in in_types),
                  grad_partial=(False,) * n, param_split={"weight": None}, param_grad_partial=("weight",))


def _vocab_loss_tp(attrs, in_types, out, sequence_parallel) -> TpRule:
    """The vocab-parallel cross-entropy: logits arrive split on vocab."""
    return TpRule(in_split=("vocab", None), grad_partial=(False, False))


#: the op kinds of this module
DEFINITIONS = [
    OpSpec("input", lambda a, ins: TensorType(tuple(a["dims"]), a["dtype"]), arity=0,
           traits=frozenset({Trait.NOT_AN_OP})),
    OpSpec("embedding", _embedding_type, arity=1, traffic=lambda a, i, o: o.nbytes, code=_embedding_code,
           traits=frozenset({Trait.EMBEDDING}), tp_styles={"vocab_embedding": _vocab_embedding_tp}),
    OpSpec("add", same_type, saved_extra=_add_extra, arity=2, traffic=elementwise_traffic, code=_add_code,
           traits=frozenset({Trait.EXPRESSION})),
    # the program's Norm (RMSNorm or LayerNorm, Gemma's (1 + w) form: the template's alias)
    OpSpec("norm", same_type, saves=lambda a: (0,), arity=1, traffic=elementwise_traffic, scratch=norm_scratch,
           code=_norm_code, traits=frozenset({Trait.EXPRESSION})),
    OpSpec("linear", _linear_type, fwd_flops=linear_flops, saves=lambda a: (0,), arity=1, code=_linear_code,
           traits=frozenset({Trait.GEMM, Trait.FP8_GEMM}), tp_styles={"column": _column_tp, "row": _row_tp}),
    # rotary position embedding at the tokens' global positions (the program's tables)
    # (Gemma 3: the sliding-window layers' own base, unscaled)
    OpSpec("rope", same_type, arity=1, traffic=elementwise_traffic, scratch=rope_scratch,
           per_layer=("theta", "scaling", "nope"), code=_rope_code, traits=frozenset({Trait.EXPRESSION, Trait.ROTARY})),
    # RMSNorm over head_dim of q or k, per head (Qwen3, Gemma 3): keeps its input
    OpSpec("qk_norm", same_type, saves=lambda a: (0,), saved_extra=_head_norm_extra, arity=1,
           traffic=elementwise_traffic, traits=frozenset({Trait.EXPRESSION}), tp_styles={"per_head": _per_head_tp},
           code=Code("QKNorm", ("head_dim", "eps", "zero_centered"), comment="RMSNorm over head_dim, each head alone",
                     **PER_HEAD)),
    # Llama 4's L2 norm of q or k after RoPE (transformers' Llama4TextL2Norm: x / rms(x) over
    # head_dim, no weight), on its RoPE layers (``nope``: passed through); keeps its input and
    # one fp32 scalar per token and head, as qk_norm
    OpSpec("l2_norm", same_type, saves=lambda a: () if a.get("nope") else (0,),
           saved_extra=lambda a, i, o: 0 if a.get("nope") else _head_norm_extra(a, i, o), arity=1,
           traffic=elementwise_traffic, per_layer=("nope",),
           code=lambda a: Code(call="rt.l2_norm({x}, {a[eps]!r}" + (", skip={a[nope]!r}" if "nope" in a else "") + ")",
                               comment="x / rms(x) over head_dim, each head alone (no weight)",
                               per_head=True, inline=False, var="", heads_in=True, heads_out=True)),
    # Llama 4's attention temperature tuning of q on its NoPE layers (``rope``: a RoPE layer's,
    # passed through): each query times log1p(floor((p + 1) / floor_scale)) * attn_scale + 1
    # (keeps only the per-position factors, T floats)
    OpSpec("attn_temperature", same_type, arity=1, traffic=elementwise_traffic, per_layer=("rope",),
           code=lambda a: Code(call="rt.tuned_queries({x}, pos, {a[floor_scale]!r}, {a[attn_scale]!r}"
                               + (", skip={a[rope]!r}" if "rope" in a else "") + ")",
                               comment="the query times its position's temperature", per_head=True,
                               inline=False, var="", heads_in=True, heads_out=True)),
    # gelu keeps its input; relu its output (the backward needs only the sign)
    OpSpec("act", same_type, saves=lambda a: () if a.get("fn") == "relu" else (0,), arity=1,
           saves_output=lambda a: a.get("fn") == "relu", traffic=elementwise_traffic,
           code=Code(call='rt.ACTIVATIONS["{a[fn]}"]({x})', inline=False), traits=frozenset({Trait.EXPRESSION})),
    OpSpec("swiglu", same_type, saves=lambda a: (0, 1), arity=2, traffic=elementwise_traffic,
           code=Code(call="rt.swiglu({0}, {1})", inline=False, operands=("gate", "up"), comment="silu(gate) * up"),
           traits=frozenset({Trait.EXPRESSION})),
    # gelu(gate, tanh approximation) * up (Gemma's GeGLU): the same saves as SwiGLU
    OpSpec("geglu", same_type, saves=lambda a: (0, 1), arity=2, traffic=elementwise_traffic,
           code=Code(call="rt.geglu({0}, {1})", inline=False, operands=("gate", "up"),
                     comment="gelu_tanh(gate) * up"),
           traits=frozenset({Trait.EXPRESSION})),
    # Gemma 2's final soft-cap cap * tanh(x / cap) on each vocab shard of the logits (tanh is
    # elementwise: the vocab-parallel loss after it stays exact); keeps its output (tanh's
    # backward is 1 - (y / cap)^2)
    OpSpec("softcap", same_type, saves_output=lambda a: True, arity=1, traffic=elementwise_traffic,
           code=Code(call="rt.softcap({x}, {a[cap]!r})", comment="cap * tanh(logits / cap)"),
           traits=frozenset({Trait.EXPRESSION})),
    OpSpec("cross_entropy", _xent_type, saved_extra=_xent_extra, arity=2, traffic=_xent_traffic,
           collectives=_xent_collectives, traits=frozenset({Trait.LOSS}), tp_styles={"vocab_loss": _vocab_loss_tp}),
]
