"""The paged KV memory manager. Pure Python: it imports no torch."""

from pagedserve.kv.block_pool import Block, BlockPool, FreeBlockQueue
from pagedserve.kv.kv_cache_manager import BlockCopy, KVCacheManager, KVCacheStats, hash_block

__all__ = ["Block", "BlockPool", "FreeBlockQueue", "BlockCopy", "KVCacheManager", "KVCacheStats", "hash_block"]
