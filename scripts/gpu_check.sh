#!/usr/bin/env bash
# Every GPU check of issue 7 in one run (not yet timed on a GPU), for a session lent a GPU:
#   scripts/gpu_check.sh OUT_DIR
# Needs a python3 with torch (CUDA), triton and transformers, as the device machine has.
# The embedded model cannot go there (its package is not installed; the GGUF is over a call's
# carry limit), so first, here:  python scripts/gpu_model.py skeleton .gpu_model  (~4 MB, ignored
# by git), and carry `.gpu_model`: this script gives it seeded random weights there, and the engine
# checks and the throughput bench compare pagedserve with transformers on them.
# Writes kernels.txt, engine.txt, throughput.{txt,json} and the throughput table and plot to OUT_DIR.
set -uo pipefail
out=${1:-gpu_out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
model_args=()
if [ -f .gpu_model/config.json ]; then
    [ -f .gpu_model/model.safetensors ] || python3 scripts/gpu_model.py weights .gpu_model
    model_args=(--model .gpu_model)
fi
python3 scripts/gpu_check.py 2>&1 | tee "$out/kernels.txt"
python3 scripts/gpu_engine_check.py "${model_args[@]}" 2>&1 | tee "$out/engine.txt"
python3 -m pagedserve.entrypoints.cli bench throughput --device cuda --dtype bfloat16 "${model_args[@]}" \
    --systems pagedserve,pagedserve-fp8,hf-static,hf-cb --reps 1 --out-dir "$out" --json "$out/throughput.json" 2>&1 \
    | tee "$out/throughput.txt"
