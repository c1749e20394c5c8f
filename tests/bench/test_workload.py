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


def test_multi_turn_chat_is_seeded_and_shaped():
    from pagedserve.bench.workload import multi_turn_chat

    w = multi_turn_chat(num_sessions=3, num_turns=4, system_prompt_len=20, user_len=5, answer_len=7, seed=1)
    assert w == multi_turn_chat(3, 4, 20, 5, 7, seed=1) and w != multi_turn_chat(3, 4, 20, 5, 7, seed=2)
    assert len(w.sessions) == 3 and w.num_turns == 4 and w.answer_len == 7
    assert all(len(s.system_prompt) == 20 and [len(m) for m in s.user_messages] == [5] * 4 for s in w.sessions)
    assert all(100 <= t < 49000 for s in w.sessions for t in s.system_prompt + sum(s.user_messages, []))
    assert len({tuple(s.system_prompt) for s in w.sessions}) == 3  # by default each session its own
    shared = multi_turn_chat(3, 4, 20, 5, 7, shared_system_prompt=True, seed=1)
    assert len({tuple(s.system_prompt) for s in shared.sessions}) == 1
    assert len({tuple(s.user_messages[0]) for s in shared.sessions}) == 3
    assert "3 sessions x 4 turns" in w.describe() and "shared" in shared.describe()


def test_multi_turn_prompts_hold_the_whole_context_so_far():
    from pagedserve.bench.workload import multi_turn_chat

    w = multi_turn_chat(num_sessions=2, num_turns=3, system_prompt_len=4, user_len=2, answer_len=3, seed=0)
    s = w.sessions[1]
    answers = [[1, 2, 3], [4, 5, 6]]
    assert w.prompt(1, 0, []) == s.system_prompt + s.user_messages[0]
    assert w.prompt(1, 2, answers) == (s.system_prompt + s.user_messages[0] + answers[0] + s.user_messages[1]
                                       + answers[1] + s.user_messages[2])
    assert [len(w.prompt(1, t, answers)) for t in range(3)] == [w.prompt_len(1, t) for t in range(3)] == [6, 11, 16]
    assert w.context_len(1) == 19
    assert w.num_prompt_tokens == 2 * (6 + 11 + 16) and w.num_output_tokens == 2 * 3 * 3
    with pytest.raises(ValueError, match="earlier answers"):
        w.prompt(0, 2, answers[:1])
    with pytest.raises(ValueError):
        multi_turn_chat(num_sessions=0)


def test_unique_prompts_share_no_prefix():
    from pagedserve.bench.workload import unique_prompts

    w = unique_prompts(10, seed=1, prompt_len=(32, 48), output_len=8)
    assert w == unique_prompts(10, seed=1, prompt_len=(32, 48), output_len=8)
    assert all(32 <= len(r.prompt_token_ids) <= 48 and r.output_len == 8 for r in w.requests)
    assert len({tuple(r.prompt_token_ids[:16]) for r in w.requests}) == 10
