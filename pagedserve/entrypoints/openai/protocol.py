"""Request and response bodies of the OpenAI API, as pydantic models.

Requests validate strictly: a value of the wrong JSON type is an error, never coerced ("5" is
not 5). Unknown fields are allowed and ignored, as OpenAI clients send fields we do not use.
Ranges follow OpenAI's documentation; vLLM's extra sampling fields (top_k, min_p, ...) are
accepted too. Every text field must be valid Unicode: JSON's "\ud800" escape carries a lone
surrogate, which no tokenizer takes (see ValidUnicode).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo
from pydantic_core import PydanticCustomError

from pagedserve.sampling_params import SamplingParams
from pagedserve.text import check_unicode

MAX_LOGPROBS = 20  # vLLM's default max_logprobs


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


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

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams' defaults stand in for nulls. Raises ValueError naming the parameter
        when the combination is invalid (e.g. min_tokens > max_tokens)."""
        names = ["n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                 "skip_special_tokens", "include_stop_str_in_output"]
        given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **given)


class CompletionRequest(SamplingRequest):
    # Text, a list of texts, token ids, or a list of token id lists.
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], ValidUnicode]
    max_tokens: int | None = Field(16, ge=1)  # null: 16 too
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant"]
    content: Annotated[str | list[TextContentPart], ValidUnicode]

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


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogProbs(ResponseModel):
    """OpenAI's legacy format: one entry per token in each list."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None


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
