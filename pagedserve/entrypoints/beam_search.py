"""Beam search above the engine, as vLLM v1 runs it.

Each round, every live beam of every search is an ordinary engine request for one greedy token
that returns its top log-probabilities (`2 x beam_width`, more for a model with several EOS
ids). The search then keeps the best `beam_width` continuations over all its beams. The engine sees nothing but requests: no beam state
lives in the scheduler, and a pool too small for every beam at once simply runs the round's
requests in turn. The prefix cache keeps what the beams share, so a beam's request recomputes only
the tail of its tokens that no full cached block holds.

Scoring follows transformers: candidates ranked by cumulative log-probability; a finished
hypothesis (EOS) counts only if it ranks within the top `beam_width`; the final ranking divides
the cumulative log-probability by generated_length ** length_penalty.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class _Beam:
    tokens: list[int]  # prompt + generated
    logprobs: list[float]  # of each generated token
    cum_logprob: float


class _Search:
    """One prompt's search: its live beams and its finished hypotheses."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, eos_token_ids: set[int], max_model_len: int):
        self.prompt_len = len(prompt)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.live = [_Beam(list(prompt), [], 0.0)]
        self.finished: list[BeamSearchSequence] = []
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return not self.live

    def advance(self, candidates: list[list[tuple[float, int]]]) -> None:
        """Take each live beam's top (logprob, token) candidates, best first; keep the best beams."""
        ranked = sorted(((beam.cum_logprob + logprob, logprob, token, beam)
                         for beam, beam_candidates in zip(self.live, candidates)
                         for logprob, token in beam_candidates), key=lambda c: -c[0])
        width = self.params.beam_width
        chosen = []
        for rank, (cum, logprob, token, beam) in enumerate(ranked):
            if not self.params.ignore_eos and token in self.eos_token_ids:
                if rank < width:
                    self._finish(beam.tokens + [token], beam.logprobs + [logprob], cum, "stop")
                continue
            chosen.append(_Beam(beam.tokens + [token], beam.logprobs + [logprob], cum))
            if len(chosen) == width:
                break
        self.num_steps += 1
        self.live = chosen
        if (self.num_steps >= self.params.max_tokens or self._cannot_improve()
                or any(len(beam.tokens) >= self.max_model_len for beam in self.live)):
            for beam in self.live:
                self._finish(beam.tokens, beam.logprobs, beam.cum_logprob, "length")
            self.live = []

    def _score(self, cum_logprob: float, generated: int) -> float:
        return cum_logprob / max(generated, 1) ** self.params.length_penalty

    def _cannot_improve(self) -> bool:
        """Enough hypotheses are finished and no live beam could still rank above them."""
        if len(self.finished) < self.params.beam_width or not self.live:
            return not self.live
        worst = sorted((self._score(s.cum_logprob, len(s.logprobs)) for s in self.finished), reverse=True)[
            self.params.beam_width - 1]
        return max(self._score(b.cum_logprob, len(b.logprobs)) for b in self.live) <= worst

    def _finish(self, tokens: list[int], logprobs: list[float], cum: float, reason: str) -> None:
        self.finished.append(BeamSearchSequence(tokens=tokens, logprobs=logprobs, cum_logprob=cum,
                                                finish_reason=reason))

    def result(self, tokenizer) -> BeamSearchOutput:
        best = sorted(self.finished, key=lambda s: -self._score(s.cum_logprob, len(s.logprobs)))
        best = best[: self.params.beam_width]
        for seq in best:
            seq.text = tokenizer.decode(seq.tokens[self.prompt_len :], skip_special_tokens=True)
        return BeamSearchOutput(sequences=best)


def beam_search(engine, prompts: list[list[int]], params: BeamSearchParams,
                adapters: list | None = None) -> list[BeamSearchOutput]:
    """Search every prompt together, one round of engine requests per generated token; `adapters`:
    each prompt's LoRARequest (or None), whose requests run under it."""
    adapters = adapters or [None] * len(prompts)
    for prompt in prompts:
        engine.validate_prompt(prompt)
    # Greedy, one token, and enough of its most likely next tokens (of the model's raw logits)
    # that `width` of them are not EOS, as transformers keeps: max(2, 1 + number of EOS ids) x width.
    num_candidates = max(2, 1 + len(engine.eos_token_ids)) * params.beam_width
    round_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=num_candidates)
    searches = [_Search(p, params, engine.eos_token_ids, engine.max_model_len) for p in prompts]
    adapter_of = {id(search): adapter for search, adapter in zip(searches, adapters)}
    while not all(s.done for s in searches):
        beams = {}  # request id -> (search, index of the beam)
        try:
            for search in searches:
                for i, beam in enumerate(search.live):
                    request_id = f"beam-{engine.next_request_id()}"
                    engine.add_request(request_id, beam.tokens, round_params, lora_request=adapter_of[id(search)])
                    beams[request_id] = (search, i)
            outputs = _run(engine, set(beams))
        except BaseException:
            for request_id in beams:
                engine.abort_request(request_id)
            raise
        candidates = {id(search): [[] for _ in search.live] for search in searches}
        for request_id, (search, i) in beams.items():
            candidates[id(search)][i] = _top(outputs[request_id], num_candidates)
        for search in searches:
            if not search.done:
                search.advance(candidates[id(search)])
    return [s.result(engine.tokenizer) for s in searches]


def _run(engine, request_ids: set[str]) -> dict[str, RequestOutput]:
    """Step the engine until these requests finish; their final outputs."""
    finished: dict[str, RequestOutput] = {}
    while len(finished) < len(request_ids):
        if not engine.core.has_unfinished_requests():  # (also those waiting for their adapter)
            raise RuntimeError("the engine stopped with beam requests unfinished")
        for output in engine.step():
            if output.finished and output.request_id in request_ids:
                if output.error is not None:
                    raise RuntimeError(f"the engine failed on a beam of this search: {output.error}")
                finished[output.request_id] = output
    return finished


def _top(output: RequestOutput, k: int) -> list[tuple[float, int]]:
    """The (logprob, token) of the k most likely next tokens, best first."""
    entry = output.outputs[0].logprobs[0]  # the sampled token and the top k, each with its rank
    ranked = sorted(entry.items(), key=lambda item: item[1].rank)
    return [(lp.logprob, token) for token, lp in ranked[:k]]
