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


def event_batches(streams: list):
    """The events of the choices' generators ``streams``
    (:meth:`parcompile.server.api.Handlers.generate`), in batches of those ready together:
    lists of ``(choice, event)``, the event an item of the generator, None at its end, or
    its failure (:func:`as_api_error`). One choice is read directly (no task, no queue
    between it and the response); several through one queue, a task each. Returns the
    batches (an async iterator) and a coroutine function that ends every generator (the
    engine requests of those unfinished are aborted)."""
    if len(streams) == 1:
        g = streams[0]

        async def one():
            try:
                async for item in g:
                    yield [(0, item)]
            except Exception as e:
                yield [(0, as_api_error(e))]
                return
            yield [(0, None)]

        batches = one()

        async def close():
            await batches.aclose()
            await g.aclose()

        return batches, close

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
    cancelled, as Starlette does for ASGI spec < 2.4 (uvicorn's h11 server says 2.3), without
    the anyio task group and cancel scope it opens for that per response; the events'
    generator is then closed (:meth:`parcompile.server.api.Handlers.events` ends its
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


__all__ = ["EventStream", "event_batches", "as_api_error", "sse", "dumps", "json_str"]
