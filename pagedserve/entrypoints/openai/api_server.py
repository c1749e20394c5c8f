"""The FastAPI app: routes, API-key check, OpenAI-style errors; and `run_server` for the CLI."""

from __future__ import annotations

import asyncio
import logging
import secrets
from urllib.parse import parse_qs
from collections.abc import AsyncIterator, Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve import __version__, heap
from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.core_client import DEFAULT_MAX_RESTARTS, DEFAULT_STALL_TIMEOUT
from pagedserve.engine.protocol import EngineClient
from pagedserve.entrypoints.openai import http_server
from pagedserve.entrypoints.openai.limits import DEFAULT_MAX_REQUEST_TOKENS, default_max_body_bytes, prompt_bound
from pagedserve.entrypoints.openai.metrics import ServerMetrics
from pagedserve.structured_output.manager import load_xgrammar
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ErrorResponse,
    LoadLoRAAdapterRequest, ModelCard, ModelList, ResponseModel, TokenizeRequest, TokenizeResponse,
    TokenizerInfoResponse, UnloadLoRAAdapterRequest,
)
from pagedserve.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_dashboard import (
    DEFAULT_MAX_VIEWERS, DashboardStreams, add_dashboard_routes,
)
from pagedserve.entrypoints.openai.serving_engine import (
    APIError, Drain, bad_request, engine_unavailable, server_error, shutting_down,
)
from pagedserve.entrypoints.openai.serving_models import LoRAModulePath, OpenAIServingModels
from pagedserve.entrypoints.openai.serving_responses import (
    DEFAULT_MAX_STORED_RESPONSES, OpenAIServingResponses, ResponseStore,
)
from pagedserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
# Routes outside /v1 that use the model: the API key guards them too (vLLM's tokenizer routes).
MODEL_ROUTES = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})

# What each error status means here, for the OpenAPI schema (all carry an ErrorResponse body).
ERROR_STATUSES = {
    400: "Invalid request: a field's type or value, a prompt too long for the context, a body that is not JSON",
    401: "Missing or wrong API key",
    404: "Unknown model (or, on /v1/responses/{id}, unknown response; on /v1/unload_lora_adapter, unknown adapter)",
    408: "The request body did not arrive in time",
    413: "The request body is over the server's limit",
    500: "The engine failed while serving the request",
    503: "The server is shutting down (draining), or its engine is not running: restarting after its core died "
         "or stalled",
}


class HealthStatus(ResponseModel):
    status: Literal["ok"] = "ok"


class _App(FastAPI):
    """FastAPI, minus the 422 it declares on every route with a body: validation errors are 400 here."""

    def openapi(self) -> dict[str, Any]:
        schema = super().openapi()
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": ERROR_STATUSES[status]} for status in statuses}


def build_app(engine: EngineClient, served_model_name: str | OpenAIServingModels, api_key: str | None = None, *,
              max_body_bytes: int | None = None, body_timeout: float = http_server.DEFAULT_BODY_TIMEOUT,
              default_max_tokens: int | None = None, enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None, extra_collectors: tuple = (),
              max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
              max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
              allow_runtime_lora_updating: bool = False, dashboard: bool = True,
              dashboard_max_viewers: int = DEFAULT_MAX_VIEWERS) -> FastAPI:
    """An app serving a started engine. The caller owns the engine (start and shutdown).

    served_model_name: the base model's name, or the served models (OpenAIServingModels: the base
    model and LoRA adapters, which a request's `model` selects);
    max_body_bytes: the largest request body (default: what the longest prompt that can fit the
    context needs, limits.default_max_body_bytes); body_timeout: seconds a request's body may take
    to arrive; default_max_tokens: max_tokens for a request that sets none (vLLM's max_new_tokens
    generation setting; default: up to the context limit for chat, 16 for completions);
    enable_auto_tool_choice and tool_call_parser: vLLM's tool-calling settings (serving_chat);
    extra_collectors: more prometheus collectors for /metrics; max_request_tokens: the most tokens
    and logprob entries one request may ask for (limits.RequestWork; more is a 400);
    max_stored_responses: how many /v1/responses answers are kept for previous_response_id and GET
    (the least recently used is dropped first); allow_runtime_lora_updating: serve vLLM's POST
    /v1/load_lora_adapter and /v1/unload_lora_adapter (absent without it, as in vLLM); dashboard:
    serve the live KV view at /dashboard (serving_dashboard); dashboard_max_viewers: the most
    /dashboard/events streams open at once (a 503 past it). The app's drain (app.state.drain) is
    driven by http_server.GracefulServer."""
    bound = prompt_bound(engine.tokenizer, engine.max_model_len)
    if max_body_bytes is None:
        max_body_bytes = default_max_body_bytes(bound and bound.max_chars)
    drain = Drain()
    dashboard_streams = DashboardStreams(engine, drain, dashboard_max_viewers) if dashboard else None
    executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagedserve-tokenizer")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        executor.submit(load_xgrammar)  # meanwhile, so that the first constrained request does not wait for it
        yield
        executor.shutdown(wait=False, cancel_futures=True)

    app = _App(title="pagedserve", version=__version__, lifespan=lifespan)
    app.state.drain = drain
    models = (served_model_name if isinstance(served_model_name, OpenAIServingModels)
              else OpenAIServingModels(engine, served_model_name))
    if dashboard_streams is not None:
        extra_collectors = (*extra_collectors, dashboard_streams.collector())
    metrics = ServerMetrics(engine, models.base_model_name, extra_collectors)
    shared = dict(executor=executor, prompt_bound=bound, default_max_tokens=default_max_tokens, drain=drain,
                  max_request_tokens=max_request_tokens)
    completions = OpenAIServingCompletion(engine, models, **shared)
    chat = OpenAIServingChat(engine, models, **shared, enable_auto_tool_choice=enable_auto_tool_choice,
                             tool_call_parser=tool_call_parser)
    responses = OpenAIServingResponses(chat, ResponseStore(max_stored_responses))
    auth = (401,) if api_key else ()
    v1 = APIRouter(prefix="/v1")

    @v1.get("/models", responses=_errors(*auth, 503))
    async def list_models() -> ModelList:
        return ModelList(data=models.cards())

    @v1.get("/models/{model_id:path}", responses=_errors(*auth, 404, 503))
    async def retrieve_model(model_id: str) -> ModelCard:
        return models.card(model_id)  # 404 with OpenAI's model_not_found

    if allow_runtime_lora_updating:
        @v1.post("/load_lora_adapter", response_class=PlainTextResponse, responses=_errors(400, *auth, 503))
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
            return PlainTextResponse(await models.load(body.lora_name, body.lora_path, completions.run_blocking,
                                                       replace=body.load_inplace))

        @v1.post("/unload_lora_adapter", response_class=PlainTextResponse, responses=_errors(400, *auth, 404, 503))
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
            return PlainTextResponse(models.unload(body.lora_name))

    generation_errors = _errors(400, *auth, 404, 408, 413, 500, 503)

    @v1.post("/completions", responses=generation_errors)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, completions.create_completion(body))

    @v1.post("/chat/completions", responses=generation_errors)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, chat.create_chat_completion(body))

    @v1.post("/responses", responses=generation_errors)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, responses.create_response(body))

    @v1.get("/responses/{response_id}", responses=_errors(*auth, 404, 503))
    async def retrieve_response(response_id: str) -> Response:
        return responses.retrieve(response_id)

    @v1.delete("/responses/{response_id}", responses=_errors(*auth, 404, 503))
    async def delete_response(response_id: str) -> Response:
        return responses.delete(response_id)

    app.include_router(v1)
    if dashboard_streams is not None:
        add_dashboard_routes(app, engine, dashboard_streams)

    tokenization = OpenAIServingTokenization(chat)

    @app.post("/tokenize", responses=_errors(400, *auth, 404, 503))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenization.tokenize(body)

    @app.post("/detokenize", responses=_errors(400, *auth, 404, 503))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.detokenize(body)

    @app.get("/tokenizer_info", responses=_errors(*auth, 503))
    async def tokenizer_info() -> TokenizerInfoResponse:
        return tokenization.tokenizer_info()

    @app.get("/health", response_model=HealthStatus, responses=_errors(503))
    async def health() -> Response:
        if drain.draining:
            return shutting_down().response()
        problem = engine.health_problem()
        if problem is not None:
            return engine_unavailable(problem).response()
        return JSONResponse(HealthStatus().model_dump())

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0]
        loc = [str(part) for part in first["loc"][1:]]  # after "body"
        if first["type"] == "json_invalid":
            return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}").response()
        where = ".".join(loc) or "body"
        more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
        return bad_request(f"{where}: {first['msg']}{more}", loc[0] if loc else None).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        response = APIError(e.status_code, str(e.detail)).response()
        response.headers.update(e.headers or {})  # e.g. 405's Allow
        return response

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, e: Exception) -> JSONResponse:
        return server_error(f"internal error: {e!r}").response()  # Starlette logs the traceback

    app.add_middleware(http_server.RequestGuard, drain=drain, max_body_bytes=max_body_bytes,
                       body_timeout=body_timeout)
    if api_key:  # outside the guard: a request without the key is refused before its body is read
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


class APIKeyMiddleware:
    """Every /v1 route needs `Authorization: Bearer <key>`: checked before the body is even read. So
    does the dashboard, which also takes the key as `?api_key=` (a browser's page and EventSource
    cannot send the header); a dashboard address with more than one `api_key` is a 400, so that no
    parser's choice among them decides."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        dashboard = path == "/dashboard" or path.startswith("/dashboard/")
        if path.startswith("/v1") or path in MODEL_ROUTES or dashboard:
            error = None
            query_keys = self._query_keys(scope) if dashboard else []
            if len(query_keys) > 1:
                error = bad_request(f"the query has {len(query_keys)} api_key parameters; give exactly one",
                                    "api_key")
            else:
                given = Headers(scope=scope).get("authorization", "").encode()
                if not (secrets.compare_digest(given, self.expected)
                        or query_keys and secrets.compare_digest(query_keys[0].encode(), self.api_key)):
                    error = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _query_keys(scope: Scope) -> list[str]:
        """Every `api_key` in the query string, empty ones included."""
        query = scope.get("query_string", b"").decode("latin-1")
        return parse_qs(query, keep_blank_values=True).get("api_key", [])


async def cancel_on_disconnect(request: Request, handler: Awaitable[Response]) -> Response:
    """Await the handler, unless the client disconnects first: then cancel it, which aborts its
    engine requests. (Once a stream has started, Starlette watches for the disconnect itself.)"""
    work = asyncio.ensure_future(handler)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)  # let its cleanup run
    if work.cancelled():
        return Response(status_code=499)  # "client closed request": nobody will read it
    return work.result()


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def make_async_engine(config: EngineConfig, engine_core: str = "process", *,
                      max_restarts: int = DEFAULT_MAX_RESTARTS, stall_timeout: float = DEFAULT_STALL_TIMEOUT,
                      ) -> AsyncLLM:
    """The server's engine, not yet started: the core in a process of its own ("process") or on a
    thread of this one ("thread"). max_restarts: the core process's restarts after it dies or stalls;
    stall_timeout: how long the core may make no progress before it counts as lost (a core process
    is killed and restarted, a core on a thread is dead)."""
    return AsyncLLM(config, engine_core=engine_core, max_restarts=max_restarts, stall_timeout=stall_timeout)


def run_server(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | None = None,
               timeout_keep_alive: float = http_server.DEFAULT_TIMEOUT_KEEP_ALIVE,
               header_timeout: float = http_server.DEFAULT_HEADER_TIMEOUT,
               body_timeout: float = http_server.DEFAULT_BODY_TIMEOUT,
               shutdown_timeout: float = http_server.DEFAULT_SHUTDOWN_TIMEOUT,
               max_body_bytes: int | None = None, default_max_tokens: int | None = None,
               engine_core: str = "process", enable_auto_tool_choice: bool = False,
               tool_call_parser: str | None = None, max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
               engine_max_restarts: int = DEFAULT_MAX_RESTARTS,
               engine_stall_timeout: float = DEFAULT_STALL_TIMEOUT,
               lora_modules: Sequence[LoRAModulePath] = (), allow_runtime_lora_updating: bool = False,
               dashboard: bool = True, dashboard_max_viewers: int = DEFAULT_MAX_VIEWERS) -> None:
    """Serve until SIGTERM or SIGINT, which drain the server (http_server.GracefulServer) before it
    exits; a second signal exits at once. engine_core: "process" runs the core in a process of its
    own, "thread" on a thread of this one (both behind `AsyncLLM`). lora_modules: LoRA adapters
    served under their names, checked before the model loads (ValueError saying which and why);
    allow_runtime_lora_updating: the routes that load and unload adapters while serving; dashboard: the
    live KV view at /dashboard, to at most dashboard_max_viewers streams at once. If the core
    process dies or stalls and cannot be restarted (a core on a thread that stalls never can), the
    server stops and this raises SystemExit with an error (exit code 1), so that a supervisor
    restarts the service."""
    engine = make_async_engine(config, engine_core, max_restarts=engine_max_restarts,
                               stall_timeout=engine_stall_timeout)
    name = served_model_name or config.model or EMBEDDED_MODEL_NAME
    models = OpenAIServingModels(engine, name, lora_modules, base_model_path=config.model)
    engine.start()
    try:
        app = build_app(engine, models, api_key, max_body_bytes=max_body_bytes, body_timeout=body_timeout,
                        default_max_tokens=default_max_tokens, enable_auto_tool_choice=enable_auto_tool_choice,
                        tool_call_parser=tool_call_parser, max_request_tokens=max_request_tokens,
                        allow_runtime_lora_updating=allow_runtime_lora_updating, dashboard=dashboard,
                        dashboard_max_viewers=dashboard_max_viewers)
        server = http_server.make_server(app, host=host, port=port, timeout_keep_alive=timeout_keep_alive,
                                         header_timeout=header_timeout, shutdown_timeout=shutdown_timeout)
        if allow_runtime_lora_updating:
            logging.getLogger("uvicorn.error").warning(
                "LoRA adapters can be loaded and unloaded at runtime (POST /v1/load_lora_adapter, "
                "/v1/unload_lora_adapter): any client with access (and the API key, if set) can make the server "
                "read a directory on this machine")
        dead: list[str] = []

        def stop(reason: str) -> None:  # on the engine's thread: uvicorn's loop reads the flag
            dead.append(reason)
            server.should_exit = True

        engine.add_dead_hook(stop)
        logging.getLogger("uvicorn.error").info("Froze %d startup objects out of the cycle collector",
                                                heap.freeze_startup_objects())
        server.run()
        if dead:
            raise SystemExit(f"error: the engine core could not be restarted: {dead[0]}")
    finally:
        engine.shutdown()
        kv = engine.stats.kv
        logging.getLogger("uvicorn.error").info("Engine stopped: %d of %d KV blocks free", kv.free_blocks,
                                                kv.total_blocks)
