"""How often greedy bfloat16 output agrees with transformers' own bfloat16 model, for pagedserve and
for vLLM, on the same prompts (the bfloat16 exactness check in docs/benchmarks.md).

The reference is transformers' `generate` on the embedded GGUF in bfloat16, one prompt at a time
(no padding). Prints, per system, how many of the requests are identical token for token and the
mean number of tokens agreeing before the first difference.

    python scripts/bf16_agreement.py --vllm-python /work/vllm-venv/bin/python --hf-model-dir /work/smollm2-hf
"""

from __future__ import annotations

import argparse
import json

import torch

from pagedserve.bench.throughput import load_hf_reference, run_external, run_pagedserve
from pagedserve.bench.workload import Workload, WorkloadRequest, sharegpt_like
from pagedserve.models.loader import load_model, load_tokenizer


def agreement(ids: list[list[int]], reference: list[list[int]]) -> dict:
    prefixes = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) for a, b in zip(ids, reference)]
    return {"identical": sum(a == b for a, b in zip(ids, reference)), "of": len(reference),
            "mean_agreeing_prefix": sum(prefixes) / len(prefixes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--vllm-python", help="a Python with vllm installed (skipped without)")
    parser.add_argument("--hf-model-dir", help="the embedded model as an HF directory, for vLLM")
    args = parser.parse_args()

    prompts = sharegpt_like(args.num_requests, seed=args.seed).requests
    workload = Workload("agreement", [WorkloadRequest(r.prompt_token_ids, args.output_len) for r in prompts])
    hf = load_hf_reference(torch.bfloat16)
    reference = []
    with torch.inference_mode():
        for r in workload.requests:
            out = hf.generate(torch.tensor([r.prompt_token_ids]), max_new_tokens=args.output_len,
                              min_new_tokens=args.output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
            reference.append(out[0, len(r.prompt_token_ids):].tolist())

    ours = run_pagedserve(workload, 1, load_model(None, torch.bfloat16), load_tokenizer(None), dtype="bfloat16")
    report = {"pagedserve": agreement(ours.token_ids, reference)}
    vllm = run_external("vllm", args.vllm_python, workload, 1, args.hf_model_dir or "", {"dtype": "bfloat16"})
    report["vllm"] = agreement(vllm.token_ids, reference) if vllm.token_ids else vllm.skipped
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
