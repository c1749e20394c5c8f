"""Speculative decoding in the core: who gets drafts, how many, and what the verifier kept.

After a step commits, every running request that is decoding gets up to k draft tokens from the
proposer (n-gram prompt lookup, suffix trees: both need only token ids; a draft model runs in the
executor, `worker/draft_runner.py`). The next step's plan runs them behind the request's last
known token; the sampler's verifier keeps the longest prefix the model agrees with plus one token
of its own, and the core rewinds the request past the rest (`Scheduler.rewind`).

How many drafts a request gets is a cost decision. The k-th draft of a request is accepted with
probability about alpha^k (alpha: the request's measured per-token acceptance rate), and it costs
one more row in the step: drafting it pays while alpha^k exceeds that row's cost relative to the
step it saves (`DRAFT_ROW_COST`, measured). A request whose acceptance is too low for even one
draft stops drafting, and tries one again every `PROBE_INTERVAL` steps. Past
`SpeculativeConfig.max_batch` running requests a step is bound by arithmetic, not by reading the
weights, and no request drafts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedserve.config import SpeculativeConfig
from pagedserve.core.request import Request

# The cost of one more decode row in a step, as a share of a one-row step's: a draft must be
# accepted at least this often to pay. Measured by `pagedserve bench spec`'s cost curve (the embedded
# model on the 2-core CPU: the mean marginal row up to 8 rows, docs/benchmarks.md).
DRAFT_ROW_COST = 0.014
# Steps a request that stopped drafting waits before it tries one draft again.
PROBE_INTERVAL = 16
# The acceptance rate's moving average: the weight of the newest draft.
ACCEPTANCE_DECAY = 0.15


@dataclass
class SpecDecodeCounters:
    """Running totals, as vLLM's spec_decode metrics count them."""

    num_drafts: int = 0  # requests verified with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j


@dataclass
class _RequestState:
    acceptance: float = 1.0  # optimistic until measured: a request drafts at first
    idle_steps: int = 0  # steps since it last drafted, while it does not


class Speculation:
    def __init__(self, config: SpeculativeConfig, draft_proposer=None) -> None:
        """`draft_proposer`: for method draft_model, the executor's draft model runner (its
        `propose(requests, num_tokens)` fills drafts); else the token-id proposer is made here."""
        self.config = config
        self.max_drafts = config.num_speculative_tokens
        self.counters = SpecDecodeCounters(accepted_per_position=[0] * self.max_drafts)
        self._states: dict[object, _RequestState] = {}
        self._ngram = self._suffix = None
        if draft_proposer is None and config.method == "ngram":
            from pagedserve.spec_decode.ngram import NgramProposer

            self._ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif draft_proposer is None and config.method == "suffix":
            from pagedserve.spec_decode.suffix import SuffixProposer

            self._suffix = SuffixProposer(config.suffix_decoding_max_tree_depth,
                                          config.suffix_decoding_max_cached_requests,
                                          config.suffix_decoding_min_token_prob)
        self._draft_model = draft_proposer

    def num_drafts(self, request: Request, max_model_len: int, batch_size: int) -> int:
        """How many drafts `request` may take for its next step (0: none)."""
        if batch_size > self.config.max_batch:
            return 0
        params = request.sampling_params
        room = max_model_len - request.num_tokens - 1  # the step adds up to k + 1 tokens
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - len(request.output_token_ids) - 1)
        if room < 1:
            return 0
        state = self._states.setdefault(request.request_id, _RequestState())
        k = self._worth_drafting(state.acceptance)
        if k == 0:
            state.idle_steps += 1
            if state.idle_steps < PROBE_INTERVAL:
                return 0
            k = 1  # probe: acceptance may have changed
        return min(k, room)

    def _worth_drafting(self, acceptance: float) -> int:
        """The most drafts whose last one is still accepted at least DRAFT_ROW_COST of the time."""
        if acceptance >= 1.0:
            return self.max_drafts
        if acceptance <= DRAFT_ROW_COST:
            return 0
        return min(self.max_drafts, int(math.log(DRAFT_ROW_COST) / math.log(acceptance)))

    def propose(self, requests: list[Request], max_model_len: int, batch_size: int) -> None:
        """Give each request (decoding, its last token not yet computed) its drafts for the next step."""
        wanted = [(r, self.num_drafts(r, max_model_len, batch_size)) for r in requests]
        wanted = [(r, k) for r, k in wanted if k > 0]
        if self._draft_model is not None:
            drafted = self._draft_model.propose([r for r, _ in wanted], [k for _, k in wanted])
        else:
            drafted = [self._propose_one(r, k) for r, k in wanted]
        for (request, _), drafts in zip(wanted, drafted):
            # Placeholders (negative ids) are drafted in the step, under the grammar already.
            request.spec_token_ids = drafts if drafts and drafts[0] < 0 else self._grammar_allows(request, drafts)

    def _propose_one(self, request: Request, k: int) -> list[int]:
        if self._ngram is not None:
            return self._ngram.propose(request.all_token_ids, k, request_id=request.request_id)
        return self._suffix.propose(request.request_id, request.all_token_ids, k)

    @staticmethod
    def _grammar_allows(request: Request, drafts: list[int]) -> list[int]:
        """The drafts cut before the first one the request's grammar refuses (or after one that ends
        it): a refused draft could never be accepted, and the rows after it are wasted."""
        grammar = request.grammar
        if grammar is None or not drafts:
            return drafts
        n = 0
        while n < len(drafts) and not grammar.is_terminated() and grammar.accept_token(drafts[n]):
            n += 1
        if n:
            grammar.rollback(n)
        return drafts[:n]

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """The verifier kept `num_accepted` of the request's `num_drafts` drafts."""
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_drafts
        c.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            c.accepted_per_position[j] += 1
        state = self._states.setdefault(request.request_id, _RequestState())
        state.idle_steps = 0
        # Each draft up to the first rejection is one trial of the per-token acceptance rate.
        trials = min(num_accepted + 1, num_drafts)
        for j in range(trials):
            state.acceptance += ACCEPTANCE_DECAY * (float(j < num_accepted) - state.acceptance)

    def finish(self, request: Request) -> None:
        """The request ended: forget it (the suffix proposer keeps its output to draft from)."""
        self._states.pop(request.request_id, None)
        if self._ngram is not None:
            self._ngram.abort(request.request_id)
        if self._suffix is not None:
            if request.status.value in ("stop", "length"):
                self._suffix.finish(request.request_id, request.output_token_ids)
            else:
                self._suffix.abort(request.request_id)
