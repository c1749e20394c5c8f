"""Stateful property test of the block pool with a KV tier behind it: the state machine of
test_kv_properties.py (its memory picture, rules and invariants), with a tier in the manager.

The tier is a fake: a small LRU dict of block hash -> payload, where a payload is what the test's
memory picture holds in the block's slots when the store is done. An entry can be corrupted: a
read then stops before it and drops it, as FileTier does with a file that fails its checks. An
entry can be held only "on disk": `read` (memory only) stops before it, and `prefetch`, asked for a
request before its admission, brings such entries back into memory when the reads finish (a rule
of their own, so admissions run before, between and after them).

Transfers are done as the engine does them. A plan's transfers (`take_transfers`) run before the
step writes anything, stores first (copy the block's slots out), then loads (write the payload
into the block's slots): so after every admission or growth, and before its tokens are written
(a tier hit's tokens are loaded, not computed). A step that completes confirms its blocks and
does the write-through stores at once; a step that fails leaves garbage in every block it wrote
(loads and copy-on-write copies included), and, as `Scheduler.undo_step` does, forgets its
unconfirmed blocks and frees the requests that ran in it (they wait, to be admitted again).

Checked after every rule, besides the base machine's invariants: each store copies out exactly
the tokens its hash was made from, so does every readable tier entry, and every pending store's
block still holds them; the offload counters equal the test's tallies. In teardown, with every
table freed, what is still queued is done and checked, and nothing refers to a reused block.

With several KV cache groups, each group's blocks are stored and loaded under names of their own
(`tier_name`), each holding that group's values (`stored`): a readmitted request's loaded blocks
must hold its tokens in every group's window.
"""

import hashlib

from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import replace
from itertools import takewhile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, multiple, rule

from pagedserve.kv import KVCacheManager
from tests.kv.stats_oracle import walked_stats
from tests.kv.test_kv_properties import (
    BLOCK_SIZE, NUM_BLOCKS, KVCacheMachine, extra_keys, first_kept_block, openings, stored, tokens,
)

# The tier's size in blocks, drawn per run: from smaller than the pool (the tier evicts often) to
# larger (what the pool evicts is still there when asked for).
tier_capacities = st.integers(1, 2 * NUM_BLOCKS)
# Long shared openings: three documents of 6 blocks each, more than the pool holds at once, so
# their blocks are evicted and asked for again (tier hits).
DOCUMENTS = [[0, 1, 2, 0, 1, 1, 2, 2, 0, 0, 2, 1, 1, 0, 2, 2, 1, 2, 0, 0, 1, 0, 2, 1],
             [2, 2, 1, 0, 0, 2, 1, 1, 1, 2, 0, 2, 2, 0, 0, 1, 0, 1, 1, 2, 2, 1, 0, 0],
             [1, 0, 0, 2, 2, 1, 0, 1, 2, 1, 1, 0, 0, 2, 1, 2, 1, 1, 2, 0, 0, 0, 1, 2]]
long_openings = st.builds(lambda doc, n: doc[:n], st.sampled_from(DOCUMENTS), st.integers(BLOCK_SIZE, 24))
short_tails = st.lists(st.integers(0, 2), min_size=1, max_size=6)
long_tails = st.lists(st.integers(0, 2), min_size=5 * BLOCK_SIZE, max_size=(NUM_BLOCKS - 1) * BLOCK_SIZE)  # evicts
GARBAGE = -1  # what a block a failed step wrote holds (tokens are 0..2)


def tier_name(group: int, block_hash: bytes) -> bytes:
    """The tier's name of a group's block holding the tokens `block_hash` names: the hash itself
    for the first group, for another a SHA-256 of the hash and the group's number."""
    return block_hash if group == 0 else hashlib.sha256(block_hash + group.to_bytes(4, "little")).digest()


class FakeTier:
    """A bounded LRU map hash -> payload, with the part of FileTier's contract the manager uses."""

    read_timeout = 1.0

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[bytes, tuple] = OrderedDict()
        self.corrupt: set[bytes] = set()  # held, but fail their checks when read
        self.on_disk: set[bytes] = set()  # held, but not in memory: `read` stops before them
        self.fetching: list[tuple[list[bytes], Future]] = []  # prefetches not finished yet
        self.asked: set[bytes] = set()  # what `read` was asked for since the test last emptied it

    def __contains__(self, block_hash):
        return block_hash in self.entries

    def read(self, block_hashes):
        """The payloads of the leading blocks held in memory; a corrupt one is dropped and ends the list."""
        # One admission asks for each block once: what it got it keeps, what it did not get is
        # not part of its hit (asking again could go on for ever).
        assert not self.asked.intersection(block_hashes), "a block read twice for one admission"
        self.asked.update(block_hashes)
        payloads = []
        for h in block_hashes:
            if h not in self.entries or h in self.on_disk:
                break
            if h in self.corrupt:
                self._drop(h)
                break
            self.entries.move_to_end(h)
            payloads.append(self.entries[h])
        return payloads

    def prefetch(self, block_hashes):
        wanted = list(takewhile(lambda h: h in self.entries, block_hashes))
        if not self.on_disk.intersection(wanted):
            return None
        future = Future()
        self.fetching.append((wanted, future))
        return future

    def finish_reads(self):
        """The reader brings each prefetch's leading blocks into memory, up to a missing or damaged one."""
        for wanted, future in self.fetching:
            for h in wanted:
                if h not in self.entries:
                    break
                if h in self.corrupt:
                    self._drop(h)
                    break
                self.on_disk.discard(h)
            future.set_result(None)
        self.fetching.clear()

    def put(self, block_hash, payload):
        if block_hash in self.entries:
            return
        self.entries[block_hash] = payload
        while len(self.entries) > self.capacity:
            self._drop(next(iter(self.entries)))

    def _drop(self, block_hash):
        del self.entries[block_hash]
        self.corrupt.discard(block_hash)
        self.on_disk.discard(block_hash)


class Memory(dict):
    """The memory picture (physical slot -> token) that remembers which blocks were written since
    the last step ended: those the current step writes."""

    def __init__(self):
        super().__init__()
        self.dirty: set[int] = set()

    def __setitem__(self, slot, token):
        self.dirty.add(slot // BLOCK_SIZE)
        super().__setitem__(slot, token)


class KVTierMachine(KVCacheMachine):
    offload_policy = "write_through"
    offload_min_hits = 0

    def __init__(self):
        super().__init__()
        self.tier = FakeTier(NUM_BLOCKS)  # sized by `start`
        self.m = KVCacheManager(self.num_blocks, BLOCK_SIZE, tier=self.tier, offload_policy=self.offload_policy,
                                offload_min_hits=self.offload_min_hits, windows=self.windows)
        self.slots = Memory()
        self.expected: dict[bytes, tuple] = {}  # tier name -> what the block it names holds
        self.learned: dict[int, int] = {}  # request -> hashes of its list already in `expected`
        self.offload_hits = self.stored = self.loaded = 0  # tallies of what the transfers carried

    # ---- helpers ---------------------------------------------------------------------------

    def _learn(self):
        """Record what each request's new block hashes stand for (its tokens, when hashed)."""
        for req, hashes in self.hashes.items():
            if req not in self.tokens:
                continue
            # (`speculate` hashes its known tokens before the test's list holds the last of them.)
            known, n = self.tokens[req], self.learned.get(req, 0)
            while n < len(hashes) and (n + 1) * BLOCK_SIZE <= len(known):
                for g in range(len(self.windows)):
                    block = tuple(stored(g, t) for t in known[n * BLOCK_SIZE : (n + 1) * BLOCK_SIZE])
                    assert self.expected.setdefault(tier_name(g, hashes[n]), block) == block
                n += 1
            self.learned[req] = n

    @staticmethod
    def _name_of(key):
        """The tier name of the block a prefix-cache key names: (group, hash), or the first group's hash."""
        return tier_name(0, key) if isinstance(key, bytes) else tier_name(*key)

    def _block(self, block_id):
        return tuple(self.slots.get(block_id * BLOCK_SIZE + i) for i in range(BLOCK_SIZE))

    def _transfers(self):
        """Take the plan's transfers and do them: stores, then loads. Returns the loads."""
        self._learn()
        stores, loads = self.m.take_transfers()
        for block_id, h in stores:
            assert self._block(block_id) == self.expected[h], f"block {block_id} is stored under another block's hash"
            self.tier.put(h, self._block(block_id))
        for block_id, payload in loads:
            for i, token in enumerate(payload):
                self.slots[block_id * BLOCK_SIZE + i] = token
        self.stored += len(stores)
        self.loaded += len(loads)
        return loads

    def _copy_on_write(self, copies):
        # Called right after a successful `grow`, before the step writes: the plan's transfers
        # (stores of the blocks it evicted, say) come first, as in the engine.
        self._transfers()
        super()._copy_on_write(copies)

    def _admit(self, req, chunk, read_cache=True):
        prompt = self.tokens[req]
        findable = {b.block_id for b in self.m.pool.cached.values()}
        self.tier.asked.clear()
        cached = self.m.admit(req, prompt, num_new_tokens=chunk, extra_keys=self.extra_keys[req],
                              block_hashes=self.hashes[req], read_cache=read_cache)
        self._learn()
        if cached is None:
            assert req not in self.m
            return
        assert cached < self.m.num_tokens(req)  # the tier too leaves the last token to compute (its logits)
        if read_cache:
            self.prefix_queries += len(prompt)
        self.prefix_hits += cached
        self.slide_points[req] = cached
        loads = self._transfers()
        # Each group's hit (the blocks its window reads before the hit point) is the pool's cached
        # blocks and, where the pool lacks one, a new block the tier's payload is loaded into.
        num_cached, loaded = cached // BLOCK_SIZE, [b for b, _ in loads]
        hit = {(g, i): blocks[i].block_id for g, blocks in enumerate(self._groups(req))
               for i in range(first_kept_block(self.windows[g], cached), num_cached)}
        assert len(set(loaded)) == len(loaded) and set(loaded) <= set(hit.values())
        assert set(hit.values()) - set(loaded) <= findable
        if loaded:  # the hit's tokens from the first block read from the tier on
            self.offload_hits += (num_cached - min(i for (_, i), b in hit.items() if b in loaded)) * BLOCK_SIZE
        # The cached prefix, loaded blocks included, must hold exactly this prompt's tokens, in
        # every group's window.
        for g in range(len(self.windows)):
            assert self._read(req, g)[:cached] == self._expected(req, g)[:cached]
        self._write(req, cached, self.m.num_tokens(req))

    def _end_step(self):
        """The step ran: its blocks are confirmed, and the write-through stores done at once."""
        self.m.confirm_cached()
        assert self._transfers() == []  # the engine's write-through would drop loads
        self.slots.dirty.clear()

    # ---- rules -----------------------------------------------------------------------------

    @initialize(target=KVCacheMachine.requests, capacity=tier_capacities, opening=long_openings, rest=short_tails,
                chunk=st.none() | st.integers(1, 8))
    def start(self, capacity, opening, rest, chunk):
        """Size the tier, and admit a first request (whatever rules the run draws, there is one)."""
        self.tier.capacity = capacity
        return self.admit(opening, rest, chunk, None, True)

    @rule(target=KVCacheMachine.requests, opening=long_openings | openings, rest=short_tails | tokens | long_tails,
          chunk=st.none() | st.integers(1, 8), keys=extra_keys, read_cache=st.sampled_from([True, True, True, False]))
    def admit(self, opening, rest, chunk, keys, read_cache):
        """A new request (one owed prompt logprobs skips the lookup, tier included)."""
        req = self.next_id
        self.next_id += 1
        self.tokens[req], self.hashes[req], self.extra_keys[req] = opening + rest, [], keys
        self._admit(req, chunk, read_cache)
        return req

    @rule(target=KVCacheMachine.requests, opening=long_openings, rest=short_tails, chunk=st.none() | st.integers(1, 8),
          finish=st.booleans())
    def admit_after_prefetch(self, opening, rest, chunk, finish):
        """A new request waits for its prefetch first, as the scheduler makes it (its reads done, or
        not: past the deadline it is admitted all the same)."""
        req = self.next_id
        self.next_id += 1
        self.tokens[req], self.hashes[req], self.extra_keys[req] = opening + rest, [], None
        before = self.m.stats()
        self.m.prefetch(self.tokens[req], None, self.hashes[req])
        assert self.m.stats() == before  # a prefetch changes no block and no figure
        if finish:
            self.tier.finish_reads()
        self._admit(req, chunk)
        return req

    @rule(i=st.integers(0, 7))
    def write_out(self, i):
        """The tier's i-th entry is written to its file and leaves memory (if it holds that many)."""
        if i < len(self.tier.entries):
            self.tier.on_disk.add(list(self.tier.entries)[i])

    @rule()
    def finish_reads(self):
        self.tier.finish_reads()

    @rule(target=KVCacheMachine.requests, req=KVCacheMachine.requests, chunk=st.none() | st.integers(1, 8),
          read_cache=st.sampled_from([True, True, True, False]))
    def resubmit(self, req, chunk, read_cache):
        """A new request with the same prompt as an earlier one (whose blocks may be in the pool,
        in the tier, or gone)."""
        if req not in self.tokens:
            return multiple()
        return self.admit([], list(self.tokens[req]), chunk, self.extra_keys[req], read_cache)

    def _preempt(self, req, swap, take_now):
        if req not in self.m:
            return
        if swap:
            if self.slots.dirty.intersection(self._held_ids(req)):
                self._end_step()  # a victim is preempted by a later plan: the step it ran in completed
            self.m.offload(req)
        self.m.free(req)
        if take_now:
            self._transfers()

    @rule(req=KVCacheMachine.requests, swap=st.booleans(), take_now=st.booleans())
    def preempt(self, req, swap, take_now):
        """Preemption, by recomputation or by swapping (the victim's computed blocks are offloaded
        before it is freed, its stores done at once or left to the next plan); the victim waits
        (`preempt_and_readmit` admits it again)."""
        if req in self.tokens:
            self._preempt(req, swap, take_now)

    @rule(req=KVCacheMachine.requests, chunk=st.none() | st.integers(1, 8), take_now=st.booleans())
    def preempt_swap_and_readmit(self, req, chunk, take_now):
        """Swap preemption, then admission again at once."""
        if req in self.tokens:
            self._preempt(req, True, take_now)
            self._admit(req, chunk)

    @rule(req=KVCacheMachine.requests, swap=st.booleans(), chunk=st.none() | st.integers(1, 8))
    def preempt_evict_and_readmit(self, req, swap, chunk):
        """Preemption, then a long prompt takes every free block (the pool evicts its cached
        prefixes, the victim's among them) and is gone again; the victim comes back, and what the
        pool lost of it, the tier may still hold."""
        if req not in self.tokens:
            return
        self._preempt(req, swap, take_now=False)
        num_groups = len(self.windows)
        if self.m.num_free_blocks >= num_groups:  # a block in every group for each block of its tokens
            filler = self.next_id
            self.next_id += 1
            self.tokens[filler] = [3] * (self.m.num_free_blocks // num_groups * BLOCK_SIZE)
            self.hashes[filler], self.extra_keys[filler] = [], "filler"
            self._admit(filler, None, read_cache=False)
            assert self.m.num_free_blocks < num_groups
            self.m.free(filler)
            del self.tokens[filler]
        self._admit(req, chunk)

    @rule()
    def take_transfers(self):
        self._transfers()

    @rule()
    def confirm_step(self):
        self._end_step()

    @rule()
    def fail_step(self):
        """The step failed: what it wrote is garbage. Its unconfirmed blocks are forgotten, then the
        requests that ran in it (those holding a block it wrote) are freed, to wait."""
        self.m.discard_unconfirmed()
        dirty = self.slots.dirty
        for req in self._live():
            if dirty.intersection(self._held_ids(req)):
                self.m.free(req)
        for b in dirty:
            for i in range(BLOCK_SIZE):
                dict.__setitem__(self.slots, b * BLOCK_SIZE + i, GARBAGE)
        dirty.clear()

    @rule(i=st.integers(0, 7))
    def corrupt_tier_entry(self, i):
        """Damage the tier's i-th entry, if it holds that many (now and then, not every entry)."""
        if i < len(self.tier.entries):
            self.tier.corrupt.add(list(self.tier.entries)[i])

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def tier_holds_the_tokens_of_its_hashes(self):
        assert len(self.tier.entries) <= self.tier.capacity
        for h, payload in self.tier.entries.items():
            if h not in self.tier.corrupt:
                assert payload == self.expected[h]

    @invariant()
    def pending_stores_still_hold_their_tokens(self):
        self._learn()
        pending = list(self.m._stores) + [(b, self._name_of(key)) for b, key, _ in self.m.pool.evicted]
        for block_id, h in pending:
            assert self._block(block_id) == self.expected[h], f"pending store of block {block_id} is stale"

    @invariant()
    def counters_match_the_walk(self):
        s = self.m.stats()
        walked = walked_stats(self.m, self.prefix_queries, self.prefix_hits, self.cow_copies)
        # A store counts when it is queued; the test sees it when the plan takes it.
        walked = replace(walked, offload_hits=self.offload_hits, offload_loaded_blocks=self.loaded,
                         offload_stored_blocks=self.stored + len(self.m._stores))
        assert s == walked
        assert (s.usage, s.waste, s.prefix_hit_rate) == (walked.usage, walked.waste, walked.prefix_hit_rate)
        assert self.m.pool.num_cached_free == walked.cached_free_blocks

    def teardown(self):
        super().teardown()  # frees every table; every block is free
        assert self._transfers() == []  # what is still queued refers to blocks nobody reused
        assert self.m.take_transfers() == ([], [])
        assert not self.m.pool.evicted


class KVTierEvictedMachine(KVTierMachine):
    offload_policy = "evicted"


class KVTierEvictedAfterAHitMachine(KVTierMachine):
    offload_policy = "evicted"
    offload_min_hits = 1


class KVTierFullAndSlidingMachine(KVTierMachine):
    """A full-attention group and a sliding one (window 5), writing through."""

    windows = (None, 5)
    num_blocks = 2 * NUM_BLOCKS


class KVTierSlidingOnlyEvictedMachine(KVTierMachine):
    """One sliding group (window 6), its blocks stored as they are evicted: those behind the window
    are let go of first, so a hit's window blocks come from the tier as well as from the pool."""

    windows = (6,)
    offload_policy = "evicted"


run_settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
group_settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestKVTierWriteThrough = KVTierMachine.TestCase
TestKVTierWriteThrough.settings = run_settings
TestKVTierEvicted = KVTierEvictedMachine.TestCase
TestKVTierEvicted.settings = run_settings
TestKVTierEvictedAfterAHit = KVTierEvictedAfterAHitMachine.TestCase
TestKVTierEvictedAfterAHit.settings = run_settings
TestKVTierFullAndSliding = KVTierFullAndSlidingMachine.TestCase
TestKVTierFullAndSliding.settings = group_settings
TestKVTierSlidingOnlyEvicted = KVTierSlidingOnlyEvictedMachine.TestCase
TestKVTierSlidingOnlyEvicted.settings = group_settings
