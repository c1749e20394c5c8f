"""The front's half of generation: from the core's token ids to the user's RequestOutputs.

Per user request it keeps each sample's detokenizer, text, token ids and logprobs, finds stop
strings, decodes logprob tokens and assembles cumulative RequestOutputs. It runs where the user
is (the caller's thread offline, the API process's event loop when the core has its own
process), so the core never waits on text.

A failure here (in a detokenizer, say) ends that request only: it is reported as an error output
and listed for the core to abort.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pagedserve.core.messages import SampleOutput, TokenLogprobs
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class _Sample:
    """One sample's output so far."""

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer, logprobs: bool) -> None:
        self.index = index
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        # Text that is final: never retracted by a stop string completing later, so a stream can
        # send it. The whole output text once the sample finishes.
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if logprobs else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.finish_time: float | None = None

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index, text=self.text, token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    arrival_time: float
    first_token_time: float | None = None
    scheduled_time: float | None = None  # when the core first admitted it
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)  # one per request that advanced or ended
    stopped: list[tuple[str, int]] = field(default_factory=list)  # samples a stop string ended: tell the core
    failed: list[str] = field(default_factory=list)  # requests the front failed on: abort them in the core


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> None:
        samples = [
            _Sample(i, IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop or (), include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens), params.logprobs is not None)
            for i in range(params.n)
        ]
        self._requests[request_id] = _RequestState(request_id, prompt, prompt_token_ids, params, samples, arrival_time)

    def abort(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def process(self, outputs: list[SampleOutput]) -> ProcessedOutputs:
        """Apply one step's sample outputs; return the RequestOutputs of the requests they touched,
        in the order they first appear."""
        result = ProcessedOutputs()
        now = time.monotonic()
        touched: dict[str, str | None] = {}  # request id -> error message
        error_params: dict[str, str] = {}  # request id -> the field at fault, for an error the request caused
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None or touched.get(out.request_id):
                continue  # aborted or finished here already (the core may run a step ahead), or failed
            if out.error is not None:
                touched[out.request_id] = out.error
                if out.error_param is not None:
                    error_params[out.request_id] = out.error_param
                continue
            sample = state.samples[out.index]
            if sample.finish_reason is not None:
                continue  # a stop string ended it; the core heard of it after this step
            try:
                self._apply(state, sample, out, now, result)
            except Exception as e:
                logger.exception("processing the output of request %s failed", out.request_id)
                touched[out.request_id] = f"the server failed on this request's output: {e!r}"
                result.failed.append(out.request_id)
                continue
            touched.setdefault(out.request_id, None)
        for request_id, error in touched.items():
            result.outputs.append(self._output(self._requests[request_id], error, error_params.get(request_id)))
        return result

    def _apply(self, state: _RequestState, sample: _Sample, out: SampleOutput, now: float,
               result: ProcessedOutputs) -> None:
        params = state.params
        state.num_cached_tokens = out.num_cached_tokens
        if state.first_token_time is None:  # the core sends its admission time with the first token
            state.first_token_time, state.scheduled_time = now, out.scheduled_time
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = [None] + [self._logprob_entry(token, lp)
                                              for token, lp in zip(state.prompt_token_ids[1:], out.prompt_logprobs)]
        # Token by token: a step may bring several (speculative decoding), and a stop string ends
        # the sample at the token that completes it, the later ones dropped.
        last = len(out.new_token_ids) - 1
        for k, token in enumerate(out.new_token_ids):
            sample.token_ids.append(token)
            if sample.logprobs is not None and out.logprobs is not None:
                lp = out.logprobs[k]
                sample.cumulative_logprob += lp.logprob
                sample.logprobs.append(self._logprob_entry(token, lp))
            # A stop token's text (EOS or stop_token_ids) is left out of the output unless asked for.
            stop_token = k == last and out.finish_reason == "stop"
            if not stop_token or params.include_stop_str_in_output:
                sample.text += sample.detokenizer.add_tokens([token])
                if not stop_token and sample.detokenizer.stop_matched:
                    sample.finish_reason, sample.stop_reason = "stop", sample.detokenizer.stop_matched
                    if out.finish_reason is None:  # still running in the core
                        result.stopped.append((state.request_id, sample.index))
                    break
        if sample.finish_reason is None and out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        if sample.finish_reason is not None:
            sample.finish_time = now
            sample.text += sample.detokenizer.finish()

    def _logprob_entry(self, token: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        """vLLM's shape: the token itself first, with its rank, then the top-k ranked from 1."""
        entry = {token: Logprob(lp.logprob, lp.rank, self._decode_one(token))}
        for rank, (tok, value) in enumerate(lp.top, start=1):
            entry.setdefault(tok, Logprob(value, rank, self._decode_one(tok)))
        return entry

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _output(self, state: _RequestState, error: str | None, error_param: str | None = None) -> RequestOutput:
        if error is not None:
            for sample in state.samples:
                if sample.finish_reason is None:
                    sample.finish_reason = "error"
        finished = all(s.finish_reason is not None for s in state.samples)
        output = RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[s.completion() for s in state.samples],
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics={"arrival_time": state.arrival_time, "first_scheduled_time": state.scheduled_time,
                     "first_token_time": state.first_token_time,
                     "finish_time": max((s.finish_time or 0.0) for s in state.samples) if finished else None},
            error=error,
            error_param=error_param,
            prompt_logprobs=state.prompt_logprobs,
        )
        if finished:
            del self._requests[state.request_id]
        return output
