"""`pagedserve bench structured`: JSON-schema-constrained requests against free ones, same tokens.

64 requests generate JSON under a schema; then the same 64 prompts run free, each asked for
exactly the number of tokens its constrained twin produced (ignore_eos), so both runs compute the
same tokens and their times compare directly. Also: the mask's cost per step (filling the
bitmask from the grammar matchers, and applying it to the logits), from the constrained run.
"""

from __future__ import annotations

import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40},
        "city": {"enum": ["Paris", "Berlin", "Rome", "Madrid", "Lisbon"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "email", "city", "skills"],
    "additionalProperties": False,
}
TOPICS = ["a software engineer", "a retired teacher", "a chef", "a student", "a pilot", "a nurse", "an artist",
          "a farmer"]


def run_structured_bench(num_requests: int = 64, max_tokens: int = 160, reps: int = 1, model=None,
                         tokenizer=None) -> dict:
    import torch

    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.structured_output.manager import apply_bitmask
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.models.loader import load_model, load_tokenizer
    from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

    model, tokenizer = model or load_model(), tokenizer or load_tokenizer()
    llm = LLM.from_engine(LLMEngine(EngineConfig(enable_prefix_caching=False), model=model, tokenizer=tokenizer))
    prompts = [llm.llm_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} (person {i}) as a JSON record."}],
        tokenize=False, add_generation_prompt=True) for i in range(num_requests)]
    constrained = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i,
                                  structured_outputs=StructuredOutputsParams(json=SCHEMA)) for i in range(num_requests)]
    llm.generate(prompts[:2], constrained[:2], use_tqdm=False)  # warm-up: loads the vocabulary, compiles the schema

    def timed(params):
        best = None
        for _ in range(reps):
            engine = llm.llm_engine
            steps, busy = engine.stats.num_steps, engine.stats.busy_seconds
            manager = engine.core.structured_output
            fills, fill_seconds = manager.fill_steps, manager.fill_seconds
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            run = {"seconds": time.perf_counter() - start, "steps": engine.stats.num_steps - steps,
                   "busy_seconds": engine.stats.busy_seconds - busy, "fill_steps": manager.fill_steps - fills,
                   "fill_seconds": manager.fill_seconds - fill_seconds, "outputs": outputs}
            if best is None or run["seconds"] < best["seconds"]:
                best = run
        return best

    json_run = timed(constrained)
    lengths = [len(o.outputs[0].token_ids) for o in json_run["outputs"]]
    import json

    valid = 0
    for o in json_run["outputs"]:
        try:
            json.loads(o.outputs[0].text)
            valid += 1
        except ValueError:
            pass
    free = [SamplingParams(max_tokens=n, temperature=0.8, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]
    free_run = timed(free)
    assert [len(o.outputs[0].token_ids) for o in free_run["outputs"]] == lengths  # the same work

    # Applying a full batch's bitmask to its logits, timed alone: the masks of 64 samples at the
    # start of the schema (few tokens allowed, as through most of a JSON value).
    manager = llm.llm_engine.core.structured_output
    matchers = manager.matchers(StructuredOutputsParams(json=SCHEMA), num_requests)
    rows, bitmask = manager.bitmask(matchers, "cpu")
    logits = torch.randn(num_requests, llm.llm_engine.model_config.vocab_size)
    apply_bitmask(logits, rows, bitmask)
    start = time.perf_counter()
    for _ in range(50):
        apply_bitmask(logits, rows, bitmask)
    apply_ms = (time.perf_counter() - start) / 50 * 1e3

    tokens = sum(lengths)
    report = {"num_requests": num_requests, "output_tokens": tokens, "valid_json": valid,
              "finished_by_length": sum(o.outputs[0].finish_reason == "length" for o in json_run["outputs"]),
              "apply_ms_per_step": apply_ms}
    for name, run in (("json", json_run), ("free", free_run)):
        report[name] = {"seconds": run["seconds"], "output_tps": tokens / run["seconds"], "steps": run["steps"],
                        "ms_per_step": run["busy_seconds"] / max(run["steps"], 1) * 1e3}
    report["fill_ms_per_step"] = json_run["fill_seconds"] / max(json_run["fill_steps"], 1) * 1e3
    report["ratio"] = report["json"]["output_tps"] / report["free"]["output_tps"]
    return report


def format_table(r: dict) -> str:
    lines = [f"{r['num_requests']} requests, {r['output_tokens']:,} output tokens in each run "
             f"(JSON: {r['valid_json']} of {r['num_requests']} parse, {r['finished_by_length']} ended by max_tokens)",
             "", "| run | seconds | output tok/s | steps | ms per step |", "|---|---:|---:|---:|---:|"]
    for name, label in (("free", "free"), ("json", "JSON schema")):
        x = r[name]
        lines.append(f"| {label} | {x['seconds']:.2f} | {x['output_tps']:.1f} | {x['steps']} | {x['ms_per_step']:.2f} |")
    lines.append(f"\nJSON-schema throughput = {r['ratio']:.1%} of free (target >= 80%). The mask per step: "
                 f"{r['fill_ms_per_step']:.3f} ms to fill the bitmask (all constrained rows), "
                 f"{r['apply_ms_per_step']:.3f} ms to apply it to {r['num_requests']} rows of logits.")
    return "\n".join(lines)
