"""The HTTP side of the server, under the app: what a connection may cost and how the server stops.

- `HeaderTimeoutH11Protocol`: uvicorn's h11 protocol, plus a deadline for a request's headers (uvicorn
  has only a keep-alive timeout, which any byte resets; a client that sends its headers slowly, or
  nothing at all, kept its socket forever), and each request's `ConnectionWrites` in its scope's
  extensions (what a stream to a client that may not read needs of the socket: ASGI has no way to
  say "the client took nothing for a while", nor to drop such a client at once).
- `RequestGuard` (ASGI): a body limit in bytes (413, at once for a Content-Length over it, else as
  the bytes arrive), a deadline for the body (408), and the drain: while the server drains, new
  requests get a 503 and every response says `Connection: close`.
- `GracefulServer`: uvicorn's Server whose first SIGTERM or SIGINT drains before uvicorn's own
  shutdown. The listening socket stays open, so new requests get the 503 rather than a refused
  connection, and /health answers 503 so load balancers stop routing; the requests already running
  have until `shutdown_timeout`; those still running then end with an error (a 503, or an error
  event and [DONE] in a stream), and uvicorn shuts down as usual. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from typing import Any

import h11
import uvicorn
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.entrypoints.openai.serving_engine import APIError, Drain, shutting_down

logger = logging.getLogger("uvicorn.error")  # the server log, formatted by uvicorn

WRITES_EXTENSION = "pagedserve.connection_writes"  # the scope["extensions"] key of a request's ConnectionWrites
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0  # an idle connection between requests (uvicorn's setting)
DEFAULT_HEADER_TIMEOUT = 5.0  # from a request's first byte (or the connection's start) to its last header
DEFAULT_BODY_TIMEOUT = 30.0  # from the headers to the body's last byte
DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # the drain's grace period for running requests
ABORT_WAIT = 5.0  # after the drain's abort, how long aborted requests get to send their errors
UVICORN_SHUTDOWN_WAIT = 5  # what uvicorn then waits for connections before cancelling their tasks


def error_body(error: APIError) -> bytes:
    return error.body.model_dump_json().encode()


# ---- the connection ----------------------------------------------------------------------------


class ConnectionWrites:
    """What a response may know and do of its connection's writes, for a stream that must not wait
    for any one client (the dashboard's): the bytes the socket has not taken yet, and dropping a
    client that does not read. In each request's scope["extensions"][WRITES_EXTENSION] under this
    module's server."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def unsent(self) -> int:
        """Bytes written to the connection that the socket has not taken yet (in the app's memory)."""
        return self._transport.get_write_buffer_size()

    def limit_kernel_queue(self, nbytes: int) -> None:
        """Let the kernel hold only about `nbytes` not yet sent (TCP_NOTSENT_LOWAT), so that a client
        that stops reading shows in `unsent()` after that much, not after the megabytes a socket's
        buffer can grow to. Nothing where the OS lacks the option, or once the connection is gone."""
        option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
        if option is not None:
            self._set_option(socket.IPPROTO_TCP, option, nbytes)

    def drop(self) -> None:
        """Close the connection now and discard what is unsent, the kernel's queue too (a reset: a
        graceful close would wait for a client that does not read)."""
        self._set_option(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._transport.abort()

    def _set_option(self, level: int, option: int, value: int | bytes) -> None:
        if self._transport.is_closing():
            return
        sock = self._transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # ValueError: uvloop's stand-in for a socket whose connection has just closed
            with contextlib.suppress(OSError, ValueError):
                sock.setsockopt(level, option, value)


class HeaderTimeoutH11Protocol(H11Protocol):
    """A request's headers must all arrive within `header_timeout` seconds of its first byte (of the
    connection's start, for its first request); else the client gets a 408 (when it sent part of a
    request) and the connection is closed. Each request's scope carries the connection's
    `ConnectionWrites`. Subclassed per server with the value set (`with_header_timeout`)."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    _header_timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_header_timeout(cls, seconds: float) -> type[HeaderTimeoutH11Protocol]:
        return type(cls.__name__, (cls,), {"header_timeout": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _set_nodelay(transport)
        self._writes = ConnectionWrites(transport)
        self._start_header_timer()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are in; its app starts at the loop's next turn
            self.cycle.scope.setdefault("extensions", {})[WRITES_EXTENSION] = self._writes

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._start_header_timer()  # a request begins (a no-op while its headers are arriving)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._stop_header_timer()  # its headers are in (or the connection failed)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _start_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout_expired)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout_expired(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a request arrived: tell the client why it is cut off
            body = error_body(APIError(408, f"the request headers did not arrive within {self.header_timeout:g} s",
                                       code="request_timeout"))
            try:
                for event in (h11.Response(status_code=408, reason=b"Request Timeout", headers=[
                        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close")]), h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:
                pass  # h11 will not send it in this state: just close
        self.transport.close()


def _set_nodelay(transport: asyncio.Transport) -> None:
    """TCP_NODELAY on the connection. asyncio sets it only for sockets whose proto is IPPROTO_TCP,
    and a listening socket handed over as socket.socket() has proto 0: then each response's body,
    written after its headers, waited for the client's delayed ACK (about 40 ms on Linux)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


# ---- bodies and the drain ------------------------------------------------------------------------


class _BodyTooLarge(Exception):
    pass


class _BodyTooSlow(Exception):
    pass


class _ClientGone(Exception):
    pass


class RequestGuard:
    """Reads each request's body before the app sees it, within `max_body_bytes` (413) and within
    `body_timeout` seconds of the headers (408); the app then reads it from memory. /v1 requests
    that arrive while the server drains get a 503 (after their body: a reply sent while a client
    still writes can be lost to the connection's reset); those admitted before count as in flight."""

    def __init__(self, app: ASGIApp, drain: Drain, max_body_bytes: int, body_timeout: float) -> None:
        self.app = app
        self.drain = drain
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = self._closing_while_draining(send)
        work = scope["path"].startswith("/v1/")
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await self._reply(scope, send, self._too_large())
            return
        admitted = work and not self.drain.draining
        if admitted:
            self.drain.in_flight += 1
        try:
            try:
                chunks = await self._read_body(receive)
            except _BodyTooLarge:
                await self._reply(scope, send, self._too_large())
                return
            except _BodyTooSlow:
                await self._reply(scope, send, APIError(
                    408, f"the request body did not arrive within {self.body_timeout:g} s", code="request_timeout"))
                return
            except _ClientGone:
                return
            if work and not admitted:
                await self._reply(scope, send, shutting_down())
                return
            await self.app(scope, _replay(chunks, receive), send)
        finally:
            if admitted:
                self.drain.in_flight -= 1

    async def _read_body(self, receive: Receive) -> list[bytes]:
        deadline = time.monotonic() + self.body_timeout
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise _BodyTooSlow() from None
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _BodyTooLarge()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks  # not joined: the app joins them, one copy of a large body is enough

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {self.max_body_bytes} bytes",
                        code="request_too_large")

    @staticmethod
    async def _reply(scope: Scope, send: Send, error: APIError) -> None:
        """Answer with `error` and close the connection (the rest of the request is not read)."""
        response = error.response()
        response.headers["connection"] = "close"
        await response(scope, _no_receive, send)

    def _closing_while_draining(self, send: Send) -> Send:
        drain = self.drain

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and drain.draining:
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"connection" for name, _ in headers):
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        return closing_send


async def _no_receive() -> Message:
    raise RuntimeError("an error reply reads nothing of the request")


def _replay(chunks: list[bytes], receive: Receive) -> Receive:
    """A receive that gives the app the body read already, then the client's later messages."""
    pending = list(reversed(chunks))

    async def replay() -> Message:
        if not pending:
            return await receive()
        chunk = pending.pop()
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    return replay


# ---- the server --------------------------------------------------------------------------------


class GracefulServer(uvicorn.Server):
    """uvicorn's Server, with a drain before its shutdown (see the module's docstring). Signal
    handlers only set flags; `on_tick`, which uvicorn's main loop runs every 0.1 s on the event
    loop, moves the drain along. Unlike uvicorn's, it does not re-raise the signal once the server
    has stopped, so a drained server's process exits 0."""

    def __init__(self, config: uvicorn.Config, drain: Drain, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.shutdown_timeout = shutdown_timeout
        self.drain_requested = False
        self._drain_deadline: float | None = None
        self._abort_deadline: float | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drain_requested or self.should_exit:
            self.should_exit = self.force_exit = True  # the second signal: stop now
        else:
            self.drain_requested = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_requested and not self.should_exit:
            self._drain_step(time.monotonic())
        return await super().on_tick(counter)

    def _drain_step(self, now: float) -> None:
        drain = self.drain
        if self._drain_deadline is None:
            self._drain_deadline = now + self.shutdown_timeout
            drain.start()
            logger.info("Draining: new requests get 503; %d running request(s) have %g s to finish",
                        drain.in_flight, self.shutdown_timeout)
        if drain.in_flight == 0:
            logger.info("Drained: no request is running")
            self.should_exit = True
        elif self._abort_deadline is None and now >= self._drain_deadline:
            logger.warning("Aborting %d request(s) still running after %g s", drain.in_flight, self.shutdown_timeout)
            drain.abort()
            self._abort_deadline = now + ABORT_WAIT
        elif self._abort_deadline is not None and now >= self._abort_deadline:
            logger.warning("%d aborted request(s) did not finish; shutting down anyway", drain.in_flight)
            self.should_exit = True


def make_server(app: Any, *, host: str = "127.0.0.1", port: int = 8000,
                timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE, header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, log_level: str = "info") -> GracefulServer:
    """A GracefulServer for an app made by build_app (it holds the drain in app.state.drain)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level,
        http=HeaderTimeoutH11Protocol.with_header_timeout(header_timeout),
        timeout_keep_alive=timeout_keep_alive,  # type: ignore[arg-type]  (uvicorn uses it as a float)
        timeout_graceful_shutdown=UVICORN_SHUTDOWN_WAIT)
    return GracefulServer(config, app.state.drain, shutdown_timeout)
