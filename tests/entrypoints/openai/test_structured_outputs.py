"""Structured output over HTTP, as clients send it: the openai client's response_format (json_schema
from a pydantic model, json_object), vLLM's guided_* and structured_outputs through extra_body,
streaming, LangChain's with_structured_output; bad specs are 400s naming their field, including
those that crashed or froze xgrammar, those it would not enforce and those the core finds (no
output allowed, compiled too late); a big schema compiling stalls no streaming neighbour. Real
server on loopback (the module's `server`: an in-thread engine on the embedded model)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from server_harness import MODEL

from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=100)


# A bounded integer: an unbounded one may be sampled digit after digit until max_tokens cuts it.
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["answer", "confidence"]}
ASK = [{"role": "user", "content": "Tell me about Paris as JSON."}]


def test_openai_parse_with_a_pydantic_model(server):
    """openai's `parse` sends response_format json_schema (strict) and parses the answer."""
    completion = server.client().chat.completions.parse(model=MODEL, messages=ASK, response_format=City,
                                                        max_tokens=80, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_schema_sampled_always_validates(server):
    client = server.client()
    completion = client.chat.completions.create(
        model=MODEL, messages=ASK, n=8, max_tokens=48, temperature=1.0, seed=0,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}})
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_and_streaming(server):
    client = server.client()
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0, stream=True,
                                            response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0,
                                           response_format={"type": "json_object"})
    assert text == whole.choices[0].message.content
    if whole.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


@pytest.mark.parametrize("extra,check", [
    ({"guided_choice": ["Paris", "Lyon", "Nice"]}, lambda t: t in ("Paris", "Lyon", "Nice")),
    ({"guided_regex": r"[A-Z][a-z]{2,8}, [0-9]{4}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}, [0-9]{4}", t)),
    ({"guided_grammar": 'root ::= "The answer is " ("yes" | "no") "."'},
     lambda t: t in ("The answer is yes.", "The answer is no.")),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     lambda t: json.dumps(json.loads(t)) == t),
], ids=["choice", "regex", "grammar", "json", "structured_outputs"])
def test_vllm_fields_on_completions(server, extra, check):
    completion = server.client().completions.create(model=MODEL, prompt="The capital of France is", max_tokens=40,
                                                    temperature=0.7, seed=1, n=2, extra_body=extra)
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert check(choice.text), choice.text


def test_same_as_the_offline_api(server, offline):
    got = server.client().completions.create(model=MODEL, prompt="A city:", max_tokens=40, temperature=0,
                                             extra_body={"guided_json": SCHEMA})
    want = offline.generate(["A city:"], SamplingParams(max_tokens=40, temperature=0.0,
                                                        structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    assert got.choices[0].text == want[0].outputs[0].text


@pytest.mark.parametrize("body,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "cannot be compiled: Unsupported type"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "cannot be compiled"),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "cannot be compiled"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex", "cannot be combined with guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "cannot be combined"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "cannot be compiled"),
    ({"structured_outputs": {"structural_tag": "<tag>"}}, "structured_outputs", "not valid JSON"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param, message):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param) and message in error["message"], error
    # The server goes on serving.
    assert httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2},
                      timeout=60).status_code == 200


def test_response_format_text_is_no_constraint(server):
    client = server.client()
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    text = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0,
                                          response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_langchain_with_structured_output(server):
    """Before structured output, this failed with `Invalid JSON: ... 'The capital of France is Paris.'`."""
    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=80)
    result = llm.with_structured_output(City, method="json_schema", include_raw=True).invoke("Tell me about Paris.")
    assert result["parsing_error"] is None
    assert isinstance(result["parsed"], City)
    assert City.model_validate_json(result["raw"].content) == result["parsed"]


# ---- specs that must never crash, freeze or go unenforced ------------------------------------

DEEP_PATTERN = {"type": "string", "pattern": "(" * 30000 + "a" + ")" * 30000}  # 60 KB: crashed xgrammar


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def post_chat(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions",
                      json={"model": MODEL, "messages": ASK, "max_tokens": 8, **body}, timeout=60)


@pytest.mark.parametrize("body,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP_PATTERN}}},
     "response_format", "nests groups"),
    ({"guided_json": DEEP_PATTERN}, "guided_json", "nests groups"),
    ({"tools": [tool("f", {"type": "object", "properties": {"a": {"type": "string", "pattern": "(" * 200 + ")" * 200}}})],
      "tool_choice": "required"}, "tools", "nests groups"),  # small: the tools are in the prompt too
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format", '"not"'),
    ({"guided_json": {"$ref": "https://example.com/s.json"}}, "guided_json", '"$ref"'),
    ({"guided_grammar": 'root ::= root "a"'}, "guided_grammar", "allows no output"),  # found by the core
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
     "structured_outputs", "cannot be combined with response_format"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "a+"}},
     "guided_choice", "guided_choice cannot be combined with structured_outputs"),
])
def test_specs_the_server_cannot_honour_are_400s(server, body, param, message):
    r = post_chat(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert post_chat(server, {"max_tokens": 2}).status_code == 200  # the server goes on serving


def test_a_late_grammar_is_a_400_naming_its_field(server):
    manager = server.engine.core.structured_output
    timeout, manager.compile_timeout = manager.compile_timeout, 1e-9
    try:
        r = post_chat(server, {"guided_regex": "late[0-9]+"})
    finally:
        manager.compile_timeout = timeout
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_regex" and "did not compile within" in r.json()["error"]["message"]


@pytest.mark.slow
def test_tool_choice_required_takes_pydantic_schemas_with_refs(server):
    from pydantic import BaseModel

    class Address(BaseModel):
        city: str = Field(max_length=12)

    class Person(BaseModel):
        name: str = Field(max_length=12)
        home: Address

    parameters = Person.model_json_schema()
    assert "$defs" in parameters
    client = server.client()
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        response = client.chat.completions.create(model=MODEL, messages=ASK, tools=[tool("f", parameters)],
                                                  tool_choice=choice, max_tokens=200, temperature=0)
        calls = response.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "f", response
        Person.model_validate_json(calls[0].function.arguments)


def test_a_tools_own_refs_mean_its_parameters_inside_the_calls_schema():
    """"#" in a tool's parameters is those parameters, not the server's array of calls around them."""
    from pagedserve.structured_output.manager import check_grammar
    from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest

    linked = {"type": "object", "properties": {"label": {"type": "string"},
                                               "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
                                               "kind": {"$ref": "#/$defs/Kind"}},
              "required": ["label", "next"], "$defs": {"Kind": {"enum": ["a", "b"]}}}
    request = ChatCompletionRequest(model=MODEL, messages=ASK, tools=[tool("g", {"type": "object"}), tool("f", linked)],
                                    tool_choice="required")
    schema = request.tool_schema()
    check_grammar(StructuredOutputsParams(json=schema))
    call = {"name": "f", "parameters": {"label": "x", "next": {"label": "y", "next": None, "kind": "b"}}}
    jsonschema.validate([call], schema)
    for bad in ({"label": "x", "next": {"next": None}}, {"label": "x", "next": None, "kind": "c"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "f", "parameters": bad}], schema)


@pytest.mark.timing
def test_a_big_schema_does_not_stall_a_streaming_neighbour(server):
    """Hundreds of optional properties take a while to compile (400: 0.6 s on an idle machine,
    several on a busy one): the neighbour's tokens keep coming meanwhile, as the compile runs off
    the step loop. On the loop, its longest gap would be the whole compile."""
    import threading
    import time
    import uuid

    prefix = uuid.uuid4().hex[:6]  # a schema the compiler's cache has not seen
    big = {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(400)}}
    client = server.client()
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1000, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "min_tokens": 1000})
    chunks = iter(stream)
    next(chunks)
    result = {}

    def send_big():
        start = time.monotonic()
        result["status"] = post_chat(server, {"guided_json": big, "max_tokens": 4}).status_code
        result["seconds"] = time.monotonic() - start

    sender = threading.Thread(target=send_big)
    last, gaps = time.monotonic(), []
    sender.start()
    for _ in chunks:
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        if not sender.is_alive():
            break
    stream.close()
    sender.join()
    assert result["status"] == 200, result
    assert max(gaps) < max(0.5 * result["seconds"], 0.25), (max(gaps), result)
