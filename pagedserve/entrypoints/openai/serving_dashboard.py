"""The live KV dashboard: GET /dashboard (the page, its script and style inline) and /dashboard/events
(Server-Sent Events, one frame per message, at most `FRAMES_PER_SECOND`).

One task (`DashboardStreams`) feeds every viewer. While at least one is connected it renews the
core's watch (`EngineClient.watch_kv`); once the last one leaves the watch lapses after
`WATCH_SECONDS` and the core records nothing again. When a new view has arrived, its frame is built
and serialized once, on a worker thread (`KVWatch.encoded`); each viewer is sent those bytes with
the events it has not had yet (viewers in step share one message), so the event loop's work per
viewer and frame is one write.

What viewers may cost is bounded. At most `max_viewers` streams are open (past it, a 503). A viewer
is written to only once its socket has taken the last message (`ConnectionWrites.unsent`), so the
app holds at most one message per viewer and no write ever waits; a viewer that falls behind skips
frames, not events (of the last 200). One whose socket has not taken its last message within
`STALL_SECONDS` (a client that stopped reading, or never did) is dropped: its connection is reset
and its slot freed (a page's EventSource reconnects by itself).

With an API key set, these routes need it too: as the API's `Authorization: Bearer` header, or as
`?api_key=` (a browser's address bar and EventSource cannot send headers).
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pagedserve.dashboard.live import EncodedFrame
from pagedserve.dashboard.report import render_page
from pagedserve.engine.protocol import EngineClient
from pagedserve.entrypoints.openai.http_server import WRITES_EXTENSION, ConnectionWrites
from pagedserve.entrypoints.openai.serving_engine import APIError, Drain, shutting_down

logger = logging.getLogger("uvicorn.error")

FRAMES_PER_SECOND = 4
WATCH_SECONDS = 3.0  # how long one renewal keeps the core watching
RENEW_EVERY = 1.0
KEEP_ALIVE_EVERY = 15.0  # an SSE comment, so that idle proxies keep the stream open
STALL_SECONDS = 5.0  # a viewer whose socket has not taken its last message by then is dropped
KERNEL_QUEUE_BYTES = 16 << 10  # what the kernel may hold unsent for a viewer (beyond it, it shows as unsent)
DEFAULT_MAX_VIEWERS = 100
WRITES_PER_TURN = 50  # writes between two turns of the event loop: other requests wait for no more

KEEP_ALIVE = b": keep-alive\n\n"
STREAM_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                  (b"x-accel-buffering", b"no")]


def add_dashboard_routes(app: FastAPI, engine: EngineClient, streams: DashboardStreams) -> None:
    page = render_page()

    def watch():
        if engine.kv_watch is None:
            raise APIError(404, "The KV dashboard shows one engine's pool; this server runs replicas, each "
                                "with its own (see each replica's own server).", code="not_found")
        return engine.kv_watch

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> HTMLResponse:
        watch()
        return HTMLResponse(page)

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events() -> Response:
        watch()
        return _EventStream(streams)


class _Viewer:
    __slots__ = ("send", "writes", "client", "since", "version", "written_at")

    def __init__(self, send: Send, writes: ConnectionWrites, client: str, now: float) -> None:
        self.send = send
        self.writes = writes
        self.client = client
        self.since = 0  # the seq of the first event it has not been sent
        self.version = -1  # the view its last frame showed
        self.written_at = now  # its last write (the headers, a frame, a keep-alive)


class DashboardStreams:
    """The open /dashboard/events streams and the one task that writes to them (event loop only)."""

    def __init__(self, engine: EngineClient, drain: Drain, max_viewers: int = DEFAULT_MAX_VIEWERS) -> None:
        if max_viewers < 1:
            raise ValueError(f"the dashboard's viewer limit must be at least 1, got {max_viewers}")
        self.engine = engine
        self.drain = drain
        self.max_viewers = max_viewers
        self.open = 0  # streams admitted and not yet ended
        self.refused = 0  # past max_viewers
        self.dropped = 0  # for not taking their messages
        self._viewers: dict[_Viewer, None] = {}  # being written to, in the order they came
        self._task: asyncio.Task | None = None

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One viewer's response, from its headers until it leaves, is dropped or the server drains."""
        writes = scope.get("extensions", {}).get(WRITES_EXTENSION)
        if self.drain.draining:
            refusal = shutting_down()
        elif writes is None:
            refusal = APIError(503, "the live KV view's stream needs pagedserve's own HTTP server (pagedserve "
                                    "serve): it bounds what a viewer that does not read may cost", type="server_error")
        elif self.open >= self.max_viewers:
            self.refused += 1
            refusal = APIError(503, f"the KV dashboard already has {self.max_viewers} viewers, this server's limit "
                                    "(--dashboard-max-viewers); try again later", type="server_error",
                               code="too_many_viewers")
        else:
            refusal = None
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        self.open += 1  # before the first await: the limit holds however many arrive at once
        try:
            writes.limit_kernel_queue(KERNEL_QUEUE_BYTES)
            await send({"type": "http.response.start", "status": 200, "headers": STREAM_HEADERS})
            client = scope.get("client")
            viewer = _Viewer(send, writes, f"{client[0]}:{client[1]}" if client else "?", time.monotonic())
            self._viewers[viewer] = None
            if self._task is None:
                self._task = asyncio.create_task(self._feed(), name="pagedserve-dashboard")
            try:
                # Nothing more comes from the client; this returns when it leaves, is dropped or the
                # response ends (the drain).
                while (await receive())["type"] != "http.disconnect":
                    pass
            finally:
                self._viewers.pop(viewer, None)
        finally:
            self.open -= 1

    async def _feed(self) -> None:
        """While anyone views: renew the watch, take each new view's frame, write to each viewer."""
        watch = self.engine.kv_watch
        frame: EncodedFrame | None = None
        messages: dict[int, bytes] = {}  # the frame's, by the first event a viewer needs: viewers in step share one
        renewed = float("-inf")
        try:
            while self._viewers:
                now = time.monotonic()
                if self.drain.draining:
                    await self._end_all()
                    break
                if now - renewed >= RENEW_EVERY:
                    self.engine.watch_kv(WATCH_SECONDS)
                    renewed = now
                if watch.version and (frame is None or frame.version != watch.version):
                    newer = await asyncio.to_thread(watch.encoded)
                    if newer is not frame:
                        frame, messages = newer, {}
                await self._write_all(frame, messages, time.monotonic())
                await asyncio.sleep(1 / FRAMES_PER_SECOND)
        except Exception:
            logger.exception("The dashboard's stream failed; its viewers are dropped (their pages reconnect)")
            for viewer in list(self._viewers):
                self._drop(viewer)
        finally:
            self._task = None

    async def _write_all(self, frame: EncodedFrame | None, messages: dict[int, bytes], now: float) -> None:
        for k, viewer in enumerate(list(self._viewers)):
            if k and k % WRITES_PER_TURN == 0:
                await asyncio.sleep(0)
            if viewer not in self._viewers:  # it left during a turn
                continue
            if viewer.writes.unsent():  # still taking its last message
                if now - viewer.written_at >= STALL_SECONDS:
                    logger.info("Dropped a dashboard viewer (%s): it took nothing for %g s", viewer.client,
                                STALL_SECONDS)
                    self._drop(viewer)
                continue
            if frame is not None and viewer.version != frame.version:
                message = messages.get(viewer.since)
                if message is None:
                    message = messages[viewer.since] = b"data: %s\n\n" % frame.json(viewer.since)
                if await self._write(viewer, message, now):
                    viewer.version, viewer.since = frame.version, frame.next_seq
            elif now - viewer.written_at >= KEEP_ALIVE_EVERY:
                await self._write(viewer, KEEP_ALIVE, now)

    async def _write(self, viewer: _Viewer, message: bytes, now: float) -> bool:
        # Its socket has taken everything before, so this does not wait: the transport writes at once.
        try:
            await viewer.send({"type": "http.response.body", "body": message, "more_body": True})
        except Exception:
            logger.exception("A dashboard viewer's write failed (%s); it is dropped", viewer.client)
            self._drop(viewer)
            return False
        viewer.written_at = now
        return True

    def _drop(self, viewer: _Viewer) -> None:
        if viewer in self._viewers:
            del self._viewers[viewer]
            self.dropped += 1
            viewer.writes.drop()  # its serve() returns once the server sees the connection gone

    async def _end_all(self) -> None:
        """The drain: end every stream (at once, for those still taking their last message)."""
        for viewer in list(self._viewers):
            del self._viewers[viewer]
            if viewer.writes.unsent():
                viewer.writes.drop()
            else:
                await viewer.send({"type": "http.response.body", "body": b"", "more_body": False})

    def collector(self) -> Collector:
        return _DashboardCollector(self)


class _EventStream(Response):
    """A /dashboard/events response: DashboardStreams serves it."""

    def __init__(self, streams: DashboardStreams) -> None:
        super().__init__()
        self.streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.streams.serve(scope, receive, send)


class _DashboardCollector(Collector):
    def __init__(self, streams: DashboardStreams) -> None:
        self.streams = streams

    def collect(self):
        s = self.streams
        yield GaugeMetricFamily("pagedserve:dashboard_viewers", "Open /dashboard/events streams.", value=s.open)
        yield CounterMetricFamily("pagedserve:dashboard_viewers_refused",
                                  "/dashboard/events streams refused (503): --dashboard-max-viewers were open.",
                                  value=s.refused)
        yield CounterMetricFamily("pagedserve:dashboard_viewers_dropped",
                                  "/dashboard/events streams dropped: their socket took nothing for "
                                  f"{STALL_SECONDS:g} s.",
                                  value=s.dropped)
