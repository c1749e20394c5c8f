"""POST /v1/completions.

`echo` with `logprobs` returns OpenAI's legacy logprobs over the prompt, then over the generated
tokens (what lm-evaluation-harness's loglikelihood tasks read): the engine computes the prompt's
logprobs (SamplingParams.prompt_logprobs). `max_tokens` 0 with `echo` returns the prompt alone,
scored: the engine generates one token, which the answer leaves out.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi.responses import StreamingResponse
from starlette.responses import Response

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.entrypoints.openai.limits import RequestWork
from pagedserve.entrypoints.openai.protocol import (
    CompletionChoice, CompletionLogProbs, CompletionRequest, CompletionResponse, PromptLogprob, PromptTokensDetails,
    UsageInfo,
)
from pagedserve.entrypoints.openai.serving_engine import (
    SSE_DONE, Answerer, APIError, OpenAIServing, Prompt, StreamState, bad_request, random_id, sse,
)
from pagedserve.outputs import Logprob, RequestOutput, SampleLogprobs


@dataclass
class _Echo:
    """A prompt as the answer echoes it: its text and, for logprobs, each token's start in it."""

    text: str
    offsets: list[int] | None = None
    first_token: str | None = None  # the first token's text (it has no logprob entry to carry it)


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> Response:
        adapter = self.check_model(request.model)
        prompt_only = request.max_tokens == 0
        if prompt_only and not request.echo:
            raise bad_request("max_tokens must be >= 1, or 0 with echo true (the prompt alone, scored)", "max_tokens")
        texts_or_ids = request.prompts()
        if not texts_or_ids:
            raise bad_request("the prompt is empty", "prompt")
        for p in texts_or_ids:  # before any tokenization: a prompt that cannot fit costs nothing
            if isinstance(p, str):
                await self.check_prompt_chars([p], "prompt")
        prompts = await self.run_blocking(self._tokenize_all, texts_or_ids)
        if request.max_tokens is not None:
            max_tokens = request.max_tokens
        elif self.default_max_tokens is not None:  # null: the operator's default, within the context
            max_tokens = max(1, min(self.max_tokens_left(len(ids)) for _, ids in prompts))
        else:
            max_tokens = 16
        for _, ids in prompts:
            self.check_context(len(ids), max_tokens, "prompt")
        # Echoed logprobs cover the prompt too, with as many top entries as the generated tokens'
        # (vLLM's rule), or more if prompt_logprobs asks for more.
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(request.logprobs, prompt_logprobs or 0)
        self.check_work(RequestWork(tuple(len(ids) for _, ids in prompts), request.n or 1, max_tokens,
                                    request.logprobs or 0, bool(request.echo), request.prompt_logprobs))
        # The engine generates at least one token; a prompt-only answer leaves it out.
        params = await self.sampling_params(request, max(max_tokens, 1), request.logprobs, prompt_logprobs)
        request_id = random_id("cmpl")
        outputs = self.generate(prompts, params, request_id, "prompt", request.constraint_field(), adapter)
        if prompt_only:
            outputs = _without_generation(outputs)
        # Wait for the first output before answering, so a refused prompt is still an HTTP error.
        first = await anext(outputs)
        echoes = ((await self.run_blocking(self._echoes, prompts, request.logprobs is not None))
                  if request.echo else [None] * len(prompts))
        answered = self.answerer(request.model, adapter)
        if request.stream:
            return StreamingResponse(self._stream(request, request_id, answered, echoes, first, outputs),
                                     media_type="text/event-stream")
        final = {first[0]: first[1]}
        async with aclosing(outputs):
            async for i, output in outputs:
                final[i] = output
        choices = [choice for i in range(len(prompts))
                   for choice in self._choices(request, i, final[i], echoes[i])]
        response = CompletionResponse(id=request_id, model=answered.model, choices=choices,
                                      usage=_usage(final.values()), system_fingerprint=answered.fingerprint)
        return await self.respond(response)

    def _tokenize_all(self, prompts: list[str | list[int]]) -> list[Prompt]:
        """Runs on the executor."""
        return [self._tokenize(p) for p in prompts]

    def _tokenize(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)  # as LLM.generate does
        return None, list(prompt)

    def _echoes(self, prompts: list[Prompt], with_offsets: bool) -> list[_Echo]:
        """Runs on the executor."""
        return [self._echo(p, with_offsets) for p in prompts]

    def _echo(self, prompt: Prompt, with_offsets: bool) -> _Echo:
        """The prompt's text (token ids decoded) and, `with_offsets`, where each token starts in
        it. Offsets come from decoding the ids incrementally, so a character split over several
        tokens is counted once (at the token that starts it), not once per token piece."""
        text, ids = prompt
        tokenizer = self.engine.tokenizer
        if not with_offsets:
            return _Echo(text if text is not None else tokenizer.decode(ids))
        detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
        offsets = []
        for token in ids:
            offsets.append(len(detokenizer.text))
            detokenizer.add_tokens([token])
        detokenizer.finish()
        # A text prompt is echoed as given; the offsets assume it decodes back to itself.
        return _Echo(text if text is not None else detokenizer.text, offsets, tokenizer.decode(ids[:1]))

    def _choices(self, request: CompletionRequest, i: int, output: RequestOutput,
                 echo: _Echo | None) -> list[CompletionChoice]:
        """The final choices of prompt i, numbered i * n + sample index."""
        choices = []
        for o in output.outputs:
            logprobs = None
            if request.logprobs is not None:
                logprobs = _echo_logprobs(echo, output, request.logprobs) if echo else CompletionLogProbs()
                _add_logprobs(logprobs, o.token_ids, o.logprobs, len(echo.text) if echo else 0, request.logprobs)
            choices.append(CompletionChoice(
                index=i * len(output.outputs) + o.index, text=(echo.text if echo else "") + o.text,
                finish_reason=o.finish_reason, stop_reason=o.stop_reason, logprobs=logprobs,
                prompt_logprobs=_prompt_logprobs(output, request.prompt_logprobs)))
        return choices

    async def _stream(self, request: CompletionRequest, request_id: str, answered: Answerer, echoes: list[_Echo | None],
                      first: tuple[int, RequestOutput], outputs: AsyncIterator[tuple[int, RequestOutput]]):
        created = int(time.time())
        n = request.n or 1
        states = [StreamState() for _ in range(len(echoes) * n)]
        # text_offset of each choice's next generated token
        offsets = [len(echoes[k // n].text) if echoes[k // n] else 0 for k in range(len(states))]
        final: dict[int, RequestOutput] = {}

        def chunks(i: int, output: RequestOutput):
            final[i] = output
            for o in output.outputs:
                k = i * n + o.index
                new = states[k].advance(o)
                if new is None:
                    continue
                text, tokens = new
                opening = tokens.start == 0  # the choice's first chunk: it carries the prompt's part
                echo = echoes[i] if opening else None
                if echo:
                    text = echo.text + text
                logprobs = None
                if request.logprobs is not None:
                    logprobs = _echo_logprobs(echo, output, request.logprobs) if echo else CompletionLogProbs()
                    offsets[k] = _add_logprobs(logprobs, o.token_ids[tokens], o.logprobs[tokens], offsets[k],
                                               request.logprobs)
                choice = CompletionChoice(
                    index=k, text=text, logprobs=logprobs, finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                    prompt_logprobs=_prompt_logprobs(output, request.prompt_logprobs) if opening else None)
                yield sse(CompletionResponse(id=request_id, created=created, model=answered.model, choices=[choice],
                                             system_fingerprint=answered.fingerprint))

        async with aclosing(outputs):
            try:
                for chunk in chunks(*first):
                    yield chunk
                async for i, output in outputs:
                    for chunk in chunks(i, output):
                        yield chunk
                if request.include_usage:
                    yield sse(CompletionResponse(id=request_id, created=created, model=answered.model, choices=[],
                                                 usage=_usage(final.values()), system_fingerprint=answered.fingerprint))
            except APIError as e:  # the status is sent already: the error goes in the stream
                yield sse(e.body)
        yield SSE_DONE


async def _without_generation(outputs: AsyncIterator[tuple[int, RequestOutput]]):
    """max_tokens 0 with echo: the outputs without the token the engine generated (it always
    generates one), each sample ended for length."""
    async with aclosing(outputs):
        async for i, output in outputs:
            samples = [dataclasses.replace(o, text="", token_ids=[], cumulative_logprob=None,
                                           logprobs=[] if o.logprobs is not None else None,
                                           finish_reason="length" if o.finish_reason else None, stop_reason=None)
                       for o in output.outputs]
            yield i, dataclasses.replace(output, outputs=samples)


def _top(token: int, entry: dict[int, Logprob], num_top: int) -> dict[str, float]:
    """The token itself and the top `num_top` of an entry, as vLLM returns them."""
    return {lp.decoded_token: lp.logprob for t, lp in entry.items() if t == token or lp.rank <= num_top}


def _echo_logprobs(echo: _Echo, output: RequestOutput, num_top: int) -> CompletionLogProbs:
    """OpenAI's legacy logprobs over the prompt; its first token has none (nothing precedes it)."""
    result = CompletionLogProbs(text_offset=list(echo.offsets), tokens=[echo.first_token], token_logprobs=[None],
                                top_logprobs=[None])
    for token, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
        result.tokens.append(entry[token].decoded_token)
        result.token_logprobs.append(entry[token].logprob)
        result.top_logprobs.append(_top(token, entry, num_top))
    return result


def _add_logprobs(result: CompletionLogProbs, token_ids: list[int], logprobs: SampleLogprobs, offset: int,
                  num_top: int) -> int:
    """Append OpenAI's legacy logprobs of these generated tokens to `result`, the first at text
    offset `offset`; return the offset after them."""
    for token, entry in zip(token_ids, logprobs):
        sampled = entry[token]
        result.tokens.append(sampled.decoded_token)
        result.token_logprobs.append(sampled.logprob)
        result.text_offset.append(offset)
        offset += len(sampled.decoded_token)
        result.top_logprobs.append(_top(token, entry, num_top))
    return offset


def _prompt_logprobs(output: RequestOutput, num_top: int | None) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's choices[].prompt_logprobs, when the request asked for them (echo's may hold more top entries)."""
    if num_top is None:
        return None
    return [None if entry is None else
            {t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
             for t, lp in entry.items() if t == token or lp.rank <= num_top}
            for token, entry in zip(output.prompt_token_ids, output.prompt_logprobs)]


def _usage(outputs) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(s.token_ids) for o in outputs for s in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
