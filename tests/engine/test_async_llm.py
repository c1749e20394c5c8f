"""AsyncLLM: the engine core in its own process, the front (detokenization, stop strings) here.

Checked against the in-process LLMEngine on the same tiny checkpoint: same tokens, same text.
Then the faults: the core process dies (everyone in flight fails fast, nothing is left behind),
the API process dies (the core follows it), the front fails on one request (only it ends).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.protocol import EngineError, EngineUnavailable
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # every test starts an engine core process

PROMPTS = [[5, 17, 33, 8], [9, 9, 40, 41, 42, 3, 7], [100, 101], [60] * 20]


def config(path) -> EngineConfig:
    return EngineConfig(model=str(path), num_kv_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


@pytest.fixture
def core(tiny, embedded_tokenizer):
    engine = AsyncLLM(config(tiny), tokenizer=embedded_tokenizer, start_timeout=120)
    engine.start()
    yield engine
    engine.shutdown()
    assert not engine.client._process.is_alive()


def run_async(engine: AsyncLLM, requests: list[tuple[list[int], SamplingParams]]) -> list:
    async def one(i, prompt, params):
        last = None
        try:
            async for out in engine.generate(prompt, params, f"r{i}"):
                last = out
        except Exception as e:
            return e
        return last

    async def main():
        return await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(requests)))

    return asyncio.run(main())


def run_inprocess(tiny, tokenizer, requests) -> list:
    engine = LLMEngine(config(tiny), tokenizer=tokenizer)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = out
    return [final[f"r{i}"] for i in range(len(requests))]


def summary(output):
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason,
             [sorted((t, round(lp.logprob, 4), lp.rank, lp.decoded_token) for t, lp in e.items()) for e in o.logprobs]
             if o.logprobs is not None else None) for o in output.outputs]


def test_outputs_equal_the_in_process_engine(core, tiny, embedded_tokenizer):
    requests = [
        (PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0)),
        (PROMPTS[1], SamplingParams(max_tokens=10, n=3, seed=7, temperature=0.9, logprobs=2)),
        (PROMPTS[2], SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[PROMPTS[2][0]])),
        (PROMPTS[3], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
    ]
    # A stop string taken from the greedy text, so that the front must find and apply it.
    expected = run_inprocess(tiny, embedded_tokenizer, requests)
    text = expected[3].outputs[0].text
    requests.append((PROMPTS[3], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[text[5:8]])))
    expected = run_inprocess(tiny, embedded_tokenizer, requests)
    assert expected[4].outputs[0].finish_reason == "stop" and expected[4].outputs[0].stop_reason == text[5:8]
    got = run_async(core, requests)
    assert [summary(o) for o in got] == [summary(o) for o in expected]
    assert all(o.finished for o in got)
    # The core's admission time crossed the process boundary on the same clock as the front's.
    assert all(o.metrics["arrival_time"] <= o.metrics["first_scheduled_time"] < o.metrics["first_token_time"]
               <= o.metrics["finish_time"] for o in got)
    deadline = time.monotonic() + 10  # the core reports its figures after the front's stops reach it
    while core.stats.kv.free_blocks != core.stats.kv.total_blocks or core.stats.num_running:
        assert time.monotonic() < deadline, core.stats
        time.sleep(0.05)


def test_a_bad_request_is_a_value_error_and_the_core_keeps_serving(core):
    with pytest.raises(ValueError, match="out of range"):
        run_async_raising(core, [10_000], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="top_k"):
        run_async_raising(core, [5], SamplingParams(max_tokens=2, top_k=1000))
    [out] = run_async(core, [(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0))])
    assert len(out.outputs[0].token_ids) == 3


def run_async_raising(engine, prompt, params):
    async def main():
        async for _ in engine.generate(prompt, params, "bad"):
            pass

    asyncio.run(main())


def test_a_front_failure_ends_that_request_only(core):
    """A fault in the front's output processing (here: the request's detokenizer) fails that
    request alone; the core never hears of it but as an abort, and serves the others on."""
    real_add = core.output_processor.add_request

    def add_request(request_id, *args):
        real_add(request_id, *args)
        if request_id == "r1":
            def broken(token_ids):
                raise RuntimeError("injected front fault")
            core.output_processor._requests[request_id].samples[0].detokenizer.add_tokens = broken

    core.output_processor.add_request = add_request
    try:
        results = run_async(core, [(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
                                   for p in PROMPTS])
    finally:
        core.output_processor.add_request = real_add
    assert isinstance(results[1], EngineError) and "injected front fault" in str(results[1])
    assert [len(r.outputs[0].token_ids) for i, r in enumerate(results) if i != 1] == [8, 8, 8]
    assert core.is_running
    [again] = run_async(core, [(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))])
    assert len(again.outputs[0].token_ids) == 4


def test_the_core_freezes_its_startup_objects_before_it_reports_ready(tiny, embedded_tokenizer, capfd):
    """Otherwise each oldest-generation collection walks them all mid-serving (heap.py)."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)  # the core process logs at the level the API process has
    try:
        engine = AsyncLLM(config(tiny), tokenizer=embedded_tokenizer, start_timeout=120)
        engine.start()
        engine.shutdown()
    finally:
        root.setLevel(level)
    log = capfd.readouterr().err  # the core process writes to the stderr it inherited
    match = re.search(r"pagedserve\.core: froze (\d+) startup objects", log)
    assert match and int(match.group(1)) > 10_000, log


@pytest.mark.timing
def test_the_core_process_dies_everyone_in_flight_fails_fast_and_a_new_core_serves(tiny, embedded_tokenizer):
    engine = AsyncLLM(config(tiny), tokenizer=embedded_tokenizer, start_timeout=120, restart_backoff=0.5)
    engine.start()
    try:
        async def main():
            async def long(i):
                async for _ in engine.generate(PROMPTS[i], SamplingParams(max_tokens=200, ignore_eos=True), f"r{i}"):
                    pass
            tasks = [asyncio.create_task(long(i)) for i in range(3)]
            while engine.stats.num_running < 3:
                await asyncio.sleep(0.01)
            before = engine.stats
            old_pid = engine.core_pid
            os.kill(old_pid, signal.SIGKILL)
            start = time.monotonic()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return results, time.monotonic() - start, before, old_pid

        results, waited, before, old_pid = asyncio.run(main())
        assert all(isinstance(r, EngineUnavailable) and "killed by signal SIGKILL" in str(r) for r in results), results
        assert waited < 2.0
        assert not process_alive(old_pid)  # reaped, not a zombie
        assert engine.health_problem() is not None  # restarting: /health says 503
        with pytest.raises(EngineUnavailable, match="restarting"):
            run_async_raising(engine, PROMPTS[0], SamplingParams(max_tokens=2))
        deadline = time.monotonic() + 120
        while not engine.is_running:
            assert time.monotonic() < deadline, "the core did not come back"
            time.sleep(0.05)
        assert engine.health_problem() is None and engine.core_pid != old_pid and engine.num_restarts == 1
        # The new core serves, and the figures go on from the old core's: no counter goes back.
        got = run_async(engine, [(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0))])[0]
        assert len(got.outputs[0].token_ids) == 4
        after = engine.stats
        assert after.finished["error"] == before.finished.get("error", 0) + 3
        assert after.num_generation_tokens >= before.num_generation_tokens + 4
        assert after.kv.prefix_queries >= before.kv.prefix_queries + len(PROMPTS[0])
        assert after.num_running == after.num_waiting == 0 and after.kv.free_blocks == after.kv.total_blocks
    finally:
        engine.shutdown()
    assert not engine.client._process.is_alive()


def test_a_core_that_cannot_restart_leaves_the_engine_dead_and_says_so(tiny, embedded_tokenizer, tmp_path):
    engine = AsyncLLM(config(tiny), tokenizer=embedded_tokenizer, start_timeout=120, max_restarts=2,
                      restart_backoff=0.05)
    engine.start()
    reasons = []
    engine.add_dead_hook(reasons.append)
    try:
        engine.client.config = config(tmp_path / "missing")  # every new core fails to load its model
        os.kill(engine.core_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not reasons:
            assert time.monotonic() < deadline, "the engine did not give up"
            time.sleep(0.05)
        assert "killed by signal SIGKILL" in reasons[0] and "2 tries" in reasons[0]
        assert not engine.is_running and "not running" in engine.health_problem()
        with pytest.raises(EngineUnavailable, match="not running"):
            run_async_raising(engine, PROMPTS[0], SamplingParams(max_tokens=2))
    finally:
        engine.shutdown()
    assert not engine.client._process.is_alive()


def test_a_stopped_idle_core_is_found_by_the_probe_killed_and_replaced(tiny, embedded_tokenizer):
    """No request in flight, so no output is awaited: the probe still finds a core that cannot
    answer. SIGSTOP also holds off SIGTERM, so this takes the SIGKILL."""
    engine = AsyncLLM(config(tiny), tokenizer=embedded_tokenizer, start_timeout=120, stall_timeout=0.5,
                      restart_backoff=0.05)
    engine.start()
    try:
        old_pid = engine.core_pid
        time.sleep(1.5)  # idle and probed meanwhile: a core that answers is not stalled
        assert engine.health_problem() is None and engine.num_restarts == 0
        os.kill(old_pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while (problem := engine.health_problem()) is None:
            assert time.monotonic() < deadline, "a stopped core read as healthy"
            time.sleep(0.02)
        assert "stalled" in problem and "restarting" in problem
        deadline = time.monotonic() + 120
        while engine.health_problem() is not None:
            assert time.monotonic() < deadline, "no new core"
            time.sleep(0.05)
        assert engine.num_restarts == 1 and engine.core_pid != old_pid and not process_alive(old_pid)
        got = run_async(engine, [(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))])[0]
        assert len(got.outputs[0].token_ids) == 3
    finally:
        engine.shutdown()


def test_the_core_exits_when_the_api_process_is_killed(tiny, tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from pagedserve.config import EngineConfig
        from pagedserve.engine.async_llm import AsyncLLM
        from pagedserve.models.loader import load_tokenizer
        if __name__ == "__main__":
            engine = AsyncLLM(EngineConfig(model={str(tiny)!r}, num_kv_blocks=64, block_size=4),
                              tokenizer=load_tokenizer(), start_timeout=120)
            engine.start()
            print(engine.core_pid, flush=True)
            time.sleep(600)
    """)
    (tmp_path / "api.py").write_text(script)
    api = subprocess.Popen([sys.executable, str(tmp_path / "api.py")], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(api.stdout.readline())
        assert process_alive(core_pid)
        api.kill()  # SIGKILL: no cleanup code of the API process runs
        api.wait()
        deadline = time.monotonic() + 10
        while process_alive(core_pid):
            assert time.monotonic() < deadline, "the core process outlived the API process"
            time.sleep(0.05)
    finally:
        api.kill()


def process_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone: it has exited, only its parent has not reaped it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
