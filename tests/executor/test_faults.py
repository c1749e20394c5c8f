"""Tensor-parallel faults: a worker killed or frozen mid-generation ends the engine loudly and in
bounded time, with no process left behind; clean shutdowns leave no process and no bound port."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.protocol import EngineError
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.executor.base import ExecutorFailed
from pagedserve.sampling_params import SamplingParams
from tests.executor.conftest import alive, children

pytestmark = [pytest.mark.tp, pytest.mark.timeout(300)]

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def make_llm(path, tokenizer, **settings) -> LLM:
    config = EngineConfig(model=str(path), tensor_parallel_size=2, num_kv_blocks=256, **settings)
    return LLM.from_engine(LLMEngine(config, tokenizer=tokenizer))


def when_steps_run(llm: LLM, steps: int, action) -> threading.Thread:
    """Run action() from another thread once the engine has run `steps` steps."""
    def wait() -> None:
        while llm.llm_engine.stats.num_steps < steps:
            time.sleep(0.005)
        action()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def prompts(n: int = 8) -> list[dict]:
    return [{"prompt_token_ids": [5 + i, 6, 7, 8, 9]} for i in range(n)]


def test_a_worker_killed_mid_generation_fails_the_engine_fast(tiny_checkpoint, embedded_tokenizer):
    path, _ = tiny_checkpoint("llama")
    llm = make_llm(path, embedded_tokenizer)
    (worker,) = llm.llm_engine.core.executor.worker_pids
    when_steps_run(llm, 5, lambda: os.kill(worker, signal.SIGKILL))
    start = time.monotonic()
    with pytest.raises(ExecutorFailed, match=rf"worker rank 1 \(pid {worker}\) exited with code -9"):
        llm.generate(prompts(), LONG, use_tqdm=False)
    assert time.monotonic() - start < 30
    with pytest.raises(ExecutorFailed):  # and stays failed: no step runs on a broken group
        llm.generate(prompts(1), LONG, use_tqdm=False)
    llm.shutdown()
    assert not alive(worker) and children() == []


def test_a_frozen_worker_times_the_collective_out(tiny_checkpoint, embedded_tokenizer):
    path, _ = tiny_checkpoint("llama")
    llm = make_llm(path, embedded_tokenizer, distributed_timeout=3.0)
    (worker,) = llm.llm_engine.core.executor.worker_pids
    when_steps_run(llm, 5, lambda: os.kill(worker, signal.SIGSTOP))
    start = time.monotonic()
    with pytest.raises(ExecutorFailed, match="Timed out"):
        llm.generate(prompts(), LONG, use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.shutdown()  # kills the frozen worker
    assert not alive(worker) and children() == []


def test_a_worker_that_dies_while_starting_is_an_error_at_once(tiny_checkpoint, embedded_tokenizer, tmp_path,
                                                              monkeypatch):
    """Not a rendezvous waiting out its timeout: the engine sees the worker's exit and says so."""
    # Python runs sitecustomize at start-up; a spawned worker's command line ends in --multiprocessing-fork.
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\nif '--multiprocessing-fork' in sys.argv:\n    os._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    path, _ = tiny_checkpoint("llama")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) exited with code 3 while starting"):
        make_llm(path, embedded_tokenizer)
    assert time.monotonic() - start < 30
    assert children() == []


def test_a_worker_slower_to_start_than_the_collective_timeout_still_joins(tiny_checkpoint, embedded_tokenizer,
                                                                         tmp_path, monkeypatch):
    """Starting a worker is not a collective: a worker that takes longer to start than
    distributed_timeout (a busy machine) joins, and the engine serves."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys, time\nif '--multiprocessing-fork' in sys.argv:\n    time.sleep(4)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    path, _ = tiny_checkpoint("llama")
    llm = make_llm(path, embedded_tokenizer, distributed_timeout=2.0)
    try:
        assert len(llm.generate(prompts(2), SamplingParams(max_tokens=4), use_tqdm=False)) == 2
    finally:
        llm.shutdown()
    assert children() == []


def test_five_clean_shutdowns_in_a_row_leave_no_process_and_no_port(tiny_checkpoint, embedded_tokenizer):
    path, _ = tiny_checkpoint("llama")
    for _ in range(5):  # each start binds a fresh rendezvous port and starts a worker
        llm = make_llm(path, embedded_tokenizer)
        executor = llm.llm_engine.core.executor
        workers, port = executor.worker_pids, int(executor.init_method.rsplit(":", 1)[1])
        assert len(llm.generate(prompts(2), SamplingParams(max_tokens=4), use_tqdm=False)) == 2
        llm.shutdown()
        assert not any(alive(w) for w in workers)
        with socket.socket() as s:  # nothing listens on the rendezvous port (TIME_WAIT aside)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
    assert children() == []


def test_the_server_engine_fails_every_request_and_reports_unhealthy(tiny_checkpoint, embedded_tokenizer):
    """The server's engine (core in its own process, workers under it): a killed worker fails every
    stream in flight with an error, is_running turns False (/health answers 503), and the core
    process and its workers are gone."""
    path, _ = tiny_checkpoint("llama")
    engine = AsyncLLM(EngineConfig(model=str(path), tensor_parallel_size=2, num_kv_blocks=256),
                      tokenizer=embedded_tokenizer, start_timeout=120)
    engine.start()
    core = engine.core_pid
    (worker,) = children(core)
    try:
        async def main():
            async def long(i):
                async for _ in engine.generate([5 + i, 6, 7, 8], LONG, f"r{i}"):
                    pass
            tasks = [asyncio.create_task(long(i)) for i in range(3)]
            while engine.stats.num_running < 3:
                await asyncio.sleep(0.01)
            os.kill(worker, signal.SIGKILL)
            start = time.monotonic()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return results, time.monotonic() - start

        results, waited = asyncio.run(main())
        assert all(isinstance(r, EngineError) and "worker rank 1" in str(r) for r in results), results
        assert waited < 30
        assert not engine.is_running
    finally:
        engine.shutdown()
    assert not alive(core) and not alive(worker) and children() == []


def test_an_idle_server_engine_notices_a_dead_worker(tiny_checkpoint, embedded_tokenizer):
    path, _ = tiny_checkpoint("llama")
    engine = AsyncLLM(EngineConfig(model=str(path), tensor_parallel_size=2, num_kv_blocks=256),
                      tokenizer=embedded_tokenizer, start_timeout=120)
    engine.start()
    try:
        (worker,) = children(engine.core_pid)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while engine.is_running and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not engine.is_running
    finally:
        engine.shutdown()
    assert children() == []
