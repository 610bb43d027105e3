"""Server-sent events of `parcompile serve`'s streamed answers (module :mod:`.api` builds
their chunks): the compact JSON writers, the choices' events read in batches (one choice
directly, several through one queue) and :class:`EventStream`, the response. Kept lean per
token: issue 33 measures the front's CPU per streamed token."""

from __future__ import annotations

import asyncio
import json
import traceback

from fastapi.responses import StreamingResponse

from parcompile.server.protocol import ApiError

#: compact JSON text of an object (as ``json.dumps(obj, separators=(",", ":"))``, one encoder for all)
dumps = json.JSONEncoder(separators=(",", ":")).encode
#: a string's JSON text (what :data:`dumps` writes for a ``str``)
json_str = json.encoder.encode_basestring_ascii


def sse(obj) -> str:
    """``obj`` as one server-sent event."""
    return f"data: {dumps(obj)}\n\n"


def as_api_error(e: Exception) -> ApiError:
    """A choice's failure as the stream's error event: an :class:`ApiError` (a rank died, its
    logits were not finite) as itself; anything else is a bug: a 500 ``internal_error`` to the
    client, its traceback to the log."""
    if isinstance(e, ApiError):
        return e
    traceback.print_exception(e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}"[:300], code="internal_error", kind="server_error")


class OneStream:
    """One choice's events as :func:`event_batches` gives them, read directly from its
    generator ``g`` (no task, no queue, no generator between it and the response):
    ``await x.__anext__()`` is ``[(0, item)]``, then ``[(0, None)]`` at its end or
    ``[(0, failure)]`` (:func:`as_api_error`), then StopAsyncIteration.
    :meth:`parcompile.server.streaming.StreamedAnswer.events` reads ``next`` (the generator's
    ``__anext__``) itself."""

    __slots__ = ("g", "next", "ended")

    def __init__(self, g):
        self.g, self.next, self.ended = g, g.__anext__, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.ended:
            raise StopAsyncIteration
        try:
            return [(0, await self.next())]
        except StopAsyncIteration:
            self.ended = True
            return [(0, None)]
        except Exception as e:
            self.ended = True
            return [(0, as_api_error(e))]

    async def aclose(self) -> None:
        """End the generator (its engine request is aborted when unfinished)."""
        self.ended = True
        await self.g.aclose()


def event_batches(streams: list):
    """The events of the choices' generators ``streams``
    (:meth:`parcompile.server.generation.Generation.generate`), in batches of those ready together:
    lists of ``(choice, event)``, the event an item of the generator, None at its end, or
    its failure (:func:`as_api_error`). One choice is read directly (:class:`OneStream`);
    several through one queue, a task each. Returns the
    batches (an async iterator) and a coroutine function that ends every generator (the
    engine requests of those unfinished are aborted)."""
    if len(streams) == 1:
        one = OneStream(streams[0])
        return one, one.aclose

    merged: asyncio.Queue = asyncio.Queue()

    async def pump(idx: int, g):
        try:
            async for item in g:
                merged.put_nowait((idx, item))
        except Exception as e:
            merged.put_nowait((idx, as_api_error(e)))
            return
        merged.put_nowait((idx, None))

    pumps = [asyncio.ensure_future(pump(idx, g)) for idx, g in enumerate(streams)]

    async def several():
        while True:
            batch = [await merged.get()]
            while not merged.empty():
                batch.append(merged.get_nowait())
            yield batch

    async def close_all():
        for t in pumps:
            t.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)

    return several(), close_all


class EventStream(StreamingResponse):
    """Starlette's :class:`StreamingResponse` of server-sent events, its client watched by one
    plain asyncio task: when the client goes away (``http.disconnect``) the stream is
    cancelled, as Starlette does for ASGI spec < 2.4 (uvicorn's h11 and httptools servers say 2.3), without
    the anyio task group and cancel scope it opens for that per response; the events'
    generator is then closed (:meth:`parcompile.server.streaming.StreamedAnswer.events` ends its
    choices' engine requests)."""

    def __init__(self, content):
        super().__init__(content, media_type="text/event-stream")

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.current_task()
        gone = False

        async def watch():
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            streaming.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone:
                raise
            if hasattr(streaming, "uncancel"):       # Python 3.11+: the cancellation was ours, and is over
                streaming.uncancel()
            await self.body_iterator.aclose()        # now, not at its collection: its requests are aborted
        finally:
            watcher.cancel()


__all__ = ["EventStream", "OneStream", "event_batches", "as_api_error", "sse", "dumps", "json_str"]
