"""The core's side of the live KV view: while a front watches, a `KVView` rides on the step outputs
at most `INTERVAL` apart (and once more when the engine goes idle, so the last state is seen).

The first view after a watch starts is `full`: the state of every block that is not free (those in a
table or in the prefix cache; every other block is free), so that its cost grows with what is held,
not with the pool. Later views carry only the blocks the pool noted as changed (`kv/watch.py`); each
also carries the block tables of the requests in flight (one per KV cache group) and the events
since the last. A listed block's group is the one whose tokens it holds (`Block.group`), NO_GROUP for
a free block (it holds nothing).
Unwatched, nothing is recorded: the pool holds `watch = None`.
"""

from __future__ import annotations

import time

import msgspec

from pagedserve.kv import KVCacheManager
from pagedserve.kv.block_pool import Block
from pagedserve.kv.watch import KVEvent, KVWatchLog, request_label

INTERVAL = 0.25  # seconds between views: at most 4 a second
MAX_REQUESTS = 64  # block tables sent per view (running first, then waiting)

# A block's state in a view
FREE, USED, SHARED, CACHED = 0, 1, 2, 3  # CACHED: free, but holding a prefix a request can still hit
NO_GROUP = 255  # the group byte of a free block


def block_state(block: Block) -> int:
    if block.ref_count > 1:
        return SHARED
    if block.ref_count == 1:
        return USED
    return FREE if block.block_hash is None else CACHED


class KVView(msgspec.Struct, array_like=True):
    """The pool as the core sees it now: `states`/`refs`/`groups` (one byte each, refs capped at 255)
    of the blocks `block_ids`: when `full`, every block not free (the others are); else those changed
    since the last view."""

    time: float  # time.monotonic(): one clock for the processes of a machine
    full: bool
    block_size: int
    num_blocks: int
    block_ids: list[int]
    states: bytes
    refs: bytes
    # (id, "running" or "waiting", tokens, a block table per group: None where a block left the window)
    requests: list[tuple[str, str, int, list[list[int | None]]]]
    num_requests: int
    events: list[KVEvent]
    offloaded_blocks: int  # blocks the KV tier holds (0 without one)
    groups: bytes = b""  # the group of each of `block_ids` (NO_GROUP: free)
    group_windows: list[int] = []  # each group's sliding window, 0 for full attention


class KVViewer:
    """Starts and stops the pool's watch, and builds the views that are due."""

    def __init__(self, kv: KVCacheManager, scheduler) -> None:
        self.kv, self.scheduler = kv, scheduler
        self.watching_until = 0.0
        self._last_view = 0.0
        self._full_next = False

    def watch(self, seconds: float) -> None:
        """Watch (or keep watching) for `seconds` from now; a front renews it while it has viewers."""
        self.watching_until = time.monotonic() + max(0.0, seconds)
        if not self.kv.watched:
            self.kv.pool.watch = KVWatchLog()
            self._full_next = True

    def take(self, busy: bool) -> KVView | None:
        """The view to send now, if one is due: the first of a watch, or INTERVAL after the last, or a
        change the front has not seen once the engine is idle (`busy` False)."""
        if not self.kv.watched:
            return None
        now = time.monotonic()
        if now > self.watching_until:
            self.kv.pool.watch = None  # nobody is looking: stop recording
            return None
        watch = self.kv.pool.watch
        due = self._full_next or now - self._last_view >= INTERVAL or \
            (not busy and (watch.changed or watch.events))
        if not due:
            return None
        self._last_view = now
        return self._build(now, watch)

    def _build(self, now: float, watch: KVWatchLog) -> KVView:
        pool = self.kv.pool
        changed, events = watch.take()
        full, self._full_next = self._full_next, False
        if full:
            changed = sorted(self.kv.held_block_ids() | {b.block_id for b in pool.cached.values()})
        blocks = [pool.blocks[i] for i in changed]
        states = bytes(block_state(b) for b in blocks)
        refs = bytes(min(b.ref_count, 255) for b in blocks)
        groups = bytes(NO_GROUP if s == FREE else b.group for b, s in zip(blocks, states))
        scheduler = self.scheduler
        in_flight = [(r, "running") for r in scheduler.running[:MAX_REQUESTS]]
        in_flight += [(r, "waiting") for r in list(scheduler.waiting)[:MAX_REQUESTS - len(in_flight)]]
        requests = [(request_label(r.request_id), status, *self._table(r.request_id)) for r, status in in_flight]
        tier = self.kv.tier
        return KVView(now, full, self.kv.block_size, pool.num_blocks, changed, states, refs,
                      requests, len(scheduler.running) + len(scheduler.waiting), events,
                      len(tier) if tier is not None else 0, groups, [w or 0 for w in self.kv.windows])

    def _table(self, request_id) -> tuple[int, list[list[int | None]]]:
        """(tokens, block table per group) of a request, None where a sliding group let go of a block
        (its id there, NULL_BLOCK_ID, names a real block); (0, []) for one that holds no blocks (waiting)."""
        kv = self.kv
        if request_id not in kv:
            return 0, []
        held = kv._tables[request_id].groups  # which entries are None: the ids alone cannot tell
        tables = [[None if block is None else block_id for block_id, block in zip(ids, blocks)]
                  for ids, blocks in zip(kv.group_block_ids(request_id), held)]
        return kv.num_tokens(request_id), tables
