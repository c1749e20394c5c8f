"""`pagedserve bench startup`: seconds from a new process to the first token, cold and warm.

Each start is a fresh Python process that imports pagedserve, builds `LLM(...)` and generates one
token. Cold: an empty cache folder (the GGUF is converted and the C kernel compiled). Warm: the
same folder again, as a second start finds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

_CHILD = """
import json, time
t0 = time.perf_counter()
from pagedserve import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(model={model!r}, dtype={dtype!r})
t2 = time.perf_counter()
llm.generate([{{"prompt_token_ids": [1, 2, 3]}}], SamplingParams(max_tokens=1), use_tqdm=False)
t3 = time.perf_counter()
print(json.dumps({{"import": t1 - t0, "engine": t2 - t1, "first_token": t3 - t2}}))
"""


def run_startup_bench(model: str | None = None, dtype: str = "float32", reps: int = 1) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagedserve-startup-") as cache:
        env = {**os.environ, "PAGEDSERVE_CACHE_DIR": cache, "PAGEDSERVE_GGUF_CACHE": "1"}
        for kind in ["cold"] + ["warm"] * reps:
            child = subprocess.run([sys.executable, "-c", _CHILD.format(model=model, dtype=dtype)], env=env,
                                   capture_output=True, text=True)
            if child.returncode != 0:
                raise RuntimeError(f"the {kind} start failed:\n{child.stderr[-2000:]}")
            times = json.loads(child.stdout.strip().splitlines()[-1])
            rows.append({"start": kind, **times, "total": sum(times.values())})
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| start | import (s) | LLM(...) (s) | first token (s) | total (s) |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['start']} | {r['import']:.2f} | {r['engine']:.2f} | {r['first_token']:.2f} | "
                     f"{r['total']:.2f} |")
    return "\n".join(lines)
