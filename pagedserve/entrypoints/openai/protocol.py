"""Request and response bodies of the OpenAI API, as pydantic models.

Requests validate strictly: a value of the wrong JSON type is an error, never coerced ("5" is
not 5). Unknown fields are allowed and ignored, as OpenAI clients send fields we do not use.
Ranges follow OpenAI's documentation; vLLM's extra sampling fields (top_k, min_p, ...) are
accepted too.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.sampling_params import SamplingParams

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


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingRequest(RequestModel):
    """The fields /v1/completions and /v1/chat/completions share. null means the default."""

    model: str | None = None
    n: int | None = Field(None, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
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
    prompt: str | list[str] | list[int] | list[list[int]]
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
    content: str | list[TextContentPart]

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
