"""POST /v1/chat/completions."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.responses import StreamingResponse
from starlette.responses import Response

from pagedserve.entrypoints.openai.limits import RequestWork
from pagedserve.structured_output.manager import check_grammar
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionChoice, ChatCompletionChunk, ChatCompletionLogProb, ChatCompletionLogProbs, ChatCompletionRequest,
    ChatCompletionResponse, ChatCompletionStreamChoice, ChatMessage, ChatResponseMessage, DeltaFunctionCall,
    DeltaMessage, DeltaToolCall, FunctionCall, NamedToolChoice, PromptTokensDetails, ToolCall, TopLogprob,
    UsageInfo,
)
from pagedserve.entrypoints.openai.serving_engine import (
    SSE_DONE, Answerer, APIError, OpenAIServing, Prompt, StreamState, bad_request, random_id, sse,
)
from pagedserve.entrypoints.openai.tool_parsers import (
    CallArguments, CallStart, CallStream, Event, FirstCallOnly, HermesToolParser, NamedCallStream, PlainStream,
    RequiredCallsStream, Text, collect, get_tool_parser, parser_for_template,
)
from pagedserve.entrypoints.openai.tool_prompt import chat_turns, template_renders_tools
from pagedserve.outputs import Logprob, RequestOutput, SampleLogprobs
from pagedserve.sampling_params import ParameterError, StructuredOutputsParams

AUTO_TOOL_CHOICE_OFF = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                        '(start the server with them, or set tool_choice to "required", "none" or a named function)')


class OpenAIServingChat(OpenAIServing):
    """Chat completions, tool calls included. tool_call_parser (`hermes`, `llama3_json`, or `auto`:
    the one whose call syntax the chat template writes; hermes, the format the server writes tools
    in, for a template that renders none) reads the calls of tool_choice "auto", which
    enable_auto_tool_choice turns on (vLLM's flags); "required" and a named function need neither:
    a JSON schema constrains the output. Strict tools under "auto" are enforced by an xgrammar
    structural tag in the parser's format."""

    def __init__(self, *args, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self.template_renders_tools = template_renders_tools(self.engine.tokenizer)
        if tool_call_parser == "auto":  # a template that renders no tools gets the server's format: hermes
            tool_call_parser = (parser_for_template(self.engine.tokenizer.chat_template) if self.template_renders_tools
                                else HermesToolParser.name)
        self.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.enable_auto_tool_choice = enable_auto_tool_choice
        # For a template that does not render tools, the server writes them and past calls in this format.
        self.call_format = self.tool_parser or HermesToolParser()

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        adapter = self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        self.check_tools(request)
        strict_calls = await self.run_blocking(self.strict_calls_constraint, request)  # parses schemas: off the loop
        # Before any template or tokenization: messages whose text cannot fit cost nothing. A
        # template puts each message's content into the prompt, at most trimmed of surrounding
        # whitespace (Llama 3's trims), so the stripped lengths are what the prompt holds at least.
        await self.check_prompt_chars([m.text().strip() for m in request.messages], "messages")
        # tool_choice "none": the tools stay out of the prompt, so the model is not asked to call them.
        tools = ([tool.model_dump(exclude_none=True) for tool in request.tools]
                 if request.tools and request.resolved_tool_choice() != "none" else None)
        prompt = await self.run_blocking(self.chat_prompt, request.messages, True, tools)
        num_prompt_tokens = len(prompt[1])
        max_tokens = request.max_completion_tokens or request.max_tokens
        self.check_context(num_prompt_tokens, max_tokens, "messages")
        if max_tokens is None:
            max_tokens = self.max_tokens_left(num_prompt_tokens)  # the operator's default, or the context limit
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        self.check_work(RequestWork((num_prompt_tokens,), request.n or 1, max_tokens, num_logprobs or 0))
        params = await self.sampling_params(request, max_tokens, num_logprobs)
        if strict_calls is not None:
            params = dataclasses.replace(params, structured_outputs=strict_calls)
        request_id = random_id("chatcmpl")
        outputs = self.generate([prompt], params, request_id, "messages", request.constraint_field(), adapter)
        # Wait for the first output before answering, so a refused prompt is still an HTTP error.
        _, output = await anext(outputs)
        answered = self.answerer(request.model, adapter)
        if request.stream:
            return StreamingResponse(self._stream(request, request_id, answered, output, outputs),
                                     media_type="text/event-stream")
        async with aclosing(outputs):
            async for _, output in outputs:  # outputs are cumulative: the last one is the answer
                pass
        choices = []
        for o in output.outputs:
            # The same events a stream sends, added up: both answers always carry the same calls.
            calls = self.call_stream(request)
            content, tool_calls = collect(calls.feed(o.text, final=True))
            message = ChatResponseMessage(
                content=content if content is not None or tool_calls else "",
                tool_calls=[ToolCall(id=_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                            for c in tool_calls] or None)
            choices.append(ChatCompletionChoice(index=o.index, message=message,
                                                finish_reason=calls.finish_reason(o.finish_reason),
                                                stop_reason=o.stop_reason,
                                                logprobs=self._logprobs(request, o.token_ids, o.logprobs)))
        response = ChatCompletionResponse(id=request_id, model=answered.model, choices=choices, usage=_usage(output),
                                          system_fingerprint=answered.fingerprint)
        return await self.respond(response)

    def check_tools(self, request: ChatCompletionRequest) -> None:
        """A 400 naming the field for a tool_choice the tools or the server cannot serve."""
        try:
            request.check_tool_choice()  # the tools' schema is checked with the other parameters, off the loop
        except ParameterError as e:
            raise bad_request(str(e), e.param) from e
        if request.resolved_tool_choice() == "auto" and request.tools and not self.enable_auto_tool_choice:
            raise bad_request(AUTO_TOOL_CHOICE_OFF, "tool_choice")

    def strict_calls_constraint(self, request: ChatCompletionRequest) -> StructuredOutputsParams | None:
        """For tool_choice "auto" with strict tools: the structural tag that makes each call name one
        of the tools and its arguments follow a strict tool's schema (any JSON object for a tool that
        is not strict), while the model stays free to answer in text. A 400 naming `tools` when the
        parser's format has no such tag, or when the tag does not compile; naming the other
        constraint when the request has one too. Runs on the executor."""
        arguments = request.strict_auto_arguments()
        if arguments is None or not self.enable_auto_tool_choice:
            return None
        strict = ", ".join(tool.function.name for tool in request.tools if tool.function.strict)
        tag = self.tool_parser.structural_tag(arguments, single_call=request.parallel_tool_calls is False)
        if tag is None:
            raise bad_request(f"strict is true for {strict}, which tool_choice \"auto\" cannot enforce with the "
                              f"{self.tool_parser.name} tool call parser (use tool_choice \"required\" or a named "
                              "function, or strict false)", "tools")
        field = request.structured_output_field()
        if field is not None:
            raise bad_request(f"{field} cannot be combined with strict tools under tool_choice \"auto\": the tools "
                              "constrain the output already", field)
        constraint = StructuredOutputsParams(structural_tag=tag)
        try:
            check_grammar(constraint)
        except ParameterError as e:
            raise bad_request(str(e).replace("structured_outputs", "tools", 1), "tools") from e
        return constraint

    def call_stream(self, request: ChatCompletionRequest) -> CallStream:
        """What reads one choice's output: content only, or content and tool calls."""
        choice = request.resolved_tool_choice()
        if isinstance(choice, NamedToolChoice):
            return NamedCallStream(choice.function.name)
        if choice == "required":
            return RequiredCallsStream()
        if choice == "auto" and request.tools:
            calls = self.tool_parser.stream()
            return FirstCallOnly(calls) if request.parallel_tool_calls is False else calls
        return PlainStream()

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> Prompt:
        """The conversation's prompt text (the chat template's) and token ids, with `tools` (OpenAI's
        tool objects) described in it. Runs on the executor."""
        tokenizer = self.engine.tokenizer
        native = self.template_renders_tools
        turns = chat_turns(messages, tools, self.call_format, native)
        try:
            text = tokenizer.apply_chat_template(turns, tools=tools if native else None, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
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

    async def _stream(self, request: ChatCompletionRequest, request_id: str, answered: Answerer, first: RequestOutput,
                      outputs: AsyncIterator[tuple[int, RequestOutput]]):
        created = int(time.time())
        states = [StreamState() for _ in first.outputs]
        calls = [self.call_stream(request) for _ in first.outputs]
        call_ids: list[list[str]] = [[] for _ in first.outputs]
        final = first

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=answered.model, choices=choices,
                                           usage=usage, system_fingerprint=answered.fingerprint))

        def chunks(output: RequestOutput):
            for o in output.outputs:
                new = states[o.index].advance(o)
                if new is None:
                    continue
                _, tokens = new
                finished = o.finish_reason is not None
                deltas = _deltas(calls[o.index].feed(o.text, finished), call_ids[o.index])
                logprobs = self._logprobs(request, o.token_ids[tokens], o.logprobs[tokens] if o.logprobs else None)
                if not deltas:  # text held back (it may start a call): the chunk carries logprobs or the end only
                    if logprobs is None and not finished:
                        continue
                    deltas = [DeltaMessage()]
                for j, delta in enumerate(deltas):
                    last = j == len(deltas) - 1
                    yield chunk([ChatCompletionStreamChoice(
                        index=o.index, delta=delta, logprobs=logprobs if j == 0 else None,
                        finish_reason=calls[o.index].finish_reason(o.finish_reason) if last else None,
                        stop_reason=o.stop_reason if last else None)])

        async with aclosing(outputs):
            try:
                for o in first.outputs:  # OpenAI opens each choice with the role (content null when it may call tools)
                    plain = isinstance(calls[o.index], PlainStream)
                    role = DeltaMessage(role="assistant", content="" if plain else None)
                    yield chunk([ChatCompletionStreamChoice(index=o.index, delta=role)])
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


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"  # OpenAI's form


def _deltas(events: list[Event], ids: list[str]) -> list[DeltaMessage]:
    """One delta per event, in OpenAI's shape; `ids` holds the choice's call ids (a call's first
    delta gets a new one)."""
    deltas = []
    for event in events:
        if isinstance(event, Text):
            deltas.append(DeltaMessage(content=event.text))
        elif isinstance(event, CallStart):
            ids.append(_call_id())
            deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=event.index, id=ids[event.index], type="function",
                function=DeltaFunctionCall(name=event.name, arguments=""))]))
        elif isinstance(event, CallArguments) and event.text:
            deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(index=event.index,
                                                                 function=DeltaFunctionCall(arguments=event.text))]))
    return deltas


def _usage(output: RequestOutput) -> UsageInfo:
    prompt = len(output.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in output.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens))
