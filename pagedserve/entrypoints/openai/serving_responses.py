"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

Built on the chat path, not beside it: a Responses request becomes a chat completion request
(instructions as the system message, then the previous response's conversation, then the input
items; function tools, tool_choice and the text format as chat's tools, tool_choice and
response_format), which `OpenAIServingChat` runs as a stream. Its chunks (text, tool calls with
their ids, finish reason, usage) become the Responses API's output items and typed events, and a
non-streamed response is those same events added up: both always carry the same items. So tool
prompts, tool-call parsers, structured output, validation, the drain and disconnects work as they
do for chat.

Responses are kept (`store`, true by default) in memory for `previous_response_id` and GET, at
most `max_stored_responses` of them: the least recently used is dropped first. A stored response
keeps its conversation without its instructions (OpenAI's rule: instructions do not carry over).
As on OpenAI, every function call in the conversation (the earlier turns' and the input's) needs
its function_call_output: a follow-up that leaves one unanswered is a 400 naming its call id.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.responses import Response

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from pagedserve.entrypoints.openai.protocol_responses import (
    DeletedResponse, FunctionCallItem, FunctionCallOutput, IncompleteDetails, InputItem, InputTextPart,
    InputTokensDetails, MessageItem, OutputMessage, OutputText, ResponseError, ResponseObject,
    ResponsesRequest, ResponseUsage,
)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_engine import APIError

DEFAULT_MAX_STORED_RESPONSES = 1000

# Chat's fields, as the Responses API names them (for errors the chat path raises).
_FIELD_NAMES = {"messages": "input", "response_format": "text", "max_completion_tokens": "max_output_tokens",
                "max_tokens": "max_output_tokens"}


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    conversation: tuple[dict[str, Any], ...]  # chat messages: the earlier turns, the input, the answer


class ResponseStore:
    """The responses kept for previous_response_id and GET: at most `max_responses`, the least
    recently used (created or read) dropped first. Event loop only."""

    def __init__(self, max_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_responses < 0:
            raise ValueError(f"max_stored_responses must be at least 0, got {max_responses}")
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def put(self, stored: StoredResponse) -> None:
        if self.max_responses == 0:
            return
        self._responses[stored.response.id] = stored
        self._responses.move_to_end(stored.response.id)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create_response(self, request: ResponsesRequest) -> Response:
        self.chat.check_model(request.model)
        earlier: tuple[dict[str, Any], ...] = ()
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                raise APIError(400, f"Previous response with id '{request.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            earlier = previous.conversation
        conversation = (*earlier, *chat_messages(request.input))
        unanswered = unanswered_call(conversation)
        if unanswered is not None:
            raise APIError(400, f"No tool output found for function call {unanswered}.", param="input")
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        chat_request = self._chat_request(request, [*system, *conversation])
        try:
            answer = await self.chat.create_chat_completion(chat_request)
        except APIError as e:
            raise _renamed(e) from None
        assert isinstance(answer, StreamingResponse)
        events = ResponseEvents(self._response(request))
        chunks = _chat_chunks(answer)
        if request.stream:
            return StreamingResponse(self._stream(request, conversation, events, chunks),
                                     media_type="text/event-stream")
        async with aclosing(chunks):
            async for chunk in chunks:
                events.feed(chunk)
        events.finish()
        if events.error is not None:
            raise _api_error(events.error)
        self._keep(request, conversation, events)
        return JSONResponse(events.response.model_dump())

    def retrieve(self, response_id: str) -> JSONResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return JSONResponse(stored.response.model_dump())

    def delete(self, response_id: str) -> JSONResponse:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse(DeletedResponse(id=response_id).model_dump())

    def _chat_request(self, request: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        body: dict[str, Any] = {"model": request.model, "messages": messages, "stream": True,
                                "stream_options": {"include_usage": True}}
        given = {"max_completion_tokens": request.max_output_tokens, "temperature": request.temperature,
                 "top_p": request.top_p, "tool_choice": request.chat_tool_choice(),
                 "parallel_tool_calls": request.parallel_tool_calls, "user": request.user}
        body |= {name: value for name, value in given.items() if value is not None}
        if request.tools is not None:
            body["tools"] = [tool.chat_tool() for tool in request.tools]
        if request.text is not None and request.text.format is not None:
            body["response_format"] = request.text.format.response_format()
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:  # what only the chat request checks (e.g. no messages at all)
            error = e.errors()[0]
            loc = [str(part) for part in error["loc"]]
            if loc[:1] == ["tools"] and loc[2:3] == ["function"]:  # a Responses tool is flat
                del loc[2]
            field = _FIELD_NAMES.get(loc[0], loc[0]) if loc else None
            raise APIError(400, f"{'.'.join([field, *loc[1:]]) if field else 'body'}: {error['msg']}",
                           param=field) from None

    def _response(self, request: ResponsesRequest) -> ResponseObject:
        """The response as it starts: the request's settings, no output yet."""
        echoed = dict(instructions=request.instructions, max_output_tokens=request.max_output_tokens,
                      metadata=request.metadata, parallel_tool_calls=request.parallel_tool_calls,
                      previous_response_id=request.previous_response_id, store=request.store,
                      temperature=request.temperature, top_p=request.top_p, user=request.user,
                      safety_identifier=request.safety_identifier, prompt_cache_key=request.prompt_cache_key)
        if request.text is not None and request.text.format is not None:
            echoed["text"] = {"format": request.text.format.echo()}
        tools = [{**tool.model_dump(exclude_none=True, exclude={"defer_loading"}), "strict": tool.strict is not False}
                 for tool in request.tools or []]
        model = request.model or self.chat.model_name  # an adapter's name, when the request names one
        return ResponseObject(id=f"resp_{uuid.uuid4().hex}", status="in_progress", model=model, tools=tools, tool_choice=request.echoed_tool_choice(),
                              **{name: value for name, value in echoed.items() if value is not None})

    async def _stream(self, request: ResponsesRequest, conversation: tuple[dict[str, Any], ...],
                      events: ResponseEvents, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        async with aclosing(chunks):
            for event in events.start():
                yield _sse(event)
            async for chunk in chunks:
                for event in events.feed(chunk):
                    yield _sse(event)
        last = events.finish()
        self._keep(request, conversation, events)  # before the last event: a client may send the next turn then
        for event in last:
            yield _sse(event)

    def _keep(self, request: ResponsesRequest, conversation: tuple[dict[str, Any], ...],
              events: ResponseEvents) -> None:
        if request.store is not False and events.error is None:
            self.store.put(StoredResponse(events.response, (*conversation, events.answer_message())))


def chat_messages(given: str | list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages: a function_call joins the assistant message before it (the
    calls of one turn are one message's tool_calls); a function_call_output is a tool message."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict[str, Any]] = []
    for item in given:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _chat_content(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _chat_content(item.output)})
    return messages


def unanswered_call(messages: tuple[dict[str, Any], ...]) -> str | None:
    """The id of the first tool call in the chat `messages` that no later tool message answers."""
    pending: dict[str, None] = {}  # in the order the calls were made
    for message in messages:
        for call in message.get("tool_calls") or ():
            pending[call["id"]] = None
        if message["role"] == "tool":
            pending.pop(message["tool_call_id"], None)
    return next(iter(pending), None)


def _chat_content(content: str | list[InputTextPart]) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.content()} for part in content]


async def _chat_chunks(answer: StreamingResponse) -> AsyncIterator[dict[str, Any]]:
    """The chat stream's chunks (and its error, `{"error": {...}}`), as JSON objects."""
    async with aclosing(answer.body_iterator) as body:
        buffer = ""
        async for part in body:
            buffer += part if isinstance(part, str) else bytes(part).decode()
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                data = event.removeprefix("data: ")
                if data != "[DONE]":
                    yield json.loads(data)


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class ResponseEvents:
    """Chat chunks in, Responses API events out, and the response they add up to (`response`).

    Text opens a message item (and its output_text part) unless one is open; a tool call's first
    delta closes the open item and opens a function_call item, whose call_id is the chat call's
    id; the end closes the open item and sets the status: completed, incomplete (the output hit
    max_output_tokens) or failed (`error`)."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.error: dict[str, Any] | None = None
        self._sequence_number = 0
        self._open: OutputMessage | FunctionCallOutput | None = None
        self._finish_reason: str | None = None

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response.model_dump()),
                self._event("response.in_progress", response=self.response.model_dump())]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if "error" in chunk:
            self.error = chunk["error"]
            return []
        if chunk.get("usage"):
            usage = chunk["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            self.response.usage = ResponseUsage(
                input_tokens=usage["prompt_tokens"], input_tokens_details=InputTokensDetails(cached_tokens=cached),
                output_tokens=usage["completion_tokens"], total_tokens=usage["total_tokens"])
        events = []
        for choice in chunk.get("choices", []):
            delta = choice["delta"]
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[dict[str, Any]]:
        if self.error is not None:
            self.response.status = "failed"
            self.response.error = ResponseError(code="server_error", message=self.error.get("message", ""))
            error = self._event("error", code=self.error.get("code"), message=self.error.get("message", ""),
                                param=self.error.get("param"))
            return [error, self._event("response.failed", response=self.response.model_dump())]
        events = []
        if not self.response.output:  # no text and no call: an empty message, as chat's content ""
            events += self._text("")
        incomplete = self._finish_reason == "length"
        events += self._close("incomplete" if incomplete else "completed")
        if incomplete:
            self.response.status = "incomplete"
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            return [*events, self._event("response.incomplete", response=self.response.model_dump())]
        self.response.status = "completed"
        return [*events, self._event("response.completed", response=self.response.model_dump())]

    def answer_message(self) -> dict[str, Any]:
        """The output as the chat message the next turn's conversation holds."""
        text = "".join(part.text for item in self.response.output if isinstance(item, OutputMessage)
                       for part in item.content)
        calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                 for item in self.response.output if isinstance(item, FunctionCallOutput)]
        if not calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": text or None, "tool_calls": calls}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open.id, "output_index": len(self.response.output) - 1}

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if not isinstance(self._open, OutputMessage):
            events += self._close("completed")
            self._open = OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[])
            self.response.output.append(self._open)
            events.append(self._event("response.output_item.added", output_index=len(self.response.output) - 1,
                                      item=self._open.model_dump()))
            self._open.content.append(OutputText(text=""))
            events.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                      part=self._open.content[0].model_dump()))
        if text:
            self._open.content[0].text += text
            events.append(self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                      logprobs=[]))
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        function = call.get("function") or {}
        if call.get("id") is not None:  # a call's first delta
            events += self._close("completed")
            self._open = FunctionCallOutput(id=f"fc_{uuid.uuid4().hex}", call_id=call["id"], name=function["name"],
                                            arguments="", status="in_progress")
            self.response.output.append(self._open)
            events.append(self._event("response.output_item.added", output_index=len(self.response.output) - 1,
                                      item=self._open.model_dump()))
        if function.get("arguments") and isinstance(self._open, FunctionCallOutput):
            self._open.arguments += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta", **self._where(),
                                      delta=function["arguments"]))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, events = self._open, []
        if item is None:
            return events
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events += [self._event("response.output_text.done", **self._where(), content_index=0, text=part.text,
                                   logprobs=[]),
                       self._event("response.content_part.done", **self._where(), content_index=0,
                                   part=part.model_dump())]
        else:
            events.append(self._event("response.function_call_arguments.done", **self._where(),
                                      arguments=item.arguments))
        item.status = status
        events.append(self._event("response.output_item.done", output_index=len(self.response.output) - 1,
                                  item=item.model_dump()))
        self._open = None
        return events


def _renamed(e: APIError) -> APIError:
    """An error of the chat path, its param named as the Responses API names the field."""
    error = e.body.error
    param = _FIELD_NAMES.get(error.param, error.param) if error.param else None
    return APIError(e.status, error.message, type=error.type, param=param, code=error.code)


# The codes of the chat path's 503s: the server drains, or its engine is down.
_UNAVAILABLE_CODES = ("server_shutting_down", "engine_unavailable")


def _api_error(error: dict[str, Any]) -> APIError:
    """The HTTP error for a chat stream's error event (a non-streamed request failed after it started)."""
    if error.get("code") in _UNAVAILABLE_CODES:
        status = 503
    else:
        status = 500 if error.get("type") == "server_error" else 400
    return APIError(status, error.get("message", ""), type=error.get("type", "server_error"),
                    param=error.get("param"), code=error.get("code"))


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id '{response_id}'.", param="response_id", code="not_found")
