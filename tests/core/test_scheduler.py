"""The scheduler alone, over the real KV manager, with no model: plans, chunks, preemption."""

import pytest

from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.kv import KVCacheManager
from pagedserve.sampling_params import SamplingParams


def make(num_blocks=16, block_size=4, max_num_seqs=8, budget=64, caching=False):
    return Scheduler(KVCacheManager(num_blocks, block_size, caching), max_num_seqs, budget)


def request(name, prompt_len, first_token=0):
    return Request(name, list(range(first_token, first_token + prompt_len)), SamplingParams())


def run_step(s, sample_token=7):
    """What the engine does around the model: advance computed counts, append a token to every
    request whose known tokens are now all computed."""
    plan = s.schedule()
    s.finish_step(plan)
    for r in plan.requests:
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(sample_token)
    return plan


def test_running_requests_first_then_waiting_in_arrival_order():
    s = make()
    a, b = request("a", 5), request("b", 3)
    s.add(a)
    s.add(b)
    plan = run_step(s)
    assert [r.request_id for r in plan.requests] == ["a", "b"] and plan.num_new_tokens == [5, 3]
    c = request("c", 2)
    s.add(c)
    plan = run_step(s)
    assert [r.request_id for r in plan.requests] == ["a", "b", "c"] and plan.num_new_tokens == [1, 1, 2]


def test_long_prompt_is_chunked_while_decodes_keep_flowing():
    s = make(num_blocks=32, budget=6)
    short = request("short", 2)
    s.add(short)
    run_step(s)
    long = request("long", 14)
    s.add(long)
    chunks = []
    while long.num_computed_tokens < 14:
        plan = run_step(s)
        assert plan.requests[0] is short and plan.num_new_tokens[0] == 1  # the decode is never starved
        assert plan.num_batched_tokens <= 6
        chunks.append(plan.num_new_tokens[plan.requests.index(long)])
    assert chunks == [5, 5, 4]
    assert len(long.output_token_ids) == 1  # sampled only after the last chunk


def test_out_of_blocks_preempts_the_newest_and_recomputes_it_later():
    s = make(num_blocks=4, block_size=4)
    a, b = request("a", 7), request("b", 7)
    s.add(a)
    s.add(b)
    run_step(s)  # both fit: 2 blocks each, 8 tokens of room each
    admitted = b.scheduled_time
    assert admitted is not None and a.scheduled_time <= admitted
    run_step(s)  # each writes its 8th token: still 2 blocks
    plan = run_step(s)  # a needs a 3rd block: b, the newest, is preempted
    assert [r.request_id for r in plan.preempted] == ["b"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert [r.request_id for r in plan.requests] == ["a"]
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    assert len(b.output_token_ids) == 2
    plan = run_step(s)  # b comes back and recomputes its prompt and the 2 tokens it had sampled
    assert plan.requests == [b] and plan.num_new_tokens == [7 + 2]
    assert s.num_preemptions == 1
    assert b.scheduled_time == admitted  # the first admission, as vLLM's queue time counts it


def test_a_lone_request_preempting_itself_does_not_deadlock():
    s = make(num_blocks=2, block_size=4)
    a, b = request("a", 4), request("b", 3)
    s.add(a)
    s.add(b)
    for _ in range(12):
        run_step(s)
        if a.num_tokens >= 8:
            break
    # a grows to need both blocks; b was preempted and waits; nothing hangs.
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    run_step(s)
    assert b.status is RequestStatus.RUNNING


def test_max_num_seqs_caps_the_running_batch():
    s = make(max_num_seqs=2)
    for name in "abc":
        s.add(request(name, 2))
    plan = run_step(s)
    assert len(plan.requests) == 2 and len(s.waiting) == 1


def test_finish_frees_blocks_in_any_state():
    s = make()
    a, b = request("a", 5), request("b", 5)
    s.add(a)
    s.add(b)
    run_step(s)
    waiting = request("w", 3)
    s.add(waiting)
    for r in (a, b, waiting):
        s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished() and s.kv.num_free_blocks == 16


def test_prefix_cache_hit_skips_computation():
    s = make(caching=True)
    a = request("a", 9)
    s.add(a)
    run_step(s)
    b = request("b", 10)  # same first 9 tokens: two full blocks cached
    s.add(b)
    plan = run_step(s)
    assert plan.num_new_tokens[plan.requests.index(b)] == 2 and b.num_cached_tokens == 8


def test_a_request_owed_prompt_logprobs_skips_the_prefix_cache():
    s = make(caching=True)
    s.add(request("a", 9))
    run_step(s)
    scored = Request("b", list(range(10)), SamplingParams(prompt_logprobs=1))  # same first 9 tokens
    s.add(scored)
    plan = run_step(s)
    assert plan.num_new_tokens[plan.requests.index(scored)] == 10 and scored.num_cached_tokens == 0
    # Once its prompt logprobs are sent (the core then drops them), a recomputation may use the cache.
    sent = Request("c", list(range(10)), SamplingParams(prompt_logprobs=1))
    sent.prompt_logprobs = None
    s.add(sent)
    run_step(s)
    assert sent.num_cached_tokens == 8


def test_a_request_hashes_each_full_block_once_across_retries_preemption_and_growth(monkeypatch):
    from pagedserve.kv import kv_cache_manager

    calls = []  # (parent hash, block tokens) of every block hash computed
    real = kv_cache_manager.hash_block
    monkeypatch.setattr(kv_cache_manager, "hash_block",
                        lambda parent, tokens, extra=None: calls.append((parent, tuple(tokens))) or real(parent, tokens, extra))
    s = make(num_blocks=4, block_size=4, caching=True)
    a, b = request("a", 7), request("b", 7, first_token=50)
    s.add(a)
    s.add(b)
    for _ in range(3):
        run_step(s)  # the third preempts b
    for _ in range(3):
        run_step(s)  # b retries admission every step: 1 block free, it needs 3
        assert b.status is RequestStatus.WAITING
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    for _ in range(8):
        run_step(s)  # b is admitted again and decodes to fill a 4th block
    assert b.status is RequestStatus.RUNNING and b.num_computed_tokens == 16
    assert len(calls) == len(set(calls)) == len(a.block_hashes) + len(b.block_hashes)
    assert len(b.block_hashes) == 4


class RecordingTier:
    """A KV tier that holds nothing: only what is sent to it counts."""

    def __contains__(self, block_hash):
        return False

    def read(self, hashes):
        return []


@pytest.mark.parametrize("mode, tier, swapped", [("auto", True, True), ("auto", False, False),
                                                 ("recompute", True, False), ("swap", True, True)])
def test_a_victim_is_swapped_by_the_mode_and_the_tier(mode, tier, swapped):
    kv = KVCacheManager(5, 4, tier=RecordingTier() if tier else None, offload_policy="evicted")
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode=mode)
    old, new = request("old", 8), request("new", 9, first_token=100)
    s.add(old)
    s.add(new)
    run_step(s)  # 2 + 3 blocks: the pool is full
    plan = s.schedule()  # old's 9th token needs a block: new is preempted
    assert plan.preempted == [new]
    assert [h for _, h in plan.kv_stores] == (new.block_hashes[:2] if swapped else [])


def lora_request(name, prompt_len, lora_id):
    from pagedserve.lora.request import LoRARequest

    adapter = None if lora_id is None else LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}")
    return Request(name, list(range(prompt_len)), SamplingParams(), lora_request=adapter,
                   cache_key=None if adapter is None else ("lora", lora_id))


def test_running_requests_use_at_most_max_loras_adapters_and_the_rest_wait_their_turn():
    s = Scheduler(KVCacheManager(64, 4, True), 8, 256, max_loras=2)
    reqs = [lora_request("a1", 5, 1), lora_request("b", 5, 2), lora_request("c", 5, 3),
            lora_request("base", 5, None), lora_request("a2", 5, 1)]
    for r in reqs:
        s.add(r)
    plan = run_step(s)
    # c's adapter would be a third: it waits, and those behind it go first.
    assert [r.request_id for r in plan.requests] == ["a1", "b", "base", "a2"]
    assert [r.request_id for r in s.waiting] == ["c"]
    slots = dict(zip([r.request_id for r in plan.requests], plan.lora_slots))
    assert slots["base"] == -1 and slots["a1"] == slots["a2"] != slots["b"] and {slots["a1"], slots["b"]} == {0, 1}
    assert sorted(a.lora_int_id for _, a in plan.lora_loads) == [1, 2]
    plan = run_step(s)
    assert plan.lora_loads == []  # the adapters stay in their slots
    s.finish(reqs[1], RequestStatus.FINISHED_STOPPED)  # b's adapter leaves the running batch
    plan = run_step(s)
    assert "c" in [r.request_id for r in plan.requests]
    assert [(slot, a.lora_int_id) for slot, a in plan.lora_loads] == [(slots["b"], 3)]  # c takes b's slot


def test_the_same_prompt_under_two_adapters_shares_no_cached_block():
    s = Scheduler(KVCacheManager(64, 4, True), 8, 256, max_loras=2)
    first = lora_request("x", 12, 1)
    s.add(first)
    run_step(s)
    same_adapter, other_adapter, base = lora_request("y", 12, 1), lora_request("z", 12, 2), lora_request("w", 12, None)
    for r in (same_adapter, other_adapter, base):
        s.add(r)
    run_step(s)
    assert same_adapter.num_cached_tokens == 8  # the full blocks it shares with x's prompt (the last is recomputed)
    assert other_adapter.num_cached_tokens == 0 and base.num_cached_tokens == 0


def test_a_failed_step_forgets_the_slots_it_was_to_fill():
    s = Scheduler(KVCacheManager(64, 4, True), 8, 256, max_loras=1)
    r = lora_request("a", 5, 1)
    s.add(r)
    plan = s.schedule()
    assert [a.lora_int_id for _, a in plan.lora_loads] == [1]
    s.undo_step(plan)
    plan = s.schedule()
    assert [a.lora_int_id for _, a in plan.lora_loads] == [1]  # loaded again: the failed step may have left it half written
