"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionChoice, ChatCompletionChunk, ChatCompletionLogProb, ChatCompletionLogProbs, ChatCompletionRequest,
    ChatCompletionResponse, ChatCompletionStreamChoice, ChatMessage, ChatResponseMessage, DeltaMessage, TopLogprob,
    UsageInfo,
)
from pagedserve.entrypoints.openai.serving_engine import (
    SSE_DONE, APIError, OpenAIServing, Prompt, StreamState, bad_request, random_id, sse,
)
from pagedserve.outputs import Logprob, RequestOutput, SampleLogprobs


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        # Before any template or tokenization: messages whose text cannot fit cost nothing. A
        # template puts each message's content into the prompt, at most trimmed of surrounding
        # whitespace (Llama 3's trims), so the stripped lengths are what the prompt holds at least.
        await self.check_prompt_chars([m.text().strip() for m in request.messages], "messages")
        prompt = await self.run_blocking(self.chat_prompt, request.messages)
        num_prompt_tokens = len(prompt[1])
        max_tokens = request.max_completion_tokens or request.max_tokens
        self.check_context(num_prompt_tokens, max_tokens, "messages")
        if max_tokens is None:
            max_tokens = self.max_tokens_left(num_prompt_tokens)  # the operator's default, or the context limit
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, num_logprobs)
        request_id = random_id("chatcmpl")
        outputs = self.generate([prompt], params, request_id, "messages")
        # Wait for the first output before answering, so a refused prompt is still an HTTP error.
        _, output = await anext(outputs)
        if request.stream:
            return StreamingResponse(self._stream(request, request_id, output, outputs), media_type="text/event-stream")
        async with aclosing(outputs):
            async for _, output in outputs:  # outputs are cumulative: the last one is the answer
                pass
        choices = [ChatCompletionChoice(index=o.index, message=ChatResponseMessage(content=o.text),
                                        finish_reason=o.finish_reason,
                                        logprobs=self._logprobs(request, o.token_ids, o.logprobs))
                   for o in output.outputs]
        response = ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=_usage(output))
        return JSONResponse(response.model_dump())

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> Prompt:
        """The conversation's prompt text (the chat template's) and token ids. Runs on the executor."""
        tokenizer = self.engine.tokenizer
        turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
        try:
            text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # the template rejects this conversation (e.g. roles out of order)
            raise bad_request(f"the chat template failed on these messages: {e}", "messages") from e
        return text, tokenizer.encode(text, add_special_tokens=False)  # as LLM.chat does

    @staticmethod
    def _logprobs(request: ChatCompletionRequest, token_ids: list[int],
                  logprobs: SampleLogprobs | None) -> ChatCompletionLogProbs | None:
        if not request.logprobs:
            return None
        num_top = request.top_logprobs or 0

        def top(lp: Logprob) -> TopLogprob:
            return TopLogprob(token=lp.decoded_token, logprob=lp.logprob, bytes=list(lp.decoded_token.encode()))

        content = []
        for token, entry in zip(token_ids, logprobs):
            sampled = entry[token]
            best = sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
            content.append(ChatCompletionLogProb(**top(sampled).model_dump(), top_logprobs=[top(lp) for lp in best]))
        return ChatCompletionLogProbs(content=content)

    async def _stream(self, request: ChatCompletionRequest, request_id: str, first: RequestOutput,
                      outputs: AsyncIterator[tuple[int, RequestOutput]]):
        created = int(time.time())
        states = [StreamState() for _ in first.outputs]
        final = first

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices,
                                           usage=usage))

        def chunks(output: RequestOutput):
            for o in output.outputs:
                new = states[o.index].advance(o)
                if new is None:
                    continue
                text, tokens = new
                delta = DeltaMessage(content=text) if text else DeltaMessage()
                logprobs = self._logprobs(request, o.token_ids[tokens], o.logprobs[tokens] if o.logprobs else None)
                yield chunk([ChatCompletionStreamChoice(index=o.index, delta=delta, logprobs=logprobs,
                                                        finish_reason=o.finish_reason)])

        async with aclosing(outputs):
            try:
                for o in first.outputs:  # OpenAI opens each choice with the role
                    yield chunk([ChatCompletionStreamChoice(index=o.index,
                                                            delta=DeltaMessage(role="assistant", content=""))])
                for c in chunks(first):
                    yield c
                async for _, final in outputs:
                    for c in chunks(final):
                        yield c
                if request.include_usage:
                    yield chunk([], usage=_usage(final))
            except APIError as e:  # the status is sent already: the error goes in the stream
                yield sse(e.body)
        yield SSE_DONE


def _usage(output: RequestOutput) -> UsageInfo:
    prompt = len(output.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in output.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
