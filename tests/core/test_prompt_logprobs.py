"""Prompt logprobs (SamplingParams.prompt_logprobs), computed by the engine core on the real embedded
model: equal to transformers' log_softmax over the same prompt whatever the chunking, the batch, the
prefix cache (such a request bypasses it), preemption or n; only the requests that ask pay for the
extra logits."""

from __future__ import annotations

import pytest
import torch

from pagedserve.sampling_params import SamplingParams
from tests.engine.test_llm_engine import assert_all_free, make_llm, prompts  # noqa: F401

pytestmark = pytest.mark.slow  # long prompts scored on the real model, and by transformers

TOL = 1e-3  # as test_llm_engine's check of sampled logprobs


@pytest.fixture(scope="module")
def reference(embedded_hf_model, prompts):
    """transformers' log_softmax of each prompt's logits: row p scores the token at p + 1."""
    out = []
    for ids in prompts:
        with torch.no_grad():
            out.append(torch.log_softmax(embedded_hf_model(torch.tensor([ids])).logits[0].float(), dim=-1))
    return out


def assert_matches(prompt_logprobs, prompt, ref, k):
    """vLLM's shape (None, then one dict per later prompt token: the prompt token first with its
    rank, then the top k ranked from 1), with transformers' values."""
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[p], ref[p - 1], prompt[p]
        assert next(iter(entry)) == token
        own = entry[token]
        assert own.logprob == pytest.approx(row[token].item(), abs=TOL)
        # Its rank: how many tokens are more likely, up to near-ties with the reference.
        assert int((row > own.logprob + TOL).sum()) + 1 <= own.rank <= int((row > own.logprob - TOL).sum()) + 1
        ranked = {lp.rank: (t, lp) for t, lp in entry.items() if lp.rank <= k}
        assert sorted(ranked) == list(range(1, k + 1)) and len(entry) in (k, k + 1)
        best = row.topk(k).values
        for rank, (t, lp) in ranked.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=TOL)
            assert lp.logprob == pytest.approx(best[rank - 1].item(), abs=TOL)  # the reference's top k, in order
            assert lp.decoded_token is not None


@pytest.fixture
def logit_rows(embedded_model, monkeypatch):
    """Counts the rows that go through the LM head (the model is shared: patched for this test only)."""
    model = embedded_model[0]
    real = model.compute_logits
    count = [0]

    def compute_logits(hidden):
        count[0] += hidden.shape[0]
        return real(hidden)

    monkeypatch.setattr(model, "compute_logits", compute_logits)
    return count


def test_chunked_and_batched_with_requests_that_do_not_ask(embedded_model, embedded_tokenizer, prompts, reference,
                                                           logit_rows):
    llm = make_llm(embedded_model, embedded_tokenizer, max_num_batched_tokens=16)
    assert min(len(p) for p in prompts) > 16  # every prompt is prefilled over several steps
    asks = {0: 0, 3: 2, 5: 5, 6: 1}  # prompt index -> prompt_logprobs; the others do not ask
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=asks.get(i))
              for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, out in enumerate(outputs):
        if i in asks:
            assert_matches(out.prompt_logprobs, prompts[i], reference[i], asks[i])
        else:
            assert out.prompt_logprobs is None
    # Only the requests that ask pay: one row per sampled token, plus one per scored prompt position.
    assert logit_rows[0] == 4 * len(prompts) + sum(len(prompts[i]) - 1 for i in asks)
    # Scoring leaves sampling alone.
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outputs]
    assert_all_free(llm)


def test_a_request_with_prompt_logprobs_bypasses_the_prefix_cache(embedded_model, embedded_tokenizer, prompts,
                                                                  reference):
    llm = make_llm(embedded_model, embedded_tokenizer, enable_prefix_caching=True)
    prompt = [{"prompt_token_ids": prompts[3]}]
    plain = SamplingParams(max_tokens=2, temperature=0)
    scored = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    llm.generate(prompt, plain, use_tqdm=False)  # the prompt's full blocks are now cached
    assert llm.generate(prompt, plain, use_tqdm=False)[0].num_cached_tokens > 0
    first = llm.generate(prompt, scored, use_tqdm=False)[0]
    second = llm.generate(prompt, scored, use_tqdm=False)[0]
    # Bypassed: computed in full both times (the cached positions would have no logits), same values.
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    assert_matches(first.prompt_logprobs, prompts[3], reference[3], 3)
    assert first.prompt_logprobs == second.prompt_logprobs
    # The cache still serves the requests that do not ask.
    assert llm.generate(prompt, plain, use_tqdm=False)[0].num_cached_tokens > 0
    assert_all_free(llm)


def test_preemption_mid_prompt_neither_duplicates_nor_loses_entries(embedded_model, embedded_tokenizer, prompts,
                                                                    reference, monkeypatch):
    longest = max(len(p) for p in prompts) + 24
    llm = make_llm(embedded_model, embedded_tokenizer, num_kv_blocks=-(-longest // 16) + 2,
                   max_model_len=longest + 16, max_num_batched_tokens=24)
    scheduler = llm.llm_engine.scheduler
    partly_scored = []  # how far each preempted request's prompt was scored
    real = scheduler._preempt

    def preempt(request):
        if request.prompt_logprobs is not None:
            partly_scored.append(len(request.prompt_logprobs))
        real(request)

    monkeypatch.setattr(scheduler, "_preempt", preempt)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert any(n > 0 for n in partly_scored)  # preempted with part of its prompt scored, then recomputed
    for out, prompt, ref in zip(outputs, prompts, reference):
        assert_matches(out.prompt_logprobs, prompt, ref, 2)
    assert_all_free(llm)


def test_parallel_samples_share_one_scoring_of_the_prompt(embedded_model, embedded_tokenizer, prompts, reference,
                                                          logit_rows):
    llm = make_llm(embedded_model, embedded_tokenizer)
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=5, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)[0]
    assert [len(o.token_ids) for o in out.outputs] == [4, 4, 4]
    assert_matches(out.prompt_logprobs, prompts[1], reference[1], 1)
    assert logit_rows[0] == 3 * 4 + len(prompts[1]) - 1  # the prompt's positions once, not per sample
    assert_all_free(llm)


def test_a_one_token_prompt_has_only_the_leading_none(embedded_model, embedded_tokenizer):
    llm = make_llm(embedded_model, embedded_tokenizer)
    out = llm.generate([{"prompt_token_ids": [42]}], SamplingParams(max_tokens=1, prompt_logprobs=4), use_tqdm=False)
    assert out[0].prompt_logprobs == [None]


def test_prompt_logprobs_beyond_the_vocabulary_are_refused(embedded_model, embedded_tokenizer):
    llm = make_llm(embedded_model, embedded_tokenizer)
    with pytest.raises(ValueError, match="prompt_logprobs must be <= the vocabulary size"):
        llm.generate(["hi"], SamplingParams(prompt_logprobs=10**6), use_tqdm=False)
    assert_all_free(llm)
