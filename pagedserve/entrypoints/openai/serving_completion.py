"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from pagedserve.entrypoints.openai.protocol import (
    CompletionChoice, CompletionLogProbs, CompletionRequest, CompletionResponse, UsageInfo,
)
from pagedserve.entrypoints.openai.serving_engine import (
    SSE_DONE, APIError, OpenAIServing, Prompt, StreamState, bad_request, random_id, sse,
)
from pagedserve.outputs import RequestOutput, SampleLogprobs


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> Response:
        self.check_model(request.model)
        if request.echo and request.logprobs is not None:
            raise bad_request("echo with logprobs needs the prompt's logprobs, which this server does not compute",
                              "echo")
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
        params = self.sampling_params(request, max_tokens, request.logprobs)
        request_id = random_id("cmpl")
        outputs = self.generate(prompts, params, request_id, "prompt")
        # Wait for the first output before answering, so a refused prompt is still an HTTP error.
        first = await anext(outputs)
        echoes = await self.run_blocking(self._echoes, prompts) if request.echo else [""] * len(prompts)
        if request.stream:
            return StreamingResponse(self._stream(request, request_id, echoes, first, outputs),
                                     media_type="text/event-stream")
        final = {first[0]: first[1]}
        async with aclosing(outputs):
            async for i, output in outputs:
                final[i] = output
        choices = [choice for i in range(len(prompts))
                   for choice in self._choices(request, i, final[i], echoes[i])]
        response = CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=_usage(final.values()))
        return JSONResponse(response.model_dump())

    def _tokenize_all(self, prompts: list[str | list[int]]) -> list[Prompt]:
        """Runs on the executor."""
        return [self._tokenize(p) for p in prompts]

    def _tokenize(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)  # as LLM.generate does
        return None, list(prompt)

    def _echoes(self, prompts: list[Prompt]) -> list[str]:
        """Runs on the executor."""
        return [self._echo(p) for p in prompts]

    def _echo(self, prompt: Prompt) -> str:
        text, ids = prompt
        return text if text is not None else self.engine.tokenizer.decode(ids)

    def _choices(self, request: CompletionRequest, i: int, output: RequestOutput, echo: str) -> list[CompletionChoice]:
        """The final choices of prompt i, numbered i * n + sample index."""
        return [
            CompletionChoice(
                index=i * len(output.outputs) + o.index, text=echo + o.text, finish_reason=o.finish_reason,
                logprobs=(_logprobs(o.token_ids, o.logprobs, len(echo))
                          if request.logprobs is not None else None))
            for o in output.outputs
        ]

    async def _stream(self, request: CompletionRequest, request_id: str, echoes: list[str],
                      first: tuple[int, RequestOutput], outputs: AsyncIterator[tuple[int, RequestOutput]]):
        created = int(time.time())
        n = request.n or 1
        states = [StreamState() for _ in range(len(echoes) * n)]
        offsets = [len(echoes[k // n]) for k in range(len(states))]  # text_offset of the next token
        final: dict[int, RequestOutput] = {}

        def chunks(i: int, output: RequestOutput):
            final[i] = output
            for o in output.outputs:
                k = i * n + o.index
                new = states[k].advance(o)
                if new is None:
                    continue
                text, tokens = new
                if tokens.start == 0:
                    text = echoes[i] + text
                logprobs = None
                if request.logprobs is not None:
                    logprobs = _logprobs(o.token_ids[tokens], o.logprobs[tokens], offsets[k])
                    offsets[k] += sum(len(t) for t in logprobs.tokens)
                choice = CompletionChoice(index=k, text=text, logprobs=logprobs, finish_reason=o.finish_reason)
                yield sse(CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[choice]))

        async with aclosing(outputs):
            try:
                for chunk in chunks(*first):
                    yield chunk
                async for i, output in outputs:
                    for chunk in chunks(i, output):
                        yield chunk
                if request.include_usage:
                    yield sse(CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                                 usage=_usage(final.values())))
            except APIError as e:  # the status is sent already: the error goes in the stream
                yield sse(e.body)
        yield SSE_DONE


def _logprobs(token_ids: list[int], logprobs: SampleLogprobs, offset: int) -> CompletionLogProbs:
    """OpenAI's legacy logprobs for these tokens, the first starting at text offset `offset`."""
    result = CompletionLogProbs()
    for token, entry in zip(token_ids, logprobs):
        sampled = entry[token]
        result.tokens.append(sampled.decoded_token)
        result.token_logprobs.append(sampled.logprob)
        result.text_offset.append(offset)
        offset += len(sampled.decoded_token)
        # The entry holds the sampled token and the top `logprobs` tokens: all of it, as vLLM returns it.
        result.top_logprobs.append({lp.decoded_token: lp.logprob for lp in entry.values()})
    return result


def _usage(outputs) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(s.token_ids) for o in outputs for s in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
