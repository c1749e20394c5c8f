"""vLLM's tokenizer routes, which load clients (vllm bench serve) and evaluation harnesses probe:
POST /tokenize (a prompt, or chat messages through the template), POST /detokenize, GET
/tokenizer_info. Same tokenizer and template as generation, so counts match what a request costs."""

from __future__ import annotations

from pagedserve.entrypoints.openai.protocol import (
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, TokenizerInfoResponse,
)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_engine import bad_request


class OpenAIServingTokenization:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat  # its engine, executor, prompt bound and chat template

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        chat = self.chat
        chat.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        tokenizer = chat.engine.tokenizer
        if request.prompt is not None:
            await chat.check_prompt_chars([request.prompt], "prompt")
            special = True if request.add_special_tokens is None else request.add_special_tokens
            ids = await chat.run_blocking(lambda: tokenizer.encode(request.prompt, add_special_tokens=special))
        else:
            await chat.check_prompt_chars([m.text().strip() for m in request.messages], "messages")
            if request.add_special_tokens:  # a template writes its own special tokens
                raise bad_request("add_special_tokens with messages is not supported by this server",
                                  "add_special_tokens")
            _, ids = await chat.run_blocking(chat.chat_prompt, request.messages, request.add_generation_prompt)
        strs = await chat.run_blocking(tokenizer.convert_ids_to_tokens, ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=chat.engine.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        chat = self.chat
        chat.check_model(request.model)
        vocab = chat.engine.vocab_size
        bad = next((t for t in request.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range for a vocabulary of {vocab}", "tokens")
        return DetokenizeResponse(prompt=await chat.run_blocking(chat.engine.tokenizer.decode, request.tokens))

    def tokenizer_info(self) -> TokenizerInfoResponse:
        tokenizer = self.chat.engine.tokenizer
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        return TokenizerInfoResponse(
            tokenizer_class=type(tokenizer).__name__, vocab_size=len(tokenizer),
            model_max_length=self.chat.engine.max_model_len, bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token, pad_token=tokenizer.pad_token, chat_template=template)
