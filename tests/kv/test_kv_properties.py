"""Stateful property test: random admit / grow / fork / write / free sequences keep every
invariant of the memory model, with the prefix cache on and off.

The test keeps its own picture of physical memory (what token each slot holds) and writes each
scheduled token through the request's block table, applying the copy-on-write copies the manager
reports first. Reading every request back through its table then checks isolation: a request only
ever sees its own tokens, including in blocks it got from the prefix cache or shares after a fork.

After every operation, each figure of `stats()` (counters) must equal what walking every table
gives (`walked_stats`), and each request's block-hash list must be the hash chain of its tokens.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from pagedserve.kv import KVCacheManager, hash_block
from tests.kv.stats_oracle import walked_stats

BLOCK_SIZE = 4
NUM_BLOCKS = 12
# A tiny vocabulary and a shared opening make prefix-cache hits frequent.
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=20)
openings = st.sampled_from([[], [0, 1, 2, 0], [0, 1, 2, 0, 1, 1, 2, 2]])
extra_keys = st.sampled_from([None, None, "lora-1"])


class KVCacheMachine(RuleBasedStateMachine):
    enable_prefix_caching = True

    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, self.enable_prefix_caching)
        self.slots: dict[int, int] = {}  # physical slot -> token id written there
        self.tokens: dict[int, list[int]] = {}  # request -> every token it knows
        self.hashes: dict[int, list[bytes]] = {}  # request -> its block-hash list (as a Request holds)
        self.extra_keys: dict[int, object] = {}
        self.next_id = 0
        # Running tallies of what the calls reported, for the counters the walk cannot see.
        self.prefix_queries = self.prefix_hits = self.cow_copies = 0

    requests = Bundle("requests")

    def _write(self, req, start, end):
        table = self.m.block_ids(req)
        for t in range(start, end):
            self.slots[table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE] = self.tokens[req][t]

    def _copy_on_write(self, copies):
        self.cow_copies += len(copies)
        for src, dst in copies:
            for i in range(BLOCK_SIZE):
                if src * BLOCK_SIZE + i in self.slots:
                    self.slots[dst * BLOCK_SIZE + i] = self.slots[src * BLOCK_SIZE + i]

    def _read(self, req):
        table = self.m.block_ids(req)
        return [self.slots.get(table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE) for t in range(self.m.num_tokens(req))]

    def _admit(self, req, chunk):
        prompt = self.tokens[req]
        cached = self.m.admit(req, prompt, num_new_tokens=chunk, extra_keys=self.extra_keys[req],
                              block_hashes=self.hashes[req])
        if cached is None:
            assert req not in self.m
            return
        self.prefix_queries += len(prompt)
        self.prefix_hits += cached
        # The cached prefix must already hold exactly this prompt's tokens.
        assert self._read(req)[:cached] == prompt[:cached]
        self._write(req, cached, self.m.num_tokens(req))

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
        preempted or waiting request, or one whose step failed, comes back."""
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
        copies = self.m.grow(req, k, known)
        if copies is None:
            assert self.m.num_tokens(req) == n
            return
        self._copy_on_write(copies)
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
        copies = self.m.grow(req, 1 + len(drafts), known)
        if copies is None:
            assert self.m.num_tokens(req) == n
            return
        self._copy_on_write(copies)
        table = self.m.block_ids(req)
        for t, value in enumerate([token] + drafts, start=n):
            self.slots[table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE] = value
        self.tokens[req] = known + drafts[:accepted]
        self.m.shrink(req, n + 1 + accepted)
        assert len(self.m.block_ids(req)) == -(-(n + 1 + accepted) // BLOCK_SIZE)

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

    @invariant()
    def ref_counts_match_tables(self):
        holders = [0] * NUM_BLOCKS
        for req in self._live():
            table = self.m.block_ids(req)
            assert len(table) == len(set(table))
            assert len(table) == -(-self.m.num_tokens(req) // BLOCK_SIZE)
            for b in table:
                holders[b] += 1
        assert [b.ref_count for b in self.m.pool.blocks] == holders

    @invariant()
    def free_queue_holds_each_free_block_once(self):
        queued = [b.block_id for b in self.m.pool.free_queue]
        assert len(queued) == len(set(queued))
        assert sorted(queued) == [b.block_id for b in self.m.pool.blocks if b.ref_count == 0]
        s = self.m.stats()
        assert s.free_blocks + s.used_blocks == s.total_blocks == NUM_BLOCKS

    @invariant()
    def cache_map_is_consistent(self):
        for h, block in self.m.pool.cached.items():
            assert block.block_hash == h

    @invariant()
    def every_request_reads_only_its_own_tokens(self):
        for req in self._live():
            assert self._read(req) == self.tokens[req][: self.m.num_tokens(req)]

    @invariant()
    def counters_match_the_walk(self):
        s = self.m.stats()
        walked = walked_stats(self.m, self.prefix_queries, self.prefix_hits, self.cow_copies)
        assert s == walked
        assert (s.usage, s.waste, s.prefix_hit_rate) == (walked.usage, walked.waste, walked.prefix_hit_rate)
        assert self.m.pool.num_cached_free == walked.cached_free_blocks

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
        assert self.m.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_count == 0 for b in self.m.pool.blocks)


class KVCacheMachineNoPrefixCaching(KVCacheMachine):
    enable_prefix_caching = False


run_settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheWithPrefixCaching = KVCacheMachine.TestCase
TestKVCacheWithPrefixCaching.settings = run_settings
TestKVCacheWithoutPrefixCaching = KVCacheMachineNoPrefixCaching.TestCase
TestKVCacheWithoutPrefixCaching.settings = run_settings
