"""Runs a pagedserve benchmark workload on llama.cpp (llama-cpp-python), one request after another,
on the GGUF file itself. Executed by that package's own Python; imports nothing from pagedserve.
Usage: llamacpp_driver.py SPEC.json REPORT.json; writes seconds per repetition to REPORT.json."""

import json
import sys
import time

spec = json.load(open(sys.argv[1]))
import llama_cpp  # noqa: E402
from llama_cpp import Llama  # noqa: E402

requests = spec["workload"]["requests"]
longest = max(len(r["prompt_token_ids"]) + r["output_len"] for r in requests)
llm = Llama(model_path=spec["model"], n_ctx=longest + 16, n_threads=spec.get("threads"), n_batch=512,
            verbose=False)


def run():
    produced = 0
    for r in requests:
        for _ in range(r["n"]):
            llm.reset()
            for i, _token in enumerate(llm.generate(r["prompt_token_ids"], temp=0.0 if r["n"] == 1 else 1.0,
                                                   reset=True)):
                produced += 1
                if i + 1 == r["output_len"]:
                    break
    return produced


run()  # warm-up
seconds, produced = [], 0
for _ in range(spec["reps"]):
    start = time.perf_counter()
    produced = run()
    seconds.append(time.perf_counter() - start)
with open(sys.argv[2], "w") as f:
    json.dump({"seconds": seconds, "output_tokens": produced,
               "note": f"llama-cpp-python {llama_cpp.__version__}, GGUF Q4_1 native, sequential"}, f)
