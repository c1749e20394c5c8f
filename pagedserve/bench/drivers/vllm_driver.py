"""Runs a pagedserve benchmark workload on vLLM. Executed by vLLM's own Python (its own virtual
environment), so it imports nothing from pagedserve. Usage: vllm_driver.py SPEC.json REPORT.json;
writes the report (seconds per repetition, output tokens; with "mode": "latency" in the spec, each
request's time to first token and decode speed) to REPORT.json: vLLM's own logs go to stdout."""

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

    report = latency(llm, prompts, params, spec["reps"]) if spec.get("mode") == "latency" else \
        throughput(llm, prompts, params, spec["reps"])
    with open(sys.argv[2], "w") as f:
        json.dump({**report, "note": f"vLLM {vllm.__version__}, {dtype}", "startup_s": startup_s}, f)


def throughput(llm, prompts, params, reps: int) -> dict:
    token_ids = []

    def run():
        llm.reset_prefix_cache()  # every repetition prefills cold, as the first did
        outputs = llm.generate(prompts, params, use_tqdm=False)
        token_ids[:] = [list(out.outputs[0].token_ids) for out in outputs]
        return sum(len(o.token_ids) for out in outputs for o in out.outputs)

    run()  # warm-up
    seconds, produced = [], 0
    for _ in range(reps):
        start = time.perf_counter()
        produced = run()
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds, "output_tokens": produced, "token_ids": token_ids}


def latency(llm, prompts, params, reps: int) -> dict:
    """One request at a time, stepped through vLLM's engine so that the first token's time is seen."""
    (prompt,), (param,) = prompts, params
    engine = llm.llm_engine

    def one(request_id: str) -> tuple[float, float, list[int]]:
        llm.reset_prefix_cache()  # the prompt is prefilled cold every time
        start, first, tokens = time.perf_counter(), None, []
        engine.add_request(request_id, prompt, param)
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = list(out.outputs[0].token_ids)
                if first is None and tokens:
                    first = time.perf_counter()
        end = time.perf_counter()
        return first - start, (len(tokens) - 1) / (end - first), tokens

    one("warm-up")
    ttft, decode = [], []
    for i in range(reps):
        first, tps, tokens = one(str(i))
        ttft.append(first)
        decode.append(tps)
    return {"ttft_s": ttft, "decode_tps": decode, "token_ids": tokens, "peak_rss_bytes": tree_peak_rss()}


def tree_peak_rss() -> int:
    """The sum of each process's peak resident memory, this one and its children (vLLM computes in a
    worker process): an upper bound of the tree's peak."""
    import os

    import psutil

    total = 0
    for proc in [psutil.Process(os.getpid()), *psutil.Process(os.getpid()).children(recursive=True)]:
        with open(f"/proc/{proc.pid}/status") as f:
            total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return total

if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()
