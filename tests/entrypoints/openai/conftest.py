"""A module-scoped real server (uvicorn on a free loopback port, in a thread) around an engine on the
preloaded embedded model, and the offline API on its own engine to compare outputs with."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import Server, serve_engine

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM


@pytest.fixture(scope="module")
def server(embedded_model, embedded_tokenizer) -> Iterator[Server]:
    engine = LLMEngine(EngineConfig(num_kv_blocks=512, max_model_len=2048), model=embedded_model,
                       tokenizer=embedded_tokenizer)
    with serve_engine(engine) as server:
        yield server


@pytest.fixture(scope="module")
def offline(embedded_model, embedded_tokenizer) -> LLM:
    """The offline API on its own engine, for outputs to compare with."""
    return LLM.from_engine(LLMEngine(EngineConfig(num_kv_blocks=256, max_model_len=2048), model=embedded_model,
                                     tokenizer=embedded_tokenizer))
