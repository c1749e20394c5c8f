"""The FastAPI app: routes, API-key check, OpenAI-style errors; and `run_server` for the CLI."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve import __version__
from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.entrypoints.openai.metrics import ServerMetrics
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_engine import APIError, bad_request, server_error

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


def build_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """An app serving a started engine. The caller owns the engine (start and shutdown)."""
    app = FastAPI(title="pagedserve", version=__version__)
    metrics = ServerMetrics(engine, served_model_name)
    completions = OpenAIServingCompletion(engine, served_model_name)
    chat = OpenAIServingChat(engine, served_model_name)
    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=engine.max_model_len)])

    @v1.post("/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, completions.create_completion(body))

    @v1.post("/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, chat.create_chat_completion(body))

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return server_error("the engine is not running").response()
        return Response(status_code=200)

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
        return APIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, e: Exception) -> JSONResponse:
        return server_error(f"internal error: {e!r}").response()  # Starlette logs the traceback

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


class APIKeyMiddleware:
    """Every /v1 route needs `Authorization: Bearer <key>`: checked before the body is even read."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                error = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


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


def run_server(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | None = None) -> None:
    import uvicorn

    from pagedserve.engine.llm_engine import LLMEngine

    engine = AsyncLLMEngine(LLMEngine(config))
    name = served_model_name or config.model or EMBEDDED_MODEL_NAME
    engine.start()
    try:
        uvicorn.run(build_app(engine, name, api_key), host=host, port=port, log_level="info")
    finally:
        engine.shutdown()
