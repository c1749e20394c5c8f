"""The front's copy of the KV pool, kept from the core's `KVView`s, and the frames the page draws.

The core sends every block's state once when a watch starts and then only the blocks that changed
(core/kv_view.py); this keeps the whole pool as three byte arrays (state, ref count, KV cache group)
and turns it into a frame (the JSON the page renders; docs/architecture.md describes it) on request,
once per view however many streams send it (`EncodedFrame`). A large pool is drawn as at most
`MAX_CELLS` cells of several blocks each, each cell in the state most of its blocks are in and of the
group most of its held blocks are of.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple

import msgspec
import numpy as np

from pagedserve.core.kv_view import CACHED, FREE, NO_GROUP, SHARED, USED, KVView
from pagedserve.core.messages import CoreStats

MAX_CELLS = 4096
MAX_EVENTS = 200  # sent in one frame (the newest)
SERIES_POINTS = 240  # one a view: a minute at four views a second
STATE_NAMES = {FREE: "free", USED: "used", SHARED: "shared", CACHED: "cached"}
SERIES = ("t", "usage", "waste", "prefix_hit_rate", "running", "waiting", "tokens_per_s")
_encode = msgspec.json.Encoder().encode  # NaN and infinity as null: the page's JSON.parse takes nothing else


class EncodedFrame:
    """One view's frame as JSON, serialized once and shared by every stream: all of it but the events
    (`head`, the object without its closing brace) and each event on its own, so that a stream's
    message is these bytes joined (`json`), whatever events it has still to send."""

    __slots__ = ("version", "head", "events", "first_seq", "next_seq")

    def __init__(self, version: int, head: bytes, events: list[bytes], first_seq: int) -> None:
        self.version = version  # the views applied when it was built
        self.head = head
        self.events = events  # oldest first, numbered first_seq, first_seq + 1, ...
        self.first_seq = first_seq
        self.next_seq = first_seq + len(events)  # the seq to ask from next time

    def json(self, since_seq: int = 0) -> bytes:
        """The frame, with the events numbered `since_seq` and later (those it still holds)."""
        start = min(max(0, since_seq - self.first_seq), len(self.events))
        return b"".join((self.head, b',"events":[', b",".join(self.events[start:]), b"]}"))


class _Snapshot(NamedTuple):
    """What a frame is built from, copied under the lock so that the build does not hold it."""
    version: int
    states: np.ndarray
    refs: np.ndarray
    groups: np.ndarray
    block_size: int
    view: KVView
    core: CoreStats
    series: list[tuple]
    events: list[dict]
    next_seq: int


class KVWatch:
    """Thread-safe: views arrive on the core client's thread, frames are built on whichever thread asks
    (the server's: a worker thread, off the event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the copy of the pool; held briefly by apply() and snapshots
        self._build_lock = threading.Lock()  # one build at a time, so that each view is built once
        self.version = 0  # views applied so far
        self._origin: float | None = None  # the first view's time: frames count from it
        self._states = np.zeros(0, np.uint8)
        self._refs = np.zeros(0, np.uint8)
        self._groups = np.zeros(0, np.uint8)  # NO_GROUP for a free block
        self._block_size = 0
        self._view: KVView | None = None  # the latest (its requests and figures)
        self._core: CoreStats | None = None
        self._events: deque[dict] = deque(maxlen=MAX_EVENTS)
        self._num_events = 0  # the seq of the next event
        self._series: deque[tuple] = deque(maxlen=SERIES_POINTS)
        self._tokens: tuple[float, int] | None = None  # (time, generated tokens) at the last view
        self._encoded: EncodedFrame | None = None  # the latest view's, once built

    def apply(self, view: KVView, core: CoreStats, generated_tokens: int) -> None:
        """Take one view, with the core's figures sent beside it and the tokens generated so far."""
        with self._lock:
            if view.full:  # every block not listed is free
                self._states = np.full(view.num_blocks, FREE, np.uint8)
                self._refs = np.zeros(view.num_blocks, np.uint8)
                self._groups = np.full(view.num_blocks, NO_GROUP, np.uint8)
            elif len(self._states) != view.num_blocks:
                return  # changes to a pool this copy never saw whole (a new core): wait for its full view
            ids = np.asarray(view.block_ids, np.int64)
            self._states[ids] = np.frombuffer(view.states, np.uint8)
            self._refs[ids] = np.frombuffer(view.refs, np.uint8)
            self._groups[ids] = np.frombuffer(view.groups, np.uint8)
            if self._origin is None:
                self._origin = view.time
            self._block_size, self._view, self._core = view.block_size, view, core
            for t, kind, request, blocks, text in view.events:
                self._events.append({"seq": self._num_events, "t": round(t - self._origin, 3), "kind": kind,
                                     "request": request, "blocks": blocks, "text": text})
                self._num_events += 1
            rate = 0.0
            if self._tokens is not None and view.time > self._tokens[0]:
                rate = (generated_tokens - self._tokens[1]) / (view.time - self._tokens[0])
            self._tokens = (view.time, generated_tokens)
            kv = core.kv
            self._series.append((round(view.time - self._origin, 3), kv.usage, kv.waste, kv.prefix_hit_rate,
                                 core.num_running, core.num_waiting, max(rate, 0.0)))
            self.version += 1

    def encoded(self) -> EncodedFrame | None:
        """The latest view's frame, built and serialized once however many streams send it (later
        calls return the same object until a new view arrives); None before the first view. A large
        pool's frame takes milliseconds: call it off the event loop."""
        with self._build_lock:
            with self._lock:
                if self._view is None:
                    return None
                if self._encoded is not None and self._encoded.version == self.version:
                    return self._encoded
                snapshot = _Snapshot(self.version, self._states.copy(), self._refs.copy(), self._groups.copy(),
                                     self._block_size,
                                     self._view, self._core, list(self._series), list(self._events),
                                     self._num_events)
            events = [_encode(e) for e in snapshot.events]
            frame = EncodedFrame(snapshot.version, _encode(_shared_frame(snapshot))[:-1], events,
                                 snapshot.next_seq - len(events))
            self._encoded = frame
            return frame

    def frame(self, since_seq: int = 0) -> tuple[dict | None, int]:
        """The page's frame now as a dict of its own, with the events numbered `since_seq` and later (at
        most MAX_EVENTS), and the seq to ask from next time; (None, since_seq) before the first view."""
        encoded = self.encoded()
        if encoded is None:
            return None, since_seq
        return msgspec.json.decode(encoded.json(since_seq)), encoded.next_seq


def _shared_frame(s: _Snapshot) -> dict:
    """The frame of a snapshot's view, but for the events each stream picks."""
    view, core = s.view, s.core
    cells, cell_refs, per_cell = _cells(s.states, s.refs)
    counts = np.bincount(s.states, minlength=4)
    kv = core.kv
    windows = view.group_windows or [0]
    held = (s.states == USED) | (s.states == SHARED)
    in_group = s.groups < len(windows)
    used = np.bincount(s.groups[held & in_group], minlength=len(windows))
    cached = np.bincount(s.groups[(s.states == CACHED) & in_group], minlength=len(windows))
    return {
        "t": s.series[-1][0],
        "block_size": s.block_size,
        "num_blocks": len(s.states),
        "cell_blocks": per_cell,
        "cells": cells,
        "cell_refs": cell_refs,
        "cell_groups": _cell_groups(s.groups, per_cell, len(windows)),
        "counts": {STATE_NAMES[state]: int(counts[state]) for state in STATE_NAMES},
        "groups": [{"index": g, "window": w or None, "used_blocks": int(used[g]), "cached_blocks": int(cached[g])}
                   for g, w in enumerate(windows)],
        "engine": {"total_blocks": kv.total_blocks, "free_blocks": kv.free_blocks,
                   "used_blocks": kv.used_blocks, "cached_free_blocks": kv.cached_free_blocks,
                   "usage": kv.usage, "waste": kv.waste, "prefix_hit_rate": kv.prefix_hit_rate,
                   "cow_copies": kv.cow_copies, "num_running": core.num_running,
                   "num_waiting": core.num_waiting, "num_preemptions": core.num_preemptions,
                   "offloaded_blocks": view.offloaded_blocks},
        # blocks: every block the request holds, group by group; groups: each group's table (null: left the window)
        "requests": [{"id": i, "status": st, "num_tokens": n,
                      "blocks": [b for table in t for b in table if b is not None], "groups": t}
                     for i, st, n, t in view.requests],
        "num_requests": view.num_requests,
        "series": {name: [point[k] for point in s.series] for k, name in enumerate(SERIES)},
    }


def _cell_groups(groups: np.ndarray, per_cell: int, num_groups: int) -> list[int]:
    """Each cell's group: that of most of its blocks that hold tokens (ties to the lower group), -1
    when none does."""
    if per_cell == 1:
        return np.where(groups == NO_GROUP, -1, groups.astype(np.int16)).tolist()
    num_cells = -(-len(groups) // per_cell)
    cell = np.arange(len(groups)) // per_cell
    some = groups < num_groups
    counts = np.bincount(cell[some] * num_groups + groups[some], minlength=num_cells * num_groups)
    counts = counts.reshape(num_cells, num_groups)
    return np.where(counts.max(1) > 0, counts.argmax(1), -1).tolist()


def _cells(states: np.ndarray, refs: np.ndarray) -> tuple[list[int], list[int], int]:
    """Each cell's state and largest ref count, and the blocks a cell stands for."""
    per_cell = max(1, -(-len(states) // MAX_CELLS))
    if per_cell == 1:
        return states.tolist(), refs.tolist(), 1
    pad = -len(states) % per_cell
    grouped = np.concatenate([states, np.full(pad, 255, np.uint8)]).reshape(-1, per_cell)
    # counts[cell, state]; ties go to the busier state (shared > used > cached > free), listed last
    counts = np.stack([(grouped == s).sum(1) for s in (FREE, CACHED, USED, SHARED)], 1)
    order = np.array([FREE, CACHED, USED, SHARED], np.uint8)
    cells = order[counts.shape[1] - 1 - np.argmax(counts[:, ::-1], 1)]
    cell_refs = np.concatenate([refs, np.zeros(pad, np.uint8)]).reshape(-1, per_cell).max(1)
    return cells.tolist(), cell_refs.tolist(), per_cell
