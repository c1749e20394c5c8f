"""Bad requests get a 4xx with an OpenAI-style error body, engine faults a 500, and through all of it
the server keeps serving everyone else; a property-based fuzz of the request bodies finds no 5xx."""

import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import MODEL, assert_all_free

CHAT = [{"role": "user", "content": "Hi!"}]
CONTEXT = 2048  # the test server's max_model_len

BAD_REQUESTS = [
    # (route, body: dict, or str sent as is, status, the error's param)
    ("completions", "{not json", 400, None),
    ("completions", "[1, 2]", 400, None),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "hi", "stop": 3}, 400, "stop"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "hi", "max_tokens": 5, "min_tokens": 6}, 400, "min_tokens"),
    # Values that fit JSON but no int64 / float32 tensor, or that exceed the vocabulary.
    ("completions", {"prompt": "x", "max_tokens": 4, "top_k": 9223372036854775808}, 400, "top_k"),
    ("completions", {"prompt": "x", "max_tokens": 4, "top_k": 10**30, "stream": True}, 400, "top_k"),
    ("completions", {"prompt": "x", "max_tokens": 4, "top_k": 49153}, 400, "top_k"),
    ("completions", {"prompt": "x", "max_tokens": 4, "seed": 2**63}, 400, "seed"),
    ("completions", {"prompt": "x", "max_tokens": 4, "seed": -(2**63) - 1}, 400, "seed"),
    ("completions", {"prompt": "x", "max_tokens": 4, "repetition_penalty": 1e39}, 400, "repetition_penalty"),
    ("completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 2**64}, 400, "min_tokens"),
    ("completions", {"prompt": "hi", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "hi", "max_tokens": 0, "logprobs": 1}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": ["hi", ""]}, 400, "prompt"),
    ("completions", {"prompt": [[]]}, 400, "prompt"),
    ("completions", {"prompt": [-1]}, 400, "prompt"),
    ("completions", {"prompt": [10**7]}, 400, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": CONTEXT}, 400, "prompt"),
    ("completions", {"prompt": [1] * (CONTEXT + 1), "max_tokens": 1}, 400, "prompt"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {}, 400, "messages"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": "hi"}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("chat/completions", {"messages": CHAT, "max_tokens": CONTEXT}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi " * CONTEXT}]}, 400, "messages"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": 1}, 400, "logprobs"),
    ("chat/completions", {"messages": CHAT, "stream_options": {"include_usage": "yes"}}, 400, "stream_options"),
    ("chat/completions", {"messages": CHAT, "model": "nope"}, 404, "model"),
    ("chat/completions", {"messages": CHAT, "max_tokens": 4, "top_k": 9223372036854775808}, 400, "top_k"),
    ("chat/completions", {"messages": CHAT, "max_tokens": 4, "top_k": 10**30, "stream": True}, 400, "top_k"),
    ("chat/completions", {"messages": CHAT, "max_tokens": 4, "seed": 2**64}, 400, "seed"),
]


def post(server, route: str, body: dict | str) -> httpx.Response:
    """POST a body as is (a str) or as JSON; Python's JSON writes NaN and Infinity, which is fine here."""
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.url}/v1/{route}", content=content, headers={"Content-Type": "application/json"},
                      timeout=120)


def assert_error_body(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    return error


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD_REQUESTS)
def test_bad_requests_get_an_openai_error(server, route, body, status, param):
    error = assert_error_body(post(server, route, body), status)
    assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"


def test_the_context_error_says_what_was_asked(server):
    error = post(server, "completions", {"prompt": [1] * 10, "max_tokens": CONTEXT}).json()["error"]
    assert error["message"] == (f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
                                f"{CONTEXT + 10} tokens (10 in the messages, {CONTEXT} in the completion). Please "
                                "reduce the length of the messages or completion.")


def test_unknown_fields_are_ignored_and_the_server_keeps_serving(server):
    r = post(server, "completions", {"prompt": "hi", "max_tokens": 2, "logit_bias_x": {"a": [1]}, "metadata": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert_all_free(server.wait_idle())


@pytest.fixture
def faulty_sampler(server):
    """Makes the engine's sampler raise from its `fail_from`-th call on (1 = at once)."""
    engine = server.engine
    real = engine.core.sampler
    state = {"calls": 0, "fail_from": 1}

    def sampler(*args):
        state["calls"] += 1
        if state["calls"] >= state["fail_from"]:
            raise RuntimeError("injected fault")
        return real(*args)

    engine.core.sampler = sampler
    yield state
    engine.core.sampler = real


def test_an_engine_fault_is_a_500_and_the_server_keeps_serving(server, faulty_sampler):
    before = server.metrics()
    for body in [{"prompt": "hi", "max_tokens": 4}, {"prompt": "hi", "max_tokens": 4, "stream": True}]:
        error = assert_error_body(post(server, "completions", body), 500)
        assert "injected fault" in error["message"]
    with pytest.raises(openai.InternalServerError):
        server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    # Mid-stream, the status is sent already: the error comes as an event and the client raises.
    faulty_sampler.update(calls=0, fail_from=3)
    stream = server.client().completions.create(model=MODEL, prompt="hi", max_tokens=8, stream=True,
                                                extra_body={"ignore_eos": True})
    texts = []
    with pytest.raises(openai.APIError, match="injected fault"):
        for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert texts  # it did stream before the fault
    after = server.wait_idle()
    assert after["vllm:request_success_total:error"] - before["vllm:request_success_total:error"] == 4
    assert_all_free(after)
    assert httpx.get(f"{server.url}/health").status_code == 200
    faulty_sampler.update(fail_from=10**9)
    assert server.client().completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text


# ---- fuzz ------------------------------------------------------------------------------------
# Half the bodies are valid, so the fuzz reaches generation with every mix of fields (stop strings,
# n, logprobs, echo, streaming, ...); the other half carry one field that is out of range, of the
# wrong type, or any JSON at all. Every accepted request stays short: max_tokens and n are bounded
# even when invalid (a null max_tokens would let chat run to the context limit).

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
not_a_count = st.text(max_size=3) | st.booleans() | st.floats(-5, 5) | st.lists(st.integers(), max_size=2)
token_ids = st.lists(st.integers(0, 49_151), min_size=1, max_size=6)
text = st.text(min_size=1, max_size=20)

VALID = {
    "model": st.just(MODEL),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, 49_152),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 3),
    "seed": st.integers(-2**63, 2**63 - 1),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": st.text(max_size=5),
    "min_tokens": st.integers(0, 3),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 49_151), max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "n": st.integers(1, 3),
    "max_tokens": st.integers(1, 4),
}
INVALID = {
    "model": st.text(max_size=5) | json_values,
    "temperature": st.floats(2, exclude_min=True) | st.floats(max_value=0, exclude_max=True) | json_values,
    "top_p": st.floats(1, exclude_min=True) | st.floats(max_value=0) | json_values,
    "top_k": st.integers(max_value=-2) | st.integers(49_153, 2**80) | json_values,
    "min_p": st.floats(1, exclude_min=True) | st.floats(max_value=0, exclude_max=True) | json_values,
    "presence_penalty": st.floats(2, exclude_min=True) | json_values,
    "frequency_penalty": st.floats(max_value=-2, exclude_max=True) | json_values,
    "repetition_penalty": st.floats(max_value=0) | json_values,
    "seed": st.integers(2**63, 2**80) | st.integers(-2**80, -2**63 - 1) | json_values,
    "stop": st.just("") | st.lists(st.just(""), min_size=1, max_size=2) | json_values,
    "stream": json_values,
    "stream_options": json_values,
    "user": json_values,
    "min_tokens": st.integers(5, 10**9) | st.integers(max_value=-1) | not_a_count,
    "ignore_eos": json_values,
    "stop_token_ids": st.lists(st.integers(-10, 10**7), min_size=1, max_size=3) | json_values,
    "include_stop_str_in_output": json_values,
    "skip_special_tokens": json_values,
    "n": st.integers(-5, 0) | not_a_count,
    "max_tokens": st.integers(-5, 0) | not_a_count,
}
COMPLETION_VALID = VALID | {
    "prompt": text | token_ids | st.lists(text, min_size=1, max_size=2) | st.lists(token_ids, min_size=1, max_size=2),
    "logprobs": st.integers(0, 20),
    "echo": st.booleans(),
    "prompt_logprobs": st.integers(0, 20),
}
COMPLETION_INVALID = INVALID | {
    "prompt": st.just("") | st.lists(st.integers(-10, 10**8), max_size=3) | json_values,
    "logprobs": st.integers(21, 10**6) | st.integers(max_value=-1) | json_values,
    "echo": json_values,
    "prompt_logprobs": st.integers(21, 10**6) | st.integers(max_value=-1) | json_values,
}
message = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant"]),
    "content": st.text(max_size=20) | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                               max_size=2)})
CHAT_VALID = VALID | {
    "messages": st.lists(message, min_size=1, max_size=3),
    "max_completion_tokens": st.integers(1, 4),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
}
CHAT_INVALID = INVALID | {
    "messages": st.just([]) | st.lists(json_values, min_size=1, max_size=2) | json_values,
    "max_completion_tokens": st.integers(-5, 0) | not_a_count,
    "logprobs": json_values,
    "top_logprobs": st.integers(21, 10**6) | json_values,
}


@st.composite
def bodies(draw, required: tuple[str, ...], valid: dict, invalid: dict) -> dict:
    optional = {name: s for name, s in valid.items() if name not in required}
    body = draw(st.fixed_dictionaries({name: valid[name] for name in required}, optional=optional))
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(invalid)))
        body[name] = draw(invalid[name])
    return body


completion_bodies = bodies(("prompt", "max_tokens"), COMPLETION_VALID, COMPLETION_INVALID)
chat_bodies = bodies(("messages", "max_tokens"), CHAT_VALID, CHAT_INVALID)


def check_response(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert_error_body(response, response.status_code)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines() if line]
        assert events[-1] == "[DONE]"
        assert all("error" not in json.loads(e) for e in events[:-1])
    else:
        assert response.json()["choices"]


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
@FUZZ
@given(body=completion_bodies)
def test_fuzz_completions_never_5xx(server, body):
    check_response(post(server, "completions", body))


@pytest.mark.slow
@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat_never_5xx(server, body):
    check_response(post(server, "chat/completions", body))


def test_after_all_that_every_block_is_free(server):
    assert_all_free(server.wait_idle())
