"""One step's plan: continuous batching with chunked prefill and preemption.

Each step, under a token budget (`max_num_batched_tokens`) and a cap on running requests
(`max_num_seqs`):
1. running requests, oldest first, get their next token (decode) or their next prompt chunk;
   when the pool cannot cover one, the most recently admitted running request is preempted
   (its blocks freed, itself sent back to the front of the queue to be recomputed later; when it
   is swapped, its full blocks are first sent to the KV tier, to be read back: `_swaps`);
2. if nobody was preempted, waiting requests are admitted in arrival order while blocks,
   budget and seats last; each may get its cached prefix for free and its first chunk. With LoRA,
   the running requests use at most `max_loras` distinct adapters: a request whose adapter would
   be one too many waits, and those behind it may go first. With a KV tier, a request whose prefix
   the tier holds only as files first waits out of the queue (`reading`) while they are read into
   memory, for at most the tier's `read_timeout` (then what was not read is computed), and those
   behind it go first: no step waits for a file, and a swapped request's read-back (it is readmitted
   like any other) neither;
3. each request's adapter gets one of the model's slots (`lora/slots.py`).

A request is computed up to all its known tokens; it produces a new token once the step that
computes its last known token runs. Since max_model_len never exceeds the pool, a request
alone always fits: preemption cannot deadlock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field

from pagedserve.core.request import Request, RequestStatus
from pagedserve.kv import BlockCopy, KVCacheManager
from pagedserve.kv.kv_cache_manager import BlockLoad, BlockStore, TierRead
from pagedserve.lora.request import LoRARequest
from pagedserve.lora.slots import LoRASlots


@dataclass
class SchedulerOutput:
    """One step's plan, as changes to what the model runner already holds: for each request its
    whole block table when the table is new to the runner (`new_tables`: admitted, recomputed or
    forked), else only the blocks from the one the step writes into first (a copy-on-write may
    have replaced it) to the end; and the requests whose tables the runner may forget."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each request runs now, drafts included
    # Per request, the draft tokens it runs after its last known one (speculative decoding; else []).
    spec_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[list[int]]] = field(default_factory=list)  # per request, per KV cache group, see above
    new_tables: list[bool] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)  # copy-on-write, before writing
    # The KV tier's transfers, before anything else: blocks to copy out (they may be reused in this
    # step), then blocks to fill from the tier (`KVCacheManager.take_transfers`).
    kv_stores: list[BlockStore] = field(default_factory=list)
    kv_loads: list[BlockLoad] = field(default_factory=list)
    # LoRA: per request the model's slot of its adapter (-1: the base model), and the (slot, adapter)
    # loads to do before the forward pass.
    lora_slots: list[int] = field(default_factory=list)
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    freed: list[Hashable] = field(default_factory=list)  # ids whose blocks were freed since the last plan
    undone: bool = False  # the step failed and `Scheduler.undo_step` took it back

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def has_drafts(self) -> bool:
        return any(self.spec_token_ids)

    def add(self, request: Request, num_new_tokens: int, block_ids: list[list[int]], new_table: bool,
            spec_token_ids: list[int] = ()) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)
        self.spec_token_ids.append(list(spec_token_ids))
        self.new_block_ids.append(block_ids)
        self.new_tables.append(new_table)

    def subset(self, rows: list[int]) -> SchedulerOutput:
        """The plan of these requests alone (every block copy and freed id kept: doing them again
        is harmless)."""
        part = SchedulerOutput(block_copies=self.block_copies, freed=self.freed, kv_stores=self.kv_stores,
                               kv_loads=self.kv_loads, lora_loads=self.lora_loads)
        for i in rows:
            part.add(self.requests[i], self.num_new_tokens[i], self.new_block_ids[i], self.new_tables[i],
                     self.spec_token_ids[i])
            if self.lora_slots:
                part.lora_slots.append(self.lora_slots[i])
        return part


# preemption_mode "auto" swaps a victim holding at least this many computed full blocks (with a KV
# tier), and recomputes a smaller one. `pagedserve bench offload` on the 2-core CPU: reading a block
# back from the file tier costs about 1/17 of computing its 16 tokens, and swap gave 1.16-1.21x the
# output tokens/s of recompute under preemption, so every victim with a block worth reading is
# swapped. Where prompts compute faster than blocks travel (a GPU's prefill against PCIe), raise it.
SWAP_MIN_BLOCKS = 1


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str = "auto", max_loras: int | None = None) -> None:
        """max_loras: with LoRA, the distinct adapters the running requests may use (the model's
        slots); None: LoRA is off."""
        if preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'auto', 'recompute' or 'swap', got {preemption_mode!r}")
        self.kv = kv
        self.preemption_mode = preemption_mode
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self._freed: list[Hashable] = []  # for the next plan
        self._new_to_runner: set[Hashable] = set()  # forked requests: their next plan sends the whole table
        # Requests out of the queue while the KV tier reads their blocks into memory, in the order
        # they left it; and those back from it, admitted without another read.
        self.reading: dict[Hashable, tuple[Request, TierRead]] = {}
        self._read_done: set[Hashable] = set()
        self.lora_slots = LoRASlots(max_loras) if max_loras is not None else None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.reading)

    def tier_reads(self) -> list[Future]:
        """The reads the `reading` requests wait for (for an idle engine to wait on)."""
        return [read.future for _, read in self.reading.values()]

    def schedule(self) -> SchedulerOutput:
        # A step that never confirmed its prefix blocks (it died before its forward pass wrote
        # them) must leave none findable: a safety net under the engine's own undo.
        self.kv.discard_unconfirmed()
        if self.reading:
            self._end_reads()
        out = SchedulerOutput(freed=self._freed)
        self._freed = []
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            # Drafts ride behind a decode's one known token, as far as the budget goes. The prefix
            # cache is offered known tokens only (all_token_ids), never drafts.
            drafts = request.spec_token_ids[: budget - 1] if request.num_tokens - request.num_computed_tokens == 1 else []
            copies = self.kv.grow(request.request_id, num_new + len(drafts), request.all_token_ids)
            if copies is None and drafts:  # the pool is short: speculation gives way before anyone is preempted
                drafts = []
                copies = self.kv.grow(request.request_id, num_new, request.all_token_ids)
            while copies is None:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
                copies = self.kv.grow(request.request_id, num_new, request.all_token_ids)
            if copies is None:
                break  # the request itself was the newest and is now waiting
            new_table = request.request_id in self._new_to_runner
            self._new_to_runner.discard(request.request_id)
            first = 0 if new_table else request.num_computed_tokens // self.kv.block_size
            out.add(request, num_new + len(drafts), self.kv.group_block_ids(request.request_id, first), new_table, drafts)
            out.block_copies += copies
            budget -= num_new + len(drafts)
            i += 1

        adapters = self._running_adapters() if self.lora_slots is not None else set()
        passed_over: list[Request] = []  # waiting behind the adapters already running
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            lora_id = request.lora_request.lora_int_id if request.lora_request is not None else None
            if lora_id is not None and lora_id not in adapters and len(adapters) >= self.lora_slots.num_slots:
                passed_over.append(self.waiting.popleft())
                continue
            # A request still owed its prompt logprobs needs every prompt position's logits, which
            # cached blocks do not have: it skips the lookup (as vLLM does) and computes them all.
            read_cache = request.prompt_logprobs is None
            if read_cache and self.kv.tier is not None and request.request_id not in self._read_done:
                read = self.kv.prefetch(request.all_token_ids, request.cache_key, request.block_hashes)
                if read is not None:  # its blocks are on their way into memory: it waits aside
                    self.reading[request.request_id] = (self.waiting.popleft(), read)
                    continue
            num_cached = self.kv.admit(request.request_id, request.all_token_ids, num_new_tokens=budget,
                                       extra_keys=request.cache_key, block_hashes=request.block_hashes,
                                       read_cache=read_cache)
            if num_cached is None:
                break  # not enough free blocks: keep arrival order, try again next step
            self.waiting.popleft()
            self._read_done.discard(request.request_id)
            if request.num_cached_tokens is None:  # its first admission
                request.num_cached_tokens = num_cached
                request.scheduled_time = time.monotonic()
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if lora_id is not None:
                adapters.add(lora_id)
            num_new = self.kv.num_tokens(request.request_id) - num_cached
            out.add(request, num_new, self.kv.group_block_ids(request.request_id), True)
            budget -= num_new
        self.waiting.extendleft(reversed(passed_over))
        out.kv_stores, out.kv_loads = self.kv.take_transfers()
        if self.lora_slots is not None:
            out.lora_slots, out.lora_loads = self.lora_slots.assign([r.lora_request for r in out.requests])
        return out

    def _end_reads(self) -> None:
        """The requests whose tier reads are done, or past their deadline, go back to the front of
        the queue, in the order they left it."""
        now = time.monotonic()
        back = [request for request, read in self.reading.values() if read.over(now)]
        for request in back:
            del self.reading[request.request_id]
            self._read_done.add(request.request_id)
        self.waiting.extendleft(reversed(back))

    def _running_adapters(self) -> set[int]:
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def finish_step(self, out: SchedulerOutput) -> None:
        """The step ran: the scheduled tokens now have their K/V in the cache."""
        for request, n in zip(out.requests, out.num_new_tokens):
            request.num_computed_tokens += n
        self.kv.confirm_cached()

    def rewind(self, request: Request, num_computed_tokens: int) -> None:
        """A speculative step's verifier kept fewer tokens than the step computed: the request's
        K/V is valid for its first `num_computed_tokens` only, and the slots past them are freed."""
        request.num_computed_tokens = num_computed_tokens
        self.kv.shrink(request.request_id, num_computed_tokens)

    def undo_step(self, out: SchedulerOutput) -> None:
        """The step failed: forget the prefix blocks it was to fill, and send every request it
        ran back to the front of the queue, in order, to be computed again from scratch (as a
        preempted request is; the prefix cache still holds what earlier steps computed)."""
        self.kv.discard_unconfirmed()
        out.undone = True
        for _, adapter in out.lora_loads:  # a failed step may have left its slot half written
            self.lora_slots.forget(adapter.lora_int_id)
        self._freed += out.freed  # the runner may not have seen them
        for request in reversed(out.requests):
            self.running.remove(request)
            self._release(request)
            request.status = RequestStatus.WAITING
            request.num_computed_tokens = 0
            request.spec_token_ids = []
            self.waiting.appendleft(request)

    def fork(self, parent: Request, child: Request) -> None:
        """Start `child` as a running copy of `parent`, sharing all of its blocks."""
        self.kv.fork(parent.request_id, child.request_id, child.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.scheduled_time = parent.scheduled_time
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        self._new_to_runner.add(child.request_id)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the schedule, whatever its state, and free its blocks."""
        assert status.finished
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            if self.reading.pop(request.request_id, None) is None and request in self.waiting:
                self.waiting.remove(request)
        self._read_done.discard(request.request_id)
        request.status = status
        self._release(request)

    def _release(self, request: Request) -> None:
        self.kv.free(request.request_id)
        self._freed.append(request.request_id)
        self._new_to_runner.discard(request.request_id)

    def _swaps(self, request: Request) -> bool:
        """Whether a preempted `request` is swapped to the KV tier rather than recomputed."""
        if self.kv.tier is None or self.preemption_mode == "recompute":
            return False
        return self.preemption_mode == "swap" or \
            request.num_computed_tokens // self.kv.block_size >= SWAP_MIN_BLOCKS

    def _preempt(self, request: Request) -> None:
        swapped = self._swaps(request)
        if self.kv.watched:
            self.kv.note("preempt", request.request_id, f"preempted (pool full) after {request.num_computed_tokens} "
                         f"tokens: its blocks are freed, it waits to be {'swapped back' if swapped else 'recomputed'}")
        if swapped:
            self.kv.offload(request.request_id)
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # recomputation starts from known tokens only
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
