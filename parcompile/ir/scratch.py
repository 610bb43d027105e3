"""Forward scratch of the serve program (:attr:`parcompile.ir.ops.OpSpec.scratch`; runtime/
generate.py, runtime/model/mla.py, runtime/model/moe.py: router, dispatch, experts, combine): the temporaries an op holds beside its operands
and its output while its forward runs with no autograd, in bytes at local types
(:func:`parcompile.analysis.serve_memory.serve_workspace` sums them with the live values).
"""

from __future__ import annotations

#: bytes of an int64 token / row index (the router's choices, the dispatch's rows)
INDEX_BYTES = 8


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
        if not _serve_fused(a):
            return held + soft
        math = max(q.nbytes + keys + S * e - out.nbytes, q.nbytes + (2 * e + 1) * S - out.nbytes,
                   q.nbytes + S * e)
        return held + S * e + math
    extra = (k.nbytes + v.nbytes) * L // T if a.get("kv_copy") else 0
    kv_heads = k.dims[-1].size // a["head_dim"]
    if heads > kv_heads:
        extra += 2 * b * heads * L * a["head_dim"] * e
    if _serve_fused(a):
        return extra + b * T * L * e
    return extra + soft


def _serve_fused(a) -> bool:
    """The serve program's attention core runs torch's fused SDPA: ``attention = flash``, no
    soft-cap (ir/code.py's ``fused``) and no sinks (runtime/serve/generate.py ``cached_attention``)."""
    return a.get("impl") == "flash" and a.get("softcap") is None and not a.get("sinks")


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


def router_scratch(a, ins, out):
    # runtime/model/moe.py Router.forward and route: the input in fp32 (a 16-bit model), the fp32
    # logits beside the scores (the output), the top-k weights (fp32) and experts (int64)
    n = ins[0].numel // ins[0].dims[-1].size
    x32 = ins[0].numel * 4 if ins[0].itemsize < 4 else 0
    return x32 + out.nbytes + n * a["top_k"] * (4 + INDEX_BYTES)


def _routed_rows(out) -> int:
    """The (token, choice) rows of a dispatch's or the experts' local (b, s, k, h) type: N k."""
    return out.numel // out.dims[-1].size


def dispatch_scratch(a, ins, out):
    # runtime/model/moe.py dispatch, every row local (no collective; with ep or expert_tp > 1 the
    # rows received: the graph's balanced estimate): the N k rows sorted by expert (N k h,
    # the model dtype) before their copy grouped by local expert (the output), and per row
    # the int64 sort order, token id, local-expert label and grouping
    r = _routed_rows(out)
    return r * (out.dims[-1].size * out.itemsize + 4 * INDEX_BYTES)


def experts_scratch(a, ins, out):
    # runtime/model/moe.py GroupedExperts: the experts run one at a time, an expert's rows at most
    # the N tokens of the step (each token chooses it once: the bound holds any routing), its
    # gate, up, activation and product (gated: 4 x f, ungated 2 x f; f the rank's ``local_ffn``)
    # beside the outputs of the experts before it; at the end the N k output rows of every
    # expert beside their concatenation (the op's output). Beside them the rows' int64 order
    # and grouping, which the routed rows carry to the combine.
    r, h, e = _routed_rows(out), out.dims[-1].size, out.itemsize
    n = r // a["top_k"]
    f = a.get("local_ffn", a["ffn"])
    inner = (4 if a["activation"] in ("swiglu", "geglu") else 2) * f
    return max(r * h * e, n * inner * e) + 2 * INDEX_BYTES * r


def combine_scratch(a, ins, out):
    # runtime/model/moe.py combine: the rows put back in arrival order, then in (token, choice) order
    # beside them (2 x N k h; one int64 sort per row at a time), then the weighted rows beside
    # the latter; the rows' order and grouping carried from the dispatch
    rows = ins[0]
    r = _routed_rows(rows)
    return 2 * rows.nbytes + 3 * INDEX_BYTES * r


__all__ = ["INDEX_BYTES", "attention_scratch", "combine_scratch", "dispatch_scratch", "experts_scratch",
           "norm_scratch", "rope_scratch", "router_scratch"]
