"""What the completion and chat endpoints share: errors, the model and context checks, sampling
parameters, and running a request's prompts through the engine."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from fastapi.responses import JSONResponse

from pagedserve.engine.async_engine import AsyncLLMEngine, EngineError
from pagedserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, ResponseModel, SamplingRequest
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import ParameterError, SamplingParams

T = TypeVar("T")
# One prompt as the engine takes it: (its text when known, its token ids).
Prompt = tuple[str | None, list[int]]


class APIError(Exception):
    """An error the client gets as an OpenAI-style body with this HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        # A message may echo the request, lone surrogates ("\ud800") included, which the body's
        # UTF-8 cannot hold: escape them, so that an error never fails on its own message.
        message = message.encode("utf-8", "backslashreplace").decode()
        if param is not None:
            param = param.encode("utf-8", "backslashreplace").decode()
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: ResponseModel | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else data.model_dump_json()}\n\n"


SSE_DONE = sse("[DONE]")


@dataclass
class StreamState:
    """What a stream has sent of one choice."""

    num_chars: int = 0
    num_tokens: int = 0
    finished: bool = False

    def advance(self, o: CompletionOutput) -> tuple[str, slice] | None:
        """The text and the slice of tokens that are new since the last chunk, or None when there is
        nothing to send. Text can lag behind tokens (held back while it may start a stop string)."""
        text = o.text[self.num_chars:]
        if self.finished or (not text and o.finish_reason is None):
            return None
        new_tokens = slice(self.num_tokens, len(o.token_ids))
        self.num_chars, self.num_tokens = len(o.text), len(o.token_ids)
        self.finished = o.finish_reason is not None
        return text, new_tokens


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        """The prompt plus the tokens asked for must fit the context (vLLM's wording)."""
        limit = self.engine.max_model_len
        if max_tokens is None and num_prompt_tokens >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your request has "
                              f"{num_prompt_tokens} input tokens. Please reduce the length of the input.", param)
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} in "
                "the completion). Please reduce the length of the messages or completion.", param)

    def sampling_params(self, request: SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams, checked against the model too, so that every bad value
        is a 400 naming its field before the engine sees it."""
        try:
            params = request.to_sampling_params(max_tokens, logprobs)
            params.verify_for_engine(self.engine.vocab_size, self.engine.max_num_seqs)
        except ParameterError as e:
            raise bad_request(str(e), e.param) from e
        return params

    async def generate(self, prompts: list[Prompt], params: SamplingParams, request_id: str,
                       param: str) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every prompt as its own engine request; yield (prompt index, cumulative output) as
        outputs arrive. Errors come out as APIError; closing the iterator aborts what is left."""
        requests = [self.engine.generate(ids, params, f"{request_id}-{i}", prompt_text=text)
                    for i, (text, ids) in enumerate(prompts)]
        async with aclosing(merge_async_iterators(*requests)) as outputs:
            try:
                async for item in outputs:
                    yield item
            except ValueError as e:  # the engine refused a prompt (or, named, a parameter)
                raise bad_request(str(e), getattr(e, "param", param)) from e
            except EngineError as e:
                raise server_error(str(e)) from e


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Yield (i, item) from several async iterators in the order items arrive. An error in any of
    them, or closing the merge, cancels and closes them all."""
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await it.aclose()
