#!/usr/bin/env bash
# Every GPU check of issue 7 in one run (about 5 minutes on an H200), for a session lent a GPU:
#   scripts/gpu_check.sh OUT_DIR
# Needs a python3 with torch (CUDA), triton and transformers, as the device machine has; the
# embedded model is a GGUF file, so also the pure-Python `gguf` package: where it is missing,
# download its wheel here and carry it (.library/device/README.md), then
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# Writes kernels.txt, engine.txt, throughput.{txt,json} and the throughput table and plot to OUT_DIR.
set -uo pipefail
out=${1:-gpu_out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 scripts/gpu_check.py 2>&1 | tee "$out/kernels.txt"
python3 scripts/gpu_engine_check.py 2>&1 | tee "$out/engine.txt"
python3 -m pagedserve.entrypoints.cli bench throughput --device cuda --dtype bfloat16 \
    --systems pagedserve,hf-static,hf-cb --reps 1 --out-dir "$out" --json "$out/throughput.json" 2>&1 \
    | tee "$out/throughput.txt"
