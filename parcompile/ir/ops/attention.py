"""The attention core (``attention``; MLA's absorbed serving core: ``latent``): its output
type, FLOPs, bytes saved for backward, traffic, serve scratch, its context-parallel
collectives, its program row and the kernel each engine runs for it
(:func:`parcompile.core.attention.kernel_choice`, the one decision).
"""

from __future__ import annotations

from parcompile.core.attention import Kernel, attention_kernel
from parcompile.ir.ops.base import Code, Collective, OpSpec, Trait, heads_facts
from parcompile.ir.tp import TpRule
from parcompile.ir.types import TensorType


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


#: the row of :data:`parcompile.core.attention.ATTENTION_KERNELS` of the programs parcompile
#: generates: the training program and the serve program run the runtime's torch attention
#: (runtime/model/core_attention.py ``attention_core``, runtime/serve/generate.py ``cached_attention``), which
#: does what their rows say (``fused=``) and decides nothing itself
PROGRAM = "program"


def attention_kernel_for(a, engine: str | None = None) -> Kernel:
    """The kernel an attention op with attributes ``a`` runs under ``engine``: the one
    decision (issue 46) that the cost model (bytes kept, traffic, time), the training
    program's row (``fused=``), the serve program's row and its scratch read alike. The
    choice per (engine, variant) and its sources are :func:`parcompile.core.attention.kernel_choice`'s
    table; ``engine`` is a row of it (``program``: both generated programs, :data:`PROGRAM`),
    None: the ``kernel`` attribute the cost model set for its engine
    (:func:`parcompile.core.attention.with_kernel`), else :data:`PROGRAM`.

    Raises:
        KeyError: an unknown engine."""
    return attention_kernel(a, engine)


def _fused(a) -> bool:
    """The attention core runs as one fused kernel (:func:`attention_kernel_for`)."""
    return attention_kernel_for(a).fused


def _attention_extra(a, ins, out):
    q = ins[0]
    b, s = q.shape[0], q.shape[1]
    e = q.itemsize
    cp = a["seq_len"] // s if s < a["seq_len"] else 1   # this rank holds s of seq_len queries
    kernel = attention_kernel_for(a)
    extra = 0
    if kernel.fused:
        # the fused kernel keeps its output (saves_output) and the fp32 log-sum-exp per
        # query and head; dropout is replayed from the RNG state, no mask
        heads_local = q.dims[-1].size // a["head_dim"]
        extra += b * s * heads_local * 4
        pad = a["head_dim"] - a.get("v_head_dim", a["head_dim"])
        if pad > 0 and kernel.pads_v:
            # MLA: the kernel takes v padded to head_dim and keeps it and its padded output; the
            # output cut to v_head_dim is a copy, the one wo keeps (runtime/model/core_attention.py _padded_core)
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


# --- scratch of the serve program (:attr:`OpSpec.scratch`)

def attention_scratch(a, ins, out):
    """The serve program's attention core (runtime/serve/generate.py ``serve_attention`` and
    ``cached_attention``) over ``L = seq_len`` keys for the step's T queries, ``S = b Hq T L``
    scores (local heads), e the model dtype's bytes:

    * the keys and values it attends, ``L`` tokens, where they are copies and not a view of
      the cache (``kv_copy``, set by the caller: the paged engine gathers the context from
      its blocks and appends the step's, a sliding-window cache concatenates its window and
      the step's, a cache in another dtype is read back converted);
    * grouped-query attention: k and v repeated to the query heads (``repeat_interleave``,
      ``2 b Hq L d e``) where a rank holds more query than kv heads;
    * fused (``attention = flash``, torch's SDPA): the boolean mask made an additive one,
      ``b T L e``; the kernel's output is the op's (a view);
    * unfused: before the weighted values (the op's output) exist, the scores, their fp32
      copy (16-bit) and the fp32 softmax, ``(e + 8) S`` (fp32: ``8 S``), with sinks (gpt-oss:
      the program spells the softmax out) the scores with the sink column appended, ``e S``
      more; beside the weighted values, the scores and the softmax (fp32) or its cast
      (16-bit).

    MLA's absorbed core (``latent``; runtime/model/mla.py ``latent_attention``): the keys
    ``[latent, RoPE key]`` concatenated over the context, the queries as rows (a copy of q),
    the mask repeated per head (``S`` bytes) and made additive (``S e``); with its value
    narrower than its key no fused SDPA kernel of the CPU takes it and torch's math path
    runs (counted on every device: an upper bound where a fused kernel takes it): a scaled copy of the query rows, then of the keys beside the scores (``S e``),
    then the scores, their softmax and its -inf test (``(2 e + 1) S``), then the softmax
    beside the output; one kv head (no repetition)."""
    q, k, v = ins[0], ins[1], ins[2]
    b, T = q.shape[0], q.shape[1]
    e = q.itemsize
    L = a["seq_len"]
    heads = q.dims[-1].size // a["head_dim"]
    S = b * heads * T * L
    # unfused, before the weighted values (the op's output) exist: the scores, with sinks
    # their copy with the sink column, its fp32 copy (16-bit), the fp32 softmax; beside the
    # weighted values: the scores and the softmax (fp32) or its cast (16-bit)
    before = S * (e + (e if a.get("sinks") else 0) + (4 if e < 4 else 0) + 4)
    soft = max(before - out.nbytes, S * (e + (e if e < 4 else 4)))
    if a.get("latent"):
        keys = (k.nbytes + v.nbytes) * L // T
        held = keys + q.nbytes + S
        if not attention_kernel_for(a, PROGRAM).fused:
            return held + soft
        math = max(q.nbytes + keys + S * e - out.nbytes, q.nbytes + (2 * e + 1) * S - out.nbytes,
                   q.nbytes + S * e)
        return held + S * e + math
    extra = (k.nbytes + v.nbytes) * L // T if a.get("kv_copy") else 0
    kv_heads = k.dims[-1].size // a["head_dim"]
    if heads > kv_heads:
        extra += 2 * b * heads * L * a["head_dim"] * e
    if attention_kernel_for(a, PROGRAM).fused:
        return extra + b * T * L * e
    return extra + soft


# --- program row (:class:`Code`)

def _program_kernel(a) -> Kernel:
    """The kernel of the generated program's row: :func:`attention_kernel_for` under
    :data:`PROGRAM` for each layer the row is written for (``_each_layer``: their per-layer
    windows; one layer: ``a``), which must agree.

    Raises:
        ValueError: (internal) the layers of one class would run different kernels."""
    kernels = {attention_kernel_for(x, PROGRAM) for x in a.get("_each_layer") or (a,)}
    if len(kernels) > 1:
        raise ValueError(f"internal error: the layers of one class run the attention kernels "
                         f"{sorted(k.name for k in kernels)}; one row passes one")
    return kernels.pop()


def _attention_facts(a) -> dict:
    """The attention core's keyword arguments (runtime/model/core_attention.py ``attention``): context
    parallelism's k/v gather where the op all-gathers over cp (its collectives), selective
    recomputation where the pass marked it (``recompute``), Gemma's score scale and soft-cap, sinks.
    The window and the scale may differ between layers (the op kind's ``per_layer``): written
    as given (a literal, or ``self.window`` where they differ), never decided on."""
    # the program's kernel: the one decision (sinks or a soft-cap: never torch's fused SDPA)
    kw = f", fused={_program_kernel(a).fused}"
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


def _latent_core_facts(a) -> dict:
    return {**_attention_facts(a), **heads_facts(a)}


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



def _attention_collectives(node, degrees, local_in, local_out) -> list[Collective]:
    """Context parallelism (approximate): all-gather K and V, reduce-scatter dK and dV."""
    if degrees.get("cp", 1) > 1 and "cp" in node.requires[1].axes_of("seq"):
        cp = degrees["cp"]
        return [c for t in local_in[1:3] for c in (
            Collective("all_gather", "cp", t.nbytes * cp, "forward", node.op.module),
            Collective("reduce_scatter", "cp", t.nbytes, "backward", node.op.module))]
    return []


# --- tensor-parallel styles of its own (the generic ones: :mod:`parcompile.ir.tp`)

def _latent_core_tp(attrs, in_types, out, sequence_parallel) -> TpRule:
    """MLA's absorbed core: the heads split; the latent and the RoPE key replicated."""
    # MLA's absorbed core: the queries split with their heads, the latent and the RoPE key
    # (one "kv head" shared by all) replicated
    return TpRule(out_split=out.dims[-1].name, in_split=(in_types[0].dims[-1].name, None, None),
                  grad_partial=(False, True, True))


#: the op kinds of this module
DEFINITIONS = [
    OpSpec("attention", _attention_type, fwd_flops=_attention_flops, saves=lambda a: (0, 1, 2),
           saved_extra=_attention_extra, saved_gathered=_attention_gathered, arity=3, selective_recompute=True,
           saves_output=_fused, traffic=_attention_traffic, scratch=attention_scratch, code=_attention_code,
           collectives=_attention_collectives, traits=frozenset({Trait.ATTENTION}), kernel=attention_kernel_for,
           tp_styles={"latent_core": _latent_core_tp},
           # sliding and full layers (Gemma 2/3, gpt-oss, Mistral); a scale per layer; Llama 4's
           # chunked (RoPE) and full (NoPE) layers
           per_layer=("window", "scale", "chunk")),
]
