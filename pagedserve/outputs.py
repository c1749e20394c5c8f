"""What generation returns, with vLLM's class and field names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the model's most likely token
    decoded_token: str | None = None


# One entry per generated token: token id -> its Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing precedes it), then token id -> its
# Logprob (the prompt token, with its rank, plus the top-k).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error", or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict = field(default_factory=dict)  # arrival / first token / finish times
    error: str | None = None  # set when the engine failed on this request (finish_reason "error")
    error_param: str | None = None  # with an error the request's own field caused: that field
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs asked for them


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated
    logprobs: list[float]  # of each generated token
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first
