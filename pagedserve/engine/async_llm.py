"""AsyncLLM: the server's engine, with the core in a process of its own.

The API process keeps the front: it validates requests, and a front thread turns the core's
token ids into text and RequestOutputs (`OutputProcessor`: detokenization, stop strings, logprob
text) and hands them to each request's stream. The core process (`core_process.py`) only
schedules, runs the model and samples, so neither HTTP work nor text slows its steps, and a
fault in the front (a bad stop string, say) ends one request, never the core.

    event loop --EngineCoreRequest / AbortRequests--> [PUSH] --> core process
    front thread <--EngineCoreOutputs (token ids, stats)-- [PULL] <-- core process
    front thread --StopSamples / AbortRequests--> [PUSH]

If the core process dies, the front thread sees its sentinel at once: it reaps the process, logs
its exit code or signal, fails every request in flight with EngineUnavailable (a 503) and starts
a new core with the same config, up to `max_restarts` tries with a doubling wait between them
(`restart_backoff`, then twice that, ...). Meanwhile `is_running` is False (/health answers 503)
and new requests get EngineUnavailable at once. If no try succeeds the engine is dead for good and
the `on_dead` callbacks run (the server exits non-zero, for its supervisor to restart it).

A core that has requests in flight but reports nothing for `stall_timeout` seconds (stopped,
wedged) is `stalled`: /health answers 503 until it reports again. Same interface as the
in-thread `AsyncLLMEngine`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq

from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import (EngineError, EngineStatsSnapshot, EngineUnavailable, RequestStream,
                                            RequestTracker)
from pagedserve.core.engine_core import validate_prompt
from pagedserve.core.messages import (AbortRequests, CoreCommand, CoreFailed, CoreMessage, CoreReady,
                                             CoreStats, EngineCoreOutputs, EngineCoreRequest, Shutdown,
                                             StopSamples)
from pagedserve.core.core_process import run_engine_core
from pagedserve.engine.llm_engine import tokenizer_eos_ids
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long start() waits for the core to load its model and report ready.
DEFAULT_START_TIMEOUT = 600.0
# How long shutdown() waits for the core to exit before terminating it.
SHUTDOWN_GRACE = 10.0
# After the core dies: how many times a new one is started before the engine gives up, and the
# wait before the first try (doubled before each next one: 1, 2, 4 s).
DEFAULT_MAX_RESTARTS = 3
DEFAULT_RESTART_BACKOFF = 1.0
# A core with requests in flight that reports nothing for this long counts as stalled. A step
# reports when it ends, so this must exceed the longest step (a full prefill budget on CPU).
DEFAULT_STALL_TIMEOUT = 60.0


def describe_exit(exitcode: int | None) -> str:
    """multiprocessing's exit code in words: a negative one is the signal that ended the process."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class _CoreGone(Exception):
    """The core process stopped serving (the reason is the message)."""


class AsyncLLM:
    def __init__(self, config: EngineConfig, *, tokenizer=None, start_timeout: float = DEFAULT_START_TIMEOUT,
                 max_restarts: int = DEFAULT_MAX_RESTARTS, restart_backoff: float = DEFAULT_RESTART_BACKOFF,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT) -> None:
        from pagedserve.models.loader import load_tokenizer

        if max_restarts < 0 or restart_backoff < 0 or stall_timeout <= 0:
            raise ValueError("max_restarts and restart_backoff must be >= 0 and stall_timeout > 0")
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.model)
        self.start_timeout = start_timeout
        self.max_restarts = max_restarts
        self.restart_backoff = restart_backoff
        self.stall_timeout = stall_timeout
        self.output_processor = OutputProcessor(self.tokenizer)
        self._tracker = RequestTracker()
        self._lock = threading.Lock()  # the output processor, the tracker and the command socket
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._process: multiprocessing.Process | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stop_event = threading.Event()  # set with _stopping: wakes a restart's backoff
        self._restarting: str | None = None  # why the core is being restarted, meanwhile
        self._dead: str | None = None  # why the core is gone for good, once it is
        self._on_dead: tuple[Callable[[str], None], ...] = ()
        self._progress_at = time.monotonic()  # when the core last reported (or work began after idling)
        # The counters of cores that died: a new core counts from zero, the figures go on from these.
        self._past_counters = _CoreCounters()
        self.num_restarts = 0
        self.stats: EngineStatsSnapshot | None = None
        self.ready: CoreReady | None = None

    # ---- facts the core reported at start: safe to read from any thread ------------------

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.ready.vocab_size

    @property
    def max_num_seqs(self) -> int:
        return self.ready.max_num_seqs

    @property
    def core_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the core process and wait until it has loaded the model (RuntimeError if it fails)."""
        assert self._process is None, "already started"
        self._zmq = zmq.Context()
        try:
            self._spawn()
        except BaseException:
            self._zmq.term()
            raise
        self.stats = self._tracker.snapshot(self.ready.stats)
        self._thread = threading.Thread(target=self._run, name="pagedserve-front", daemon=True)
        self._thread.start()

    def _spawn(self) -> None:
        """Start a core process on fresh sockets and wait for its CoreReady (RuntimeError if it fails)."""
        self._dir = tempfile.mkdtemp(prefix="pagedserve-core-")
        self._commands = self._zmq.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # never block a sender (the lock is held while sending)
        self._commands.bind(f"ipc://{self._dir}/commands")
        self._outputs = self._zmq.socket(zmq.PULL)
        self._outputs.bind(f"ipc://{self._dir}/outputs")
        mp = multiprocessing.get_context("spawn")  # a clean interpreter: no forked threads or CUDA state
        child_end, self._parent_alive = mp.Pipe(duplex=False)  # (reader, writer)
        # _parent_alive is held open: its closing tells the core that we are gone.
        self._process = mp.Process(
            target=run_engine_core, name="pagedserve-core", daemon=True,
            args=(self.config, tokenizer_eos_ids(self.tokenizer), f"ipc://{self._dir}/commands",
                  f"ipc://{self._dir}/outputs", child_end, logging.getLogger().getEffectiveLevel()))
        try:
            self._process.start()
            child_end.close()
            self.ready = self._await_ready()
        except BaseException:
            if self._process.is_alive():  # still loading: nothing to wait for
                self._process.kill()
            if self._process.pid is not None:
                self._process.join()
            self._close_channel()
            raise

    def _await_ready(self) -> CoreReady:
        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        poller.register(self._process.sentinel, zmq.POLLIN)
        deadline = time.monotonic() + self.start_timeout
        while (left := deadline - time.monotonic()) > 0:
            if self._stop_event.is_set():
                raise RuntimeError("the engine is shutting down")
            events = dict(poller.poll(min(left, 0.1) * 1000))  # in slices: shutdown() may interrupt
            if self._outputs in events:
                message = self._decoder.decode(self._outputs.recv())
                if isinstance(message, CoreFailed):
                    raise RuntimeError(message.message)
                if isinstance(message, CoreReady):
                    return message
            elif events:
                self._process.join()
                raise RuntimeError(f"the engine core process exited while starting "
                                   f"({describe_exit(self._process.exitcode)})")
        raise RuntimeError(f"the engine core was not ready within {self.start_timeout:.0f} s")

    def shutdown(self) -> None:
        """Stop the core process and the front thread; requests still in flight fail with EngineError."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._stop_event.set()
            serving = self._process is not None and self._serving_before_stop()
            if serving:
                self._send(Shutdown())
        if serving:  # else a restart may be starting a core: the front thread stops it
            self._stop_process()
        if self._thread is not None:
            self._thread.join()
        self._stop_process()  # a core a restart started meanwhile
        self._fail_all(EngineUnavailable("the engine is shut down"))
        if self._process is not None:
            self._close_channel()
            self._zmq.term()

    def _stop_process(self) -> None:
        if self._process is None or self._process.exitcode is not None:
            return
        self._process.join(SHUTDOWN_GRACE)
        if self._process.is_alive():
            logger.warning("the engine core did not stop within %.0f s; terminating it", SHUTDOWN_GRACE)
            self._process.terminate()
            self._process.join(SHUTDOWN_GRACE)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()

    def _close_channel(self) -> None:
        """Close one core's sockets, pipe and socket directory (closing twice is harmless)."""
        self._commands.close(linger=0)
        self._outputs.close(linger=0)
        self._parent_alive.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def is_running(self) -> bool:
        return (self._process is not None and self._dead is None and self._restarting is None
                and not self._stopping and self._process.is_alive())

    @property
    def stalled(self) -> bool:
        """Requests are in flight but the core has reported nothing for stall_timeout seconds."""
        return bool(self._tracker.entries) and time.monotonic() - self._progress_at > self.stall_timeout

    def health_problem(self) -> str | None:
        """Why the engine cannot serve now (for /health), or None when it can."""
        if self._dead is not None:
            return f"the engine is not running: {self._dead}"
        if self._stopping:
            return "the engine is shut down"
        if self._restarting is not None:
            return f"the engine core is restarting: {self._restarting}"
        if not self.is_running:
            return "the engine is not running"
        if self.stalled:
            return f"the engine core has made no progress for over {self.stall_timeout:g} s"
        return None

    def add_finish_hook(self, hook: Callable[[RequestOutput], None]) -> None:
        """Call `hook(output)` on the front thread with the last output of each request that
        finishes (not aborted, not failed). Add hooks before serving."""
        self._tracker.finish_hooks = (*self._tracker.finish_hooks, hook)

    def add_dead_hook(self, hook: Callable[[str], None]) -> None:
        """Call `hook(reason)` on the front thread if the core dies and cannot be restarted."""
        self._on_dead = (*self._on_dead, hook)

    # ---- requests (event loop) -----------------------------------------------------------

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str,
                       prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes. Same contract as
        `AsyncLLMEngine.generate`: ValueError for a request the engine refuses, EngineError for
        an engine fault (EngineUnavailable while the core restarts, or for the requests its death
        ended); leaving early aborts the request."""
        if isinstance(prompt, str):
            raise TypeError("AsyncLLM takes token ids; the server tokenizes")
        params.verify_for_engine(self.vocab_size, self.max_num_seqs)
        validate_prompt(prompt, self.max_model_len, self.vocab_size)  # the client's 400, at once
        stream = RequestStream(asyncio.get_running_loop())
        arrival = time.monotonic()
        with self._lock:
            if self._stopping:
                raise EngineUnavailable("the engine is shut down")
            if self._dead is not None:
                raise EngineUnavailable(f"the engine is not running: {self._dead}")
            if self._restarting is not None:
                raise EngineUnavailable(f"the engine core is restarting ({self._restarting}); retry shortly")
            if request_id in self.output_processor:
                raise ValueError(f"request id {request_id!r} is already in use")
            if not self._tracker.entries:  # the stall clock starts with the work, not at the last report
                self._progress_at = time.monotonic()
            self.output_processor.add_request(request_id, prompt_text, list(prompt), params, arrival)
            self._tracker.add(request_id, stream, params.n)
            self._send(EngineCoreRequest(request_id, list(prompt), params))
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
                if self._serving():
                    self._send(AbortRequests([request_id]))

    def _serving(self) -> bool:
        """With the lock held: a core is up and listening for commands."""
        return self._serving_before_stop() and not self._stopping

    def _serving_before_stop(self) -> bool:
        return self._dead is None and self._restarting is None

    def _send(self, command: CoreCommand) -> None:
        """With the lock held (ZMQ sockets are not thread-safe)."""
        self._commands.send(self._encoder.encode(command))

    # ---- the front thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._serve_core()
                return  # shutting down
            except _CoreGone as gone:
                if self._stopping or not self._restart(str(gone)):
                    return

    def _serve_core(self) -> None:
        """Deliver the current core's outputs until it stops (_CoreGone) or we shut down (return)."""
        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        poller.register(self._process.sentinel, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._outputs in events:
                message = self._decoder.decode(self._outputs.recv())
                if isinstance(message, EngineCoreOutputs):
                    self._deliver(message)
                    continue
                if isinstance(message, CoreFailed) and not self._stopping:
                    self._process.join(SHUTDOWN_GRACE)  # it exits after saying why
                    if self._process.is_alive():
                        self._process.kill()
                        self._process.join()
                    raise _CoreGone(f"{message.message} ({describe_exit(self._process.exitcode)})")
            elif events:  # the sentinel: the process has exited
                self._process.join()  # reap it: no zombie, and its exit code is known
                if self._stopping:
                    return
                raise _CoreGone(f"the engine core process died ({describe_exit(self._process.exitcode)})")

    def _restart(self, reason: str) -> bool:
        """Fail what was in flight, then start a new core: True once it serves, False if every try
        failed (the engine is then dead) or the engine is shutting down."""
        logger.error("%s; failing the requests in flight and restarting the core", reason)
        with self._lock:
            self._restarting = reason
            self._past_counters = _CoreCounters.of(self.stats)
        self._fail_all(EngineUnavailable(f"{reason}; this request was lost and the engine is restarting"))
        with self._lock:  # nothing runs or waits now; the failures are counted
            self.stats = dataclasses.replace(self.stats, num_running=0, num_waiting=0,
                                             finished=dict(self._tracker.finished))
        self._close_channel()
        delay = self.restart_backoff
        for attempt in range(1, self.max_restarts + 1):
            if self._stop_event.wait(delay):
                return False
            delay *= 2
            logger.info("starting a new engine core (try %d of %d)", attempt, self.max_restarts)
            try:
                with self._lock:  # shutdown() either sees this process or stops us before it starts
                    if self._stopping:
                        return False
                self._spawn()
            except Exception as e:  # noqa: BLE001 -- any failure to start is one failed try
                logger.error("the new engine core failed to start: %s", e)
                continue
            with self._lock:
                self._restarting = None
                self._progress_at = time.monotonic()
                self.num_restarts += 1
                self.stats = self._snapshot(self.ready.stats)
            logger.info("the engine core is back (pid %d)", self._process.pid)
            return True
        reason = f"{reason}; no new core started in {self.max_restarts} tries"
        logger.critical("%s: the engine is dead", reason)
        with self._lock:
            self._dead = reason
            self._restarting = None
        for hook in self._on_dead:
            try:
                hook(reason)
            except Exception:
                logger.exception("dead hook failed")
        return False

    def _snapshot(self, core: CoreStats) -> EngineStatsSnapshot:
        """With the lock held: the figures, the counters of past cores added to this one's."""
        return self._past_counters.add_to(self._tracker.snapshot(core))

    def _deliver(self, message: EngineCoreOutputs) -> None:
        with self._lock:
            self._progress_at = time.monotonic()
            processed = self.output_processor.process(message.outputs)
            if (processed.stopped or processed.failed) and self._serving():
                if processed.stopped:
                    self._send(StopSamples(processed.stopped))
                if processed.failed:
                    self._send(AbortRequests(processed.failed))
            deliveries = self._tracker.route(processed.outputs)
            # Publish before delivering: a client that got its last output sees the figures after it.
            self.stats = self._snapshot(message.stats)
        for stream, item in deliveries:
            stream.put(item)

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
    prefix_queries: int = 0
    prefix_hits: int = 0
    cow_copies: int = 0

    @staticmethod
    def of(stats: EngineStatsSnapshot) -> _CoreCounters:
        """The counters as last published (those of every core so far)."""
        return _CoreCounters(stats.num_preemptions, stats.kv.prefix_queries, stats.kv.prefix_hits,
                             stats.kv.cow_copies)

    def add_to(self, stats: EngineStatsSnapshot) -> EngineStatsSnapshot:
        kv = dataclasses.replace(stats.kv, prefix_queries=stats.kv.prefix_queries + self.prefix_queries,
                                 prefix_hits=stats.kv.prefix_hits + self.prefix_hits,
                                 cow_copies=stats.kv.cow_copies + self.cow_copies)
        return dataclasses.replace(stats, kv=kv, num_preemptions=stats.num_preemptions + self.num_preemptions)
