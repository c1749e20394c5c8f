"""The live KV view (core/kv_view.py into dashboard/live.py): the front's copy of the pool, built from
a full view and then changes alone, always equals the pool as the tables and the prefix cache make it;
the events say what happened; nothing is recorded unwatched."""

import random
from collections import deque
from types import SimpleNamespace

import pytest
from hypothesis import settings
from hypothesis.stateful import invariant, rule

from pagedserve.core import kv_view
from pagedserve.core.kv_view import KVViewer
from pagedserve.core.messages import CoreStats
from pagedserve.dashboard.live import KVWatch
from pagedserve.kv import KVCacheManager
from tests.kv.test_kv_properties import NUM_BLOCKS, KVCacheMachine


def expected_pool(m: KVCacheManager, live) -> tuple[list[str], list[int]]:
    """Each block's state and holders, from the tables and the cache map (not the blocks' own counts)."""
    holders = [0] * m.pool.num_blocks
    for req in live:
        for b in m.block_ids(req):
            holders[b] += 1
    cached = {block.block_id for block in m.pool.cached.values()}
    states = ["shared" if h > 1 else "used" if h == 1 else "cached" if b in cached else "free"
              for b, h in enumerate(holders)]
    return states, holders


class WatchedKVCacheMachine(KVCacheMachine):
    """The memory model's state machine, watched: after every operation the front's copy is checked."""

    def __init__(self):
        super().__init__()
        self.scheduler = SimpleNamespace(running=[], waiting=deque())
        self.viewer = KVViewer(self.m, self.scheduler)
        self.viewer.watch(3600)
        self.watch = KVWatch()
        self.seq = 0
        self.kinds: list[str] = []

    def _look(self):
        self.scheduler.running = [SimpleNamespace(request_id=r) for r in self._live()]
        view = self.viewer.take(busy=False)  # due whenever something changed
        if view is not None:
            self.watch.apply(view, CoreStats(len(self.scheduler.running), 0, self.m.stats(), 0), 0)
        frame, self.seq = self.watch.frame(self.seq)
        self.kinds = [e["kind"] for e in frame["events"]]
        return frame

    @rule(req=KVCacheMachine.requests)
    def fork_and_write(self, req):
        """A fork, then one token into the child: a copy-on-write when the last block is partial."""
        if req not in self.m or self.m.num_tokens(req) % 4 == 0:
            return
        self._look()
        child = self.fork(req)
        copies = self.m.grow(child, 1, self.tokens[child] + [0])
        self.tokens[child].append(0)
        if copies is None:
            self.tokens[child].pop()
            return
        self._copy_on_write(copies)
        self._write(child, len(self.tokens[child]) - 1, len(self.tokens[child]))
        self._look()
        assert "fork" in self.kinds and "cow" in self.kinds

    @rule()
    def the_watch_lapses_and_a_viewer_comes_back(self):
        """Nobody renewed the watch: the pool stops recording; the next viewer starts from a full view
        of whatever is held now."""
        self.viewer.watching_until = 0.0
        assert self.viewer.take(busy=False) is None and self.m.pool.watch is None
        self.viewer.watch(3600)

    @invariant()
    def the_front_sees_the_pool(self):
        frame = self._look()
        states, holders = expected_pool(self.m, self._live())
        assert frame["cell_blocks"] == 1 and frame["num_blocks"] == NUM_BLOCKS
        assert [["free", "used", "shared", "cached"][c] for c in frame["cells"]] == states
        assert frame["cell_refs"] == holders
        counts, engine = frame["counts"], frame["engine"]
        assert engine["free_blocks"] == counts["free"] + counts["cached"]
        assert engine["used_blocks"] == counts["used"] + counts["shared"]
        assert engine["cached_free_blocks"] == counts["cached"]
        assert {r["id"]: r["blocks"] for r in frame["requests"]} == {str(r): self.m.block_ids(r) for r in self._live()}


WatchedKVCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestWatchedKVCache = WatchedKVCacheMachine.TestCase


def test_events_tell_the_walk_through():
    m = KVCacheManager(8, 4)
    scheduler = SimpleNamespace(running=[], waiting=deque())
    viewer = KVViewer(m, scheduler)
    assert viewer.take(busy=True) is None and m.pool.watch is None  # unwatched: nothing recorded
    viewer.watch(60)
    first = viewer.take(busy=True)
    assert first.full and first.block_ids == [] and first.events == []  # an empty pool: every block free
    m.admit("a", [1, 2, 3, 4, 5, 6])  # 2 blocks
    m.grow("a", 3, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # across a block boundary
    m.free("a")  # its full block stays cached
    m.admit("b", [1, 2, 3, 4, 5, 6, 7])  # hits that block
    m.fork("b", "c")
    m.grow("c", 1, [1, 2, 3, 4, 5, 6, 7, 8])  # the shared partial block is copied first
    kinds = [e[1] for e in viewer.take(busy=False).events]
    assert kinds == ["admit", "grow", "free", "prefix_hit", "admit", "fork", "cow"]
    assert viewer.take(busy=False) is None  # nothing new, idle: no view
    m.free("b")
    m.free("c")
    view = viewer.take(busy=False)
    assert not view.full and [e[1] for e in view.events] == ["free", "free"]


def test_the_watch_lapses_and_restarts_full(monkeypatch):
    m = KVCacheManager(8, 4)
    viewer = KVViewer(m, SimpleNamespace(running=[], waiting=deque()))
    clock = [100.0]
    monkeypatch.setattr(kv_view.time, "monotonic", lambda: clock[0])
    viewer.watch(3)
    assert viewer.take(busy=True).full
    clock[0] += 0.1
    m.admit("a", [1, 2, 3])
    assert viewer.take(busy=True) is None  # busy: at most one view per INTERVAL
    clock[0] += kv_view.INTERVAL
    assert viewer.take(busy=True).block_ids == m.block_ids("a")
    clock[0] += 5
    assert viewer.take(busy=True) is None and m.pool.watch is None  # nobody renewed: recording stops
    viewer.watch(3)
    assert viewer.take(busy=True).full


def test_a_large_pool_is_drawn_in_cells_of_several_blocks():
    m = KVCacheManager(10_000, 16)
    viewer = KVViewer(m, SimpleNamespace(running=[], waiting=deque()))
    viewer.watch(60)
    m.admit("a", list(range(16 * 3000)))  # blocks 0..2999 in use
    watch = KVWatch()
    watch.apply(viewer.take(busy=True), CoreStats(1, 0, m.stats(), 0), 0)
    frame, _ = watch.frame()
    assert frame["cell_blocks"] == 3 and len(frame["cells"]) == 3334
    assert frame["cells"][:1000] == [1] * 1000 and frame["cells"][1000:] == [0] * 2334
    assert frame["counts"] == {"free": 7000, "used": 3000, "shared": 0, "cached": 0}


def expected_groups(m: KVCacheManager) -> list[int]:
    """Each block's group from the tables that hold it and the prefix cache's keys (a key of group
    g > 0 is (g, hash)), not from the blocks; -1 for a free block."""
    groups = [-1] * m.pool.num_blocks
    for key, block in m.pool.cached.items():
        groups[block.block_id] = key[0] if isinstance(key, tuple) else 0
    for table in m._tables.values():
        for g, blocks in enumerate(table.groups):
            for block in blocks:
                if block is not None:
                    assert groups[block.block_id] in (-1, g), "a block in two groups' tables"
                    groups[block.block_id] = g
    return groups


@pytest.mark.parametrize("seed", range(3))
def test_a_windowed_pool_shows_each_blocks_group_and_each_groups_table(seed):
    """A pool of a sliding group (window 6) and a full one, watched through random admissions, growth
    past the window, forks and frees: every cell shows its block's group, each request its table per
    group (null where a block left the window), the legend each group's blocks, and blocks leaving the
    window are events like the others."""
    rng = random.Random(seed)
    m = KVCacheManager(40, 4, windows=(6, None))
    scheduler = SimpleNamespace(running=[], waiting=deque())
    viewer = KVViewer(m, scheduler)
    viewer.watch(3600)
    watch = KVWatch()
    tokens: dict[int, list[int]] = {}
    opening = [rng.randrange(100) for _ in range(8)]
    kinds, next_id, seq = set(), 0, 0
    for _ in range(150):
        live = list(tokens)
        op = rng.random()
        if op < 0.3 or not live:
            prompt = opening[:rng.randrange(1, 9)] + [rng.randrange(100) for _ in range(rng.randrange(6))]
            if m.admit(next_id, prompt) is not None:
                tokens[next_id] = prompt
            next_id += 1
        elif op < 0.75:
            req = rng.choice(live)
            new = [rng.randrange(100) for _ in range(rng.randrange(1, 5))]
            if m.grow(req, len(new), tokens[req] + new) is not None:
                tokens[req] += new
        elif op < 0.85:
            req = rng.choice(live)
            m.fork(req, next_id)
            tokens[next_id] = list(tokens[req])
            next_id += 1
        else:
            req = rng.choice(live)
            m.free(req)
            del tokens[req]
        scheduler.running = [SimpleNamespace(request_id=r) for r in tokens]
        view = viewer.take(busy=False)
        if view is not None:
            watch.apply(view, CoreStats(len(tokens), 0, m.stats(), 0), 0)
        frame, seq = watch.frame(seq)
        kinds.update(e["kind"] for e in frame["events"])
        states, _ = expected_pool_groups(m)
        assert [["free", "used", "shared", "cached"][c] for c in frame["cells"]] == states
        assert frame["cell_groups"] == expected_groups(m)
        tables = {str(r): [[None if b is None else b.block_id for b in blocks] for blocks in m._tables[r].groups]
                  for r in tokens}
        assert {r["id"]: r["groups"] for r in frame["requests"]} == tables
        assert {r["id"]: r["blocks"] for r in frame["requests"]} == {
            r: [b for table in t for b in table if b is not None] for r, t in tables.items()}
        stats = m.group_stats()
        assert [(g["index"], g["window"], g["used_blocks"]) for g in frame["groups"]] == [
            (0, 6, stats[0].used_blocks), (1, None, stats[1].used_blocks)]
        assert sum(g["cached_blocks"] for g in frame["groups"]) == frame["counts"]["cached"]
    assert {"admit", "grow", "slide", "prefix_hit", "fork", "free"} <= kinds, kinds


def expected_pool_groups(m: KVCacheManager) -> tuple[list[str], list[int]]:
    """expected_pool over every group's tables."""
    holders = [0] * m.pool.num_blocks
    for table in m._tables.values():
        for block in table.held():
            holders[block.block_id] += 1
    cached = {block.block_id for block in m.pool.cached.values()}
    states = ["shared" if h > 1 else "used" if h == 1 else "cached" if b in cached else "free"
              for b, h in enumerate(holders)]
    return states, holders


def test_a_large_windowed_pool_draws_each_cell_in_the_group_most_of_its_blocks_hold():
    m = KVCacheManager(10_000, 16, windows=(64, None))
    viewer = KVViewer(m, SimpleNamespace(running=[], waiting=deque()))
    viewer.watch(60)
    m.admit("a", list(range(16 * 1500)))  # the whole prompt in both groups: blocks 0..1499, then 1500..2999
    m.grow("a", 1)  # the sliding group lets go of all but its window's blocks
    watch = KVWatch()
    watch.apply(viewer.take(busy=True), CoreStats(1, 0, m.stats(), 0), 0)
    frame, _ = watch.frame()
    assert frame["cell_blocks"] == 3
    groups = expected_groups(m)
    for cell, group in enumerate(frame["cell_groups"]):
        held = [g for g in groups[cell * 3:cell * 3 + 3] if g >= 0]
        assert group == (max(set(held), key=lambda g: (held.count(g), -g)) if held else -1), cell
    assert frame["groups"][0]["used_blocks"] == m.group_stats()[0].used_blocks <= 64 // 16 + 2
    assert frame["groups"][1]["used_blocks"] == 1501
