"""Request and response bodies of the OpenAI API, as pydantic models.

Requests validate strictly: a value of the wrong JSON type is an error, never coerced ("5" is
not 5). Every field is honoured or refused:
- the fields declared here are honoured, including ones that change nothing in a single-model
  server's output (`user`, `metadata`, `store`, `service_tier`);
- fields of OpenAI's or vLLM's API that would change the output and that pagedserve does not
  implement (`Unsupported` below: `suffix`, `tools`, `response_format`, `guided_json`, ...) are a
  400 naming the field, unless they carry their neutral value (null, `{"type": "text"}`, ...);
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

from pagedserve.sampling_params import ParameterError, SamplingParams
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


def Refused(*neutral: Any) -> AfterValidator:
    """For a field pagedserve knows but does not implement: a 400 naming it, unless its value is
    null or one of `neutral` (values that mean what the field's absence means)."""
    def check(value: Any) -> Any:
        if value is not None and value not in neutral:
            alternatives = f", or set it to {' or '.join(json.dumps(v) for v in neutral)}" if neutral else ""
            raise PydanticCustomError("unsupported_field",
                                      f"not supported by this server (leave it out or null{alternatives})")
        return value

    return AfterValidator(check)


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
    # Known, not implemented: a 400 naming the field unless it is null (or neutral).
    structured_outputs: Annotated[Any, Refused()] = None
    guided_json: Annotated[Any, Refused()] = None
    guided_regex: Annotated[Any, Refused()] = None
    guided_choice: Annotated[Any, Refused()] = None
    guided_grammar: Annotated[Any, Refused()] = None
    guided_decoding_backend: Annotated[Any, Refused()] = None
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
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **given)


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


class ChatMessage(RequestModel):
    # "developer" is OpenAI's newer name for "system" (templates know "system" only).
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str | list[TextContentPart], BeforeValidator(_text_parts_only), ValidUnicode]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # default: up to the context limit
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[Any, Refused([])] = None
    tool_choice: Annotated[Any, Refused("none", "auto")] = None  # without tools, both mean no tool
    parallel_tool_calls: Annotated[Any, Refused(True, False)] = None
    functions: Annotated[Any, Refused([])] = None
    function_call: Annotated[Any, Refused("none", "auto")] = None
    response_format: Annotated[Any, Refused({"type": "text"})] = None
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


# ---- responses -------------------------------------------------------------------------------


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
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
    # vLLM's, when prompt_logprobs is asked for: None for the first prompt token, then token id -> logprob.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = _omit_none()


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = _omit_none()


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProb(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(ResponseModel):
    content: list[ChatCompletionLogProb] | None = None


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = _omit_none()
    content: str | None = _omit_none()


class ChatCompletionStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = _omit_none()
