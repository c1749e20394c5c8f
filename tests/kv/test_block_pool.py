import pytest

from pagedserve.kv.block_pool import Block, BlockPool, FreeBlockQueue


def ids(queue):
    return [b.block_id for b in queue]


def test_free_queue_keeps_order_and_removes_from_the_middle():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.appendleft(blocks[0])
    assert ids(q) == [0, 1, 3, 4, 2]


def test_free_queue_rejects_double_insert_and_empty_pop():
    b = Block(0)
    q = FreeBlockQueue([b])
    with pytest.raises(AssertionError):
        q.append(b)
    q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_allocate_takes_lru_blocks_and_release_returns_them():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert (a.block_id, b.block_id) == (0, 1)
    assert a.ref_count == b.ref_count == 1
    assert pool.num_free == 2 and pool.num_used == 2
    pool.release([a, b])
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="only 4 free"):
        pool.allocate(5)


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"A")
    pool.release([a, b])  # a keeps its hash: it goes to the tail; b holds nothing: to the head
    assert ids(pool.free_queue) == [1, 0]
    (taken,) = pool.allocate(1)
    assert taken is b
    assert pool.lookup(b"A") is a


def test_cached_block_is_evicted_when_reused_and_revived_when_touched():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, b"A")
    pool.release([a])
    assert pool.num_cached_free == 1
    pool.touch([a])  # revive straight out of the middle of the queue
    assert a.ref_count == 1 and pool.num_free == 0
    pool.release([a, b])
    pool.allocate(2)  # reuses both, so the hash must be forgotten
    assert pool.lookup(b"A") is None and a.block_hash is None


def test_reset_cache_forgets_every_prefix_only_when_no_block_is_used():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, b"A")
    pool.cache(b, b"B")
    pool.release([a])
    assert not pool.reset_cache() and pool.lookup(b"A") is a  # b is still in use
    pool.release([b])
    assert pool.reset_cache()
    assert pool.lookup(b"A") is None and pool.lookup(b"B") is None and pool.num_cached_free == 0
    assert pool.num_free == 3


def test_first_block_with_a_hash_stays_the_cached_copy():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, b"X")
    pool.cache(b, b"X")
    assert pool.lookup(b"X") is a and b.block_hash is None


def test_caching_disabled_never_finds_anything():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache(a, b"A")
    assert pool.lookup(b"A") is None


def test_release_below_zero_is_a_bug():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.release([a])
    with pytest.raises(AssertionError):
        pool.release([a])
