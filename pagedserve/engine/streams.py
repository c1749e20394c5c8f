"""The front's side of requests in flight: each request's `RequestStream`, read by the caller's
event loop, and the `RequestTracker` that routes each output to its stream and counts it."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.core.messages import CoreStats
from pagedserve.engine.protocol import EngineError, EngineStatsSnapshot
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import ParameterError

logger = logging.getLogger(__name__)


class RequestStream:
    """One request's outputs: put by the thread that delivers them, read on the event loop.

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
            num_generation_tokens=self.num_generation_tokens, finished=dict(self.finished), spec=core.spec,
            kv_groups=tuple(tuple(group) for group in core.kv_groups))
