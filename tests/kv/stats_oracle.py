"""The KV figures recomputed by walking every block of every table: the oracle the counters
behind `KVCacheManager.stats()` and `group_stats()` are checked against. It shares no code with
them: which group a block serves is taken from the table holding it, not from the block."""

from pagedserve.kv import KVCacheManager, KVCacheStats
from pagedserve.kv.kv_cache_manager import GroupStats


def walked_fill(m: KVCacheManager) -> list[dict[int, int]]:
    """Per KV cache group, each physical block its tables hold -> the tokens it holds (the max over
    its holders). A table entry a sliding window let go of (None) holds nothing."""
    bs = m.block_size
    filled: list[dict[int, int]] = [{} for _ in m.windows]
    for table in m._tables.values():
        for g, blocks in enumerate(table.groups):
            for i, block in enumerate(blocks):
                if block is None:
                    continue
                n = min(bs, table.num_tokens - i * bs)
                if n > filled[g].get(block.block_id, -1):
                    filled[g][block.block_id] = n
    return filled


def walked_stats(m: KVCacheManager, prefix_queries: int, prefix_hits: int, cow_copies: int) -> KVCacheStats:
    """`m`'s figures from its tables and blocks; the three running tallies come from the caller."""
    bs = m.block_size
    filled = walked_fill(m)
    held: set[int] = set().union(*filled)
    used = sum(1 for b in m.pool.blocks if b.ref_count > 0)
    assert used == len(held), "a block is in use that no table holds, or the other way round"
    return KVCacheStats(
        total_blocks=len(m.pool.blocks),
        free_blocks=len(m.pool.blocks) - used,
        used_blocks=used,
        cached_free_blocks=sum(1 for b in m.pool.cached.values() if b.ref_count == 0),
        reserved_slots=used * bs,
        filled_slots=sum(sum(group.values()) for group in filled),
        prefix_queries=prefix_queries,
        prefix_hits=prefix_hits,
        cow_copies=cow_copies,
    )


def walked_group_stats(m: KVCacheManager) -> list[GroupStats]:
    """`m.group_stats()` from its tables: each group's blocks are those its tables hold."""
    return [GroupStats(w, len(fill), sum(fill.values()), m.block_size) for w, fill in zip(m.windows, walked_fill(m))]
