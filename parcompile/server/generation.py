"""One sequence through the engines, as text (:class:`Generation`): what both endpoints
(:mod:`parcompile.server.serving_completion`, :mod:`parcompile.server.serving_chat`) run
for each of a request's prompts and samples, as vLLM's ``OpenAIServing`` hands its
per-endpoint classes one ``engine_client.generate`` stream per prompt
(vllm-project/vllm ``vllm/entrypoints/openai/serving_completion.py`` at 00463e6)."""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time

from fastapi import Request

from parcompile.server.engines import EngineFailed
from parcompile.server.protocol import DISCONNECT_POLL_S, ApiError, ModelInfo, unavailable
from parcompile.server.text import IncrementalText

#: what :meth:`Generation.watch_client` puts on a request's token queue when its client went away
CLIENT_GONE = object()


def non_finite_logits() -> ApiError:
    """500 for a request whose logits came out NaN or infinite (the server goes on)."""
    return ApiError(500, "the model produced NaN or infinite logits for this request (its weights "
                         "or activations overflow in the serve dtype); no token could be drawn",
                    code="non_finite_logits", kind="server_error")


class Generation:
    """The engine side of the front for one model (``info``, :class:`ModelInfo`): submits a
    sequence to ``engines`` (:class:`parcompile.server.engines.Engines`) under a request id
    unique in this front, turns its tokens into text deltas (:meth:`generate`), aborts it
    when its client goes away (:meth:`watch_client`) or a stop string matches, and records
    requests and tokens into ``metrics`` (:class:`parcompile.server.metrics.Metrics`). One
    per front, shared by the endpoints (its request ids must not repeat)."""

    def __init__(self, info: ModelInfo, engines, metrics):
        self.info, self.engines, self.metrics = info, engines, metrics
        # engine request ids: a random prefix per front and a count (issue 33: no uuid4 per request)
        self.rid_prefix, self.rids = secrets.token_hex(6) + "-", itertools.count()

    async def generate(self, request: Request, prompt: list[int], params: dict, watch: str):
        """Yield (text delta, token ids so far, finish_reason, their logprobs so far, the
        prompt's logprobs) as tokens arrive; the request is cancelled in the engine when the
        client goes away or a stop string matches. The text is
        :class:`parcompile.server.text.IncrementalText`'s: final text only (an unfinished
        character, and the last characters that may begin a stop string, wait), stop strings
        searched in the new text, the end token that stopped the sequence not in it (its id
        and logprob are: :meth:`take`). Logprobs are the engine's entries
        (:func:`parcompile.runtime.serve.paged.unpack_logprobs`), one per token id (an empty list
        when the request asked for none). Tokens that arrived together (the reader fell
        behind the engine's steps) are taken together (:meth:`take`): one yield for all of
        them, as vLLM's output collector merges a lagging request's outputs.

        ``watch``: "all" polls the connection every :data:`DISCONNECT_POLL_S` seconds while
        tokens arrive (a plain response: nothing is written until the end); "first" until
        the first token only (a stream: once it is writing, Starlette cancels it when the
        client goes away). The polling is a task beside the request's (:meth:`watch_client`),
        so that a token costs one queue wake-up, not a timer and a task.

        Raises :class:`ApiError`: 503 once a rank has died, 500 (:func:`non_finite_logits`)
        when this request's logits were NaN or infinite."""
        rid = f"{self.rid_prefix}{next(self.rids)}"      # unique in this front (no uuid4 per request)
        params = dict(params)
        text = IncrementalText(self.info.tokenizer.decode, params.pop("stop"))
        stop = text.stop
        params.pop("want", None)
        t0 = time.perf_counter()
        try:
            q = self.engines.submit(rid, prompt, params)
        except EngineFailed as e:
            raise unavailable(str(e)) from None
        self.metrics.request_started(len(prompt))
        watcher = asyncio.ensure_future(self.watch_client(request, q))
        ids: list[int] = []
        lps: list = []
        prompt_lps = None
        last = None
        finished = False
        try:
            while True:
                items = [await q.get()]
                while not stop and not q.empty():   # with stop strings, token by token (where one ends)
                    items.append(q.get_nowait())
                reason, n_tokens, prompt_lps = self.take(items, ids, lps, prompt_lps)
                if reason is CLIENT_GONE:
                    return                   # the finally aborts it: its blocks are freed
                if reason == "error":        # its logits were NaN or inf: this request fails, the server lives
                    finished = True
                    self.metrics.request_finished("abort", len(ids))
                    raise non_finite_logits()
                now = time.perf_counter()     # the batch's tokens arrived together: one clock read
                self.metrics.tokens(n_tokens, now - (t0 if last is None else last), first=last is None)
                last = now
                if watch == "first" and watcher is not None:
                    watcher.cancel()     # a stream is writing: Starlette watches the client from now on
                    watcher = None
                # the end token that stopped it is in its ids and logprobs, not its text (take)
                new = text.step(ids[:-1] if reason == "stop" else ids, final=reason is not None)
                if stop and new:        # only the new text can complete a stop string (also on the last token)
                    hit = text.find_stop(len(new))
                    if hit >= 0:
                        text.cut(hit)
                        if reason is None:
                            self.engines.abort(rid)
                        reason = "stop"
                delta = text.release(reason is not None)
                if reason is None:
                    if delta:
                        yield delta, ids, None, lps, prompt_lps
                    continue
                finished = True
                self.metrics.request_finished(reason, len(ids))
                yield delta, ids, reason, lps, prompt_lps
                return
        finally:
            if watcher is not None:
                watcher.cancel()
            if not finished:
                self.engines.abort(rid)
                self.metrics.request_finished("abort", len(ids))

    def take(self, items: list, ids: list[int], lps: list, prompt_lps):
        """Take a batch of the engine's queue ``items`` (``(token id, finish_reason[,
        logprob entry])``) into the sequence's token ``ids`` and logprobs ``lps`` (both
        appended to). The end token that stops a sequence (finish_reason "stop" from the
        engine: one of ``params["eos"]``) is kept in both, as vLLM keeps the stop token in a
        request's ``token_ids`` and logprobs and counts it in ``completion_tokens`` (its
        scheduler appends the sampled token, then ``check_stop``, vllm/v1/core/sched/utils.py
        at 018d5dc, finishes the request on it), while :meth:`generate` leaves it out of the
        text, as vLLM's detokenizer skips a stop-terminated sequence's last token unless
        ``include_stop_str_in_output`` (default false; ``BaseIncrementalDetokenizer.update``,
        vllm-project/vllm vllm/v1/engine/detokenizer.py at e372329); lm-eval's
        loglikelihood requests (``max_tokens`` 1, echo) read every entry but the last as the
        continuation's. Returns (finish_reason or None, the tokens taken, the prompt's
        logprobs: ``prompt_lps`` unless an entry brings them); finish_reason "error" (NaN or
        infinite logits) or :data:`CLIENT_GONE` ends the batch where it is met. Raises 503
        (:func:`unavailable`) for a dead rank."""
        reason = None
        n_tokens = 0
        for item in items:
            if type(item) is not tuple:
                if item is CLIENT_GONE:
                    return CLIENT_GONE, n_tokens, prompt_lps
                if isinstance(item, EngineFailed):
                    raise unavailable(str(item))
            tok, reason = item[0], item[1]
            lp = item[2] if len(item) > 2 else None
            if reason == "error":
                return reason, n_tokens, prompt_lps
            n_tokens += 1
            if lp is not None and "prompt" in lp:
                prompt_lps = lp["prompt"]
            ids.append(tok)
            if lp is not None:
                lps.append((lp["lp"], lp["top"]))
            if reason is not None:
                break            # nothing comes after a finish
        return reason, n_tokens, prompt_lps

    @staticmethod
    async def watch_client(request: Request, q) -> None:
        """Every :data:`DISCONNECT_POLL_S` seconds, whether the client of ``request`` went
        away; then :data:`CLIENT_GONE` on its token queue ``q`` (:meth:`generate` aborts it).
        Cancelled when the request ends (or a stream starts writing)."""
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                q.put_nowait(CLIENT_GONE)
                return
