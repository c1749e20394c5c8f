"""Test helpers for the server: run an app on real uvicorn on a free loopback port in a thread (or
an engine behind the OpenAI app: `serve_engine`), and read /metrics with prometheus-client's parser."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.openai.api_server import build_app
from pagedserve.entrypoints.openai.http_server import GracefulServer, make_server

MODEL = "smollm2-test"


@contextmanager
def serve(app, **options) -> Iterator[str]:
    """Run `app` (from build_app) on uvicorn in a thread, as `pagedserve serve` does (make_server,
    which takes `options`: header_timeout, shutdown_timeout, ...); yield its base URL."""
    with serve_server(app, **options) as (url, _):
        yield url


@contextmanager
def serve_server(app, **options) -> Iterator[tuple[str, GracefulServer]]:
    """serve(), yielding the uvicorn server too (to drive its drain: server.handle_exit)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # the OS picks a free port; holding the socket leaves no race
    server = make_server(app, log_level="warning", **options)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@dataclass
class Server:
    url: str
    engine: LLMEngine | None  # None when the core runs in its own process
    async_engine: AsyncLLM

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                             **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        return read_metrics(self.url)

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """/metrics once nothing runs or waits (aborts take effect within a step)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
                return m
            assert time.monotonic() < deadline, f"still busy after {timeout}s: {m}"
            time.sleep(0.05)


@contextmanager
def serve_engine(engine: LLMEngine, **app_options) -> Iterator[Server]:
    """`engine` behind the OpenAI app (through an AsyncLLM on a thread), served on loopback as MODEL;
    `app_options` go to build_app."""
    async_engine = AsyncLLM.from_llm_engine(engine)
    async_engine.start()
    try:
        with serve(build_app(async_engine, MODEL, **app_options)) as url:
            yield Server(url, engine, async_engine)
    finally:
        async_engine.shutdown()


@contextmanager
def serve_small_pool(model, tokenizer, num_kv_blocks: int, **app_options) -> Iterator[Server]:
    """serve_engine over a new engine on (model, tokenizer) with a pool of `num_kv_blocks` blocks of 16:
    small enough to draw and read block by block (max_model_len: what it holds, at most 1024)."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=num_kv_blocks, max_model_len=min(1024, 16 * num_kv_blocks)),
                       model=model, tokenizer=tokenizer)
    with serve_engine(engine, **app_options) as server:
        yield server


def read_metrics(url: str) -> dict[str, float]:
    """Sample name (plus any label but model_name, after ':') -> value, via prometheus-client's parser."""
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = [v for k, v in sorted(sample.labels.items()) if k != "model_name"]
            values[":".join([sample.name, *labels])] = sample.value
    return values


def assert_all_free(m: dict[str, float]) -> None:
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["pagedserve:kv_cache_free_blocks"] == m["pagedserve:kv_cache_total_blocks"] > 0
    assert m["vllm:kv_cache_usage_perc"] == 0
