"""uvicorn for `parcompile serve`: its HTTP/1.1 protocol with a deadline on request headers,
so that connections that never finish their headers (slowloris) are dropped, and a bound on
their size; on uvloop and httptools (uvicorn's ``[standard]`` extras, as vLLM serves) when
they are installed, else on asyncio and h11 (:func:`uvicorn_config`).

uvicorn 0.3x-0.5x arms its keep-alive timer only after a response and cancels it on any
byte received (``uvicorn/protocols/http/h11_impl.py`` and ``httptools_impl.py``:
``on_response_complete``, ``data_received``): a client that opens a connection and sends a
header byte now and then holds it forever. :class:`HeaderTimeoutProtocol` (h11) and
:class:`HttpToolsHeaderTimeoutProtocol` (httptools) close a connection whose request
headers are not complete :data:`HEADERS_TIMEOUT_S` seconds after it opened (or after the
previous response on a kept-alive connection), as Node's ``server.headersTimeout`` and
Apache's ``mod_reqtimeout`` do. Incomplete headers past :data:`MAX_HEADER_BYTES` get 400:
h11 bounds them itself (``h11_max_incomplete_event_size``); llhttp (httptools) buffers a
header of any size, so :class:`HttpToolsHeaderTimeoutProtocol` counts the bytes received
while the headers are incomplete (Node's ``--max-http-header-size`` does the same over
llhttp).
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

#: seconds a connection has to deliver complete request headers
HEADERS_TIMEOUT_S = 10.0
#: bytes of incomplete request headers buffered before the answer is 400 (h11's and uvicorn's default, 16 KiB)
MAX_HEADER_BYTES = 16 * 1024
#: seconds an idle kept-alive connection stays open (uvicorn's default)
KEEP_ALIVE_S = 5
#: seconds a request's body has to arrive once its headers are complete, plus a second per
#: :data:`BODY_MIN_RATE` bytes received: a client that sends headers and `{` and then nothing
#: was held forever (issue 51), while a legitimate body of the 64 MB a 1M-token context allows
#: on a 10 Mbit/s link takes 54 s. Apache's mod_reqtimeout by default: ``RequestReadTimeout
#: body=20,MinRate=500`` (httpd.apache.org/docs/2.4/mod/mod_reqtimeout.html)
BODY_TIMEOUT_S = 30.0
#: bytes per second a body must keep arriving at to extend its deadline (Apache's MinRate)
BODY_MIN_RATE = 500
#: connections one client address may hold open at once; more are closed as they arrive
#: (nginx's ``limit_conn``), so one client cannot take the file descriptors /health needs
MAX_CONNECTIONS_PER_CLIENT = 1024


class _HeaderDeadline:
    """The request deadlines both protocols share: the headers deadline, armed when a
    connection opens and after each response; once a request's headers are complete, the
    body deadline (:data:`BODY_TIMEOUT_S`), disarmed when its body is complete; at either
    deadline a connection still in that phase (:meth:`_waiting_for_headers`,
    :meth:`_waiting_for_body`, per protocol) is closed. And a cap of
    :data:`MAX_CONNECTIONS_PER_CLIENT` open connections per client address. Needs the
    protocol's ``loop`` and ``transport``."""

    headers_timeout_s: float = HEADERS_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT
    body_min_rate: float = BODY_MIN_RATE
    _headers_deadline = None
    _body_bytes = 0          # body bytes received since the body deadline was last (re)armed
    _client = None
    #: open connections per client address, over every connection of the process
    _open: dict = {}

    def _admit(self, transport) -> bool:
        """Count the connection against its client address; False (and the connection
        aborted: uvicorn's connection_lost follows) past the cap."""
        peer = transport.get_extra_info("peername")
        client = peer[0] if isinstance(peer, (tuple, list)) and peer else None
        if client is not None and self._open.get(client, 0) >= self.max_connections_per_client:
            transport.abort()
            return False
        if client is not None:
            self._open[client] = self._open.get(client, 0) + 1
            self._client = client
        return True

    def _release(self) -> None:
        if self._client is not None:
            left = self._open.get(self._client, 1) - 1
            if left > 0:
                self._open[self._client] = left
            else:
                self._open.pop(self._client, None)
            self._client = None

    def _arm(self, body: bool = False) -> None:
        self._disarm()
        seconds, check = (self.body_timeout_s, self._waiting_for_body) if body else \
            (self.headers_timeout_s, self._waiting_for_headers)
        self._body_bytes = 0
        self._headers_deadline = self.loop.call_later(seconds, self._timed_out, check)

    def _disarm(self) -> None:
        if self._headers_deadline is not None:
            self._headers_deadline.cancel()
            self._headers_deadline = None

    def _timed_out(self, still_waiting) -> None:
        self._headers_deadline = None
        earned, self._body_bytes = self._body_bytes / self.body_min_rate, 0
        if earned > 0 and still_waiting == self._waiting_for_body and still_waiting():
            # a second per BODY_MIN_RATE bytes that arrived since: the deadline moves on
            self._headers_deadline = self.loop.call_later(earned, self._timed_out, still_waiting)
        elif still_waiting() and not self.transport.is_closing():
            self.transport.close()


class HeaderTimeoutProtocol(_HeaderDeadline, H11Protocol):
    """uvicorn's h11 protocol, closing connections whose headers take longer than
    ``headers_timeout_s`` (class attribute; :func:`uvicorn_config` sets it per server)."""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self._admit(transport):
            self._arm()

    def _waiting_for_headers(self) -> bool:
        return self.conn.their_state in (h11.IDLE, h11.DONE) and (self.cycle is None or self.cycle.response_complete)

    def _waiting_for_body(self) -> bool:
        return self.conn.their_state == h11.SEND_BODY

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting_for_body():               # headers complete, the body on its way
            self._body_bytes += len(data)
            if self._phase != "body":
                self._phase = "body"
                self._arm(body=True)
        elif not self._waiting_for_headers() and self._phase != "done":   # the whole request arrived
            self._phase = "done"
            self._disarm()

    _phase = "head"

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._phase = "head"
            self._arm()                            # the next request's headers get the same deadline

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._release()
        super().connection_lost(exc)


def _httptools_protocol():
    """:class:`HttpToolsHeaderTimeoutProtocol`, defined on first use (httptools is optional)."""
    global HttpToolsHeaderTimeoutProtocol
    if HttpToolsHeaderTimeoutProtocol is not None:
        return HttpToolsHeaderTimeoutProtocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _Protocol(_HeaderDeadline, HttpToolsProtocol):
        """uvicorn's httptools protocol, closing connections whose headers take longer than
        ``headers_timeout_s`` (class attribute) and answering 400 to incomplete headers past
        ``max_header_bytes`` (counted from the end of the previous request: at most one read
        more is buffered)."""

        max_header_bytes: int = MAX_HEADER_BYTES
        _in_head = True          # the bytes arriving belong to a request's head (line and headers)
        _head_bytes = 0

        _in_body = False         # headers complete, the body not yet

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if self._admit(transport):
                self._arm()

        def _waiting_for_headers(self) -> bool:
            return self._in_head and (self.cycle is None or self.cycle.response_complete)

        def _waiting_for_body(self) -> bool:
            return self._in_body

        def data_received(self, data: bytes) -> None:
            if self._in_body:
                self._body_bytes += len(data)
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._in_head and self._head_bytes > self.max_header_bytes and not self.transport.is_closing():
                self.send_400_response("Request headers too large.")

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes, self._in_body = False, 0, True
            self._arm(body=True)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_head, self._in_body = True, False   # what follows is the next request's head
            self._disarm()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._waiting_for_headers():
                self._arm()                        # the next request's headers get the same deadline

        def connection_lost(self, exc) -> None:
            self._disarm()
            self._release()
            super().connection_lost(exc)

    _Protocol.__name__ = _Protocol.__qualname__ = "HttpToolsHeaderTimeoutProtocol"
    HttpToolsHeaderTimeoutProtocol = _Protocol
    return _Protocol


#: the httptools protocol class (None until :func:`_httptools_protocol` defines it)
HttpToolsHeaderTimeoutProtocol = None


def fast_http_available() -> tuple[bool, bool]:
    """Whether uvloop and httptools can be imported (``pip install 'uvicorn[standard]'``)."""
    found = []
    for name in ("uvloop", "httptools"):
        try:
            __import__(name)
            found.append(True)
        except ImportError:
            found.append(False)
    return found[0], found[1]


def uvicorn_config(app, host: str, port: int, headers_timeout_s: float = HEADERS_TIMEOUT_S, http: str = "auto",
                   loop: str = "auto", body_timeout_s: float = BODY_TIMEOUT_S,
                   max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT,
                   body_min_rate: float = BODY_MIN_RATE):
    """The uvicorn ``Config`` `serve` runs ``app`` with: :data:`MAX_HEADER_BYTES`,
    :data:`KEEP_ALIVE_S`, warnings only, no lifespan, the headers deadline
    ``headers_timeout_s`` (seconds), the body deadline ``body_timeout_s`` plus a second per
    ``body_min_rate`` bytes received, at most ``max_connections_per_client`` connections per
    client address (none counted for a Unix socket's peers), on the HTTP protocol ``http``: "httptools"
    (:class:`HttpToolsHeaderTimeoutProtocol`), "h11" (:class:`HeaderTimeoutProtocol`) or
    "auto" (httptools when installed); the event loop ``loop``: "uvloop", "asyncio" or "auto"
    (uvloop when installed).

    Raises:
        ValueError: an unknown ``http`` or ``loop``, or one asked for and not installed.
    """
    import uvicorn

    has_uvloop, has_httptools = fast_http_available()
    if http == "auto":
        http = "httptools" if has_httptools else "h11"
    if loop == "auto":
        loop = "uvloop" if has_uvloop else "asyncio"
    if http not in ("httptools", "h11") or loop not in ("uvloop", "asyncio"):
        raise ValueError(f"unknown HTTP protocol {http!r} or loop {loop!r}: httptools, h11 or auto; uvloop, asyncio "
                         f"or auto")
    if (http == "httptools" and not has_httptools) or (loop == "uvloop" and not has_uvloop):
        raise ValueError(f"{http if http == 'httptools' and not has_httptools else loop} is not installed "
                         f"(pip install 'uvicorn[standard]')")
    base = _httptools_protocol() if http == "httptools" else HeaderTimeoutProtocol
    protocol = type(base.__name__, (base,), {"headers_timeout_s": headers_timeout_s, "body_timeout_s": body_timeout_s,
                                             "body_min_rate": body_min_rate,
                                             "max_connections_per_client": max_connections_per_client, "_open": {}})
    return uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", http=protocol, loop=loop,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, timeout_keep_alive=KEEP_ALIVE_S)


__all__ = ["HeaderTimeoutProtocol", "HttpToolsHeaderTimeoutProtocol", "uvicorn_config", "fast_http_available",
           "HEADERS_TIMEOUT_S", "MAX_HEADER_BYTES", "KEEP_ALIVE_S", "BODY_TIMEOUT_S", "BODY_MIN_RATE",
           "MAX_CONNECTIONS_PER_CLIENT"]
