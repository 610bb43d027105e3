"""Continuous batching over a paged KV cache: the engine behind `parcompile serve` (SPEC 4).

The generated serve program (``serve.py``) builds its model as for one-shot generation and,
started with ``--engine HOST:PORT`` by `parcompile serve`, hands it to :func:`serve_requests`
instead of prefilling one batch. The same ``Stage.forward`` runs: its attention layers write
the step's k, v once (:func:`parcompile.runtime.serve.generate.write_step`), then call
``cache.store(layer, k, v, where)`` and :func:`parcompile.runtime.serve.generate.cached_attention`
with the step's masks (through :func:`parcompile.runtime.serve.generate.by_group`), and here the
cache is a :class:`PagedKVCache` bound to the step's groups of rows and their slots (as
vLLM's attention reads the forward context's slot mapping).

Scheduling, preemption, prefix caching and chunked prefill are the leader's host-side
bookkeeping, :mod:`parcompile.runtime.serve.scheduler` (:class:`Scheduler`, :class:`BlockPool`; no
torch there): each engine step it lays out ONE forward pass, the new requests' prompts
(prefill) beside one token of every running sequence (decode). The step's plan
(token ids, context lengths and block tables per row, the new requests' sampling
parameters) is broadcast to every rank of the replica over torch.distributed; the last
stage samples each row with its own parameters and generator and broadcasts the tokens
over pp (:func:`parcompile.runtime.serve.generate.broadcast_from_last`), so the leader knows them.

A step's tokens are packed (vLLM's layout): token ids (1, N), N the step's real tokens, so
the embedding, linear layers, norms, MLPs and MoE of ``Stage.forward`` run on real tokens
only, never on padding (a decode row beside a 512-token chunk costs one token, not 512).
Attention runs per group of rows laid out alike (:func:`paged_step`,
:class:`parcompile.runtime.serve.generate.PackGroup`): the rows of one new token (decode; no
padding at all) and the rows of more (prefill, chunks, recomputation) left-padded to their
own longest T. A group's row attends its cached context, gathered from its blocks (G,
kv, C, D), C the group's longest context, followed by the group's own keys (G, kv, T, D):
the mask (G, 1, T, C + T) lets a real query see its context and the real new keys up to
itself (and, for a sliding-window layer, only those within the window); a padding query
sees itself only (finite values no real token reads). Padding keys are never written.
``Stage.forward`` samples each row's last token (``StepInput.last``) and, for prompt
logprobs, lays every position out (B, T, V') left-padded again (``StepInput.padded``).

The leader talks to the HTTP front (``parcompile.server``) through a
``multiprocessing.connection`` socket whose authentication key comes in the environment
(``PARCOMPILE_ENGINE_KEY``, hex). Messages front -> engine: ``("add", rid, prompt_ids,
params)``, ``("abort", rid)``, ``("stop",)``; engine -> front: ``("ready", info)``,
``("out", [(rid, token, finish_reason or None, logprobs or None)], stats)``
(finish_reason "error": that request's logits were not finite, token
:data:`ERROR_TOKEN`; ``logprobs``: :func:`unpack_logprobs`), ``("error", message)``.

Logprobs (a request's ``params["logprobs"]``: k >= 0 alternatives; ``prompt_logprobs``:
also every prompt token's) are the log-softmax, in fp32, of the model's full-vocabulary
logits (the tp ranks' vocabulary shares gathered, :func:`parcompile.runtime.serve.generate.
gather_vocab`, padded rows dropped), before temperature, top-k or top-p (vLLM's
``raw_logprobs``); the last stage packs them (:func:`logprob_table`) and broadcasts them
over pp beside the tokens.
"""

from __future__ import annotations

import os
import json
import socket
import sys
import time
from functools import partial
from itertools import chain

import numpy as np
import torch
import torch.distributed as dist

from parcompile.core.model import STEP_PLAN_BYTES
from parcompile.runtime.serve import generate as gen
from parcompile.runtime.distributed.comm import nbytes
from parcompile.runtime.distributed.context import ParallelContext
# the leader's scheduling (runtime/serve/scheduler.py), re-exported: callers use them as paged.<name>
from parcompile.runtime.serve.scheduler import (ERROR_TOKEN, BlockPool, Row, Scheduler, Sequence, StreamBuffer,  # noqa: F401
                                         block_hashes)

#: seconds an idle leader waits for a request before it sends its replica an empty step
#: (a heartbeat: the other ranks never wait on a collective longer than this when idle)
IDLE_HEARTBEAT_S = 1.0
#: the environment variable holding the front's authentication key (hex)
KEY_ENV = "PARCOMPILE_ENGINE_KEY"


class PagedKVCache:
    """Keys and values of every local layer in ``blocks`` blocks of ``block_size`` tokens:
    (blocks * block_size, kv_local, head_dim) per layer, in ``dtype`` (the spec's
    ``kv_dtype``; widened to the compute dtype when read). A token at position p of a
    sequence sits in slot ``table[p // block_size] * block_size + p % block_size``.

    :meth:`bind` sets the step's slots; :meth:`store` has :class:`parcompile.runtime.
    generate.KVCache`'s interface, so the program's attention layers run unchanged. A
    sliding-window layer keeps every token (its mask drops the old ones). ``v_dim``: the
    values' width when it is not ``head_dim`` (MLA's latent and RoPE key).
    """

    def __init__(self, layers: list[int], blocks: int, block_size: int, kv_local: int, head_dim: int,
                 dtype: torch.dtype, device, v_dim: int | None = None):
        if blocks < 1 or block_size < 1:
            raise gen.ServeError(f"a paged KV cache needs blocks >= 1 and block_size >= 1, not {blocks}, {block_size}")
        self.blocks, self.block_size = blocks, block_size
        slots = blocks * block_size
        self.k = {i: torch.zeros((slots, kv_local, head_dim), dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.zeros((slots, kv_local, head_dim if v_dim is None else v_dim), dtype=dtype, device=device)
                  for i in layers}
        self.slots = torch.zeros(0, dtype=torch.long)     # the step's write slots (bind)

    @property
    def nbytes(self) -> int:
        return sum(nbytes(t) for t in self.k.values()) + sum(nbytes(t) for t in self.v.values())

    def bind(self, groups: list[gen.PackGroup]) -> None:
        """Take the step's groups of rows (:func:`paged_step`), each holding where its real
        tokens go (``write``: a slot per packed token) and the context slots its rows attend
        (``read``; :meth:`store` is given the group): ``slots`` (N,) becomes every packed
        token's slot, the groups' ``write`` one after the other (the groups hold consecutive
        slices of the packed tokens), for :meth:`write_step`."""
        self.slots = groups[0].write if len(groups) == 1 else torch.cat([g.write for g in groups])

    def write_step(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's new k, v of ``layer``, packed (1, N, kv_local, D) as the step's
        tokens (:func:`paged_step`), into their slots (:meth:`bind`'s ``slots``): one
        in-place write per tensor and step, before any group reads (:meth:`store`).

        One write, not one per group: under ``serve.compile`` inductor keeps a single
        ``index_copy_`` of a graph input in place, but two on the same cache tensor (a step
        with decode and prompt groups) made it copy every layer's whole cache and copy it
        back (torch 2.13's output code: a step of 31 decode rows and one prompt cost 5.1 ms
        against 2.5 ms for 32 decode rows; issue 33). A row never reads a slot the step
        writes (its context was written by earlier steps, and a block is shared through the
        prefix cache only once computed, :meth:`Scheduler.collect`), so the order is free."""
        for cache, new in ((self.k[layer], k), (self.v[layer], v)):
            cache.index_copy_(0, self.slots, new[0].to(cache.dtype))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              group: gen.PackGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the ``group``'s (one of those :meth:`bind` was given) queries
        attend, given its new k, v (G, kv_local, T, D) left-padded as
        :meth:`parcompile.runtime.serve.generate.PackGroup.unpack` lays them out: each row's
        context (G, kv_local, C, D) followed by the group's own, (G, kv_local, C + T, D), in
        k's dtype (the :class:`parcompile.runtime.serve.generate.KVCache` interface: the group
        stands where the contiguous cache takes the step's start). The step's new tokens
        are written once for all groups, by :meth:`write_step`
        (:func:`parcompile.runtime.serve.generate.write_step` calls it before the groups run)."""
        G, H, T, _ = k.shape
        C = group.read.shape[0] // G
        keys, values = (c.index_select(0, group.read).view(G, C, H, c.shape[-1]).transpose(1, 2).to(x.dtype)
                        for c, x in ((self.k[layer], k), (self.v[layer], v)))      # (G, H, C, D)
        return torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)


def _tables(rows: list[Row], width: int | None = None) -> np.ndarray:
    """The rows' block tables (G, width), each cut to ``width`` blocks (default: the longest
    table's) or padded with block 0 to it. One ``np.fromiter`` over the rows' lists (a 2-D
    ``np.array`` of nested lists costs 4x as much per step)."""
    if width is None:
        width = max(len(r.table) for r in rows)
    pad = [0] * width
    flat = np.fromiter(chain.from_iterable((r.table + pad)[:width] for r in rows), dtype=np.int64,
                       count=len(rows) * width)
    return flat.reshape(len(rows), width)


def _context_slots(tables: np.ndarray, C: int, block_size: int) -> np.ndarray:
    """The slots of positions ``0 .. C-1`` of each row of ``tables`` (G, >= ceil(C /
    block_size)) -> (G C,): ``table[p // block_size] * block_size + p % block_size``, row
    after row (a row's table padded with block 0 past its own blocks)."""
    G, W = len(tables), -(-C // block_size)
    slots = tables[:, :W, None] * block_size + np.arange(block_size)                   # (G, W, bs)
    # (a copy: with C == 1 and G >= 2 the slice reshapes to a strided view, which a compiled
    # CPU step's guard would take for a new layout and recompile)
    return np.ascontiguousarray(slots.reshape(G, W * block_size)[:, :C]).reshape(-1)


def _group_layout(rows: list[Row], block_size: int, wins: tuple, device, start: int) -> gen.PackGroup:
    """The :class:`parcompile.runtime.serve.generate.PackGroup` of ``rows`` (the step's rows of one
    group, in row order), whose tokens are packed from index ``start`` on: rows left-padded
    to their longest T, contexts C their longest (module docstring). The index arithmetic
    runs in numpy (a small array op costs about a microsecond there, several in torch: this
    runs every step on the leader's one core) and each result becomes a tensor once."""
    G = len(rows)
    n_list, c_list = [len(r.tokens) for r in rows], [r.context for r in rows]
    T, C = max(n_list), max(c_list)
    if T == 1:
        return _decode_layout(rows, c_list, C, block_size, wins, device, start)
    padded = min(n_list) < T
    c = np.array(c_list, dtype=np.int64)
    tables = _tables(rows)
    # (every position below a row's context + its new tokens lies in its table: padding
    # positions, clamped to >= 0, and context columns past a row's own read real table
    # entries or the 0 padding the table; the masks and the index maps drop them)
    t = np.arange(T)
    first = (T - np.array(n_list, dtype=np.int64))[:, None]   # (G, 1): the first real column
    rel = t[None, :] - first                                   # (G, T): the new token's index (< 0: padding)
    q_pos = np.maximum(c[:, None] + rel, 0)                    # (G, T): its position in its sequence
    write = (np.take_along_axis(tables, q_pos // block_size, 1) * block_size + q_pos % block_size).reshape(-1)
    j = np.arange(C)
    read = _context_slots(tables, C, block_size)                                            # (G C,)
    ctx_ok = np.broadcast_to(j[None, None, :] < c[:, None, None], (G, T, C))                # (G, T, C)
    new_ok = (t[None, None, :] >= first[:, :, None]) & (t[None, None, :] <= t[None, :, None])   # (G, T, T)
    to_packed = to_padded = None
    if padded:
        real_q = rel >= 0                                                                    # (G, T)
        ctx_ok = ctx_ok & real_q[:, :, None]              # (new_ok is False on a padding query already)
        to_packed = np.flatnonzero(real_q)                 # (count,): row-major = packed order
        write = write[to_packed]
        offsets = np.cumsum([0] + n_list[:-1])             # each row's first token in the group's slice
        to_padded = torch.from_numpy((offsets[:, None] + np.maximum(rel, 0)).reshape(-1)).to(device)
        to_packed = torch.from_numpy(to_packed).to(device)
    masks = {}
    for w in wins:
        a, b_ = ctx_ok, new_ok
        if w:
            a = a & ((q_pos[:, :, None] - j[None, None, :]) < w)
            b_ = b_ & ((t[None, :, None] - t[None, None, :]) < w)
        if padded:
            b_ = b_ | (t[None, None, :] == t[None, :, None]) & ~real_q[:, :, None]   # padding sees itself
        masks[w] = torch.from_numpy(np.concatenate([a, b_], axis=2).reshape(G, 1, T, C + T)).to(device)
    return gen.PackGroup(start, sum(n_list), (G, T), to_padded, to_packed, masks,
                         torch.from_numpy(write).to(device), torch.from_numpy(read).to(device))


def _decode_layout(rows: list[Row], c_list: list[int], C: int, block_size: int, wins: tuple, device,
                   start: int) -> gen.PackGroup:
    """:func:`_group_layout` of rows of one new token each (the decode rows: every step holds
    them), in fewer host ops: nothing is padded (T = 1), the token sits at its row's
    position ``context`` (its write slot computed in Python), its query sees the context
    (within a window) and itself. The same rule: tests/test_serve_engine.py holds both
    against the rule per position."""
    G = len(rows)
    write = np.fromiter((r.table[c // block_size] * block_size + c % block_size for r, c in zip(rows, c_list)),
                        dtype=np.int64, count=G)
    read = _context_slots(_tables(rows, -(-C // block_size)), C, block_size)             # (G C,)
    c = np.fromiter(c_list, dtype=np.int64, count=G)[:, None]                                 # (G, 1)
    j = np.arange(C)
    masks = {}
    for w in wins:
        m = np.empty((G, C + 1), dtype=bool)
        np.less(j, c, out=m[:, :C])                                                        # the context
        if w:
            m[:, :C] &= (c - j) < w
        m[:, C] = True                                                                     # itself
        masks[w] = torch.from_numpy(m.reshape(G, 1, 1, C + 1)).to(device)
    return gen.PackGroup(start, G, (G, 1), None, None, masks, torch.from_numpy(write).to(device),
                         torch.from_numpy(read).to(device))


def paged_step(rows: list[Row], block_size: int, windows, device) -> tuple[torch.Tensor, gen.StepInput]:
    """The inputs of one step over ``rows`` (module docstring): token ids (1, N) packed, N
    the step's tokens, and the :class:`parcompile.runtime.serve.generate.StepInput`
    (positions (1, N); its :class:`~parcompile.runtime.serve.generate.Packing`: the rows of one
    new token (decode) packed first, then the rows of more (prefill, chunks, recomputation),
    each group's rows in row order, each row's tokens in order; per group its masks per
    attention window (0: full causal), write and read slots for :meth:`PagedKVCache.bind`,
    and its index maps)."""
    wins = tuple(dict.fromkeys(windows)) if isinstance(windows, (tuple, list)) else (windows,)
    B = len(rows)
    if all(len(r.tokens) == 1 for r in rows):        # decode rows only (most steps under load): row order
        c_list = [r.context for r in rows]
        groups = [_decode_layout(rows, c_list, max(c_list), block_size, wins, device, 0)]
        ids = np.fromiter((r.tokens[0] for r in rows), dtype=np.int64, count=B)
        offsets, positions = list(range(B)), np.array(c_list, dtype=np.int64)
        packing = gen.Packing(groups, torch.arange(B, device=device), [1] * B, offsets)
        return (torch.from_numpy(ids).view(1, B),
                gen.StepInput(0, torch.from_numpy(positions).view(1, B).to(device), {}, packing=packing))
    order = [b for b, r in enumerate(rows) if len(r.tokens) == 1] + [b for b, r in enumerate(rows) if len(r.tokens) > 1]
    n_dec = sum(1 for r in rows if len(r.tokens) == 1)
    ids, positions, offsets, last = [], [], [0] * B, [0] * B
    for b in order:
        r = rows[b]
        offsets[b] = len(ids)
        ids += r.tokens
        positions += range(r.context, r.context + len(r.tokens))
        last[b] = len(ids) - 1
    groups = []
    for sub in (order[:n_dec], order[n_dec:]):
        if sub:
            groups.append(_group_layout([rows[b] for b in sub], block_size, wins, device, offsets[sub[0]]))
    N = len(ids)
    packing = gen.Packing(groups, torch.from_numpy(np.array(last, dtype=np.int64)).to(device),
                          [len(r.tokens) for r in rows], offsets)
    return (torch.from_numpy(np.array(ids, dtype=np.int64)).view(1, N),
            gen.StepInput(0, torch.from_numpy(np.array(positions, dtype=np.int64)).view(1, N).to(device), {},
                          packing=packing))


def greedy_tokens(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each row's likeliest token among the first ``vocab`` of logits (B, V') -> (B,) int64
    (:func:`parcompile.runtime.serve.generate.pick_tokens`' greedy rule: the first on ties), or
    :data:`ERROR_TOKEN` where a row's logits hold NaN or inf. :func:`compile_engine` gives
    the model a ``torch.compile``d copy (one fused kernel where eager runs six ops)."""
    x = logits[:, :vocab].float()
    if torch.compiler.is_compiling():
        finite = torch.isfinite(x).all(dim=-1)       # (a compiler may fold x * 0 to zeros)
    else:
        finite = (x * 0).sum(dim=-1) == 0     # 0 * (NaN or +-inf) is NaN: every logit finite, 4x cheaper than isfinite().all()
    return torch.where(finite, x.argmax(dim=-1), torch.full((), ERROR_TOKEN, device=x.device))


def sample_rows(logits: torch.Tensor, vocab: int, params: list[dict], generators: list[torch.Generator],
                greedy_fn=greedy_tokens, greedy_all: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's next token from logits (B, V') with its own ``temperature``, ``top_k`` and
    ``top_p`` and generator (:func:`parcompile.runtime.serve.generate.pick_tokens`); a row whose
    logits hold NaN or inf gets :data:`ERROR_TOKEN` (that request fails, the rank lives).
    The greedy rows are drawn together by ``greedy_fn`` (:func:`greedy_tokens`, or its
    compiled copy), or taken from ``greedy_all`` (B,) when given: :func:`greedy_tokens` of
    every row, computed with the logits (:func:`compile_engine`'s ``forward_and_greedy``)."""
    greedy = [b for b, p in enumerate(params) if gen.is_greedy(p["temperature"])]
    if len(greedy) == len(params):       # every row greedy (the common case): no scatter by a list
        return (greedy_fn(logits, vocab) if greedy_all is None else greedy_all).to(logits.device)
    out = torch.full((len(params),), ERROR_TOKEN, dtype=torch.long)
    if greedy:       # one argmax for every greedy row (pick_tokens' rule, per row: first on ties)
        out[greedy] = (greedy_fn(logits[greedy], vocab) if greedy_all is None else greedy_all[greedy]).cpu()
    for b, (p, g) in enumerate(zip(params, generators)):
        if gen.is_greedy(p["temperature"]):
            continue
        try:
            out[b] = gen.pick_tokens(logits[b:b + 1], vocab, p["temperature"], p["top_k"], g, top_p=p["top_p"])[0]
        except gen.NonFiniteLogits:
            pass
    return out.to(logits.device)


def wants_logprobs(params: list[dict]) -> int | None:
    """The most logprob alternatives any row of a step asks for (``params[i]["logprobs"]``),
    None when no row wants logprobs."""
    ks = [p["logprobs"] for p in params if p.get("logprobs") is not None]
    return max(ks) if ks else None


def logprob_table(logits: torch.Tensor, vocab: int, rows: list["Row"], params: list[dict], tokens: torch.Tensor,
                  prompt_rows: list[bool], k: int, partial_next: list[int | None] | None = None) -> torch.Tensor:
    """The step's logprobs, packed for one broadcast: (B, P, 2 + 2k) float64, P the step's T
    when ``logits`` hold every position (B, T, V') else 1 (the last position, (B, V')).
    Column 0 the chosen token's id, 1 its logprob, then the ``k`` likeliest ids and their
    logprobs. The chosen token at the last position is the sampled one (``tokens``, (B,));
    at a prompt position (a row of ``prompt_rows``) the prompt's next token, and so at the
    last position of a chunk of a prompt (``partial_next``: that next token, or None for a
    row whose prompt is whole after the step). Logprobs are
    ``log_softmax`` of the fp32 logits over the real vocabulary; rows or positions nobody
    asked for are NaN."""
    full = logits if logits.dim() == 3 else logits[:, None, :]
    B, P, _ = full.shape
    lp = torch.log_softmax(full[..., :vocab].float(), dim=-1)                   # (B, P, vocab)
    chosen = torch.zeros((B, P), dtype=torch.long, device=lp.device)
    chosen[:, -1] = tokens.clamp(min=0)
    for b, nxt in enumerate(partial_next or ()):
        if nxt is not None:
            chosen[b, -1] = nxt
    for b, (r, pr) in enumerate(zip(rows, prompt_rows)):
        if pr and P > 1 and len(r.tokens) > 1:                        # column P - n + j predicts token j + 1
            chosen[b, P - len(r.tokens):P - 1] = torch.tensor(r.tokens[1:], dtype=torch.long)
    out = torch.full((B, P, 2 + 2 * k), float("nan"), dtype=torch.float64, device=lp.device)
    out[..., 0] = chosen.double()
    out[..., 1] = lp.gather(-1, chosen[..., None])[..., 0].double()
    if k:
        top = torch.topk(lp, min(k, vocab), dim=-1)                               # sorted, likeliest first
        out[..., 2:2 + top.indices.shape[-1]] = top.indices.double()
        out[..., 2 + k:2 + k + top.values.shape[-1]] = top.values.double()
    return out


def unpack_logprobs(table: torch.Tensor, rows: list["Row"], params: list[dict], prompt_rows: list[bool],
                    tokens: list[int], partial_next: list[int | None] | None = None) -> list[dict | None]:
    """Each row's logprobs from :func:`logprob_table`'s (B, P, 2 + 2k): None for a row that
    asked for none; else ``{"lp": the sampled token's logprob, "top": [(id, logprob)] of its
    k alternatives}`` and, for a prompt row, ``"prompt"``: one ``(logprob, top)`` per token
    of the row after its first (the prompt's first token has no logprob: nothing precedes
    it; a later chunk's first token got its own from the chunk before). A chunk of a prompt
    (``partial_next``) has only ``"prompt"``, its last entry its last column's."""
    partial_next = partial_next or [None] * len(rows)
    t = table.cpu().tolist()
    K = (table.shape[-1] - 2) // 2
    out: list[dict | None] = []

    def entry(cell, k):
        return cell[1], [(int(cell[2 + i]), cell[2 + K + i]) for i in range(k) if cell[2 + i] == cell[2 + i]]

    for b, (r, p, pr) in enumerate(zip(rows, params, prompt_rows)):
        k = p.get("logprobs")
        if k is None or tokens[b] == ERROR_TOKEN:
            out.append(None)
            continue
        lp, top = entry(t[b][-1], k)
        d = {"lp": lp, "top": top}
        if pr:
            P = len(t[b])
            d["prompt"] = [entry(t[b][P - len(r.tokens) + j], k) for j in range(len(r.tokens) - 1)] if P > 1 else []
        if partial_next[b] is not None:
            d = {"prompt": d.get("prompt", []) + [(lp, top)]}
        out.append(d)
    return out


def run_step(model, ctx: ParallelContext, cache: PagedKVCache, rows: list[Row], params: list[dict],
             generators: list[torch.Generator], vocab: int, hidden: int, dtype: torch.dtype, windows,
             tag: int = 0, prompt_rows: list[bool] | None = None,
             partial_next: list[int | None] | None = None) -> tuple[list[int], list[dict | None] | None]:
    """One engine step on this rank: lay out ``rows`` (:func:`paged_step`), bind the cache,
    pass the step through the pipeline (:func:`parcompile.runtime.serve.generate.pipeline_pass`),
    sample each row on the last stage (:func:`sample_rows`) and broadcast the tokens over
    pp; returns each row's next token (known on every rank of the tp-0 pipeline and on every
    last-stage rank) and, when a row's parameters ask for logprobs, each row's
    (:func:`unpack_logprobs`; else None). ``prompt_rows``: the rows whose prompt logprobs
    are wanted (this step computes their prompt, or a chunk of it): the last stage then
    computes every position's logits. ``partial_next``: per row, the prompt's next token
    when the row is a chunk of a prompt that stays unfinished (its token is drawn greedily,
    leaving its generator untouched, and thrown away by the leader), else None."""
    prompt_rows = prompt_rows or [False] * len(rows)
    partial_next = partial_next or [None] * len(rows)
    greedy = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    sample_params = [greedy if nxt is not None else p for p, nxt in zip(params, partial_next)]
    sample_gens = [None if nxt is not None else g for g, nxt in zip(generators, partial_next)]
    k = wants_logprobs(params)
    ids, step = paged_step(rows, cache.block_size, windows, ctx.device)
    T = max(len(r.tokens) for r in rows)                              # the longest row: prompt logprobs' width
    step.all_positions = k is not None and any(prompt_rows) and T > 1
    cache.bind(step.packing.groups)
    fused = getattr(model, "forward_and_greedy", None)            # compile_engine's, on a tp-1 last stage
    with torch.inference_mode():      # no autograd state at all (cheaper per op than no_grad)
        out = gen.pipeline_pass(model.forward if fused is None else fused, ctx, ids, step, hidden, dtype, tag=tag)
    logits, greedy_all = out if fused is not None else (out, None)
    P = T if step.all_positions else 1
    if ctx.is_last_stage():
        if step.all_positions:                                         # (B, T, V'/tp) left-padded -> (B, T, V')
            B, T, V = logits.shape
            full = gen.gather_vocab(logits.reshape(B * T, V), ctx.tp).reshape(B, T, -1)
            last = full[:, -1]
        else:
            full = last = gen.gather_vocab(logits, ctx.tp)
        tokens = sample_rows(last, vocab, sample_params, sample_gens, getattr(model, "greedy_tokens", greedy_tokens),
                             greedy_all=greedy_all)
        if k is not None:
            table = logprob_table(full, vocab, rows, params, tokens, prompt_rows, k, partial_next)
    else:                                                              # filled by the last stage's broadcast
        tokens = torch.zeros(len(rows), dtype=torch.long, device=ctx.device)
        table = torch.zeros((len(rows), P, 2 + 2 * (k or 0)), dtype=torch.float64, device=ctx.device)
    tokens = gen.broadcast_from_last(tokens, ctx.pp).cpu().tolist()
    if k is None:
        return tokens, None
    table = gen.broadcast_from_last(table, ctx.pp)
    return tokens, unpack_logprobs(table, rows, params, prompt_rows, tokens, partial_next)


#: the step layouts :func:`compile_engine` warms up: per step, each row's (new tokens, context)
#: and whether prompt logprobs (every position's logits) are wanted. Every pairing of a
#: decode group (none, one row, several) with a prompt group (none; one new prompt; one chunk
#: after a cached context; new prompts of unequal lengths, padded; of equal lengths, not
#: padded; chunks after contexts): dynamic shapes specialise a size of 0 or 1, and the step's
#: Python (group count, padding maps) differs between these, so each is its own graph; sizes
#: inside one pairing are free (one graph serves every batch of that layout).
_DECODE_GROUPS: tuple[tuple[tuple[int, int], ...], ...] = ((), ((1, 5),), ((1, 5), (1, 9), (1, 3)))
_PROMPT_GROUPS: tuple[tuple[tuple[int, int], ...], ...] = (
    (), ((7, 0),), ((5, 4),), ((6, 0), (3, 0)), ((6, 0), (6, 0), (6, 0)), ((5, 4), (2, 6)))
WARMUP_LAYOUTS: tuple[tuple[tuple[tuple[int, int], ...], bool], ...] = tuple(
    (d + p, False) for d in _DECODE_GROUPS for p in _PROMPT_GROUPS if d + p) + ((((6, 0), (3, 0)), True),)


#: inductor options of the engine's compiled step (``torch.compile(..., options=...)``, torch
#: 2.13's ``torch._inductor.config`` names). ``size_asserts`` off: the graph's runner no longer
#: checks every input's and every extern kernel's sizes and strides from Python on each call
#: (about 70 ``assert_size_stride`` calls per step of the tiny model; a 32-row decode step
#: 4-5% faster, same kernels: measured in one process against the default, paired). Dynamo's
#: guards still check each input's dtype, rank and the size relations the graph was traced
#: under before it runs (another graph, or a compile, when they differ), and every input is
#: made here (:func:`paged_step`, the cache, the model's parameters), never by a caller.
COMPILE_OPTIONS = {"size_asserts": False}


def _importable(fn) -> bool:
    """Whether ``fn``'s module is the one ``sys.modules`` holds under its name: dynamo, inlining
    ``fn`` into another function's graph (:func:`_forward_and_greedy`), imports it to reach
    its globals (torch 2.13, ``symbolic_convert.import_source``). The serve program runs as
    ``__main__``; a program loaded with ``importlib.util.spec_from_file_location`` and not
    registered is not, and keeps the separate greedy call."""
    fn = getattr(fn, "__func__", fn)
    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    return mod is not None and getattr(mod, "__dict__", None) is getattr(fn, "__globals__", ())


def _forward_and_greedy(forward, vocab: int, x: torch.Tensor, step: gen.StepInput) -> tuple[torch.Tensor, torch.Tensor]:
    """A last stage's ``forward(x, step)`` (logits (B, V') of each row's last token, or
    (B, T, V') of every position with ``step.all_positions``) and :func:`greedy_tokens` of
    each row's last-token logits (B,): what :func:`compile_engine` compiles as one graph on
    a last-stage rank with tp 1 (whose logits cover the whole vocabulary, no gather between).
    :func:`run_step` hands the tokens to :func:`sample_rows` (``greedy_all``)."""
    logits = forward(x, step)
    return logits, greedy_tokens(logits[:, -1] if step.all_positions else logits, vocab)


def compile_engine(model, ctx: ParallelContext, cache: PagedKVCache, vocab: int, hidden: int, dtype: torch.dtype,
                   windows, layouts=WARMUP_LAYOUTS) -> float:
    """``serve.compile = true``: ``torch.compile(dynamic=True)`` (inductor,
    :data:`COMPILE_OPTIONS`) the step, and run one throwaway step (:func:`run_step`, greedy) per layout of
    ``layouts`` (:data:`WARMUP_LAYOUTS`) so that no request waits for a compile; returns the
    seconds it took. Every rank of a replica runs the same steps (collectives match).

    What is compiled: on a last-stage rank with tp 1 (its logits cover the whole vocabulary)
    whose program module is importable (:func:`_importable`), the forward and every row's
    greedy token as one graph, ``model.forward_and_greedy`` (:func:`_forward_and_greedy`;
    :func:`run_step` calls it and hands the tokens to :func:`sample_rows`); elsewhere
    ``model.forward``, and :func:`greedy_tokens` as ``model.greedy_tokens`` (what
    :func:`run_step` samples greedy rows with there). The spec refuses ``compile`` with tp or
    pp above 1 today (frontend/checks.py), so the second form serves only a program loaded
    from a file and not registered in ``sys.modules``.

    The steps write k, v into the cache's blocks ``0, 1, ...`` (wrapping around a small
    cache): those blocks stay free in the leader's :class:`Scheduler` (nothing here touches
    it or its prefix cache), and a request's context is always written before it is read,
    so the scratch values are never seen. :meth:`PagedKVCache.write_step`'s ``index_copy_`` (one
    per cache tensor and step) stays in the graph: inductor writes the step's slots of the
    cache (a graph input, its slot count a dynamic size) in place and never copies the whole
    cache back (checked in its output code, torch 2.13: tests/test_serve_engine.py). A layout not warmed up compiles when
    first met (a recompile, not an error: the recompile limit is raised to 64 graphs; the
    compile (minutes on a CPU) then stalls that step and the ones behind it)."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):      # a graph per layout (and per group count)
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 512)
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False    # sizes equal by chance (T == G, ...) get no guard of equality
    t0 = time.perf_counter()
    if ctx.tp.size == 1 and ctx.is_last_stage() and _importable(model.forward):
        # one compiled call per step, not two (issue 33: a 32-row decode step 1,356 -> 1,260 us,
        # 31 decode rows + 1 prompt 1,744 -> 1,635, in one process, alternated)
        model.forward_and_greedy = torch.compile(partial(_forward_and_greedy, model.forward, vocab), dynamic=True,
                                                 options=COMPILE_OPTIONS)
    else:
        model.forward = torch.compile(model.forward, dynamic=True, options=COMPILE_OPTIONS)
        model.greedy_tokens = torch.compile(greedy_tokens, dynamic=True, options=COMPILE_OPTIONS)
    bs, nxt = cache.block_size, 0
    for shape, prompt_lps in layouts:
        rows = []
        for j, (n, c) in enumerate(shape):
            need = -(-(c + n) // bs)
            rows.append(Row(f"warmup{j}", [(7 * j + t) % vocab for t in range(n)], c,
                            [(nxt + i) % cache.blocks for i in range(need)]))
            nxt = (nxt + need) % cache.blocks
        params = [{"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0,
                   "logprobs": 1 if prompt_lps else None}] * len(rows)
        run_step(model, ctx, cache, rows, params, [None] * len(rows), vocab, hidden, dtype, windows,
                 prompt_rows=[prompt_lps and n > 1 for n, _ in shape])
    return time.perf_counter() - t0


def replica_ranks(plan: dict) -> list[list[int]]:
    """The ranks of each data-parallel replica (its tp x pp ranks), by replica index."""
    dp_groups = plan["groups"].get("dp") or [[r] for r in range(plan["world_size"])]
    size = len(dp_groups[0])
    if size == 1:
        return [sorted(r for g in dp_groups for r in g)]
    return [sorted(g[i] for g in dp_groups) for i in range(size)]


def tcp_nodelay(conn) -> None:
    """Turn Nagle's algorithm off on ``conn``'s socket (a ``multiprocessing.connection``
    ``Connection`` over TCP; any other kind is left alone), as uvloop and asyncio do for
    every TCP transport and NCCL and gloo for their sockets.

    The front and the leader exchange one small message per step each way. With Nagle on,
    a step's ``out`` message waits in the sender's kernel until the previous one is
    acknowledged, and the receiver delays its acknowledgement (Linux: up to 40 ms) when it
    has nothing to send back: a sequential request's tokens then reached the front in one
    burst at the end (strace: 47 ms between its first and second ``out``; TTFT p50 46 ms
    against 3 ms on the server's clock). Both ends call this (:func:`_connect`,
    :class:`parcompile.server.engines.Engines`)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as s:    # a duplicate: closing it leaves conn open
        if s.family in (socket.AF_INET, socket.AF_INET6):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _connect(address: str):
    from multiprocessing.connection import Client

    host, _, port = address.rpartition(":")
    key = bytes.fromhex(os.environ.get(KEY_ENV, ""))
    conn = Client((host, int(port)), authkey=key)
    tcp_nodelay(conn)
    return conn


def serve_requests(model, ctx: ParallelContext, plan: dict, address: str, vocab: int, hidden: int,
                   dtype: torch.dtype, windows, startup=None) -> None:
    """Run the engine of this rank's replica until the front says stop (module docstring).

    ``model`` is the program's ``Stage`` (with ``new_paged_cache`` and ``forward``), ``plan``
    its plan.json (``serve.kv_blocks``, ``block_size``, ``batch``), ``address`` the front's
    ``host:port``, ``windows`` the program's attention window(s), ``startup`` the program's
    :class:`parcompile.runtime.progress.Startup` (told of the cache, the compile and the
    connection to the front).

    Raises:
        ServeError: the front cannot be reached.
    """
    sv = plan["serve"]
    block_size, blocks, max_seqs = sv["block_size"], sv["kv_blocks"], sv["batch_per_replica"]
    cache = model.new_paged_cache(blocks, block_size, ctx.device)
    say = startup.done if startup is not None else (lambda text: None)
    say(f"KV cache allocated: {blocks:,} blocks of {block_size} tokens ({cache.nbytes / 2**20:,.1f} MiB on rank 0)")
    if sv.get("compile"):
        took = compile_engine(model, ctx, cache, vocab, hidden, dtype, windows)
        print(f"[rank {ctx.rank}] engine compiled (torch.compile, {len(WARMUP_LAYOUTS)} warm-up steps) "
              f"in {took:.1f} s", flush=True)
    group, leader = None, 0
    if ctx.distributed:
        for ranks in replica_ranks(plan):    # every rank creates every group, in order
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if ctx.rank in ranks:
                group, leader = g, ranks[0]
    is_leader = ctx.rank == leader
    conn = sched = None
    if is_leader:
        try:
            conn = _connect(address)
        except OSError as e:
            raise gen.ServeError(f"cannot reach the server's front at {address}: {e}") from None
        sched = Scheduler(blocks, block_size, max_seqs, prefix_caching=sv.get("prefix_caching", True),
                          max_prefill_tokens=sv.get("max_prefill_tokens"), stream_interval=sv.get("stream_interval") or 1,
                          waiting_served_ratio=sv.get("waiting_served_ratio", 0.0),
                          max_waiting_steps=sv.get("max_waiting_steps", 0))
        conn.send(("ready", {"replica": ctx.dp.index, "kv_blocks": blocks, "block_size": block_size,
                             "max_seqs": max_seqs, "cache_bytes": cache.nbytes}))
    say("engine ready: connected to the front")
    if startup is not None:
        startup.close()
    generators: dict[str, torch.Generator] = {}
    params: dict[str, dict] = {}
    step_no = 0
    while True:
        msg = None
        if is_leader:
            msg = _leader_plan(conn, sched)
        if group is not None:
            msg = broadcast_plan(msg, leader, group, is_leader, ctx.device)
        if msg["stop"]:
            break
        for rid in msg["free"]:
            generators.pop(rid, None)
            params.pop(rid, None)
        for rid, p in msg["new"].items():
            params[rid] = p
            generators[rid] = torch.Generator().manual_seed(p["seed"])
        rows = [Row(*r) for r in msg["rows"]]
        if not rows:
            if is_leader:
                conn.send(("stats", sched.stats()))
            continue
        want, partial = set(msg.get("prompt_logprobs", ())), msg.get("partial", {})
        tokens, lps = run_step(model, ctx, cache, rows, [params[r.rid] for r in rows],
                               [generators[r.rid] for r in rows], vocab, hidden, dtype, windows, tag=step_no % 1024,
                               prompt_rows=[r.rid in want for r in rows],
                               partial_next=[partial.get(r.rid) for r in rows])
        step_no += 1
        if is_leader:
            _leader_collect(conn, sched, rows, tokens, lps)
    if conn is not None:
        conn.close()


def broadcast_plan(msg: dict | None, src: int, group, is_src: bool, device="cpu") -> dict:
    """The step's plan ``msg`` (given on rank ``src``; plain JSON data: ids, token lists,
    sampling parameters) on every rank of ``group``: as JSON (never pickle: a rank unpickles
    nothing) behind its 8-byte length into a buffer of :data:`parcompile.core.model.STEP_PLAN_BYTES`,
    one broadcast while it fits and a second for the rest (``broadcast_object_list`` takes
    two broadcasts every step, its size's and its bytes': a collective per step saved). The
    buffers live on ``device`` (the group's backend's: NCCL's are on the GPU).

    Every rank, the leader too, returns the plan decoded from the JSON text it sent: a
    tuple comes back a list and an int dict key a string on all ranks alike, so the ranks
    never run different plans. Raises TypeError on ``src`` if ``msg`` holds a value JSON
    cannot write (the server builds the plan from plain ints, floats, strings and lists)."""
    buf = torch.zeros(STEP_PLAN_BYTES, dtype=torch.uint8)
    head = STEP_PLAN_BYTES - 8
    data = b""
    if is_src:
        data = json.dumps(msg, separators=(",", ":")).encode()
        first = len(data).to_bytes(8, "little") + data[:head]
        buf[:len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    buf = buf.to(device)
    dist.broadcast(buf, src=src, group=group)
    if is_src:
        rest = len(data) - head
    else:
        raw = buf.cpu().numpy().tobytes()
        n = int.from_bytes(raw[:8], "little")
        data, rest = raw[8:8 + min(n, head)], n - head
    if rest > 0:
        tail = torch.zeros(rest, dtype=torch.uint8)
        if is_src:
            tail.copy_(torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8))
        tail = tail.to(device)
        dist.broadcast(tail, src=src, group=group)
        if not is_src:
            data += tail.cpu().numpy().tobytes()
    return json.loads(data)


def _leader_plan(conn, sched: Scheduler) -> dict:
    """Read the front's messages (waiting up to :data:`IDLE_HEARTBEAT_S` when idle), then
    free, admit and lay out the next step."""
    deadline = time.monotonic() + IDLE_HEARTBEAT_S
    while True:
        idle = not sched.running and not sched.admissible()
        timeout = max(deadline - time.monotonic(), 0) if idle else 0
        if not conn.poll(timeout):
            break
        m = conn.recv()
        if m[0] == "add":
            sched.add(m[1], m[2], m[3])
        elif m[0] == "abort":
            sched.abort(m[1])
        elif m[0] == "stop":
            return {"stop": True}
    return sched.next_step()


def _leader_collect(conn, sched: Scheduler, rows: list[Row], tokens: list[int], logprobs=None) -> None:
    """Record the step's tokens; send those due (``sched.stream``: :class:`StreamBuffer`, the
    ``serve.stream_interval``), with their logprobs and the cache's state, to the front (with
    an interval of 1, every step, even when it finished no token)."""
    due = sched.stream.push(sched.collect(rows, tokens, logprobs))
    if due or sched.stream.interval == 1:
        conn.send(("out", due, sched.stats()))


__all__ = ["PagedKVCache", "Row", "paged_step", "greedy_tokens", "sample_rows", "ERROR_TOKEN", "run_step", "wants_logprobs",
           "logprob_table", "unpack_logprobs", "replica_ranks", "block_hashes", "BlockPool", "Sequence", "Scheduler",
           "StreamBuffer", "serve_requests", "broadcast_plan", "tcp_nodelay", "IDLE_HEARTBEAT_S", "KEY_ENV"]
