"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, shaped like vLLM's."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Union

from tqdm.auto import tqdm

from pagedserve.config import EngineConfig
from pagedserve.engine.beam_search import BeamSearchParams, run_beam_search
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import BeamSearchOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams

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
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = engine.next_request_id()
                text, prompt_input = _prompt_input(prompt)
                engine.add_request(request_id, prompt_input, p, prompt_text=text)
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
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [
            {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
            for text in (tokenizer.apply_chat_template(c, chat_template=chat_template, tokenize=False,
                                                       add_generation_prompt=add_generation_prompt)
                         for c in conversations)
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search for each prompt; each output's sequences come best first."""
        engine = self.llm_engine
        token_prompts = [engine.tokenize(_prompt_input(p)[1])[1] for p in _as_prompt_list(prompts)]
        return run_beam_search(engine, token_prompts, params)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start, prompt_tokens, output_tokens = time.perf_counter(), 0, 0
        try:
            while len(finished) < len(ids):
                if not engine.scheduler.has_unfinished():
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

    def reset_prefix_cache(self) -> bool:
        """As vLLM's: forget all cached prefixes, so the next prompts are computed cold. False
        (nothing forgotten) while requests are running."""
        return self.llm_engine.reset_prefix_cache()

    # ---- figures -------------------------------------------------------------------------

    def get_metrics(self) -> dict[str, float]:
        """Engine figures since start: KV usage and waste, prefix-cache hits, preemptions, throughput."""
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
            "preemptions": engine.num_preemptions,
        }


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _prompt_input(prompt: PromptType) -> tuple[str | None, str | list[int]]:
    """(the prompt's text if known, what the engine tokenizes or takes as ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], prompt["prompt"]
        raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return None, prompt
    raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
