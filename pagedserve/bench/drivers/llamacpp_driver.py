"""Runs a pagedserve benchmark workload on llama.cpp (llama-cpp-python), one request after another,
on the GGUF file itself. Executed by that package's own Python; imports nothing from pagedserve.
Usage: llamacpp_driver.py SPEC.json REPORT.json; writes to REPORT.json seconds per repetition, or
with "mode": "latency" in the spec, each request's time to first token and decode speed."""

import json
import resource
import sys
import time

spec = json.load(open(sys.argv[1]))
import llama_cpp  # noqa: E402
from llama_cpp import Llama  # noqa: E402

requests = spec["workload"]["requests"]
longest = max(len(r["prompt_token_ids"]) + r["output_len"] for r in requests)
llm = Llama(model_path=spec["model"], n_ctx=longest + 16, n_threads=spec.get("threads"), n_batch=512,
            verbose=False)


def stream(r, sample):
    """Yield each token of one sample of request r as it is produced (a fresh context each time: no
    prefix carried over from the last request)."""
    llm.reset()
    for i, token in enumerate(llm.generate(r["prompt_token_ids"], temp=0.0 if r["n"] == 1 else 1.0, reset=True)):
        yield token
        if i + 1 == r["output_len"]:
            return


def run():
    return sum(1 for r in requests for sample in range(r["n"]) for _token in stream(r, sample))


def throughput() -> dict:
    run()  # warm-up
    seconds, produced = [], 0
    for _ in range(spec["reps"]):
        start = time.perf_counter()
        produced = run()
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds, "output_tokens": produced}


def timed_request(r) -> tuple[float, float, list[int]]:
    """(seconds to the first token, decode tokens/s after it, the tokens) of one greedy request."""
    tokens, start, first = [], time.perf_counter(), None
    for token in stream(r, 0):
        if first is None:
            first = time.perf_counter()
        tokens.append(token)
    end = time.perf_counter()
    return first - start, (len(tokens) - 1) / (end - first), tokens


def latency() -> dict:
    (r,) = requests
    timed_request(r)  # warm-up
    ttft, decode = [], []
    for _ in range(spec["reps"]):
        first, tps, tokens = timed_request(r)
        ttft.append(first)
        decode.append(tps)
    return {"ttft_s": ttft, "decode_tps": decode, "token_ids": tokens,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


report = latency() if spec.get("mode") == "latency" else throughput()
with open(sys.argv[2], "w") as f:
    json.dump({**report, "note": f"llama-cpp-python {llama_cpp.__version__}, GGUF native, {spec.get('threads')} "
               "threads, sequential"}, f)
