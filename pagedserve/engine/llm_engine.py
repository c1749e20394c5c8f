"""LLMEngine: the synchronous engine, front and core in one process. add_request / step / abort.

The front tokenizes and validates a request, then hands token ids to the `EngineCore` (through an
`InprocClient`: the core runs when the caller steps it); after each core step the `OutputProcessor`
turns the core's token ids into text and RequestOutputs, and tells the core which samples a stop
string ended. `LLM` and the tests drive it; the server's front is `async_llm.AsyncLLM`.
"""

from __future__ import annotations

import itertools
import time

from pagedserve.config import EngineConfig
from pagedserve.core.engine_core import EngineCore, EngineStats
from pagedserve.core.messages import EngineCoreRequest
from pagedserve.engine.core_client import InprocClient
from pagedserve.engine.input_processor import check_lora_enabled, process_inputs, tokenize
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.kv import KVCacheStats
from pagedserve.lora.request import LoRARequest
from pagedserve.ops import native
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams


def tokenizer_eos_ids(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model=None, tokenizer=None) -> None:
        """`model` = (module, ModelConfig) and `tokenizer` may be passed in to share loaded weights."""
        from pagedserve.models.loader import check_draft_model, load_tokenizer

        self.config = config = config or EngineConfig()
        check_draft_model(config)  # a ValueError now, not once the model's weights have loaded
        if config.device == "cpu":
            native.build_ahead()  # a cold start compiles the C kernels while the tokenizer loads
        self.tokenizer = tokenizer or load_tokenizer(config.model)
        self.core = EngineCore(config, eos_token_ids=tokenizer_eos_ids(self.tokenizer), model=model,
                               tokenizer=self.tokenizer)
        self.client = InprocClient(self.core)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()
        self._checked_adapters: set[LoRARequest] = set()

    # The core's parts, for the tools and tests that look inside.
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv(self):
        return self.core.kv

    @property
    def runner(self):
        return self.core.executor.runner

    @property
    def model(self):
        return self.runner.model

    @property
    def model_config(self):
        return self.core.model_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def stats(self) -> EngineStats:
        return self.core.stats

    @property
    def eos_token_ids(self) -> set[int]:
        return self.core.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.core.eos_token_ids = ids

    # ---- requests ------------------------------------------------------------------------

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(the text, its token ids), or (None, the ids) for token ids (`input_processor.tokenize`)."""
        return tokenize(self.tokenizer, prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, prompt_text: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request (under a LoRA adapter, or the base model); it joins the running batch at
        the next step. Bad input: ValueError."""
        params = params or SamplingParams()
        if lora_request is not None:
            self.add_lora(lora_request)
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = process_inputs(self.tokenizer, prompt, params, max_model_len=self.max_model_len,
                                         vocab_size=self.model_config.vocab_size,
                                         max_num_seqs=self.scheduler.max_num_seqs)
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.client.add_request(EngineCoreRequest(request_id, token_ids, params, lora_request))
        self.output_processor.add_request(request_id, prompt_text if prompt_text is not None else text,
                                          token_ids, params, arrival_time)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter into host memory, checked against the model, its values included
        (ValueError saying why it cannot be served). True once it is known. The weights read here
        are the ones its requests use (unless host memory drops them first: see LoRAManager)."""
        if lora_request not in self._checked_adapters:
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
            check_lora_enabled(lora_request, self.config)
            self.core.executor.prefetch_lora(lora_request).result()
            self._checked_adapters.add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        self._checked_adapters = {a for a in self._checked_adapters if a.lora_int_id != lora_int_id}
        return self.core.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return {a.lora_int_id for a in self.core.list_loras()} | {a.lora_int_id for a in self._checked_adapters}

    def validate_prompt(self, token_ids: list[int]) -> None:
        self.core.validate_prompt(token_ids)

    def abort_request(self, request_id: str) -> None:
        """Stop a request at once, whatever its state, and free everything it holds."""
        self.client.abort_requests([request_id])
        self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return len(self.output_processor) > 0

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output_processor)

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one core step; return the outputs of every user request that advanced or ended."""
        processed = self.output_processor.process(self.client.step())
        self.client.stop_samples(processed.stopped)
        self.client.abort_requests(processed.failed)
        return processed.outputs

    def shutdown(self) -> None:
        """Stop the engine's workers (tensor parallelism); it runs no more steps."""
        self.client.shutdown()

    # ---- figures -------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing forgotten) while requests hold blocks."""
        return self.core.reset_prefix_cache()

    def kv_stats(self) -> KVCacheStats:
        return self.kv.stats()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions
