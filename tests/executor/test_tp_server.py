"""`pagedserve serve --tensor-parallel-size 2` as it runs: the core process drives a worker rank; the
real `openai` client gets TP=1's greedy answers, streamed or not; when the worker dies, /health
answers 503 and a request gets a 500 with an OpenAI-style body, and no process is left."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.llm import LLM
from pagedserve.entrypoints.openai.api_server import build_app
from pagedserve.sampling_params import SamplingParams
from tests.executor.conftest import alive, children
from tests.entrypoints.openai.server_harness import MODEL, Server, serve

pytestmark = [pytest.mark.tp, pytest.mark.timeout(300)]

PROMPT = "The capital of France is"


def test_a_tensor_parallel_server_answers_then_fails_loudly(odd_checkpoint, embedded_tokenizer):
    path = str(odd_checkpoint[0])
    with LLM(path, num_kv_blocks=128) as offline:
        expected = offline.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    engine = AsyncLLM(EngineConfig(model=path, tensor_parallel_size=2, num_kv_blocks=128),
                      tokenizer=embedded_tokenizer, start_timeout=120)
    engine.start()
    core = engine.core_pid
    (worker,) = children(core)
    try:
        with serve(build_app(engine, MODEL)) as url:
            client = Server(url, None, engine).client()
            got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
            assert got.choices[0].text == expected.outputs[0].text
            streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                                 stream=True)
            assert "".join(chunk.choices[0].text for chunk in streamed) == expected.outputs[0].text
            assert httpx.get(f"{url}/health").status_code == 200

            os.kill(worker, signal.SIGKILL)
            deadline = time.monotonic() + 15
            while httpx.get(f"{url}/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert httpx.get(f"{url}/health").status_code == 503
            response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
            assert response.status_code >= 500
            assert "worker rank 1" in response.json()["error"]["message"]
    finally:
        engine.shutdown()
    assert not alive(core) and not alive(worker) and children() == []
