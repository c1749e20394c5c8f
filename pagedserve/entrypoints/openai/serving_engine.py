"""What the completion and chat endpoints share: errors, the model, size and context checks,
sampling parameters, tokenizer work off the event loop, the server's drain, and running a
request's prompts through the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from fastapi.responses import JSONResponse
from pydantic_core import PydanticSerializationError
from starlette.responses import Response

from pagedserve import __version__
from pagedserve.engine.protocol import EngineClient, EngineError, EngineUnavailable
from pagedserve.entrypoints.openai.limits import DEFAULT_MAX_REQUEST_TOKENS, PromptBound, RequestWork
from pagedserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, ResponseModel, SamplingRequest
from pagedserve.entrypoints.openai.tool_parsers import escape_lone_surrogates
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import ParameterError, SamplingParams

if TYPE_CHECKING:
    from pagedserve.entrypoints.openai.serving_models import OpenAIServingModels

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


def engine_unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="engine_unavailable")


def shutting_down(message: str = "the server is shutting down") -> APIError:
    return APIError(503, message, type="server_error", code="server_shutting_down")


class Drain:
    """The server's shutdown as the app sees it (event loop only). After `start()` new work is
    refused with a 503 while the requests already running go on; after `abort()` those still running
    end with a 503 error too (a stream gets it as its last event)."""

    def __init__(self) -> None:
        self.draining = False
        self.aborted = False
        self.in_flight = 0  # /v1 requests inside the app, counted by the request guard
        self._aborted_future: asyncio.Future | None = None

    def start(self) -> None:
        self.draining = True

    def abort(self) -> None:
        self.draining = self.aborted = True
        if self._aborted_future is not None and not self._aborted_future.done():
            self._aborted_future.set_result(None)

    def aborted_future(self) -> asyncio.Future:
        """Done once `abort()` is called: what a running request waits on beside its outputs."""
        if self._aborted_future is None:
            self._aborted_future = asyncio.get_running_loop().create_future()
            if self.aborted:
                self._aborted_future.set_result(None)
        return self._aborted_future


def system_fingerprint(engine: EngineClient, model_name: str, adapter: LoRARequest | None = None) -> str:
    """OpenAI's system_fingerprint: the same for every answer of one build serving one model (and
    LoRA adapter) with one configuration, different when any of them changes (so a client can tell
    why outputs changed)."""
    config = engine.config
    facts = {"version": __version__, "model": model_name,
             "adapter": None if adapter is None else [adapter.lora_name, adapter.lora_int_id, adapter.lora_path],
             "tokenizer": getattr(engine.tokenizer, "name_or_path", None),
             "config": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else None,
             "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
             "max_num_seqs": engine.max_num_seqs}
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()
    return f"fp_{digest[:10]}"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _json_text(data: ResponseModel) -> str:
    try:
        return data.model_dump_json()
    except PydanticSerializationError:  # a lone surrogate: UTF-8 cannot hold it, its escape can
        return escape_lone_surrogates(json.dumps(data.model_dump(), ensure_ascii=False, separators=(",", ":")))


def sse(data: ResponseModel | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else _json_text(data)}\n\n"


SSE_DONE = sse("[DONE]")


def json_response(data: ResponseModel) -> Response:
    """A whole response as JSON (what JSONResponse writes; lone surrogates escaped). Each choice is
    serialized on its own: one serializer call holds the GIL throughout, so a response made in one
    call would stall the event loop for all of it even from another thread; between choices the
    loop gets its turns."""
    choices = getattr(data, "choices", None)
    if not choices or len(choices) < 2:
        return Response(_json_bytes(data.model_dump()), media_type="application/json")
    head = _json_bytes(data.model_copy(update={"choices": []}).model_dump())
    # The key can only occur once, as the key: inside a JSON string every quote is escaped.
    before, after = head.split(b'"choices":[]', 1)
    parts = [before, b'"choices":[']
    for i, choice in enumerate(choices):
        parts += [b"," if i else b"", _json_bytes(choice.model_dump())]
    parts += [b"]", after]
    return Response(b"".join(parts), media_type="application/json")


def _json_bytes(content) -> bytes:
    try:
        return JSONResponse(content).body
    except UnicodeEncodeError:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return escape_lone_surrogates(text).encode()


@dataclass(frozen=True)
class Answerer:
    """Who answers a request, as its response says: the model name the client asked for (a LoRA
    adapter's or the base model's) and that model's system_fingerprint."""

    model: str
    fingerprint: str


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
    """The endpoints' shared state. Tokenizer work (encoding, chat templates, decoding) runs on
    `executor`, never on the event loop: the tokenizer releases the GIL while it encodes, so a long
    prompt delays no other client. `prompt_bound` (limits.prompt_bound) refuses a prompt that
    cannot fit before it is tokenized at all; None turns that check off."""

    def __init__(self, engine: EngineClient, models: OpenAIServingModels | str, *, executor: Executor | None = None,
                 prompt_bound: PromptBound | None = None, default_max_tokens: int | None = None,
                 drain: Drain | None = None, max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS) -> None:
        """models: the served models (the base model and its LoRA adapters), or the base model's name alone."""
        from pagedserve.entrypoints.openai.serving_models import OpenAIServingModels  # it raises this module's errors

        self.engine = engine
        self.models = models if isinstance(models, OpenAIServingModels) else OpenAIServingModels(engine, models)
        self.executor = executor or ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagedserve-tokenizer")
        self.prompt_bound = prompt_bound
        self.default_max_tokens = default_max_tokens  # the operator's, for a request that sets none
        self.drain = drain or Drain()
        self.max_request_tokens = max_request_tokens  # the work one request may ask for (limits.RequestWork)
        self._fingerprints: dict[LoRARequest | None, str] = {}

    @property
    def model_name(self) -> str:
        """The base model's name."""
        return self.models.base_model_name

    def system_fingerprint(self, adapter: LoRARequest | None = None) -> str:
        """OpenAI's system_fingerprint of the answers of the base model or of an adapter."""
        fingerprint = self._fingerprints.get(adapter)
        if fingerprint is None:
            if len(self._fingerprints) >= 64:  # adapters come and go at runtime: keep a bounded few
                self._fingerprints.clear()
            fingerprint = self._fingerprints[adapter] = system_fingerprint(self.engine, self.model_name, adapter)
        return fingerprint

    async def run_blocking(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the executor: for tokenizer work, which must not block the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def respond(self, data: ResponseModel) -> Response:
        """The JSON response, serialized on the executor: a large one (many choices, logprobs) would
        hold the event loop, and so every other client and /health, for as long as it takes."""
        return await self.run_blocking(json_response, data)

    def check_work(self, work: RequestWork) -> None:
        """A 400 naming the field for a request that asks for more than the server's budget."""
        refusal = work.over(self.max_request_tokens)
        if refusal is not None:
            raise bad_request(*refusal)

    async def check_prompt_chars(self, texts: list[str], param: str) -> None:
        """Refuse, before tokenizing, a prompt (made of `texts`) whose characters cannot fit the
        context. Below the bound it costs a len(); above it, characters the tokenizer drops are
        counted out on the executor (a scan per such character)."""
        bound = self.prompt_bound
        num_chars = sum(map(len, texts))
        if bound is None or num_chars <= bound.max_chars:
            return
        if bound.dropped:
            num_chars = await self.run_blocking(lambda: sum(bound.counted(text) for text in texts))
        if num_chars > bound.max_chars:
            limit = self.engine.max_model_len
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your request has "
                              f"{num_chars} characters of input, more than {limit} tokens can hold. Please reduce "
                              "the length of the input.", param)

    def max_tokens_left(self, num_prompt_tokens: int) -> int:
        """The default when a request sets no max_tokens: the operator's default (vLLM's
        max_new_tokens), or else up to the context limit; never more than the context leaves."""
        room = self.engine.max_model_len - num_prompt_tokens
        return room if self.default_max_tokens is None else min(self.default_max_tokens, room)

    def answerer(self, model: str | None, adapter: LoRARequest | None) -> Answerer:
        return Answerer(model or self.model_name, self.system_fingerprint(adapter))

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); a 404 with OpenAI's
        model_not_found for a model the server does not serve."""
        return self.models.resolve(model)

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

    async def sampling_params(self, request: SamplingRequest, max_tokens: int, logprobs: int | None,
                              prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's SamplingParams, checked against the model too, so that every bad value
        is a 400 naming its field before the engine sees it. On the executor: a structured-output
        spec is parsed and checked here, once, and a big one takes a while."""
        return await self.run_blocking(self._sampling_params, request, max_tokens, logprobs, prompt_logprobs)

    def _sampling_params(self, request: SamplingRequest, max_tokens: int, logprobs: int | None,
                         prompt_logprobs: int | None) -> SamplingParams:
        try:
            params = request.to_sampling_params(max_tokens, logprobs, prompt_logprobs)
        except ParameterError as e:  # named after the request's field already
            raise bad_request(str(e), e.param) from e
        try:
            params.verify_for_engine(self.engine.vocab_size, self.engine.max_num_seqs)
        except ParameterError as e:
            raise constraint_error(e, request.constraint_field()) from e
        return params

    async def generate(self, prompts: list[Prompt], params: SamplingParams, request_id: str,
                       param: str, constraint_field: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every prompt as its own engine request (under `lora_request`'s adapter, or the base
        model); yield (prompt index, cumulative output) as outputs arrive. Errors come out as
        APIError (one the engine pins on the constraint names `constraint_field`, where it came
        from); closing the iterator aborts what is left, and so does the drain's abort (then the
        error is a 503)."""
        if self.drain.aborted:
            raise shutting_down()
        requests = [self.engine.generate(ids, params, f"{request_id}-{i}", prompt_text=text, lora_request=lora_request)
                    for i, (text, ids) in enumerate(prompts)]
        merged = merge_async_iterators(*requests, until=self.drain.aborted_future())
        async with aclosing(merged) as outputs:
            try:
                async for item in outputs:
                    yield item
            except ParameterError as e:  # the engine refused a parameter (a grammar that does not compile in time)
                raise constraint_error(e, constraint_field) from e
            except ValueError as e:  # the engine refused a prompt
                raise bad_request(str(e), param) from e
            except EngineUnavailable as e:  # the core died or is restarting: retry later
                raise engine_unavailable(str(e)) from e
            except EngineError as e:
                raise server_error(str(e)) from e
            except Interrupted:
                raise shutting_down("the server shut down before this request finished") from None


def constraint_error(e: ParameterError, constraint_field: str | None) -> APIError:
    """A 400 for a ParameterError; "structured_outputs", the engine's name for any constraint,
    becomes the request's field it came from."""
    if e.param != "structured_outputs" or constraint_field is None:
        return bad_request(str(e), e.param)
    return bad_request(str(e).replace("structured_outputs", constraint_field, 1), constraint_field)


class Interrupted(Exception):
    """merge_async_iterators stopped because its `until` future is done."""


async def merge_async_iterators(*iterators: AsyncIterator[T],
                                until: asyncio.Future | None = None) -> AsyncIterator[tuple[int, T]]:
    """Yield (i, item) from several async iterators in the order items arrive. An error in any of
    them, closing the merge, or `until` becoming done (then it raises Interrupted) cancels and
    closes them all."""
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait([*pending, *([until] if until is not None else [])],
                                         return_when=asyncio.FIRST_COMPLETED)
            if until is not None and until.done():
                raise Interrupted()
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
