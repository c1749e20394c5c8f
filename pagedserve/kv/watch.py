"""What the KV manager changed, recorded only while someone watches (the live dashboard).

Unwatched, the pool holds `watch = None`, and the pool and the manager pay one attribute test per
call. Watched, they note every block whose state may have changed (so a view sends those alone, not
the whole pool) and a bounded log of events: what happened to which request's blocks, in words.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

# (time.monotonic(), kind, request id or None, block ids, text)
KVEvent = tuple[float, str, str | None, list[int], str]
EVENT_KINDS = ("admit", "grow", "slide", "prefix_hit", "fork", "cow", "preempt", "offload", "free", "evict")


def request_label(request: object) -> str:
    """A request id as the view shows it: the engine's (user request id, sample index) as "id-index"."""
    if isinstance(request, tuple) and len(request) == 2:
        return f"{request[0]}-{request[1]}"
    return str(request)


class KVWatchLog:
    """Blocks changed and events since the last `take`; older events beyond `capacity` are dropped."""

    def __init__(self, capacity: int = 256) -> None:
        self.changed: set[int] = set()
        self.events: deque[KVEvent] = deque(maxlen=capacity)

    def add(self, kind: str, request: object, blocks: Iterable[int], text: str) -> None:
        self.events.append((time.monotonic(), kind, None if request is None else request_label(request), list(blocks),
                            text))

    def take(self) -> tuple[list[int], list[KVEvent]]:
        changed, events = sorted(self.changed), list(self.events)
        self.changed.clear()
        self.events.clear()
        return changed, events
