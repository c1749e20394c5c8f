"""Beam search over the engine, with beams sharing KV blocks.

Each beam is an engine request. After a step computes every live beam's last token, the search
takes the best `beam_width` continuations over all beams; each becomes a new request forked from
its parent beam (sharing all its blocks), and the parents are released. The first write into a
shared, partially filled block is then copied (copy-on-write), as for parallel sampling. Scoring
follows transformers: candidates ranked by cumulative log-probability; a finished hypothesis
(EOS) counts only if it ranks within the top `beam_width`; final ranking by
cumulative logprob / generated_length ** length_penalty.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.request import Request, RequestStatus
from pagedserve.outputs import BeamSearchOutput, BeamSearchSequence
from pagedserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # accepted for vLLM compatibility; only 0 (deterministic) is supported
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 for beam search, got {self.temperature}")


@dataclass
class _Beam:
    request: Request
    logprobs: list[float]
    cum_logprob: float


class BeamSearch:
    """One prompt's search; `advance()` after every engine step."""

    def __init__(self, engine, prompt_token_ids: list[int], params: BeamSearchParams) -> None:
        engine.validate_prompt(prompt_token_ids)
        self.engine = engine
        self.params = params
        self.prompt_len = len(prompt_token_ids)
        # The beams never sample: the search appends their tokens.
        self._request_params = SamplingParams(max_tokens=params.max_tokens, temperature=0.0)
        root = self._new_request(prompt_token_ids)
        self.live = [_Beam(root, [], 0.0)]
        self.finished: list[BeamSearchSequence] = []
        self.num_steps = 0
        self.done = False
        engine.scheduler.add(root)

    def _new_request(self, token_ids: list[int]) -> Request:
        request = Request(("beam", self.engine.next_request_id()), token_ids[: self.prompt_len], self._request_params)
        request.beam_width = self.params.beam_width
        for token in token_ids[self.prompt_len :]:
            request.append_token(token)
        return request

    def _score(self, cum_logprob: float, generated: int) -> float:
        return cum_logprob / max(generated, 1) ** self.params.length_penalty

    def advance(self) -> None:
        if self.done:
            return
        failed = next((b.request for b in self.live if b.request.status is RequestStatus.FINISHED_ERROR), None)
        if failed is not None:
            raise RuntimeError(f"the engine failed on a beam of this search ({failed.request_id})")
        if any(b.request.beam_candidates is None for b in self.live):
            return
        candidates = []
        for beam in self.live:
            for logprob, token in zip(*beam.request.beam_candidates):
                candidates.append((beam.cum_logprob + logprob, logprob, token, beam))
        candidates.sort(key=lambda c: -c[0])
        width, eos = self.params.beam_width, self.engine.eos_token_ids
        chosen = []
        for rank, (cum, logprob, token, beam) in enumerate(candidates):
            if not self.params.ignore_eos and token in eos:
                if rank < width:
                    self._finish(beam.request.all_token_ids + [token], beam.logprobs + [logprob], cum, "stop")
                continue
            chosen.append((cum, logprob, token, beam))
            if len(chosen) == width:
                break
        self.num_steps += 1
        scheduler = self.engine.scheduler
        new_live = []
        for cum, logprob, token, beam in chosen:
            child = self._new_request(beam.request.all_token_ids + [token])
            scheduler.fork(beam.request, child)  # shares every block of the parent
            new_live.append(_Beam(child, beam.logprobs + [logprob], cum))
        for beam in self.live:
            scheduler.finish(beam.request, RequestStatus.FINISHED_ABORTED)
        self.live = new_live
        if self.num_steps >= self.params.max_tokens or self._cannot_improve():
            for beam in self.live:
                self._finish(beam.request.all_token_ids, beam.logprobs, beam.cum_logprob, "length")
                scheduler.finish(beam.request, RequestStatus.FINISHED_LENGTH)
            self.live = []
            self.done = True

    def _cannot_improve(self) -> bool:
        """Enough hypotheses are finished and no live beam could still rank above them."""
        if len(self.finished) < self.params.beam_width or not self.live:
            return not self.live
        worst = sorted((self._score(s.cum_logprob, len(s.logprobs)) for s in self.finished), reverse=True)[
            self.params.beam_width - 1]
        best_live = max(self._score(b.cum_logprob, len(b.logprobs)) for b in self.live)
        return best_live <= worst

    def _finish(self, tokens: list[int], logprobs: list[float], cum: float, reason: str) -> None:
        self.finished.append(BeamSearchSequence(tokens=list(tokens), logprobs=logprobs, cum_logprob=cum,
                                                finish_reason=reason))

    def result(self) -> BeamSearchOutput:
        ranked = sorted(self.finished, key=lambda s: -self._score(s.cum_logprob, len(s.logprobs)))
        best = ranked[: self.params.beam_width]
        for seq in best:
            seq.text = self.engine.tokenizer.decode(seq.tokens[self.prompt_len :], skip_special_tokens=True)
        return BeamSearchOutput(sequences=best)


def run_beam_search(engine, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Search every prompt together, stepping the engine until all searches are done."""
    searches = [BeamSearch(engine, prompt, params) for prompt in prompts]
    try:
        while not all(s.done for s in searches):
            steps_before = engine.stats.num_steps, [s.num_steps for s in searches]
            engine.step()
            for search in searches:
                search.advance()
            if (engine.stats.num_steps, [s.num_steps for s in searches]) == steps_before:
                raise RuntimeError("beam search made no progress: the engine ran nothing and no search advanced")
    except BaseException:
        for search in searches:
            for beam in search.live:
                engine.scheduler.finish(beam.request, RequestStatus.FINISHED_ABORTED)
        raise
    return [s.result() for s in searches]
