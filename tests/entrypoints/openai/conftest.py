"""A module-scoped real server (uvicorn on a free loopback port, in a thread) around an engine on the
preloaded embedded model, and the offline API on its own engine to compare outputs with."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import MODEL, Server, serve

from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.entrypoints.openai.api_server import build_app


@pytest.fixture(scope="module")
def server(embedded_model, embedded_tokenizer) -> Iterator[Server]:
    engine = LLMEngine(EngineConfig(num_kv_blocks=512, max_model_len=2048), model=embedded_model,
                       tokenizer=embedded_tokenizer)
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()
    try:
        with serve(build_app(async_engine, MODEL)) as url:
            yield Server(url, engine, async_engine)
    finally:
        async_engine.shutdown()


@pytest.fixture(scope="module")
def offline(embedded_model, embedded_tokenizer) -> LLM:
    """The offline API on its own engine, for outputs to compare with."""
    return LLM.from_engine(LLMEngine(EngineConfig(num_kv_blocks=256, max_model_len=2048), model=embedded_model,
                                     tokenizer=embedded_tokenizer))
