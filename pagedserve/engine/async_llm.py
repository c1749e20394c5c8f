"""AsyncLLM: the server's engine. One front over any engine core client.

The front validates each request, hands its token ids to the core (`core_client.py`: on a thread of
this process, or in a process of its own, the default), turns the core's token ids into text and
RequestOutputs (`OutputProcessor`: detokenization, stop strings, logprob text) and hands them to
each request's stream. A fault in the front (a bad stop string, say) ends one request, never the
core. The same front serves both clients, so validation, streams, aborts and figures are the same
whichever runs the core.

Outputs arrive on the client's thread: the front's lock guards the output processor and the tracker
against the event loop adding and aborting requests meanwhile. If the core is lost (it died, or made
no progress for `stall_timeout` seconds: the client watches for that, `core_client.py`), every
request in flight fails with EngineUnavailable (a 503) and /health answers 503 until a new core
serves; if none can (a core on a thread is never restarted) the `on_dead` hooks run (the server
exits non-zero, for its supervisor to restart it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from pagedserve.config import EngineConfig
from pagedserve.core.messages import CoreReady, CoreStats, EngineCoreOutputs, EngineCoreRequest, SpecDecodeStats
from pagedserve.dashboard.live import KVWatch
from pagedserve.engine.core_client import (DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_BACKOFF, DEFAULT_STALL_TIMEOUT,
                                           DEFAULT_START_TIMEOUT, EngineCoreClient, ProcessCoreClient,
                                           ThreadedCoreClient)
from pagedserve.engine.input_processor import check_adapter, process_inputs
from pagedserve.engine.llm_engine import LLMEngine, tokenizer_eos_ids
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.protocol import EngineError, EngineStatsSnapshot, EngineUnavailable
from pagedserve.engine.streams import RequestStream, RequestTracker
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ENGINE_CORES = ("process", "thread")


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, *, engine_core: str = "process", tokenizer=None,
                 client: EngineCoreClient | None = None, start_timeout: float = DEFAULT_START_TIMEOUT,
                 max_restarts: int = DEFAULT_MAX_RESTARTS, restart_backoff: float = DEFAULT_RESTART_BACKOFF,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT) -> None:
        """engine_core: "process" (the core in a process of its own, restarted if it dies or stalls)
        or "thread" (on a thread of this one); `client` overrides both. max_restarts, restart_backoff
        and start_timeout: the core process's; stall_timeout: how long either client's core may make
        no progress before it counts as lost (a given client has its own)."""
        from pagedserve.models.loader import check_draft_model, load_tokenizer

        if stall_timeout <= 0:
            raise ValueError("stall_timeout must be > 0")
        if engine_core not in ENGINE_CORES:
            raise ValueError(f"engine_core must be 'process' or 'thread', got {engine_core!r}")
        self.config = config = config or EngineConfig()
        check_draft_model(config)  # a ValueError here, not the core's failure to start
        self.tokenizer = tokenizer or load_tokenizer(config.model)
        if client is None and engine_core == "process":
            client = ProcessCoreClient(config, tokenizer_eos_ids(self.tokenizer), start_timeout=start_timeout,
                                       max_restarts=max_restarts, restart_backoff=restart_backoff,
                                       stall_timeout=stall_timeout)
        elif client is None:
            client = ThreadedCoreClient(config, tokenizer_eos_ids(self.tokenizer), tokenizer=self.tokenizer,
                                        stall_timeout=stall_timeout)
        self.client = client
        self.output_processor = OutputProcessor(self.tokenizer)
        self._tracker = RequestTracker()
        self._lock = threading.Lock()  # the output processor, the tracker and the figures
        self._started = False
        self._stopping = False
        self._on_dead: tuple[Callable[[str], None], ...] = ()
        # The counters of cores that were lost: a new core counts from zero, the figures go on from these.
        self._past_counters = _CoreCounters()
        self.stats: EngineStatsSnapshot | None = None
        self._model_config = None  # read when an adapter is first checked
        self.kv_watch = KVWatch()  # the pool as the live view shows it, while someone watches

    @classmethod
    def from_llm_engine(cls, engine: LLMEngine, **kwargs) -> AsyncLLM:
        """A front over `engine`'s core, stepped on a thread (the engine keeps its model and pool,
        and may be stepped again after this front shuts down)."""
        client = ThreadedCoreClient(engine.config, tokenizer_eos_ids(engine.tokenizer), core=engine.core,
                                    stall_timeout=kwargs.pop("stall_timeout", DEFAULT_STALL_TIMEOUT))
        return cls(engine.config, tokenizer=engine.tokenizer, client=client, **kwargs)

    # ---- facts the core reported at start: safe to read from any thread ------------------

    @property
    def max_model_len(self) -> int:
        return self.client.ready.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.client.ready.vocab_size

    @property
    def max_num_seqs(self) -> int:
        return self.client.ready.max_num_seqs

    @property
    def core_pid(self) -> int | None:
        """The core process's pid (None when the core runs in this process)."""
        return self.client.core_pid

    @property
    def num_restarts(self) -> int:
        return self.client.num_restarts

    def stats_by_replica(self) -> None:
        return None  # one engine: its figures are `stats`

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the core and return once it serves (RuntimeError if it cannot start)."""
        assert not self._started, "already started"
        self.client.start(self)
        self._started = True
        self.stats = self._tracker.snapshot(self.client.ready.stats)

    def shutdown(self) -> None:
        """Stop the core; requests still in flight fail with EngineUnavailable."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self.client.shutdown()
        self._fail_all(EngineUnavailable("the engine is shut down"))
        with self._lock:
            if self.stats is not None:  # nothing runs or waits now
                self.stats = self._idle_stats()

    @property
    def is_running(self) -> bool:
        return self._started and not self._stopping and self.client.health_problem() is None

    def check_lora(self, adapter: LoRARequest) -> None:
        """ValueError unless the engine can serve `adapter` (its config and tensor shapes against
        the model's): a server checks an adapter once, when it is registered."""
        if self._model_config is None:
            from pagedserve.models.loader import load_config

            self._model_config = load_config(self.config.model)
        check_adapter(adapter, self.config, self._model_config)

    def remove_lora(self, lora_int_id: int) -> None:
        """The core forgets the adapter (its host memory and slot)."""
        self.client.remove_lora(lora_int_id)

    def watch_kv(self, seconds: float) -> None:
        """Have the core send views of its KV pool into `kv_watch` for `seconds` from now (a viewer
        renews this while it looks). Unwatched, the core records nothing."""
        self.client.watch_kv(seconds)

    def health_problem(self) -> str | None:
        """Why the engine cannot serve now (for /health), or None when it can."""
        if self._stopping:
            return "the engine is shut down"
        return self.client.health_problem() if self._started else "the engine is not running"

    def add_finish_hook(self, hook: Callable[[RequestOutput], None]) -> None:
        """Call `hook(output)` on the client's thread with the last output of each request that
        finishes (not aborted, not failed). Add hooks before serving."""
        self._tracker.finish_hooks = (*self._tracker.finish_hooks, hook)

    def add_dead_hook(self, hook: Callable[[str], None]) -> None:
        """Call `hook(reason)` on the client's thread if the core is gone for good."""
        self._on_dead = (*self._on_dead, hook)

    # ---- requests (event loop) -----------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       prompt_text: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes. A request the engine refuses
        raises ValueError; an engine fault raises EngineError (EngineUnavailable while no core
        serves, or for the requests a lost core took with it). Leaving early (break and close, or
        cancellation) aborts the request."""
        if not self._started or self._stopping:
            raise EngineUnavailable(self.health_problem() or "the engine is not running")
        text, prompt = process_inputs(self.tokenizer, prompt, params, max_model_len=self.max_model_len,
                                      vocab_size=self.vocab_size, max_num_seqs=self.max_num_seqs)  # a 400, at once
        prompt_text = text if prompt_text is None else prompt_text
        stream = RequestStream(asyncio.get_running_loop())
        arrival = time.monotonic()
        with self._lock:
            if self._stopping:
                raise EngineUnavailable("the engine is shut down")
            if request_id in self.output_processor:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.output_processor.add_request(request_id, prompt_text, list(prompt), params, arrival)
            self._tracker.add(request_id, stream, params.n)
            try:
                self.client.add_request(EngineCoreRequest(request_id, list(prompt), params, lora_request))
            except EngineUnavailable:
                self._tracker.entries.pop(request_id, None)
                self.output_processor.abort(request_id)
                raise
        try:
            while not stream.finished:
                yield await stream.get()
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are free after the core's current step. Thread-safe."""
        with self._lock:
            if self._tracker.abort(request_id):
                self.output_processor.abort(request_id)
                self.client.abort_requests([request_id])

    # ---- CoreEvents: called on the client's thread ---------------------------------------

    def on_outputs(self, message: EngineCoreOutputs) -> None:
        with self._lock:
            processed = self.output_processor.process(message.outputs)
            if processed.stopped:
                self.client.stop_samples(processed.stopped)
            if processed.failed:
                self.client.abort_requests(processed.failed)
            deliveries = self._tracker.route(processed.outputs)
            # Publish before delivering: a client that got its last output sees the figures after it.
            self.stats = self._snapshot(message.stats)
            if message.kv_view is not None:
                self.kv_watch.apply(message.kv_view, message.stats, self.stats.num_generation_tokens)
        for stream, item in deliveries:
            stream.put(item)

    def on_core_lost(self, reason: str, restarting: bool) -> None:
        with self._lock:
            self._past_counters = _CoreCounters.of(self.stats)
        lost = f"{reason}; this request was lost" + (" and the engine is restarting" if restarting else "")
        self._fail_all(EngineUnavailable(lost))
        with self._lock:  # nothing runs or waits now; the failures are counted
            self.stats = self._idle_stats()

    def on_core_ready(self, ready: CoreReady) -> None:
        with self._lock:
            self.stats = self._snapshot(ready.stats)

    def on_dead(self, reason: str) -> None:
        for hook in self._on_dead:
            try:
                hook(reason)
            except Exception:
                logger.exception("dead hook failed")

    # ---- helpers -------------------------------------------------------------------------

    def _snapshot(self, core: CoreStats) -> EngineStatsSnapshot:
        """With the lock held: the figures, the counters of past cores added to this one's."""
        return self._past_counters.add_to(self._tracker.snapshot(core))

    def _idle_stats(self) -> EngineStatsSnapshot:
        return dataclasses.replace(self.stats, num_running=0, num_waiting=0, finished=dict(self._tracker.finished))

    def _fail_all(self, error: EngineError) -> None:
        """End every request in flight with `error`."""
        with self._lock:
            failed = self._tracker.fail_all(error)
            for request_id, _, _ in failed:
                self.output_processor.abort(request_id)
        for _, stream, error in failed:
            stream.put(error)


@dataclasses.dataclass(frozen=True)
class _CoreCounters:
    """The counters a core keeps (they restart from zero with a new core)."""

    num_preemptions: int = 0
    kv: dict[str, int] = dataclasses.field(default_factory=dict)  # KVCacheStats' counters, by name
    spec: SpecDecodeStats | None = None

    KV_COUNTERS = ("prefix_queries", "prefix_hits", "cow_copies", "offload_hits", "offload_stored_blocks",
                   "offload_loaded_blocks")

    @staticmethod
    def of(stats: EngineStatsSnapshot) -> _CoreCounters:
        """The counters as last published (those of every core so far)."""
        return _CoreCounters(stats.num_preemptions, {k: getattr(stats.kv, k) for k in _CoreCounters.KV_COUNTERS},
                             stats.spec)

    def add_to(self, stats: EngineStatsSnapshot) -> EngineStatsSnapshot:
        kv = dataclasses.replace(stats.kv, **{k: getattr(stats.kv, k) + v for k, v in self.kv.items()})
        spec = stats.spec.plus(self.spec) if stats.spec is not None else self.spec
        return dataclasses.replace(stats, kv=kv, num_preemptions=stats.num_preemptions + self.num_preemptions,
                                   spec=spec)
