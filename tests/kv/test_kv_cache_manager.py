import time
from concurrent.futures import Future

import pytest

from pagedserve.kv import KVCacheManager, hash_block, kv_cache_manager


def refs(m, block_ids):
    return [m.pool.blocks[i].ref_count for i in block_ids]


def test_walkthrough_from_the_seed_document():
    """10 blocks of 16; A (24-token prompt) takes 2 blocks; B forks and shares them;
    B's 25th token lands in the shared half-full block and gets a private copy; A grows past
    32 tokens into a third block; freeing both returns all 10 blocks."""
    m = KVCacheManager(num_blocks=10, block_size=16)
    prompt = list(range(24))
    assert m.admit("A", prompt) == 0
    a0, a1 = m.block_ids("A")
    assert m.num_free_blocks == 8

    m.fork("A", "B")
    assert m.block_ids("B") == [a0, a1]
    assert refs(m, [a0, a1]) == [2, 2]

    copies = m.grow("B", 1, prompt + [100])
    b1 = m.block_ids("B")[1]
    assert copies == [(a1, b1)] and b1 != a1
    assert m.block_ids("B")[0] == a0
    assert refs(m, [a0, a1, b1]) == [2, 1, 1]

    assert m.grow("A", 9, prompt + list(range(200, 209))) == []  # a1 is A's alone now: no copy
    assert m.num_tokens("A") == 33
    assert m.block_ids("A")[:2] == [a0, a1] and len(m.block_ids("A")) == 3
    assert m.stats().cow_copies == 1

    m.free("A")
    m.free("B")
    assert m.num_free_blocks == 10


def test_the_writer_of_a_shared_block_gets_the_copy_whoever_writes_first():
    m = KVCacheManager(num_blocks=10, block_size=16)
    m.admit("A", list(range(24)))
    m.fork("A", "B")
    shared = m.block_ids("A")[1]
    copies = m.grow("A", 9)
    assert copies == [(shared, m.block_ids("A")[1])]
    assert m.block_ids("B")[1] == shared and refs(m, [shared]) == [1]
    assert m.grow("B", 1) == []


def test_grow_takes_a_block_exactly_at_the_boundary():
    m = KVCacheManager(num_blocks=4, block_size=4)
    m.admit("r", [1, 2, 3])
    assert len(m.block_ids("r")) == 1
    m.grow("r", 1)
    assert len(m.block_ids("r")) == 1  # 4 tokens fill the block
    m.grow("r", 1)
    assert len(m.block_ids("r")) == 2  # the 5th crosses the boundary
    m.grow("r", 7)
    assert len(m.block_ids("r")) == 3 and m.num_tokens("r") == 12


def test_allocation_is_all_or_nothing():
    m = KVCacheManager(num_blocks=3, block_size=4)
    assert m.admit("big", list(range(13))) is None  # needs 4 blocks
    assert "big" not in m and m.num_free_blocks == 3
    m.admit("r", list(range(8)))
    assert m.grow("r", 5) is None  # needs 2 more, 1 free
    assert m.num_tokens("r") == 8 and len(m.block_ids("r")) == 2
    assert m.grow("r", 4) == []


def test_copy_on_write_counts_against_the_budget():
    m = KVCacheManager(num_blocks=2, block_size=4)
    m.admit("A", [1, 2])
    m.fork("A", "B")
    m.admit("C", [5])
    assert m.blocks_needed_to_grow("B", 1) == 1
    m.free("C")
    assert m.grow("B", 1) is not None


def test_chunked_admission_reserves_only_the_chunk():
    m = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(20))
    assert m.admit("r", prompt, num_new_tokens=6) == 0
    assert m.num_tokens("r") == 6 and len(m.block_ids("r")) == 2
    m.grow("r", 14, prompt)
    assert len(m.block_ids("r")) == 5


def test_prefix_hit_reuses_full_blocks_and_leaves_a_token_to_compute():
    m = KVCacheManager(num_blocks=10, block_size=4)
    system = list(range(100, 112))  # 3 full blocks
    m.admit("A", system + [1, 2])
    a = m.block_ids("A")
    assert m.admit("B", system + [7, 8, 9]) == 12
    assert m.block_ids("B")[:3] == a[:3] and m.block_ids("B")[3] != a[3]
    assert refs(m, a[:3]) == [2, 2, 2]
    # Exactly the cached tokens: the last block must be recomputed, so only 2 blocks hit.
    assert m.admit("C", system) == 8
    s = m.stats()
    assert (s.prefix_queries, s.prefix_hits) == (14 + 15 + 12, 12 + 8)


def test_freed_cached_blocks_stay_findable_until_reused():
    m = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(9))
    m.admit("A", prompt)
    a = m.block_ids("A")
    m.free("A")
    assert m.stats().cached_free_blocks == 2 and m.num_free_blocks == 4
    assert m.admit("B", prompt) == 8  # revived from the free queue
    assert m.block_ids("B")[:2] == a[:2]
    m.free("B")
    m.admit("C", list(range(50, 66)))  # takes all 4 blocks: the cache is evicted
    m.free("C")
    assert m.admit("D", prompt) == 0


def test_tail_blocks_are_evicted_before_the_prefix():
    m = KVCacheManager(num_blocks=4, block_size=2)
    m.admit("A", [1, 2, 3, 4, 5, 6, 7])  # blocks 0..3, three full and cached
    first = m.block_ids("A")
    m.free("A")
    m.admit("B", [9, 9, 9])  # needs 2 blocks: the uncached tail, then the last cached block
    assert set(m.block_ids("B")) == {first[3], first[2]}
    m.free("B")
    assert m.admit("C", [1, 2, 3, 4, 8]) == 4  # the first two blocks survived


def test_extra_keys_separate_identical_tokens():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.admit("A", list(range(9)), extra_keys="lora-1")
    assert m.admit("B", list(range(9)), extra_keys="lora-2") == 0
    assert m.admit("C", list(range(9)), extra_keys="lora-1") == 8


def test_a_request_that_skips_the_lookup_computes_every_token_and_still_offers_its_blocks():
    m = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(9))
    assert m.admit("A", prompt, read_cache=False) == 0
    assert m.admit("B", prompt) == 8  # A's full blocks joined the cache
    assert m.admit("C", prompt, read_cache=False) == 0
    assert not set(m.block_ids("C")) & set(m.block_ids("A"))
    s = m.stats()
    assert (s.prefix_queries, s.prefix_hits) == (9, 8)  # a skipped lookup is no query


def test_prefix_caching_off_never_shares():
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    m.admit("A", list(range(9)))
    assert m.admit("B", list(range(9))) == 0
    assert not set(m.block_ids("A")) & set(m.block_ids("B"))


def test_hash_chains_on_the_parent():
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]) != hash_block(None, [3, 4])
    assert hash_block(None, [1, 2]) == h1 != hash_block(None, [2, 1])


def test_stats_count_waste_of_the_last_block_only():
    m = KVCacheManager(num_blocks=10, block_size=16)
    m.admit("A", list(range(20)))  # 2 blocks, 12 slots empty
    m.fork("A", "B")  # sharing adds no physical slots
    s = m.stats()
    assert (s.used_blocks, s.reserved_slots, s.filled_slots) == (2, 32, 20)
    assert s.waste == pytest.approx(12 / 32)
    assert s.usage == pytest.approx(0.2)


def test_bad_calls_raise():
    m = KVCacheManager(num_blocks=4, block_size=4)
    m.admit("A", [1])
    with pytest.raises(ValueError, match="already"):
        m.admit("A", [1])
    with pytest.raises(ValueError, match="no tokens"):
        m.admit("B", [])
    with pytest.raises(ValueError, match="already"):
        m.fork("A", "A")
    with pytest.raises(ValueError):
        m.grow("A", 0)
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=0)
    m.free("A")
    m.free("A")  # idempotent
    assert m.num_free_blocks == 4


def count_hash_calls(monkeypatch):
    """Record every block hash computed, as (parent hash, block tokens)."""
    calls = []
    real = kv_cache_manager.hash_block

    def counting(parent, token_ids, extra_keys=None):
        calls.append((parent, tuple(token_ids)))
        return real(parent, token_ids, extra_keys)

    monkeypatch.setattr(kv_cache_manager, "hash_block", counting)
    return calls


def test_each_full_block_of_a_request_is_hashed_once(monkeypatch):
    calls = count_hash_calls(monkeypatch)
    m = KVCacheManager(num_blocks=4, block_size=4)
    m.admit("other", list(range(100, 109)))  # 3 of the 4 blocks
    calls.clear()
    prompt, hashes = list(range(10)), []  # 2 full blocks + 2 tokens: needs 3 blocks
    for _ in range(5):  # the scheduler retries every step while the pool is short
        assert m.admit("r", prompt, block_hashes=hashes) is None
    assert len(calls) == 1  # the lookup stops at the first miss, and remembers that hash
    m.free("other")
    assert m.admit("r", prompt, block_hashes=hashes) == 0
    assert len(calls) == 2 and len(hashes) == 2
    tokens = prompt + [10, 11, 12, 13, 14, 15]
    for n in range(11, 17):  # decode one token at a time up to 4 full blocks
        m.grow("r", 1, tokens[:n])
    assert len(calls) == 4 and len(hashes) == 4
    m.free("r")  # preempted: its hashes stay valid and come back with it
    assert m.admit("r", tokens, num_new_tokens=1, block_hashes=hashes) == 12
    child_hashes = []
    m.fork("r", "child", child_hashes)
    assert child_hashes == hashes[:3]  # the table holds 13 tokens: 3 full blocks are shared
    assert len(calls) == 4 and len(set(calls)) == 4


def test_a_hash_list_is_the_chain_of_the_tokens_with_their_extra_keys():
    m = KVCacheManager(num_blocks=8, block_size=2)
    hashes = []
    m.admit("r", [1, 2, 3, 4, 5], extra_keys="lora-1", block_hashes=hashes)
    h0 = hash_block(None, [1, 2], "lora-1")
    assert hashes == [h0, hash_block(h0, [3, 4], "lora-1")]


class DictTier:
    """A KV tier as the manager sees one: `hash in tier`; `read`, a prefix of intact payloads in
    memory; `prefetch`, a future for the blocks held only as files (`on_disk`), or None."""

    read_timeout = 5.0

    def __init__(self, entries=None, damaged=(), on_disk=()):
        self.entries = dict(entries or {})
        self.damaged = set(damaged)
        self.on_disk = set(on_disk)
        self.prefetched: list[list[bytes]] = []

    def __contains__(self, block_hash):
        return block_hash in self.entries

    def read(self, hashes):
        out = []
        for block_hash in hashes:
            if block_hash not in self.entries or block_hash in self.damaged:
                self.entries.pop(block_hash, None)
                break
            if block_hash in self.on_disk:
                break
            out.append(self.entries[block_hash])
        return out

    def prefetch(self, hashes):
        if not self.on_disk.intersection(hashes):
            return None
        self.prefetched.append(list(hashes))
        return Future()


def chain(tokens, block_size=4):
    hashes = []
    for i in range(len(tokens) // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * block_size:(i + 1) * block_size]))
    return hashes


def test_a_prefix_the_pool_lacks_is_loaded_from_the_tier_into_new_blocks():
    prompt = list(range(13))  # three full blocks and one token
    hashes = chain(prompt)
    tier = DictTier({hashes[0]: "p0", hashes[1]: "p1"})
    m = KVCacheManager(num_blocks=8, block_size=4, tier=tier)
    assert m.admit("A", prompt) == 8
    table = m.block_ids("A")
    stores, loads = m.take_transfers()
    assert stores == [] and loads == [(table[0], "p0"), (table[1], "p1")]
    s = m.stats()
    assert (s.prefix_hits, s.offload_hits, s.offload_loaded_blocks) == (8, 8, 2)
    assert m.take_transfers() == ([], [])  # taken once


def test_the_pool_serves_first_and_the_tier_continues_where_it_ends():
    prompt = list(range(17))
    hashes = chain(prompt)
    m = KVCacheManager(num_blocks=10, block_size=4, tier=DictTier({h: f"p{i}" for i, h in enumerate(hashes)}))
    m.admit("A", prompt[:9])  # computes (and caches) the first two blocks
    m.confirm_cached()
    m.take_transfers()
    m.free("A")
    assert m.admit("B", prompt) == 16
    _, loads = m.take_transfers()
    assert [payload for _, payload in loads] == ["p2", "p3"]  # blocks 0 and 1 came from the pool


def test_a_damaged_tier_block_ends_the_prefix_and_is_computed():
    prompt = list(range(13))
    hashes = chain(prompt)
    tier = DictTier({hashes[0]: "p0", hashes[1]: "p1", hashes[2]: "p2"}, damaged={hashes[1]})
    m = KVCacheManager(num_blocks=8, block_size=4, tier=tier)
    assert m.admit("A", prompt, num_new_tokens=2) == 4  # block 0 from the tier, then 2 tokens computed
    assert m.num_tokens("A") == 6 and len(m.block_ids("A")) == 2
    assert [p for _, p in m.take_transfers()[1]] == ["p0"]
    assert hashes[1] not in tier


def test_an_admission_the_pool_cannot_cover_reads_nothing_and_changes_nothing():
    prompt = list(range(13))
    hashes = chain(prompt)

    class Counting(DictTier):
        reads = 0

        def read(self, hashes):
            self.reads += 1
            return super().read(hashes)

    tier = Counting({h: "p" for h in hashes})
    m = KVCacheManager(num_blocks=3, block_size=4, tier=tier)
    assert m.admit("A", prompt) is None
    assert tier.reads == 0 and m.num_free_blocks == 3 and m.take_transfers() == ([], [])


def test_write_through_sends_each_computed_block_the_tier_lacks_once_its_step_ran():
    prompt = list(range(9))
    hashes = chain(prompt)
    m = KVCacheManager(num_blocks=8, block_size=4, tier=DictTier({hashes[1]: "already"}), offload_policy="write_through")
    m.admit("A", prompt, read_cache=False)
    assert m.take_transfers() == ([], [])  # nothing is computed yet
    m.confirm_cached()
    table = m.block_ids("A")
    assert m.take_transfers() == ([(table[0], hashes[0])], [])
    m.discard_unconfirmed()
    m.admit("B", list(range(50, 59)), read_cache=False)
    m.discard_unconfirmed()  # that step failed: its blocks hold nothing
    m.confirm_cached()
    assert m.take_transfers() == ([], [])


def test_the_evicted_policy_stores_a_cached_block_as_it_is_reused_when_hit_often_enough():
    m = KVCacheManager(num_blocks=2, block_size=4, tier=DictTier(), offload_policy="evicted", offload_min_hits=1)
    cold, hot = list(range(5)), list(range(100, 105))
    m.admit("cold", cold)
    m.confirm_cached()
    m.free("cold")
    m.admit("hot", hot)
    m.confirm_cached()
    m.free("hot")
    m.admit("hot again", hot)  # a hit on the hot block
    m.free("hot again")
    assert m.take_transfers() == ([], [])  # written through? no: this policy waits for eviction
    m.admit("new", list(range(200, 208)))  # takes both blocks: evicts the cold one and the hot one
    stores, _ = m.take_transfers()
    assert [h for _, h in stores] == chain(hot)  # only the block hit at least once


def test_swap_sends_the_victims_computed_full_blocks():
    prompt = list(range(10))
    m = KVCacheManager(num_blocks=8, block_size=4, tier=DictTier(), offload_policy="evicted", offload_min_hits=99)
    m.admit("A", prompt)
    m.confirm_cached()
    table, hashes = m.block_ids("A"), chain(prompt)
    m.offload("A")
    m.free("A")
    assert m.take_transfers() == ([(table[0], hashes[0]), (table[1], hashes[1])], [])


def test_at_shutdown_the_cached_blocks_the_tier_lacks_go_to_it_by_the_evicted_rule():
    m = KVCacheManager(num_blocks=8, block_size=4, tier=DictTier(), offload_min_hits=1)
    cold, hot = list(range(5)), list(range(100, 105))
    for name, prompt in (("cold", cold), ("hot", hot), ("hot again", hot)):
        m.admit(name, prompt)
        m.confirm_cached()
        m.free(name)
    m.offload_cached()
    assert [h for _, h in m.take_transfers()[0]] == chain(hot)  # the cold block was never hit


def test_prefetch_asks_the_tier_for_the_blocks_an_admission_would_load_and_admission_takes_memory_only():
    prompt = list(range(17))
    hashes = chain(prompt)
    tier = DictTier({h: f"p{i}" for i, h in enumerate(hashes) if i > 0}, on_disk=hashes[2:])
    m = KVCacheManager(num_blocks=10, block_size=4, tier=tier)
    m.admit("A", prompt[:5])  # block 0 computed: the pool holds it
    m.confirm_cached()
    m.free("A")
    before = m.stats()
    read = m.prefetch(prompt, block_hashes=[])
    assert tier.prefetched == [hashes[1:4]] and not read.over(time.monotonic())  # past the pool's hit, before the last token
    assert read.over(read.deadline) and m.stats() == before and m.take_transfers() == ([], [])
    assert m.admit("B", prompt) == 8  # the file-only blocks are computed: admission never waits for one
    assert [p for _, p in m.take_transfers()[1]] == ["p1"]
    m.free("B")
    tier.on_disk.clear()  # read into memory
    assert m.prefetch(prompt) is None  # nothing to wait for
    assert KVCacheManager(num_blocks=4, block_size=4).prefetch(prompt) is None  # no tier


def test_shrinking_into_a_block_shared_with_a_fork_raises():
    """The fork still holds the slots past the shrink in that block (its token count is both
    tables'); a grow first copies the shared block, so a speculative rewind never meets one."""
    m = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    m.admit("a", [1, 2, 3])
    m.fork("a", "b")
    with pytest.raises(ValueError, match="shared"):
        m.shrink("b", 2)
    assert m.num_tokens("b") == 3 and m.stats().filled_slots == 3
    assert len(m.grow("b", 2)) == 1  # token 3 goes to a private copy of the shared block
    m.shrink("b", 3)
    assert m.stats().filled_slots == 3 + 3 and m.block_ids("b") != m.block_ids("a")
