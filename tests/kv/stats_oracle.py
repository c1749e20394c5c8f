"""The KV figures recomputed by walking every block of every table: the oracle the counters
behind `KVCacheManager.stats()` are checked against. It shares no code with them."""

from pagedserve.kv import KVCacheManager, KVCacheStats


def walked_stats(m: KVCacheManager, prefix_queries: int, prefix_hits: int, cow_copies: int) -> KVCacheStats:
    """`m`'s figures from its tables and blocks; the three running tallies come from the caller."""
    bs = m.block_size
    filled: dict[int, int] = {}  # physical block -> tokens it holds (max over sharers)
    for table in m._tables.values():
        for i, block in enumerate(table.blocks):
            n = min(bs, table.num_tokens - i * bs)
            if n > filled.get(block.block_id, 0):
                filled[block.block_id] = n
    used = sum(1 for b in m.pool.blocks if b.ref_count > 0)
    return KVCacheStats(
        total_blocks=len(m.pool.blocks),
        free_blocks=len(m.pool.blocks) - used,
        used_blocks=used,
        cached_free_blocks=sum(1 for b in m.pool.cached.values() if b.ref_count == 0),
        reserved_slots=used * bs,
        filled_slots=sum(filled.values()),
        prefix_queries=prefix_queries,
        prefix_hits=prefix_hits,
        cow_copies=cow_copies,
    )
