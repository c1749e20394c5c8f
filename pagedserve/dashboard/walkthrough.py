"""PagedAttention's classic walk-through, run on the real memory manager and recorded as the live
view's frames: `pagedserve demo --html FILE` writes them as one self-contained page to step through.

A pool of 16 blocks of 4 tokens. Request A is admitted and grows across a block boundary; B arrives
with the same system prompt and shares A's full blocks through the prefix cache; B is sampled three
times (n=3: two forks share all its blocks) and each sample's first token copies the shared partial
block first (copy on write); A finishes and its prefix stays cached; C needs more blocks than are free,
so the cached block is evicted, and to grow it preempts the newest sample; at the end every block is
free or cached.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from pagedserve.core.kv_view import KVViewer
from pagedserve.core.messages import CoreStats
from pagedserve.dashboard.live import KVWatch
from pagedserve.kv import KVCacheManager

BLOCK_SIZE = 4
NUM_BLOCKS = 16
SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks of "system prompt"


class _Run:
    """The manager, a stand-in for the scheduler's queues, and the frames recorded so far."""

    def __init__(self) -> None:
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.queues = SimpleNamespace(running=[], waiting=deque())
        self.viewer = KVViewer(self.kv, self.queues)
        self.viewer.watch(float("inf"))
        self.watch = KVWatch()
        self.tokens: dict[str, list[int]] = {}
        self.frames: list[dict] = []
        self.next_event = 0  # the seq of the first event the next frame shows
        self.generated = 0
        self.preemptions = 0

    def admit(self, req: str, prompt: list[int]) -> None:
        self.tokens[req] = list(prompt)
        self.kv.admit(req, prompt)
        self.queues.running.append(SimpleNamespace(request_id=req))

    def decode(self, req: str, token: int) -> None:
        self.tokens[req].append(token)
        self.kv.grow(req, 1, self.tokens[req])
        self.generated += 1

    def fork(self, parent: str, child: str) -> None:
        self.kv.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.queues.running.append(SimpleNamespace(request_id=child))

    def finish(self, req: str) -> None:
        self.kv.free(req)
        self.queues.running = [r for r in self.queues.running if r.request_id != req]

    def preempt(self, req: str) -> None:
        self.kv.note("preempt", req, "preempted: the pool is full; its blocks are freed and it will be recomputed")
        self.finish(req)
        self.queues.waiting.append(SimpleNamespace(request_id=req))
        self.preemptions += 1

    def record(self, caption: str) -> None:
        view = self.viewer.take(busy=False)  # idle: due whenever something changed
        if view is not None:
            stats = CoreStats(len(self.queues.running), len(self.queues.waiting), self.kv.stats(), self.preemptions)
            self.watch.apply(view, stats, self.generated)
        frame, self.next_event = self.watch.frame(self.next_event)  # this step's events only (a dict of its own)
        step = len(self.frames)
        for event in frame["events"]:  # time in steps, not in the microseconds the script took
            event["t"] = step
        frame["t"] = step
        frame["series"]["t"] = list(range(step - len(frame["series"]["t"]) + 1, step + 1))
        frame["series"]["tokens_per_s"] = [0.0] * len(frame["series"]["t"])
        frame["caption"] = caption
        self.frames.append(frame)


def walkthrough_frames() -> list[dict]:
    run = _Run()
    run.record(f"An empty pool: {NUM_BLOCKS} physical blocks of {BLOCK_SIZE} token slots each.")
    run.admit("A", SYSTEM + [21, 22])
    run.record("Request A arrives with a 10-token prompt: it gets 3 blocks, anywhere in the pool; the last is "
               "half full. Its block table maps logical blocks 0, 1, 2 to those physical blocks.")
    run.decode("A", 23)
    run.decode("A", 24)
    run.decode("A", 25)
    run.record("A decodes 3 tokens: the 11th and 12th fill its last block, the 13th crosses the boundary and takes "
               "one new block. Only the tail of the last block is ever unused.")
    run.admit("B", SYSTEM + [31, 32, 33])
    run.record("Request B starts with the same 8-token system prompt: the prefix cache finds A's two full blocks, "
               "so B shares them (reference count 2) and gets one block of its own.")
    run.fork("B", "B.1")
    run.fork("B", "B.2")
    run.record("B asks for n=3 samples: two forks share every block of B, its partial last block too "
               "(reference counts 4 and 3). Nothing is copied yet.")
    run.decode("B", 34)
    run.decode("B.1", 44)
    run.decode("B.2", 54)
    run.record("Each sample writes its first token into the shared partial block: the first two writers copy it "
               "first (copy on write) and the last holder keeps the original.")
    run.finish("A")
    run.record("A finishes: its private blocks are free; its full blocks stay in the prefix cache (evictable) "
               "until the pool needs them.")
    run.admit("C", [61 + i for i in range(44)])
    run.record("Request C needs 11 blocks: the 10 empty ones are taken first, then A's cached block is evicted "
               "(its prefix is forgotten). The pool is full.")
    run.preempt("B.2")
    run.decode("C", 90)
    run.record("C's next token needs a new block, but none is free: the newest sample, B.2, is preempted and "
               "waits to be recomputed. Its own full block stays cached only until C evicts it to grow.")
    for req in ("B", "B.1", "C"):
        run.finish(req)
    run.queues.waiting.clear()
    run.record("Everyone finishes (B.2 is dropped here): every block is free again, or cached for the next "
               "request with the same prefix.")
    return run.frames
