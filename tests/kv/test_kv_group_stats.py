"""`KVCacheManager.group_stats()`, read from the pool's per-group counters, against the same figures
walked from every request's tables, through random admissions (prefix hits), growth past windows,
forks with copy-on-write, speculative rewinds and frees."""

from __future__ import annotations

import random

import pytest

from pagedserve.kv import KVCacheManager

BLOCK = 4


def walked_group_stats(m: KVCacheManager) -> list[tuple[int, int]]:
    """(blocks in use, slots holding a token) per group, from the tables: a block in group g's table
    counts for g, once however many tables share it."""
    filled: list[dict[int, int]] = [{} for _ in m.windows]
    for table in m._tables.values():
        for g, blocks in enumerate(table.groups):
            for i, block in enumerate(blocks):
                if block is not None:
                    n = min(BLOCK, table.num_tokens - i * BLOCK)
                    filled[g][block.block_id] = max(filled[g].get(block.block_id, 0), n)
    return [(len(f), sum(f.values())) for f in filled]


@pytest.mark.parametrize("windows", [(None,), (6, None), (5, 5, None), (7,)], ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_group_stats_are_the_tables_walked(windows, seed):
    rng = random.Random(seed)
    m = KVCacheManager(48, BLOCK, windows=windows)
    openings = [[rng.randrange(100) for _ in range(10)] for _ in range(2)]
    tokens: dict[int, list[int]] = {}
    next_id, slid = 0, False
    for _ in range(300):
        live = list(tokens)
        op = rng.random()
        if op < 0.25 or not live:
            prompt = rng.choice(openings)[:rng.randrange(1, 11)] + [rng.randrange(100) for _ in range(rng.randrange(8))]
            if m.admit(next_id, prompt, block_hashes=[]) is not None:
                tokens[next_id] = prompt
            next_id += 1
        elif op < 0.6:
            req = rng.choice(live)
            new = [rng.randrange(100) for _ in range(rng.randrange(1, 6))]
            if m.grow(req, len(new), tokens[req] + new) is not None:
                tokens[req] += new
        elif op < 0.7:
            req = rng.choice(live)
            m.fork(req, next_id)
            tokens[next_id] = list(tokens[req])
            next_id += 1
        elif op < 0.8:  # drafts written, then rejected
            req = rng.choice(live)
            n = m.num_tokens(req)
            if m.grow(req, 3) is not None:
                m.shrink(req, n + rng.randrange(0, 3))
                m.shrink(req, n)
        else:
            req = rng.choice(live)
            m.free(req)
            del tokens[req]
        slid = slid or any(b is None for t in m._tables.values() for blocks in t.groups for b in blocks)
        stats = m.group_stats()
        assert [(s.used_blocks, s.filled_slots) for s in stats] == walked_group_stats(m)
        assert [s.window for s in stats] == list(windows)
        assert sum(s.used_blocks for s in stats) == m.stats().used_blocks
        assert sum(s.filled_slots for s in stats) == m.stats().filled_slots
    assert m.stats().prefix_hits > 0 and m.stats().cow_copies > 0
    assert slid == any(w is not None for w in windows)  # sliding groups did let go of blocks
    for req in list(tokens):
        m.free(req)
    assert all(s.used_blocks == s.filled_slots == 0 for s in m.group_stats())
