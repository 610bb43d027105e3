"""A streamed answer of `parcompile serve` (:class:`StreamedAnswer`): OpenAI's chunk
objects as server-sent events, as vLLM's per-endpoint stream generators write them
(vllm-project/vllm ``vllm/entrypoints/openai/serving_completion.py``
``completion_stream_generator`` at 00463e6), the chunks' shapes given by the endpoint
(:class:`parcompile.server.serving.Serving`)."""

from __future__ import annotations

from parcompile.server.protocol import ApiError, usage
from parcompile.server.sse import EventStream, OneStream, as_api_error, dumps, event_batches, json_str, sse


class StreamedAnswer:
    """One request's answer (``r``, :class:`parcompile.server.serving.Reply`) to an
    endpoint (``serving``, :class:`parcompile.server.serving.Serving`) as server-sent
    events: the chunks of its choices as their tokens arrive (``batches``,
    :func:`parcompile.server.sse.event_batches`; ``close`` closes the choices'
    generators), then the usage (when ``include_usage``) and ``data:
    [DONE]``. Owns each choice's progress: the token ids sent (``n_ids``), the text offset
    of its logprobs (``offsets``), whether it has begun (``started``: echo and the prompt's
    logprobs go in its first chunk) and ended (``done``)."""

    def __init__(self, serving, r, batches, close, include_usage: bool):
        self.serving, self.r, self.batches, self.close, self.include_usage = serving, r, batches, close, include_usage
        n = len(r.jobs)
        self.n_ids = [0] * n
        self.offsets = [0] * n
        self.started = [False] * n
        self.done = [False] * n   # finished or ended
        self.open = n

    @classmethod
    async def start(cls, serving, r, streams: list) -> EventStream:
        """The response streaming the choices' events (:func:`parcompile.server.sse.event_batches`
        of their generators ``streams``); the first must arrive (or fail) before the 200
        status goes out."""
        batches, close = event_batches(streams)
        try:
            first = await batches.__anext__()
        except BaseException:
            await close()
            raise
        if isinstance(first[0][1], ApiError):
            await close()
            raise first[0][1]
        include_usage = bool(r.req.stream_options and r.req.stream_options.include_usage)
        return EventStream(cls(serving, r, batches, close, include_usage).events(first))

    def event(self, idx: int, body: str, new_ids: list[int], reason, lp_obj) -> str:
        """A streamed chunk of choice ``idx`` as its server-sent event: OpenAI's chunk object,
        the request's constant head (:attr:`Reply.heads`), the choice's ``body``
        (:meth:`Serving.chunk_body`) and its other fields, in the order of the object
        ``{**base, "object", "choices": [{"index", "delta" | "text", "logprobs",
        "finish_reason"[, "token_ids"]}]}`` written by :data:`parcompile.server.sse.dumps`."""
        return (self.r.heads[idx] + body
                + (',"logprobs":null' if lp_obj is None else ',"logprobs":' + dumps(lp_obj))
                + (',"finish_reason":null' if reason is None else ',"finish_reason":' + json_str(reason))
                + (',"token_ids":[' + ",".join(map(str, new_ids)) + "]}]}\n\n" if self.r.req.return_token_ids else
                   "}]}\n\n"))

    async def events(self, first):
        """The event stream from the ``first`` batch of events on: one write per batch (the
        end's chunks, usage and ``[DONE]`` together); a rank's error ends it as the last
        event. Closes the choices' generators at the end. One choice
        (:class:`parcompile.server.sse.OneStream`) is read here directly: no generator between
        its tokens and the response."""
        batches, close = self.batches, self.close
        one = batches.next if isinstance(batches, OneStream) else None
        if first[0][1] is None and self.open == 1:
            await close()
            return
        out = [self.event(idx, self.serving.chunk_body("", role=True), [], None, None)
               for idx in range(len(self.r.jobs))] if self.serving.role_chunk else []
        batch = first
        try:
            while True:
                error = self.take(batch, out)
                if error is not None:             # a rank died mid-stream: the error as the last event
                    out.append(sse({"error": {"message": error.message, "type": error.kind, "param": None,
                                               "code": error.code}}))
                    yield "".join(out)
                    return
                if self.open == 0:
                    break
                if out:
                    yield out[0] if len(out) == 1 else "".join(out)
                    out = []
                if one is None:
                    batch = await batches.__anext__()
                    continue
                try:                                  # OneStream.__anext__, inline
                    batch = ((0, await one()),)
                except StopAsyncIteration:
                    batch = ((0, None),)
                except Exception as e:
                    batch = ((0, as_api_error(e)),)
        finally:
            await close()
        if self.include_usage:
            r = self.r
            out.append(sse({**r.base, "object": self.serving.chunk_obj, "choices": [],
                            "usage": usage(sum(map(len, r.prompts)), sum(self.n_ids))}))
        out.append("data: [DONE]\n\n")
        yield "".join(out)

    def take(self, batch, out: list) -> ApiError | None:
        """Append to ``out`` the chunks of a ``batch`` of ``(choice, event)``: an event is the
        choice's (text delta, ids so far, finish_reason, logprobs so far, prompt logprobs),
        None where it ended without a finish (its client went away), or a rank's
        :class:`ApiError`, returned (the rest of the batch is not read)."""
        serving, r = self.serving, self.r
        n_ids, started, done = self.n_ids, self.started, self.done
        for idx, ev in batch:
            if isinstance(ev, ApiError):
                return ev
            if ev is None:
                if not done[idx]:
                    done[idx] = True
                    self.open -= 1
                continue
            delta, ids, reason, lps, plps = ev
            new_ids = ids[n_ids[idx]:]
            lp_obj = None
            if r.want_lp:
                lp_obj = serving.logprobs(r, r.jobs[idx][1], new_ids, lps[n_ids[idx]:], plps,
                                          r.echo and not started[idx], self.offsets[idx])
                self.offsets[idx] += serving.logprobs_chars(lp_obj)
            if r.echo and not started[idx]:
                delta = serving.info.tokenizer.decode(r.jobs[idx][1]) + delta
            out.append(self.event(idx, serving.chunk_body(delta), new_ids, reason, lp_obj))
            n_ids[idx] = len(ids)
            started[idx] = True
            if reason is not None:            # its last event: nothing comes after a finish
                done[idx] = True
                self.open -= 1
        return None
