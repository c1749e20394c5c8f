"""Request and response bodies of the Responses API (`POST /v1/responses`), as pydantic models.

The same rules as protocol.py: strict types, every field honoured or refused (`Refused`: a 400
naming it unless it carries its neutral value), a field no API defines ignored with a warning.
Input items and tools of kinds this server cannot serve (images, files, reasoning items, built-in
tools such as web_search) get one sentence naming the item, before pydantic's union would answer
with every member's complaint.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagedserve.entrypoints.openai.protocol import (
    HistoryFunctionCall, Refused, RequestModel, ResponseModel, ValidUnicode,
)

# ---- input items -------------------------------------------------------------------------------

_TEXT_PART_TYPES = ("input_text", "output_text", "refusal")


def _text_parts_only(content: Any) -> Any:
    """A message's content parts: text only (an image, a file or audio is refused by name)."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str):
                raise PydanticCustomError("content_part", 'content part {j} must be an object with a "type"', {"j": j})
            if kind not in _TEXT_PART_TYPES:
                raise PydanticCustomError("text_only", "this model takes text only; content part {j} is of type {kind}",
                                          {"j": j, "kind": repr(kind)})
    return content


class InputTextPart(RequestModel):
    """input_text (what a user, system or developer says), output_text (an assistant's earlier answer,
    as the server returned it) or refusal (an assistant's refusal, whose text is `refusal`)."""

    type: Literal["input_text", "output_text", "refusal"]
    text: Annotated[str, ValidUnicode] | None = None
    refusal: Annotated[str, ValidUnicode] | None = None
    annotations: list[Any] | None = None  # output_text's, as returned: citations, which change nothing here
    logprobs: list[Any] | None = None  # output_text's, as returned

    @model_validator(mode="after")
    def _text_of_its_type(self) -> InputTextPart:
        field = "refusal" if self.type == "refusal" else "text"
        if getattr(self, field) is None:
            raise PydanticCustomError("content_part", "a {type} part needs its {field}", {"type": self.type,
                                                                                        "field": field})
        return self

    def content(self) -> str:
        return self.refusal if self.type == "refusal" else self.text


class MessageItem(RequestModel):
    """A message: OpenAI's EasyInputMessage (`type` may be left out) or a message item (a server's
    earlier output, with its id and status)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[str | list[InputTextPart], BeforeValidator(_text_parts_only), ValidUnicode]
    id: str | None = None
    status: str | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # an assistant message's, as returned


class FunctionCallItem(RequestModel):
    """A function call the model made in an earlier turn (as the server returned it)."""

    type: Literal["function_call"]
    call_id: Annotated[str, ValidUnicode]
    name: Annotated[str, ValidUnicode]
    arguments: Annotated[str, ValidUnicode]
    id: str | None = None
    status: str | None = None
    caller: Annotated[Any, Refused({"type": "direct"})] = None
    namespace: Annotated[Any, Refused()] = None
    async_: Annotated[Any, Refused(False)] = Field(None, alias="async")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        return HistoryFunctionCall._json_object(arguments)  # the chat history's check: the JSON text of an object


class FunctionCallOutputItem(RequestModel):
    """A function's result, for the call `call_id` names."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, ValidUnicode]
    output: Annotated[str | list[InputTextPart], BeforeValidator(_text_parts_only), ValidUnicode]
    id: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem,
               "function_call_output": FunctionCallOutputItem}


def _input_items(value: str | list[dict[str, Any]]) -> str | list[InputItem]:
    """Each item parsed by its `type` (none: a message). An error is one sentence that names the
    item, rather than the complaints of every member of a union."""
    if isinstance(value, str):
        return value
    items = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if not isinstance(kind, str) or kind not in _ITEM_TYPES:
            raise PydanticCustomError(
                "input_item", "input item {i} is of type {kind}, which this server does not take (it takes "
                "messages, function_call and function_call_output items)", {"i": i, "kind": repr(kind)})
        try:
            items.append(_ITEM_TYPES[kind].model_validate(item, strict=True))
        except ValidationError as e:
            # A str-or-parts field fails both ways: the parts' complaint is the one that says something.
            errors = [err for err in e.errors() if err["type"] != "string_type"] or e.errors()
            where = ".".join(str(part) for part in errors[0]["loc"] if part not in ("str",) and "[" not in str(part))
            raise PydanticCustomError("input_item", "input item {i} ({kind}){where}: {msg}",
                                      {"i": i, "kind": kind, "where": f", {where}" if where else "",
                                       "msg": errors[0]["msg"]}) from None
    return items


# ---- tools ---------------------------------------------------------------------------------------


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Annotated[str, ValidUnicode] | None = None
    parameters: dict[str, Any] | None = None
    # The Responses API's default is true (chat's is false): null or absent means strict.
    strict: bool | None = None
    defer_loading: Annotated[Any, Refused(False)] = None

    def chat_tool(self) -> dict[str, Any]:
        """The tool as /v1/chat/completions takes it."""
        function = {"name": self.name, "strict": self.strict is not False}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


def _function_tools_only(tools: Any) -> Any:
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise PydanticCustomError(
                    "tool_type", "tool {i} is of type {kind}: this server runs function tools only (built-in tools "
                    "such as web_search, file_search or code_interpreter are not supported)",
                    {"i": i, "kind": repr(kind)})
    return tools


class FunctionToolChoice(RequestModel):
    type: Literal["function"]
    name: str


def _tool_choice_shape(value: Any) -> Any:
    if value is None or isinstance(value, str) and value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return value
    raise PydanticCustomError("tool_choice", 'must be "none", "auto", "required" or a function, '
                              '{"type": "function", "name": "..."} (this server runs function tools only)')


# ---- text format ---------------------------------------------------------------------------------


class TextFormat(RequestModel):
    """text (no constraint), json_object, or json_schema (its fields flat, unlike chat's response_format)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, ValidUnicode] | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Annotated[str, ValidUnicode] | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _name_of_a_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.name is None:
            raise PydanticCustomError("json_schema", "a json_schema format needs its name")
        return self

    def response_format(self) -> dict[str, Any]:
        """The format as chat's response_format."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "description": self.description, "schema": self.json_schema,
                  "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Annotated[Any, Refused("medium")] = None  # the model has one verbosity


class ResponsesStreamOptions(RequestModel):
    # Obfuscation pads deltas against length side channels; this server adds none, which changes no text.
    include_obfuscation: bool | None = None


def _metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    if metadata is not None and len(metadata) > 16:
        raise PydanticCustomError("metadata", "at most 16 key-value pairs")
    for key, value in (metadata or {}).items():
        if len(key) > 64 or len(value) > 512:
            raise PydanticCustomError("metadata", "keys are at most 64 characters, values at most 512")
    return metadata


class ResponsesRequest(RequestModel):
    model: Annotated[str, ValidUnicode] | None = None
    input: Annotated[str | list[dict[str, Any]], ValidUnicode, AfterValidator(_input_items)]
    instructions: Annotated[str, ValidUnicode] | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # None: true, as OpenAI's
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)  # default: up to the context limit
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: Annotated[list[FunctionTool], BeforeValidator(_function_tools_only)] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | FunctionToolChoice | None,
                           BeforeValidator(_tool_choice_shape)] = None
    parallel_tool_calls: bool | None = None  # None: true
    text: TextConfig | None = None
    metadata: Annotated[dict[str, str], AfterValidator(_metadata)] | None = None
    user: Annotated[str, ValidUnicode] | None = None
    # Accepted and without effect here: they label, route or cache a request, never change its output.
    safety_identifier: Annotated[str, ValidUnicode] | None = None
    prompt_cache_key: Annotated[str, ValidUnicode] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Any = None
    # Known, not implemented: a 400 naming the field unless it is null (or neutral).
    include: Annotated[Any, Refused([])] = None
    truncation: Annotated[Any, Refused("disabled", hint="; an input too long for the context is a 400")] = None
    background: Annotated[Any, Refused(False)] = None
    background_options: Annotated[Any, Refused()] = None
    reasoning: Annotated[Any, Refused({}, hint="; this model has no reasoning options")] = None
    top_logprobs: Annotated[Any, Refused(0)] = None
    max_tool_calls: Annotated[Any, Refused()] = None
    conversation: Annotated[Any, Refused(hint="; use previous_response_id")] = None
    prompt: Annotated[Any, Refused(hint="; send instructions and input")] = None
    context_management: Annotated[Any, Refused([])] = None
    prompt_cache_options: Annotated[Any, Refused()] = None
    moderation: Annotated[Any, Refused()] = None
    image: Annotated[Any, Refused()] = None
    access_programs: Annotated[Any, Refused()] = None

    def echoed_tool_choice(self) -> str | dict[str, Any]:
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        if isinstance(self.tool_choice, FunctionToolChoice):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice


# ---- responses -----------------------------------------------------------------------------------


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallOutput(ResponseModel):
    """A function call the model made: OpenAI's ResponseFunctionToolCall."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text of an object
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | FunctionCallOutput


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0  # input tokens served from the prefix cache


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(ResponseModel):
    code: str
    message: str


class ResponseObject(ResponseModel):
    """OpenAI's Response: the request's settings echoed, the output items, status and usage."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class DeletedResponse(ResponseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
