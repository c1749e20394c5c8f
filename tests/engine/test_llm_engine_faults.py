"""A fault stays with the request that caused it: a step that raises is retried, bisected down to
the request at fault, undone, and only that request ends (finish_reason "error"); the others get
exactly the tokens they get without it, the prefix cache keeps nothing the failed step was to
write, and every block is free afterwards. A device error is the exception: it ends the engine."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.config import EngineConfig
from pagedserve.core.engine_core import find_culprits, is_device_error
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.executor.base import ExecutorFailed
from pagedserve.sampling_params import SamplingParams
from tests.engine.fault_injection import forward_fails_for

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def fibonacci(n):",
           "The best way to learn a language is", "Water boils at", "My favourite colour is", "Dear Sir,"]
# Innocent neighbours: greedy, and seeded sampling (its draws must be replayed exactly after a fault).
INNOCENT = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True) if i % 2 else
            SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
            for i in range(len(PROMPTS))]


def make_llm(embedded_model, embedded_tokenizer, **overrides) -> LLM:
    config = EngineConfig(**(dict(num_kv_blocks=256, max_model_len=1024) | overrides))
    return LLM.from_engine(LLMEngine(config, model=embedded_model, tokenizer=embedded_tokenizer))


def assert_all_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def texts(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def alone(embedded_model, embedded_tokenizer) -> list[list[int]]:
    """The innocents' tokens with no faulty request beside them."""
    return texts(make_llm(embedded_model, embedded_tokenizer).generate(PROMPTS, INNOCENT, use_tqdm=False))


# ---- finding the culprits ----------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 64), data=st.data())
def test_bisection_finds_exactly_the_rows_that_fail_alone(n, data):
    culprits = data.draw(st.sets(st.integers(0, n - 1), min_size=1))
    probes = []

    def fails(rows):
        probes.append(rows)
        bad = [r for r in rows if r in culprits]
        return ValueError(bad[0]) if bad else None

    found = find_culprits(list(range(n)), ValueError(min(culprits)), fails)
    assert set(found) == culprits
    assert all(str(e) == str(r) for r, e in found.items())  # each with its own error
    assert len(probes) <= 2 * len(culprits) * max(1, (n - 1).bit_length())


@given(n=st.integers(2, 64), data=st.data())
def test_rows_that_fail_only_together_are_blamed_together(n, data):
    a, b = data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
    found = find_culprits(list(range(n)), RuntimeError("both"),
                          lambda rows: RuntimeError("both") if a in rows and b in rows else None)
    assert {a, b} <= set(found)
    assert sorted(found) == list(range(min(found), max(found) + 1))  # the smallest part holding both


# ---- telling device errors from host faults ----------------------------------------------------

ILLEGAL_ACCESS = ("CUDA error: an illegal memory access was encountered\n"
                  "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
                  "below might be incorrect.")
# How torch reports a failed CUDA call: AcceleratorError in recent versions, RuntimeError before.
DEVICE_ERRORS = {
    "accelerator-error": lambda: torch.AcceleratorError(ILLEGAL_ACCESS),
    "device-assert": lambda: torch.AcceleratorError("CUDA error: device-side assert triggered"),
    "runtime-error": lambda: RuntimeError(ILLEGAL_ACCESS),
    "triton": lambda: RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"),
}


@pytest.mark.parametrize("make", DEVICE_ERRORS.values(), ids=DEVICE_ERRORS.keys())
def test_errors_of_the_device_are_device_errors(make):
    assert is_device_error(make())


@pytest.mark.parametrize("error", [
    RuntimeError("injected fault in the forward pass"),
    RuntimeError("Overflow when unpacking long long"),  # a sampling parameter out of range
    ValueError("CUDA error"),  # not an error torch raises for a device
    IndexError("index 49153 is out of bounds for dimension 0 with size 49152"),
    UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),  # the detokenizer
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),  # the device stays usable
], ids=["runtime", "overflow", "value", "index", "unicode", "out-of-memory"])
def test_host_faults_are_not_device_errors(error):
    assert not is_device_error(error)


# ---- the engine --------------------------------------------------------------------------------


def unvalidated(**fields) -> SamplingParams:
    """Params holding values validation refuses (as a bug elsewhere might let through)."""
    params = SamplingParams(max_tokens=12, temperature=0.7, ignore_eos=True)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize("bad", [
    unvalidated(top_k=2**63),  # torch.tensor: "Overflow when unpacking long long"
    unvalidated(temperature=0.0, logprobs=-5),  # topk with a negative k
    unvalidated(n=1, min_tokens=3, stop_token_ids=[10**12]),  # index_put out of the vocabulary
], ids=["top_k", "logprobs", "stop_token_ids"])
def test_a_request_that_breaks_sampling_fails_alone(embedded_model, embedded_tokenizer, alone, bad):
    llm = make_llm(embedded_model, embedded_tokenizer)
    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(zip(PROMPTS, INNOCENT)):
        engine.add_request(f"ok{i}", prompt, params)
        if i == 3:
            engine.add_request("bad", "Tell me a story", SamplingParams(max_tokens=2))
            engine.core._groups["bad"][0].sampling_params = bad  # past add_request's validation
    finished = run(engine)
    assert finished["bad"].outputs[0].finish_reason == "error" and finished["bad"].error
    assert [finished[f"ok{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == alone
    assert all(finished[f"ok{i}"].error is None for i in range(len(PROMPTS)))
    assert_all_free(engine)


def run(engine: LLMEngine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finished
                finished[output.request_id] = output
    return finished


def test_the_offline_api_returns_the_failed_request_with_its_error(embedded_model, embedded_tokenizer, alone):
    llm = make_llm(embedded_model, embedded_tokenizer)
    poison = embedded_tokenizer.encode(" zebra")[0]
    bad = {"prompt_token_ids": embedded_tokenizer.encode("Tell me about the") + [poison]}
    with forward_fails_for(embedded_model[0], poison) as injected:
        outputs = llm.generate(PROMPTS[:4] + [bad] + PROMPTS[4:], INNOCENT[:4] + [INNOCENT[1]] + INNOCENT[4:],
                               use_tqdm=False)
    assert injected.raised > 2  # the step, its retry, then the parts of the bisection that hold it
    assert outputs[4].outputs[0].finish_reason == "error" and "injected fault" in outputs[4].error
    assert texts(outputs[:4] + outputs[5:]) == alone
    assert_all_free(llm.llm_engine)


def test_parallel_samples_of_a_failing_request_end_together(embedded_model, embedded_tokenizer, alone):
    llm = make_llm(embedded_model, embedded_tokenizer)
    engine = llm.llm_engine
    engine.add_request("ok", PROMPTS[1], INNOCENT[1])
    engine.add_request("bad", PROMPTS[2], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=1))
    for _ in range(3):  # the samples have forked and run
        engine.step()
    engine.core._groups["bad"][2].sampling_params = unvalidated(top_k=2**63)
    finished = run(engine)
    assert [o.finish_reason for o in finished["bad"].outputs] == ["error"] * 3
    assert finished["ok"].outputs[0].token_ids == alone[1]
    assert_all_free(engine)


def test_a_failed_forward_leaves_nothing_in_the_prefix_cache(embedded_model, embedded_tokenizer, alone):
    model, tokenizer = embedded_model[0], embedded_tokenizer
    llm = make_llm(embedded_model, embedded_tokenizer)
    engine = llm.llm_engine
    # Five full blocks, then the token that trips the fault: the blocks are hashed when the step is
    # planned, and layers 0-9 of them written before the fault.
    prompt = tokenizer.encode("Paged attention stores keys and values in fixed-size blocks. " * 8)[:80]
    poison = tokenizer.encode(" zebra")[0]
    assert poison not in prompt and all(poison not in tokenizer.encode(p) for p in PROMPTS)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with forward_fails_for(model, poison):
        for i, (p, params) in enumerate(zip(PROMPTS, INNOCENT)):
            engine.add_request(f"ok{i}", p, params)
        engine.add_request("bad", prompt + [poison], greedy)
        finished = run(engine)
    assert "injected fault" in finished["bad"].error
    assert [finished[f"ok{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == alone
    assert_all_free(engine)
    # The same prompt again, fault gone: it must compute those blocks, not hit them.
    again = llm.generate([{"prompt_token_ids": prompt + [poison]}], greedy, use_tqdm=False)[0]
    fresh = make_llm(embedded_model, embedded_tokenizer).generate(
        [{"prompt_token_ids": prompt + [poison]}], greedy, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert again.num_cached_tokens == 0


def test_a_request_whose_token_handling_fails_ends_alone(embedded_model, embedded_tokenizer, alone):
    llm = make_llm(embedded_model, embedded_tokenizer)
    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(zip(PROMPTS, INNOCENT)):
        engine.add_request(f"ok{i}", prompt, params)
    engine.add_request("bad", "Hello", SamplingParams(max_tokens=8, temperature=0.0))

    def broken(token_ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    engine.output_processor._requests["bad"].samples[0].detokenizer.add_tokens = broken  # a front-side fault
    finished = run(engine)
    assert finished["bad"].outputs[0].finish_reason == "error" and "injected" in finished["bad"].error
    assert [finished[f"ok{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == alone
    assert_all_free(engine)


def test_an_interrupted_step_is_undone_and_poisons_nothing(embedded_model, embedded_tokenizer, alone):
    """Ctrl-C during a forward pass that had written half its layers: the step is taken back, so
    the engine can go on (the requests recompute and give their tokens) and no block it was to
    fill is findable in the prefix cache."""
    llm = make_llm(embedded_model, embedded_tokenizer)
    engine = llm.llm_engine
    prompt = embedded_tokenizer.encode("Paged attention stores keys and values in fixed-size blocks. " * 8)[:80]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    model, real = engine.runner.model, engine.runner.model.forward
    calls = 0

    def forward(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:  # the first step's forward is interrupted after 10 layers wrote their K/V
            handle = model.model.layers[10].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
            try:
                return real(*args, **kwargs)
            finally:
                handle.remove()
        return real(*args, **kwargs)

    model.forward = forward
    try:
        engine.add_request("p", prompt, greedy)
        for i, (p, params) in enumerate(zip(PROMPTS, INNOCENT)):
            engine.add_request(f"ok{i}", p, params)
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        assert engine.kv.pool.num_cached_free == 0 and not engine.kv.pool.cached  # nothing findable
        finished = run(engine)  # the caller carries on: everyone recomputes
    finally:
        del model.forward
    assert [finished[f"ok{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == alone
    fresh = make_llm(embedded_model, embedded_tokenizer).generate([{"prompt_token_ids": prompt}], greedy,
                                                                  use_tqdm=False)[0]
    assert finished["p"].outputs[0].token_ids == fresh.outputs[0].token_ids
    assert_all_free(engine)


@pytest.mark.parametrize("make", [DEVICE_ERRORS["accelerator-error"], DEVICE_ERRORS["runtime-error"]],
                         ids=["accelerator-error", "runtime-error"])
def test_a_device_error_ends_the_engine_instead_of_failing_one_request(embedded_model, embedded_tokenizer, make):
    """After an illegal memory access every CUDA call fails: the step is neither run again nor
    bisected, the caller gets ExecutorFailed (as when a worker dies), and so does every later step."""
    llm = make_llm(embedded_model, embedded_tokenizer)
    poison = embedded_tokenizer.encode(" zebra")[0]
    bad = {"prompt_token_ids": embedded_tokenizer.encode("Tell me about the") + [poison]}
    with forward_fails_for(embedded_model[0], poison, error=make) as injected:
        with pytest.raises(ExecutorFailed, match="the device failed .*illegal memory access") as failure:
            llm.generate(PROMPTS[:3] + [bad], INNOCENT[:3] + [INNOCENT[1]], use_tqdm=False)
    assert injected.raised == 1
    assert type(failure.value.__cause__) is type(make())
    with pytest.raises(ExecutorFailed, match="illegal memory access"):  # the engine stays failed
        llm.generate(PROMPTS[:1], INNOCENT[:1], use_tqdm=False)
    with pytest.raises(ExecutorFailed, match="illegal memory access"):  # and its health says so
        llm.llm_engine.core.check_health()
