"""POST /v1/responses over a real server on loopback, with the real `openai` client and the OpenAI
Agents SDK: text answers (greedy: the chat endpoint's answer to the same conversation), streamed
as typed events that add up to the non-streamed response; function tools and their results, with
previous_response_id and without; the store and its bound; and the 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from server_harness import MODEL, Server, assert_all_free, serve_engine

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine

INSTRUCTIONS = "You are a helpful assistant."
QUESTION = "What is the capital of France?"
GREEDY = dict(model=MODEL, temperature=0, max_output_tokens=24)
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False},
           "strict": True}
FORCE_WEATHER = {"type": "function", "name": "get_weather"}
ASK = "What is the weather like in Paris today?"


@pytest.fixture(scope="module")
def tool_server(embedded_model, embedded_tokenizer) -> Iterator[Server]:
    """A server with vLLM's flags for tool_choice "auto" (what the Agents SDK sends once a tool has
    run), keeping two responses at most."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=256, max_model_len=2048), model=embedded_model,
                       tokenizer=embedded_tokenizer)
    with serve_engine(engine, enable_auto_tool_choice=True, tool_call_parser="hermes",
                      max_stored_responses=2) as server:
        yield server


def post(server: Server, body: dict) -> httpx.Response:
    content = json.dumps({"model": MODEL, "input": QUESTION, "max_output_tokens": 2, **body})
    return httpx.post(f"{server.url}/v1/responses", content=content, headers={"content-type": "application/json"},
                      timeout=60)


def test_text_is_the_chat_endpoints_answer_to_the_same_conversation(server):
    client = server.client()
    response = client.responses.create(instructions=INSTRUCTIONS, input=QUESTION, **GREEDY)
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_completion_tokens=24,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.output_text == chat.choices[0].message.content != ""
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    finished = chat.choices[0].finish_reason == "stop"
    assert (response.status, message.status) == (("completed",) * 2 if finished else ("incomplete",) * 2)
    # The request's settings come back, and the response is kept: GET returns it.
    assert (response.instructions, response.max_output_tokens, response.temperature) == (INSTRUCTIONS, 24, 0)
    assert response.tools == [] and response.tool_choice == "none" and response.parallel_tool_calls is True
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()


def test_a_stream_is_typed_events_that_add_up_to_the_response(server):
    client = server.client()
    request = dict(instructions=INSTRUCTIONS, input=[{"role": "user", "content": [
        {"type": "input_text", "text": QUESTION}]}], **GREEDY)
    answer = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))

    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas > 1
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     f"response.{answer.status}"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == answer.output_text
    final = events[-1].response
    assert final.output[0].content[0].text == text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (answer.usage.input_tokens,
                                                                     answer.usage.output_tokens)
    # The openai client's stream helper checks the events' order and adds them up itself.
    with client.responses.stream(**request) as stream:
        assert stream.get_final_response().output_text == answer.output_text


def test_max_output_tokens_cuts_the_response_short_and_says_so(server):
    client = server.client()
    response = client.responses.create(input=QUESTION, model=MODEL, temperature=0, max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"
    events = list(client.responses.create(input=QUESTION, model=MODEL, temperature=0, max_output_tokens=3,
                                          stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == response.output_text


def check_call(response) -> object:
    """The response's one item: a call to get_weather with arguments that follow its schema."""
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    return call


def test_a_function_tool_round_trip_with_previous_response_id_and_without(server):
    client = server.client()
    first = client.responses.create(input=ASK, tools=[WEATHER], tool_choice=FORCE_WEATHER, **GREEDY)
    call = check_call(first)
    assert first.tool_choice.name == "get_weather" and first.tools[0].strict is True
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"celsius": 21})}

    answer = GREEDY | {"max_output_tokens": 8}
    chained = client.responses.create(previous_response_id=first.id, input=[result], tools=[WEATHER],
                                      tool_choice="none", **answer)
    assert chained.previous_response_id == first.id and chained.output_text
    assert chained.output[0].type == "message"
    # The same conversation sent whole: the question, the call as the server returned it, the result.
    whole = client.responses.create(input=[{"role": "user", "content": ASK}, call.to_dict(), result],
                                    tools=[WEATHER], tool_choice="none", **answer)
    assert whole.output_text == chained.output_text
    # The history costs what its rendering costs: the call and its result are in the prompt.
    alone = client.responses.create(input=ASK, tools=[WEATHER], tool_choice="none", **answer)
    assert whole.usage.input_tokens == chained.usage.input_tokens > alone.usage.input_tokens + 20


def weather_call(call_id: str, city: str) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": json.dumps({"city": city})}


def weather_result(call_id: str, celsius: int) -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": json.dumps({"celsius": celsius})}


def test_a_follow_up_must_answer_every_function_call(server):
    """As OpenAI: a function call left without its function_call_output is a 400 naming its id,
    whether the calls come from previous_response_id or are given in `input`. The model is shown
    one earlier turn with two calls, and makes two."""
    client = server.client()
    shown = [{"role": "user", "content": "What is the weather in Paris and in Rome?"},
             weather_call("call_p", "Paris"), weather_call("call_r", "Rome"),
             weather_result("call_p", 20), weather_result("call_r", 25),
             {"role": "assistant", "content": "Paris: 20 C, Rome: 25 C."}]
    ask = {"role": "user", "content": "What is the weather in Berlin and in Madrid?"}
    first = client.responses.create(input=[*shown, ask], tools=[WEATHER], tool_choice="required",
                                    **GREEDY | {"max_output_tokens": 60})
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 2, first.output
    answered, unanswered = (weather_result(call.call_id, 18) for call in calls)
    answer = dict(tools=[WEATHER], tool_choice="none", **GREEDY | {"max_output_tokens": 4})

    def refused(**request) -> dict:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**request, **answer)
        return e.value.body

    second = calls[1].call_id
    for body in (refused(previous_response_id=first.id, input=[answered]),
                 refused(previous_response_id=first.id, input=[answered], stream=True),
                 refused(input=[*shown, ask, calls[0].to_dict(), calls[1].to_dict(), answered])):
        assert body == {"message": f"No tool output found for function call {second}.",
                        "type": "invalid_request_error", "param": "input", "code": None}
    # A follow-up that answers none names the first call; one that answers both is served.
    assert refused(previous_response_id=first.id, input="And tomorrow?")["message"].endswith(f"{calls[0].call_id}.")
    served = client.responses.create(previous_response_id=first.id, input=[answered, unanswered], **answer)
    assert served.status in ("completed", "incomplete") and served.output_text
    assert_all_free(server.wait_idle())


def test_a_streamed_call_sends_its_arguments_in_fragments(server):
    client = server.client()
    request = dict(input=ASK, tools=[WEATHER], tool_choice=FORCE_WEATHER, **GREEDY)
    answer = client.responses.create(**request)
    call = check_call(answer)
    events = list(client.responses.create(**request, stream=True))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.arguments == "" and added.item.name == "get_weather"
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(fragments) > 1 and "".join(fragments) == done.arguments == call.arguments
    assert events[-1].type == "response.completed"
    assert [(i.name, i.arguments) for i in events[-1].response.output] == [(call.name, call.arguments)]


def test_text_format_json_schema_constrains_the_output(server):
    """The openai client's `responses.parse` sends a pydantic model as a strict json_schema format
    and parses the output back into it."""
    from typing import Literal

    import pydantic

    class Answer(pydantic.BaseModel):
        capital: Literal["Paris", "Lyon"]
        country: str

    response = server.client().responses.parse(input=QUESTION, text_format=Answer, **GREEDY | {"max_output_tokens": 40})
    assert response.status == "completed" and isinstance(response.output_parsed, Answer)
    assert response.text.format.type == "json_schema" and response.text.format.name == "Answer"
    assert response.text.format.strict is True


def test_an_unknown_previous_response_id_is_a_400_in_openais_shape(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().responses.create(previous_response_id="resp_unknown", input=QUESTION, **GREEDY)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    assert "resp_unknown" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        server.client().responses.retrieve("resp_unknown")


def test_store_false_keeps_nothing_and_delete_forgets(server):
    client = server.client()
    unstored = client.responses.create(input=QUESTION, store=False, model=MODEL, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    assert post(server, {"previous_response_id": unstored.id}).status_code == 400
    stored = client.responses.create(input=QUESTION, model=MODEL, max_output_tokens=2)
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)


def test_the_store_keeps_the_most_recently_used_responses(tool_server):
    client = tool_server.client()  # keeps 2
    a, b = (client.responses.create(input=QUESTION, model=MODEL, max_output_tokens=1) for _ in range(2))
    client.responses.retrieve(a.id)  # a is now more recently used than b
    c = client.responses.create(input=QUESTION, model=MODEL, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(b.id)
    assert client.responses.retrieve(a.id).id == a.id and client.responses.retrieve(c.id).id == c.id
    assert post(tool_server, {"previous_response_id": b.id}).json()["error"]["code"] == "previous_response_not_found"


@pytest.mark.parametrize("body,param,message", [
    ({"background": True}, "background", "not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools", "function tools only"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "function tools only"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "no reasoning options"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "not supported"),
    ({"truncation": "auto"}, "truncation", "too long for the context"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"text": {"verbosity": "low"}}, "text", "not supported"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "input item 0 is of type 'reasoning'"),
    ({"input": [{"role": "user", "content": "Hi"}, {"type": ["message"]}]}, "input", "input item 1 is of type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "text only"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "city"}]}, "input",
     "JSON text of an object"),
    ({"input": []}, "input", "at least 1"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "search"}}, "tool_choice", "'search'"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text",
     "tool_choice"),
    ({"tools": [{**WEATHER, "parameters": {"type": "string"}}], "tool_choice": "required"}, "tools",
     'tools.0.parameters: must be a JSON schema of type "object"'),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"model": "gpt-4o"}, "model", "does not exist"),
])
def test_refused_and_bad_fields_are_400s_naming_the_field(server, body, param, message):
    r = post(server, body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_what_the_openai_client_sends_by_default_is_accepted(server):
    r = post(server, {"include": [], "truncation": "disabled", "store": True, "metadata": {"k": "v"}, "user": "u",
                      "parallel_tool_calls": True, "text": {"format": {"type": "text"}}, "reasoning": {},
                      "background": False, "prompt_cache_key": "agent-1", "safety_identifier": "s"})
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"k": "v"} and r.json()["user"] == "u"


def test_a_stream_closed_early_frees_its_blocks(server):
    client = server.client()
    with client.responses.create(input=QUESTION, model=MODEL, max_output_tokens=400, stream=True) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break
    assert_all_free(server.wait_idle())


def weather_tool():
    from agents import function_tool

    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"21 degrees Celsius in {city}"

    return get_weather, calls


def test_the_agents_sdk_runs_a_function_tool_in_both_its_modes(tool_server):
    """The SDK's default tool is strict. The first turn forces the call; once the tool has run the
    SDK resets tool_choice, so the answer comes with tool_choice "auto". Both modes run the same
    conversation through the same chat machinery: the same call, the same answer."""
    from agents import (
        Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, set_tracing_disabled,
    )

    set_tracing_disabled(True)
    runs = {}
    for mode in (OpenAIResponsesModel, OpenAIChatCompletionsModel):
        get_weather, calls = weather_tool()
        agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                      model=mode(model=MODEL, openai_client=tool_server.async_client()),
                      model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=200))
        result = Runner.run_sync(agent, ASK, max_turns=3)
        assert len(calls) == 1 and isinstance(calls[0], str) and calls[0]
        assert isinstance(result.final_output, str) and result.final_output
        runs[mode] = (calls, result.final_output)
    assert runs[OpenAIResponsesModel] == runs[OpenAIChatCompletionsModel]


def test_the_compatibility_table_lists_every_field_and_says_which_are_refused():
    from pathlib import Path

    from pagedserve.entrypoints.openai.protocol_responses import ResponsesRequest

    lines = (Path(__file__).parents[3] / "docs" / "api_compatibility.md").read_text().splitlines()
    section = lines[lines.index("## Responses API"):]
    table = {}
    for line in section:
        if line.startswith("| `"):
            field, status = [c.strip() for c in line.strip("|").split("|")]
            table[field.strip("`")] = status.startswith("refused")
    declared = {name: any("Refused" in getattr(getattr(m, "func", None), "__qualname__", "") for m in info.metadata)
                for name, info in ResponsesRequest.model_fields.items()}
    assert table == declared


# The translation from chat chunks to Responses events, on chunks in the chat stream's shape.

def chunk(content=None, calls=None, finish_reason=None) -> dict:
    delta = {k: v for k, v in {"content": content, "tool_calls": calls}.items() if v is not None}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


def new_events():
    from pagedserve.entrypoints.openai.protocol_responses import ResponseObject
    from pagedserve.entrypoints.openai.serving_responses import ResponseEvents

    return ResponseEvents(ResponseObject(id="resp_1", status="in_progress", model=MODEL))


def test_text_around_calls_becomes_messages_and_calls_in_the_models_order():
    events = new_events()
    sent = events.start()
    for c in [chunk("Let me check."),
              chunk(calls=[{"index": 0, "id": "call_a", "type": "function",
                            "function": {"name": "get_weather", "arguments": ""}}]),
              chunk(calls=[{"index": 0, "function": {"arguments": '{"city": '}}]),
              chunk(calls=[{"index": 0, "function": {"arguments": '"Paris"}'}}]),
              chunk("Done."), chunk(finish_reason="tool_calls"),
              {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                                        "prompt_tokens_details": {"cached_tokens": 3}}}]:
        sent += events.feed(c)
    sent += events.finish()
    response = events.response
    assert [item.type for item in response.output] == ["message", "function_call", "message"]
    call = response.output[1]
    assert (call.call_id, call.name, call.arguments, call.status) == ("call_a", "get_weather", '{"city": "Paris"}',
                                                                      "completed")
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    assert [e["output_index"] for e in sent if e["type"] == "response.output_item.added"] == [0, 1, 2]
    assert sent[-1]["type"] == "response.completed" and response.usage.input_tokens_details.cached_tokens == 3
    assert events.answer_message() == {"role": "assistant", "content": "Let me check.Done.", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


def test_an_error_in_the_chat_stream_fails_the_response():
    events = new_events()
    events.start()
    events.feed(chunk("Partial"))
    events.feed({"error": {"message": "the server shut down before this request finished", "type": "server_error",
                           "param": None, "code": "server_shutting_down"}})
    error, failed = events.finish()
    assert error["type"] == "error" and error["code"] == "server_shutting_down"
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert "shut down" in failed["response"]["error"]["message"]


def test_input_items_become_the_chat_conversation():
    from pagedserve.entrypoints.openai.protocol_responses import ResponsesRequest
    from pagedserve.entrypoints.openai.serving_responses import chat_messages

    request = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris and Rome?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "21 C"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "25 C"}]},
    ]})
    calls = [{"id": f"call_{k}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
             for k, city in (("a", "Paris"), ("b", "Rome"))]
    assert chat_messages(request.input) == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Rome?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_a", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "25 C"}]},
    ]
