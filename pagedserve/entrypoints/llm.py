"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, shaped like vLLM's."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, Union

from tqdm.auto import tqdm

from pagedserve.config import EngineConfig
from pagedserve.entrypoints import tier_at_exit
from pagedserve.entrypoints.beam_search import beam_search
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import BeamSearchOutput, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.text import check_unicode

# A prompt: text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": [...]}.
PromptType = Union[str, list[int], dict]
Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, *, _engine: LLMEngine | None = None, **engine_args: Any) -> None:
        """model: an HF directory, a .gguf file, or None for the embedded default. engine_args: any
        field of EngineConfig (dtype, device, block_size, kv_cache_dtype, gpu_memory_utilization,
        enforce_eager, attention_backend, ...), as vLLM's LLM takes its engine arguments."""
        fields = set(EngineConfig.__dataclass_fields__)
        unknown = sorted(set(engine_args) - fields)
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments {unknown}; known: {sorted(fields - {'model'})}")
        config = EngineConfig(model=model, **engine_args)
        self.llm_engine = _engine or LLMEngine(config)
        # Its own engine's pool goes to the KV tier at the end, however the script ends (tier_at_exit.py).
        core = self.llm_engine.core
        self._saver = tier_at_exit.save_at_end(self, core) if _engine is None and core.kv.tier is not None else None

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        return cls(_engine=engine)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    # ---- generation ----------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. `lora_request`: the LoRA
        adapter of every prompt, or a list of them (None: the base model), as vLLM's. A wrong
        argument is a ValueError naming it (and the item of a list) before anything runs."""
        prompts = _as_prompt_list(prompts)
        params = _sampling_params_list(sampling_params, len(prompts))
        adapters = _lora_request_list(lora_request, len(prompts))
        engine = self.llm_engine
        for adapter in dict.fromkeys(a for a in adapters if a is not None):
            engine.add_lora(adapter)  # a bad adapter is a ValueError now, before any prompt is queued
        ids = []
        try:
            for prompt, p, adapter in zip(prompts, params, adapters):
                request_id = engine.next_request_id()
                text, prompt_input = _prompt_input(prompt)
                engine.add_request(request_id, prompt_input, p, prompt_text=text, lora_request=adapter)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # all or nothing: leave no half-submitted batch behind
                engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of message dicts) or a list
        of them, then generate. A wrong argument is a ValueError naming it, and text that is not
        valid Unicode names the message: messages[1]['content'] is not valid Unicode: ..."""
        conversations = _as_conversation_list(messages)
        if chat_template is not None:
            if not isinstance(chat_template, str):
                raise ValueError(f"chat_template must be a str or None, got {_kind(chat_template)}")
            check_unicode(chat_template, "chat_template")
        tokenizer = self.get_tokenizer()
        prompts = [
            {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
            for text in (tokenizer.apply_chat_template(c, chat_template=chat_template, tokenize=False,
                                                       add_generation_prompt=add_generation_prompt)
                         for c in conversations)
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """Beam search for each prompt (under `lora_request`, as in `generate`); each output's
        sequences come best first."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {_kind(params)}")
        engine = self.llm_engine
        token_prompts = [engine.tokenize(_prompt_input(p)[1])[1] for p in _as_prompt_list(prompts)]
        adapters = _lora_request_list(lora_request, len(token_prompts))
        for adapter in dict.fromkeys(a for a in adapters if a is not None):
            engine.add_lora(adapter)
        return beam_search(engine, token_prompts, params, adapters)

    # ---- LoRA adapters --------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter and start reading it into memory (ValueError saying why it cannot be
        served); `generate` does this for the adapters it is given."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (False if unknown)."""
        return self.llm_engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters the engine knows."""
        return self.llm_engine.list_loras()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start, prompt_tokens, output_tokens = time.perf_counter(), 0, 0
        try:
            while len(finished) < len(ids):
                if not engine.core.has_unfinished_requests():
                    raise RuntimeError("the engine stopped with requests unfinished")
                for output in engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        prompt_tokens += len(output.prompt_token_ids)
                        output_tokens += sum(len(o.token_ids) for o in output.outputs)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"est. speed input: {prompt_tokens / elapsed:.1f} toks/s, "
                                            f"output: {output_tokens / elapsed:.1f} toks/s", refresh=False)
                        bar.update(1)
        except BaseException:
            for request_id in ids:  # e.g. Ctrl-C: free what the unfinished requests hold
                engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]

    def shutdown(self) -> None:
        """Stop the engine: with tensor_parallel_size > 1 its worker processes exit and their ports
        close (also done when the LLM is garbage-collected, or at exit). With a KV tier, the pool's
        cached blocks are written to it first (also done when the LLM is garbage-collected, at exit,
        and on SIGINT or SIGTERM: `tier_at_exit.py`)."""
        if self._saver is not None:
            tier_at_exit.cancel(self._saver)
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def reset_prefix_cache(self) -> bool:
        """As vLLM's: forget all cached prefixes, so the next prompts are computed cold. False
        (nothing forgotten) while requests are running."""
        return self.llm_engine.reset_prefix_cache()

    # ---- figures -------------------------------------------------------------------------

    def get_metrics(self) -> dict[str, float]:
        """Engine figures since start: KV usage and waste (and each KV cache group's now), prefix-cache
        hits, preemptions, throughput."""
        engine = self.llm_engine
        stats, kv = engine.stats, engine.kv_stats()
        peak = stats.kv_at_peak
        return {
            "requests": stats.num_requests,
            "prompt_tokens": stats.num_prompt_tokens,
            "generation_tokens": stats.num_generation_tokens,
            "generation_tokens_per_s": stats.generation_throughput,
            "steps": stats.num_steps,
            "kv_total_blocks": kv.total_blocks,
            "kv_used_blocks": kv.used_blocks,
            "kv_usage": kv.usage,
            "kv_peak_used_blocks": stats.peak_used_blocks,
            "kv_waste_at_peak": peak.waste if peak else 0.0,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "prefix_cache_hit_rate": kv.prefix_hit_rate,
            "cow_copies": kv.cow_copies,
            "kv_offload_hit_tokens": kv.offload_hits,
            "kv_offload_stored_blocks": kv.offload_stored_blocks,
            "kv_offload_loaded_blocks": kv.offload_loaded_blocks,
            "preemptions": engine.num_preemptions,
            "fast_paths_skipped": sum(reason is not None for reason in self.fast_paths().values()),
            **self._group_metrics(),
            **self._spec_metrics(),
        }

    def _group_metrics(self) -> dict[str, Any]:
        """Each KV cache group's share of the pool now (kv/groups.py; one group for a model of one
        kind of layer): its window (0: full attention), blocks in use and waste."""
        groups = self.llm_engine.kv.group_stats()
        metrics: dict[str, Any] = {"kv_groups": len(groups)}
        for g, group in enumerate(groups):
            metrics[f"kv_group_{g}_window"] = group.window or 0
            metrics[f"kv_group_{g}_used_blocks"] = group.used_blocks
            metrics[f"kv_group_{g}_waste"] = group.waste
        return metrics

    def _spec_metrics(self) -> dict[str, Any]:
        """Speculative decoding's figures, when it is on: drafts verified, tokens drafted and accepted."""
        speculation = self.llm_engine.core.speculation
        if speculation is None:
            return {}
        c = speculation.counters
        return {"spec_num_drafts": c.num_drafts, "spec_num_draft_tokens": c.num_draft_tokens,
                "spec_num_accepted_tokens": c.num_accepted_tokens,
                "spec_acceptance_rate": c.num_accepted_tokens / c.num_draft_tokens if c.num_draft_tokens else 0.0,
                "spec_accepted_per_position": list(c.accepted_per_position)}

    def fast_paths(self) -> dict[str, str | None]:
        """The engine's fast paths (decode steps replayed, the C kernels on CPU): None for each it
        takes, else the reason it falls back (logged once too). `get_metrics()` counts the skipped."""
        return self.llm_engine.core.fast_paths()


def _kind(value: Any) -> str:
    """What a wrong argument is, for an error message."""
    return "None" if value is None else type(value).__name__


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    """The `prompts` argument as a list of prompts, each checked: ValueError naming the argument
    (prompts[i] for an item of a list) and what is wrong."""
    if isinstance(prompts, (str, dict)):
        _check_prompt(prompts, "prompt")
        return [prompts]
    if not isinstance(prompts, Iterable) or isinstance(prompts, (bytes, bytearray)):
        raise ValueError("prompts must be a prompt (a str, a list of token ids or a dict) or a list of prompts, "
                         f"got {_kind(prompts)}")
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    for i, prompt in enumerate(prompts):
        _check_prompt(prompt, f"prompts[{i}]")
    return prompts


def _check_prompt(prompt: Any, where: str) -> None:
    if isinstance(prompt, str):
        check_unicode(prompt, where)
    elif isinstance(prompt, dict):
        if "prompt" not in prompt and "prompt_token_ids" not in prompt:
            raise ValueError(f"{where}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if "prompt_token_ids" in prompt:
            _check_token_ids(prompt["prompt_token_ids"], f"{where}['prompt_token_ids']")
        text = prompt.get("prompt")
        if isinstance(text, str):
            check_unicode(text, f"{where}['prompt']")
        elif text is not None or "prompt_token_ids" not in prompt:  # the text may be absent beside token ids
            raise ValueError(f"{where}['prompt'] must be a str, got {_kind(text)}")
    elif isinstance(prompt, (list, tuple)):
        _check_token_ids(prompt, where)
    else:
        raise ValueError(f"{where} must be a str, a list of token ids or a dict, got {_kind(prompt)}")


def _check_token_ids(token_ids: Any, where: str) -> None:
    if not isinstance(token_ids, (list, tuple)):
        raise ValueError(f"{where} must be a list of token ids, got {_kind(token_ids)}")
    bad = next((t for t in token_ids if not isinstance(t, int)), None)
    if bad is not None:
        raise ValueError(f"{where} must be a list of int token ids, but it holds {_kind(bad)} {bad!r}")


def _prompt_input(prompt: PromptType) -> tuple[str | None, str | list[int]]:
    """(the prompt's text if known, what the engine tokenizes or takes as ids), for a prompt that
    _as_prompt_list has checked."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        return prompt["prompt"], prompt["prompt"]
    if isinstance(prompt, str):
        return prompt, prompt
    return None, list(prompt)


def _sampling_params_list(sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: None (the defaults), one for all, or a list of them."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        raise ValueError("sampling_params must be None, a SamplingParams or a list of them (one per prompt), "
                         f"got {_kind(sampling_params)}")
    for i, params in enumerate(sampling_params):
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {_kind(params)}")
    if len(sampling_params) != num_prompts:
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {num_prompts} prompts")
    return list(sampling_params)


def _lora_request_list(lora_request: Any, num_prompts: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt: None, one for all, or a list of them."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, (list, tuple)):
        raise ValueError("lora_request must be None, a LoRARequest or a list of them (one per prompt), "
                         f"got {_kind(lora_request)}")
    for i, adapter in enumerate(lora_request):
        if adapter is not None and not isinstance(adapter, LoRARequest):
            raise ValueError(f"lora_request[{i}] must be a LoRARequest or None, got {_kind(adapter)}")
    if len(lora_request) != num_prompts:
        raise ValueError(f"lora_request: got {len(lora_request)} LoRA requests for {num_prompts} prompts")
    return list(lora_request)


def _as_conversation_list(messages: Any) -> list[Conversation]:
    """The `messages` argument of chat as a list of conversations, each message checked:
    ValueError naming the argument (messages[i], or messages[c][i] in a list of conversations)."""
    shape = "a conversation (a list of message dicts) or a list of conversations"
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be {shape}, got {_kind(messages)}")
    single = bool(messages) and isinstance(messages[0], dict)  # [] stays no conversation at all
    conversations = [(messages, "messages")] if single else [(c, f"messages[{i}]") for i, c in enumerate(messages)]
    for conversation, where in conversations:
        if not isinstance(conversation, (list, tuple)):
            raise ValueError(f"{where} must be a list of message dicts, got {_kind(conversation)}")
        for i, message in enumerate(conversation):
            _check_message(message, f"{where}[{i}]")
    return [list(c) for c, _ in conversations]


def _check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be a message dict with 'role' and 'content', got {_kind(message)}")
    if not isinstance(message.get("role"), str):
        raise ValueError(f"{where}['role'] must be a str, got {_kind(message.get('role'))}")
    for key, value in message.items():  # every text the template may render, content parts included
        if isinstance(value, str):
            check_unicode(value, f"{where}[{key!r}]")
        elif isinstance(value, list):
            for j, part in enumerate(value):
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    check_unicode(part["text"], f"{where}[{key!r}][{j}]['text']")
