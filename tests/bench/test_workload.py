from collections import Counter

import pytest

from pagedserve.bench.workload import WORKLOADS, parallel_sampling, shared_prefix, sharegpt_like, system_prompts


def test_workloads_are_seeded_and_bounded():
    a, b = sharegpt_like(20, seed=1), sharegpt_like(20, seed=1)
    assert a == b and a != sharegpt_like(20, seed=2)
    assert all(16 <= len(r.prompt_token_ids) <= 512 and 16 <= r.output_len <= 256 for r in a.requests)
    assert a.num_prompt_tokens == sum(len(r.prompt_token_ids) for r in a.requests)


def test_shared_prefix_requests_share_their_opening():
    w = shared_prefix(8, prefix_len=64)
    first = w.requests[0].prompt_token_ids[:64]
    assert all(r.prompt_token_ids[:64] == first and len(r.prompt_token_ids) > 64 for r in w.requests)


def test_parallel_sampling_multiplies_outputs():
    w = parallel_sampling(4, n=4)
    assert all(r.n == 4 for r in w.requests)
    assert w.num_output_tokens == 4 * sum(r.output_len for r in w.requests)
    assert set(WORKLOADS) == {"sharegpt-like", "decode-heavy", "long-prompt", "long-outputs", "shared-prefix",
                              "parallel-sampling"}
    assert w.to_json()["requests"][0]["n"] == 4


def test_long_prompt_lengths():
    from pagedserve.bench.workload import WORKLOADS, long_prompt

    workload = long_prompt(num_requests=40, seed=1)
    assert WORKLOADS["long-prompt"] is long_prompt and workload.name == "long-prompt"
    assert all(512 <= len(r.prompt_token_ids) <= 2048 and 32 <= r.output_len <= 256 for r in workload.requests)
    assert workload.requests == long_prompt(num_requests=40, seed=1).requests


def test_decode_heavy_has_sharegpt_like_prompts_and_longer_outputs():
    from pagedserve.bench.workload import decode_heavy

    chat, heavy = sharegpt_like(64), decode_heavy(64)
    assert WORKLOADS["decode-heavy"] is decode_heavy and heavy.name == "decode-heavy"
    assert all(16 <= len(r.prompt_token_ids) <= 512 and 64 <= r.output_len <= 256 for r in heavy.requests)
    assert heavy.num_output_tokens > 1.5 * chat.num_output_tokens
    assert heavy.num_output_tokens > 0.7 * heavy.num_prompt_tokens
    assert heavy == decode_heavy(64) and heavy != decode_heavy(64, seed=1)


def test_long_outputs_are_all_decode():
    from pagedserve.bench.workload import long_outputs

    w = long_outputs(10, prompt_len=16, output_len=256)
    assert WORKLOADS["long-outputs"] is long_outputs and w.name == "long-outputs"
    assert [(len(r.prompt_token_ids), r.output_len) for r in w.requests] == [(16, 256)] * 10
    assert len({tuple(r.prompt_token_ids) for r in w.requests}) == 10  # no shared prefix to cache
    assert w == long_outputs(10) and w != long_outputs(10, seed=1)


def test_system_prompts_are_each_behind_equally_many_requests_with_their_own_suffixes_in_random_order():
    w = system_prompts(num_prompts=4, requests_per_prompt=5, prompt_len=32, suffix_len=3, seed=1)
    requests = [r.prompt_token_ids for r in w.requests]
    assert len(requests) == 20 and all(len(r) == 35 for r in requests)
    assert all(100 <= t < 49000 for r in requests for t in r)
    assert sorted(Counter(tuple(r[:32]) for r in requests).values()) == [5, 5, 5, 5]
    assert len({tuple(r[32:]) for r in requests}) == 20
    firsts = list(dict.fromkeys(tuple(r[:32]) for r in requests))
    assert [firsts.index(tuple(r[:32])) for r in requests] != [i % 4 for i in range(20)]  # shuffled
    assert system_prompts(4, 5, seed=2, prompt_len=32, suffix_len=3).requests != w.requests


def test_a_fixed_output_length_keeps_the_prompts():
    base = sharegpt_like(16, seed=3)
    prompts_alone = base.with_output_len(1)
    assert [r.prompt_token_ids for r in prompts_alone.requests] == [r.prompt_token_ids for r in base.requests]
    assert prompts_alone.num_output_tokens == 16 and prompts_alone.name == "sharegpt-like-out1"
    with pytest.raises(ValueError, match="at least 1"):
        base.with_output_len(0)
