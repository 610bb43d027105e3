"""Token-by-token generation for generated serve programs: the KV cache, prompt batches,
attention over the cache, the pipeline pass of one step, sampling, tokenizers and the end
token.

The serve program (``parcompile/codegen/templates/serve.py.j2``) builds its model from the
training runtime's tensor-parallel layers; this module holds what only inference needs.
Weights come from :mod:`parcompile.runtime.state.weights`.

Layout (plan.json): attention heads and the cache split by kv head over tp (one kv head
replicated on ``tp / kv_heads`` ranks when tp is a multiple of kv_heads), layers and their
cache split over pp, dp replicas independent. One generation step passes the whole batch
through the stages in order: stage s receives the hidden state (B, T, h) from stage s-1,
the last stage all-gathers the vocab-split logits of the last position over tp, picks
the next tokens (the same on every tp rank: greedy, or sampling from a generator seeded
alike) and broadcasts them over pp, so every rank knows the batch's tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parcompile.core.files import json_loads
from parcompile.core.model import cached_tokens
from parcompile.runtime.distributed.comm import COUNTER, all_gather_single, isend, nbytes, recv
from parcompile.runtime.distributed.context import Axis, ParallelContext
from parcompile.runtime.machine.dtypes import KV_TORCH_DTYPES as TORCH_DTYPES  # the serve template's gen.TORCH_DTYPES
from parcompile.runtime.model.core_attention import check_fused, spelled_out


class ServeError(Exception):
    """A mistake the serve program reports as one ``error:`` line (no traceback): a missing
    weights directory, a checkpoint of another model, an unreadable tokenizer."""


class KVCache:
    """Keys and values of every local layer: (B, kv_local, C, head_dim) each, in ``dtype``
    (the spec's ``kv_dtype``), C = ``max_len`` for a full-attention layer and
    ``min(window, max_len)`` for a sliding-window one, which keeps only the last
    ``window`` tokens (vLLM, transformers' sliding-window cache). fp8 is stored as
    ``float8_e4m3fn`` without scaling and widened to the compute dtype when read.

    ``windows``: one attention window for every layer, or a sequence indexed by layer id
    (0: full causal). ``v_dim``: the values' width when it is not ``head_dim`` (MLA keeps
    its latent as the keys, ``kv_local = 1`` x kv_lora_rank, and the RoPE key as the values,
    qk_rope_head_dim wide: :func:`parcompile.runtime.model.mla.latent_attention`). ``nbytes`` is what the plan predicts: ``B * 2 * kv_local * head_dim
    * bytes * sum_layers C`` (``serve.kv_cache_bytes_per_rank``; :mod:`parcompile.analysis.kv`).
    """

    def __init__(self, layers: list[int], batch: int, kv_local: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device, windows=0, v_dim: int | None = None):
        self.max_len = max_len
        win = {i: (windows[i] if isinstance(windows, (tuple, list)) else windows) for i in layers}
        self.capacity = {i: cached_tokens(w, max_len) for i, w in win.items()}
        self.k = {i: torch.zeros((batch, kv_local, c, head_dim), dtype=dtype, device=device)
                  for i, c in self.capacity.items()}
        self.v = {i: torch.zeros((batch, kv_local, c, head_dim if v_dim is None else v_dim), dtype=dtype,
                                 device=device) for i, c in self.capacity.items()}

    @property
    def nbytes(self) -> int:
        return sum(nbytes(t) for t in self.k.values()) + sum(nbytes(t) for t in self.v.values())

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, kv_local, T, D) at cache positions ``start..start+T-1``; return the
        keys and values the step's queries may attend, in k's dtype: the cache up to
        ``start + T`` (B, kv_local, start+T, D), or for a sliding-window layer the last
        ``n + T`` of them (``n = min(start, C)`` held before the step; the mask's last
        ``n + T`` columns match them).

        Raises:
            ServeError: the cache is full (a request longer than it was sized for).
        """
        end = start + k.shape[2]
        if end > self.max_len:
            raise ServeError(f"the KV cache holds {self.max_len} tokens; this step needs {end}")
        cap = self.capacity[layer]
        if cap < self.max_len:     # sliding window: [0, n) holds tokens start-n .. start-1, in order
            n = min(start, cap)
            keys = torch.cat([self.k[layer][:, :, :n].to(k.dtype), k], dim=2)
            values = torch.cat([self.v[layer][:, :, :n].to(v.dtype), v], dim=2)
            kept = min(keys.shape[2], cap)
            self.k[layer][:, :, :kept] = keys[:, :, -kept:].to(self.k[layer].dtype)
            self.v[layer][:, :, :kept] = values[:, :, -kept:].to(self.v[layer].dtype)
            return keys, values
        self.k[layer][:, :, start:end] = k.to(self.k[layer].dtype)
        self.v[layer][:, :, start:end] = v.to(self.v[layer].dtype)
        return self.k[layer][:, :, :end].to(k.dtype), self.v[layer][:, :, :end].to(v.dtype)


@dataclass
class PackGroup:
    """Rows of a packed step (:class:`Packing`) laid out alike for attention: ``shape`` (G,
    T), G rows left-padded to their longest, T tokens (the decode rows, T = 1: no padding).
    The group's real tokens are the packed tokens ``start .. start + count - 1`` (its rows
    one after the other, in the step's row order). ``to_padded`` (G T,): for each padded
    slot, in row-major order, the index of its token in that packed slice (a padding slot
    points at its row's first token: a finite copy no real query reads); ``to_packed``
    (count,): for each packed token its padded slot; both None when no row is padded (the
    layouts are one view). ``masks``: per attention window (0: full causal) (G, 1, T, C +
    T), True where a query may attend a key, C the group's longest context (the paged
    cache's rule, :func:`parcompile.runtime.serve.paged.paged_step`). ``write`` (count,): the
    cache slot of each real token, in packed order; ``read`` (G C,): the C slots of each
    row's context, row after row (a column past a row's context points anywhere: the mask
    hides it)."""

    start: int
    count: int
    shape: tuple[int, int]
    to_padded: torch.Tensor | None
    to_packed: torch.Tensor | None
    masks: dict
    write: torch.Tensor
    read: torch.Tensor

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """The group's tokens of a packed tensor x (1, N, ...) left-padded: -> (G, T, ...)."""
        y = x[0, self.start:self.start + self.count]
        if self.to_padded is not None:
            y = y.index_select(0, self.to_padded)
        return y.view(*self.shape, *x.shape[2:])

    def pack(self, y: torch.Tensor) -> torch.Tensor:
        """The group's real tokens of y (G, T, ...), in packed order: -> (count, ...)."""
        y = y.reshape(self.shape[0] * self.shape[1], *y.shape[2:])
        return y if self.to_packed is None else y.index_select(0, self.to_packed)


@dataclass
class Packing:
    """How a step's tokens are packed (the paged engine's layout: one token row per real
    token, N in all, no padding through the linear layers, norms and MLPs; vLLM's packed
    batch): the ``groups`` (:class:`PackGroup`) in packed order, each holding a
    contiguous slice of the N tokens; ``last`` (B,) the packed index of each row's last
    token, in the step's row order; ``lengths`` and ``offsets`` (B each, row order): each
    row's token count and the packed index of its first token."""

    groups: list[PackGroup]
    last: torch.Tensor
    lengths: list[int]
    offsets: list[int]


@dataclass
class StepInput:
    """What every layer of one step needs: where the step's tokens sit in the cache
    (``start``), their positions in their sequences (B, T), and per attention window the
    model's layers use (0: full causal) the mask (B, 1, T, start+T), True where a query
    may attend a key (a sliding-window cache attends only the mask's last columns).
    ``all_positions``: the last stage returns the logits of every position (B, T, V'/tp),
    not only the last one's (B, V'/tp) (prompt logprobs: `parcompile serve`'s ``echo``).

    ``packing`` (the paged engine, :func:`parcompile.runtime.serve.paged.paged_step`): the step's
    tokens are packed, ids and hidden states (1, N, ...), ``positions`` (1, N), and the
    masks live in the packing's groups (``masks`` empty, ``start`` unused); None for the
    contiguous cache's (B, T) layout. The program reads a step's outputs through
    :meth:`last` and :meth:`padded`, which know both layouts."""

    start: int
    positions: torch.Tensor
    masks: dict
    all_positions: bool = False
    packing: Packing | None = None

    def last(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's last token: x (B, T, ...) -> (B, 1, ...) (its last position; packed
        (1, N, ...): the rows' last tokens, in row order)."""
        if self.packing is None:
            return x[:, -1:]
        return x[0].index_select(0, self.packing.last).unsqueeze(1)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """Every position of every row: x (B, T, ...) as it is; packed (1, N, ...) -> (B, T,
        ...) left-padded to the step's longest row T, a padding position holding a copy of
        its row's first token (the layout :func:`parcompile.runtime.serve.paged.logprob_table`
        reads)."""
        if self.packing is None:
            return x
        n, off = self.packing.lengths, self.packing.offsets
        T = max(n)
        idx = [o + max(t - (T - k), 0) for k, o in zip(n, off) for t in range(T)]
        index = torch.tensor(idx, dtype=torch.long, device=x.device)
        return x[0].index_select(0, index).view(len(n), T, *x.shape[2:])


def by_group(step: StepInput, fn, *xs: torch.Tensor) -> torch.Tensor:
    """The attention entry points' one rule for both layouts: ``fn(where, masks, *padded)``
    runs on tensors (B, T, ...) and returns (B, T, ...), ``where`` what the cache's
    ``store`` takes (the contiguous :class:`KVCache`: the step's ``start``; the paged one:
    the :class:`PackGroup`) and ``masks`` the step's masks by window. Contiguous step: one
    call on ``xs`` as given. Packed step (``step.packing``): xs (1, N, ...) are unpacked
    per group (:meth:`PackGroup.unpack`), ``fn`` runs per group, and its outputs are packed
    back -> (1, N, ...)."""
    if step.packing is None:
        return fn(step.start, step.masks, *xs)
    outs = [g.pack(fn(g, g.masks, *(g.unpack(x) for x in xs))) for g in step.packing.groups]
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)).unsqueeze(0)


def write_step(pos: "LayerStep", k: torch.Tensor, v: torch.Tensor) -> None:
    """A packed step (the paged engine's, ``pos.step.packing``): write its new k, v (1, N,
    Hkv, D) of layer ``pos.layer`` into the paged cache once, before :func:`by_group` runs
    the groups (whose ``cache.store`` then reads only:
    :meth:`parcompile.runtime.serve.paged.PagedKVCache.write_step` says why). A contiguous step
    (the :class:`KVCache`) writes in its ``store``: nothing here."""
    if pos.step.packing is not None:
        pos.cache.write_step(pos.layer, k, v)


@dataclass
class LayerStep:
    """What one decoder layer of a serving step reads besides its input (the generated
    program's ``pos``, as training's :class:`~parcompile.runtime.distributed.context_parallel.Positions`):
    the ``step``, the ``cache`` (:class:`KVCache` or the paged one), the ``layer``'s index in
    it, and ``rope``: the (cos, sin) tables at the step's token positions, (B, T, rot) each
    ((1, N, rot) packed), or None without RoPE."""

    step: StepInput
    cache: object
    layer: int
    rope: tuple[torch.Tensor, torch.Tensor] | None = None


def rope_at(tables, positions: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The RoPE ``tables`` (cos, sin) (SEQ_LEN, rot) at ``positions`` (B, T) (a packed
    step's: (1, N)) -> (B, T, rot) each on ``device``; None without RoPE."""
    if tables is None:
        return None
    idx = positions.reshape(-1).to(tables[0].device)        # index_select: advanced indexing costs more per call
    return tuple(t.index_select(0, idx).view(*positions.shape, t.shape[-1]).to(device) for t in tables)


def serve_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: LayerStep, window: int, *,
                    fused: bool, scale: float | None = None, sinks: torch.Tensor | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """The attention core of a serving step on per-head tensors (training's layout): q (B, T,
    Hq, D), k/v (B, T, Hkv, D) of the step's tokens ((1, N, ...) packed: :func:`by_group`
    runs each group of rows padded alike); k and v are written into ``pos.cache``
    at layer ``pos.layer`` (the contiguous :class:`KVCache` or the paged one, whose rows
    may start after a cached prefix or a chunk), the queries attend the cache so far under
    the step's mask for ``window`` (:func:`cached_attention`, ``scale``, ``sinks`` and
    ``softcap`` as there: the attention op's attributes, ir/ops/attention.py) -> (B, T, Hq * D)."""

    def core(where, masks, q, k, v):
        B, T = q.shape[:2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)      # (B, heads, T, D)
        k, v = pos.cache.store(pos.layer, k, v, where)                         # (B, Hkv, L, D): the cache so far
        y = cached_attention(q, k, v, masks[window], fused, scale, sinks, softcap)
        return y.transpose(1, 2).reshape(B, T, -1)

    write_step(pos, k, v)
    return by_group(pos.step, core, q, k, v)


class Requests:
    """A batch of prompts, left-padded to one length, and the tokens generated so far.

    ``valid`` (B, L) marks real tokens in cache order, ``positions`` (B, L) their positions
    in their own sequences (a left-padded prompt starts at 0 after its padding).
    """

    def __init__(self, prompts: list[list[int]], max_new_tokens: int, window, device):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ServeError("every prompt needs at least one token")
        self.batch = len(prompts)
        self.prompt_len = max(len(p) for p in prompts)
        self.max_len = self.prompt_len + max_new_tokens
        # one window for every layer, or each layer's (local and global layers: Gemma, gpt-oss)
        self.windows = tuple(dict.fromkeys(window)) if isinstance(window, (tuple, list)) else (window,)
        self.device = device
        B, L = self.batch, self.max_len
        self.ids = torch.zeros((B, L), dtype=torch.long)
        self.valid = torch.zeros((B, L), dtype=torch.bool)
        for b, p in enumerate(prompts):
            pad = self.prompt_len - len(p)
            self.ids[b, pad:self.prompt_len] = torch.tensor(p, dtype=torch.long)
            self.valid[b, pad:self.prompt_len] = True
        self.valid[:, self.prompt_len:] = True
        self.positions = (self.valid.long().cumsum(-1) - 1).clamp(min=0)
        self.length = self.prompt_len   # tokens in the cache after the next step's input

    def step(self, start: int, end: int) -> StepInput:
        """Inputs of a step whose tokens sit at cache positions ``start..end-1``."""
        q_idx = torch.arange(start, end)
        k_idx = torch.arange(end)
        causal = self.valid[:, None, :end] & (k_idx[None, None, :] <= q_idx[None, :, None])
        masks = {}
        for window in self.windows:
            keep = causal.clone()
            if window:
                qp, kp = self.positions[:, start:end], self.positions[:, :end]
                # positions differ by less than ``end``: a longer window (a spec may write 10**30,
                # past what a tensor compares with) keeps the same tokens
                keep &= (qp[:, :, None] - kp[:, None, :]) < min(window, end)
            # a padding query sees itself only: finite values that no real token attends
            keep |= k_idx[None, None, :] == q_idx[None, :, None]
            masks[window] = keep.unsqueeze(1).to(self.device)
        return StepInput(start, self.positions[:, start:end].to(self.device), masks)


def apply_rope_at(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (B, T, H, D) at per-sequence positions: cos/sin (B, T, rot)
    (the tables of :func:`parcompile.runtime.model.layers.rope_tables` indexed by position):
    ``x * cos + rotate_half(x) * sin`` on the first ``rot`` dims of each head, the rest
    passed through (transformers' ``apply_rotary_pos_emb``, its op order: serving's
    greedy tokens are compared with it exactly)."""
    rot = cos.shape[-1]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)                         # (B, T, 1, rot)
    if c.dtype != x.dtype:
        c, s = c.to(x.dtype), s.to(x.dtype)
    whole = rot == x.shape[-1]
    xr = x if whole else x[..., :rot]
    rotated = torch.cat([-xr[..., rot // 2:], xr[..., : rot // 2]], dim=-1)
    y = (xr * c).add_(rotated.mul_(s))                                  # fresh tensors: in place
    return y if whole else torch.cat([y, x[..., rot:]], dim=-1)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, fused: bool,
                     scale: float | None = None, sinks: torch.Tensor | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over the cache (``scale`` None: 1 / sqrt(d)): q (B, Hq, T, D),
    k/v (B, Hkv, L, D), mask (B, 1, T, L) -> (B, Hq, T, D). Each group of Hq/Hkv query
    heads shares one kv head. ``sinks`` (Hq,): one more logit per head in the softmax's
    denominator, dropped after it (gpt-oss; the training core's rule,
    :func:`parcompile.runtime.model.core_attention.attention_core`). ``softcap`` (Gemma 2's
    ``attn_logit_softcapping``): the scaled scores become ``cap * tanh(scores / cap)``
    before the mask and the softmax (:func:`parcompile.runtime.model.core_attention.softcap`; transformers
    5.24 ``models/gemma2/modeling_gemma2.py`` ``eager_attention_forward``, vLLM's
    ``logits_soft_cap``); torch's SDPA cannot cap, so the softmax is spelt out (the serve
    program's row passes ``fused=False`` for both: the kernel is the op's one decision,
    parcompile/ir/ops/attention.py ``attention_kernel_for``).

    Raises:
        ValueError: ``fused`` with sinks or a soft-cap."""
    check_fused(fused, sinks, softcap)
    rep = q.shape[1] // k.shape[1]
    mask = mask[..., -k.shape[2]:]         # a sliding-window cache returns only the last keys
    if fused and q.shape[2] == 1 and q.device.type == "cpu" and torch.compiler.is_compiling():
        # one query per row (a serve step's decode rows) under torch.compile (serve.compile):
        # the softmax spelt out, which inductor fuses into its own kernels, where CPU's flash
        # kernel is one opaque call that costs more than the rest of the layer at these sizes
        # (issue 33: a 32-row decode step 3.8 -> 3.1 ms, the same tokens)
        fused = False
    if fused and rep > 1 and q.device.type == "cpu":
        # GQA inside SDPA, k/v not copied per query head: CPU's flash kernel takes it with a
        # mask (the same results as the copies); CUDA's fused kernels do not and would fall
        # back to the math kernel (pytorch/pytorch#139586), so they get the copies
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    if fused:
        if rep > 1:   # GQA by copies: CUDA's fused kernels take no grouped k/v with a mask
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # the softmax spelt out (the training core's math, runtime/model/core_attention.py), k and v copied per
    # query head rather than a grouped view: the grouped products round differently (small-M
    # GEMM kernels), and eager attention (transformers' repeat_kv) computes these
    return spelled_out(q, k, v, mask, scale=scale, softcap=softcap, sinks=sinks, expand_kv=True)


def gather_vocab(logits: torch.Tensor, tp: Axis) -> torch.Tensor:
    """All-gather vocab-split logits (B, V'/tp) over tp -> (B, V') (counted)."""
    if tp.size == 1 or tp.group is None:
        return logits
    x = logits.t().contiguous()                                  # (V'/tp, B)
    out = torch.empty((x.shape[0] * tp.size, x.shape[1]), dtype=x.dtype, device=x.device)
    COUNTER.record("all_gather", tp.name, nbytes(out))
    all_gather_single(out, x, group=tp.group)
    return out.t().contiguous()


def broadcast_from_last(t: torch.Tensor, pp: Axis) -> torch.Tensor:
    """Broadcast ``t`` from the last rank of the pp group to all of it (counted); in place."""
    if pp.size == 1 or pp.group is None:
        return t
    COUNTER.record("broadcast", pp.name, nbytes(t))
    dist.broadcast(t, src=pp.ranks[-1], group=pp.group)
    return t


class NonFiniteLogits(ServeError):
    """The model's logits hold NaN or inf for a sequence (its weights or activations
    overflowed): no token can be drawn for it. ``rows``: the affected rows of the batch."""

    def __init__(self, rows: list[int]):
        super().__init__(f"the model produced NaN or infinite logits for batch row(s) {rows} (its weights or "
                         f"activations overflow in this dtype)")
        self.rows = rows


#: float32's smallest normal number (1.2e-38): :func:`is_greedy`'s bound (the serve engine asks
#: once per row and step; ``torch.finfo`` costs more than the comparison)
_FP32_TINY = torch.finfo(torch.float32).tiny


def is_greedy(temperature: float) -> bool:
    """Whether :func:`pick_tokens` draws greedily at ``temperature``: 0, NaN, and temperatures
    below float32's smallest normal number (1.2e-38; 1e-300 is 0 in float32)."""
    return not temperature >= _FP32_TINY


def pick_tokens(logits: torch.Tensor, vocab: int, temperature: float, top_k: int,
                generator: torch.Generator | None, top_p: float = 1.0) -> torch.Tensor:
    """Next token per sequence from logits (B, V'): padded columns (>= vocab) never win.
    ``temperature == 0`` is greedy (argmax, first on ties; so are NaN and temperatures below
    float32's smallest normal number, 1.2e-38); else softmax(logits / T) over
    the ``top_k`` likeliest (0: all), then over the smallest set of the likeliest whose
    probability reaches ``top_p`` (nucleus sampling, Holtzman et al. 2019; 1: all; the
    order of transformers' and vLLM's samplers), drawn with ``generator`` (CPU).

    Whatever ``temperature`` (> 0), ``top_k`` and ``top_p`` (even one that rounds to 0 in
    float32) say, the likeliest token always survives (transformers' ``min_tokens_to_keep``,
    vLLM's sampler), and ``logits / T`` is taken after subtracting each row's maximum, so
    that no finite logits overflow to inf and the probabilities are never NaN.

    Raises:
        NonFiniteLogits: a row of ``logits`` holds NaN or inf (a model fault, not a choice of
            sampling values): the caller answers that sequence with an error.
    """
    logits = logits[:, :vocab].float()
    bad = (~torch.isfinite(logits).all(dim=-1)).nonzero().flatten().tolist()
    if bad:
        raise NonFiniteLogits(bad)
    if is_greedy(temperature):
        return logits.argmax(dim=-1)
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature     # <= 0: never +inf
    if top_k and 0 < top_k < vocab:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
        drop = probs.cumsum(dim=-1) - probs >= top_p          # the mass before a token already reaches top_p
        drop[:, 0] = False                                    # the likeliest always survives
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1).cpu()
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


def pipeline_pass(stage_forward, ctx: ParallelContext, x_ids: torch.Tensor, step: StepInput, hidden: int,
                  dtype: torch.dtype, tag: int) -> torch.Tensor | None:
    """One step through this rank's stage: token ids (B, T) on the first stage (a packed
    step's: (1, N)), the hidden state (B, T, h) received from the previous stage elsewhere;
    sends the result on, and returns the last position's local logits (B, V'/tp) on the
    last stage (every position's, (B, T, V'/tp), with ``step.all_positions``; None
    elsewhere)."""
    pp = ctx.pp
    B, T = x_ids.shape
    if ctx.is_first_stage():
        x = x_ids.to(ctx.device)
    else:
        x = recv((B, T, hidden), dtype, ctx.device, pp, pp.index - 1, tag)
    y = stage_forward(x, step)
    if ctx.is_last_stage():
        return y
    isend(y.to(dtype).contiguous(), pp, pp.index + 1, tag).wait()
    return None


# ---- tokenizers ------------------------------------------------------------------------

class ByteTokenizer:
    """Bytes as tokens (the byte-level models training programs make from text files)."""

    kind = "bytes"
    #: the most UTF-8 bytes of text one token stands for (a lower bound on a text's tokens)
    max_token_bytes: int | None = 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (ids outside 0-255 dropped; bytes that are no UTF-8 as U+FFFD)."""
        try:
            raw = bytes(ids)          # the serve front decodes every streamed token's text: C speed
        except (ValueError, TypeError):
            raw = bytes(i for i in ids if 0 <= i < 256)
        return raw.decode("utf-8", errors="replace")

    def token_text(self, tok: int) -> str:
        """One token's own text (a logprobs entry's ``token``): its byte, as :meth:`decode`."""
        return self.decode([tok])


class IdTokenizer:
    """No tokenizer: prompts are token ids, output is printed as ids."""

    kind = "ids"
    max_token_bytes: int | None = None      # whitespace between ids is unbounded

    def encode(self, text: str) -> list[int]:
        try:
            return [int(x) for x in text.replace(",", " ").split()]
        except ValueError:
            raise ServeError("this model has no tokenizer.json and a vocabulary under 256 tokens: "
                             "give prompts as token ids (--prompt-ids 1,2,3)") from None

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)

    def token_text(self, tok: int) -> str:
        """One token's own text (a logprobs entry's ``token``): its id."""
        return str(tok)


class HFTokenizer:
    """A ``tokenizer.json`` read with the `tokenizers` library."""

    kind = "tokenizer.json"

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - a dependency
            raise ServeError("reading tokenizer.json needs the `tokenizers` package (pip install tokenizers)") from None
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise ServeError(f"cannot read the tokenizer {path}: {e}") from None
        self.max_token_bytes = _max_token_bytes(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens (the end token, chat markers) left out, as
        vLLM's detokenizer writes a completion's text (``skip_special_tokens``, default true)."""
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_text(self, tok: int) -> str:
        """One token's own text (a logprobs entry's ``token``), a special token's included
        ("<|endoftext|>"): vLLM decodes each logprob's token alone with the tokenizer's
        default ``skip_special_tokens`` (false) (``convert_ids_list_to_tokens`` in
        vllm-project/vllm vllm/tokenizers/detokenizer_utils.py at 092baf6, called from
        vllm/v1/engine/logprobs.py at dfafe71)."""
        return self.tok.decode([tok], skip_special_tokens=False)


#: normalizers and pre-tokenizers that never drop text (so each token stands for at most its
#: own UTF-8 bytes): `tokenizers`' type names; Replace / Split are checked further
_KEEPS_TEXT = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "NFC", "NFD", "NFKC", "NFKD", "Prepend",
               "Replace", "Sequence", "UnicodeScripts"}


def _max_token_bytes(tok) -> int | None:
    """The most UTF-8 bytes of input text one token of ``tok`` (a `tokenizers` Tokenizer)
    covers, over its vocabulary and added tokens: an upper bound for the byte-level and
    SentencePiece-style tokenizers (a byte-level symbol or ``▁`` is more UTF-8 bytes than
    the input byte it stands for); None when its normalizer or pre-tokenizer may drop text
    (whitespace splitting, stripping, removal), where no such bound holds."""
    import json

    try:
        d = json.loads(tok.to_str())
    except Exception:   # pragma: no cover - a tokenizer that cannot be written back
        return None

    def keeps(node) -> bool:
        if node is None:
            return True
        if not isinstance(node, dict) or node.get("type") not in _KEEPS_TEXT:
            return False
        if node["type"] == "Split" and node.get("behavior") == "Removed":
            return False
        if node["type"] == "Replace" and not node.get("content"):
            return False
        subs = node.get("normalizers") or node.get("pretokenizers") or []
        return all(keeps(x) for x in subs)

    if not (keeps(d.get("normalizer")) and keeps(d.get("pre_tokenizer"))):
        return None
    return max((len(t.encode("utf-8")) for t in tok.get_vocab(with_added_tokens=True)), default=1) or 1


def load_tokenizer(path: str | None, weights: str | None, vocab: int):
    """The tokenizer: ``path`` (a tokenizer.json or a directory holding one), else the
    weights directory's ``tokenizer.json``, else bytes when the vocabulary holds all 256
    byte values, else token ids.

    Raises:
        ServeError: ``path`` names no tokenizer.json.
    """
    if path:
        p = Path(path)
        p = p / "tokenizer.json" if p.is_dir() else p
        if not p.is_file():
            raise ServeError(f"no tokenizer at {path}: give a tokenizer.json or a directory holding one")
        return HFTokenizer(p)
    if weights and (Path(weights) / "tokenizer.json").is_file():
        return HFTokenizer(Path(weights) / "tokenizer.json")
    return ByteTokenizer() if vocab >= 256 else IdTokenizer()


def end_tokens(weights: str | None) -> list[int]:
    """End-of-sequence token ids of a Hugging Face checkpoint (``generation_config.json``,
    else ``config.json``: ``eos_token_id``, an int or a list); none otherwise."""
    if not weights:
        return []
    for name in ("generation_config.json", "config.json"):
        f = Path(weights) / name
        if f.is_file():
            try:
                eos = json_loads(f.read_text()).get("eos_token_id")
            except (OSError, ValueError):
                continue
            if isinstance(eos, int):
                return [eos]
            if isinstance(eos, list):
                return [int(x) for x in eos if isinstance(x, int)]
    return []


def default_prompts(batch: int, prompt_len: int, vocab: int, seed: int, tokenizer, text: str | None) -> list[list[int]]:
    """``batch`` prompts when none are given: ``text`` (or a short English line) through the
    tokenizer; with ids only, ``prompt_len`` tokens drawn from ``seed``."""
    if tokenizer.kind != "ids":
        ids = tokenizer.encode(text if text is not None else "The ")
        return [list(ids) for _ in range(batch)]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()


def replica_slice(items: list, index: int, size: int) -> list:
    """The contiguous share of ``items`` that data-parallel replica ``index`` of ``size``
    serves (the first replicas take one more when the count does not divide)."""
    n = len(items)
    per, extra = divmod(n, size)
    start = index * per + min(index, extra)
    return items[start:start + per + (1 if index < extra else 0)]


def write_record(out_dir: str | os.PathLike, ctx: ParallelContext, record: dict) -> None:
    """Write ``rank{r}.json`` (tokens, cache bytes, collectives) into ``out_dir``; the
    record's tensors (``logits`` with ``--record-logits``) go to ``rank{r}.pt`` beside it."""
    path = Path(out_dir) / f"rank{ctx.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v for k, v in record.items() if isinstance(v, torch.Tensor)}
    if tensors:
        tmp = path.with_suffix(".pt.tmp")
        torch.save(tensors, tmp)
        os.replace(tmp, path.with_suffix(".pt"))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({k: v for k, v in record.items() if k not in tensors}, indent=1, sort_keys=True))
    os.replace(tmp, path)


__all__ = [
    "ServeError", "KVCache", "PackGroup", "Packing", "StepInput", "LayerStep", "by_group", "rope_at", "serve_attention", "Requests", "apply_rope_at", "cached_attention", "gather_vocab",
    "broadcast_from_last", "pick_tokens", "NonFiniteLogits", "pipeline_pass", "ByteTokenizer", "IdTokenizer", "HFTokenizer",
    "load_tokenizer", "end_tokens", "default_prompts", "replica_slice", "write_record", "TORCH_DTYPES",
]
