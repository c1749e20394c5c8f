"""AsyncLLMEngine: an asyncio front over the synchronous LLMEngine, for `serve --engine-core thread`
(the default, `AsyncLLM`, runs the core in its own process). Also the pieces both share: each
request's `RequestStream`, the `RequestTracker` that routes outputs to streams and counts them,
and `EngineError`.

LLMEngine is not thread-safe, so one thread owns it. That thread sleeps while there is no work;
otherwise it applies the adds and aborts queued since its last step, runs one step, and hands
each request's output to the request's stream on the caller's event loop. A request that
arrives at any time joins the running batch at the next step (continuous batching across
clients). Readers on other threads see the engine only through `stats`, a snapshot the engine
thread replaces after every step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pagedserve.core.messages import CoreStats
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.executor.base import HEALTH_CHECK_INTERVAL, ExecutorFailed
from pagedserve.kv import KVCacheStats
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import ParameterError, SamplingParams

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while serving a request: a server fault, not the client's."""


class EngineUnavailable(EngineError):
    """The engine cannot serve now (its core is restarting, or gone): the server answers 503."""


@dataclass(frozen=True)
class EngineStatsSnapshot:
    """The engine's figures after a step. Counts are per sequence (a request with n samples is n)."""

    num_running: int
    num_waiting: int
    kv: KVCacheStats
    num_preemptions: int
    num_prompt_tokens: int  # counted once a prompt has been computed
    num_generation_tokens: int  # counted as they are generated, aborted requests included
    finished: dict[str, int]  # "stop" / "length" / "abort" / "error" -> sequences


class RequestStream:
    """One request's outputs: put by the engine thread, read on the event loop.

    Outputs are cumulative, so a reader that fell behind needs only the newest one."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.finished = False  # read on the event loop only

    def put(self, item: RequestOutput | Exception) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more

    async def get(self) -> RequestOutput:
        item = await self._queue.get()
        while not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    prompt_text: str | None
    arrival_time: float
    stream: RequestStream


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Entry:
    """A request in flight, as the front tracks it."""

    stream: RequestStream
    num_seqs: int
    num_output_tokens: int = 0  # already counted in the stats


class RequestTracker:
    """The streams of the requests in flight and the counts the server reports: where each
    RequestOutput goes, and what it adds to the totals. Used by whichever thread delivers outputs."""

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.finished: Counter[str] = Counter()
        self.finish_hooks: tuple[Callable[[RequestOutput], None], ...] = ()

    def add(self, request_id: str, stream: RequestStream, num_seqs: int) -> None:
        self.entries[request_id] = _Entry(stream, num_seqs)

    def abort(self, request_id: str) -> bool:
        """Forget a request the client left; False if it had finished already (or never started)."""
        entry = self.entries.pop(request_id, None)
        if entry is None:
            return False
        self.finished["abort"] += entry.num_seqs
        return True

    def route(self, outputs: list[RequestOutput]) -> list[tuple[RequestStream, RequestOutput | Exception]]:
        """Count each output and pair it with its stream (an EngineError for a failed request)."""
        deliveries: list[tuple[RequestStream, RequestOutput | Exception]] = []
        for output in outputs:
            entry = self.entries.get(output.request_id)
            if entry is None:
                continue
            if entry.num_output_tokens == 0:  # its first output: the prompt has been computed
                self.num_prompt_tokens += len(output.prompt_token_ids)
            num_tokens = sum(len(o.token_ids) for o in output.outputs)
            self.num_generation_tokens += num_tokens - entry.num_output_tokens
            entry.num_output_tokens = num_tokens
            if output.error is not None:  # the engine failed on this request alone
                del self.entries[output.request_id]
                self.finished["error"] += entry.num_seqs
                error = EngineError(output.error) if output.error_param is None \
                    else ParameterError(output.error_param, output.error)  # the client's fault: a 400
                deliveries.append((entry.stream, error))
                continue
            if output.finished:
                del self.entries[output.request_id]
                self.finished.update(o.finish_reason for o in output.outputs)
                for hook in self.finish_hooks:
                    try:
                        hook(output)
                    except Exception:
                        logger.exception("finish hook failed")
            deliveries.append((entry.stream, output))
        return deliveries

    def fail_all(self, error: Exception) -> list[tuple[str, RequestStream, Exception]]:
        """End every request in flight with `error`: (request id, stream, error) of each."""
        failed = [(request_id, entry.stream, error) for request_id, entry in self.entries.items()]
        for entry in self.entries.values():
            self.finished["error"] += entry.num_seqs
        self.entries.clear()
        return failed

    def snapshot(self, core: CoreStats) -> EngineStatsSnapshot:
        return EngineStatsSnapshot(
            num_running=core.num_running, num_waiting=core.num_waiting, kv=core.kv,
            num_preemptions=core.num_preemptions, num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens, finished=dict(self.finished))


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []  # guarded by _cond
        self._stopping = False
        self._dead: str | None = None  # why the engine can run no more steps, once it cannot
        self._thread: threading.Thread | None = None
        self._tracker = RequestTracker()  # engine thread only
        self.stats = self._snapshot()

    # ---- facts that never change: safe to read from any thread ----------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def config(self):
        return self.engine.config

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def max_num_seqs(self) -> int:
        return self.engine.scheduler.max_num_seqs

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine thread; requests still in flight fail with EngineError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        self.engine.shutdown()  # its tensor-parallel workers, if any

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping and self._dead is None

    def add_finish_hook(self, hook: Callable[[RequestOutput], None]) -> None:
        """Call `hook(output)` on the engine thread with the last output of each request that
        finishes (not aborted, not failed). Add hooks before serving."""
        self._tracker.finish_hooks = (*self._tracker.finish_hooks, hook)

    # ---- requests (event loop) -----------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes.

        A request the engine refuses raises ValueError; an engine fault raises EngineError.
        Leaving early (break and close, or cancellation) aborts the request."""
        stream = RequestStream(asyncio.get_running_loop())
        self._submit(_Add(request_id, prompt, params, prompt_text, time.monotonic(), stream))
        try:
            while not stream.finished:
                yield await stream.get()
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are free after the engine's current step. Thread-safe."""
        self._submit(_Abort(request_id))

    def _submit(self, command: _Add | _Abort) -> None:
        with self._cond:
            if self._stopping:
                if isinstance(command, _Abort):
                    return  # shutdown aborts everything anyway
                raise EngineError("the engine is shut down")
            if self._dead is not None:
                if isinstance(command, _Abort):
                    return
                raise EngineError(self._dead)
            self._commands.append(command)
            self._cond.notify()

    # ---- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                    # idle: sleep until a request arrives, looking at the workers' health now and then
                    if not self._cond.wait(HEALTH_CHECK_INTERVAL) and not self._healthy():
                        break
                commands, self._commands = self._commands, []
                stopping = self._stopping
            if stopping:
                self._stop(commands)
                return
            if self._dead is None:
                for command in commands:
                    self._apply(command)
            deliveries = self._step() if self._dead is None and engine.has_unfinished_requests() else []
            # Publish before delivering: a client that got its last output sees the figures after it.
            self.stats = self._snapshot()
            for stream, item in deliveries:
                stream.put(item)
            if self._dead is not None:
                self._stop(commands)  # fail what is queued; the thread ends, is_running turns False
                return

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            if self._tracker.abort(command.request_id):  # else finished already, or never added
                self.engine.abort_request(command.request_id)
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    arrival_time=command.arrival_time, prompt_text=command.prompt_text)
        except ValueError as e:  # the client's mistake
            command.stream.put(e)
            return
        except Exception as e:
            logger.exception("adding request %s failed", command.request_id)
            command.stream.put(EngineError(f"the engine failed to add the request: {e!r}"))
            return
        self._tracker.add(command.request_id, command.stream, command.params.n)

    def _healthy(self) -> bool:
        try:
            self.engine.core.check_health()
        except ExecutorFailed as e:
            logger.error("%s", e)
            self._dead = str(e)
            return False
        return True

    def _step(self) -> list[tuple[RequestStream, RequestOutput | Exception]]:
        try:
            outputs = self.engine.step()
        except ExecutorFailed as e:  # no step can run any more: fail everyone, stop serving
            logger.error("%s; failing %d request(s)", e, len(self._tracker.entries))
            self._dead = str(e)
            return self._fail_all(EngineError(str(e)))
        except Exception as e:
            # The engine could not pin the fault on a request (it fails those itself): fail what
            # is in flight, free its blocks, keep serving.
            logger.exception("engine step failed; failing %d request(s)", len(self._tracker.entries))
            return self._fail_all(EngineError(f"the engine failed while running this request: {e!r}"))
        return self._tracker.route(outputs)

    def _fail_all(self, error: Exception) -> list[tuple[RequestStream, Exception]]:
        deliveries = []
        for request_id, stream, e in self._tracker.fail_all(error):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("aborting request %s failed", request_id)
            deliveries.append((stream, e))
        return deliveries

    def _stop(self, commands: list[_Add | _Abort]) -> None:
        error = EngineError(self._dead or "the engine is shut down")
        for command in commands:
            if isinstance(command, _Add):
                command.stream.put(error)
        for stream, item in self._fail_all(error):
            stream.put(item)
        self.stats = self._snapshot()

    def _snapshot(self) -> EngineStatsSnapshot:
        return self._tracker.snapshot(self.engine.core.core_stats())
