"""The op table: per op kind, its output type rule, FLOPs, bytes saved for backward, the
collectives it runs inside itself, its program row and the attributes that may differ from
one decoder layer to the next (``OpSpec.per_layer``). The tensor-parallel layout of each
``tp`` style is :mod:`parcompile.ir.tp`'s.

Every rule works on *types*: global types for inference, local (per-rank) types for
cost. FLOPs count matmuls only (SPEC 3: model FLOPs are matmul FLOPs): a linear layer
``(..., k) -> (..., n)`` costs ``2 * m * n * k`` forward, attention ``4 * b * s * s_kv * d``
for ``Q K^T`` and ``A V`` (no causal halving). Backward costs twice forward (the
convention of Narayanan et al. 2021 and Korthikanti et al. 2022).

Bytes saved for backward follow Korthikanti et al. (2022), "Reducing Activation
Recomputation in Large Transformer Models", section 4: each op names which operands it
keeps (``saves``; a tensor kept by several ops is counted once), whether it keeps its own
output (``saves_output``: the fused attention kernel), plus the internal tensors it keeps
(``saved_extra``: softmax output, dropout masks, log-sum-exp). For a GPT layer
(layernorm, gelu, dropout, MHA, ffn 4h, unfused attention, 16-bit) this gives Table 2 of
the paper exactly, per layer: layer norms ``4sbh`` (their inputs), attention ``11sbh +
5as^2b`` (QKV input 2sbh, Q K V 6sbh, softmax 2as^2b, its dropout mask as^2b and output
2as^2b, projection input 2sbh, residual dropout mask sbh), MLP ``19sbh`` (fc1 input 2sbh,
gelu input 8sbh, fc2 input 8sbh, dropout mask sbh); tensor parallelism divides the
split tensors by t (``10 + 24/t``), sequence parallelism the rest (the analysis keeps the
sequence-split input of a column-parallel layer, as Megatron-LM does, and all-gathers it
again in backward).

``traffic`` is the bytes the op's non-matmul kernels read and write in the forward
(layer norms, activations, softmax, dropout, residual adds, the loss): what bounds those
kernels is memory bandwidth, not FLOPs. The cost model prices it at the GPU's memory
bandwidth; GEMM operands are not counted (their time is their FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from parcompile.core.attention import attention_kernel
from parcompile.core.model import GATED_ACTIVATIONS
from parcompile.ir.code import CODES, COMM_KINDS, Code
from parcompile.ir.scratch import (INDEX_BYTES, attention_scratch, combine_scratch, dispatch_scratch, experts_scratch,
                                    norm_scratch, rope_scratch, router_scratch)
from parcompile.ir.types import Sharding, TensorType

# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Param:
    """A trainable parameter held by an op.

    ``type`` is the global type as stored (vocabulary padded); ``logical_numel`` the count
    the model function has (unpadded; None: ``type.numel``). ``tied_to`` names the
    parameter this one is a synchronised copy of (the LM head of a tied model on the last
    pipeline stage). ``expert`` marks MoE expert weights (reduced over ``expert_dp``).
    """

    name: str
    type: TensorType
    sharding: Sharding = Sharding()
    logical_numel: int | None = None
    tied_to: str | None = None
    expert: bool = False
    #: mesh axes over which the gradient is a partial sum though the value is replicated
    #: (a qk-norm weight under tp: each rank sums it over its own heads); set by the
    #: tensor-parallel pass from :attr:`parcompile.ir.tp.TpRule.param_grad_partial`
    grad_partial: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        """The unpadded (model) element count."""
        return self.type.numel if self.logical_numel is None else self.logical_numel


@dataclass(frozen=True)
class Op:
    """An operation: a stable hierarchical ``name`` (``layers.3.attn.wq``), a ``kind`` of
    the table below, hashable ``attrs`` (sorted key/value pairs), the decoder ``layer`` it
    belongs to (None outside layers) and the spec ``origin`` (a Span) that caused it."""

    name: str
    kind: str
    attrs: tuple[tuple[str, Any], ...] = ()
    layer: int | None = None
    origin: Any = None

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def attr_map(self) -> dict[str, Any]:
        return dict(self.attrs)

    @property
    def module(self) -> str:
        """The module the op belongs to: ``layers.3.attn`` for ``layers.3.attn.wq``,
        ``layers.3.attn_norm`` for itself, ``embedding`` for ``embedding.pos_add``."""
        parts = self.name.split(".")
        if parts[0] == "layers" and len(parts) >= 3:
            return ".".join(parts[:3])
        return parts[0]


@dataclass(frozen=True)
class Collective:
    """One collective an op runs per micro-batch (``per = "microbatch"``) or per step.

    ``bytes`` is the size of the tensor the collective produces on one rank (the gathered
    output for an all-gather, the shard for a reduce-scatter). ``phase`` is
    ``forward``, ``backward`` or ``step``. ``stage`` overrides the op's stage (a
    send/recv pair runs on two stages).
    """

    op: str
    axis: str
    bytes: int
    phase: str
    where: str
    per: str = "microbatch"
    stage: int | None = None
    #: > 0: the size depends on the router's choices (MoE token dispatch); ``bytes`` is the
    #: balanced estimate and ``bytes_per_row`` the bytes of one routed token (h * e)
    bytes_per_row: int = 0
    #: runs per step of a ``per = "step"`` collective (ZeRO-3 regathers a layer bucket 2 m times)
    count: int = 1
    #: a tensor-parallel all-gather's or reduce-scatter's GEMMs (the linears it feeds or
    #: drains): their forward FLOPs on one rank, ``(FP8-eligible, other)``, what it overlaps
    #: under ``cluster.tp_comm_overlap`` (:func:`parcompile.analysis.comm.comm_report` sets
    #: it; :func:`parcompile.analysis.estimate.chunk_times` reads it)
    gemm_flops: tuple[int, int] = (0, 0)


def code_of(kind: str, attrs: Mapping[str, Any]) -> Code | None:
    """The :class:`Code` row of an op of ``kind`` with ``attrs`` (a row may depend on the
    op's tensor-parallel style or attributes); None: the kind runs outside generated classes.

    Raises:
        KeyError: unknown kind.
        ValueError: a conversion with no runtime call (:func:`_redistribute_code`).
    """
    code = spec(kind).code
    return code(attrs) if callable(code) else code


@dataclass(frozen=True)
class OpSpec:
    """The rules of one op kind (see module docstring)."""

    kind: str
    infer: Callable[[Mapping[str, Any], Sequence[TensorType]], TensorType]
    fwd_flops: Callable[[Mapping[str, Any], Sequence[TensorType], TensorType], int] = lambda a, i, o: 0
    saves: Callable[[Mapping[str, Any]], tuple[int, ...]] = lambda a: ()
    saved_extra: Callable[[Mapping[str, Any], Sequence[TensorType], TensorType], int] = lambda a, i, o: 0
    #: bytes the op keeps in copies of its operands all-gathered inside it (context-parallel
    #: k and v, expert_tp rows), beyond the local operands: ``(attrs, local inputs,
    #: degrees)``; kept under selective recomputation too (the checkpoint holds them)
    saved_gathered: Callable[[Mapping[str, Any], Sequence[TensorType], Mapping[str, int]], int] = \
        lambda a, i, d: 0
    #: number of operands (None: any)
    arity: int | None = None
    #: selective recomputation drops ``saved_extra`` and recomputes this op's forward
    selective_recompute: bool = False
    #: the op keeps its own output for backward (counted once with its consumers' saves)
    saves_output: Callable[[Mapping[str, Any]], bool] = lambda a: False
    #: bytes read + written by the op's non-matmul kernels in the forward (module docstring)
    traffic: Callable[[Mapping[str, Any], Sequence[TensorType], TensorType], int] = lambda a, i, o: 0
    #: how a generated program runs it (:class:`Code`, or a function of the attributes
    #: giving one: :func:`code_of`); None: outside decoder layers (the templates' skeleton).
    #: Written here (a constant row: ``softcap``) or in ir/code.py's ``CODES``, not both
    code: Code | Callable[[Mapping[str, Any]], Code] | None = None
    #: bytes of the temporaries the op holds beside its operands and its output while its
    #: forward runs in the serve program (no autograd), at local types; an attention core's
    #: ``seq_len`` is the keys it attends (:func:`parcompile.analysis.serve_memory.serve_workspace`)
    scratch: Callable[[Mapping[str, Any], Sequence[TensorType], TensorType], int] = lambda a, i, o: 0
    #: the attributes whose value may differ from one decoder layer to the next (a sliding
    #: window, a score scale, a RoPE base). Codegen writes one class for many layers: each of
    #: these that differs becomes a per-layer table the class reads; any other attribute
    #: that differs is an internal error (:func:`parcompile.codegen.program_data.layer_tables`)
    per_layer: tuple[str, ...] = ()


# --------------------------------------------------------------------------- rules


def _same(a, ins):
    return ins[0]


def _input_type(a, ins):
    return TensorType(tuple(a["dims"]), a["dtype"])


def _embedding_type(a, ins):
    return TensorType(ins[0].dims + (a["out_dim"],), a["dtype"])


def _linear_type(a, ins):
    x = ins[0]
    if x.dims[-1].name != a["in_dim"].name:
        raise ValueError(f"linear expects last dim {a['in_dim'].name}, got {x}")
    return TensorType(x.dims[:-1] + (a["out_dim"],), x.dtype)


def _linear_flops(a, ins, out):
    # 2 * (elements of the output) * (contracted dim): 2 m n k
    return 2 * out.numel * ins[0].dims[-1].size


def _attention_type(a, ins):
    # MLA: the output has v_head_dim per head (v's features), not q's; MLA's absorbed core
    # (``latent``): each head's weighted latents, its ``out_dim``
    if a.get("latent"):
        return TensorType(ins[0].dims[:-1] + (a["out_dim"],), ins[0].dtype)
    return TensorType(ins[0].dims[:-1] + (ins[2].dims[-1],), ins[0].dtype) if a.get("v_head_dim") else ins[0]


def _attention_flops(a, ins, out):
    q = ins[0]
    b, s = q.shape[0], q.shape[1]
    s_kv = a["seq_len"]
    if a.get("window"):
        s_kv = min(s_kv, a["window"])
    # Q K^T: 2 * b * s * s_kv * (local heads * head_dim); A V: the same with v's head width
    # (MLA: v_head_dim; otherwise head_dim, so 4 * b * s * s_kv * d in all)
    heads_local = q.dims[-1].size // a["head_dim"]
    return 2 * b * s * s_kv * heads_local * (a["head_dim"] + a.get("v_head_dim", a["head_dim"]))


def _scores(a, q: TensorType) -> int:
    """Elements of the local ``s x s_kv`` attention scores of one micro-batch."""
    b, s = q.shape[0], q.shape[1]
    heads_local = q.dims[-1].size // a["head_dim"]
    s_kv = min(a["seq_len"], a["window"]) if a.get("window") else a["seq_len"]
    return b * heads_local * s * s_kv


def _attention_gathered(a, ins, degrees) -> int:
    # context parallelism: k and v are all-gathered over cp, and the gathered copies are
    # what the kernel (or a recomputed core) keeps
    return (degrees.get("cp", 1) - 1) * (ins[1].nbytes + ins[2].nbytes)


def _fused(a) -> bool:
    """The attention core runs as one fused kernel: the ``kernel`` attribute the analysis
    sets for the engine (:func:`parcompile.core.attention.with_kernel`), else the generated
    program's own (``attention = flash`` and no sinks: torch's fused kernels take no sink
    logits, so with sinks the runtime spells the softmax out, runtime/model/layers.py
    attention_core)."""
    return attention_kernel(a).fused


def _attention_extra(a, ins, out):
    q = ins[0]
    b, s = q.shape[0], q.shape[1]
    e = q.itemsize
    cp = a["seq_len"] // s if s < a["seq_len"] else 1   # this rank holds s of seq_len queries
    kernel = attention_kernel(a)
    extra = 0
    if kernel.fused:
        # the fused kernel keeps its output (saves_output) and the fp32 log-sum-exp per
        # query and head; dropout is replayed from the RNG state, no mask
        heads_local = q.dims[-1].size // a["head_dim"]
        extra += b * s * heads_local * 4
        pad = a["head_dim"] - a.get("v_head_dim", a["head_dim"])
        if pad > 0 and kernel.pads_v:
            # MLA: the kernel takes v padded to head_dim and keeps it and its padded output; the
            # output cut to v_head_dim is a copy, the one wo keeps (runtime/model/mla.py mla_core)
            extra += b * s * heads_local * (pad + a["head_dim"]) * e
        if a.get("sinks") and kernel.sink_rescale:
            # sinks applied after the kernel: output * sigmoid(lse - sink) keeps the kernel's
            # output beside the rescaled one (torchtitan's gpt-oss)
            extra += out.nbytes
        window = a.get("window") or 0
        if kernel.explicit_mask and (cp > 1 or 0 < window < a["seq_len"]):
            # torch SDPA takes a sliding window or context-parallel positions as an explicit
            # (s, seq_len) mask, which it keeps too
            extra += s * a["seq_len"] * e
        return extra
    # the unfused path materialises every s x s_kv score; a sliding window only masks them
    # (a sink is one more column of the softmax's output: s x (s_kv + 1))
    scores = _scores({**a, "window": 0}, q)
    if a.get("softcap") is not None:
        extra += scores * e  # tanh of the scores (Gemma 2's soft-cap: its backward reads it)
    if a.get("sinks"):
        scores += scores // a["seq_len"]
    extra += scores * e  # softmax output
    if a.get("dropout", 0) > 0:
        extra += scores * 1 + scores * e  # dropout mask + dropout output
    return extra


def _attention_traffic(a, ins, out):
    q = ins[0]
    if _fused(a):
        # one fused kernel streams Q, K, V in and the output out
        return sum(t.nbytes for t in ins) + out.nbytes
    e = q.itemsize
    scores = _scores(a, q)
    # Q K^T writes the scores; scale-mask-softmax reads and writes them; dropout reads
    # them and writes output and mask; A V reads the result
    per = 4 * e + ((2 * e + 1) if a.get("dropout", 0) > 0 else 0)
    if a.get("softcap") is not None:
        per += 2 * e   # the soft-cap reads and writes them once more (one fused tanh pass)
    return scores * per


def _elementwise_traffic(a, ins, out):
    """Read every operand, write the output (plus a 1-byte mask with dropout)."""
    mask = out.numel if a.get("dropout", 0) > 0 else 0
    return sum(t.nbytes for t in ins) + out.nbytes + mask


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


def _scalar(a, ins):
    return TensorType((), "fp32")


# --- multi-head latent attention (ir/lower.py ``mla``; runtime/model/mla.py)

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


# MLA's absorbed (serving) form (ir/lower.py ``mla_absorbed``; DeepSeek-V2 section 2.1.1, vLLM's
# MLA backend): wkv_b (H (n + v), c) split into W_uk (H, n, c) and W_uv (H, v, c)

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


# --- mixture of experts (ir/lower.py; runtime/model/moe.py). Local types assume balanced routing:
# each rank receives as many (token, expert) rows as it sends, b * s_local * top_k.

def _router_type(a, ins):
    # fp32 scores: softmax probabilities, or sigmoid scores (DeepSeek-V3: scoring_func)
    return TensorType(ins[0].dims[:-1] + (a["out_dim"],), "fp32")


def _dispatch_type(a, ins):
    return TensorType(ins[0].dims[:-1] + (a["topk_dim"], ins[0].dims[-1]), ins[0].dtype)


def _combine_type(a, ins):
    return TensorType(ins[0].dims[:-2] + (ins[0].dims[-1],), ins[0].dtype)




def _router_extra(a, ins, out):
    # the fp32 scores are the router's output (saves_output: softmax's and sigmoid's backward
    # both read their output); the top-k (or the gather of the chosen scores) keeps its int64
    # indices, the renormalisation the k weights and their sum (fp32); a 16-bit model's
    # router runs in fp32 and keeps fp32 copies of its input and weight. DeepSeek-V3's
    # choice (correction bias, group mask: topk_method noaux_tc) runs without gradient and
    # keeps nothing; routed_scaling_factor is a constant factor (nothing kept)
    n = ins[0].numel // ins[0].dims[-1].size
    k = a["top_k"]
    extra = n * k * (INDEX_BYTES + 4) + n * 4
    if a.get("fp32_input"):
        extra += ins[0].numel * 4 + a["experts"] * ins[0].dims[-1].size * 4
    return extra


def _router_traffic(a, ins, out):
    # the fp32 logits written and read, the scores written; noaux_tc also writes and reads
    # the corrected scores and their group-masked copy (runtime/model/moe.py: route)
    return (7 if a.get("topk_method") == "noaux_tc" else 3) * out.nbytes


def _dispatch_extra(a, ins, out):
    # two row gathers (tokens to sorted rows, arrivals grouped by expert) keep their indices
    return 2 * INDEX_BYTES * (out.numel // out.dims[-1].size)


def _combine_extra(a, ins, out):
    # the gather back to (token, choice) order keeps its indices (two permutations); the
    # weighted sum keeps the k router weights per token (fp32)
    rows = ins[0].numel // ins[0].dims[-1].size
    return 2 * INDEX_BYTES * rows + 4 * rows


def _experts_gathered(a, ins, degrees: Mapping[str, int]) -> int:
    # expert_tp > 1: the routed rows are all-gathered over expert_tp (runtime/model/moe.py); the
    # experts keep the gathered rows, plus the two int64 indices that group them by expert
    # and restore their order, over the gathered rows
    etp = degrees.get("expert_tp", 1)
    rows = ins[0].numel // ins[0].dims[-1].size
    return (etp - 1) * (ins[0].nbytes + 2 * INDEX_BYTES * rows)


def _expert_mats(a) -> int:
    return 3 if a["activation"] in GATED_ACTIVATIONS else 2


def _experts_flops(a, ins, out):
    # every routed row runs one expert MLP: 2 * rows * h * ffn per weight matrix; with
    # expert_tp the rows are gathered and each rank runs ffn / expert_tp: the same FLOPs
    rows = ins[0].numel // ins[0].dims[-1].size
    return 2 * rows * ins[0].dims[-1].size * a["ffn"] * _expert_mats(a)


def _experts_extra(a, ins, out):
    # the expert activations kept for backward: gate, up and their product (SwiGLU) or the
    # pre- and post-activation (gelu/relu), ffn wide per routed row
    rows = ins[0].numel // ins[0].dims[-1].size
    return rows * a["ffn"] * ins[0].itemsize * _expert_mats(a)


def _experts_traffic(a, ins, out):
    rows = ins[0].numel // ins[0].dims[-1].size
    return rows * a["ffn"] * ins[0].itemsize * _expert_mats(a)


def _copy_traffic(a, ins, out):
    return ins[0].nbytes + out.nbytes


def _program_row(s: OpSpec) -> OpSpec:
    """``s`` with its program row: the one written in its entry (``code=``: a constant
    :class:`Code`, one op in one place) or the one in :data:`parcompile.ir.code.CODES`
    (rows with functions of their own); a kind with both is an error."""
    if s.code is not None and s.kind in CODES:
        raise ValueError(f"op kind {s.kind!r} has two program rows: its OPS entry's and ir/code.py's")
    return s if s.code is not None else replace(s, code=CODES.get(s.kind))


OPS: dict[str, OpSpec] = {
    s.kind: _program_row(s)
    for s in [
        OpSpec("input", _input_type, arity=0),
        OpSpec("embedding", _embedding_type, arity=1, traffic=lambda a, i, o: o.nbytes),
        OpSpec("add", _same, saved_extra=_add_extra, arity=2, traffic=_elementwise_traffic),
        # the program's Norm (RMSNorm or LayerNorm, Gemma's (1 + w) form: the template's alias)
        OpSpec("norm", _same, saves=lambda a: (0,), arity=1, traffic=_elementwise_traffic, scratch=norm_scratch),
        OpSpec("linear", _linear_type, fwd_flops=_linear_flops, saves=lambda a: (0,), arity=1),
        # rotary position embedding at the tokens' global positions (the program's tables)
        # (Gemma 3: the sliding-window layers' own base, unscaled)
        OpSpec("rope", _same, arity=1, traffic=_elementwise_traffic, scratch=rope_scratch,
               per_layer=("theta", "scaling", "nope")),
        # RMSNorm over head_dim of q or k, per head (Qwen3, Gemma 3): keeps its input
        OpSpec("qk_norm", _same, saves=lambda a: (0,), saved_extra=_head_norm_extra, arity=1,
               traffic=_elementwise_traffic),
        OpSpec("attention", _attention_type, fwd_flops=_attention_flops, saves=lambda a: (0, 1, 2),
               saved_extra=_attention_extra, saved_gathered=_attention_gathered, arity=3, selective_recompute=True,
               saves_output=_fused, traffic=_attention_traffic, scratch=attention_scratch,
               # sliding and full layers (Gemma 2/3, gpt-oss, Mistral); a scale per layer; Llama 4's
               # chunked (RoPE) and full (NoPE) layers
               per_layer=("window", "scale", "chunk")),
        # Llama 4's L2 norm of q or k after RoPE (transformers' Llama4TextL2Norm: x / rms(x) over
        # head_dim, no weight), on its RoPE layers (``nope``: passed through); keeps its input and
        # one fp32 scalar per token and head, as qk_norm
        OpSpec("l2_norm", _same, saves=lambda a: () if a.get("nope") else (0,),
               saved_extra=lambda a, i, o: 0 if a.get("nope") else _head_norm_extra(a, i, o), arity=1,
               traffic=_elementwise_traffic, per_layer=("nope",),
               code=lambda a: Code(call="rt.l2_norm({x}, {a[eps]!r}" + (", skip={a[nope]!r}" if "nope" in a else "")
                                   + ")", comment="x / rms(x) over head_dim, each head alone (no weight)",
                                   per_head=True, inline=False, var="", heads_in=True, heads_out=True)),
        # Llama 4's attention temperature tuning of q on its NoPE layers (``rope``: a RoPE layer's,
        # passed through): each query times log1p(floor((p + 1) / floor_scale)) * attn_scale + 1
        # (keeps only the per-position factors, T floats)
        OpSpec("attn_temperature", _same, arity=1, traffic=_elementwise_traffic,
               per_layer=("rope",),
               code=lambda a: Code(call="rt.tuned_queries({x}, pos, {a[floor_scale]!r}, {a[attn_scale]!r}"
                                   + (", skip={a[rope]!r}" if "rope" in a else "") + ")",
                                   comment="the query times its position's temperature", per_head=True,
                                   inline=False, var="", heads_in=True, heads_out=True)),
        # MLA (runtime/model/mla.py): the normed latent and the RoPE key cut from wkv_a's output, and
        # each head's key [k_nope, rope key] and value cut from wkv_b's
        OpSpec("latent_norm", _latent_type, saves=lambda a: (0,), saved_extra=_latent_norm_extra, arity=1,
               traffic=_elementwise_traffic),
        OpSpec("latent_rope", _latent_type, arity=1, traffic=_elementwise_traffic, per_layer=("theta", "scaling")),
        OpSpec("mla_key", _mla_key_type, arity=2, traffic=_mla_key_traffic),
        OpSpec("mla_value", _mla_value_type, arity=1, traffic=_copy_traffic),
        # MLA's absorbed serving form: the query through W_uk, the core's weighted latents through W_uv
        OpSpec("mla_absorb", _absorb_type, fwd_flops=_absorb_flops, arity=1, traffic=_copy_traffic),
        OpSpec("mla_value_up", _value_up_type, fwd_flops=_value_up_flops, arity=1, traffic=_copy_traffic),
        # gelu keeps its input; relu its output (the backward needs only the sign)
        OpSpec("act", _same, saves=lambda a: () if a.get("fn") == "relu" else (0,), arity=1,
               saves_output=lambda a: a.get("fn") == "relu", traffic=_elementwise_traffic),
        OpSpec("swiglu", _same, saves=lambda a: (0, 1), arity=2, traffic=_elementwise_traffic),
        # gelu(gate, tanh approximation) * up (Gemma's GeGLU): the same saves as SwiGLU
        OpSpec("geglu", _same, saves=lambda a: (0, 1), arity=2, traffic=_elementwise_traffic),
        # Gemma 2's final soft-cap cap * tanh(x / cap) on each vocab shard of the logits (tanh is
        # elementwise: the vocab-parallel loss after it stays exact); keeps its output (tanh's
        # backward is 1 - (y / cap)^2)
        OpSpec("softcap", _same, saves_output=lambda a: True, arity=1, traffic=_elementwise_traffic,
               code=Code(call="rt.softcap({x}, {a[cap]!r})", comment="cap * tanh(logits / cap)")),
        OpSpec("cross_entropy", _xent_type, saved_extra=_xent_extra, arity=2, traffic=_xent_traffic),
        OpSpec("router", _router_type, fwd_flops=_linear_flops, saves=lambda a: () if a.get("fp32_input") else (0,),
               saved_extra=_router_extra, saves_output=lambda a: True, arity=1, traffic=_router_traffic,
               scratch=router_scratch),
        OpSpec("moe_dispatch", _dispatch_type, saved_extra=_dispatch_extra, arity=2, traffic=_copy_traffic,
               scratch=dispatch_scratch),
        OpSpec("experts", _same, fwd_flops=_experts_flops, saves=lambda a: (0,), saved_extra=_experts_extra,
               saved_gathered=_experts_gathered,
               arity=1, traffic=_experts_traffic, scratch=experts_scratch),
        OpSpec("moe_combine", _combine_type, saves=lambda a: (0,), saved_extra=_combine_extra, arity=2,
               traffic=_copy_traffic, scratch=combine_scratch),
        # inserted by passes
        OpSpec("redistribute", _same, arity=1),
        OpSpec("send_recv", _same, arity=1),
        OpSpec("step_collective", _scalar, arity=0),
    ]
}


def spec(kind: str) -> OpSpec:
    """The table entry of ``kind``; KeyError names the kind."""
    try:
        return OPS[kind]
    except KeyError:
        raise KeyError(f"unknown op kind {kind!r}") from None


# --------------------------------------------------------------------------- collectives


def convert(src: Sharding, dst: Sharding, degrees: Mapping[str, int]) -> list[tuple[str, str]]:
    """The collectives that turn layout ``src`` into layout ``dst``, one per mesh axis
    that differs (axes of degree 1 never communicate). The one rule of the compiler:

    ========================  ==========================  ===============
    src on axis a             dst on axis a               collective
    ========================  ==========================  ===============
    partial                   replicated                  ``all_reduce``
    partial                   split(d)                    ``reduce_scatter``
    split(d)                  replicated                  ``all_gather``
    split(d)                  split(d')                   ``all_to_all``
    replicated                split(d)                    ``split`` (local, free)
    ========================  ==========================  ===============

    A nested split (``seq: cp*tp``) is one split per axis, each inside the ones before it:
    ``seq: cp*tp -> seq: cp`` is an all-gather over tp of the cp rank's part, ``seq: cp
    -> seq: cp*tp`` a local split, ``partial(tp), seq: cp -> seq: cp*tp`` a
    reduce-scatter over tp (Megatron-Core's sequence parallelism inside context
    parallelism). The same dim split over ``a`` inside different outer axes is an
    ``all_to_all`` over ``a``.

    Returns ``[(kind, axis), ...]`` sorted by axis; empty when nothing is needed.

    Raises:
        ValueError: the conversion is impossible (anything -> partial).
    """
    out: list[tuple[str, str]] = []
    for axis in sorted(src.axes | dst.axes):
        if degrees.get(axis, 1) == 1:
            continue
        s_part, d_part = axis in src.partial, axis in dst.partial
        s_dim, d_dim = src.dim_of(axis), dst.dim_of(axis)
        if s_part and d_part:
            continue
        if d_part:
            raise ValueError(f"cannot produce partial({axis}) from {src}")
        if s_part:
            out.append(("reduce_scatter" if d_dim else "all_reduce", axis))
        elif s_dim and d_dim:
            # the same dim, split inside the same outer axes (a nested split, ``seq: cp*tp``):
            # the same slices; otherwise the slices move between ranks
            if s_dim != d_dim or _outer(src, axis, degrees) != _outer(dst, axis, degrees):
                out.append(("all_to_all", axis))
        elif s_dim:
            out.append(("all_gather", axis))
        elif d_dim:
            out.append(("split", axis))
    return out


def _outer(s: Sharding, axis: str, degrees: Mapping[str, int]) -> tuple[str, ...]:
    """The axes of more than one rank that a nested split puts outside ``axis``."""
    return tuple(a for a in s.outer_axes(axis) if degrees.get(a, 1) > 1)


def dual(s: Sharding) -> Sharding:
    """The layout of the gradient a tensor of layout ``s`` needs: the same splits, no
    partial axes (the gradient of a partial sum is the full gradient on every rank)."""
    return s.without_partial()




def op_collectives(node, degrees: Mapping[str, int], local_in: Sequence[TensorType],
                   local_out: TensorType) -> list[Collective]:
    """The collectives one op runs (see :class:`Collective`); ``node`` is a graph Node."""
    op = node.op
    a = op.attr_map
    res: list[Collective] = []
    if op.kind == "redistribute":
        where = a["where"]
        for kind, axis in a["fwd"]:
            if kind in COMM_KINDS:
                res.append(Collective(kind, axis, local_out.nbytes, "forward", where))
        g = node.grads[0].local_type(node.type, degrees) if node.grads else local_out
        for kind, axis in a["bwd"]:
            if kind in COMM_KINDS:
                res.append(Collective(kind, axis, g.nbytes, "backward", where))
    elif op.kind == "send_recv":
        where = f"stage {a['src_stage']} -> {a['dst_stage']}"
        nb = local_out.nbytes
        res += [
            Collective("send", "pp", nb, "forward", where, stage=a["src_stage"]),
            Collective("recv", "pp", nb, "forward", where, stage=a["dst_stage"]),
            Collective("send", "pp", nb, "backward", where, stage=a["dst_stage"]),
            Collective("recv", "pp", nb, "backward", where, stage=a["src_stage"]),
        ]
    elif op.kind == "step_collective":
        res.append(Collective(a["op"], a["axis"], a["bytes"], "step", a["where"], per="step",
                              count=int(a.get("count", 1))))
    elif op.kind == "cross_entropy":
        if node.requires[0].axis_of("vocab") == "tp" and degrees.get("tp", 1) > 1:
            logits = local_in[0]
            nb = logits.numel // logits.dims[-1].size * 4  # one fp32 per token
            # vocab-parallel cross-entropy: max, sum of exp, target logit
            res += [Collective("all_reduce", "tp", nb, "forward", op.module)] * 3
    elif op.kind in ("moe_dispatch", "moe_combine"):
        res += moe_collectives(op.kind, a, degrees, local_out if op.kind == "moe_dispatch" else local_in[0],
                               op.module)
    elif op.kind == "attention":
        if degrees.get("cp", 1) > 1 and "cp" in node.requires[1].axes_of("seq"):
            # context parallelism (approximate: all-gather K and V, reduce-scatter dK, dV)
            cp = degrees["cp"]
            for t in local_in[1:3]:
                res.append(Collective("all_gather", "cp", t.nbytes * cp, "forward", op.module))
                res.append(Collective("reduce_scatter", "cp", t.nbytes, "backward", op.module))
    return res


COUNTS_BYTES = 8  # the runtime exchanges token counts as int64


def moe_collectives(kind: str, a: Mapping[str, Any], degrees: Mapping[str, int], routed: TensorType,
                    where: str) -> list[Collective]:
    """The token dispatch (``moe_dispatch``) or combine (``moe_combine``) of one MoE layer,
    one micro-batch, one rank (Megatron-Core's all-to-all token dispatcher).

    ``routed`` is the local ``(b, s, top_k, h)`` tensor: the A = b * s_local * top_k
    (token, expert) rows this rank sends, A * h * e bytes. Under balanced routing a rank
    also receives A rows (R = A); the sizes marked ``bytes_per_row`` depend on the router
    (R, or the sum of R over expert_tp) and are that balanced estimate. Forward:

    * dispatch: all-to-all over ep of the token counts per expert (E int64), all-to-all
      over ep of the rows (R h e); with expert_tp > 1 an all-gather over expert_tp of the
      counts (expert_tp * E int64) and of the rows (sum of R over expert_tp);
    * combine: with expert_tp > 1 a reduce-scatter over expert_tp of the experts' partial
      outputs (R h e), then the all-to-all over ep back to the tokens' ranks (A h e, exact).

    Backward mirrors them: combine: all-to-all (R), all-gather over expert_tp (sum of R);
    dispatch: reduce-scatter over expert_tp (R), all-to-all (A, exact). No count exchange
    runs in backward (the forward's splits are reused).


    Serving with ``ep = 1`` (``ffn_axis = "tp"``, set by ``shard-experts``): every rank holds
    every expert and the tokens of the whole tp group, so neither runs a collective; the
    combine's partial sums over tp are all-reduced by the conversion after them.
    """
    ep, etp = degrees.get("ep", 1), degrees.get("expert_tp", 1)
    if a.get("ffn_axis") == "tp":   # experts split over tp, the tokens replicated there: nothing moves
        return []
    row = routed.dims[-1].size * routed.itemsize
    nb = routed.nbytes
    E = a["experts"]
    out: list[Collective] = []
    if kind == "moe_dispatch":
        if ep > 1:
            out.append(Collective("all_to_all", "ep", E * COUNTS_BYTES, "forward", where))
            out.append(Collective("all_to_all", "ep", nb, "forward", where, bytes_per_row=row))
        if etp > 1:
            out.append(Collective("all_gather", "expert_tp", etp * E * COUNTS_BYTES, "forward", where))
            out.append(Collective("all_gather", "expert_tp", etp * nb, "forward", where, bytes_per_row=row))
            out.append(Collective("reduce_scatter", "expert_tp", nb, "backward", where, bytes_per_row=row))
        if ep > 1:
            out.append(Collective("all_to_all", "ep", nb, "backward", where))
    else:
        if etp > 1:
            out.append(Collective("reduce_scatter", "expert_tp", nb, "forward", where, bytes_per_row=row))
        if ep > 1:
            out.append(Collective("all_to_all", "ep", nb, "forward", where))
            out.append(Collective("all_to_all", "ep", nb, "backward", where, bytes_per_row=row))
        if etp > 1:
            out.append(Collective("all_gather", "expert_tp", etp * nb, "backward", where, bytes_per_row=row))
    return out
