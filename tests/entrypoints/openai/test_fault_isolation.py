"""One bad request never fails its neighbours: while eight innocent requests run on the real server,
a request that is refused gets its 4xx, a request the engine fails on gets its 500 (or an error event
once streaming), and every innocent one gets its 200 with exactly the text it gets alone. A bounded
fuzz of the sampling fields (boundary integers and floats) holds the same."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import MODEL, assert_all_free

from pagedserve.sampling_params import SamplingParams
from tests.engine.fault_injection import forward_fails_for

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def fibonacci(n):",
           "The best way to learn a language is", "Water boils at", "My favourite colour is", "Dear Sir,"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def alone(offline) -> list[str]:
    """Each innocent's greedy completion, computed on its own engine."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [offline.generate(p, params, use_tqdm=False)[0].outputs[0].text for p in PROMPTS]


def innocent_body(i: int) -> dict:
    return {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": i % 2 == 1}


async def post(client: httpx.AsyncClient, route: str, body: dict) -> tuple[int, str | dict]:
    """(status, the completion's text or the error body). A stream's text is its chunks joined; an
    error event inside a stream comes back as that error body."""
    async with client.stream("POST", f"/v1/{route}", content=json.dumps(body),
                             headers={"Content-Type": "application/json"}) as response:
        raw = await response.aread()
    if response.status_code != 200:
        return response.status_code, json.loads(raw)
    if not response.headers["content-type"].startswith("text/event-stream"):
        choice = json.loads(raw)["choices"][0]
        return 200, choice["text"] if "text" in choice else choice["message"]["content"]
    events = [line[len("data: "):] for line in raw.decode().splitlines() if line]
    assert events[-1] == "[DONE]"
    text = ""
    for event in map(json.loads, events[:-1]):
        if "error" in event:
            return 200, event
        for choice in event["choices"]:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return 200, text


def run_beside_innocents(server, route: str, bad: dict) -> tuple[int, str | dict, list[tuple[int, str | dict]]]:
    """Send `bad` while the eight innocents run; return (its status, its result, the innocents')."""
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            innocents = [asyncio.ensure_future(post(client, "completions", innocent_body(i)))
                         for i in range(len(PROMPTS))]
            await asyncio.sleep(0.05)  # they are in the running batch
            status, result = await post(client, route, bad)
            return status, result, await asyncio.gather(*innocents)

    return asyncio.run(main())


def assert_innocents_unharmed(innocents, alone) -> None:
    assert [status for status, _ in innocents] == [200] * len(PROMPTS)
    assert [text for _, text in innocents] == alone


@pytest.mark.parametrize(("route", "bad"), [
    ("completions", {"prompt": "x", "max_tokens": 4, "top_k": 9223372036854775808}),
    ("completions", {"prompt": "x", "max_tokens": 4, "top_k": 10**30, "stream": True}),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "top_k": 2**63}),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_k": 10**30, "stream": True}),
], ids=["completion", "completion-stream", "chat", "chat-stream"])
def test_an_out_of_range_top_k_is_a_400_and_fails_nobody_else(server, alone, route, bad):
    status, error, innocents = run_beside_innocents(server, route, bad)
    assert status == 400 and error["error"]["param"] == "top_k"
    assert_innocents_unharmed(innocents, alone)
    assert_all_free(server.wait_idle())


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_engine_fails_on_fails_alone(server, alone, stream):
    tokenizer = server.engine.tokenizer
    poison = tokenizer.encode(" zebra")[0]
    before = server.metrics()
    with forward_fails_for(server.engine.model, poison):  # from its first step: no output yet
        status, error, innocents = run_beside_innocents(
            server, "completions", {"prompt": tokenizer.encode("Tell me about the") + [poison], "max_tokens": 4,
                                    "stream": stream})
    assert status == 500 and "injected fault" in error["error"]["message"]
    assert error["error"]["type"] == "server_error"
    assert_innocents_unharmed(innocents, alone)
    after = server.wait_idle()
    assert after["vllm:request_success_total:error"] - before["vllm:request_success_total:error"] == 1
    assert_all_free(after)


def test_a_stream_the_engine_fails_on_midway_ends_with_an_error_event(server, alone):
    engine = server.engine
    poison = engine.tokenizer.encode(" zebra")[0]
    real = engine.runner.execute

    def execute(plan, rows, spans):  # fails every step that decodes the bad request's third token or later
        if any(poison in r.prompt_token_ids and len(r.output_token_ids) >= 2 for r in plan.requests):
            raise RuntimeError("injected fault mid-stream")
        return real(plan, rows, spans)

    engine.runner.execute = execute
    try:
        status, event, innocents = run_beside_innocents(
            server, "completions", {"prompt": engine.tokenizer.encode("Tell me about the") + [poison],
                                    "max_tokens": 8, "ignore_eos": True, "stream": True})
    finally:
        del engine.runner.execute
    assert status == 200 and "injected fault mid-stream" in event["error"]["message"]
    assert_innocents_unharmed(innocents, alone)
    assert_all_free(server.wait_idle())


# ---- fuzz --------------------------------------------------------------------------------------

INT64 = 2**63
ints = st.sampled_from([-1, 0, 1, 2, 49_151, 49_152, 49_153, INT64 - 1, INT64, -INT64, -INT64 - 1, 10**30]) \
    | st.integers(-2**70, 2**70)
floats = st.sampled_from([0.0, -0.0, 1e-45, 1.1754943508222875e-38, 1e-5, 0.5, 1.0, 2.0, 2.0000001, 3.4e38, 3.5e38,
                          1e308, -1e308, math.inf, -math.inf, math.nan]) | st.floats()
FIELDS = {
    "top_k": ints, "seed": ints, "n": st.integers(1, 3) | ints, "min_tokens": st.integers(0, 3) | ints,
    "logprobs": st.integers(0, 20) | ints, "stop_token_ids": st.lists(ints, max_size=2),
    "temperature": floats, "top_p": floats, "min_p": floats, "presence_penalty": floats,
    "frequency_penalty": floats, "repetition_penalty": floats,
}


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(fields=st.fixed_dictionaries({}, optional=FIELDS), stream=st.booleans())
def test_fuzz_sampling_fields_beside_innocents(server, alone, fields, stream):
    bad = {"prompt": "Tell me a story", "max_tokens": 4, "stream": stream} | fields
    status, result, innocents = run_beside_innocents(server, "completions", bad)
    assert status == 200 or 400 <= status < 500, result
    if status != 200:
        assert set(result["error"]) == {"message", "type", "param", "code"}
    else:
        assert isinstance(result, str), result  # not an error event
    assert_innocents_unharmed(innocents, alone)


def test_after_all_that_every_block_is_free(server):
    assert_all_free(server.wait_idle())
