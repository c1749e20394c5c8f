"""AsyncLLM with its core on a thread: requests joining at any time, aborts, faults and idling."""

import asyncio
import threading
import time

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.protocol import EngineError
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def fibonacci(n):",
           "The best way to learn a language is", "Water boils at"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(embedded_model, embedded_tokenizer):
    return LLMEngine(EngineConfig(num_kv_blocks=128, max_model_len=1024), model=embedded_model,
                     tokenizer=embedded_tokenizer)


@pytest.fixture(scope="module")
def reference(embedded_model, embedded_tokenizer):
    """Each prompt's greedy tokens from the offline API (one batch: the engine's outputs do not
    depend on the batch, tests/engine/test_llm_engine.py holds that)."""
    llm = LLM.from_engine(LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=1024), model=embedded_model,
                                    tokenizer=embedded_tokenizer))
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outputs)}


@pytest.fixture
def async_engine(engine):
    ae = AsyncLLM.from_llm_engine(engine)
    ae.start()
    yield ae
    ae.shutdown()
    assert not engine.core.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks  # nothing leaks, whatever the test did


async def collect(ae, prompt, params=GREEDY, request_id=None):
    outputs = [o async for o in ae.generate(prompt, params, request_id or prompt)]
    return outputs


async def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_concurrent_requests_match_the_offline_api(async_engine, reference):
    async def main():
        # Staggered arrivals: later requests join a batch that is already running.
        async def delayed(i, prompt):
            await asyncio.sleep(0.05 * i)
            return await collect(async_engine, prompt)

        return await asyncio.gather(*(delayed(i, p) for i, p in enumerate(PROMPTS)))

    results = asyncio.run(main())
    for prompt, outputs in zip(PROMPTS, results):
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        assert outputs[-1].outputs[0].token_ids == reference[prompt]
        texts = [o.outputs[0].text for o in outputs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, never retracted
    stats = async_engine.stats
    assert (stats.num_running, stats.num_waiting, stats.kv.used_blocks) == (0, 0, 0)
    assert stats.finished == {"length": len(PROMPTS)}
    assert stats.num_generation_tokens == len(PROMPTS) * GREEDY.max_tokens


def test_requests_join_the_running_batch(async_engine, engine):
    """A request that arrives mid-generation is served in the same steps as the running one."""
    steps_with_both = 0
    real_step = engine.core.step

    def step():
        nonlocal steps_with_both
        steps_with_both += len(engine.scheduler.running) == 2
        return real_step()

    engine.core.step = step
    try:
        async def main():
            long = asyncio.ensure_future(collect(async_engine, PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True)))
            await wait_until(lambda: async_engine.stats.num_generation_tokens >= 3)
            await collect(async_engine, PROMPTS[1])
            assert not long.done()
            await long

        asyncio.run(main())
    finally:
        del engine.core.step
    assert steps_with_both >= GREEDY.max_tokens - 1


def test_cancelling_or_leaving_early_aborts_the_request(async_engine, engine):
    params = SamplingParams(max_tokens=500, ignore_eos=True)

    async def main():
        task = asyncio.ensure_future(collect(async_engine, PROMPTS[0], params))
        await wait_until(lambda: async_engine.stats.kv.used_blocks > 0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_until(lambda: async_engine.stats.kv.used_blocks == 0)

        gen = async_engine.generate(PROMPTS[1], params, "left-early")
        first = await anext(gen)
        assert not first.finished
        await gen.aclose()
        await wait_until(lambda: async_engine.stats.finished.get("abort") == 2)

    asyncio.run(main())
    assert not engine.core.has_unfinished_requests()
    assert async_engine.stats.kv.used_blocks == 0


@pytest.mark.slow
def test_a_refused_request_raises_and_the_others_carry_on(async_engine, reference):
    async def main():
        good = asyncio.ensure_future(collect(async_engine, PROMPTS[2]))
        with pytest.raises(ValueError, match="empty"):
            await collect(async_engine, [], request_id="empty")
        with pytest.raises(ValueError, match="out of range"):
            await collect(async_engine, [10**7], request_id="oov")
        # A duplicate id is refused without touching the request that holds it.
        dup = async_engine.generate(PROMPTS[3], SamplingParams(max_tokens=50, ignore_eos=True), "dup")
        await anext(dup)
        with pytest.raises(ValueError, match="already in use"):
            await collect(async_engine, PROMPTS[4], request_id="dup")
        rest = [o async for o in dup]
        assert rest[-1].finished and len(rest[-1].outputs[0].token_ids) == 50
        return await good

    outputs = asyncio.run(main())
    assert outputs[-1].outputs[0].token_ids == reference[PROMPTS[2]]


def run_with_faulty(engine, async_engine, name, fail_on, prompts):
    """Run `prompts` concurrently while `engine.<name>` raises on the calls `fail_on(call)` picks."""
    real = getattr(engine, name)
    calls = 0

    def faulty(*args):
        nonlocal calls
        calls += 1
        if fail_on(calls):
            raise RuntimeError("injected fault")
        return real(*args)

    setattr(engine, name, faulty)
    try:
        async def main():
            return await asyncio.gather(*(collect(async_engine, p) for p in prompts), return_exceptions=True)

        return asyncio.run(main())
    finally:
        setattr(engine, name, real)


def test_a_transient_fault_is_retried_and_nobody_notices(async_engine, engine, reference):
    results = run_with_faulty(engine.core, async_engine, "sampler", lambda call: call == 3, PROMPTS[:3])
    assert [r[-1].outputs[0].token_ids for r in results] == [reference[p] for p in PROMPTS[:3]]
    assert async_engine.stats.finished == {"length": 3}


def test_a_fault_that_no_request_causes_alone_fails_them_all_and_the_loop_carries_on(async_engine, engine,
                                                                                       reference):
    results = run_with_faulty(engine.core, async_engine, "sampler", lambda call: True, PROMPTS[:3])
    assert all(isinstance(r, EngineError) and "injected fault" in str(r) for r in results)
    assert async_engine.stats.finished == {"error": 3}
    assert async_engine.stats.kv.used_blocks == 0  # their blocks were freed
    assert async_engine.is_running
    outputs = asyncio.run(collect(async_engine, PROMPTS[0]))
    assert outputs[-1].outputs[0].token_ids == reference[PROMPTS[0]]


def test_a_fault_outside_the_step_fails_the_requests_in_flight(async_engine, engine, reference):
    # The scheduler itself failing: the engine cannot contain it, the async loop fails everyone.
    results = run_with_faulty(engine.scheduler, async_engine, "schedule", lambda call: call == 3, PROMPTS[:3])
    assert all(isinstance(r, EngineError) and "injected fault" in str(r) for r in results)
    assert async_engine.stats.finished == {"error": 3}
    assert async_engine.stats.kv.used_blocks == 0
    outputs = asyncio.run(collect(async_engine, PROMPTS[1]))
    assert outputs[-1].outputs[0].token_ids == reference[PROMPTS[1]]


def test_the_loop_sleeps_while_idle_and_wakes_for_a_request(async_engine, engine):
    calls = 0
    real_step = engine.core.step

    def counting_step():
        nonlocal calls
        calls += 1
        return real_step()

    engine.core.step = counting_step
    try:
        time.sleep(0.3)
        assert calls == 0  # no busy spin
        thread = next(t for t in threading.enumerate() if t.name == "pagedserve-engine")
        assert thread.is_alive()
        outputs = asyncio.run(collect(async_engine, PROMPTS[1]))
        assert outputs[-1].finished
        steps = calls
        assert steps >= GREEDY.max_tokens
        time.sleep(0.3)
        assert calls == steps
    finally:
        del engine.core.step


def test_shutdown_fails_what_is_in_flight(engine):
    ae = AsyncLLM.from_llm_engine(engine)
    ae.start()

    async def main():
        gen = ae.generate(PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True), "long")
        await anext(gen)
        await asyncio.get_running_loop().run_in_executor(None, ae.shutdown)
        with pytest.raises(EngineError, match="shut down"):
            async for _ in gen:
                pass
        with pytest.raises(EngineError, match="shut down"):
            await collect(ae, PROMPTS[1])

    asyncio.run(main())
    assert not ae.is_running
    assert not engine.core.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_finish_hooks_see_each_finished_request_once(async_engine):
    seen = []
    async_engine.add_finish_hook(lambda output: seen.append(output.request_id))
    async_engine.add_finish_hook(lambda output: 1 / 0)  # a broken hook is logged, not fatal

    async def main():
        await asyncio.gather(*(collect(async_engine, p, SamplingParams(max_tokens=3, n=2)) for p in PROMPTS[:3]))

    asyncio.run(main())
    assert sorted(seen) == sorted(PROMPTS[:3])
    assert sum(async_engine.stats.finished.values()) == 6  # counted per sample
