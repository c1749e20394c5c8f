"""The server as `pagedserve serve` runs it by default: the engine core in its own process.

Same answers as the offline API, over the real `openai` client; and when the core process dies,
the server says so at once (/health 503, requests 500 with an OpenAI-style body) instead of
hanging, and leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from server_harness import MODEL, Server, serve

from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.api_server import build_app


@pytest.fixture(scope="module")
def process_server(embedded_tokenizer):
    # The front shares the session's tokenizer; the core process loads the model itself.
    engine = AsyncLLM(EngineConfig(num_kv_blocks=512, max_model_len=2048), tokenizer=embedded_tokenizer)
    engine.start()
    try:
        with serve(build_app(engine, MODEL)) as url:
            yield Server(url, None, engine)
    finally:
        engine.shutdown()
    assert not engine._process.is_alive()


def test_greedy_answers_equal_the_offline_api(process_server, offline):
    client = process_server.client()
    prompt = "The capital of France is"
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    want = offline.generate([prompt], offline_params(16))[0].outputs[0]
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    want = offline.chat([messages], offline_params(12))[0].outputs[0]
    assert chat.choices[0].message.content == want.text

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text


def offline_params(max_tokens):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def test_a_bad_request_is_a_400_naming_the_field(process_server):
    r = httpx.post(f"{process_server.url}/v1/completions",
                   json={"model": MODEL, "prompt": "x", "max_tokens": 4, "top_k": 2**63})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"


def test_structured_output_in_the_core_process(process_server, offline):
    """The core process has no tokenizer of its own: its first constrained request loads the
    checkpoint's vocabulary to compile the grammar. Same answer as the offline API."""
    from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "year": {"type": "integer"}},
              "required": ["city", "year"]}
    got = process_server.client().completions.create(model=MODEL, prompt="A trip:", max_tokens=40, temperature=0,
                                                     extra_body={"guided_json": schema})
    want = offline.generate(["A trip:"], SamplingParams(max_tokens=40, temperature=0.0,
                                                        structured_outputs=StructuredOutputsParams(json=schema)))
    assert got.choices[0].text == want[0].outputs[0].text
    assert json.loads(got.choices[0].text)["city"] in ("Paris", "Rome")


def test_prompt_logprobs_cross_the_process_boundary(process_server, offline):
    from pagedserve.sampling_params import SamplingParams

    ids = offline.get_tokenizer().encode("The capital of France is Paris")
    got = process_server.client().completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    want = offline.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                            use_tqdm=False)[0].prompt_logprobs
    assert got.choices[0].logprobs.token_logprobs == [None] + [
        pytest.approx(want[p][ids[p]].logprob, abs=1e-5) for p in range(1, len(ids))]


def test_the_core_dies_health_fails_and_requests_get_500_quickly(process_server):
    url, engine = process_server.url, process_server.async_engine
    assert httpx.get(f"{url}/health").status_code == 200
    in_flight = {}

    def long_request():
        in_flight["response"] = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Count:", "max_tokens": 2000, "ignore_eos": True})

    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 30
    while engine.stats.num_running == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(engine.core_pid, signal.SIGKILL)
    start = time.monotonic()
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - start < 3
    r = in_flight["response"]
    assert r.status_code == 500 and "died" in r.json()["error"]["message"]
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and health.json()["error"]["type"] == "server_error"
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"

