"""Runs a pagedserve benchmark workload on vLLM. Executed by vLLM's own Python (its own virtual
environment), so it imports nothing from pagedserve. Usage: vllm_driver.py SPEC.json REPORT.json;
writes the report (seconds per repetition, output tokens) to REPORT.json: vLLM's own logs go to stdout."""

import json
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    requests = spec["workload"]["requests"]
    # The same KV budget as pagedserve's default; the memory fraction only has to fit the machine.
    dtype = spec.get("dtype", "float32")  # the dtype pagedserve runs in, for the same comparison
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=dtype, seed=0, enable_prefix_caching=spec.get("prefix_caching", True),
              kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 1 << 30), gpu_memory_utilization=0.3)
    startup_s = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [SamplingParams(n=r["n"], max_tokens=r["output_len"], ignore_eos=True,
                             temperature=0.0 if r["n"] == 1 else 1.0, seed=i) for i, r in enumerate(requests)]

    token_ids = []

    def run():
        llm.reset_prefix_cache()  # every repetition prefills cold, as the first did
        outputs = llm.generate(prompts, params, use_tqdm=False)
        token_ids[:] = [list(out.outputs[0].token_ids) for out in outputs]
        return sum(len(o.token_ids) for out in outputs for o in out.outputs)

    run()  # warm-up
    seconds, produced = [], 0
    for _ in range(spec["reps"]):
        start = time.perf_counter()
        produced = run()
        seconds.append(time.perf_counter() - start)
    with open(sys.argv[2], "w") as f:
        json.dump({"seconds": seconds, "output_tokens": produced, "note": f"vLLM {vllm.__version__}, {dtype}",
                   "startup_s": startup_s, "token_ids": token_ids}, f)


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()
