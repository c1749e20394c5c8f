"""AsyncLLM: the server's engine, with the core in a process of its own.

The API process keeps the front: it validates requests, and a front thread turns the core's
token ids into text and RequestOutputs (`OutputProcessor`: detokenization, stop strings, logprob
text) and hands them to each request's stream. The core process (`core_process.py`) only
schedules, runs the model and samples, so neither HTTP work nor text slows its steps, and a
fault in the front (a bad stop string, say) ends one request, never the core.

    event loop --EngineCoreRequest / AbortRequests--> [PUSH] --> core process
    front thread <--EngineCoreOutputs (token ids, stats)-- [PULL] <-- core process
    front thread --StopSamples / AbortRequests--> [PUSH]

If the core process dies, the front thread sees its sentinel at once: every request in flight
fails with EngineError (a 500), `is_running` turns False (/health answers 503) and new requests
are refused. Same interface as the in-thread `AsyncLLMEngine`.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq

from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import EngineError, EngineStatsSnapshot, RequestStream, RequestTracker
from pagedserve.engine.core import validate_prompt
from pagedserve.engine.core_messages import (AbortRequests, CoreCommand, CoreFailed, CoreMessage, CoreReady,
                                             EngineCoreOutputs, EngineCoreRequest, Shutdown, StopSamples)
from pagedserve.engine.core_process import run_engine_core
from pagedserve.engine.llm_engine import tokenizer_eos_ids
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long start() waits for the core to load its model and report ready.
DEFAULT_START_TIMEOUT = 600.0
# How long shutdown() waits for the core to exit before terminating it.
SHUTDOWN_GRACE = 10.0


class AsyncLLM:
    def __init__(self, config: EngineConfig, *, tokenizer=None, start_timeout: float = DEFAULT_START_TIMEOUT) -> None:
        from pagedserve.models.loader import load_tokenizer

        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.model)
        self.start_timeout = start_timeout
        self.output_processor = OutputProcessor(self.tokenizer)
        self._tracker = RequestTracker()
        self._lock = threading.Lock()  # the output processor, the tracker and the command socket
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._process: multiprocessing.Process | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: str | None = None  # why the core is gone, once it is
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
        self._dir = tempfile.mkdtemp(prefix="pagedserve-core-")
        self._zmq = zmq.Context()
        self._commands = self._zmq.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # never block a sender (the lock is held while sending)
        self._commands.bind(f"ipc://{self._dir}/commands")
        self._outputs = self._zmq.socket(zmq.PULL)
        self._outputs.bind(f"ipc://{self._dir}/outputs")
        mp = multiprocessing.get_context("spawn")  # a clean interpreter: no forked threads or CUDA state
        self._child_end, parent_alive = mp.Pipe(duplex=False)  # (reader, writer)
        self._parent_alive = parent_alive  # held open: its closing tells the core that we are gone
        self._process = mp.Process(
            target=run_engine_core, name="pagedserve-core", daemon=True,
            args=(self.config, tokenizer_eos_ids(self.tokenizer), f"ipc://{self._dir}/commands",
                  f"ipc://{self._dir}/outputs", self._child_end, logging.getLogger().getEffectiveLevel()))
        self._process.start()
        self._child_end.close()
        try:
            self.ready = self._await_ready()
        except BaseException:
            self._stop_process()
            self._close()
            raise
        self.stats = self._tracker.snapshot(self.ready.stats)
        self._thread = threading.Thread(target=self._run, name="pagedserve-front", daemon=True)
        self._thread.start()

    def _await_ready(self) -> CoreReady:
        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        poller.register(self._process.sentinel, zmq.POLLIN)
        deadline = time.monotonic() + self.start_timeout
        while (left := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(left * 1000))
            if self._outputs in events:
                message = self._decoder.decode(self._outputs.recv())
                if isinstance(message, CoreFailed):
                    raise RuntimeError(message.message)
                if isinstance(message, CoreReady):
                    return message
            elif events:
                raise RuntimeError(f"the engine core process exited while starting (exit code "
                                   f"{self._process.exitcode})")
        raise RuntimeError(f"the engine core was not ready within {self.start_timeout:.0f} s")

    def shutdown(self) -> None:
        """Stop the core process and the front thread; requests still in flight fail with EngineError."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            if self._process is not None and self._dead is None:
                self._send(Shutdown())
        self._stop_process()
        if self._thread is not None:
            self._thread.join()
        self._fail_all("the engine is shut down")
        self._close()

    def _stop_process(self) -> None:
        if self._process is None:
            return
        self._process.join(SHUTDOWN_GRACE)
        if self._process.is_alive():
            logger.warning("the engine core did not stop within %.0f s; terminating it", SHUTDOWN_GRACE)
            self._process.terminate()
            self._process.join(SHUTDOWN_GRACE)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()

    def _close(self) -> None:
        self._commands.close(linger=0)
        self._outputs.close(linger=0)
        self._zmq.term()
        self._parent_alive.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def is_running(self) -> bool:
        return (self._process is not None and self._dead is None and not self._stopping
                and self._process.is_alive())

    def add_finish_hook(self, hook: Callable[[RequestOutput], None]) -> None:
        """Call `hook(output)` on the front thread with the last output of each request that
        finishes (not aborted, not failed). Add hooks before serving."""
        self._tracker.finish_hooks = (*self._tracker.finish_hooks, hook)

    # ---- requests (event loop) -----------------------------------------------------------

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str,
                       prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes. Same contract as
        `AsyncLLMEngine.generate`: ValueError for a request the engine refuses, EngineError for
        an engine fault; leaving early aborts the request."""
        if isinstance(prompt, str):
            raise TypeError("AsyncLLM takes token ids; the server tokenizes")
        params.verify_for_engine(self.vocab_size, self.max_num_seqs)
        validate_prompt(prompt, self.max_model_len, self.vocab_size)  # the client's 400, at once
        stream = RequestStream(asyncio.get_running_loop())
        arrival = time.monotonic()
        with self._lock:
            if self._dead is not None or self._stopping:
                raise EngineError(self._dead or "the engine is shut down")
            if request_id in self.output_processor:
                raise ValueError(f"request id {request_id!r} is already in use")
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
                if self._dead is None and not self._stopping:
                    self._send(AbortRequests([request_id]))

    def _send(self, command: CoreCommand) -> None:
        """With the lock held (ZMQ sockets are not thread-safe)."""
        self._commands.send(self._encoder.encode(command))

    # ---- the front thread ----------------------------------------------------------------

    def _run(self) -> None:
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
                if isinstance(message, CoreFailed):
                    self._core_gone(message.message)
                    return
            elif events:  # the sentinel: the process has exited
                if not self._stopping:
                    self._core_gone(f"the engine core process died (exit code {self._process.exitcode})")
                return

    def _deliver(self, message: EngineCoreOutputs) -> None:
        with self._lock:
            processed = self.output_processor.process(message.outputs)
            if (processed.stopped or processed.failed) and self._dead is None and not self._stopping:
                if processed.stopped:
                    self._send(StopSamples(processed.stopped))
                if processed.failed:
                    self._send(AbortRequests(processed.failed))
            deliveries = self._tracker.route(processed.outputs)
            # Publish before delivering: a client that got its last output sees the figures after it.
            self.stats = self._tracker.snapshot(message.stats)
        for stream, item in deliveries:
            stream.put(item)

    def _core_gone(self, reason: str) -> None:
        logger.error("%s; failing every request in flight", reason)
        with self._lock:
            self._dead = reason
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            failed = self._tracker.fail_all(EngineError(reason))
            for request_id, _, _ in failed:
                self.output_processor.abort(request_id)
        for _, stream, error in failed:
            stream.put(error)

