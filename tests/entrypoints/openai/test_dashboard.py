"""The live KV dashboard's routes on a real server: the event stream (read here without a browser;
tests/dashboard/test_dashboard_browser.py drives the page), its API-key check, --no-dashboard, and the
core's watch lapsing once nobody looks."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_harness import MODEL, assert_all_free, serve_engine, serve_small_pool

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.openai import serving_dashboard

pytestmark = pytest.mark.slow

SHARED_PREFIX = "You are a careful assistant who answers in one short sentence. " * 3


class FrameReader:
    """Reads /dashboard/events on a thread into `frames` until `stop()`."""

    def __init__(self, url: str, **params) -> None:
        self.frames: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, params), daemon=True)
        self._thread.start()

    def _read(self, url: str, params: dict) -> None:
        with httpx.stream("GET", f"{url}/dashboard/events", params=params, timeout=30) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.frames.append(json.loads(line[len("data: "):]))
                if self._stop.is_set():
                    return

    def wait_for(self, predicate, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for frame in reversed(self.frames):
                if predicate(frame):
                    return frame
            assert time.monotonic() < deadline, "no such frame came"
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def events(self) -> list[dict]:
        seen = {}
        for frame in self.frames:
            for event in frame["events"]:
                seen[event["seq"]] = event
        return [seen[k] for k in sorted(seen)]


@pytest.fixture(scope="module")
def small_server(embedded_model, embedded_tokenizer):
    with serve_small_pool(embedded_model, embedded_tokenizer, num_kv_blocks=64) as server:
        yield server


def test_the_stream_shows_sharing_forks_copies_and_the_pool_coming_back(small_server):
    reader = FrameReader(small_server.url)
    try:
        idle = reader.wait_for(lambda f: True, timeout=30)  # the first frame: the whole pool, idle
        assert idle["num_blocks"] == 64 and idle["cell_blocks"] == 1 and len(idle["cells"]) == 64
        client = small_server.client()
        client.completions.create(model=MODEL, prompt=SHARED_PREFIX + "Name a colour.", max_tokens=4)
        done = threading.Event()

        def fork():
            client.completions.create(model=MODEL, prompt=SHARED_PREFIX + "Name a fruit.", max_tokens=160, n=3,
                                      temperature=1.0, seed=1, extra_body={"ignore_eos": True})
            done.set()

        threading.Thread(target=fork, daemon=True).start()
        # While the three samples run, the prompt's blocks are shared by all three (and the cached prefix).
        busy = reader.wait_for(lambda f: any(r >= 3 for r in f["cell_refs"]))
        assert busy["engine"]["used_blocks"] == busy["counts"]["used"] + busy["counts"]["shared"]
        assert busy["engine"]["free_blocks"] == busy["counts"]["free"] + busy["counts"]["cached"]
        assert busy["counts"]["shared"] >= 1 and busy["engine"]["num_running"] == 3
        running = [r for r in busy["requests"] if r["status"] == "running"]
        assert len(running) == 3 and len({tuple(r["blocks"][:2]) for r in running}) == 1  # one prefix, shared
        assert done.wait(120)
        end = reader.wait_for(lambda f: f["engine"]["num_running"] == 0 and f["counts"]["used"] == 0
                              and f["counts"]["shared"] == 0)
        assert end["counts"]["cached"] > 0 and end["engine"]["free_blocks"] == 64
        kinds = [e["kind"] for e in reader.events()]
        for kind in ("admit", "prefix_hit", "grow", "fork", "cow", "free"):
            assert kind in kinds, (kind, kinds)
        assert kinds.count("fork") == 2  # n=3: two forks of the first sample
        assert end["series"]["t"] == sorted(end["series"]["t"]) and max(end["series"]["tokens_per_s"]) > 0
    finally:
        reader.stop()
    assert_all_free(small_server.wait_idle())


def test_the_watch_lapses_when_nobody_looks(small_server, monkeypatch):
    monkeypatch.setattr(serving_dashboard, "WATCH_SECONDS", 1.0)
    reader = FrameReader(small_server.url)
    reader.wait_for(lambda f: True, timeout=30)
    pool = small_server.engine.core.kv.pool
    assert pool.watch is not None
    reader.stop()
    small_server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)  # a step after the lapse
    deadline = time.monotonic() + 30
    while pool.watch is not None:
        time.sleep(0.2)
        small_server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert time.monotonic() < deadline, "the core still records with nobody watching"


def test_the_dashboard_needs_the_api_key_when_one_is_set(embedded_model, embedded_tokenizer):
    with serve_small_pool(embedded_model, embedded_tokenizer, num_kv_blocks=32, api_key="sesame") as server:
        for path in ("/dashboard", "/dashboard/events"):
            refused = httpx.get(server.url + path)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(server.url + path, params={"api_key": "wrong"}).status_code == 401
        page = httpx.get(server.url + "/dashboard", headers={"Authorization": "Bearer sesame"})
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert httpx.get(server.url + "/dashboard", params={"api_key": "sesame"}).status_code == 200
        # The key in the query opens the dashboard only, not the API.
        assert httpx.get(server.url + "/v1/models", params={"api_key": "sesame"}).status_code == 401
        reader = FrameReader(server.url, api_key="sesame")
        try:
            assert reader.wait_for(lambda f: True, timeout=30)["num_blocks"] == 32
        finally:
            reader.stop()


def test_the_page_is_one_response_and_no_dashboard_serves_none(embedded_model, embedded_tokenizer):
    engine = LLMEngine(EngineConfig(num_kv_blocks=32, max_model_len=512), model=embedded_model,
                       tokenizer=embedded_tokenizer)
    with serve_engine(engine) as server:
        page = httpx.get(server.url + "/dashboard").text
        # Its style and script are inline (one request, which an API key in the address covers), and
        # it fetches nothing from anywhere else.
        assert "<style>" in page and "EventSource" in page and 'type="application/json">[' not in page  # no frames embedded: live
        assert "static/dashboard" not in page.split("</head>")[1] and "http://" not in page and "https://" not in page
        assert httpx.get(server.url + "/dashboard/static/dashboard.js").status_code == 404
    with serve_engine(engine, dashboard=False) as server:
        for path in ("/dashboard", "/dashboard/events"):
            assert httpx.get(server.url + path).status_code == 404
