"""Tool calling on /v1/chat/completions, over a real server on loopback with the real `openai`
client (and LangChain's ChatOpenAI): tool_choice "required" and a named function, which a JSON
schema enforces on any model, the embedded 135M one included; "auto" through the server's hermes
parser (the model's output forced by a guided regex); parallel_tool_calls; streaming deltas that
the client adds up to the non-streaming answer; an agent's round trip (calls, then their results
sent back); and the 400s."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from server_harness import MODEL, Server, serve_engine

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [ADD, WEATHER]  # the 135M model picks get_weather for ASK (it leans to the tool listed last)
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SUM = [{"role": "user", "content": "What is 2 plus 3?"}]  # the 135M model calls add twice for it
GREEDY = dict(model=MODEL, temperature=0, max_tokens=48)


@pytest.fixture(scope="module")
def tool_server(embedded_model, embedded_tokenizer) -> Iterator[Server]:
    """A server started with vLLM's flags for tool_choice "auto": --enable-auto-tool-choice
    --tool-call-parser hermes."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=256, max_model_len=2048), model=embedded_model,
                       tokenizer=embedded_tokenizer)
    with serve_engine(engine, enable_auto_tool_choice=True, tool_call_parser="hermes") as server:
        yield server


def check_calls(message, tools=TOOLS) -> list:
    """Every call in OpenAI's shape, to one of `tools`, with arguments that follow its schema."""
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) > len("call_")
        assert call.function.name in schemas
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert len({call.id for call in message.tool_calls}) == len(message.tool_calls)
    return message.tool_calls


def streamed(client: openai.OpenAI, **request) -> tuple[list, object]:
    """The stream's chunks, and the completion the openai client adds them up to."""
    with client.chat.completions.stream(**request) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        return chunks, stream.get_final_completion()


def test_required_calls_a_tool_with_arguments_that_follow_its_schema(server):
    """No server flag needed: the schema constrains the output of any model."""
    response = server.client().chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY)
    choice = response.choices[0]
    check_calls(choice.message)
    assert choice.message.content is None and choice.finish_reason == "tool_calls"


def test_a_named_function_is_called_once_and_finishes_with_stop(server):
    response = server.client().chat.completions.create(
        messages=SUM, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}}, **GREEDY)
    choice = response.choices[0]
    [call] = check_calls(choice.message)
    assert call.function.name == "add" and choice.message.content is None
    assert choice.finish_reason == "stop"  # OpenAI's answer to a forced function (not "tool_calls")


def test_streamed_calls_add_up_to_the_same_calls_as_the_answer(server):
    client = server.client()
    request = dict(messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY)
    answer = client.chat.completions.create(**request)
    chunks, final = streamed(client, **request)

    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[0].content is None
    call_deltas = [d.tool_calls[0] for d in deltas if d.tool_calls]
    first = call_deltas[0]  # a call opens with its id, type and name, and empty arguments
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.function.arguments == ""
    assert first.id.startswith("call_")
    assert all(d.id is None and d.function.name is None for d in call_deltas[1:] if d.index == 0)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    got, want = final.choices[0], answer.choices[0]
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in want.message.tool_calls]
    assert got.message.content is None and got.finish_reason == want.finish_reason == "tool_calls"


def test_a_named_function_streams_its_arguments_in_fragments(server):
    client = server.client()
    request = dict(messages=SUM, tools=TOOLS,
                   tool_choice={"type": "function", "function": {"name": "add"}}, **GREEDY)
    answer = client.chat.completions.create(**request)
    chunks, final = streamed(client, **request)
    fragments = [c.choices[0].delta.tool_calls[0].function.arguments for c in chunks
                 if c.choices and c.choices[0].delta.tool_calls]
    assert len(fragments) > 2  # "", then the arguments as the tokens come
    assert "".join(fragments) == answer.choices[0].message.tool_calls[0].function.arguments
    assert final.choices[0].message.tool_calls[0].function.arguments == "".join(fragments)
    assert final.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_makes_one_call_at_most(server):
    client = server.client()
    request = dict(messages=SUM, tools=TOOLS, tool_choice="required", **GREEDY | {"max_tokens": 80})
    parallel = client.chat.completions.create(**request)
    assert len(check_calls(parallel.choices[0].message)) > 1  # what the limit has to stop
    one = client.chat.completions.create(**request, parallel_tool_calls=False)
    assert len(check_calls(one.choices[0].message)) == 1 and one.choices[0].finish_reason == "tool_calls"


def test_an_agent_round_trip_sends_calls_and_results_back(tool_server):
    client = tool_server.client()
    messages = list(ASK)
    first = client.chat.completions.create(messages=messages, tools=TOOLS, tool_choice="required", **GREEDY)
    message = first.choices[0].message
    calls = check_calls(message)
    # The assistant message as the client returned it (content null), then each call's result.
    messages.append(message)
    for call in calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})})
    second = client.chat.completions.create(messages=messages, tools=TOOLS, tool_choice="none", **GREEDY)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and isinstance(answer.message.content, str) and answer.message.content
    assert answer.finish_reason in ("stop", "length")
    # The template has no tool role: the results, labelled with their calls, are answered, not repeated
    # (as "<tool_response>" blocks) nor called for again.
    assert "<tool_response>" not in answer.message.content and "<tool_call>" not in answer.message.content
    assert "21" in answer.message.content, answer.message.content
    again = client.chat.completions.create(messages=messages, tools=TOOLS, tool_choice="auto", **GREEDY).choices[0]
    assert again.message.tool_calls is None and "<tool_response>" not in again.message.content
    # The history costs what its rendering costs: the calls and the result are in the prompt.
    without_history = client.chat.completions.create(messages=ASK, max_tokens=1, model=MODEL)
    assert second.usage.prompt_tokens > without_history.usage.prompt_tokens + 20


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(server):
    client = server.client()
    plain = client.chat.completions.create(messages=ASK, max_tokens=1, model=MODEL)
    none = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1, model=MODEL)
    required = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=1,
                                              model=MODEL)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < required.usage.prompt_tokens


# The hermes format, with text before the calls: what a model that calls tools on its own writes.
HERMES_OUTPUT = ('Let me check.\n<tool_call>\n'
                 '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
                 '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')


@pytest.mark.slow
def test_auto_reads_the_models_calls_with_the_servers_parser(tool_server):
    """The 135M model does not call tools on its own, so a guided regex makes it write exactly
    HERMES_OUTPUT: tool_choice "auto" then goes through the server's hermes parser end to end,
    answered and streamed alike."""
    client = tool_server.client()
    request = dict(messages=ASK, tools=TOOLS, tool_choice="auto", model=MODEL, max_tokens=100,
                   extra_body={"structured_outputs": {"regex": re.escape(HERMES_OUTPUT)}})
    answer = client.chat.completions.create(**request).choices[0]
    assert answer.message.content == "Let me check." and answer.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in check_calls(answer.message)] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 2, "b": 3})]

    chunks, final = streamed(client, **request)
    assert final.choices[0].message.content == "Let me check."
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in answer.message.tool_calls]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    indexes = [d.index for c in chunks if c.choices and c.choices[0].delta.tool_calls
               for d in c.choices[0].delta.tool_calls]
    assert indexes[0] == 0 and sorted(set(indexes)) == [0, 1]

    # parallel_tool_calls false: the first call only.
    one = client.chat.completions.create(**request, parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["get_weather"]


def test_a_lone_surrogate_in_a_calls_arguments_is_escaped_answered_and_streamed(tool_server):
    """The model writes a JSON escape of a lone surrogate in a call's arguments (a guided regex makes
    it): the parsed value cannot be UTF-8 encoded, yet the answer is a 200 and the stream ends with
    [DONE], the arguments valid JSON that mean what the model wrote."""
    output = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\ud800is", "unit": "celsius"}}'
              '\n</tool_call>')
    request = dict(messages=ASK, tools=TOOLS, tool_choice="auto", model=MODEL, max_tokens=100,
                   extra_body={"structured_outputs": {"regex": re.escape(output)}})
    client = tool_server.client()
    answer = client.chat.completions.create(**request).choices[0]
    [call] = answer.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Par\ud800is", "unit": "celsius"}
    chunks, final = streamed(client, **request)  # the client parses every event: none is cut short
    assert final.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    with httpx.stream("POST", f"{tool_server.url}/v1/chat/completions", timeout=120,
                      json={**{k: v for k, v in request.items() if k != "extra_body"}, **request["extra_body"],
                            "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"


def test_auto_output_that_is_not_a_call_is_content(tool_server):
    """A malformed block (guided again, to be sure of the output) comes back as text, no calls."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>'
    response = tool_server.client().chat.completions.create(
        messages=ASK, tools=TOOLS, model=MODEL, max_tokens=60, extra_body={"guided_regex": re.escape(text)})
    choice = response.choices[0]
    assert choice.message.content == text and choice.message.tool_calls is None and choice.finish_reason == "stop"


def test_forced_tool_choice_and_another_constraint_are_a_400(server):
    r = post(server, {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "tool_choice" in r.json()["error"]["message"]


def post(server, body: dict) -> httpx.Response:
    # ASCII JSON, as Python's json.dumps writes it: a lone surrogate travels as its escape.
    content = json.dumps({"model": MODEL, "messages": ASK, "max_tokens": 2, **body})
    return httpx.post(f"{server.url}/v1/chat/completions", content=content,
                      headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize("body,param,message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}}, "tool_choice",
     "'search', which is not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}], "tool_choice": "required"}, "tools",
     "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "get weather!"}}], "tool_choice": "required"}, "tools",
     "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools", 'type "object"'),
    ({"tools": [ADD, ADD], "tool_choice": "required"}, "tools", "same name: add"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "no-such-type"}}}}}], "tool_choice": "required"}, "tools", "cannot be compiled"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", 'must be "none", "auto", "required" or a function'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice", "or a function"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls", "bool"),
    ({"functions": [ADD["function"]]}, "functions", "use tools"),
    ({"function_call": {"name": "add"}}, "function_call", "use tool_choice"),
    ({"messages": [{"role": "tool", "content": "21 C"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages", "content is required"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages", "assistant"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "city=Paris"}}]}]}, "messages",
     "JSON text of an object"),
    # A lone surrogate, escaped in JSON, would reach the tokenizer through the prompt.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"description": "\ud800"}}}],
      "tool_choice": "required"}, "tools", "not valid Unicode"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": "\\ud800"}'}}]}]}, "messages",
     "not valid Unicode"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, body, param, message):
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_auto_without_the_servers_flags_is_a_400_saying_which_flags(server):
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):  # tools alone mean "auto"
        r = post(server, body)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "tool_choice"
        assert "--enable-auto-tool-choice and --tool-call-parser" in error["message"]
    # Without tools, "auto" and "none" mean no tool call, as before.
    assert post(server, {"tool_choice": "auto"}).status_code == post(server, {"tools": []}).status_code == 200


# A strict tool as OpenAI's SDKs write one (openai.pydantic_function_tool, the Agents SDK's
# function_tool): every property required, no others. The enum is one the 135M model would not
# write on its own ("Paris" is what it writes): only the constraint makes the arguments follow it.
STRICT_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Lyon", "Nice"]},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


# An earlier call in the history, which the 135M model copies: it calls get_weather on its own.
CALLED_BEFORE = [{"role": "user", "content": "What is the weather like in Rome today?"},
                 {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                     "name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
                 *ASK]


def test_strict_tools_under_auto_call_with_arguments_that_follow_the_schema(tool_server):
    client = tool_server.client()
    request = dict(messages=CALLED_BEFORE, tools=[ADD, STRICT_WEATHER], tool_choice="auto",
                   **GREEDY | {"max_tokens": 80})
    free = client.chat.completions.create(**request | {"tools": [ADD, {"type": "function", "function": {
        **STRICT_WEATHER["function"], "strict": False}}]}).choices[0]
    assert free.message.tool_calls  # the model calls on its own here...
    with pytest.raises(jsonschema.ValidationError):  # ...with arguments the schema does not allow
        check_calls(free.message, [STRICT_WEATHER])

    answer = client.chat.completions.create(**request).choices[0]
    assert [call.function.name for call in check_calls(answer.message, [ADD, STRICT_WEATHER])] == ["get_weather"]
    assert answer.finish_reason == "tool_calls"
    chunks, final = streamed(client, **request)
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in answer.message.tool_calls]


def test_strict_tools_under_auto_leave_the_model_free_to_answer_in_text(tool_server):
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    answer = tool_server.client().chat.completions.create(messages=messages, tools=[STRICT_WEATHER], **GREEDY)
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.message.content and "<tool_call>" not in choice.message.content


def test_openai_pydantic_function_tool_under_auto(tool_server):
    from pydantic import BaseModel

    class GetWeather(BaseModel):
        """Get the current weather in a city."""
        city: str
        unit: str

    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    assert tool["function"]["strict"] and tool["function"]["parameters"]["additionalProperties"] is False
    completion = tool_server.client().chat.completions.parse(messages=CALLED_BEFORE, tools=[tool],
                                                           **GREEDY | {"max_tokens": 80})
    message = completion.choices[0].message
    [call] = check_calls(message, [tool])
    assert isinstance(call.function.parsed_arguments, GetWeather)  # the client's own parse of the arguments


def test_an_agents_sdk_function_tool_runs_and_the_agent_answers_in_text(tool_server):
    """The Agents SDK in Chat Completions mode: its function tools are strict; the first turn is
    forced to call (the 135M model would not), the second is "auto" with the strict tool (the SDK
    resets tool_choice after a call) and must answer the user from the tool's result."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"21 degrees and sunny in {city}"

    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0))
    agent = Agent(name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
                  model=model, model_settings=ModelSettings(temperature=0, max_tokens=60, tool_choice="required"))
    result = asyncio.run(Runner.run(agent, "What is the weather like in Paris today?", max_turns=3))
    assert calls and all(isinstance(city, str) for city in calls)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert not result.final_output.lstrip().startswith(("<tool_response>", "<tool_call>")), result.final_output


def test_strict_tools_under_auto_and_another_constraint_are_a_400(tool_server):
    r = post(tool_server, {"tools": [STRICT_WEATHER], "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "strict" in r.json()["error"]["message"]


def test_langchain_binds_a_tool_forces_it_and_sends_the_result_back(tool_server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"21 degrees in {city}"

    llm = ChatOpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=60,
                     max_retries=0)
    forced = llm.bind_tools([get_weather], tool_choice="get_weather")
    messages = [HumanMessage("What is the weather in Paris?")]
    ai = forced.invoke(messages)
    [call] = ai.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    assert call["id"].startswith("call_")
    messages += [ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm.bind_tools([get_weather]).invoke(messages)  # tool_choice left to the server: "auto"
    assert isinstance(answer.content, str) and (answer.content or answer.tool_calls)
