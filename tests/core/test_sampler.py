import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.core.sampler import Sampler, SamplingBatch, TokenCounts, apply_penalties, exponential_noise_
from pagedserve.sampling_params import SamplingParams

EOS = 2


def build(params, prompts=None, outputs=None, generators=None, eos=(EOS,)):
    n = len(params)
    return SamplingBatch.build(
        params, prompts or [[] for _ in range(n)], outputs or [[] for _ in range(n)],
        generators or [None] * n, eos, "cpu",
    )


def sample(logits, params, sampler=None, **kw):
    return (sampler or Sampler(seed=0))(logits, build(params, **kw))


def rand_logits(rows, vocab, seed=0, scale=3.0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def reference_probs(logits_row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Straightforward per-token version of the filter chain (vLLM order: min-p, top-k, top-p)."""
    probs = torch.softmax(logits_row.double() / temperature, -1).tolist()
    keep = set(range(len(probs)))
    if min_p > 0:
        keep = {i for i in keep if probs[i] >= min_p * max(probs)}
    order = sorted(keep, key=lambda i: -probs[i])
    if top_k > 0:
        order = order[:top_k]
    if top_p < 1:
        total, kept = sum(probs[i] for i in order), []
        for i in order:  # most likely first, until the kept mass reaches top_p
            kept.append(i)
            if sum(probs[j] for j in kept) / total >= top_p:
                break
        order = kept
    mass = sum(probs[i] for i in order)
    return {i: probs[i] / mass for i in order}


def test_greedy_is_argmax_of_logits():
    logits = rand_logits(6, 50)
    out = sample(logits, [SamplingParams(temperature=0)] * 6)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6 and out.ranks == [None] * 6 and out.top_logprobs == [None] * 6


def test_greedy_batch_draws_no_randomness():
    sampler = Sampler(seed=0)
    sample(rand_logits(3, 20), [SamplingParams(temperature=0)] * 3, sampler=sampler)
    assert sampler._generator is None  # never needed a random number


def test_input_logits_untouched():
    logits = rand_logits(2, 30)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.3,
                             presence_penalty=0.5, min_tokens=3, logprobs=2)] * 2
    sample(logits, params, outputs=[[1, 1], [3]], prompts=[[4], [5]])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("seed", range(5))
def test_top_k_1_and_tiny_top_p_are_greedy(seed):
    logits = rand_logits(8, 100, seed=seed, scale=1.0)
    argmax = logits.argmax(-1).tolist()
    assert sample(logits, [SamplingParams(top_k=1)] * 8, Sampler(seed)).token_ids == argmax
    assert sample(logits, [SamplingParams(top_p=1e-6)] * 8, Sampler(seed)).token_ids == argmax
    assert sample(logits, [SamplingParams(top_p=1e-9)] * 8, Sampler(seed)).token_ids == argmax  # 1 - p == 1 in fp32
    assert sample(logits, [SamplingParams(top_k=1, top_p=0.5, temperature=5.0)] * 8, Sampler(seed)).token_ids == argmax


def test_mixed_greedy_and_random_rows():
    logits = rand_logits(6, 40, scale=0.5)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=2.0)] * 3
    outs = [sample(logits, params, Sampler(s)).token_ids for s in range(6)]
    argmax = logits.argmax(-1).tolist()
    for out in outs:
        assert out[0::2] == argmax[0::2]  # greedy rows fixed
    assert len({tuple(o[1::2]) for o in outs}) > 1  # random rows vary with the seed


def test_min_p_support():
    # probs proportional to exp(logits): tokens 0..3 hold 1, e^-1, e^-2, e^-3 of the max
    logits = torch.tensor([[0.0, -1.0, -2.0, -3.0, -10.0]]).repeat(4000, 1)
    out = sample(logits, [SamplingParams(min_p=0.2)] * 4000)
    assert set(out.token_ids) == {0, 1}  # e^-2 = 0.135 < 0.2
    out = sample(logits, [SamplingParams(min_p=0.1)] * 4000)
    assert set(out.token_ids) == {0, 1, 2}


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[1.0, 0.0, -1.0]]).repeat(4000, 1)
    share = {}
    for t in (0.25, 1.0, 4.0):
        ids = torch.tensor(sample(logits, [SamplingParams(temperature=t)] * 4000).token_ids)
        share[t] = (ids == 0).float().mean().item()
        expected = torch.softmax(torch.tensor([1.0, 0.0, -1.0]) / t, -1)[0].item()
        assert abs(share[t] - expected) < 0.03
    assert share[0.25] > share[1.0] > share[4.0]


def chi_square(counts: list[int], probs: dict[int, float]) -> float:
    n = sum(counts)
    return sum((counts[i] - n * p) ** 2 / (n * p) for i, p in probs.items())


# (temperature, top_k, top_p, min_p, chi-square 99.9% critical value for df = kept tokens - 1)
@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (0.9, 6, 0.9, 0.0), (1.0, 0, 1.0, 0.05),
])
def test_sampled_frequencies_follow_filtered_softmax(temperature, top_k, top_p, min_p):
    crit = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}
    row = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.1, -0.3, -0.8, -1.5, -3.0])[torch.randperm(10, generator=torch.Generator().manual_seed(1))]
    n = 20000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    ids = sample(row.repeat(n, 1), [params] * n, Sampler(seed=123)).token_ids
    counts = torch.bincount(torch.tensor(ids), minlength=10).tolist()
    probs = reference_probs(row, temperature, top_k, top_p, min_p)
    assert {i for i, c in enumerate(counts) if c} == set(probs)  # exactly the kept tokens appear
    assert chi_square(counts, probs) < crit[len(probs) - 1]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    temperature=st.floats(0.05, 3.0),
    top_k=st.sampled_from([0, -1, 1, 2, 5, 30]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.0, 0.05, 0.3]),
)
def test_samples_stay_in_reference_support(seed, temperature, top_k, top_p, min_p):
    logits = rand_logits(1, 30, seed=seed, scale=2.0).repeat(300, 1)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    # Cuts a hair looser than asked: float32 and float64 may disagree on a token at the edge.
    allowed = reference_probs(logits[0], temperature, max(top_k, 0), min(1.0, top_p + 1e-4), max(0.0, min_p - 1e-4))
    assert set(sample(logits, [params] * 300, Sampler(seed)).token_ids) <= set(allowed)


def reference_penalties(logits, prompts, outputs, params):
    out = logits.clone()
    for r, p in enumerate(params):
        for tok in set(prompts[r]) | set(outputs[r]):
            x = out[r, tok].item()
            out[r, tok] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for tok in set(outputs[r]):
            out[r, tok] -= p.frequency_penalty * outputs[r].count(tok) + p.presence_penalty
    return out


def test_penalties_match_reference():
    logits = rand_logits(4, 12)
    prompts = [[1, 2, 3], [4, 4, 0], [], [11]]
    outputs = [[3, 3, 5], [], [7, 7, 7, 8], [11, 2]]
    params = [
        SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(frequency_penalty=-0.5, presence_penalty=1.0, temperature=0),
        SamplingParams(repetition_penalty=2.0, frequency_penalty=1.5),
    ]
    got = apply_penalties(logits, build(params, prompts=prompts, outputs=outputs))
    want = reference_penalties(logits, prompts, outputs, params)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    changed = (got != logits).nonzero().tolist()
    assert [2, 9] not in changed and [0, 0] not in changed  # untouched tokens stay untouched


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.zeros(1, 6)
    params = [SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)]
    got = apply_penalties(logits, build(params, prompts=[[0, 1, 1]], outputs=[[2, 2, 3]]))
    assert got.tolist() == [[0.0, 0.0, -2.0, -1.5, 0.0, 0.0]]


def test_no_penalty_work_when_unused():
    batch = build([SamplingParams(), SamplingParams(temperature=0)], outputs=[[1], [2]])
    assert batch.repetition_penalty is None and batch.frequency_penalty is None
    logits = rand_logits(2, 5)
    assert apply_penalties(logits, batch) is logits


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0]])
    assert sample(logits, [SamplingParams(temperature=0)], outputs=[[1]]).token_ids == [1]
    assert sample(logits, [SamplingParams(temperature=0, presence_penalty=0.5)], outputs=[[1]]).token_ids == [2]
    assert sample(logits, [SamplingParams(temperature=0, repetition_penalty=1.1)], prompts=[[1]]).token_ids == [2]


def test_min_tokens_blocks_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0]]).repeat(4, 1)  # eos (2) then 3 then 4
    params = [
        SamplingParams(temperature=0, min_tokens=2),  # 1 output so far: eos blocked
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]),  # eos and 3 blocked
        SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[3]),  # min reached: nothing blocked
        SamplingParams(temperature=0, min_tokens=2, ignore_eos=True),  # eos is no stop token: allowed
    ]
    out = sample(logits, params, outputs=[[1]] * 4)
    assert out.token_ids == [3, 4, 2, 2]
    # random rows too, and with several eos ids
    params = [SamplingParams(min_tokens=5)] * 500
    out = sample(logits[:1].repeat(500, 1), params, eos={2, 3})
    assert set(out.token_ids) == {0, 1, 4}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_raw_log_softmax(temperature):
    logits = rand_logits(4, 64)
    params = [
        SamplingParams(temperature=temperature, logprobs=5, repetition_penalty=1.7, presence_penalty=1.0),
        SamplingParams(temperature=temperature),
        SamplingParams(temperature=temperature, logprobs=0, top_k=3),
        SamplingParams(temperature=temperature, logprobs=2, min_tokens=3),
    ]
    out = sample(logits, params, outputs=[[int(logits[0].argmax())], [], [], []])
    lp = torch.log_softmax(logits, -1)
    for r, p in enumerate(params):
        if p.logprobs is None:
            assert out.logprobs[r] is None and out.ranks[r] is None and out.top_logprobs[r] is None
            continue
        tok = out.token_ids[r]
        assert out.logprobs[r] == pytest.approx(lp[r, tok].item(), abs=1e-6)
        assert out.ranks[r] == 1 + int((lp[r] > lp[r, tok]).sum())
        top = torch.topk(lp[r], p.logprobs)
        assert [t for t, _ in out.top_logprobs[r]] == top.indices.tolist()
        assert [v for _, v in out.top_logprobs[r]] == pytest.approx(top.values.tolist(), abs=1e-6)
    if temperature == 0:
        assert out.ranks[0] > 1  # the penalty moved greedy off the raw argmax; logprobs stayed raw


def seeded_run(seed, steps, others, where, vocab=200):
    """Tokens of one seeded row over `steps` steps, batched with `others` rows at index `where`."""
    gen = torch.Generator().manual_seed(seed)
    mine = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=seed)
    sampler = Sampler(seed=seed + 1000)
    tokens = []
    for step in range(steps):
        logits = rand_logits(1 + others, vocab, seed=step, scale=1.0)
        own = rand_logits(1, vocab, seed=10_000 + step, scale=1.0)  # this row's logits, batch-independent
        logits[where] = own[0]
        params = [SamplingParams(temperature=0.5 + 0.1 * i, min_p=0.01 * (i % 3), seed=(7 * i if i % 2 else None),
                                 frequency_penalty=0.1 * (i % 2)) if i % 4 != 3 else SamplingParams(temperature=0)
                  for i in range(1 + others)]
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        params[where], gens[where] = mine, gen
        outputs = [[1, 2, 3]] * (1 + others)
        outputs[where] = tokens
        tokens.append(sampler(logits, build(params, outputs=outputs, generators=gens)).token_ids[where])
    return tokens


def test_exponential_noise_is_exp_1_finite_and_positive(monkeypatch):
    q = exponential_noise_(torch.empty(1000, 1000), torch.Generator().manual_seed(0))
    assert bool(torch.isfinite(q).all()) and bool((q > 0).all())
    # Exp(1): mean 1, P(q > x) = exp(-x). With a million draws each figure is within 5 standard errors.
    assert abs(q.double().mean().item() - 1) < 5e-3
    for x in (0.1, 1.0, 3.0, 6.0):
        expected = math.exp(-x)
        assert abs((q > x).double().mean().item() - expected) < 5 * math.sqrt(expected * (1 - expected) / 1e6)
    again = exponential_noise_(torch.empty(1000, 1000), torch.Generator().manual_seed(0))
    assert torch.equal(q, again)
    # A uniform draw of exactly 0 (one in 2**24 in float32) would be infinite noise: the floor keeps it finite.
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, generator=None: self.zero_())
    assert exponential_noise_(torch.empty(3), None).tolist() == [pytest.approx(-math.log(2.0**-126))] * 3


def test_seeded_row_independent_of_batch():
    alone = seeded_run(seed=42, steps=25, others=0, where=0)
    assert seeded_run(seed=42, steps=25, others=5, where=0) == alone
    assert seeded_run(seed=42, steps=25, others=5, where=3) == alone
    assert seeded_run(seed=42, steps=25, others=8, where=8) == alone
    assert seeded_run(seed=43, steps=25, others=0, where=0) != alone


def test_unseeded_rows_reproducible_with_sampler_seed():
    logits = rand_logits(16, 100, scale=1.0)
    params = [SamplingParams()] * 16
    assert sample(logits, params, Sampler(5)).token_ids == sample(logits, params, Sampler(5)).token_ids
    assert sample(logits, params, Sampler(5)).token_ids != sample(logits, params, Sampler(6)).token_ids


def test_top_k_larger_than_vocab_and_ties():
    logits = torch.tensor([[1.0, 1.0, 0.0, -math.inf]]).repeat(2000, 1)
    assert set(sample(logits, [SamplingParams(top_k=1)] * 2000).token_ids) == {0, 1}  # ties at the k-th stay
    assert set(sample(logits, [SamplingParams(top_k=100)] * 2000).token_ids) == {0, 1, 2}
    assert set(sample(logits, [SamplingParams(top_k=100, top_p=0.99)] * 2000).token_ids) == {0, 1, 2}


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_kept_token_counts_penalise_exactly_as_padding_every_step(data):
    """TokenCounts (the engine's: prompts counted once, outputs as they grow, requests forgotten
    when freed) gives the same penalised logits as padding every prompt and output anew."""
    vocab = 12
    counts = TokenCounts(vocab)
    tokens = st.lists(st.integers(0, vocab - 1), max_size=6)
    requests = {k: (data.draw(tokens), []) for k in range(4)}
    params = {k: SamplingParams(repetition_penalty=data.draw(st.sampled_from([1.0, 1.5])),
                                frequency_penalty=data.draw(st.sampled_from([0.0, 0.7])),
                                presence_penalty=data.draw(st.sampled_from([0.0, -0.4])))
              for k in requests}
    for step in range(data.draw(st.integers(1, 6))):
        keys = data.draw(st.lists(st.sampled_from(sorted(requests)), min_size=1, max_size=4, unique=True))
        for k in keys:  # each request in the batch gained 0..2 output tokens since it was last sampled
            requests[k][1].extend(data.draw(st.lists(st.integers(0, vocab - 1), max_size=2)))
        if data.draw(st.booleans()):  # freed (finished or preempted): counted again from scratch later
            counts.forget([data.draw(st.sampled_from(sorted(requests)))])
        ps = [params[k] for k in keys]
        prompts, outputs = [requests[k][0] for k in keys], [requests[k][1] for k in keys]
        logits = rand_logits(len(keys), vocab, seed=step)
        kept = SamplingBatch.build(ps, prompts, outputs, [None] * len(keys), (EOS,), "cpu", counts, keys)
        fresh = build(ps, prompts=prompts, outputs=outputs)
        assert torch.equal(apply_penalties(logits, kept), apply_penalties(logits, fresh))


def test_logit_bias_is_added_to_its_rows_only():
    logits = torch.zeros(3, 6)
    params = [SamplingParams(logit_bias={1: 2.5, 4: -100}), SamplingParams(), SamplingParams(logit_bias={0: 1})]
    out = Sampler(seed=0)(logits, build([SamplingParams(temperature=0, logit_bias=p.logit_bias) for p in params]))
    assert out.token_ids == [1, 0, 0]  # row 0 biased to token 1; row 1 untouched (ties: first); row 2 to 0
    biased = build(params).logit_bias
    assert sorted(zip(biased[0].tolist(), biased[1].tolist(), biased[2].tolist())) == [
        (0, 1, 2.5), (0, 4, -100.0), (2, 0, 1.0)]


def packed_bitmask(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    """xgrammar's layout, written out: bit j of int32 word w allows token 32 * w + j."""
    words = torch.zeros(len(allowed), -(-vocab // 32), dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            words[row, t // 32] |= 1 << (t % 32)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the same 32 bits, as signed int32


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("constrained", [[1], [0, 1, 2]], ids=["one_row", "every_row"])
def test_grammar_bitmask_constrains_its_rows_only(temperature, constrained):
    logits = rand_logits(3, 100, seed=4)
    untouched = logits.clone()
    allowed = {5, 17, 96}
    mask = (torch.tensor(constrained), packed_bitmask([allowed] * len(constrained), 100))
    params = [SamplingParams(temperature=temperature, logprobs=2, seed=i) for i in range(3)]
    free = Sampler(seed=0)(logits, build(params, generators=[torch.Generator().manual_seed(i) for i in range(3)]))
    batch = build(params, generators=[torch.Generator().manual_seed(i) for i in range(3)])
    batch.grammar_bitmask = mask
    out = Sampler(seed=0)(logits, batch)
    assert torch.equal(logits, untouched)
    for row in range(3):
        if row in constrained:
            assert out.token_ids[row] in allowed
            if temperature == 0.0:
                assert out.token_ids[row] == max(allowed, key=lambda t: logits[row, t])
        else:  # drawn as it would be without the constrained rows
            assert out.token_ids[row] == free.token_ids[row]
        # Logprobs stay the model's own.
        assert out.top_logprobs[row] == free.top_logprobs[row]
        assert out.logprobs[row] == pytest.approx(logits[row].log_softmax(-1)[out.token_ids[row]].item(), abs=1e-5)
