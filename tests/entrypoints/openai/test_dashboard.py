"""The live KV dashboard's routes on a real server: the event stream (read here without a browser;
tests/dashboard/test_dashboard_browser.py drives the page), its API-key check, --no-dashboard, the
core's watch lapsing once nobody looks, and what viewers may cost: the viewer limit, a viewer that
does not read dropped, one frame serialized per view however many read it, the drain ending streams."""

from __future__ import annotations

import errno
import json
import logging
import signal
import socket
import threading
import time

import httpx
import pytest
from server_harness import MODEL, assert_all_free, read_metrics, serve_engine, serve_server, serve_small_pool

from pagedserve.config import EngineConfig
from pagedserve.dashboard import live
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.openai import serving_dashboard
from pagedserve.entrypoints.openai.api_server import build_app

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


class RawViewer:
    """/dashboard/events over a plain socket: `status`, and (unless `read=False`) the bytes read on a
    thread until the server ends the stream or `close()`. A non-reader asks for a receive buffer as
    small as the kernel allows and never reads."""

    def __init__(self, url: str, read: bool = True) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if not read:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        self.sock.settimeout(30)
        self.sock.connect((host, int(port)))
        self.sock.sendall(f"GET /dashboard/events HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        self.data = b""
        self.ended = threading.Event()  # the server closed or reset the connection
        if read:
            while b"\r\n\r\n" not in self.data:
                chunk = self.sock.recv(1 << 16)
                assert chunk, "the server closed the connection before its status line"
                self.data += chunk
            self.status = int(self.data.split(b" ", 2)[1])
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while chunk := self.sock.recv(1 << 16):
                self.data += chunk
        except OSError:
            pass
        self.ended.set()

    def frames(self) -> int:
        return self.data.count(b"\ndata: {")  # each message follows a chunk's size line

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reading thread
        except OSError:
            pass
        self.sock.close()


def wait_until(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.1)


class Traffic:
    """Short completions, one after another on a thread, so that the core sends views (and the stream
    frames) until `stop()`."""

    def __init__(self, server) -> None:
        self._stop = threading.Event()
        self._client = server.client()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._client.completions.create(model=MODEL, prompt="Tell me a story.", max_tokens=24)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


@pytest.fixture(scope="module")
def small_server(embedded_model, embedded_tokenizer):
    with serve_small_pool(embedded_model, embedded_tokenizer, num_kv_blocks=64) as server:
        yield server


@pytest.fixture(scope="module")
def two_viewer_server(small_server):
    """The small server's engine behind a second app that lets two viewers in."""
    with serve_server(build_app(small_server.async_engine, MODEL, dashboard_max_viewers=2)) as (url, _):
        yield url


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


def test_viewers_past_the_limit_get_a_503_and_one_that_leaves_frees_its_place(two_viewer_server):
    url = two_viewer_server
    viewers = [RawViewer(url), RawViewer(url)]
    try:
        assert [v.status for v in viewers] == [200, 200]
        refused = httpx.get(f"{url}/dashboard/events", timeout=30)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "too_many_viewers" and "2 viewers" in error["message"]
        assert "--dashboard-max-viewers" in error["message"]
        m = read_metrics(url)
        assert m["pagedserve:dashboard_viewers"] == 2 and m["pagedserve:dashboard_viewers_refused_total"] >= 1
        viewers.pop().close()
        wait_until(lambda: read_metrics(url)["pagedserve:dashboard_viewers"] == 1, "the leaving viewer's place freed")
        viewers.append(RawViewer(url))
        assert viewers[-1].status == 200
    finally:
        for v in viewers:
            v.close()
    wait_until(lambda: read_metrics(url)["pagedserve:dashboard_viewers"] == 0, "every place freed")


def test_a_viewer_that_does_not_read_is_dropped_and_one_that_reads_is_not(small_server, two_viewer_server,
                                                                         monkeypatch):
    monkeypatch.setattr(serving_dashboard, "STALL_SECONDS", 1.0)
    url = two_viewer_server
    dropped_before = read_metrics(url)["pagedserve:dashboard_viewers_dropped_total"]
    reader, silent = RawViewer(url), RawViewer(url, read=False)
    traffic = Traffic(small_server)  # frames keep coming: the silent one's buffers fill
    try:
        wait_until(lambda: read_metrics(url)["pagedserve:dashboard_viewers"] == 1, "the non-reader dropped")
        assert read_metrics(url)["pagedserve:dashboard_viewers_dropped_total"] == dropped_before + 1
        # The server reset the connection: reading what it had taken ends in an error (or the end).
        silent.sock.settimeout(30)
        with pytest.raises(ConnectionResetError):
            while silent.sock.recv(1 << 16):
                pass
            raise ConnectionResetError(errno.ECONNRESET, "closed")  # a plain end counts too
        frames = reader.frames()
        wait_until(lambda: reader.frames() > frames, "the reading viewer still gets frames")
        assert not reader.ended.is_set()
    finally:
        traffic.stop()
        reader.close()
        silent.close()
    assert_all_free(small_server.wait_idle())


def test_each_view_is_serialized_once_however_many_viewers_read_it(small_server, monkeypatch):
    builds = []
    shared_frame = live._shared_frame
    monkeypatch.setattr(live, "_shared_frame",
                        lambda snapshot: builds.append(snapshot.version) or shared_frame(snapshot))
    watch = small_server.async_engine.kv_watch
    viewers = [RawViewer(small_server.url) for _ in range(30)]
    traffic = Traffic(small_server)
    try:
        assert {v.status for v in viewers} == {200}
        wait_until(lambda: min(v.frames() for v in viewers) >= 5, "five frames for every viewer")
    finally:
        traffic.stop()
        for v in viewers:
            v.close()
    sent = sum(v.frames() for v in viewers)
    assert len(builds) == len(set(builds)), "a view was built twice"
    assert builds == sorted(builds) and builds[-1] <= watch.version
    assert sent >= 10 * len(builds), (sent, len(builds))  # 30 viewers, in step: one build, 30 messages
    # The messages of one view are the same bytes for every viewer in step.
    last_frames = [v.data.rsplit(b"\ndata: ", 1)[1].split(b"\n\n", 1)[0] for v in viewers]
    assert len(last_frames[0]) > 100 and len(set(last_frames)) <= 3
    assert_all_free(small_server.wait_idle())


def test_viewers_that_connect_and_drop_at_once_cost_nothing_lasting(small_server, two_viewer_server):
    url = two_viewer_server
    host, port = url.removeprefix("http://").split(":")
    errors = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    server_log = logging.getLogger("uvicorn.error")
    server_log.addHandler(handler)
    traffic = Traffic(small_server)
    try:
        for k in range(60):
            with socket.create_connection((host, int(port)), timeout=30) as s:
                s.sendall(f"GET /dashboard/events HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
                if k % 2:
                    s.recv(64)  # half of them leave once the response has begun
        wait_until(lambda: read_metrics(url)["pagedserve:dashboard_viewers"] == 0, "every place freed")
        viewers = [RawViewer(url), RawViewer(url)]  # the limit's two places are free again
        try:
            assert [v.status for v in viewers] == [200, 200]
            wait_until(lambda: min(v.frames() for v in viewers) >= 1, "frames for the new viewers")
        finally:
            for v in viewers:
                v.close()
    finally:
        traffic.stop()
        server_log.removeHandler(handler)
    assert not errors, [e.getMessage() for e in errors]


def test_the_drain_ends_every_stream_and_frees_its_place(small_server):
    with serve_server(build_app(small_server.async_engine, MODEL)) as (url, uvicorn_server):
        viewer = RawViewer(url)
        try:
            assert viewer.status == 200
            wait_until(lambda: viewer.frames() >= 1, "a first frame")
            uvicorn_server.handle_exit(signal.SIGTERM, None)
            assert viewer.ended.wait(60), "the stream did not end with the drain"
            assert viewer.data.endswith(b"0\r\n\r\n")  # the chunked body's proper end, not a cut
        finally:
            viewer.close()
