"""uvicorn for `parcompile serve`: its HTTP/1.1 protocol (h11) with a deadline on request
headers, so that connections that never finish their headers (slowloris) are dropped.

uvicorn 0.3x-0.5x arms its keep-alive timer only after a response and cancels it on any
byte received (``uvicorn/protocols/http/h11_impl.py``: ``on_response_complete``,
``data_received``): a client that opens a connection and sends a header byte now and then
holds it forever. :class:`HeaderTimeoutProtocol` closes a connection whose request headers
are not complete :data:`HEADERS_TIMEOUT_S` seconds after it opened (or after the previous
response on a kept-alive connection), as Node's ``server.headersTimeout`` and Apache's
``mod_reqtimeout`` do. h11 itself bounds the size of incomplete headers
(``h11_max_incomplete_event_size``, :data:`MAX_HEADER_BYTES`): larger ones get 400.
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

#: seconds a connection has to deliver complete request headers
HEADERS_TIMEOUT_S = 10.0
#: bytes of headers h11 buffers before it answers 400 (h11's and uvicorn's default, 16 KiB)
MAX_HEADER_BYTES = 16 * 1024
#: seconds an idle kept-alive connection stays open (uvicorn's default)
KEEP_ALIVE_S = 5


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose headers take longer than
    ``headers_timeout_s`` (class attribute; :func:`uvicorn_config` sets it per server)."""

    headers_timeout_s: float = HEADERS_TIMEOUT_S

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._headers_deadline = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._headers_deadline = self.loop.call_later(self.headers_timeout_s, self._headers_timed_out)

    def _disarm(self) -> None:
        if getattr(self, "_headers_deadline", None) is not None:
            self._headers_deadline.cancel()
            self._headers_deadline = None

    def _waiting_for_headers(self) -> bool:
        return self.conn.their_state in (h11.IDLE, h11.DONE) and (self.cycle is None or self.cycle.response_complete)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._waiting_for_headers():        # a request's headers arrived
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()                            # the next request's headers get the same deadline

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_timed_out(self) -> None:
        self._headers_deadline = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app, host: str, port: int, headers_timeout_s: float = HEADERS_TIMEOUT_S):
    """The uvicorn ``Config`` `serve` runs ``app`` with: :class:`HeaderTimeoutProtocol`,
    :data:`MAX_HEADER_BYTES`, :data:`KEEP_ALIVE_S`, warnings only, no lifespan."""
    import uvicorn

    protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"headers_timeout_s": headers_timeout_s})
    return uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", http=protocol,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, timeout_keep_alive=KEEP_ALIVE_S)


__all__ = ["HeaderTimeoutProtocol", "uvicorn_config", "HEADERS_TIMEOUT_S", "MAX_HEADER_BYTES", "KEEP_ALIVE_S"]
