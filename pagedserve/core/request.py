"""A request as the engine tracks it: one sequence of tokens and its state.

A user request with n > 1 samples becomes n Requests: the first prefills the prompt, the others
are forked from it when its first token is sampled and share its blocks.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagedserve.core.messages import TokenLogprobs
    from pagedserve.lora.request import LoRARequest
    from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # new, or preempted and waiting to be recomputed
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # new, its grammar compiling: not yet in the scheduler
    WAITING_FOR_ADAPTER = "waiting_for_adapter"  # new, its LoRA adapter loading: not yet in the scheduler
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a step failed because of this request

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.WAITING_FOR_ADAPTER,
                            RequestStatus.RUNNING)

    @property
    def unscheduled(self) -> bool:
        """Waiting for something before it joins the scheduler: it holds nothing."""
        return self in (RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.WAITING_FOR_ADAPTER)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        group_id: str | None = None,
        sample_index: int = 0,
        generator: torch.Generator | None = None,
        lora_request: LoRARequest | None = None,
        cache_key: object = None,
    ) -> None:
        self.request_id = request_id
        self.group_id = group_id if group_id is not None else request_id  # the user's request id
        self.sample_index = sample_index
        self.sampling_params = sampling_params
        self.generator = generator
        self.lora_request = lora_request  # the adapter it runs with; None: the base model
        # What its prefix-cache hashes mix in besides the tokens (its adapter's identity): K/V
        # computed under one adapter is never served to another.
        self.cache_key = cache_key
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V is in the cache
        # Chained prefix-cache hashes of all_token_ids' leading full blocks, extended by the KV
        # manager: tokens only ever grow, so they stay valid across preemptions and failed steps.
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens: int | None = None  # prompt tokens the prefix cache served at first admission
        self.scheduled_time: float | None = None  # time.monotonic() at first admission (preemptions aside)
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        # Its grammar's state (an xgrammar GrammarMatcher) when its output is constrained: it has
        # accepted exactly output_token_ids, whatever the request's KV state.
        self.grammar = None
        # The prompt logprobs gathered so far (entry p scores prompt token p + 1) while they are
        # owed: the first sample of a request that asks (forks share its prompt), until the core
        # sends them with its first token. None otherwise.
        self.prompt_logprobs: list[TokenLogprobs] | None = (
            [] if sampling_params.prompt_logprobs is not None and sample_index == 0 else None)
        # Speculative decoding: the drafts the next step verifies (proposed after this request's
        # last token; the scheduler may cut them, preemption drops them), and how many it may take.
        self.spec_token_ids: list[int] = []
        self.spec_budget: int | None = None  # set by the engine's speculation policy

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})")
