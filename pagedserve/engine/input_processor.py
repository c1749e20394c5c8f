"""A request as every front checks it before the core sees it: the same rules offline and served."""

from __future__ import annotations

from pagedserve.config import EngineConfig
from pagedserve.core.engine_core import validate_prompt
from pagedserve.lora.request import LoRARequest
from pagedserve.lora.weights import verify_adapter
from pagedserve.models.config import ModelConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.text import check_unicode


def tokenize(tokenizer, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    """(the text, its token ids), or (None, the ids) for token ids. Text that is not valid Unicode
    is a ValueError saying where, not a TypeError from inside the tokenizer."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(check_unicode(prompt, "the prompt"))
    return None, list(prompt)


def process_inputs(tokenizer, prompt: str | list[int], params: SamplingParams, *, max_model_len: int,
                   vocab_size: int, max_num_seqs: int) -> tuple[str | None, list[int]]:
    """(text, token ids) of a request the engine can run; ValueError (a ParameterError naming the
    field, for parameters) for one it cannot."""
    params.verify_for_engine(vocab_size, max_num_seqs)
    text, token_ids = tokenize(tokenizer, prompt)
    validate_prompt(token_ids, max_model_len, vocab_size)
    return text, token_ids


def check_lora_enabled(adapter: LoRARequest, config: EngineConfig) -> None:
    if not config.enable_lora:
        raise ValueError(f"this engine serves no LoRA adapters (asked for {adapter.lora_name!r}): start it with "
                         "enable_lora=True (the server: --enable-lora)")


def check_adapter(adapter: LoRARequest, config: EngineConfig, model_config: ModelConfig) -> None:
    """ValueError unless the engine serves LoRA and `adapter` fits the model and max_lora_rank,
    its values included (every read bounded: `lora/files.py`). For a front whose core reads the
    adapter itself: the weights read here are dropped. (Sending them to the core would cost more
    than its own read of a file just read; it repeats every check, so a file changed meanwhile is
    refused then, for the requests that need it.)"""
    check_lora_enabled(adapter, config)
    verify_adapter(adapter.lora_path, model_config, config.max_lora_rank, config.torch_dtype)
