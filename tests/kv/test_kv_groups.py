"""KV cache groups: how layers are grouped (KVLayout) and what the manager does with a group of
sliding-window layers beside (or instead of) full-attention ones."""

import pytest

from pagedserve.kv import KVCacheManager
from pagedserve.kv.groups import KVCacheGroup, KVLayout
from pagedserve.kv.kv_cache_manager import NULL_BLOCK_ID
from tests.kv.test_kv_cache_manager import DictTier, chain


def cdiv(a, b):
    return -(-a // b)


def held(m, req, group):
    """The blocks the group's table of the request holds (entries a window let go of are None)."""
    return [b for b in m._tables[req].groups[group] if b is not None]


def decode(m, req, tokens, upto):
    """Grow the request one token at a time until it holds `upto` of `tokens`."""
    for n in range(m.num_tokens(req) + 1, upto + 1):
        assert m.grow(req, 1, tokens[:n]) is not None


# ---- KVLayout ----------------------------------------------------------------------------------


def gemma3_27b_windows():
    """62 layers, every sixth full attention, the others a 1024-token window."""
    return [None if layer % 6 == 5 else 1024 for layer in range(62)]


def test_layers_of_two_kinds_make_groups_of_the_gcd_of_their_counts():
    layout = KVLayout.of(gemma3_27b_windows())  # 52 sliding, 10 full: groups of gcd(52, 10) = 2
    assert layout.layers_per_block == 2 and layout.num_groups == 31
    assert layout.windows == (1024,) * 26 + (None,) * 5
    assert layout.groups[0] == KVCacheGroup(1024, (0, 1))
    assert layout.groups[2] == KVCacheGroup(1024, (4, 6))  # layer 5 is full attention
    assert layout.groups[26] == KVCacheGroup(None, (5, 11))
    assert layout.groups[30] == KVCacheGroup(None, (53, 59))
    assert sorted(layer for g in layout.groups for layer in g.layers) == list(range(62))
    assert all(len(g.layers) == 2 for g in layout.groups)
    assert layout.groups[26].kind == "full" and layout.groups[0].kind == "sliding 1024"


def test_a_model_of_one_kind_makes_one_group_of_all_its_layers():
    for layout in (KVLayout.of([None] * 5), KVLayout.uniform(5)):
        assert layout.groups == (KVCacheGroup(None, (0, 1, 2, 3, 4)),) and layout.layers_per_block == 5
    assert KVLayout.of([8] * 3).windows == (8,)


def test_kinds_come_in_order_of_first_appearance_and_layers_in_layer_order():
    assert KVLayout.of([None, 8, None, 8]).groups == (KVCacheGroup(None, (0, 2)), KVCacheGroup(8, (1, 3)))
    assert KVLayout.of([8, None, 8, None]).groups == (KVCacheGroup(8, (0, 2)), KVCacheGroup(None, (1, 3)))
    # Counts 2, 1, 1: groups of one layer; two windows are two kinds.
    assert KVLayout.of([4, 4, 8, None]).windows == (4, 4, 8, None)


def test_layer_places_name_each_layers_group_and_buffer_slot():
    layout = KVLayout.of([8, None, 8, None, 8, 8, 8, 8])  # 6 sliding, 2 full: groups of 2
    assert layout.windows == (8, 8, 8, None)
    assert layout.layer_places() == [(0, 0), (3, 0), (0, 1), (3, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    places = KVLayout.of(gemma3_27b_windows()).layer_places()
    assert places[5] == (26, 0) and places[11] == (26, 1) and places[6] == (2, 1)
    assert len(set(places)) == 62


def test_bad_layer_windows_raise():
    with pytest.raises(ValueError, match="at least one layer"):
        KVLayout.of([])
    with pytest.raises(ValueError, match="layer 1: sliding window must be positive"):
        KVLayout.of([None, 0])


def test_blocks_per_request_counts_every_block_of_a_full_group_and_a_window_and_chunk_of_a_sliding_one():
    layout = KVLayout.of([None, 8])
    assert layout.blocks_per_request(100, 4, 1) == 25 + 3  # window 8 at one token a step: cdiv(8, 4) + 1
    assert layout.blocks_per_request(100, 4, 16) == 25 + cdiv(8 - 1 + 16, 4) + 1
    assert layout.blocks_per_request(5, 4, 16) == 2 + 2  # a short request holds all its blocks
    assert KVLayout.uniform(3).blocks_per_request(9, 4, 1) == 3  # one group, whatever its layer count
    assert KVLayout.of([8]).blocks_per_request(10**6, 4, 1) == 3


def test_max_tokens_is_the_longest_request_that_fits_alone():
    layout = KVLayout.of([None, 8])
    assert layout.max_tokens(28, 4, 1, 1000) == 100  # 25 + 3 blocks; 101 tokens take 26 + 3
    assert layout.blocks_per_request(101, 4, 1) == 29
    assert layout.max_tokens(28, 4, 1, 50) == 50  # at most the limit
    assert KVLayout.of([8]).max_tokens(4, 4, 4, 10**6) == 10**6  # a window of 8 at 4 a step: 4 blocks at most
    assert KVLayout.of([8]).max_tokens(3, 4, 4, 10**6) == 12
    assert KVLayout.uniform(2).max_tokens(0, 4, 1, 100) == 0


def test_a_request_of_max_tokens_runs_alone_in_the_pool_it_was_sized_for():
    """The manager never needs more than blocks_per_request: a request of max_tokens tokens, its
    prompt computed in chunks and then decoded, never finds the pool short."""
    layout, bs, chunk, num_blocks = KVLayout.of([None, 6]), 4, 5, 20
    n = layout.max_tokens(num_blocks, bs, chunk, 10**4)
    assert n == 64 and layout.blocks_per_request(n + 1, bs, chunk) > num_blocks
    m = KVCacheManager(num_blocks, bs, windows=layout.windows)
    tokens = list(range(n))
    prompt = tokens[: n - 12]
    assert m.admit("r", prompt, num_new_tokens=chunk) == 0
    while m.num_tokens("r") < n:
        k = min(chunk, len(prompt) - m.num_tokens("r")) if m.num_tokens("r") < len(prompt) else 1
        assert m.grow("r", k, tokens[: m.num_tokens("r") + k]) is not None
        assert num_blocks - m.num_free_blocks <= layout.blocks_per_request(m.num_tokens("r"), bs, chunk)


# ---- sliding groups in the manager -------------------------------------------------------------


def test_a_sliding_group_holds_at_most_its_window_and_chunk_during_decode():
    window, bs = 6, 4
    m = KVCacheManager(64, bs, windows=(None, window))
    tokens = list(range(60))
    m.admit("r", tokens[:10])
    counts = []
    for n in range(11, 61):
        assert m.grow("r", 1, tokens[:n]) is not None
        counts.append(len(held(m, "r", 1)))
        assert len(held(m, "r", 0)) == cdiv(n, bs)  # the full group keeps every block
        assert m.num_free_blocks == 64 - cdiv(n, bs) - counts[-1]  # what the window let go of is free
        first = max(0, n - 1 - window + 1) // bs  # the block of the oldest position token n - 1 reads
        assert [b is None for b in m._tables["r"].groups[1]] == [True] * first + [False] * (cdiv(n, bs) - first)
        assert m.block_ids("r", group=1)[:first] == [NULL_BLOCK_ID] * first
    assert max(counts) == cdiv(window - 1 + 1, bs) + 1 == 3  # the bound, and it is reached
    # A chunk of 5 tokens a step: the window of its first token and the chunk.
    m.admit("chunked", tokens[:5], num_new_tokens=5)
    counts = []
    for n in range(10, 60, 5):
        assert m.grow("chunked", 5, tokens[:n]) is not None
        counts.append(len(held(m, "chunked", 1)))
    assert max(counts) == cdiv(window - 1 + 5, bs) + 1 == 4


def test_a_hybrid_hit_is_shorter_when_the_sliding_groups_window_blocks_were_evicted():
    """The full group still has all 3 blocks of the prompt cached, but the sliding group's block 2,
    which a hit at 12 tokens needs (window 4: positions 9..12), was evicted: the hit stops at 8,
    where the sliding group needs only block 1 (positions 5..8)."""
    bs, prompt, hashes = 4, list(range(13)), []
    m = KVCacheManager(11, bs, windows=(4, None))  # the sliding group first, as in Gemma 3
    m.admit("a", prompt, block_hashes=hashes)  # 4 blocks in each group; 3 never used
    m.free("a")  # the sliding group's block 2 is released first of the cached blocks
    m.admit("filler", list(range(100, 112)), read_cache=False)  # 2 + 3 uncached blocks, then 1 cached
    m.free("filler")
    cached = m.pool.cached
    assert hashes[2] not in cached and all((1, h) in cached for h in hashes[:3])  # the full group's are all there
    assert m.admit("b", prompt) == 8
    sliding, full = m._tables["b"].groups
    assert sliding[0] is None and sliding[1].block_hash == hashes[1]
    assert [b.block_hash for b in full[:2]] == [(1, hashes[0]), (1, hashes[1])]


def test_a_pure_sliding_model_hits_even_when_its_early_blocks_were_evicted():
    """Window 4: a hit at 16 tokens needs only block 3 (positions 13..16). The request's earlier
    blocks left its window as it decoded, and another request took them."""
    bs, tokens = 4, list(range(17))
    m = KVCacheManager(5, bs, windows=(4,))
    hashes = []
    m.admit("a", tokens[:5], block_hashes=hashes)
    decode(m, "a", tokens, 17)
    assert [b is None for b in m._tables["a"].groups[0]] == [True, True, True, False, False]
    m.admit("filler", list(range(100, 112)), read_cache=False)  # takes the 3 blocks the window let go of
    m.free("filler")
    m.free("a")
    assert not any(h in m.pool.cached for h in hashes[:3])  # blocks 0..2 are gone
    assert m.admit("b", tokens) == 16
    table = m._tables["b"].groups[0]
    assert table[:3] == [None, None, None] and table[3].block_hash == hashes[3]
    assert m.block_ids("b")[:3] == [NULL_BLOCK_ID] * 3


def test_free_lets_the_tails_of_all_groups_go_before_any_prefix():
    """A hybrid request's blocks become free tail first across its groups, so evicting some of
    them shortens its cached prefix rather than losing it: after two evictions a hit of 8 tokens
    remains (the full group's blocks 0 and 1, the sliding group's block 1)."""
    bs, prompt = 4, list(range(13))
    m = KVCacheManager(10, bs, windows=(None, 4))
    m.admit("a", prompt)  # 4 blocks in each group; 2 never used
    m.free("a")
    m.admit("filler", list(range(100, 112)), read_cache=False)  # 2 + 2 uncached, then 2 cached
    m.free("filler")
    assert m.admit("b", prompt) == 8


def test_shrinking_past_what_a_window_let_go_of_raises():
    m = KVCacheManager(8, 4, enable_prefix_caching=False, windows=(None, 4))
    m.admit("r", list(range(12)))
    m.grow("r", 1)  # the window of token 12 starts at position 9: blocks 0 and 1 are let go of
    assert m.block_ids("r", group=1)[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]
    with pytest.raises(ValueError, match="window"):
        m.shrink("r", 5)  # token 5's window would read positions 2..5: blocks 0 and 1
    assert m.num_tokens("r") == 13
    m.shrink("r", 12)  # back to the count before the grow: its window is kept
    assert m.num_tokens("r") == 12 and m.grow("r", 1) == []


def test_fork_shares_every_groups_blocks_and_each_side_copies_its_partial_blocks_on_write():
    m = KVCacheManager(16, 4, windows=(None, 4))
    tokens = list(range(30))
    m.admit("a", tokens[:10])
    decode(m, "a", tokens, 14)
    m.fork("a", "b")
    assert m.group_block_ids("b") == m.group_block_ids("a")
    partial = [ids[3] for ids in m.group_block_ids("a")]
    copies = m.grow("b", 1, tokens[:15])
    assert [src for src, _ in copies] == partial  # one copy per group
    assert [ids[3] for ids in m.group_block_ids("b")] == [dst for _, dst in copies]
    assert m.grow("a", 1, tokens[:15]) == []  # the partial blocks are a's alone now
    m.free("a")
    m.free("b")
    assert m.num_free_blocks == 16 and all(g.used_blocks == 0 for g in m.group_stats())


def test_group_stats_count_each_groups_blocks_and_tokens():
    m = KVCacheManager(16, 4, windows=(None, 4))
    m.admit("r", list(range(10)))
    m.grow("r", 7, list(range(17)))  # the window of token 10 starts at 7: block 0 is let go of
    full, sliding = m.group_stats()
    assert (full.window, full.used_blocks, full.filled_slots) == (None, 5, 17)
    assert (sliding.window, sliding.used_blocks, sliding.filled_slots) == (4, 4, 13)
    assert sliding.waste == pytest.approx(1 - 13 / 16)
    s = m.stats()
    assert (s.used_blocks, s.filled_slots) == (9, 30)


def test_each_groups_block_is_cached_under_a_key_of_its_own():
    m = KVCacheManager(16, 4, windows=(None, 8, 8))
    hashes = []
    m.admit("r", list(range(9)), block_hashes=hashes)
    groups = m._tables["r"].groups
    assert [groups[g][0].block_hash for g in range(3)] == [hashes[0], (1, hashes[0]), (2, hashes[0])]
    assert len({groups[g][0].block_id for g in range(3)}) == 3


def test_bad_windows_raise():
    with pytest.raises(ValueError, match="windows"):
        KVCacheManager(4, 4, windows=())
    with pytest.raises(ValueError, match="windows"):
        KVCacheManager(4, 4, windows=(None, 0))


def test_a_tier_hit_found_again_without_blocks_only_on_disk_ends():
    """Window 6: a hit at 20 tokens needs blocks 3 and 4, at 16 blocks 2 and 3, at 8 blocks 0 and 1.
    The tier holds blocks 2 and 4 only as files: each shorter hit reads other blocks, and a block
    once found missing stays out of the hit (the longer hit never comes back), so the admission
    ends, with the blocks 0 and 1 it read from memory."""
    prompt = list(range(21))
    hashes = chain(prompt)

    class AskedOnce(DictTier):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.asked: list[bytes] = []

        def read(self, names):
            assert not set(self.asked) & set(names), "asked again: the hits go round in a circle"
            self.asked += names
            return super().read(names)

    tier = AskedOnce({h: f"p{i}" for i, h in enumerate(hashes)}, on_disk={hashes[2], hashes[4]})
    m = KVCacheManager(num_blocks=8, block_size=4, tier=tier, windows=(6,))
    assert m.admit("A", prompt) == 8
    assert tier.asked == [hashes[3], hashes[4], hashes[2], hashes[0], hashes[1]]
    table = m.block_ids("A")
    assert m.take_transfers() == ([], [(table[0], "p0"), (table[1], "p1")])
    assert m.stats().offload_loaded_blocks == 2
