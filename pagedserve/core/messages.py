"""What the front and the engine core say to each other, as msgspec structs.

The same objects travel by function call when the core runs in-process, and as msgpack frames
over ZMQ when it runs in a process of its own (`core_process.py`): no pickle on the wire.
Structs are array-like (fields by position) to keep frames small.
"""

from __future__ import annotations

import msgspec

from pagedserve.core.kv_view import KVView
from pagedserve.kv import KVCacheStats
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, tag="add"):
    """A request, tokenized and validated by the front."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model


class AbortRequests(msgspec.Struct, array_like=True, tag="abort"):
    """End these user requests at once (the client left, or the front failed on them)."""

    request_ids: list[str]


class StopSamples(msgspec.Struct, array_like=True, tag="stop"):
    """The front found a stop string in these samples, (request id, sample index): end them."""

    samples: list[tuple[str, int]]


class RemoveLoRA(msgspec.Struct, array_like=True, tag="remove_lora"):
    """Forget an adapter: its weights leave host memory and the model's slot (`EngineCore.remove_lora`)."""

    lora_int_id: int


class WatchKV(msgspec.Struct, array_like=True, tag="watch_kv"):
    """Someone watches the KV pool live: attach a `KVView` to the outputs now and then, for `seconds`
    from now (the front renews it while it has viewers)."""

    seconds: float


class Ping(msgspec.Struct, array_like=True, tag="ping"):
    """The front's liveness probe, sent when the core has said nothing for a while. The core answers
    from its step loop, with the outputs message it sends after every pass (empty unless a step
    ran); a core that does not answer within the front's stall timeout is stalled."""


class Shutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    pass


CoreCommand = EngineCoreRequest | AbortRequests | StopSamples | RemoveLoRA | WatchKV | Ping | Shutdown


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities of one token (sampled, or of the prompt): its own, its rank, and the
    top-k (token, logprob)."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


class SampleOutput(msgspec.Struct, array_like=True):
    """What one sample of a request got in one step."""

    request_id: str
    index: int
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    finish_reason: str | None = None  # "stop" (EOS or a stop token), "length" or "error"
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    error: str | None = None  # why the engine failed on this request (finish_reason "error")
    # Sent once, with the first sample's first token, when asked for: one entry per prompt token
    # after the first (what precedes it predicts it), each holding that prompt token's logprob.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Sent with a sample's first token: when the scheduler first admitted it (time.monotonic(),
    # which is one clock for every process of a machine).
    scheduled_time: float | None = None
    # With an error the client caused (a grammar that does not compile in time, say): the
    # request's field at fault, for a 400 naming it ("structured_outputs" stands for the field
    # the front took the constraint from).
    error_param: str | None = None


class SpecDecodeStats(msgspec.Struct, array_like=True):
    """Speculative decoding's totals, as vLLM's spec_decode metrics count them."""

    num_drafts: int  # request-steps verified with at least one draft
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]  # [j]: drafts accepted at position j

    def plus(self, other: SpecDecodeStats | None) -> SpecDecodeStats:
        if other is None:
            return self
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        per_position = [a + b for a, b in zip(self.accepted_per_position + [0] * width,
                                              other.accepted_per_position + [0] * width)][:width]
        return SpecDecodeStats(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                               self.num_accepted_tokens + other.num_accepted_tokens, per_position)


class CoreStats(msgspec.Struct, array_like=True):
    """The core's figures after a step. Counts are per sequence (a request with n samples is n)."""

    num_running: int
    num_waiting: int
    kv: KVCacheStats
    num_preemptions: int
    spec: SpecDecodeStats | None = None  # with speculative decoding
    kv_groups: list[tuple[int, int]] = []  # per KV cache group: (its window, 0 for full; blocks in use)


class EngineCoreOutputs(msgspec.Struct, array_like=True, tag="outputs"):
    outputs: list[SampleOutput]
    stats: CoreStats
    kv_view: KVView | None = None  # while watched, when one is due (core/kv_view.py)


class CoreReady(msgspec.Struct, array_like=True, tag="ready"):
    """The core process loaded the model and sized its pool: the facts the front needs."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    num_kv_blocks: int
    stats: CoreStats


class CoreFailed(msgspec.Struct, array_like=True, tag="failed"):
    """The core process failed (at start, or in its loop) and is exiting."""

    message: str


CoreMessage = EngineCoreOutputs | CoreReady | CoreFailed
