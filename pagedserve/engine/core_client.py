"""How a front reaches its engine core: in the caller's own step loop, on a thread, or in a process.

Every client carries the same messages (`core/messages.py`): an `EngineCoreRequest`, aborts and the
samples a stop string ended go in; `EngineCoreOutputs` (token ids and the core's figures) come out.
- `InprocClient`: the core runs when the caller steps it (`LLMEngine`, the offline API).
- `ThreadedCoreClient`: the core steps on a thread of this process while there is work.
- `ProcessCoreClient`: the core runs in a process of its own (`core/core_process.py`), over two ZMQ
  sockets; a core that dies, or stalls, is replaced by a new one.
The two background clients push what happens to the front through `CoreEvents`, on their own
thread; the async front (`async_llm.AsyncLLM`) is the same whichever of them it drives.

Both watch for a stalled core: one that makes no progress for `stall_timeout` seconds, with or
without requests in flight. The process client asks a core that has been silent for a moment
(`Ping`); one that does not answer in time is killed and restarted like a dead one. A thread cannot
be killed, so the thread client's core, stuck in one pass of its loop for that long, is dead.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq

from pagedserve.config import EngineConfig
from pagedserve.core.core_process import apply_command, ready_message, run_engine_core, step_contained
from pagedserve.core.engine_core import EngineCore
from pagedserve.core.messages import (AbortRequests, CoreCommand, CoreFailed, CoreMessage, CoreReady,
                                      EngineCoreOutputs, EngineCoreRequest, Ping, RemoveLoRA, SampleOutput,
                                      Shutdown, StopSamples, WatchKV)
from pagedserve.engine.protocol import EngineUnavailable
from pagedserve.executor.base import HEALTH_CHECK_INTERVAL, ExecutorFailed

logger = logging.getLogger(__name__)

# How long start() waits for the core to load its model and report ready.
DEFAULT_START_TIMEOUT = 600.0
# How long shutdown() waits for the core process to exit before terminating it: longer than the
# core's own bounded exit work (the KV tier's save and close, 10 s each), so that is never cut short.
SHUTDOWN_GRACE = 30.0
# After the core process dies: how many times a new one is started before the engine gives up, and
# the wait before the first try (doubled before each next one: 1, 2, 4 s).
DEFAULT_MAX_RESTARTS = 3
DEFAULT_RESTART_BACKOFF = 1.0
# A core that makes no progress for this long is stalled. A core answers only between steps, so this
# must exceed the longest step (a full prefill budget on CPU).
DEFAULT_STALL_TIMEOUT = 60.0
# How long a core may be silent before it is probed (a quarter of the stall timeout, if less).
PROBE_INTERVAL = 1.0
# A stalled core process gets SIGTERM, then SIGKILL if it has not exited after this many seconds.
STALL_TERM_GRACE = 1.0


class CoreEvents(Protocol):
    """What a background client tells its front, on the client's thread."""

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        """A step's (or a command's) sample outputs and the core's figures after it."""

    def on_core_lost(self, reason: str, restarting: bool) -> None:
        """The core stopped serving: every request in flight is lost. A new core is being started
        when `restarting`."""

    def on_core_ready(self, ready: CoreReady) -> None:
        """A restarted core serves (its counters start from zero)."""

    def on_dead(self, reason: str) -> None:
        """The core is gone for good."""


class EngineCoreClient(Protocol):
    """A core behind a background client. Every method is thread-safe; commands to a core that is
    not serving are dropped (its loss has failed those requests already), except `add_request`."""

    ready: CoreReady | None  # the facts of the serving core, once started
    num_restarts: int  # cores started after one was lost
    core_pid: int | None  # the core's process, where it has its own

    def start(self, events: CoreEvents) -> None:
        """Start the core and return once it serves (RuntimeError if it cannot start)."""

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated request; EngineUnavailable when no core is serving."""

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def stop_samples(self, samples: list[tuple[str, int]]) -> None: ...

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter (RemoveLoRA)."""

    def watch_kv(self, seconds: float) -> None:
        """Have the core attach live KV views to its outputs for `seconds` from now (WatchKV)."""

    def health_problem(self) -> str | None:
        """Why no core serves now, or None."""

    def shutdown(self) -> None:
        """Stop the core; no event is sent after this returns."""


class InprocClient:
    """The core in the caller's own loop: each call runs at once, `step` runs one step."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        self.core.stop_samples(samples)

    def remove_lora(self, lora_int_id: int) -> None:
        self.core.remove_lora(lora_int_id)

    def step(self) -> list[SampleOutput]:
        return self.core.step()

    def shutdown(self) -> None:
        self.core.shutdown()


class ThreadedCoreClient:
    """The core on a thread of this process. EngineCore is not thread-safe, so one thread owns it:
    it sleeps while there is no work (looking at the workers' health now and then); otherwise it
    applies the commands queued since its last step, runs one step and reports. A core that can run
    no more steps (ExecutorFailed) is dead: a thread cannot be restarted around a broken group.
    Nor can a thread be stopped: a watchdog that finds one pass of the loop (commands and a step)
    running for over `stall_timeout` seconds declares the core dead, and the thread is left where
    it is stuck (its requests fail; a server exits, for its supervisor to start a new one)."""

    def __init__(self, config: EngineConfig, eos_token_ids: list[int], *, core: EngineCore | None = None,
                 model=None, tokenizer=None, stall_timeout: float = DEFAULT_STALL_TIMEOUT) -> None:
        """`core`: run this one (its owner keeps it: shutdown() leaves it usable); else one is built
        at start, from `model` and `tokenizer` when given (to share loaded weights)."""
        if not stall_timeout > 0:
            raise ValueError("stall_timeout must be > 0")
        self.config, self.eos_token_ids = config, eos_token_ids
        self.core, self._owns_core = core, core is None
        self._model, self._tokenizer = model, tokenizer
        self.stall_timeout = stall_timeout
        self._cond = threading.Condition()
        self._commands: list[CoreCommand] = []  # guarded by _cond
        self._stopping = False
        self._dead: str | None = None
        self._stuck = False  # the core's thread is stuck in a pass of its loop (and may never return)
        self._busy_since: float | None = None  # when the current pass of the loop began (None: waiting)
        self._stop_watching = threading.Event()
        self._thread: threading.Thread | None = None
        self._events: CoreEvents | None = None
        self.ready: CoreReady | None = ready_message(core) if core is not None else None
        self.num_restarts, self.core_pid = 0, None  # the core shares this process and is never restarted

    def start(self, events: CoreEvents) -> None:
        assert self._thread is None, "already started"
        if self.core is None:
            self.core = EngineCore(self.config, eos_token_ids=self.eos_token_ids, model=self._model,
                                   tokenizer=self._tokenizer)
            self.core.warm_up()  # as the core process does before it reports ready
        self._events = events
        self.ready = ready_message(self.core)
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch, name="pagedserve-engine-watchdog", daemon=True).start()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._submit(request, refuse=True)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._submit(AbortRequests(list(request_ids)))

    def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        self._submit(StopSamples(list(samples)))

    def remove_lora(self, lora_int_id: int) -> None:
        self._submit(RemoveLoRA(lora_int_id))

    def watch_kv(self, seconds: float) -> None:
        self._submit(WatchKV(seconds))

    def _submit(self, command: CoreCommand, refuse: bool = False) -> None:
        with self._cond:
            problem = self.health_problem()
            if problem is not None:
                if refuse:
                    raise EngineUnavailable(problem)
                return
            self._commands.append(command)
            self._cond.notify()

    def health_problem(self) -> str | None:
        if self._dead is not None:
            return f"the engine is not running: {self._dead}"
        if self._stopping:
            return "the engine is shut down"
        if self._thread is None or not self._thread.is_alive():
            return "the engine is not running"
        return None

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._stop_watching.set()
        if self._stuck:  # the core is in use by a thread that may never return: leave both alone
            logger.warning("the engine core's thread is stuck in a step; leaving it (and its KV blocks)")
            return
        if self._thread is not None:
            self._thread.join()
        if self.core is not None:
            self.core.fail_all("the engine is shut down")  # frees every block; the front fails the streams
            if self._owns_core:
                self.core.shutdown()  # its tensor-parallel workers, if any

    def _run(self) -> None:
        core = self.core
        while True:
            with self._cond:
                self._busy_since = None
                while not (self._commands or self._stopping or core.has_unfinished_requests()):
                    if not self._cond.wait(HEALTH_CHECK_INTERVAL) and not self._healthy():
                        return
                commands, self._commands = self._commands, []
                if self._stopping or self._dead is not None:
                    return
                self._busy_since = time.monotonic()
            results: list[SampleOutput] = []
            for command in commands:
                results += apply_command(core, command)
            try:
                if core.has_unfinished_requests():
                    results += step_contained(core)
            except ExecutorFailed as e:
                self._die(str(e))
                return
            if self._stuck:  # back after the watchdog gave the core up: its requests have failed already
                return
            self._events.on_outputs(EngineCoreOutputs(results, core.core_stats(), core.kv_view()))

    def _watch(self) -> None:
        """Declare the core dead once one pass of its loop has run for over stall_timeout seconds."""
        while not self._stop_watching.wait(min(PROBE_INTERVAL, self.stall_timeout / 4)):
            busy_since = self._busy_since
            if busy_since is None or time.monotonic() - busy_since <= self.stall_timeout:
                continue
            reason = (f"the engine core made no progress for {self.stall_timeout:g} s (stalled; a core on a "
                      "thread cannot be restarted)")
            with self._cond:
                if self._stopping or self._dead is not None:
                    return
                self._dead, self._stuck = reason, True
            logger.critical("%s: the engine is dead", reason)
            self._events.on_core_lost(reason, restarting=False)
            self._events.on_dead(reason)
            return

    def _healthy(self) -> bool:
        try:
            self.core.check_health()
        except ExecutorFailed as e:
            self._die(str(e))
            return False
        return True

    def _die(self, reason: str) -> None:
        logger.error("%s: the engine can run no more steps", reason)
        with self._cond:
            self._dead = reason
        self._stop_watching.set()
        self.core.fail_all(reason)  # frees every block
        self._events.on_core_lost(reason, restarting=False)
        self._events.on_dead(reason)


class _Probe:
    """One core's liveness probe: a core silent for `interval` seconds is asked (Ping); one that has
    not answered `timeout` seconds after it was asked is stalled. Any message from the core answers.
    The timeout runs from the question, not from the last message, so only a pass of the core's loop
    that lasts over `timeout` (a step stuck, not an idle spell before it) reads as a stall."""

    def __init__(self, timeout: float) -> None:
        self.timeout, self.interval = timeout, min(PROBE_INTERVAL, timeout / 4)
        self.heard_at, self.asked_at = time.monotonic(), None

    def answered(self) -> None:
        self.heard_at, self.asked_at = time.monotonic(), None

    def asked(self) -> None:
        self.asked_at = time.monotonic()

    def seconds_left(self) -> float:
        """Until the next question is due, or the pending one's time is up."""
        due = self.heard_at + self.interval if self.asked_at is None else self.asked_at + self.timeout
        return max(0.0, due - time.monotonic())

    def due(self) -> bool:
        return self.asked_at is None and time.monotonic() - self.heard_at >= self.interval

    def unanswered(self) -> bool:
        return self.asked_at is not None and time.monotonic() - self.asked_at >= self.timeout


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


class ProcessCoreClient:
    """The core in a process of its own, so that neither HTTP work nor text slows its steps:

        caller --EngineCoreRequest / AbortRequests / StopSamples--> [PUSH] --> core process
        client thread <--EngineCoreOutputs (token ids, figures)-- [PULL] <-- core process

    If the core process dies, the client thread sees its sentinel at once: it reaps the process,
    logs its exit code or signal, tells the front (which fails what was in flight) and starts a new
    core with the same config, up to `max_restarts` tries with a doubling wait between them
    (`restart_backoff`, then twice that, ...). If no try succeeds the core is dead for good.

    A core that stalls is handled the same way, once it is found: the client thread probes a core
    that has said nothing for a moment (`Ping`, which its step loop answers after its current
    pass); one that has not answered `stall_timeout` seconds after it was asked gets SIGTERM, then
    SIGKILL, and is replaced like a dead one (the same tries, counted in `num_restarts`).

    A new core serves, and `health_problem()` clears, only once it has run its warm-up step (a
    step of the whole token budget, before it reports ready) and its step loop has answered a
    first probe: a core that is up but cannot step never reads as healthy."""

    def __init__(self, config: EngineConfig, eos_token_ids: list[int], *,
                 start_timeout: float = DEFAULT_START_TIMEOUT, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 restart_backoff: float = DEFAULT_RESTART_BACKOFF, stall_timeout: float = DEFAULT_STALL_TIMEOUT,
                 core_main: Callable[..., None] = run_engine_core) -> None:
        """core_main: the core process's main function (`run_engine_core`'s arguments; tests wrap
        it to inject faults into the core)."""
        if max_restarts < 0 or restart_backoff < 0:
            raise ValueError("max_restarts and restart_backoff must be >= 0")
        if not stall_timeout > 0:
            raise ValueError("stall_timeout must be > 0")
        self.config, self.eos_token_ids = config, eos_token_ids
        self.start_timeout, self.max_restarts, self.restart_backoff = start_timeout, max_restarts, restart_backoff
        self.stall_timeout, self.core_main = stall_timeout, core_main
        self._lock = threading.Lock()  # the command socket and the state below
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._process: multiprocessing.Process | None = None
        self._thread: threading.Thread | None = None
        self._events: CoreEvents | None = None
        self._stopping = False
        self._stop_event = threading.Event()  # set with _stopping: wakes a restart's backoff
        self._restarting: str | None = None  # why the core is being restarted, meanwhile
        self._dead: str | None = None  # why the core is gone for good, once it is
        self.num_restarts = 0
        self.ready: CoreReady | None = None

    @property
    def core_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self, events: CoreEvents) -> None:
        assert self._process is None, "already started"
        self._events = events
        self._zmq = zmq.Context()
        try:
            self._spawn()
        except BaseException:
            self._zmq.term()
            raise
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
            target=self.core_main, name="pagedserve-core", daemon=True,
            args=(self.config, self.eos_token_ids, f"ipc://{self._dir}/commands",
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
        """The new core's CoreReady (sent after its warm-up step), once its step loop has also
        answered a first probe."""
        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        poller.register(self._process.sentinel, zmq.POLLIN)
        deadline = time.monotonic() + self.start_timeout
        ready: CoreReady | None = None
        while (left := deadline - time.monotonic()) > 0:
            if self._stop_event.is_set():
                raise RuntimeError("the engine is shutting down")
            events = dict(poller.poll(min(left, 0.1) * 1000))  # in slices: shutdown() may interrupt
            if self._outputs in events:
                message = self._decoder.decode(self._outputs.recv())
                if isinstance(message, CoreFailed):
                    raise RuntimeError(message.message)
                if isinstance(message, CoreReady):
                    ready = message
                    with self._lock:
                        self._send(Ping())
                elif isinstance(message, EngineCoreOutputs) and ready is not None:
                    return ready  # the probe's answer
            elif events:
                self._process.join()
                raise RuntimeError(f"the engine core process exited while starting "
                                   f"({describe_exit(self._process.exitcode)})")
        if ready is not None:
            raise RuntimeError(f"the engine core was ready but its step loop did not answer within "
                               f"{self.start_timeout:.0f} s")
        raise RuntimeError(f"the engine core was not ready within {self.start_timeout:.0f} s")

    def shutdown(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._stop_event.set()
            serving = self._process is not None and self._dead is None and self._restarting is None
            if serving:
                self._send(Shutdown())
        if serving:  # else a restart may be starting a core: the client thread stops it
            self._stop_process()
        if self._thread is not None:
            self._thread.join()
        self._stop_process()  # a core a restart started meanwhile
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

    def health_problem(self) -> str | None:
        if self._dead is not None:
            return f"the engine is not running: {self._dead}"
        if self._stopping:
            return "the engine is shut down"
        if self._restarting is not None:
            return f"the engine core is restarting ({self._restarting}); retry shortly"
        if self._process is None or not self._process.is_alive():
            return "the engine is not running"
        return None

    # ---- commands (any thread) -----------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        with self._lock:
            if not self._serving():
                raise EngineUnavailable(self.health_problem() or "the engine is not running")
            self._send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        with self._lock:
            if self._serving():
                self._send(AbortRequests(list(request_ids)))

    def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        with self._lock:
            if self._serving():
                self._send(StopSamples(list(samples)))

    def remove_lora(self, lora_int_id: int) -> None:
        with self._lock:
            if self._serving():
                self._send(RemoveLoRA(lora_int_id))

    def watch_kv(self, seconds: float) -> None:
        with self._lock:
            if self._serving():
                self._send(WatchKV(seconds))

    def _serving(self) -> bool:
        """With the lock held: a core is up and listening for commands."""
        return self._process is not None and self._dead is None and self._restarting is None and not self._stopping

    def _send(self, command: CoreCommand) -> None:
        """With the lock held (ZMQ sockets are not thread-safe)."""
        self._commands.send(self._encoder.encode(command))

    # ---- the client thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._serve_core()
                return  # shutting down
            except _CoreGone as gone:
                if self._stopping or not self._restart(str(gone)):
                    return

    def _serve_core(self) -> None:
        """Deliver the current core's outputs until it stops or stalls (_CoreGone) or we shut down
        (return)."""
        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        poller.register(self._process.sentinel, zmq.POLLIN)
        probe = _Probe(self.stall_timeout)
        while True:
            events = dict(poller.poll(math.ceil(probe.seconds_left() * 1000)))
            if not events:
                if probe.unanswered():
                    self._stop_stalled()
                    return  # shutting down
                if probe.due():
                    with self._lock:
                        if self._serving():
                            self._send(Ping())
                    probe.asked()
                continue
            if self._outputs in events:
                probe.answered()  # any message is a sign of life
                message = self._decoder.decode(self._outputs.recv())
                if isinstance(message, EngineCoreOutputs):
                    self._events.on_outputs(message)
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

    def _stop_stalled(self) -> None:
        """Kill the stalled core (SIGTERM, then SIGKILL) and raise _CoreGone; return if we are
        shutting down (shutdown() stops the process)."""
        reason = f"the engine core stalled (no answer for {self.stall_timeout:g} s)"
        with self._lock:
            if self._stopping:
                return
            self._restarting = reason  # no command goes to it now, and shutdown() leaves the process to us
        logger.error("%s; stopping it (pid %d)", reason, self._process.pid)
        self._process.terminate()
        self._process.join(STALL_TERM_GRACE)
        if self._process.is_alive():  # stuck where SIGTERM does not end it
            self._process.kill()
            self._process.join(SHUTDOWN_GRACE)
        if self._process.is_alive():
            logger.error("the stalled engine core (pid %d) outlived SIGKILL; starting a new one beside it",
                         self._process.pid)
        raise _CoreGone(f"{reason} and was stopped ({describe_exit(self._process.exitcode)})")

    def _restart(self, reason: str) -> bool:
        """Tell the front, then start a new core: True once it serves, False if every try failed
        (the core is then dead) or the engine is shutting down."""
        logger.error("%s; failing the requests in flight and restarting the core", reason)
        with self._lock:
            self._restarting = reason
        self._events.on_core_lost(reason, restarting=True)
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
            self._events.on_core_ready(self.ready)
            with self._lock:
                self._restarting = None
                self.num_restarts += 1
            logger.info("the engine core is back (pid %d)", self._process.pid)
            return True
        reason = f"{reason}; no new core started in {self.max_restarts} tries"
        logger.critical("%s: the engine is dead", reason)
        with self._lock:
            self._dead = reason
            self._restarting = None
        self._events.on_dead(reason)
        return False
