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
import threading
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


NULL_BLOCK_ID = 0  # what a table entry a window no longer reads points at (masked, never written)
CacheKey = Hashable  # the prefix cache's key of a block: its hash (group 0) or (group, hash)


@dataclass(frozen=True)
class GroupStats:
    """One KV cache group's share of the pool."""

    window: int | None  # None: full attention
    used_blocks: int
    filled_slots: int
    block_size: int

    @property
    def waste(self) -> float:
        reserved = self.used_blocks * self.block_size
        return 1.0 - self.filled_slots / reserved if reserved else 0.0


class _Table:
    """What the manager knows about one request: a block table per KV cache group."""

    __slots__ = ("groups", "group_ids", "num_tokens", "hashes", "num_offered", "extra_keys")

    def __init__(self, groups: list[list[Block | None]], num_tokens: int, hashes: list[bytes], num_offered: int,
                 extra_keys: object):
        # Per group, its logical blocks; None where a block lies wholly before the group's window.
        self.groups = groups
        self.group_ids = [[NULL_BLOCK_ID if b is None else b.block_id for b in blocks] for blocks in groups]
        self.num_tokens = num_tokens  # tokens with a slot reserved (computed or scheduled now)
        # Chained hashes of the request's leading full blocks (the caller's list, or the
        # table's own); may run ahead of the table, after a prefix lookup of the whole prompt.
        self.hashes = hashes
        self.num_offered = num_offered  # leading blocks already offered to the prefix cache
        self.extra_keys = extra_keys

    @property
    def blocks(self) -> list[Block | None]:
        """The first group's table (the only one of a model with one kind of layer)."""
        return self.groups[0]

    @property
    def block_ids(self) -> list[int]:
        return self.group_ids[0]

    def held(self) -> list[Block]:
        """Every block the table holds, group by group."""
        return [b for blocks in self.groups for b in blocks if b is not None]


@dataclass
class _Hit:
    """A prefix-cache hit of `num_blocks` leading blocks: per group, the index of its first block
    the hit gives (a sliding group needs only its last window) and, from there on, each block taken
    from the pool (a Block) or loaded from the tier (its tier key)."""

    num_blocks: int
    starts: list[int]
    entries: list[list[Block | bytes]]

    def pool_blocks(self) -> list[Block]:
        return [e for entries in self.entries for e in entries if isinstance(e, Block)]

    def num_loads(self) -> int:
        return sum(1 for entries in self.entries for e in entries if not isinstance(e, Block))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True, *,
                 tier: Any = None, offload_policy: str = "evicted", offload_min_hits: int = 0,
                 windows: Sequence[int | None] = (None,)):
        """windows: one entry per KV cache group (kv/groups.py), its sliding window or None (full
        attention); by default one full-attention group."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if offload_policy not in ("write_through", "evicted"):
            raise ValueError(f"offload_policy must be 'write_through' or 'evicted', got {offload_policy!r}")
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must name at least one group, each None or a positive window: {windows!r}")
        self.block_size = block_size
        self.windows = tuple(windows)
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching, num_groups=len(self.windows))
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

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    # ---- queries -------------------------------------------------------------------------

    def __contains__(self, req_id: RequestId) -> bool:
        return req_id in self._tables

    def block_ids(self, req_id: RequestId, start: int = 0, group: int = 0) -> list[int]:
        """One group's block table of the request from logical block `start` on (a copy);
        NULL_BLOCK_ID where a block fell out of a sliding window."""
        return self._tables[req_id].group_ids[group][start:]

    def group_block_ids(self, req_id: RequestId, start: int = 0) -> list[list[int]]:
        """Every group's `block_ids` from logical block `start` on."""
        return [ids[start:] for ids in self._tables[req_id].group_ids]

    def num_tokens(self, req_id: RequestId) -> int:
        return self._tables[req_id].num_tokens

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def find_cached_prefix(
        self, token_ids: Sequence[int], extra_keys: object = None, block_hashes: list[bytes] | None = None
    ) -> list[Block]:
        """The longest cached prefix of `token_ids` every group can serve, as the first group's
        blocks of it (a sliding group's: those of its last window).

        At least the last token is always left out, so the model still has one token to run
        and produce logits from. `block_hashes` (the chained hashes of `token_ids`' leading
        full blocks known so far) is reused, and extended with each block hashed here.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = [] if block_hashes is None else block_hashes
        return self._find_hit(token_ids, extra_keys, hashes, use_tier=False).entries[0]

    def _key(self, group: int, block_hash: bytes) -> CacheKey:
        """The prefix cache's key of a block of `group` holding the tokens `block_hash` names."""
        return block_hash if group == 0 else (group, block_hash)

    @staticmethod
    def _tier_key(key: CacheKey) -> bytes:
        """The tier's 32-byte name of the block a cache key names."""
        if isinstance(key, bytes):
            return key
        group, block_hash = key
        return hashlib.sha256(block_hash + group.to_bytes(4, "little")).digest()

    def _find_hit(self, token_ids: Sequence[int], extra_keys: object, hashes: list[bytes], use_tier: bool,
                  unavailable: frozenset = frozenset()) -> _Hit:
        """The longest prefix of whole blocks that every group can serve from the pool (or, with
        `use_tier`, from the tier too, except the tier keys in `unavailable`): a full-attention group
        needs every block before the hit point, a sliding group the blocks its window reads from
        there. Hashes are made lazily; the block of the last token is never part of a hit."""
        bs, tier = self.block_size, self.tier if use_tier else None
        limit = (len(token_ids) - 1) // bs

        def find(g: int, i: int) -> Block | bytes | None:
            key = self._key(g, hashes[i])
            block = self.pool.lookup(key)
            if block is not None or tier is None:
                return block
            name = self._tier_key(key)
            return name if name in tier and name not in unavailable else None

        full = [g for g, w in enumerate(self.windows) if w is None]
        found: dict[tuple[int, int], Block | bytes] = {}
        reach = 0  # blocks every full group can serve
        while reach < limit:
            self._hash_blocks(hashes, token_ids, reach + 1, extra_keys)
            items = [find(g, reach) for g in full]
            if any(item is None for item in items):
                break
            found.update(((g, reach), item) for g, item in zip(full, items))
            reach += 1
        if len(full) == len(self.windows):
            num = reach
        else:  # the longest hit point up to `reach` at which every sliding group has its window cached
            if not full:
                self._hash_blocks(hashes, token_ids, limit, extra_keys)
            num = reach
            while num > 0:
                ok = True
                for g, w in enumerate(self.windows):
                    if w is None:
                        continue
                    for i in range(self._window_start(g, num * bs), num):
                        if (g, i) not in found:
                            item = find(g, i)
                            if item is None:
                                ok = False
                                break
                            found[(g, i)] = item
                    if not ok:
                        break
                if ok:
                    break
                num -= 1
        starts = [self._window_start(g, num * bs) for g in range(self.num_groups)]
        entries = [[found[(g, i)] for i in range(starts[g], num)] for g in range(self.num_groups)]
        return _Hit(num, starts, entries)

    def _window_start(self, group: int, position: int) -> int:
        """The first block a query at `position` (or later) can read in `group`: 0 for full attention."""
        window = self.windows[group]
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def prefetch(self, token_ids: Sequence[int], extra_keys: object = None,
                 block_hashes: list[bytes] | None = None) -> TierRead | None:
        """Start bringing into memory the tier's blocks that an admission of `token_ids` would load
        now (those the pool's cached prefix lacks), for the caller to wait on outside its step; None
        when there is nothing to wait for (no tier, no such block, all of them in memory already,
        or the tier reads nothing now). Changes no figure and no block: only `block_hashes` grows."""
        if self.tier is None:
            return None
        hashes = [] if block_hashes is None else block_hashes
        hit = self._find_hit(token_ids, extra_keys, hashes, use_tier=True)
        futures = []
        for entries in hit.entries:
            names = [e for e in entries if not isinstance(e, Block)]
            future = self.tier.prefetch(names) if names else None
            if future is not None:
                futures.append(future)
        if not futures:
            return None
        return TierRead(_all_done(futures), time.monotonic() + self.tier.read_timeout)

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
        """Give a new (or preempted) request a block table in every group.

        Reuses the longest cached prefix every group can serve, then reserves slots for up to
        `num_new_tokens` of the remaining tokens (all of them by default). `read_cache=False` skips
        the lookup, for a request that needs every prompt position computed (its logits); its full
        blocks are still offered to the cache. Returns how many tokens came from the prefix
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
        if read_cache and self.enable_prefix_caching:
            hit = self._find_hit(token_ids, extra_keys, hashes, use_tier=self.tier is not None)
        else:
            hit = _Hit(0, [0] * self.num_groups, [[] for _ in self.windows])
        if not self._admission_fits(len(token_ids), hit, num_new_tokens):
            return None
        # Taken only once the blocks are sure. The tier serves what it holds in memory (read ahead by
        # `prefetch`, or not written yet); a block it holds only as a file, or that failed its
        # checks, is not part of the hit: the hit is found again without it.
        payloads: dict[bytes, Any] = {}
        # Kept across rounds: a shorter hit's sliding windows read other blocks than the longer
        # hit's, and that longer hit must not come back (each round then rules out a new name).
        unavailable: set[bytes] = set()
        while hit.num_loads():
            missing = set()
            for entries in hit.entries:
                names = [e for e in entries if not isinstance(e, Block) and e not in payloads]
                if names:
                    got = self.tier.read(names)
                    payloads.update(zip(names, got))
                    missing.update(names[len(got):])
            if not missing:
                break
            unavailable |= missing | {n for n in payloads if payloads[n] is None}
            hit = self._find_hit(token_ids, extra_keys, hashes, use_tier=True, unavailable=frozenset(unavailable))
            if not self._admission_fits(len(token_ids), hit, num_new_tokens):
                return None
        num_cached = hit.num_blocks * self.block_size
        n = min(len(token_ids) - num_cached, num_new_tokens or len(token_ids))
        num_tokens = num_cached + n
        hit_blocks = hit.pool_blocks()
        self.pool.touch(hit_blocks)  # hit blocks are full: their token count is already right
        for block in hit_blocks:
            block.num_hits += 1
        groups, first_loaded, num_loaded = [], hit.num_blocks, 0
        for g, (start, entries) in enumerate(zip(hit.starts, hit.entries)):
            size = cdiv(num_tokens, self.block_size)
            fresh = iter(self.pool.allocate(size - start - sum(1 for e in entries if isinstance(e, Block)), g))
            blocks: list[Block | None] = [None] * start
            for i, entry in enumerate(entries):
                if isinstance(entry, Block):
                    blocks.append(entry)
                else:  # loaded from the tier into a new block
                    block = next(fresh)
                    self._loads.append((block.block_id, payloads[entry]))
                    first_loaded = min(first_loaded, start + i)
                    num_loaded += 1
                    blocks.append(block)
            groups.append(blocks + list(fresh))
        table = _Table(groups, num_tokens, hashes, first_loaded, extra_keys)
        self._tables[req_id] = table
        self._count_tokens(table, 0)
        if read_cache:
            self.prefix_queries += len(token_ids)
        self.prefix_hits += num_cached
        self.offload_hits += (hit.num_blocks - first_loaded) * self.block_size  # the hit's tokens past the pool's
        self.offload_loaded_blocks += num_loaded
        self._cache_full_blocks(table, token_ids)  # the loaded blocks too: findable once the step has run
        watch = self.pool.watch
        if watch is not None:
            if hit.num_blocks:
                watch.add("prefix_hit", req_id, hit_ids(table, hit),
                          f"prefix cache hit: {num_cached} of {len(token_ids)} tokens"
                          + (f" ({num_loaded} blocks read back from the KV tier)" if num_loaded else ""))
            watch.add("admit", req_id, [b.block_id for b in table.held()], f"admitted with {table.num_tokens} "
                      f"tokens in {len(table.held())} blocks ({len(hit_blocks)} shared from the prefix cache)")
        return num_cached

    def _admission_fits(self, num_tokens: int, hit: _Hit, num_new_tokens: int | None) -> bool:
        """Whether the pool can give a request of `num_tokens` tokens its tables with this hit."""
        num_cached = hit.num_blocks * self.block_size
        size = cdiv(num_cached + min(num_tokens - num_cached, num_new_tokens or num_tokens), self.block_size)
        hit_blocks = hit.pool_blocks()
        needed = sum(size - start for start in hit.starts) - len(hit_blocks)
        return needed + sum(1 for b in hit_blocks if b.ref_count == 0) <= self.pool.num_free

    def blocks_needed_to_grow(self, req_id: RequestId, num_new_tokens: int) -> int:
        """Free blocks that `grow(req_id, num_new_tokens)` would take (copy-on-write included)."""
        table = self._tables[req_id]
        size = cdiv(table.num_tokens + num_new_tokens, self.block_size)
        return sum(size - len(blocks) + int(self._needs_copy_on_write(table, g))
                   for g, blocks in enumerate(table.groups))

    def grow(
        self, req_id: RequestId, num_new_tokens: int, token_ids: Sequence[int] | None = None
    ) -> list[BlockCopy] | None:
        """Reserve slots for the request's next `num_new_tokens` tokens.

        First, each sliding-window group lets go of the blocks that lie wholly before the window of
        the first new token (they stay cached, to be evicted, where the prefix cache holds them).
        Then a new block is taken exactly when a block boundary is crossed. If the first slot to be
        written lies in a block shared with another request, that block is first replaced by a
        private copy (copy-on-write); the returned (src, dst) pairs tell the model runner which
        tensors to copy before the step writes. `token_ids` (the request's tokens so far,
        including those being scheduled) lets blocks that become full join the prefix cache.
        Returns None, changing nothing more, when the pool cannot cover it.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        table = self._tables[req_id]
        self._drop_behind_windows(req_id, table)
        if self.blocks_needed_to_grow(req_id, num_new_tokens) > self.pool.num_free:
            return None
        copies = []
        first_written = table.num_tokens // self.block_size
        for g, blocks in enumerate(table.groups):
            if self._needs_copy_on_write(table, g):
                shared = blocks[first_written]
                (private,) = self.pool.allocate(1, g)
                blocks[first_written] = private
                table.group_ids[g][first_written] = private.block_id
                self.pool.release([shared])
                copies.append((shared.block_id, private.block_id))
                self.cow_copies += 1
                if self.pool.watch is not None:
                    self.pool.watch.add("cow", req_id, [shared.block_id, private.block_id],
                                        f"copy on write: block {shared.block_id} (still held by {shared.ref_count}) "
                                        f"copied to {private.block_id} before writing token {table.num_tokens}")
        table.num_tokens += num_new_tokens
        size = cdiv(table.num_tokens, self.block_size)
        new_ids = []
        for g, blocks in enumerate(table.groups):
            new_blocks = self.pool.allocate(size - len(blocks), g)
            blocks += new_blocks
            table.group_ids[g] += [b.block_id for b in new_blocks]
            new_ids += [b.block_id for b in new_blocks]
        self._count_tokens(table, first_written)
        if new_ids and self.pool.watch is not None:
            self.pool.watch.add("grow", req_id, new_ids,
                                f"grew to {table.num_tokens} tokens: {len(new_ids)} new block"
                                f"{'s' if len(new_ids) > 1 else ''} (table of {size})")
        if token_ids is not None:
            self._cache_full_blocks(table, token_ids)
        return copies

    def _drop_behind_windows(self, req_id: RequestId, table: _Table) -> None:
        """Release each sliding group's blocks that no query from the table's next token on can read."""
        dropped = []
        for g, blocks in enumerate(table.groups):
            if self.windows[g] is None:
                continue
            end = min(self._window_start(g, table.num_tokens), len(blocks))
            for i in range(end - 1, -1, -1):
                if blocks[i] is None:
                    break  # those before were dropped already
                dropped.append(blocks[i])
                blocks[i] = None
                table.group_ids[g][i] = NULL_BLOCK_ID
        if dropped:
            self.pool.release(reversed(dropped))  # the oldest become free first
            if self.pool.watch is not None:
                self.pool.watch.add("slide", req_id, [b.block_id for b in dropped],
                                    f"{len(dropped)} block{'s' if len(dropped) > 1 else ''} left the sliding window")

    def shrink(self, req_id: RequestId, num_tokens: int) -> None:
        """Give back the request's slots past its first `num_tokens` (a speculative step's rejected
        drafts): the blocks no longer needed return to the pool. Those slots were never offered to
        the prefix cache (a block is offered once full of known tokens, and drafts are not known
        tokens), so nothing unverified stays findable. A request shrinks to no fewer tokens than it
        held before that grow (ValueError where it cannot): a sliding group let go of the blocks
        behind the window of the grow's first token, and the grow copied a block it shared with a
        fork before writing into it, so the block its last token lies in is its own."""
        table = self._tables[req_id]
        if not 0 < num_tokens <= table.num_tokens:
            raise ValueError(f"cannot shrink request {req_id!r} from {table.num_tokens} to {num_tokens} tokens")
        keep = cdiv(num_tokens, self.block_size)
        for g, blocks in enumerate(table.groups):
            first = self._window_start(g, num_tokens)
            if first < keep and blocks[first] is None:  # its next token would have no block to go to
                raise ValueError(f"cannot shrink request {req_id!r} to {num_tokens} tokens: the sliding window "
                                 f"({self.windows[g]}) of its next token reads blocks already let go of")
            if num_tokens % self.block_size and blocks[keep - 1].ref_count > 1:
                # Its token count is every holder's: the others still hold the slots past num_tokens.
                raise ValueError(f"cannot shrink request {req_id!r} to {num_tokens} tokens: its last block "
                                 f"{blocks[keep - 1].block_id} is shared with another request")
        assert table.num_offered <= num_tokens // self.block_size, "a cached block would lose its tokens"
        for g, blocks in enumerate(table.groups):
            extra = [b for b in blocks[keep:] if b is not None]
            del blocks[keep:]
            del table.group_ids[g][keep:]
            self.pool.release(reversed(extra))
        table.num_tokens = num_tokens
        self._count_tokens(table, num_tokens // self.block_size)

    def fork(self, parent_id: RequestId, child_id: RequestId, block_hashes: list[bytes] | None = None) -> None:
        """Give `child_id` tables sharing every block of `parent_id` (parallel sampling).

        The child's tokens match the parent's only as far as the table goes, so it inherits
        the hashes of the full blocks there: into `block_hashes`, the child's own list (whose
        contents are replaced), if given.
        """
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already has a block table")
        parent = self._tables[parent_id]
        held = parent.held()
        self.pool.touch(held)
        num_full = parent.num_tokens // self.block_size
        hashes = [] if block_hashes is None else block_hashes
        hashes[:] = parent.hashes[:num_full]
        self._tables[child_id] = _Table(
            [list(blocks) for blocks in parent.groups], parent.num_tokens, hashes,
            min(parent.num_offered, num_full), parent.extra_keys
        )
        if self.pool.watch is not None:
            self.pool.watch.add("fork", child_id, [b.block_id for b in held], f"forked from "
                                f"{request_label(parent_id)}: shares all {len(held)} of its blocks "
                                f"({parent.num_tokens} tokens)")

    def free(self, req_id: RequestId) -> None:
        """Drop the request's tables; a no-op for a request that holds none.

        Blocks are released tail first, so when they become free the end of the request (the
        part least likely to be shared) is evicted before its prefix; across groups too (logical
        block by logical block), since a hit needs every group's blocks up to its end.
        """
        table = self._tables.pop(req_id, None)
        if table is not None:
            self.pool.release(blocks[i] for i in reversed(range(cdiv(table.num_tokens, self.block_size)))
                              for blocks in table.groups if blocks[i] is not None)
            if self.pool.watch is not None:
                held = table.held()
                kept = sum(1 for b in held if b.ref_count == 0 and b.block_hash is not None)
                self.pool.watch.add("free", req_id, [b.block_id for b in held], f"released {len(held)} blocks"
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
        sent = []
        for g, blocks in enumerate(table.groups):
            for i in range(table.num_offered):
                if blocks[i] is not None:
                    self._store(blocks[i].block_id, self._key(g, table.hashes[i]))
                    sent.append(blocks[i].block_id)
        if self.pool.watch is not None:
            self.pool.watch.add("offload", req_id, sent, f"swapped out: {len(sent)} full blocks to the KV tier")

    def offload_cached(self) -> None:
        """Send every cached block the tier lacks to it, by the policy's rule for an evicted block
        (hit at least `offload_min_hits` times): the pool is about to go away (shutdown)."""
        if self.tier is None:
            return
        for key, block in self.pool.cached.items():
            if self.write_through or block.num_hits >= self.offload_min_hits:
                self._store(block.block_id, key)

    def take_transfers(self) -> tuple[list[BlockStore], list[BlockLoad]]:
        """The tier transfers a plan carries, to be done before its forward pass writes anything:
        the stores first (a block evicted to the tier may be reused in the same step), then the
        loads."""
        for block_id, key, hits in self.pool.evicted:
            if hits >= self.offload_min_hits:
                self._store(block_id, key)
        self.pool.evicted.clear()
        stores, loads = self._stores, self._loads
        self._stores, self._loads = [], []
        self._storing.clear()
        return stores, loads

    def _store(self, block_id: int, key: CacheKey) -> None:
        name = self._tier_key(key)
        if name not in self.tier and name not in self._storing:
            self._storing.add(name)
            self._stores.append((block_id, name))
            self.offload_stored_blocks += 1

    def discard_unconfirmed(self) -> None:
        """That step failed: the blocks cached since the last `confirm_cached()` may hold
        anything, so no later request may hit them. (Call before freeing their tables, so that
        they go back to the free queue as holding nothing reusable.)"""
        for block in self._unconfirmed:
            self.pool.uncache(block)
        self._unconfirmed.clear()

    # ---- internals -----------------------------------------------------------------------

    def _needs_copy_on_write(self, table: _Table, group: int = 0) -> bool:
        """Whether the next token's slot lies in a partially filled block someone else holds."""
        if table.num_tokens % self.block_size == 0:
            return False  # the next token starts a fresh block
        block = table.groups[group][table.num_tokens // self.block_size]
        return block is not None and block.ref_count > 1

    def _count_tokens(self, table: _Table, first: int) -> None:
        """Tell the pool how many tokens the tables' blocks from index `first` on now hold."""
        bs = self.block_size
        for blocks in table.groups:
            for i in range(first, len(blocks)):
                if blocks[i] is not None:
                    self.pool.set_num_tokens(blocks[i], min(bs, table.num_tokens - i * bs))

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
        for g, blocks in enumerate(table.groups):
            for i in range(table.num_offered, num_full):
                block = blocks[i]
                if block is not None and self.pool.cache(block, self._key(g, table.hashes[i])):
                    self._unconfirmed.append(block)
        table.num_offered = max(table.num_offered, num_full)

    # ---- figures -------------------------------------------------------------------------

    def held_block_ids(self) -> set[int]:
        """Every block some table holds (O(blocks held))."""
        return {b.block_id for table in self._tables.values() for b in table.held()}

    @property
    def watched(self) -> bool:
        """Whether a live view records what happens (kv/watch.py)."""
        return self.pool.watch is not None

    def note(self, kind: str, req_id: RequestId, text: str) -> None:
        """Record an event about a request's blocks that the caller decided (a preemption), while watched."""
        if self.pool.watch is not None:
            held = [b.block_id for b in self._tables[req_id].held()] if req_id in self._tables else []
            self.pool.watch.add(kind, req_id, held, text)

    def group_stats(self) -> list[GroupStats]:
        """Each group's blocks in use and the token slots of those that hold a token (O(groups): the
        pool's counters)."""
        pool = self.pool
        return [GroupStats(w, u, f, self.block_size)
                for w, u, f in zip(self.windows, pool.used_by_group, pool.filled_by_group)]

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


def hit_ids(table: _Table, hit: _Hit) -> list[int]:
    """The block ids of a request's table that its prefix-cache hit gave (from the pool or the tier)."""
    return [table.group_ids[g][i] for g, start in enumerate(hit.starts) for i in range(start, hit.num_blocks)]


def _all_done(futures: list[Future]) -> Future:
    """A future done once every one of `futures` is."""
    if len(futures) == 1:
        return futures[0]
    done: Future = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            done.set_result(None)

    for future in futures:
        future.add_done_callback(one_done)
    return done
