"""Request and response bodies of the OpenAI API, as pydantic models.

Requests validate strictly: a value of the wrong JSON type is an error, never coerced ("5" is
not 5). Every field is honoured or refused:
- the fields declared here are honoured, including ones that change nothing in a single-model
  server's output (`user`, `metadata`, `store`, `service_tier`);
- fields of OpenAI's or vLLM's API that would change the output and that pagedserve does not
  implement (`Refused` below: `suffix`, `prompt_logprobs`, `functions`, ...) are a 400 naming
  the field, unless they carry their neutral value (null, `""`, `[]`, ...);
- a field no API defines is ignored with a warning in the log, as vLLM does (clients add their
  own; refusing them breaks clients that work against OpenAI's servers).
Ranges follow OpenAI's documentation; vLLM's extra sampling fields (top_k, min_p, ...) are
accepted too. Every text field must be valid Unicode: JSON's "\ud800" escape carries a lone
surrogate, which no tokenizer takes (see ValidUnicode).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagedserve.sampling_params import ParameterError, SamplingParams, StructuredOutputsParams
from pagedserve.structured_output.grammar_check import parse_schema, rebase_refs
from pagedserve.text import check_unicode

MAX_LOGPROBS = 20  # vLLM's default max_logprobs

logger = logging.getLogger(__name__)


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _warn_unknown_fields(self) -> RequestModel:
        if self.model_extra:
            logger.warning("ignoring fields no API defines: %s", ", ".join(sorted(self.model_extra)))
        return self


class ResponseModel(BaseModel):
    pass


def _omit_none(**kwargs):
    """A field left out of the JSON while it is None (OpenAI omits them in stream deltas)."""
    return Field(None, exclude_if=lambda v: v is None, **kwargs)


# ---- errors ----------------------------------------------------------------------------------


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


# ---- requests --------------------------------------------------------------------------------


def _valid_unicode(value: Any, info: ValidationInfo) -> Any:
    """Every str in a field's value (a str, a list of them, or chat content parts), checked with
    check_unicode; the error names the field (and the list item). It runs on the field as a whole,
    after the union has picked its member: inside a union member, the error would come after the
    other members' irrelevant ones ("Input should be a valid string")."""
    name = info.field_name
    if isinstance(value, str):
        items = [(name, value)]
    else:  # token ids have nothing to check
        items = [(f"{name}[{i}]", v.text if isinstance(v, TextContentPart) else v) for i, v in enumerate(value)]
    for what, text in items:
        if isinstance(text, str):
            try:
                check_unicode(text, what)
            except ValueError as e:
                raise PydanticCustomError("invalid_unicode", str(e)) from None
    return value


# `Annotated[<a text field's type>, ValidUnicode]`: its strs must be valid Unicode (a 400 naming
# the field, never a 500 from the tokenizer or from a JSON response that echoes the text).
ValidUnicode = AfterValidator(_valid_unicode)


def Refused(*neutral: Any, hint: str = "") -> AfterValidator:
    """For a field pagedserve knows but does not implement: a 400 naming it, unless its value is
    null or one of `neutral` (values that mean what the field's absence means). `hint` ends the
    message (what to use instead)."""
    def check(value: Any) -> Any:
        if value is not None and value not in neutral:
            alternatives = f", or set it to {' or '.join(json.dumps(v) for v in neutral)}" if neutral else ""
            raise PydanticCustomError("unsupported_field",
                                      f"not supported by this server (leave it out or null{alternatives}){hint}")
        return value

    return AfterValidator(check)


class JsonSchemaFormat(RequestModel):
    name: Annotated[str, ValidUnicode] = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Annotated[str, ValidUnicode] | None = None
    # OpenAI's name is `schema`, which pydantic's BaseModel has as a method: hence the alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(RequestModel):
    """OpenAI's response_format: text (no constraint), json_object or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("json_schema", "json_schema is required with type json_schema, "
                                      "and only then")
        return self

    def to_params(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            # No schema: any JSON object, as OpenAI's json_schema without one.
            schema = self.json_schema.json_schema
            return StructuredOutputsParams(json=schema) if schema is not None else StructuredOutputsParams(json_object=True)
        return None


class StructuredOutputsField(RequestModel):
    """vLLM's structured_outputs object (StructuredOutputsParams' fields)."""

    json_: Annotated[str | dict[str, Any], ValidUnicode] | None = Field(None, alias="json")
    regex: Annotated[str, ValidUnicode] | None = None
    choice: Annotated[list[str], ValidUnicode] | None = None
    grammar: Annotated[str, ValidUnicode] | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_fallback: bool | None = None  # there is one backend, so nothing to fall back to
    structural_tag: Annotated[str | dict[str, Any], ValidUnicode] | None = None
    whitespace_pattern: Annotated[Any, Refused()] = None
    disable_additional_properties: Annotated[Any, Refused(False)] = None

    def model_dump(self, **kwargs) -> dict[str, Any]:
        return super().model_dump(by_alias=True, **kwargs)


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingRequest(RequestModel):
    """The fields /v1/completions and /v1/chat/completions share. null means the default."""

    model: Annotated[str, ValidUnicode] | None = None
    n: int | None = Field(None, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: Annotated[str | list[str], ValidUnicode] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, ValidUnicode] | None = None
    # vLLM's extras.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI's) -> bias in [-100, 100]
    # Accepted and without effect here: they label or route a request, never change its output.
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    # Structured output: at most one of these (see structured_outputs_params).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None  # vLLM's
    guided_json: Annotated[str | dict[str, Any], ValidUnicode] | None = None  # vLLM's older names
    guided_regex: Annotated[str, ValidUnicode] | None = None
    guided_choice: Annotated[list[str], ValidUnicode] | None = None
    guided_grammar: Annotated[str, ValidUnicode] | None = None
    guided_decoding_backend: Annotated[Any, Refused("xgrammar", "auto")] = None  # xgrammar is the one there is
    guided_whitespace_pattern: Annotated[Any, Refused()] = None
    # Known, not implemented: a 400 naming the field unless it is null (or neutral).
    allowed_token_ids: Annotated[Any, Refused()] = None
    bad_words: Annotated[Any, Refused()] = None
    truncate_prompt_tokens: Annotated[Any, Refused()] = None
    use_beam_search: Annotated[Any, Refused(False)] = None
    length_penalty: Annotated[Any, Refused(1, 1.0)] = None
    spaces_between_special_tokens: Annotated[Any, Refused(True)] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, max_tokens: int, logprobs: int | None,
                           prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams' defaults stand in for nulls. Raises ValueError naming the parameter
        when the combination is invalid (e.g. min_tokens > max_tokens)."""
        names = ["n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                 "skip_special_tokens", "include_stop_str_in_output"]
        given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if self.logit_bias is not None:
            given["logit_bias"] = _token_keyed(self.logit_bias)
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              structured_outputs=self.structured_outputs_params(), **given)

    def structured_output_field(self) -> str | None:
        """The one field that constrains the output, if any; two are a 400 naming the second."""
        fields = [name for name in _STRUCTURED_FIELDS if getattr(self, name) is not None]
        if fields and fields[0] == "response_format" and self.response_format.type == "text":
            fields.pop(0)  # the neutral value
        if len(fields) > 1:
            raise ParameterError(fields[1], f"{fields[1]} cannot be combined with {fields[0]}: give one constraint")
        return fields[0] if fields else None

    def constraint_field(self) -> str | None:
        """The field the request's constraint comes from (for naming it in an error found later),
        once structured_outputs_params has succeeded."""
        return self.structured_output_field()

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The constraint the request puts on its output. Errors name the field it came from."""
        field = self.structured_output_field()
        if field is None:
            return None
        try:
            if field == "response_format":
                return self.response_format.to_params()
            if field == "structured_outputs":
                given = self.structured_outputs.model_dump(exclude_none=True)
                given.pop("disable_fallback", None)
                return StructuredOutputsParams(**given)
            kind = field.removeprefix("guided_")
            return StructuredOutputsParams(**{kind: getattr(self, field)})
        except ParameterError as e:
            raise ParameterError(field, str(e).replace("structured_outputs: ", f"{field}: ", 1)) from None


_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")


def _token_keyed(logit_bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings."""
    keyed = {}
    for token, bias in logit_bias.items():
        try:
            keyed[int(token)] = bias
        except ValueError:
            raise ParameterError("logit_bias", f"logit_bias keys must be token ids, got {token!r}") from None
    return keyed


class CompletionRequest(SamplingRequest):
    # Text, a list of texts, token ids, or a list of token id lists.
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], ValidUnicode]
    max_tokens: int | None = Field(16, ge=0)  # null: 16 too; 0 only with echo (the prompt alone, scored)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: choices[].prompt_logprobs
    suffix: Annotated[Any, Refused("")] = None
    best_of: int | None = Field(None, ge=1)  # honoured when it equals n (every sample is returned)
    add_special_tokens: Annotated[Any, Refused(True)] = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of != (info.data.get("n") or 1):
            raise PydanticCustomError("unsupported_field", "other than n, not supported by this server "
                                      "(leave it out or null, or set it to n)")
        return best_of

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


def _text_parts_only(content: Any) -> Any:
    """Content parts get one clear sentence each, before the str | list union would answer with
    every member's complaint: a part that is not text (an image, audio, a file) is refused, as is
    a text part without its text."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str):
                raise PydanticCustomError("content_part", "content part {j} must be an object with a \"type\"",
                                          {"j": j})
            if kind != "text":
                raise PydanticCustomError("text_only", "this model takes text only; content part {j} is of type {kind}",
                                          {"j": j, "kind": repr(kind)})
            if not isinstance(part.get("text"), str):
                raise PydanticCustomError("content_part", "content part {j} is a text part without a string \"text\"",
                                          {"j": j})
    return content


class HistoryFunctionCall(RequestModel):
    name: Annotated[str, ValidUnicode]
    arguments: Annotated[str, ValidUnicode]  # JSON text of an object, as OpenAI returns it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise PydanticCustomError("arguments", "must be the JSON text of an object, as a tool call returns it")
        _check_json_unicode(parsed, "arguments")  # a "\ud800" escape inside the JSON text
        return arguments


def _check_json_unicode(value: Any, what: str) -> None:
    """The strings of a JSON value that goes into the prompt must be valid Unicode too."""
    try:
        check_unicode(json.dumps(value, ensure_ascii=False), what)
    except ValueError as e:
        raise PydanticCustomError("invalid_unicode", str(e)) from None


class HistoryToolCall(RequestModel):
    """A tool call of an assistant message in the conversation (one the server returned earlier)."""

    id: Annotated[str, ValidUnicode]
    type: Literal["function"] = "function"
    function: HistoryFunctionCall


class ChatMessage(RequestModel):
    # "developer" is OpenAI's newer name for "system" (templates know "system" only); "tool" carries
    # a tool's result, for the call `tool_call_id` names.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextContentPart], BeforeValidator(_text_parts_only), ValidUnicode] | None = None
    tool_calls: list[HistoryToolCall] | None = None  # assistant messages only
    tool_call_id: Annotated[str, ValidUnicode] | None = None  # tool messages only, and required there

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("content", "content is required, unless an assistant message has tool_calls")
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("tool_calls", "tool_calls belong in assistant messages only")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise PydanticCustomError("tool_call_id", "a tool message needs a tool_call_id, and only a tool message "
                                      "has one")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # as vLLM joins text parts


# ---- tools ---------------------------------------------------------------------------------------


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: Annotated[str, ValidUnicode] | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; none: no arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None and parameters.get("type", "object") != "object":
            raise PydanticCustomError("parameters", 'must be a JSON schema of type "object" (arguments are an object)')
        _check_json_unicode(parameters, "parameters")
        return parameters

    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' JSON schema: always of an object (no parameters: an empty one)."""
        return {"type": "object", **self.parameters} if self.parameters else {"type": "object", "properties": {}}


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


def _tool_choice_shape(value: Any) -> Any:
    """One sentence for a tool_choice of the wrong shape, before the union answers with each member's
    complaint."""
    if value is None or isinstance(value, str) and value in ("none", "auto", "required"):
        return value
    function = value.get("function") if isinstance(value, dict) else None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(function, dict) \
            and isinstance(function.get("name"), str):
        return value
    raise PydanticCustomError("tool_choice", 'must be "none", "auto", "required" or a function, '
                              '{"type": "function", "function": {"name": "..."}}')


def _distinct_names(tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
    names = [tool.function.name for tool in tools or []]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise PydanticCustomError("tools", "two tools have the same name: {names}", {"names": ", ".join(twice)})
    return tools


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # default: up to the context limit
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[ToolDefinition], AfterValidator(_distinct_names)] | None = None
    # None: OpenAI's default, "auto" with tools and "none" without (resolved_tool_choice).
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None,
                           BeforeValidator(_tool_choice_shape)] = None
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI
    # OpenAI's deprecated names for tools and tool_choice, whose answers use function_call, not tool_calls.
    functions: Annotated[Any, Refused([], hint="; use tools")] = None
    function_call: Annotated[Any, Refused("none", "auto", hint="; use tool_choice")] = None
    modalities: Annotated[Any, Refused(["text"])] = None
    audio: Annotated[Any, Refused()] = None
    prediction: Annotated[Any, Refused()] = None
    web_search_options: Annotated[Any, Refused()] = None
    reasoning_effort: Annotated[Any, Refused()] = None
    chat_template: Annotated[Any, Refused()] = None
    chat_template_kwargs: Annotated[Any, Refused()] = None
    documents: Annotated[Any, Refused()] = None
    add_generation_prompt: Annotated[Any, Refused(True)] = None
    continue_final_message: Annotated[Any, Refused(False)] = None
    prompt_logprobs: Annotated[Any, Refused()] = None  # vLLM's; honoured on /v1/completions

    def resolved_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice:
        """tool_choice with OpenAI's default filled in: "auto" when there are tools, else "none"."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    def check_tool_choice(self) -> None:
        """ParameterError, naming the field, when the tools cannot serve tool_choice."""
        choice = self.resolved_tool_choice()
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if not any(tool.function.name == name for tool in self.tools or []):
                raise ParameterError("tool_choice", f"tool_choice names the function {name!r}, which is not among "
                                     "the tools")
        elif choice == "required" and not self.tools:
            raise ParameterError("tool_choice", 'tool_choice "required" needs tools')

    def strict_auto_arguments(self) -> dict[str, dict[str, Any]] | None:
        """For tool_choice "auto" with a strict tool: each tool's name -> the schema its arguments
        must follow (a strict tool's parameters; any JSON object for a tool that is not strict).
        None otherwise: "auto" without strict tools leaves the output free."""
        if self.resolved_tool_choice() != "auto" or not any(tool.function.strict for tool in self.tools or []):
            return None
        return {tool.function.name: tool.function.parameters_schema() if tool.function.strict else {"type": "object"}
                for tool in self.tools}

    def constraint_field(self) -> str | None:
        return "tools" if self.tool_schema_applies() else self.structured_output_field()

    def tool_schema_applies(self) -> bool:
        """Whether tool_choice ("required" or a named function) constrains the output."""
        choice = self.resolved_tool_choice()
        return isinstance(choice, NamedToolChoice) or choice == "required"

    def tool_schema(self) -> dict[str, Any] | None:
        """The JSON schema that tool_choice "required" or a named function puts on the output (as
        vLLM's): a named function's arguments; for "required", an array of calls
        `{"name": ..., "parameters": {...}}`, one call at most when parallel_tool_calls is false."""
        choice = self.resolved_tool_choice()
        if isinstance(choice, NamedToolChoice):
            return next(tool.function.parameters_schema() for tool in self.tools
                        if tool.function.name == choice.function.name)
        if choice != "required":
            return None
        # Each tool's own references ("#", "#/$defs/...") point into its parameters where they are embedded.
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                                   "parameters": rebase_refs(parse_schema(tool.function.parameters_schema()),
                                                                             f"#/items/anyOf/{i}/properties/parameters")},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for i, tool in enumerate(self.tools)]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return schema

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's constraint, or the tools' for tool_choice "required" or a named function
        (one constraint at most: both are a 400). The tools' JSON has no optional whitespace:
        arguments come back compact."""
        try:
            schema = self.tool_schema()
        except ParameterError as e:  # a tool's parameters xgrammar cannot take
            raise ParameterError("tools", str(e).replace("structured_outputs", "tools", 1)) from None
        if schema is None:
            return super().structured_outputs_params()
        field = self.structured_output_field()
        if field is not None:
            raise ParameterError(field, f'{field} cannot be combined with tool_choice "required" or a named function: '
                                 "the tools constrain the output already")
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


class TokenizeRequest(RequestModel):
    """vLLM's POST /tokenize: a prompt, or chat messages through the chat template."""

    model: Annotated[str, ValidUnicode] | None = None
    prompt: Annotated[str, ValidUnicode] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    model: Annotated[str, ValidUnicode] | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(RequestModel):
    """vLLM's POST /v1/load_lora_adapter: serve the adapter in `lora_path` (a PEFT directory on the
    server's machine) under the model name `lora_name`; `load_inplace` replaces an adapter of that name."""

    lora_name: Annotated[str, ValidUnicode] = Field(min_length=1)
    lora_path: Annotated[str, ValidUnicode] = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(RequestModel):
    """vLLM's POST /v1/unload_lora_adapter."""

    lora_name: Annotated[str, ValidUnicode] = Field(min_length=1)


# ---- responses -------------------------------------------------------------------------------


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None  # vLLM's: the model's path (a LoRA adapter's directory)
    parent: str | None = None  # vLLM's: the base model a LoRA adapter adapts (None for the base)
    max_model_len: int


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str


class TokenizerInfoResponse(ResponseModel):
    tokenizer_class: str
    vocab_size: int
    model_max_length: int  # the server's max_model_len
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogProbs(ResponseModel):
    """OpenAI's legacy format: one entry per token in each list."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(ResponseModel):
    """vLLM's Logprob, as its prompt_logprobs carry it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    # vLLM's, when prompt_logprobs is asked for: None for the first prompt token, then token id -> logprob.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = _omit_none()


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = _omit_none()
    system_fingerprint: str | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProb(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(ResponseModel):
    content: list[ChatCompletionLogProb] | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str  # JSON text of an object


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the message is tool calls alone, as OpenAI's
    tool_calls: list[ToolCall] | None = _omit_none()


class ChatCompletionChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaFunctionCall(ResponseModel):
    name: str | None = _omit_none()
    arguments: str | None = _omit_none()  # a fragment: the fragments of a call add up to its arguments


class DeltaToolCall(ResponseModel):
    """A call's first delta has its id, type and name (arguments ""); the next ones only arguments."""

    index: int
    id: str | None = _omit_none()
    type: Literal["function"] | None = _omit_none()
    function: DeltaFunctionCall


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = _omit_none()
    content: str | None = _omit_none()
    tool_calls: list[DeltaToolCall] | None = _omit_none()


class ChatCompletionStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = _omit_none()
    system_fingerprint: str | None = None
