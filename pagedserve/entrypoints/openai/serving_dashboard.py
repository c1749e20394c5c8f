"""The live KV dashboard: GET /dashboard (the page, its script and style inline) and /dashboard/events
(Server-Sent Events, one frame per message, at most `FRAMES_PER_SECOND`).

While at least one viewer is connected the server renews the core's watch (`EngineClient.watch_kv`);
once the last one leaves the watch lapses after `WATCH_SECONDS` and the core records nothing again.
Viewers share one copy of the pool (`dashboard/live.py`); each stream sends a frame only when a new
view has arrived, with the events it has not sent yet. With an API key set, these routes need it too:
as the API's `Authorization: Bearer` header, or as `?api_key=` (a browser's address bar and
EventSource cannot send headers).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from pagedserve.dashboard.report import render_page
from pagedserve.engine.protocol import EngineClient
from pagedserve.entrypoints.openai.serving_engine import APIError, Drain

FRAMES_PER_SECOND = 4
WATCH_SECONDS = 3.0  # how long one renewal keeps the core watching
RENEW_EVERY = 1.0
KEEP_ALIVE_EVERY = 15.0  # an SSE comment, so that idle proxies keep the stream open


def add_dashboard_routes(app: FastAPI, engine: EngineClient, drain: Drain) -> None:
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
    async def dashboard_events(request: Request) -> StreamingResponse:
        frames = _frames(engine, watch(), drain, request)
        return StreamingResponse(frames, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _frames(engine: EngineClient, watch, drain: Drain, request: Request) -> AsyncIterator[str]:
    since, version, renewed, sent = 0, -1, 0.0, time.monotonic()
    while not drain.draining and not await request.is_disconnected():
        now = time.monotonic()
        if now - renewed >= RENEW_EVERY:
            engine.watch_kv(WATCH_SECONDS)
            renewed = now
        if watch.version != version:
            version = watch.version
            frame, since = watch.frame(since)
            if frame is not None:
                yield f"data: {json.dumps(frame, separators=(',', ':'))}\n\n"
                sent = now
        elif now - sent >= KEEP_ALIVE_EVERY:
            yield ": keep-alive\n\n"
            sent = now
        await asyncio.sleep(1 / FRAMES_PER_SECOND)
