"""What the OpenAI server needs of an engine (`EngineClient`), and the errors and figures it sees.

Two things implement it: `async_llm.AsyncLLM`, one engine core behind a front in this process (the
core on a thread or in a process of its own), and the Ray ingress's `ReplicaPool`, many replicas
behind a router. The server is typed against this protocol and never asks which one it has.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pagedserve.core.messages import SpecDecodeStats
from pagedserve.kv import KVCacheStats

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig
    from pagedserve.dashboard.live import KVWatch
    from pagedserve.lora.request import LoRARequest
    from pagedserve.outputs import RequestOutput
    from pagedserve.sampling_params import SamplingParams


class EngineError(RuntimeError):
    """The engine failed while serving a request: a server fault, not the client's."""


class EngineUnavailable(EngineError):
    """The engine cannot serve now (its core is restarting, shut down, or gone): the server answers 503."""


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
    spec: SpecDecodeStats | None = None  # with speculative decoding
    kv_groups: tuple[tuple[int, int], ...] = ()  # per KV cache group: (window, 0 for full; blocks in use)


class EngineClient(Protocol):
    """An engine as the server sees it. Facts are fixed once it serves; every method is safe to call
    from the server's event loop."""

    tokenizer: Any
    config: EngineConfig | None  # the engine's settings (None where the server cannot know them)

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def stats(self) -> EngineStatsSnapshot | None:
        """The figures after the latest step; None where they come per replica."""

    def stats_by_replica(self) -> dict[str, EngineStatsSnapshot] | None:
        """Each replica's figures by its id, or None for a single engine (its figures are `stats`)."""

    def health_problem(self) -> str | None:
        """Why the engine cannot serve now (for /health), or None when it can."""

    def add_finish_hook(self, hook: Callable[[RequestOutput], None]) -> None:
        """Call `hook(output)` with the last output of each request that finishes (not aborted, not
        failed). Add hooks before serving."""

    def generate(self, prompt: list[int], params: SamplingParams, request_id: str,
                 prompt_text: str | None = None,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """The request's cumulative outputs until it finishes, under `lora_request`'s adapter (None:
        the base model). ValueError for a request the engine refuses (a 400), EngineError for an
        engine fault (EngineUnavailable: a 503); leaving early aborts the request."""

    def check_lora(self, adapter: LoRARequest) -> None:
        """ValueError saying why the engine cannot serve `adapter` (LoRA off, a bad directory or
        config, shapes that do not fit the model, a rank above max_lora_rank). Reads the adapter's
        config and tensor shapes, not its tensors: quick, but file reads (keep it off the event loop)."""

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter (its host memory and slot); requests in flight that use it finish with it."""

    @property
    def kv_watch(self) -> KVWatch | None:
        """The KV pool as the live view shows it (dashboard/live.py), or None where the engine has no one
        pool to show (replicas)."""

    def watch_kv(self, seconds: float) -> None:
        """Keep `kv_watch` up to date for `seconds` from now (a viewer renews it while it looks)."""
