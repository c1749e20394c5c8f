"""Speculative decoding in the engine, on the real embedded model: greedy outputs are token for token
those without speculation, whatever the drafts (right, half right, junk), the method, the pool
(preemption), the token budget (chunked prefill), the prefix cache, n > 1, stop strings, logprobs
and structured output; seeded sampled requests are reproducible; nothing leaks."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.config import EngineConfig
from pagedserve.core.speculation import Speculation
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

MAX_TOKENS = 24
TEXT = ("The block table maps each request's logical blocks to physical blocks anywhere in the pool, so a "
        "request's memory need not be contiguous and waste is only the unfilled tail of its last block.")
PROMPTS = [
    f"Repeat this sentence exactly, twice.\n{TEXT}\n",
    "The capital of France is",
    f"Summarise: {TEXT}\nSummary: The block table maps",
    "Count: 1, 2, 3, 4, 5, 6, 7, 8,",
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


class ScriptedDrafts:
    """A draft model stand-in: proposes the reference continuation of each request (what the model
    will say), each draft corrupted with probability `noise`, or pure junk with `noise=1`."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], noise: float, seed: int = 0) -> None:
        self.references = references
        self.noise = noise
        self.random = random.Random(seed)

    def propose(self, requests, num_tokens: list[int]) -> list[list[int]]:
        drafts = []
        for request, k in zip(requests, num_tokens):
            full = self.references.get(tuple(request.prompt_token_ids), [])
            n = request.num_tokens
            truth = full[n:n + k] if full[:n] == request.all_token_ids else []
            truth += [self.random.randrange(1000)] * (k - len(truth))
            drafts.append([self.random.randrange(1000) if self.random.random() < self.noise else t for t in truth])
        return drafts


def make_llm(embedded_model, embedded_tokenizer, **overrides) -> LLM:
    settings = dict(num_kv_blocks=256, max_model_len=1024) | overrides
    engine = LLMEngine(EngineConfig(**settings), model=embedded_model, tokenizer=embedded_tokenizer)
    return LLM.from_engine(engine)


def with_scripted_drafts(llm: LLM, references, noise: float, k: int = 4) -> LLM:
    core = llm.llm_engine.core
    core.speculation = Speculation(core.config.speculative_config, ScriptedDrafts(references, noise))
    return llm


def run(llm: LLM, prompts, params: SamplingParams):
    return llm.generate(prompts, params, use_tqdm=False)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_all_free(llm: LLM) -> None:
    stats = llm.llm_engine.kv.stats()
    assert stats.used_blocks == 0 and stats.free_blocks == stats.total_blocks
    assert not llm.llm_engine.scheduler.has_unfinished()


@pytest.fixture(scope="module")
def baseline(embedded_model, embedded_tokenizer):
    """Outputs without speculation, per sampling setting, and the full token sequences to script from."""
    llm = make_llm(embedded_model, embedded_tokenizer)
    cache: dict = {}

    def get(params: SamplingParams, prompts=PROMPTS):
        key = (repr(params), tuple(prompts))
        if key not in cache:
            cache[key] = run(llm, prompts, params)
        return cache[key]

    return get


def references_of(outputs) -> dict[tuple[int, ...], list[int]]:
    return {tuple(o.prompt_token_ids): list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs}


SPEC = {"method": "ngram", "num_speculative_tokens": 4}


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(noise=st.sampled_from([0.0, 0.3, 1.0]), block_size=st.sampled_from([4, 16]),
       small_pool=st.booleans(), chunk=st.sampled_from([None, 24]), prefix_caching=st.booleans(),
       n=st.sampled_from([1, 2]), stop=st.sampled_from([None, ["."]]), logprobs=st.sampled_from([None, 2]))
def test_greedy_outputs_equal_those_without_speculation(embedded_model, embedded_tokenizer, baseline, noise,
                                                        block_size, small_pool, chunk, prefix_caching, n, stop,
                                                        logprobs):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, n=n, stop=stop, logprobs=logprobs)
    expected = baseline(params)
    overrides = dict(block_size=block_size, enable_prefix_caching=prefix_caching, speculative_config=SPEC)
    if small_pool:  # a pool that holds the longest request and little more: preemptions
        overrides |= dict(num_kv_blocks=80 // block_size + 1, max_model_len=80)
    if chunk:
        overrides |= dict(max_num_batched_tokens=chunk)
    llm = with_scripted_drafts(make_llm(embedded_model, embedded_tokenizer, **overrides),
                               references_of(baseline(SamplingParams(max_tokens=MAX_TOKENS, temperature=0))), noise)
    outputs = run(llm, PROMPTS, params)
    assert token_ids(outputs) == token_ids(expected)
    assert [[c.text for c in o.outputs] for o in outputs] == [[c.text for c in o.outputs] for o in expected]
    if logprobs:
        for got, want in zip(outputs, expected):
            for a, b in zip(got.outputs, want.outputs):
                assert [sorted(entry) for entry in a.logprobs] == [sorted(entry) for entry in b.logprobs]
                for x, y in zip(a.logprobs, b.logprobs):
                    for token in x:
                        assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-3)
    counters = llm.llm_engine.core.speculation.counters
    assert counters.num_draft_tokens > 0
    if noise == 0.0:
        assert counters.num_accepted_tokens > counters.num_draft_tokens / 2
    if small_pool:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_all_free(llm)


def test_junk_drafts_cost_nothing_but_time_and_leak_nothing(embedded_model, embedded_tokenizer, baseline):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    llm = with_scripted_drafts(make_llm(embedded_model, embedded_tokenizer, speculative_config=SPEC, block_size=4),
                               {}, noise=1.0)
    assert token_ids(run(llm, PROMPTS, params)) == token_ids(baseline(params))
    counters = llm.llm_engine.core.speculation.counters
    assert counters.num_draft_tokens > 0 and counters.num_accepted_tokens < counters.num_draft_tokens / 10
    assert_all_free(llm)
    # The prefix cache holds known tokens only: the same prompts again hit it and say the same.
    again = run(llm, PROMPTS, params)
    assert token_ids(again) == token_ids(baseline(params))
    assert sum(o.num_cached_tokens for o in again) > 0


def test_structured_output_with_drafts_the_grammar_cuts(embedded_model, embedded_tokenizer, baseline):
    params = SamplingParams(max_tokens=48, temperature=0,
                            structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)))
    prompts = ["Give me a person as JSON: ", "A JSON object for Ada Lovelace, 36 years old: "]
    expected = baseline(params, prompts)
    references = references_of(expected)
    llm = with_scripted_drafts(make_llm(embedded_model, embedded_tokenizer, speculative_config=SPEC),
                               references, noise=0.4)  # drafts the grammar refuses too: it cuts them
    outputs = run(llm, prompts, params)
    assert token_ids(outputs) == token_ids(expected)
    for o in outputs:
        json.loads(o.outputs[0].text)
    counters = llm.llm_engine.core.speculation.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert_all_free(llm)


def test_seeded_sampled_requests_are_reproducible(embedded_model, embedded_tokenizer, baseline):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=7, n=2)
    references = references_of(baseline(SamplingParams(max_tokens=MAX_TOKENS, temperature=0)))
    results = []
    for _ in range(2):
        llm = with_scripted_drafts(make_llm(embedded_model, embedded_tokenizer, speculative_config=SPEC),
                                   references, noise=0.2)
        results.append(token_ids(run(llm, PROMPTS[:2], params)))
        assert llm.llm_engine.core.speculation.counters.num_accepted_tokens > 0
        assert_all_free(llm)
    assert results[0] == results[1]
    assert all(len(ids) == MAX_TOKENS or ids for outs in results[0] for ids in outs)


def test_metrics_count_drafts_and_acceptance_per_position(embedded_model, embedded_tokenizer, baseline):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    references = references_of(baseline(params))
    llm = with_scripted_drafts(make_llm(embedded_model, embedded_tokenizer, speculative_config=SPEC), references,
                               noise=0.0)
    run(llm, PROMPTS, params)
    metrics = llm.get_metrics()
    per_position = metrics["spec_accepted_per_position"]
    assert metrics["spec_num_accepted_tokens"] == sum(per_position) > 0
    assert metrics["spec_num_draft_tokens"] >= metrics["spec_num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_position, per_position[1:]))  # position j needs j - 1 accepted
    assert per_position[0] <= metrics["spec_num_drafts"]


@pytest.mark.parametrize("method", [{"method": "ngram", "num_speculative_tokens": 4},
                                    {"method": "suffix", "num_speculative_tokens": 6}])
def test_each_proposer_gives_the_same_greedy_output(embedded_model, embedded_tokenizer, baseline, method):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    llm = make_llm(embedded_model, embedded_tokenizer, speculative_config=method, block_size=8,
                   max_num_batched_tokens=32)
    for _ in range(2):  # suffix: the second round drafts from the first round's outputs too
        assert token_ids(run(llm, PROMPTS, params)) == token_ids(baseline(params))
    counters = llm.llm_engine.core.speculation.counters
    assert counters.num_accepted_tokens > 0
    assert_all_free(llm)


def test_one_request_and_its_drafts_fit_the_decode_replay(embedded_model, embedded_tokenizer):
    """A speculative step is a decode step of 1 + k rows: the CPU replay is recorded that large even when
    only one request runs at a time."""
    llm = make_llm(embedded_model, embedded_tokenizer, max_num_seqs=1, speculative_config=SPEC)
    runner = llm.llm_engine.core.executor.runner
    assert llm.fast_paths()["decode_replay"] is None
    assert runner.decode_graphs.size == runner.max_decode_rows == 1 + SPEC["num_speculative_tokens"]
