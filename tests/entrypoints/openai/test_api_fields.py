"""Every field is honoured or refused: logit_bias is applied; fields pagedserve knows but does not
implement are a 400 naming them (unless neutral); unknown fields are ignored with a warning;
GET /v1/models/{id}. Real server on loopback, the real openai client where it can send the field."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
from server_harness import MODEL

CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 2}

REFUSED = [
    # (route, field, a value that needs support, a neutral value that must be accepted)
    ("completions", "suffix", " and Paris.", ""),
    ("completions", "best_of", 3, 1),
    ("completions", "guided_decoding_backend", "outlines", "xgrammar"),
    ("completions", "guided_whitespace_pattern", "[ ]?", None),
    ("completions", "use_beam_search", True, False),
    ("completions", "add_special_tokens", False, True),
    ("chat/completions", "functions", [{"name": "f", "parameters": {}}], []),
    ("chat/completions", "function_call", {"name": "f"}, "none"),
    ("chat/completions", "chat_template_kwargs", {"enable_thinking": True}, None),
    ("chat/completions", "modalities", ["text", "audio"], ["text"]),
    ("chat/completions", "prompt_logprobs", 1, None),  # honoured on completions only
]


def post(server, route: str, body: dict) -> httpx.Response:
    base = COMPLETION if route == "completions" else CHAT
    return httpx.post(f"{server.url}/v1/{route}", json={"model": MODEL, **base, **body}, timeout=60)


@pytest.mark.parametrize("route,field,value,neutral", REFUSED, ids=[f"{r}-{f}" for r, f, *_ in REFUSED])
def test_a_field_known_but_not_implemented_is_a_400_naming_it(server, route, field, value, neutral):
    r = post(server, route, {field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "not supported" in error["message"] and error["type"] == "invalid_request_error"
    # Its neutral value means what leaving it out means: served.
    assert post(server, route, {field: neutral}).status_code == 200


def test_unknown_fields_are_ignored_with_a_warning(server, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedserve.entrypoints.openai.protocol"):
        r = post(server, "completions", {"x_client_trace": "abc", "metadata": {"k": "v"}, "store": False})
    assert r.status_code == 200
    assert "x_client_trace" in caplog.text and "metadata" not in caplog.text  # metadata is OpenAI's: accepted


def test_logit_bias_steers_greedy_decoding(server, embedded_tokenizer):
    client = server.client()
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                      logprobs=1)
    first = embedded_tokenizer.encode(plain.choices[0].text, add_special_tokens=False)[0]
    banned = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                       logit_bias={str(first): -100})
    assert embedded_tokenizer.encode(banned.choices[0].text, add_special_tokens=False)[0] != first
    forced_id = embedded_tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=3, temperature=0,
                                            logit_bias={str(forced_id): 100})
    assert forced.choices[0].message.content == embedded_tokenizer.decode([forced_id] * 3)


@pytest.mark.parametrize("bias,message", [({"x": 1}, "token ids"), ({"5": 101}, "[-100, 100]"),
                                          ({"99999999": 1}, "out of range")])
def test_a_bad_logit_bias_is_a_400_naming_it(server, bias, message):
    r = post(server, "completions", {"logit_bias": bias})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert message in r.json()["error"]["message"]


def test_retrieve_a_model(server):
    client = server.client()
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.max_model_len == 2048
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"


def test_the_compatibility_table_lists_every_field_and_says_which_are_refused():
    from pathlib import Path

    from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    table = {}
    for line in (Path(__file__).parents[3] / "docs" / "api_compatibility.md").read_text().splitlines():
        if line.startswith("## Responses API"):  # its own table (test_serving_responses checks it)
            break
        if line.startswith("| `"):
            field, completions, chat, status = [c.strip() for c in line.strip("|").split("|")]
            table[field.strip("`")] = (completions == "yes", chat == "yes", status.startswith("refused"))

    def refused(model, name):
        return any("Refused" in getattr(getattr(m, "func", None), "__qualname__", "")
                   for m in model.model_fields[name].metadata)

    declared = {}
    for name in CompletionRequest.model_fields.keys() | ChatCompletionRequest.model_fields.keys():
        owner = CompletionRequest if name in CompletionRequest.model_fields else ChatCompletionRequest
        declared[name] = (name in CompletionRequest.model_fields, name in ChatCompletionRequest.model_fields,
                          refused(owner, name))
    assert table == declared


def test_the_developer_role_is_the_system_role_and_text_parts_are_text(server):
    client = server.client()

    def reply(messages):
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                              temperature=0).choices[0].message.content

    system = reply([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Say hello."}])
    developer = reply([{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Say hello."}])
    parts = reply([{"role": "system", "content": [{"type": "text", "text": "Answer in French."}]},
                   {"role": "user", "content": [{"type": "text", "text": "Say hello."}]}])
    assert developer == system == parts


def test_content_parts_are_joined_with_a_newline_as_vllm_does(server, embedded_tokenizer):
    """vLLM joins a message's text parts with "\n": the same prompt, so the same greedy answer."""
    parts = [{"type": "text", "text": "Name a color."}, {"type": "text", "text": "Answer in one word."}]
    joined = [{"role": "user", "content": "Name a color.\nAnswer in one word."}]
    want = embedded_tokenizer.encode(embedded_tokenizer.apply_chat_template(joined, tokenize=False,
                                                                            add_generation_prompt=True),
                                     add_special_tokens=False)
    got = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": parts}]}).json()
    assert got["tokens"] == want

    client = server.client()

    def reply(content):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                              max_tokens=8, temperature=0).choices[0].message.content

    assert reply(parts) == reply(joined[0]["content"])


def test_system_fingerprint_on_every_answer_and_chunk(server):
    client = server.client()
    chat = client.chat.completions.create(model=MODEL, **CHAT)
    fingerprint = chat.system_fingerprint
    assert fingerprint.startswith("fp_") and len(fingerprint) > len("fp_")
    completion = client.completions.create(model=MODEL, **COMPLETION)
    chunks = list(client.chat.completions.create(model=MODEL, **CHAT, stream=True))
    chunks += list(client.completions.create(model=MODEL, **COMPLETION, stream=True,
                                             stream_options={"include_usage": True}))
    # One server, one model, one configuration: one fingerprint.
    assert {completion.system_fingerprint, *(c.system_fingerprint for c in chunks)} == {fingerprint}
    assert client.chat.completions.create(model=MODEL, **CHAT).system_fingerprint == fingerprint


def test_stop_reason_is_the_stop_string_or_token_that_ended_a_choice(server, embedded_tokenizer):
    client = server.client()
    prompt = COMPLETION["prompt"]
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0]
    assert free.finish_reason == "length" and free.model_extra["stop_reason"] is None
    tokens = embedded_tokenizer.encode(prompt + free.text)[len(embedded_tokenizer.encode(prompt)):]
    assert embedded_tokenizer.decode(tokens) == free.text  # so tokens[2] is the third generated token

    word = free.text.split()[1]
    by_string = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[word, "zzz"])
    assert by_string.choices[0].finish_reason == "stop" and by_string.choices[0].model_extra["stop_reason"] == word
    by_token = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"stop_token_ids": [tokens[2]]})
    assert by_token.choices[0].model_extra["stop_reason"] == tokens[2]

    # Chat: the end of the answer (the model's end-of-sequence token) is no stop_reason, as vLLM's.
    ended = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=40, temperature=0).choices[0]
    assert ended.finish_reason == "stop" and ended.model_extra["stop_reason"] is None
    chat_stop = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                               max_tokens=40, temperature=0, stop=[ended.message.content.split()[0]])
    assert chat_stop.choices[0].model_extra["stop_reason"] == ended.message.content.split()[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                                 max_tokens=40, temperature=0, stream=True,
                                                 stop=[ended.message.content.split()[0]]))
    reasons = [c.choices[0].model_extra["stop_reason"] for c in chunks if c.choices]
    assert reasons[-1] == ended.message.content.split()[0] and set(reasons[:-1]) == {None}


@pytest.mark.parametrize("part,message", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "this model takes text only; "
                                                                                  "content part 1 is of type 'image_url'"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "text only"),
    ({"type": "text"}, 'content part 1 is a text part without a string "text"'),
])
def test_a_content_part_that_is_not_text_is_a_400_in_one_sentence(server, part, message):
    r = post(server, "chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "What?"}, part]}]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages" and message in error["message"] and "more error" not in error["message"]


def test_tokenize_and_detokenize_as_vllm_does(server, embedded_tokenizer):
    text = "The capital of France is Paris."
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == embedded_tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    assert body["token_strs"] == embedded_tokenizer.convert_ids_to_tokens(body["tokens"])
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]}).json()
    assert back == {"prompt": embedded_tokenizer.decode(body["tokens"])}

    # Messages go through the same template as a chat request: the count is what the chat costs.
    messages = [{"role": "user", "content": "Say hi."}]
    counted = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["count"]
    usage = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert counted == usage.prompt_tokens

    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["vocab_size"] == len(embedded_tokenizer) and info["eos_token"] == embedded_tokenizer.eos_token


@pytest.mark.parametrize("route,body,param", [
    ("tokenize", {}, "prompt"), ("tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("detokenize", {"tokens": [10**9]}, "tokens"), ("detokenize", {"tokens": ["a"]}, "tokens"),
    ("tokenize", {"prompt": "a", "model": "other"}, "model"),
])
def test_bad_tokenizer_requests_are_4xx_naming_the_field(server, route, body, param):
    r = httpx.post(f"{server.url}/{route}", json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param
