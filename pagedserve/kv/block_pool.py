"""The pool of physical KV blocks: reference counts, an LRU free queue and the prefix-cache map.

Pure Python (no torch): a block here is bookkeeping only; the model runner owns the tensors and
addresses them by `block_id`.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Iterator

from pagedserve.kv.watch import KVWatchLog


class Block:
    """One physical block of `block_size` token slots."""

    __slots__ = ("block_id", "ref_count", "num_tokens", "block_hash", "num_hits", "group", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        # Slots holding a token. Every table holding the block agrees on it: only full blocks
        # are shared by the prefix cache, and a shared partial block is copied before a write.
        # Kept while the block is free (a cached block still holds its tokens).
        self.num_tokens = 0
        # Set while the block holds a full block of cached prefix that others may hit: the prefix
        # cache's key of it (kv_cache_manager.CacheKey).
        self.block_hash: Hashable | None = None
        self.num_hits = 0  # times the prefix cache served it since it was cached
        self.group = 0  # the KV cache group whose tokens it holds (kv/groups.py), set when allocated
        # Links of the intrusive free queue; both None while the block is in use.
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently used at the head.

    Intrusive (the links live in the blocks) so that every operation is O(1), including
    `remove` of a block from the middle when the prefix cache revives it.
    """

    def __init__(self, blocks: Iterable[Block]) -> None:
        # Sentinels at both ends keep the link code free of special cases.
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def _insert_between(self, block: Block, prev: Block, nxt: Block) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} already queued"
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1

    def append(self, block: Block) -> None:
        """Queue `block` as the most recently used: evicted last."""
        self._insert_between(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: Block) -> None:
        """Queue `block` as the first to be taken (it caches nothing worth keeping)."""
        self._insert_between(block, self._head, self._head.next_free)

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block


class BlockPool:
    """`num_blocks` physical blocks with reference counts and a hash -> block prefix cache.

    A block with ref count 0 is free and sits in the free queue. If it holds a cached full
    block it keeps its hash until it is taken for reuse, so a later request can still hit it.

    The figures are counters kept up to date by every call, so reading them is O(1).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, num_groups: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[Hashable, Block] = {}
        self.num_cached_free = 0  # free blocks that still hold a findable cached prefix
        self.num_filled_slots = 0  # sum of `num_tokens` over the blocks in use
        # The same two per KV cache group (`Block.group`) of the blocks in use
        self.used_by_group = [0] * num_groups
        self.filled_by_group = [0] * num_groups
        # (block id, hash, hits) of each cached block that `allocate` evicted, when recorded (a KV
        # tier that receives blocks as they are evicted); its owner empties it.
        self.record_evictions = False
        self.evicted: list[tuple[int, Hashable, int]] = []
        self.watch: KVWatchLog | None = None  # while the live view watches: what changed

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self, n: int, group: int = 0) -> list[Block]:
        """Take `n` free blocks (ref count 1 each) for KV cache group `group`, evicting cached
        content in LRU order."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self.free_queue)} free")
        taken = []
        watch = self.watch
        for _ in range(n):
            block = self.free_queue.popleft()
            if self.record_evictions and block.block_hash is not None:
                self.evicted.append((block.block_id, block.block_hash, block.num_hits))
            if watch is not None:
                watch.changed.add(block.block_id)
                if block.block_hash is not None:
                    watch.add("evict", None, [block.block_id], f"evicted cached block {block.block_id} "
                              f"(hit {block.num_hits} times) to reuse it")
            self._forget(block)
            block.ref_count = 1
            block.group = group
            block.num_tokens = 0  # whatever it held is overwritten
            taken.append(block)
        self.used_by_group[group] += n
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add one reference to each block, reviving free ones out of the free queue."""
        watch = self.watch
        for block in blocks:
            if watch is not None:
                watch.changed.add(block.block_id)
            if block.ref_count == 0:
                self.free_queue.remove(block)
                self.num_filled_slots += block.num_tokens
                self.used_by_group[block.group] += 1
                self.filled_by_group[block.group] += block.num_tokens
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_count += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in order; those reaching 0 become free.

        Freed blocks that hold a cached prefix join the tail of the queue (evicted last, and
        in the order given); blocks holding nothing reusable go to the head, to be taken first.
        """
        watch = self.watch
        for block in blocks:
            if watch is not None:
                watch.changed.add(block.block_id)
            assert block.ref_count > 0, f"{block} released more often than referenced"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.num_filled_slots -= block.num_tokens
                self.used_by_group[block.group] -= 1
                self.filled_by_group[block.group] -= block.num_tokens
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
                    self.num_cached_free += 1

    def set_num_tokens(self, block: Block, num_tokens: int) -> None:
        """Record how many slots of an in-use block now hold a token."""
        assert block.ref_count > 0, f"{block} is not in use"
        self.num_filled_slots += num_tokens - block.num_tokens
        self.filled_by_group[block.group] += num_tokens - block.num_tokens
        block.num_tokens = num_tokens

    def lookup(self, block_hash: Hashable) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def cache(self, block: Block, block_hash: Hashable) -> bool:
        """Make a full, in-use block findable by its content hash; True if it now is.

        If another block already holds the same content, the first one stays the cached copy
        and `block` remains private: it is simply not findable.
        """
        assert block.ref_count > 0, f"{block} is not in use"  # so it counts in no free figure
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def uncache(self, block: Block) -> None:
        """Make a block unfindable again (its content is not what its hash says)."""
        if block.ref_count == 0 and block.block_hash is not None:
            # A free block holding nothing reusable moves to the head of the queue.
            self.free_queue.remove(block)
            self.free_queue.appendleft(block)
        self._forget(block)

    def reset_cache(self) -> bool:
        """Forget every cached prefix; only when no block is in use (False, and nothing done, if one is)."""
        if self.num_used:
            return False
        for block in list(self.cached.values()):
            self._forget(block)
        return True

    def _forget(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.watch is not None:
                self.watch.changed.add(block.block_id)
            del self.cached[block.block_hash]
            block.block_hash = None
            block.num_hits = 0
            if block.ref_count == 0:
                self.num_cached_free -= 1
