"""Per-request block tables over the block pool: admit, grow, fork, copy-on-write, free.

A request's block table maps its logical blocks to physical ones: the token at position `t`
lives in block `table[t // block_size]`, slot `t % block_size`. Tables are always exactly as
long as the tokens they hold need (`ceil(num_tokens / block_size)` blocks), so waste is the
unfilled tail of the last block.

Every allocating call is all-or-nothing: when the pool cannot cover it, nothing changes and
the caller gets `None`, so the scheduler can preempt someone and try again.

With a KV tier behind the pool (`tier`), the prefix cache reaches into it: a lookup that runs past
the pool's cached blocks goes on in the tier, and the blocks found there in memory are allocated
and loaded (their payloads ride in the step's plan, `take_transfers`). Admission never waits for a
file: `prefetch` asks the tier to bring the blocks an admission would load into memory first, and
the caller holds the request back until that is done (or its deadline passes: what is not in
memory then is computed). Blocks reach the tier by the policy
given: a cached block as the pool evicts it, when it was hit at least `offload_min_hits` times
("evicted"; `offload_cached` applies the same rule to every cached block at shutdown), or every
full block once its step has computed it ("write_through"); and a preempted request's blocks on
request (`offload`, swap preemption). The tier is duck-typed: `hash in tier`;
`tier.read(hashes)`, the payloads of the leading blocks it holds in memory, with no I/O;
`tier.prefetch(hashes)`, a future that is done once the leading blocks it holds are in memory, or
None when there is nothing to wait for; `tier.read_timeout`, how long a request waits for that; and
`len(tier)`, the blocks it holds (for the live view).

A request's prefix-cache hashes live in a list its caller owns and passes to `admit` (the
engine keeps one per `Request`): the manager extends it in place as blocks fill, so each full
block is hashed once in the request's life, across failed admissions and preemptions.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from pagedserve.kv.block_pool import Block, BlockPool
from pagedserve.kv.sizes import cdiv
from pagedserve.kv.watch import request_label

RequestId = Hashable
BlockCopy = tuple[int, int]  # (source block id, destination block id)
BlockStore = tuple[int, bytes]  # (block id, its hash): copy the block's K/V to the tier
BlockLoad = tuple[int, Any]  # (block id, the tier's payload): copy the payload into the block


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: object = None) -> bytes:
    """Content hash of one full block, chained to the hash of the block before it.

    SHA-256, so two different token sequences never share a block by accident.
    """
    h = hashlib.sha256(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    if extra_keys is not None:
        h.update(repr(extra_keys).encode())
    return h.digest()


@dataclass(frozen=True)
class TierRead:
    """Blocks being read from the KV tier into memory for a request's admission (`prefetch`): the
    request waits until `future` is done or `deadline` (time.monotonic()) has passed."""

    future: Future
    deadline: float

    def over(self, now: float) -> bool:
        return self.future.done() or now >= self.deadline


@dataclass(frozen=True)
class KVCacheStats:
    total_blocks: int
    free_blocks: int
    used_blocks: int
    cached_free_blocks: int  # free, but still holding a prefix a later request can hit
    reserved_slots: int  # token slots in used blocks
    filled_slots: int  # of those, slots holding a token
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens found cached
    cow_copies: int
    offload_hits: int = 0  # of prefix_hits, tokens read from the KV tier
    offload_stored_blocks: int = 0  # blocks sent to the KV tier
    offload_loaded_blocks: int = 0  # blocks read back from it

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def waste(self) -> float:
        """Share of reserved token slots that hold no token (internal fragmentation)."""
        return 1.0 - self.filled_slots / self.reserved_slots if self.reserved_slots else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class _Table:
    """What the manager knows about one request."""

    __slots__ = ("blocks", "block_ids", "num_tokens", "hashes", "num_offered", "extra_keys")

    def __init__(self, blocks: list[Block], num_tokens: int, hashes: list[bytes], num_offered: int,
                 extra_keys: object):
        self.blocks = blocks
        self.block_ids = [b.block_id for b in blocks]  # kept beside `blocks`: read every step
        self.num_tokens = num_tokens  # tokens with a slot reserved (computed or scheduled now)
        # Chained hashes of the request's leading full blocks (the caller's list, or the
        # table's own); may run ahead of the table, after a prefix lookup of the whole prompt.
        self.hashes = hashes
        self.num_offered = num_offered  # leading blocks already offered to the prefix cache
        self.extra_keys = extra_keys


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True, *,
                 tier: Any = None, offload_policy: str = "evicted", offload_min_hits: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if offload_policy not in ("write_through", "evicted"):
            raise ValueError(f"offload_policy must be 'write_through' or 'evicted', got {offload_policy!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.tier = tier if enable_prefix_caching else None  # keyed by the prefix cache's hashes
        self.write_through = offload_policy == "write_through"
        self.offload_min_hits = offload_min_hits
        self.pool.record_evictions = self.tier is not None and not self.write_through
        self._stores: list[BlockStore] = []  # for the next plan
        self._loads: list[BlockLoad] = []
        self._storing: set[bytes] = set()  # the hashes in _stores
        self.offload_hits = 0
        self.offload_stored_blocks = 0
        self.offload_loaded_blocks = 0
        self._tables: dict[RequestId, _Table] = {}
        # Blocks made findable since the last `confirm_cached()`: their hashes are registered
        # when a step is planned, before the forward pass writes their K/V.
        self._unconfirmed: list[Block] = []
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.cow_copies = 0

    # ---- queries -------------------------------------------------------------------------

    def __contains__(self, req_id: RequestId) -> bool:
        return req_id in self._tables

    def block_ids(self, req_id: RequestId, start: int = 0) -> list[int]:
        """The request's block table from logical block `start` on (a copy)."""
        return self._tables[req_id].block_ids[start:]

    def num_tokens(self, req_id: RequestId) -> int:
        return self._tables[req_id].num_tokens

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def find_cached_prefix(
        self, token_ids: Sequence[int], extra_keys: object = None, block_hashes: list[bytes] | None = None
    ) -> list[Block]:
        """The longest run of cached full blocks that starts `token_ids`.

        At least the last token is always left out, so the model still has one token to run
        and produce logits from. `block_hashes` (the chained hashes of `token_ids`' leading
        full blocks known so far) is reused, and extended with each block hashed here.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = [] if block_hashes is None else block_hashes
        return self._leading_blocks(token_ids, extra_keys, hashes, 0, self.pool.lookup)

    def _leading_blocks(self, token_ids: Sequence[int], extra_keys: object, hashes: list[bytes], start: int,
                        find) -> list:
        """`find(hash)` of each full block of `token_ids` from `start` on, up to the first it gives
        None for, never reaching the block of the last token. Hashes are made lazily: a miss ends
        the walk."""
        found = []
        for i in range(start, (len(token_ids) - 1) // self.block_size):
            self._hash_blocks(hashes, token_ids, i + 1, extra_keys)
            item = find(hashes[i])
            if item is None:
                break
            found.append(item)
        return found

    def prefetch(self, token_ids: Sequence[int], extra_keys: object = None,
                 block_hashes: list[bytes] | None = None) -> TierRead | None:
        """Start bringing into memory the tier's blocks that an admission of `token_ids` would load
        now (those past the pool's cached prefix), for the caller to wait on outside its step; None
        when there is nothing to wait for (no tier, no such block, all of them in memory already,
        or the tier reads nothing now). Changes no figure and no block: only `block_hashes` grows."""
        if self.tier is None:
            return None
        hashes = [] if block_hashes is None else block_hashes
        hit = self.find_cached_prefix(token_ids, extra_keys, hashes)
        in_tier = self._leading_blocks(token_ids, extra_keys, hashes, len(hit), lambda h: h if h in self.tier else None)
        future = self.tier.prefetch(in_tier) if in_tier else None
        return TierRead(future, time.monotonic() + self.tier.read_timeout) if future is not None else None

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (e.g. between benchmark runs). False while any request
        holds blocks: then nothing is forgotten."""
        return self.pool.reset_cache()

    # ---- allocation ----------------------------------------------------------------------

    def admit(
        self,
        req_id: RequestId,
        token_ids: Sequence[int],
        num_new_tokens: int | None = None,
        extra_keys: object = None,
        block_hashes: list[bytes] | None = None,
        read_cache: bool = True,
    ) -> int | None:
        """Give a new (or preempted) request a block table.

        Reuses the longest cached prefix, then reserves slots for up to `num_new_tokens` of the
        remaining tokens (all of them by default). `read_cache=False` skips the lookup, for a
        request that needs every prompt position computed (its logits); its full blocks are
        still offered to the cache. Returns how many tokens came from the prefix
        cache, or None (and changes nothing but `block_hashes`) when the pool cannot cover it.

        `block_hashes` is the request's own list of chained block hashes (empty at first; only
        valid for these `token_ids` and `extra_keys`, which may only grow). The manager extends
        it in place, also later in `grow`, so pass the same list on every admission attempt.
        """
        if req_id in self._tables:
            raise ValueError(f"request {req_id!r} already has a block table")
        if not token_ids:
            raise ValueError("cannot admit a request with no tokens")
        if num_new_tokens is not None and num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        hashes = [] if block_hashes is None else block_hashes
        hit = self.find_cached_prefix(token_ids, extra_keys, hashes) if read_cache else []
        in_tier = self._leading_blocks(token_ids, extra_keys, hashes, len(hit),
                                       lambda h: h if h in self.tier else None) if read_cache and self.tier else []
        num_revived = sum(1 for b in hit if b.ref_count == 0)
        if self._blocks_to_admit(len(token_ids), len(hit) + len(in_tier), num_new_tokens) - len(hit) \
                + num_revived > self.pool.num_free:
            return None
        # Taken only once the blocks are sure. The tier serves what it holds in memory (read ahead by
        # `prefetch`, or not written yet); the first block it holds only as a file, or that failed its
        # checks, ends the prefix there (fewer cached blocks never need more new ones).
        payloads = self.tier.read(in_tier) if in_tier else []
        num_cached = (len(hit) + len(payloads)) * self.block_size
        num_blocks = self._blocks_to_admit(len(token_ids), len(hit) + len(payloads), num_new_tokens)
        self.pool.touch(hit)  # hit blocks are full: their token count is already right
        for block in hit:
            block.num_hits += 1
        new_blocks = self.pool.allocate(num_blocks - len(hit))
        self._loads += [(block.block_id, payload) for block, payload in zip(new_blocks, payloads)]
        n = min(len(token_ids) - num_cached, num_new_tokens or len(token_ids))
        table = _Table(hit + new_blocks, num_cached + n, hashes, len(hit), extra_keys)
        self._tables[req_id] = table
        self._count_tokens(table, len(hit))
        if read_cache:
            self.prefix_queries += len(token_ids)
        self.prefix_hits += num_cached
        self.offload_hits += len(payloads) * self.block_size
        self.offload_loaded_blocks += len(payloads)
        self._cache_full_blocks(table, token_ids)  # the loaded blocks too: findable once the step has run
        watch = self.pool.watch
        if watch is not None:
            if hit or payloads:
                watch.add("prefix_hit", req_id, [b.block_id for b in hit] + [b.block_id for b in new_blocks[:len(payloads)]],
                          f"prefix cache hit: {num_cached} of {len(token_ids)} tokens"
                          + (f" ({len(payloads)} blocks read back from the KV tier)" if payloads else ""))
            watch.add("admit", req_id, table.block_ids, f"admitted with {table.num_tokens} tokens in "
                      f"{len(table.blocks)} blocks ({len(hit)} shared from the prefix cache)")
        return num_cached

    def _blocks_to_admit(self, num_tokens: int, num_cached_blocks: int, num_new_tokens: int | None) -> int:
        """The blocks a request of `num_tokens` tokens holds once admitted with this many cached."""
        num_cached = num_cached_blocks * self.block_size
        return cdiv(num_cached + min(num_tokens - num_cached, num_new_tokens or num_tokens), self.block_size)

    def blocks_needed_to_grow(self, req_id: RequestId, num_new_tokens: int) -> int:
        """Free blocks that `grow(req_id, num_new_tokens)` would take (copy-on-write included)."""
        table = self._tables[req_id]
        return cdiv(table.num_tokens + num_new_tokens, self.block_size) - len(table.blocks) + int(
            self._needs_copy_on_write(table)
        )

    def grow(
        self, req_id: RequestId, num_new_tokens: int, token_ids: Sequence[int] | None = None
    ) -> list[BlockCopy] | None:
        """Reserve slots for the request's next `num_new_tokens` tokens.

        A new block is taken exactly when a block boundary is crossed. If the first slot to be
        written lies in a block shared with another request, that block is first replaced by a
        private copy (copy-on-write); the returned (src, dst) pairs tell the model runner which
        tensors to copy before the step writes. `token_ids` (the request's tokens so far,
        including those being scheduled) lets blocks that become full join the prefix cache.
        Returns None, changing nothing, when the pool cannot cover it.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        table = self._tables[req_id]
        if self.blocks_needed_to_grow(req_id, num_new_tokens) > self.pool.num_free:
            return None
        copies = []
        if self._needs_copy_on_write(table):
            i = table.num_tokens // self.block_size
            shared = table.blocks[i]
            (private,) = self.pool.allocate(1)
            table.blocks[i] = private
            table.block_ids[i] = private.block_id
            self.pool.release([shared])
            copies.append((shared.block_id, private.block_id))
            self.cow_copies += 1
            if self.pool.watch is not None:
                self.pool.watch.add("cow", req_id, [shared.block_id, private.block_id],
                                    f"copy on write: block {shared.block_id} (still held by {shared.ref_count}) "
                                    f"copied to {private.block_id} before writing token {table.num_tokens}")
        first_written = table.num_tokens // self.block_size
        table.num_tokens += num_new_tokens
        new_blocks = self.pool.allocate(cdiv(table.num_tokens, self.block_size) - len(table.blocks))
        table.blocks += new_blocks
        table.block_ids += [b.block_id for b in new_blocks]
        self._count_tokens(table, first_written)
        if new_blocks and self.pool.watch is not None:
            self.pool.watch.add("grow", req_id, [b.block_id for b in new_blocks],
                                f"grew to {table.num_tokens} tokens: {len(new_blocks)} new block"
                                f"{'s' if len(new_blocks) > 1 else ''} (table of {len(table.blocks)})")
        if token_ids is not None:
            self._cache_full_blocks(table, token_ids)
        return copies

    def shrink(self, req_id: RequestId, num_tokens: int) -> None:
        """Give back the request's slots past its first `num_tokens` (a speculative step's rejected
        drafts): the blocks no longer needed return to the pool. Those slots were never offered to
        the prefix cache (a block is offered once full of known tokens, and drafts are not known
        tokens), so nothing unverified stays findable."""
        table = self._tables[req_id]
        if not 0 < num_tokens <= table.num_tokens:
            raise ValueError(f"cannot shrink request {req_id!r} from {table.num_tokens} to {num_tokens} tokens")
        assert table.num_offered <= num_tokens // self.block_size, "a cached block would lose its tokens"
        keep = cdiv(num_tokens, self.block_size)
        extra = table.blocks[keep:]
        del table.blocks[keep:]
        del table.block_ids[keep:]
        table.num_tokens = num_tokens
        self.pool.release(reversed(extra))
        self._count_tokens(table, num_tokens // self.block_size)

    def fork(self, parent_id: RequestId, child_id: RequestId, block_hashes: list[bytes] | None = None) -> None:
        """Give `child_id` a table sharing every block of `parent_id` (parallel sampling).

        The child's tokens match the parent's only as far as the table goes, so it inherits
        the hashes of the full blocks there: into `block_hashes`, the child's own list (whose
        contents are replaced), if given.
        """
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already has a block table")
        parent = self._tables[parent_id]
        self.pool.touch(parent.blocks)
        num_full = parent.num_tokens // self.block_size
        hashes = [] if block_hashes is None else block_hashes
        hashes[:] = parent.hashes[:num_full]
        self._tables[child_id] = _Table(
            list(parent.blocks), parent.num_tokens, hashes, min(parent.num_offered, num_full), parent.extra_keys
        )
        if self.pool.watch is not None:
            self.pool.watch.add("fork", child_id, parent.block_ids, f"forked from {request_label(parent_id)}: shares all "
                                f"{len(parent.blocks)} of its blocks ({parent.num_tokens} tokens)")

    def free(self, req_id: RequestId) -> None:
        """Drop the request's table; a no-op for a request that holds none.

        Blocks are released tail first, so when they become free the end of the request (the
        part least likely to be shared) is evicted before its prefix.
        """
        table = self._tables.pop(req_id, None)
        if table is not None:
            self.pool.release(reversed(table.blocks))
            if self.pool.watch is not None:
                kept = sum(1 for b in table.blocks if b.ref_count == 0 and b.block_hash is not None)
                self.pool.watch.add("free", req_id, table.block_ids, f"released {len(table.blocks)} blocks"
                                    + (f", {kept} kept as cached prefix" if kept else ""))

    def confirm_cached(self) -> None:
        """The step that fills the blocks cached since the last call has written their K/V (write
        through: those the tier lacks are queued for it; the core copies them out at once)."""
        if self.tier is not None and self.write_through:
            for block in self._unconfirmed:
                if block.block_hash is not None:
                    self._store(block.block_id, block.block_hash)
        self._unconfirmed.clear()

    def offload(self, req_id: RequestId) -> None:
        """Send the request's computed full blocks that the tier lacks to it (swap preemption:
        call before `free`; the next plan copies them out before any step overwrites them)."""
        if self.tier is None:
            return
        table = self._tables[req_id]
        for i in range(table.num_offered):
            self._store(table.block_ids[i], table.hashes[i])
        if self.pool.watch is not None:
            self.pool.watch.add("offload", req_id, table.block_ids[:table.num_offered],
                                f"swapped out: {table.num_offered} full blocks to the KV tier")

    def offload_cached(self) -> None:
        """Send every cached block the tier lacks to it, by the policy's rule for an evicted block
        (hit at least `offload_min_hits` times): the pool is about to go away (shutdown)."""
        if self.tier is None:
            return
        for block_hash, block in self.pool.cached.items():
            if self.write_through or block.num_hits >= self.offload_min_hits:
                self._store(block.block_id, block_hash)

    def take_transfers(self) -> tuple[list[BlockStore], list[BlockLoad]]:
        """The tier transfers a plan carries, to be done before its forward pass writes anything:
        the stores first (a block evicted to the tier may be reused in the same step), then the
        loads."""
        for block_id, block_hash, hits in self.pool.evicted:
            if hits >= self.offload_min_hits:
                self._store(block_id, block_hash)
        self.pool.evicted.clear()
        stores, loads = self._stores, self._loads
        self._stores, self._loads = [], []
        self._storing.clear()
        return stores, loads

    def _store(self, block_id: int, block_hash: bytes) -> None:
        if block_hash not in self.tier and block_hash not in self._storing:
            self._storing.add(block_hash)
            self._stores.append((block_id, block_hash))
            self.offload_stored_blocks += 1

    def discard_unconfirmed(self) -> None:
        """That step failed: the blocks cached since the last `confirm_cached()` may hold
        anything, so no later request may hit them. (Call before freeing their tables, so that
        they go back to the free queue as holding nothing reusable.)"""
        for block in self._unconfirmed:
            self.pool.uncache(block)
        self._unconfirmed.clear()

    # ---- internals -----------------------------------------------------------------------

    def _needs_copy_on_write(self, table: _Table) -> bool:
        """Whether the next token's slot lies in a partially filled block someone else holds."""
        if table.num_tokens % self.block_size == 0:
            return False  # the next token starts a fresh block
        return table.blocks[table.num_tokens // self.block_size].ref_count > 1

    def _count_tokens(self, table: _Table, first: int) -> None:
        """Tell the pool how many tokens the table's blocks from index `first` on now hold."""
        bs = self.block_size
        for i in range(first, len(table.blocks)):
            self.pool.set_num_tokens(table.blocks[i], min(bs, table.num_tokens - i * bs))

    def _hash_blocks(self, hashes: list[bytes], token_ids: Sequence[int], num_blocks: int, extra_keys: object) -> None:
        """Extend `hashes` to the first `num_blocks` full blocks of `token_ids`."""
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs], extra_keys))

    def _cache_full_blocks(self, table: _Table, token_ids: Sequence[int]) -> None:
        if not self.enable_prefix_caching:
            return
        num_full = min(table.num_tokens, len(token_ids)) // self.block_size
        self._hash_blocks(table.hashes, token_ids, num_full, table.extra_keys)
        for i in range(table.num_offered, num_full):
            if self.pool.cache(table.blocks[i], table.hashes[i]):
                self._unconfirmed.append(table.blocks[i])
        table.num_offered = max(table.num_offered, num_full)

    # ---- figures -------------------------------------------------------------------------

    def held_block_ids(self) -> set[int]:
        """Every block some table holds (O(blocks held))."""
        return {b for table in self._tables.values() for b in table.block_ids}

    @property
    def watched(self) -> bool:
        """Whether a live view records what happens (kv/watch.py)."""
        return self.pool.watch is not None

    def note(self, kind: str, req_id: RequestId, text: str) -> None:
        """Record an event about a request's blocks that the caller decided (a preemption), while watched."""
        if self.pool.watch is not None:
            self.pool.watch.add(kind, req_id, self._tables[req_id].block_ids if req_id in self._tables else [], text)

    def stats(self) -> KVCacheStats:
        """O(1): every figure is a counter kept by the pool or here (the tests check them all
        against a walk over every table, tests/kv/stats_oracle.py)."""
        pool = self.pool
        return KVCacheStats(
            total_blocks=pool.num_blocks,
            free_blocks=pool.num_free,
            used_blocks=pool.num_used,
            cached_free_blocks=pool.num_cached_free,
            reserved_slots=pool.num_used * self.block_size,
            filled_slots=pool.num_filled_slots,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            cow_copies=self.cow_copies,
            offload_hits=self.offload_hits,
            offload_stored_blocks=self.offload_stored_blocks,
            offload_loaded_blocks=self.offload_loaded_blocks,
        )
