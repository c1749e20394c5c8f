"""`pagedserve bench prefix`: the shared-prefix workload with prefix caching on vs off."""

from __future__ import annotations

import time

from pagedserve.bench.workload import shared_prefix


def run_prefix_bench(num_requests: int = 32, prefix_len: int = 512, seed: int = 0, reps: int = 1,
                     model=None, tokenizer=None) -> list[dict]:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.models.loader import load_model, load_tokenizer
    from pagedserve.sampling_params import SamplingParams

    model, tokenizer = model or load_model(), tokenizer or load_tokenizer()
    workload = shared_prefix(num_requests=num_requests, prefix_len=prefix_len, seed=seed)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in workload.requests]
    rows = []
    for caching in (True, False):
        best = None
        for _ in range(reps):
            llm = LLM.from_engine(LLMEngine(EngineConfig(enable_prefix_caching=caching), model=model,
                                            tokenizer=tokenizer))  # a cold cache every time
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            if best is None or seconds < best[0]:
                best = (seconds, llm.get_metrics())
        seconds, m = best
        rows.append({
            "prefix_caching": caching,
            "seconds": seconds,
            "total_tps": (workload.num_prompt_tokens + workload.num_output_tokens) / seconds,
            "output_tps": workload.num_output_tokens / seconds,
            "prompt_tokens": workload.num_prompt_tokens,
            "prefill_tokens_computed": workload.num_prompt_tokens - m["prefix_cache_hits"],
            "peak_blocks": m["kv_peak_used_blocks"],
        })
    rows[0]["speedup"] = rows[1]["seconds"] / rows[0]["seconds"]
    rows[0]["workload"] = rows[1]["workload"] = workload.describe()
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [rows[0]["workload"], "", "| prefix caching | seconds | total tok/s | output tok/s | prefill tokens computed | peak KV blocks |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {'on' if r['prefix_caching'] else 'off'} | {r['seconds']:.1f} | {r['total_tps']:.1f} | "
                     f"{r['output_tps']:.1f} | {r['prefill_tokens_computed']:,} of {r['prompt_tokens']:,} | {r['peak_blocks']} |")
    lines.append(f"\nSpeed-up with prefix caching: {rows[0]['speedup']:.2f}x")
    return "\n".join(lines)
