"""GPU check of the engine's CUDA path, one section at a time; a section that fails
prints its traceback and the others still run.

    python scripts/gpu_engine_check.py [--model DIR]            # on a CUDA machine
    python scripts/gpu_engine_check.py --device cpu --smoke     # the script itself, no GPU

--model: an HF directory (scripts/gpu_model.py makes one where the embedded model cannot go).
1. exactness: float32 engine (Triton backend, CUDA graphs) vs transformers' greedy on the GPU:
   tokens, and the log-probability of each chosen token;
2. CUDA graphs vs enforce_eager in bfloat16: same tokens, and decode step time at batch 1/16/64;
3. the KV pool sized by gpu_memory_utilization: blocks, GiB, the GPU's memory in use afterwards;
4. fp8 KV cache: blocks against bfloat16 for the same budget, token agreement;
5. LoRA: a batch mixing two PEFT adapters and the base model (the torch path of the LoRA delta)
   vs transformers + PEFT with each adapter merged, float32; then the same batch in bfloat16.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams

SYSTEM = "You are a helpful assistant. Answer briefly and accurately, in plain English sentences."
QUESTIONS = ["Hi!", "What is the capital of France?", "Write a haiku about the sea.",
             "Explain in two sentences why the sky is blue.", "List three fruits.", "What is 12 times 7?",
             "Who wrote Romeo and Juliet?", "Translate 'good morning' into French, Spanish and German."]
MAX_TOKENS = 32


def chat_prompts(tokenizer) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                           tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def engine(args, **overrides) -> LLM:
    gc.collect()  # the previous section's engine, before this one measures free GPU memory
    cpu = dict(num_kv_blocks=512, attention_backend="torch") if args.device == "cpu" else {}
    return LLM(args.model, **(dict(device=args.device, max_model_len=2048) | cpu | overrides))


def greedy(llm: LLM, prompts, max_tokens=MAX_TOKENS, with_logprobs=False):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0 if with_logprobs else None),
                        use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    if not with_logprobs:
        return tokens
    return tokens, [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]


def agreement(a, b) -> str:
    same = sum(x == y for x, y in zip(a, b))
    first = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None) for x, y in zip(a, b)]
    return f"{same}/{len(a)} sequences identical; first differing position per prompt (None: same): {first}"


def decode_step_ms(llm: LLM, batch: int, context: int = 256, steps: int = 20) -> float:
    """Median time of a decode step with `batch` requests of about `context` tokens."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=steps + 5, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"bench-{batch}-{i}", [(7 * i + j) % 1000 + 10 for j in range(context)], params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    times = []
    for _ in range(steps):
        if llm.llm_engine.config.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3


def section(title: str):
    def wrap(fn):
        def run(*a, **k):
            print(f"\n## {title}", flush=True)
            try:
                fn(*a, **k)
            except Exception:
                traceback.print_exc()
        return run
    return wrap


@section("1. exactness: float32 engine vs transformers, greedy")
def exactness(args, prompts):
    from pagedserve.bench.throughput import load_hf_reference

    hf = load_hf_reference(torch.float32, args.device, args.model)
    reference, reference_logprobs = [], []
    for ids in prompts:
        t = torch.tensor([ids], device=args.device)
        with torch.inference_mode():
            out = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=MAX_TOKENS, do_sample=False,
                              pad_token_id=2, output_scores=True, return_dict_in_generate=True)
        chosen = out.sequences[0, len(ids):]
        reference.append(chosen.tolist())
        reference_logprobs.append([torch.log_softmax(s[0].float(), -1)[c].item() for s, c in zip(out.scores, chosen)])
    del hf
    llm = engine(args, dtype="float32")
    print("backend", llm.llm_engine.config.attention_backend, "graphs",
          llm.llm_engine.runner.decode_graphs is not None)
    tokens, logprobs = greedy(llm, prompts, with_logprobs=True)
    print("pagedserve float32 vs transformers float32:", agreement(tokens, reference))
    same = [(a, b) for t, r, lp, rlp in zip(tokens, reference, logprobs, reference_logprobs) if t == r
            for a, b in zip(lp, rlp)]
    if same:
        print(f"chosen-token log-probabilities over identical sequences: max abs diff "
              f"{max(abs(a - b) for a, b in same):.2e} ({len(same)} steps)")


@section("2. CUDA graphs vs enforce_eager, bfloat16")
def graphs_vs_eager(args, prompts):
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    timings = {}
    tokens = {}
    for eager in (False, True):
        llm = engine(args, dtype=dtype, enforce_eager=eager, max_num_seqs=64)
        tokens[eager] = greedy(llm, prompts)
        timings[eager] = {b: decode_step_ms(llm, b) for b in ([1, 4] if args.smoke else [1, 16, 64])}
        del llm
    print("graphs vs eager tokens:", agreement(tokens[False], tokens[True]))
    print("batch | graphs ms/step | eager ms/step")
    for b in timings[False]:
        print(f"{b} | {timings[False][b]:.2f} | {timings[True][b]:.2f}")


@section("3. KV pool from gpu_memory_utilization")
def pool_size(args, prompts):
    for utilization in (0.9, 0.5):
        llm = engine(args, dtype="bfloat16", gpu_memory_utilization=utilization) if args.device == "cuda" \
            else engine(args)
        e = llm.llm_engine
        blocks = e.kv.pool.num_blocks
        gib = blocks * e.config.block_size * e.model_config.kv_bytes_per_token(e.config.kv_torch_dtype) / 2**30
        line = f"utilization {utilization}: {blocks} blocks = {gib:.2f} GiB of KV"
        if args.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            line += f"; GPU in use now {(total - free) / 2**30:.2f} of {total / 2**30:.2f} GiB ({(total - free) / total:.1%})"
        print(line, flush=True)
        greedy(llm, prompts[:2], max_tokens=4)
        del llm, e
        if args.device == "cuda":
            torch.cuda.empty_cache()


@section("4. fp8 KV cache")
def fp8(args, prompts):
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    budget = 1 << 30
    full = engine(args, dtype=dtype, kv_cache_memory_bytes=budget, num_kv_blocks=None)
    quarter = engine(args, dtype=dtype, kv_cache_memory_bytes=budget, num_kv_blocks=None, kv_cache_dtype="fp8")
    print(f"blocks for 1 GiB: {dtype} {full.llm_engine.kv.pool.num_blocks}, fp8 {quarter.llm_engine.kv.pool.num_blocks}")
    print(f"fp8 vs {dtype} tokens:", agreement(greedy(quarter, prompts), greedy(full, prompts)))
    if args.device == "cuda":
        print("decode step ms at batch 64, fp8:", f"{decode_step_ms(quarter, 64):.2f}",
              f"{dtype}:", f"{decode_step_ms(full, 64):.2f}")


@section("5. LoRA: mixed adapters vs transformers + PEFT merged")
def lora(args, prompts):
    from pagedserve.bench.throughput import load_hf_reference
    from pagedserve.lora.request import LoRARequest

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "lora"))
    from lora_fixtures import make_peft_adapter, merged_reference  # the tests' PEFT adapters and references

    hf = load_hf_reference(torch.float32, args.device, args.model)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"r{rank}", i + 1, str(make_peft_adapter(
            hf, Path(tmp) / f"r{rank}", rank=rank, alpha=2 * rank, seed=i + 1))) for i, rank in enumerate((8, 16))]
        picks = [adapters[i % 3] if i % 3 < 2 else None for i in range(len(prompts))]  # r8, r16, base, ...
        reference = []
        for ids, pick in zip(prompts, picks):
            model = merged_reference(hf, pick.lora_path) if pick else hf
            t = torch.tensor([ids], device=args.device)
            with torch.inference_mode():
                out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=MAX_TOKENS,
                                     do_sample=False, pad_token_id=2)
            reference.append(out[0, len(ids):].tolist())
        del hf, model
        tokens = {}
        for dtype in ("float32", "bfloat16") if args.device == "cuda" else ("float32",):
            llm = engine(args, dtype=dtype, enable_lora=True, max_loras=2, max_lora_rank=16)
            tokens[dtype] = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts],
                SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), lora_request=picks, use_tqdm=False)]
            del llm
    print("adapters per prompt:", [p.lora_name if p else "base" for p in picks])
    print("pagedserve float32 + LoRA vs transformers + PEFT merged float32:", agreement(tokens["float32"], reference))
    if "bfloat16" in tokens:
        print("pagedserve bfloat16 + LoRA vs float32 + LoRA:", agreement(tokens["bfloat16"], tokens["float32"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="fewer sizes (to try the script without a GPU)")
    parser.add_argument("--model", default=None, help="an HF directory (default: the embedded model)")
    parser.add_argument("--only", nargs="+", type=int, help="run these sections only (numbers)")
    args = parser.parse_args()
    if args.device == "cuda":
        print(torch.cuda.get_device_name(), "torch", torch.__version__)
    from pagedserve.models.loader import load_tokenizer

    prompts = chat_prompts(load_tokenizer(args.model))
    if args.smoke:
        prompts = prompts[:3]
    for number, check in enumerate((exactness, graphs_vs_eager, pool_size, fp8, lora), 1):
        if not args.only or number in args.only:
            check(args, prompts)


if __name__ == "__main__":
    main()
