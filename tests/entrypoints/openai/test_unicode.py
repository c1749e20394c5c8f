"""Text that is not valid Unicode (a lone surrogate, which JSON carries as the escape "\\ud800") gets a
400 naming the field at validation, never a 500 from the tokenizer or from an error body that cannot
be encoded; and the server keeps serving."""

import json

import httpx
import pytest
from server_harness import MODEL, assert_all_free

from pagedserve.entrypoints.openai.serving_engine import APIError

BAD = "abc\ud800def"  # the first bad character at position 3

USER = {"role": "user", "content": "Hi!"}

SURROGATE_REQUESTS = [
    # (route, body, the error's param, what the message names)
    ("completions", {"prompt": BAD}, "prompt", "prompt"),
    ("completions", {"prompt": ["fine", BAD]}, "prompt", "prompt[1]"),
    ("completions", {"prompt": "hi", "stop": BAD}, "stop", "stop"),
    ("completions", {"prompt": "hi", "stop": ["ok", BAD]}, "stop", "stop[1]"),
    ("completions", {"prompt": "hi", "user": BAD}, "user", "user"),
    ("completions", {"prompt": "hi", "model": BAD}, "model", "model"),
    ("chat/completions", {"messages": [{"role": "user", "content": BAD}]}, "messages", "content"),
    ("chat/completions", {"messages": [USER, {"role": "assistant", "content": [
        {"type": "text", "text": "fine"}, {"type": "text", "text": BAD}]}]}, "messages", "content[1]"),
    ("chat/completions", {"messages": [USER], "stop": [BAD]}, "stop", "stop[0]"),
    ("chat/completions", {"messages": [USER], "user": BAD}, "user", "user"),
    ("chat/completions", {"messages": [USER], "model": BAD}, "model", "model"),
]


def post(server, route: str, body: dict) -> httpx.Response:
    """POST body as ASCII JSON: the surrogate travels as the escape \ud800, as Python's json.dumps and
    JavaScript's JSON.stringify write it. (The openai client cannot send one at all: it encodes its
    JSON to UTF-8 and raises UnicodeEncodeError before any request is made.)"""
    content = json.dumps(body)
    assert "\\ud800" in content
    return httpx.post(f"{server.url}/v1/{route}", content=content, headers={"Content-Type": "application/json"},
                      timeout=120)


@pytest.mark.parametrize(("route", "body", "param", "names"), SURROGATE_REQUESTS)
def test_a_lone_surrogate_is_a_400_naming_the_field(server, route, body, param, names):
    response = post(server, route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] is None
    assert error["param"] == param
    # The message names the field and where the bad character is, the character escaped as in Python.
    assert f"{names} is not valid Unicode: it holds a lone surrogate '\\ud800' at position 3" in error["message"]
    assert error["message"].startswith(f"{param}")


def test_valid_non_ascii_text_still_works_and_the_server_keeps_serving(server):
    """Only surrogates are refused: accents, CJK and astral-plane emoji (a surrogate pair in JSON) pass."""
    body = {"prompt": "Café, 東京 and 🙂 are", "max_tokens": 2, "stop": ["🙂"], "user": "zoë"}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    chat = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Say 🙂"}]}], max_tokens=2)
    assert chat.usage.completion_tokens >= 1
    assert_all_free(server.wait_idle())


def test_an_api_error_escapes_what_it_cannot_encode():
    """An error whose message or param echoes a surrogate still renders (it used to raise
    UnicodeEncodeError inside the handler: a 500 instead of the 404)."""
    error = APIError(404, f"The model `{BAD}` does not exist.", param=f"x{BAD}", code="model_not_found")
    body = json.loads(error.response().body)  # rendering is what used to fail
    assert error.status == 404
    assert body["error"] == {"message": "The model `abc\\ud800def` does not exist.", "type": "invalid_request_error",
                             "param": "xabc\\ud800def", "code": "model_not_found"}
    assert str(error) == "The model `abc\\ud800def` does not exist."
    plain = APIError(400, "Café 🙂 is fine", param="prompt")
    assert json.loads(plain.response().body)["error"]["message"] == "Café 🙂 is fine"  # valid text is unchanged
