"""The leader's side of continuous batching (the engine of :mod:`parcompile.runtime.serve.paged`):
which sequences run in the next engine step, with which tokens and which KV blocks. Plain
Python, no torch: the leader of a replica (its lowest rank) runs it and broadcasts the step
it lays out (:class:`Row` fields) to the replica's ranks, which run it over their paged cache.

Scheduling (iteration level, as vLLM v1's scheduler): the leader of a replica (its lowest
rank) holds the waiting queue, the running sequences and the free blocks. Every engine step
it frees the blocks of finished and cancelled sequences, gives each running sequence (in
admission order) the blocks its tokens of this step need, then admits waiting requests in
arrival order (no overtaking) while at most ``batch`` sequences run and the blocks of their
first tokens are free, and runs ONE forward pass holding the new requests' prompts
(prefill) beside one token of every running sequence (decode). Blocks are taken as tokens
need them (vLLM v1's ``allocate_slots``): a prompt's (or a chunk's) at its prefill, one more
when a decoding sequence crosses a block boundary; a request's whole context
(``prompt + max_tokens``) is not reserved, so the cache holds as many sequences as their
tokens so far fit. Beside running sequences an admission leaves :data:`WATERMARK` of the
blocks free (vLLM's block manager: room to grow before a preemption); alone, a request is
admitted when it fits at all (the front refuses a context beyond ``prompt_len +
max_new_tokens``, and the spec's check makes the cache hold one: a request alone never
waits forever nor is preempted).

Preemption (vLLM's RECOMPUTE): when a running sequence needs a block and none is free (a
free block still holding a cached prefix is evicted first), the most recently admitted
running sequence is preempted (itself, when it is the latest): its blocks are released and
it goes back to the front of the waiting queue, to be prefilled again over its prompt and
the tokens it generated so far (chunked under the budget like a prompt, and finding its own
blocks in the prefix cache while they are not reused), after which it decodes on: its
output continues exactly. The ranks keep its sampling parameters and generator (it is not
announced as new again, only freed when it finishes), and a recomputed row's token is drawn
from that generator only at the end of the recompute, where its next token was due: seeded
sampling draws the same tokens. Prompt logprobs already sent are not computed again. A
step that preempts admits no one (as vLLM). The leader counts preemptions and recomputed
tokens in its stats (``/metrics``: ``parcompile_num_preemptions_total``).

Prefix caching (``serve.prefix_caching``, on by default as in vLLM v1; :class:`BlockPool`):
a full block, once its keys and values are computed, is registered under the hash of its
tokens chained to the previous block's hash (SHA-256; vLLM's ``hash_block_tokens``), so
its key names the whole prefix up to its end. A new request looks up its prompt's full
blocks (never the block holding the last prompt token, whose logits must be computed) and
shares the longest prefix found: those blocks are reference-counted, and its prefill
starts after them (a row with ``context`` > 0). A block whose last holder finishes stays
cached among the free blocks, least recently freed first out (LRU), until a new
allocation takes it. A request that wants its prompt's logprobs (``echo``) is prefilled
whole (the cached prefix holds no logits), as vLLM does.

Chunked prefill (``serve.max_prefill_tokens``, vLLM's ``max_num_batched_tokens`` for the
prompts; none: a prompt is prefilled in one step): a step holds every running sequence's
decode token and at most that many prompt tokens, the prefills in progress first, then new
requests (admitted while budget is left). A sequence whose prompt is not yet whole in the
cache runs a chunk (a row at ``context`` = its computed tokens); that row's token is not
sampled from its generator (greedy, thrown away: seeded sampling draws as without chunks)
and not sent. A long prompt so never stalls the decoding sequences for more than one
budget's worth of prefill.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

#: the token a row gets when its logits are not finite (:class:`~parcompile.runtime.serve.generate.NonFiniteLogits`):
#: the leader finishes that sequence with ``finish_reason`` "error", the others go on
ERROR_TOKEN = -1


@dataclass
class Row:
    """One sequence in a step: its new token ids, the tokens it has in the cache before the
    step (``context``), and its block table."""

    rid: str
    tokens: list[int]
    context: int
    table: list[int]


def block_hashes(tokens: list[int], block_size: int, blocks: int, parent: bytes = b"") -> list[bytes]:
    """The prefix keys of the first ``blocks`` full blocks of ``tokens``: block i's is
    SHA-256 of block i - 1's key (``parent`` for the first) and block i's token ids (int64),
    so equal keys mean equal prefixes (vLLM's ``hash_block_tokens`` chain,
    ``vllm/v1/core/kv_cache_utils.py``)."""
    out = []
    for i in range(blocks):
        parent = hashlib.sha256(parent + array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()).digest()
        out.append(parent)
    return out


class BlockPool:
    """The leader's KV blocks: reference counts, the free blocks in eviction order (least
    recently freed first; a block holding no cached prefix goes first of all) and, with
    ``caching``, the full blocks registered under their prefix key (:func:`block_hashes`).
    A free block that still holds a cached prefix can be found (and shared) until an
    allocation evicts it. Counters (tokens): ``queries`` (prompt tokens looked up),
    ``hits`` (of those, found cached)."""

    def __init__(self, blocks: int, caching: bool = True):
        self.total, self.caching = blocks, caching
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(blocks))
        self.ref = [0] * blocks
        self.key_of: dict[int, bytes] = {}      # block -> its prefix key
        self.cached: dict[bytes, int] = {}      # prefix key -> block
        self.queries = self.hits = 0

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of ``keys``."""
        found = []
        for key in keys:
            b = self.cached.get(key)
            if b is None:
                break
            found.append(b)
        return found

    def available(self, shared: list[int]) -> int:
        """Blocks an allocation beside ``shared`` (cached blocks it will hold) can take."""
        return len(self.free) - sum(1 for b in shared if self.ref[b] == 0)

    def take(self, shared: list[int], new: int) -> list[int]:
        """Hold ``shared`` (one more reference each) and ``new`` fresh blocks, evicting the
        cached prefixes these held; returns the table (shared first)."""
        for b in shared:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
        table = list(shared)
        for _ in range(new):
            b, _ = self.free.popitem(last=False)
            key = self.key_of.pop(b, None)
            if key is not None:
                del self.cached[key]
            self.ref[b] = 1
            table.append(b)
        return table

    def release(self, table: list[int]) -> None:
        """Drop one reference to each block of ``table``; a block no one holds is free (the
        table's tail first out, then its head; one holding no prefix before any)."""
        for b in reversed(table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                if b not in self.key_of:
                    self.free.move_to_end(b, last=False)

    def register(self, block: int, key: bytes) -> None:
        """Cache ``block`` (computed, full) under ``key`` unless the key is cached already."""
        if self.caching and key not in self.cached and block not in self.key_of:
            self.cached[key] = block
            self.key_of[block] = key


@dataclass
class Sequence:
    """A request of the leader's: its prompt, generated tokens and blocks; ``computed``
    tokens have their keys and values in the cache, ``keys`` are the prefix keys of its
    first full blocks (registered in the pool). ``started``: it was admitted once (the
    ranks hold its sampling parameters and generator until it finishes); ``preemptions``:
    how often its blocks were taken back (it then waits to recompute ``prompt + out``)."""

    rid: str
    prompt: list[int]
    params: dict
    table: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)
    computed: int = 0
    keys: list[bytes] = field(default_factory=list)
    prompt_lps: list = field(default_factory=list)    # prompt logprobs of the chunks so far
    started: bool = False
    preemptions: int = 0

    @property
    def limit(self) -> int:
        return self.params["max_tokens"]

    @property
    def length(self) -> int:
        """Tokens it has: its prompt and the tokens generated so far."""
        return len(self.prompt) + len(self.out)

    def tokens(self, a: int, b: int) -> list[int]:
        """Its tokens ``a .. b - 1`` of ``prompt + out`` (0 <= a <= b), without building
        ``prompt + out`` (a decode step asks each running sequence for one token: O(1), not
        O(its length))."""
        P = len(self.prompt)
        if b <= P:
            return self.prompt[a:b]
        if a >= P:
            return self.out[a - P:b - P]
        return self.prompt[a:] + self.out[:b - P]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are asked for and not yet sent (they go out with its first
        token; a request preempted after that recomputes its prompt without them)."""
        return bool(self.params.get("prompt_logprobs")) and not self.out


#: the fraction of the cache's blocks a waiting request must leave free beside running
#: sequences to be admitted (vLLM's block manager ``watermark``, 0.01): room for the
#: running sequences to grow before one is preempted
WATERMARK = 0.01


class Scheduler:
    """The leader's queue, running set and block pool (module docstring); ``prefix_caching``:
    share cached prompt prefixes (:class:`BlockPool`); ``max_prefill_tokens``: the prompt
    tokens one step may compute (chunked prefill; None: whole prompts); ``watermark``: the
    fraction of ``blocks`` an admission leaves free while sequences run (:data:`WATERMARK`);
    ``stream_interval``: the tokens of a request the leader sends together (:class:`StreamBuffer`);
    ``waiting_served_ratio`` and ``max_waiting_steps``: when waiting requests join a running
    batch (:meth:`admit_now`; 0 steps: at once).

    Blocks are taken as tokens need them (vLLM v1's ``allocate_slots``) and a running
    sequence that needs a block when none is free preempts the most recently admitted
    running sequence (vLLM's RECOMPUTE preemption; module docstring)."""

    def __init__(self, blocks: int, block_size: int, max_seqs: int, prefix_caching: bool = True,
                 max_prefill_tokens: int | None = None, watermark: float = WATERMARK, stream_interval: int = 1,
                 waiting_served_ratio: float = 0.0, max_waiting_steps: int = 0):
        self.block_size, self.max_seqs = block_size, max_seqs
        self.waiting_served_ratio, self.max_waiting_steps = waiting_served_ratio, max_waiting_steps
        self.held_steps = 0            # steps with requests waiting since the last admission (admit_now)
        self.max_prefill_tokens = max_prefill_tokens or None    # prompt tokens per step (None: no limit)
        self.pool = BlockPool(blocks, prefix_caching)
        self.total = blocks
        self.watermark_blocks = int(watermark * blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}      # in admission order: the last is preempted first
        self.freed: list[str] = []     # sequences whose generators the last stage may drop
        self.prefill_tokens = 0        # prompt tokens computed (a cached prefix is not)
        self.recomputed_tokens = 0     # tokens computed again after a preemption
        self.preemptions = 0
        self.stream = StreamBuffer(stream_interval)  # which outputs the leader sends the front each step

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def add(self, rid: str, prompt: list[int], params: dict) -> None:
        self.waiting.append(Sequence(rid, list(prompt), params))

    def abort(self, rid: str) -> None:
        """Cancel ``rid``: a waiting request leaves the queue; a running one frees its blocks."""
        for s in self.waiting:
            if s.rid == rid:
                self.waiting.remove(s)
                if s.started:                 # preempted: the ranks still hold its generator
                    self.freed.append(rid)
                break
        if rid in self.running:
            self.finish(rid)
        self.stream.drop(rid)

    def finish(self, rid: str) -> None:
        seq = self.running.pop(rid)
        self.pool.release(seq.table)
        self.freed.append(rid)

    def _chunk(self, seq: Sequence, computed: int, budget: float) -> tuple[int, bool]:
        """``(tokens, prefill)``: the tokens ``seq`` computes in the next step after
        ``computed`` and whether they count against the step's prompt budget (a prompt's, or
        more than one token: a recompute; a decode's one token does not)."""
        n = seq.length - computed
        prefill = computed < len(seq.prompt) or n > 1
        return (int(min(n, budget)) if prefill else n), prefill

    def _preempt(self, seq: Sequence) -> None:
        """Take ``seq``'s blocks back and queue it first to recompute ``prompt + out`` (vLLM's
        RECOMPUTE; its blocks stay cached until they are reused, so it may find them again)."""
        del self.running[seq.rid]
        self.pool.release(seq.table)
        seq.table, seq.computed, seq.keys = [], 0, []
        if not seq.out:
            seq.prompt_lps = []
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Give ``seq`` the blocks its next ``n`` tokens need; False when too few are free."""
        need = self.blocks_for(seq.computed + n) - len(seq.table)
        if need > len(self.pool.free):
            return False
        if need > 0:
            seq.table += self.pool.take([], need)
        return True

    def _fit(self, seq: Sequence, budget: float):
        """``(keys, shared blocks, tokens, prefill)`` for admitting waiting ``seq`` under ``budget``
        (its first chunk), None when that chunk's blocks are not free (beside running
        sequences, :attr:`watermark_blocks` more). Its full blocks before its last token are
        looked up in the prefix cache (its last token's logits must be computed); none while
        its prompt's logprobs are wanted."""
        keys = []
        if self.pool.caching and not seq.wants_prompt_logprobs:
            toks = seq.prompt + seq.out
            keys = block_hashes(toks, self.block_size, (len(toks) - 1) // self.block_size)
        shared = self.pool.lookup(keys)
        n, prefill = self._chunk(seq, len(shared) * self.block_size, budget)
        need = self.blocks_for(len(shared) * self.block_size + n) - len(shared)
        if n <= 0 or need > self.pool.available(shared) - (self.watermark_blocks if self.running else 0):
            return None
        return keys, shared, n, prefill

    def admissible(self) -> bool:
        """Whether the first waiting request could be admitted now."""
        if not self.waiting or len(self.running) >= self.max_seqs:
            return False
        return self._fit(self.waiting[0], self.max_prefill_tokens or float("inf")) is not None

    def admit_now(self, prefilling: bool) -> bool:
        """Whether this step admits waiting requests beside the running ones (text-generation-
        inference's router: ``--waiting-served-ratio``, ``--max-waiting-tokens``, launcher/src/main.rs
        at 009c4e0b; a wait counts engine steps, TGI's decode tokens of the batch): at once when
        nothing runs, when the step computes prompt tokens anyway (``prefilling``: a chunk or
        a recompute; the new prompts join that group), when at least ``waiting_served_ratio``
        x the running sequences wait, or once they have been held ``max_waiting_steps``
        steps (0: never held). Holding them a few steps gathers several prompts into one
        step: on a CPU a compiled step that holds prompt rows beside the decode rows costs
        1.3-1.4x a decode-only step, about the same with 1 or 4 prompts (issue 33, the tiny
        model: 31 decode rows + 1 prompt 1.6 ms against 1.26 ms for 32 decode rows), so a
        prefill per new request costs throughput under load (32 streaming clients against
        `parcompile serve`, two 15-s phases each: these defaults 10,224 and 8,500 tok/s,
        admitting every step 9,136 and 8,141)."""
        return (not self.running or prefilling or self.held_steps >= self.max_waiting_steps
                or len(self.waiting) >= self.waiting_served_ratio * len(self.running))

    def next_step(self) -> dict:
        """Free, schedule and lay out the next step (vLLM v1's ``schedule``): the running
        sequences in admission order, each with its blocks for the step (preempting the most
        recently admitted ones when none is free), then, when none was preempted, waiting
        requests in order while they fit (no overtaking), at most ``max_seqs`` run and prompt
        budget is left. Returns ``free`` (sequences finished or cancelled since the last
        step), ``new`` (the sampling parameters of requests admitted for the first time),
        ``rows`` (``Row`` fields, in admission order: a decoding sequence's last token after
        its context; a prefilling one's next tokens after its computed ones, all of them or
        its share of the step's ``max_prefill_tokens``), ``prompt_logprobs`` (the rows, by
        rid, whose prompt logprobs this step computes) and ``partial`` (rid -> the next
        token, for rows whose tokens stay unfinished after this step)."""
        freed, self.freed = self.freed, []
        budget = self.max_prefill_tokens or float("inf")
        rows, partial, want, new = [], {}, [], []
        preempted = prefilling = False

        def schedule(s: Sequence, n: int) -> None:
            rows.append((s.rid, s.tokens(s.computed, s.computed + n), s.computed, s.table))
            if s.computed + n < s.length:
                partial[s.rid] = s.tokens(s.computed + n, s.computed + n + 1)[0]
            if s.wants_prompt_logprobs:
                want.append(s.rid)

        for s in list(self.running.values()):
            if s.rid not in self.running:      # preempted for an earlier one (and so all after it)
                break
            n, prefill = self._chunk(s, s.computed, budget)
            if n <= 0:
                continue
            while not self._grow(s, n):
                victim = self.running[next(reversed(self.running))]
                self._preempt(victim)
                preempted = True
                if victim is s:
                    break
            if s.rid not in self.running:
                break
            budget -= n if prefill else 0
            prefilling = prefilling or prefill
            schedule(s, n)
        held = bool(self.waiting) and not preempted and not self.admit_now(prefilling)
        admitted = 0
        while not preempted and not held and self.waiting and len(self.running) < self.max_seqs and budget > 0:
            s = self.waiting[0]
            fit = self._fit(s, budget)
            if fit is None:
                break
            keys, shared, n, prefill = fit
            self.waiting.popleft()
            s.table = self.pool.take(shared, 0)
            s.computed, s.keys = len(shared) * self.block_size, keys[:len(shared)]
            self._grow(s, n)
            if self.pool.caching and not s.wants_prompt_logprobs and not s.started:
                self.pool.queries += len(s.prompt)
                self.pool.hits += s.computed
            if not s.started:
                s.started = True
                new.append(s)
            self.running[s.rid] = s
            budget -= n if prefill else 0
            schedule(s, n)
            admitted += 1
        # the wait counts until someone joins: a request that waited out a full batch joins when a seat frees
        self.held_steps = self.held_steps + 1 if self.waiting and not admitted else 0
        return {"stop": False, "free": freed, "new": {s.rid: s.params for s in new}, "rows": rows,
                "prompt_logprobs": want, "partial": partial}

    def _register(self, seq: Sequence) -> None:
        """Cache the sequence's blocks that are now full and computed."""
        if not self.pool.caching:
            return
        bs = self.block_size
        while (len(seq.keys) + 1) * bs <= seq.computed:
            i = len(seq.keys)
            toks = seq.tokens(i * bs, (i + 1) * bs)
            seq.keys += block_hashes(toks, bs, 1, seq.keys[-1] if seq.keys else b"")
            self.pool.register(seq.table[i], seq.keys[-1])

    def collect(self, rows: list[Row], tokens: list[int], logprobs: list | None = None) -> list[tuple]:
        """Append each row's token; finish a sequence at ``max_tokens`` or one of its end
        tokens (``params["eos"]``), or with "error" on :data:`ERROR_TOKEN`; returns ``(rid, token,
        finish_reason or None, logprobs or None)`` per row (``logprobs``: :func:`run_step`'s).
        A row that leaves its sequence's tokens unfinished (a chunk) gives nothing."""
        out = []
        for i, (r, tok) in enumerate(zip(rows, tokens)):
            seq = self.running.get(r.rid)
            if seq is None:
                continue
            lp = logprobs[i] if logprobs else None
            end = r.context + len(r.tokens)
            if r.context < len(seq.prompt) or len(r.tokens) > 1:       # tokens computed beside a decode's one
                if seq.preemptions:
                    self.recomputed_tokens += len(r.tokens)
                else:
                    self.prefill_tokens += len(r.tokens)
            if tok != ERROR_TOKEN and end < seq.length:                # a chunk
                seq.computed = end
                self._register(seq)
                if lp is not None and seq.wants_prompt_logprobs:
                    seq.prompt_lps += lp.get("prompt", [])
                continue
            if lp is not None and "prompt" in lp and seq.prompt_lps:
                lp = {**lp, "prompt": seq.prompt_lps + lp["prompt"]}
            if tok == ERROR_TOKEN:       # non-finite logits: this request fails, not the replica
                reason = "error"
            else:
                seq.out.append(tok)
                seq.computed = end
                self._register(seq)
                reason = ("stop" if tok in seq.params.get("eos", ())
                          else "length" if len(seq.out) >= seq.limit else None)
            if reason:
                self.finish(r.rid)
            out.append((r.rid, tok, reason, lp))
        return out

    def stats(self) -> dict:
        """The cache and queue now, and the counters so far: ``prefix_cache_queries``,
        ``prefix_cache_hits`` (prompt tokens, at a request's first admission),
        ``prefill_tokens`` (prompt tokens computed), ``preemptions`` (running sequences whose
        blocks were taken back) and ``recomputed_tokens`` (tokens computed again after one)."""
        return {"blocks_used": self.total - len(self.pool.free), "blocks_free": len(self.pool.free),
                "waiting": len(self.waiting), "running": len(self.running),
                "prefix_cache_queries": self.pool.queries, "prefix_cache_hits": self.pool.hits,
                "prefill_tokens": self.prefill_tokens, "preemptions": self.preemptions,
                "recomputed_tokens": self.recomputed_tokens}


class StreamBuffer:
    """``serve.stream_interval``: the leader sends a request's tokens to the front in groups
    of ``interval`` (SGLang's and vLLM's ``--stream-interval``, "the interval (or buffer
    size) for streaming in terms of the token length": smaller streams smoother, larger
    costs the host less per token). A request's first token (its time to first token) and
    its last (finished, stopped, failed) go out at once; the others wait until ``interval``
    of them are held. Every token is sent, in order; the front streams a group as one
    event (``parcompile.server.generation.Generation.generate`` takes the tokens that arrived
    together). ``interval`` 1 sends each token the step it is made, as before.

    A stop string found by the front ends its request up to ``interval - 1`` steps later
    than it would with 1 (the front cuts the text where the stop string ends, so what the
    client sees is the same; the engine computed a few tokens nobody reads)."""

    __slots__ = ("interval", "held")

    def __init__(self, interval: int = 1):
        if interval < 1:
            raise ValueError(f"stream interval must be at least 1, got {interval}")
        self.interval = interval
        self.held: dict[str, list[tuple]] = {}     # rid -> its outputs not yet sent (after its first)

    def push(self, outputs: list[tuple]) -> list[tuple]:
        """The outputs to send now, given one step's ``outputs`` (:meth:`Scheduler.collect`'s
        ``(rid, token, finish_reason or None, logprobs or None)``): each request's held
        ones before its new one, in order."""
        if self.interval == 1:
            return outputs
        due = []
        for item in outputs:
            rid, reason = item[0], item[2]
            held = self.held.get(rid)
            if held is None:
                due.append(item)                      # the first token: at once
                if reason is None:
                    self.held[rid] = []
            elif reason is not None:                  # the last: with the held ones, at once
                due += held
                due.append(item)
                del self.held[rid]
            else:
                held.append(item)
                if len(held) >= self.interval:
                    due += held
                    self.held[rid] = []
        return due

    def drop(self, rid: str) -> None:
        """Forget ``rid``'s held outputs (the front cancelled it: nobody reads them)."""
        self.held.pop(rid, None)


__all__ = ["ERROR_TOKEN", "Row", "block_hashes", "BlockPool", "Sequence", "WATERMARK", "Scheduler", "StreamBuffer"]
