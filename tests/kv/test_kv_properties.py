"""Stateful property test: random admit / grow / fork / speculate / free sequences keep every
invariant of the memory model, with the prefix cache on and off, for one KV cache group and for
layouts of several (full attention and sliding windows sharing the pool).

The test keeps its own picture of physical memory (what each slot holds) and writes each scheduled
token through every group's block table, applying the copy-on-write copies the manager reports
first. A group writes its tokens as values of its own (`stored`), so a table that points at another
group's block reads wrong values. Reading every request back through its tables then checks
isolation: a request only ever sees its own tokens, including in blocks it got from the prefix
cache or shares after a fork, at every position of a full-attention group and at every position a
sliding group still keeps. A sliding group keeps exactly the blocks from the one holding the oldest
position its window reads for the first token of the request's last step (admission: the first
token computed; grow: the first new token), so no entry a live window reads is let go of, and
nothing behind it is kept.

After every operation, each figure of `stats()` and `group_stats()` (counters) must equal what
walking every table gives (`walked_stats`, `walked_group_stats`), each request's block-hash list
must be the hash chain of its tokens, and an admission's prefix hit must be the longest one every
group can serve from the pool's cache (recomputed from the cache map). A call that fails for want
of blocks changes nothing (`grow`: but the blocks behind the windows, which it lets go of first).
"""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from pagedserve.kv import KVCacheManager, hash_block
from pagedserve.kv.groups import KVLayout
from pagedserve.kv.kv_cache_manager import NULL_BLOCK_ID
from tests.kv.stats_oracle import walked_group_stats, walked_stats

BLOCK_SIZE = 4
NUM_BLOCKS = 12
# A tiny vocabulary and a shared opening make prefix-cache hits frequent.
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=20)
openings = st.sampled_from([[], [0, 1, 2, 0], [0, 1, 2, 0, 1, 1, 2, 2]])
extra_keys = st.sampled_from([None, None, "lora-1"])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def first_kept_block(window: int | None, position: int) -> int:
    """The first logical block a group keeps for a query at `position`: the block of the oldest
    position that query reads (`window - 1` before it); 0 for full attention."""
    return 0 if window is None else max(0, position - window + 1) // BLOCK_SIZE


def stored(group: int, token: int) -> int:
    """What group `group` writes into a slot for `token` (the first group: the token itself)."""
    return token + 100 * group


class KVCacheMachine(RuleBasedStateMachine):
    enable_prefix_caching = True
    windows: tuple[int | None, ...] = (None,)  # one entry per KV cache group
    num_blocks = NUM_BLOCKS

    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(self.num_blocks, BLOCK_SIZE, self.enable_prefix_caching, windows=self.windows)
        self.layout = KVLayout.of(self.windows)  # a layer per group: the same groups
        self.slots: dict[int, int] = {}  # physical slot -> value written there
        self.tokens: dict[int, list[int]] = {}  # request -> every token it knows
        self.hashes: dict[int, list[bytes]] = {}  # request -> its block-hash list (as a Request holds)
        self.extra_keys: dict[int, object] = {}
        # request -> the first token of its last step (or failed grow): where its windows were cut
        self.slide_points: dict[int, int] = {}
        self.next_id = 0
        # Running tallies of what the calls reported, for the counters the walk cannot see.
        self.prefix_queries = self.prefix_hits = self.cow_copies = 0

    requests = Bundle("requests")

    # ---- the memory picture ------------------------------------------------------------------

    def _groups(self, req):
        """The request's table of each group: a Block, or None where a window let go of it."""
        return self.m._tables[req].groups

    def _held_ids(self, req):
        return [b.block_id for blocks in self._groups(req) for b in blocks if b is not None]

    def _put(self, req, t, token):
        """Write `token` at position `t` of the request through every group's table."""
        for g, blocks in enumerate(self._groups(req)):
            block = blocks[t // BLOCK_SIZE]
            assert block is not None, f"group {g} has no block for position {t}, which it writes"
            self.slots[block.block_id * BLOCK_SIZE + t % BLOCK_SIZE] = stored(g, token)

    def _write(self, req, start, end):
        for t in range(start, end):
            self._put(req, t, self.tokens[req][t])

    def _copy_on_write(self, copies):
        self.cow_copies += len(copies)
        for src, dst in copies:
            for i in range(BLOCK_SIZE):
                if src * BLOCK_SIZE + i in self.slots:
                    self.slots[dst * BLOCK_SIZE + i] = self.slots[src * BLOCK_SIZE + i]

    def _read(self, req, group=0):
        """What the group's table reads at each of the request's positions (None: no block there)."""
        blocks = self._groups(req)[group]
        return [None if blocks[t // BLOCK_SIZE] is None
                else self.slots.get(blocks[t // BLOCK_SIZE].block_id * BLOCK_SIZE + t % BLOCK_SIZE)
                for t in range(self.m.num_tokens(req))]

    def _expected(self, req, group):
        """What it must read: the request's own tokens, from the first block its window keeps."""
        first = first_kept_block(self.windows[group], self.slide_points[req]) * BLOCK_SIZE
        return [None if t < first else stored(group, token)
                for t, token in enumerate(self.tokens[req][: self.m.num_tokens(req)])]

    def _pool_picture(self):
        """Everything a call that fails for want of blocks must leave as it was."""
        pool = self.m.pool
        return (self.m.stats(), self.m.group_stats(),
                [(b.ref_count, b.block_hash, b.num_tokens, b.group) for b in pool.blocks],
                [b.block_id for b in pool.free_queue],
                {r: [list(blocks) for blocks in self._groups(r)] for r in self._live()})

    def _longest_hit(self, req):
        """The longest prefix of the request's prompt that every group can serve from the pool's
        cache (a full group every block before the hit point, a sliding group the blocks its window
        reads from there; never the block of the last token): its length in tokens, and its blocks."""
        if not self.enable_prefix_caching:
            return 0, []
        prompt, chain, parent = self.tokens[req], [], None
        for i in range((len(prompt) - 1) // BLOCK_SIZE):
            parent = hash_block(parent, prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], self.extra_keys[req])
            chain.append(parent)
        cached = self.m.pool.cached
        for num in range(len(chain), 0, -1):
            keys = [chain[i] if g == 0 else (g, chain[i])
                    for g, w in enumerate(self.windows) for i in range(first_kept_block(w, num * BLOCK_SIZE), num)]
            if all(key in cached for key in keys):
                return num * BLOCK_SIZE, [cached[key] for key in keys]
        return 0, []

    def _admit(self, req, chunk):
        prompt = self.tokens[req]
        before = self._pool_picture()
        longest, hit = self._longest_hit(req)
        # The free blocks the admission takes: new ones for every group from its first kept block
        # on, less the hit's, plus the hit's that are free now (revived).
        size = cdiv(longest + min(len(prompt) - longest, chunk or len(prompt)), BLOCK_SIZE)
        needed = sum(size - first_kept_block(w, longest) for w in self.windows) - len(hit) \
            + sum(1 for b in hit if b.ref_count == 0)
        free = self.m.num_free_blocks
        cached = self.m.admit(req, prompt, num_new_tokens=chunk, extra_keys=self.extra_keys[req],
                              block_hashes=self.hashes[req])
        assert (cached is None) == (needed > free)
        assert self.m.num_free_blocks == free - (0 if cached is None else needed)
        if cached is None:
            assert req not in self.m
            assert self._pool_picture() == before  # a failed admission changes no figure and no block
            return
        assert cached == longest
        self.prefix_queries += len(prompt)
        self.prefix_hits += cached
        self.slide_points[req] = cached
        # The cached prefix must already hold exactly this prompt's tokens, in every group's window.
        for g in range(len(self.windows)):
            assert self._read(req, g)[:cached] == self._expected(req, g)[:cached]
        self._write(req, cached, self.m.num_tokens(req))

    def _grow(self, req, k, token_ids):
        """`grow` by k slots, checked: the copies are those of the shared partial block of each
        group; a failure changes nothing but the blocks behind the windows of the next token."""
        n = self.m.num_tokens(req)
        before = [list(blocks) for blocks in self._groups(req)]
        refs = [b.ref_count for b in self.m.pool.blocks]
        # The blocks behind the windows of token n that become free, and the free blocks the
        # growth takes then: the new blocks of every group, and a copy of each shared partial one.
        freed = sum(1 for g, blocks in enumerate(before) for b in blocks[: first_kept_block(self.windows[g], n)]
                    if b is not None and b.ref_count == 1)
        needed = sum(cdiv(n + k, BLOCK_SIZE) - len(blocks) for blocks in before) \
            + sum(1 for blocks in before if n % BLOCK_SIZE and blocks[n // BLOCK_SIZE].ref_count > 1)
        free = self.m.num_free_blocks
        copies = self.m.grow(req, k, token_ids)
        self.slide_points[req] = n
        assert (copies is None) == (needed > free + freed)
        assert self.m.num_free_blocks == free + freed - (0 if copies is None else needed)
        if copies is None:
            assert self.m.num_tokens(req) == n
            dropped = Counter()
            for g, blocks in enumerate(before):
                first = first_kept_block(self.windows[g], n)
                assert self._groups(req)[g] == [None] * first + blocks[first:]
                dropped.update(b.block_id for b in blocks[:first] if b is not None)
            assert [b.ref_count for b in self.m.pool.blocks] == [r - dropped[i] for i, r in enumerate(refs)]
            return None
        i = n // BLOCK_SIZE
        assert copies == [(before[g][i].block_id, self._groups(req)[g][i].block_id) for g in range(len(before))
                          if n % BLOCK_SIZE and refs[before[g][i].block_id] > 1]
        self._copy_on_write(copies)
        return copies

    # ---- rules -------------------------------------------------------------------------------

    @rule(target=requests, opening=openings, rest=tokens, chunk=st.none() | st.integers(1, 8), keys=extra_keys)
    def admit(self, opening, rest, chunk, keys):
        """A new request; one the pool cannot cover stays known, waiting, with no table."""
        req = self.next_id
        self.next_id += 1
        self.tokens[req], self.hashes[req], self.extra_keys[req] = opening + rest, [], keys
        self._admit(req, chunk)
        return req

    @rule(req=requests, chunk=st.none() | st.integers(1, 8))
    def preempt_and_readmit(self, req, chunk):
        """Free the request's table (if any) and admit it again with its hash list: a
        preempted or waiting request, or one whose step failed, comes back (its hit, if any, holds
        its tokens in every window)."""
        if req not in self.tokens:
            return
        self.m.free(req)
        self._admit(req, chunk)

    @rule(req=requests, k=st.integers(1, 6), new=tokens)
    def grow(self, req, k, new):
        """Schedule k more tokens: the rest of a chunked prompt first, then decoded ones."""
        if req not in self.m:
            return
        n = self.m.num_tokens(req)
        known = self.tokens[req]
        if len(known) < n + k:
            known += (new * k)[: n + k - len(known)]
        if self._grow(req, k, known) is not None:
            self._write(req, n, n + k)

    @rule(req=requests, k=st.integers(1, 6), new=tokens)
    def grow_without_token_ids(self, req, k, new):
        """Growth that tells the manager no tokens (as the memory benchmark grows): nothing becomes
        findable now; a later growth with tokens offers the blocks still held."""
        if req not in self.m:
            return
        n = self.m.num_tokens(req)
        known = self.tokens[req]
        if len(known) < n + k:
            known += (new * k)[: n + k - len(known)]
        if self._grow(req, k, None) is not None:
            self._write(req, n, n + k)

    @rule(req=requests, token=st.integers(0, 2))
    def write_one(self, req, token):
        """A decode step: one sampled token."""
        if req in self.m and self.m.num_tokens(req) == len(self.tokens[req]):
            self.grow(req, 1, [token])

    @rule(req=requests, token=st.integers(0, 2), drafts=st.lists(st.integers(0, 2), min_size=1, max_size=6),
          accepted=st.integers(0, 6))
    def speculate(self, req, token, drafts, accepted):
        """A speculative decode step: one known token and drafts written behind it, of which the
        verifier keeps `accepted`; the slots past them are given back. The cache is offered the known
        tokens only: no block holding a rejected draft may become findable (`_admit` would read it)."""
        if req not in self.m or self.m.num_tokens(req) != len(self.tokens[req]):
            return
        n, accepted = self.m.num_tokens(req), min(accepted, len(drafts))
        known = self.tokens[req] + [token]
        if self._grow(req, 1 + len(drafts), known) is None:
            return
        for t, value in enumerate([token] + drafts, start=n):
            self._put(req, t, value)
        self.tokens[req] = known + drafts[:accepted]
        self.m.shrink(req, n + 1 + accepted)
        assert len(self.m.block_ids(req)) == cdiv(n + 1 + accepted, BLOCK_SIZE)

    @rule(req=requests, drafts=st.lists(st.integers(0, 2), min_size=1, max_size=6), accepted=st.integers(0, 6))
    def speculate_drafts_only(self, req, drafts, accepted):
        """Drafts alone behind the request's known tokens, rewound to any count from the one before
        the grow: none of them kept, some, or all."""
        if req not in self.m or self.m.num_tokens(req) != len(self.tokens[req]):
            return
        n, accepted = self.m.num_tokens(req), min(accepted, len(drafts))
        if self._grow(req, len(drafts), self.tokens[req]) is None:
            return
        for t, value in enumerate(drafts, start=n):
            self._put(req, t, value)
        self.tokens[req] = self.tokens[req] + drafts[:accepted]
        self.m.shrink(req, n + accepted)

    @rule(req=requests, back=st.integers(1, 12))
    def rewind(self, req, back):
        """Give back the last `back` slots, their tokens kept to be scheduled again, as far back as
        the prefix cache allows (a block offered to it keeps its tokens). Where a sliding window of
        the next token would read a block already let go of, or the last block kept is partial and
        shared (a fork's), the manager refuses and changes nothing."""
        if req not in self.m:
            return
        n = self.m.num_tokens(req)
        target = max(1, n - back, self.m._tables[req].num_offered * BLOCK_SIZE)
        if target >= n:
            return
        keep, refused = cdiv(target, BLOCK_SIZE), False
        for g, window in enumerate(self.windows):
            blocks, first = self._groups(req)[g], first_kept_block(window, target)
            refused |= first < keep and blocks[first] is None
            refused |= target % BLOCK_SIZE != 0 and blocks[keep - 1] is not None and blocks[keep - 1].ref_count > 1
        if refused:
            before = self._pool_picture()
            with pytest.raises(ValueError, match="sliding window|shared"):
                self.m.shrink(req, target)
            assert self._pool_picture() == before
        else:
            self.m.shrink(req, target)
            assert self.m.num_tokens(req) == target

    @rule(target=requests, req=requests)
    def fork(self, req):
        if req not in self.m:
            return multiple()
        child = self.next_id
        self.next_id += 1
        self.hashes[child] = []
        self.m.fork(req, child, self.hashes[child])
        self.tokens[child] = self.tokens[req][: self.m.num_tokens(req)]
        self.extra_keys[child] = self.extra_keys[req]
        self.slide_points[child] = self.slide_points[req]
        return child

    @rule(req=consumes(requests))
    def free(self, req):
        self.m.free(req)
        self.tokens.pop(req, None)

    @rule()
    def confirm_step(self):
        self.m.confirm_cached()

    @rule()
    def fail_step(self):
        """The step failed: the blocks cached since the last confirmation are forgotten."""
        self.m.discard_unconfirmed()

    @rule()
    def reset_prefix_cache(self):
        assert self.m.reset_prefix_cache() == (self.m.pool.num_used == 0)

    def _live(self):
        return [req for req in self.tokens if req in self.m]

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def ref_counts_match_tables(self):
        holders = [0] * self.num_blocks
        for req in self._live():
            groups, ids = self._groups(req), self.m.group_block_ids(req)
            assert ids == [[NULL_BLOCK_ID if b is None else b.block_id for b in blocks] for blocks in groups]
            held = self._held_ids(req)
            assert len(held) == len(set(held))  # a block serves one place of one group
            for g, blocks in enumerate(groups):
                assert self.m.block_ids(req, group=g) == ids[g]
                assert len(blocks) == cdiv(self.m.num_tokens(req), BLOCK_SIZE)
                for b in blocks:
                    if b is not None:
                        assert b.group == g
                        holders[b.block_id] += 1
        assert [b.ref_count for b in self.m.pool.blocks] == holders

    @invariant()
    def free_queue_holds_each_free_block_once(self):
        queued = [b.block_id for b in self.m.pool.free_queue]
        assert len(queued) == len(set(queued))
        assert sorted(queued) == [b.block_id for b in self.m.pool.blocks if b.ref_count == 0]
        s = self.m.stats()
        assert s.free_blocks + s.used_blocks == s.total_blocks == self.num_blocks
        assert s.cached_free_blocks <= s.free_blocks

    @invariant()
    def cache_map_is_consistent(self):
        for key, block in self.m.pool.cached.items():
            assert block.block_hash == key
            assert block.group == (0 if isinstance(key, bytes) else key[0])  # keyed by the group it serves

    @invariant()
    def every_request_reads_only_its_own_tokens(self):
        for req in self._live():
            for g in range(len(self.windows)):
                assert self._read(req, g) == self._expected(req, g), f"group {g} of request {req}"

    @invariant()
    def sliding_tables_stay_within_their_bound(self):
        for req in self._live():
            n = self.m.num_tokens(req)
            chunk = max(1, n - self.slide_points[req])
            held = [sum(1 for b in blocks if b is not None) for blocks in self._groups(req)]
            for g, window in enumerate(self.windows):
                if window is not None:
                    assert held[g] <= cdiv(window - 1 + chunk, BLOCK_SIZE) + 1
            assert sum(held) <= self.layout.blocks_per_request(n, BLOCK_SIZE, chunk)

    @invariant()
    def counters_match_the_walk(self):
        s = self.m.stats()
        walked = walked_stats(self.m, self.prefix_queries, self.prefix_hits, self.cow_copies)
        assert s == walked
        assert (s.usage, s.waste, s.prefix_hit_rate) == (walked.usage, walked.waste, walked.prefix_hit_rate)
        assert self.m.pool.num_cached_free == walked.cached_free_blocks
        groups = self.m.group_stats()
        assert groups == walked_group_stats(self.m)
        assert sum(g.used_blocks for g in groups) == s.used_blocks
        assert sum(g.filled_slots for g in groups) == s.filled_slots

    @invariant()
    def hash_lists_are_the_chain_of_the_tokens(self):
        for req, hashes in self.hashes.items():
            if req not in self.tokens:
                continue
            known, parent = self.tokens[req], None
            for i, h in enumerate(hashes):
                parent = hash_block(parent, known[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], self.extra_keys[req])
                assert h == parent and (i + 1) * BLOCK_SIZE <= len(known)

    def teardown(self):
        for req in list(self.tokens):
            self.m.free(req)
        assert self.m.num_free_blocks == self.num_blocks
        assert all(b.ref_count == 0 for b in self.m.pool.blocks)
        assert all(g.used_blocks == g.filled_slots == 0 for g in self.m.group_stats())
        if not self.enable_prefix_caching:
            assert not self.m.pool.cached and self.m.stats().cached_free_blocks == 0
            assert all(b.block_hash is None for b in self.m.pool.blocks)


class KVCacheMachineNoPrefixCaching(KVCacheMachine):
    enable_prefix_caching = False


class FullAndSlidingMachine(KVCacheMachine):
    """A full-attention group and a sliding one (window 5: not a multiple of the block size)."""

    windows = (None, 5)
    num_blocks = 20


class SlidingOnlyMachine(KVCacheMachine):
    """One sliding group (window 6): a request's table stays short however long it grows."""

    windows = (6,)
    num_blocks = 10


class SlidingFirstMachine(KVCacheMachine):
    """A sliding group first (as Gemma 3's layers make it) with a window shorter than a block."""

    windows = (2, None)
    num_blocks = 16


class FullAndTwoSlidingMachine(KVCacheMachine):
    """A full-attention group and two sliding ones (a window of one block, and of two and a bit)."""

    windows = (None, 4, 9)
    num_blocks = 24


class FullAndTwoSlidingMachineNoPrefixCaching(FullAndTwoSlidingMachine):
    enable_prefix_caching = False


run_settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
group_settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestKVCacheWithPrefixCaching = KVCacheMachine.TestCase
TestKVCacheWithPrefixCaching.settings = run_settings
TestKVCacheWithoutPrefixCaching = KVCacheMachineNoPrefixCaching.TestCase
TestKVCacheWithoutPrefixCaching.settings = run_settings
TestKVCacheFullAndSliding = FullAndSlidingMachine.TestCase
TestKVCacheFullAndSliding.settings = group_settings
TestKVCacheSlidingOnly = SlidingOnlyMachine.TestCase
TestKVCacheSlidingOnly.settings = group_settings
TestKVCacheSlidingFirst = SlidingFirstMachine.TestCase
TestKVCacheSlidingFirst.settings = group_settings
TestKVCacheFullAndTwoSliding = FullAndTwoSlidingMachine.TestCase
TestKVCacheFullAndTwoSliding.settings = group_settings
TestKVCacheFullAndTwoSlidingWithoutPrefixCaching = FullAndTwoSlidingMachineNoPrefixCaching.TestCase
TestKVCacheFullAndTwoSlidingWithoutPrefixCaching.settings = group_settings
