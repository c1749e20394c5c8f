"""The offline API writes its pool to the KV tier however a script ends: real scripts, in processes
of their own, make `LLM(kv_offload_dir=d)` (the default policy: blocks reach the tier only as the
pool evicts them), generate on a long prompt and end without `shutdown()`: by returning (at module
level: the exit writes; in `main()`: the LLM is collected and writes), on SIGTERM while idle (the
process still exits with status 143) and on SIGINT (KeyboardInterrupt). A new engine on the same
directory then finds the prompt's blocks and gives the same output.

The four scripts run at once (module fixture): each start loads the model, the slow part."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = [(7919 * i) % 20000 + 100 for i in range(100)]  # 6 full blocks of 16, and 4 tokens
SETTINGS = dict(num_kv_blocks=64, max_model_len=256)
PARAMS = dict(max_tokens=4, temperature=0, ignore_eos=True)
SCRIPT = """
import json, sys, time
from pagedserve import LLM, SamplingParams

def run():
    llm = LLM(kv_offload_dir=sys.argv[1], **SETTINGS)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(**PARAMS), use_tqdm=False)
    print(json.dumps(list(out.outputs[0].token_ids)), flush=True)
    return llm

if sys.argv[2] == "main":
    run()  # the LLM is collected as run() returns
else:
    llm = run()  # kept at module level, to the end
    if sys.argv[2] == "wait":
        print("ready", flush=True)
        time.sleep(300)
"""
ROOT = Path(__file__).resolve().parents[2]
# Per ending: the script's mode, and the signal sent once it is idle.
ENDINGS = {"return at module level": ("return", None), "return from main()": ("main", None),
           "SIGTERM while idle": ("wait", signal.SIGTERM), "SIGINT while idle": ("wait", signal.SIGINT)}


@pytest.fixture(scope="module")
def ended(tmp_path_factory) -> dict[str, tuple[int, list[int], Path]]:
    """Per ending: (the exit status, the tokens the script printed, its tier directory)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    runs = {}
    for ending, (mode, _) in ENDINGS.items():
        directory = tmp_path_factory.mktemp("tier")
        path = directory / "script.py"
        path.write_text(f"SETTINGS, PROMPT, PARAMS = {SETTINGS!r}, {PROMPT!r}, {PARAMS!r}\n" + SCRIPT)
        runs[ending] = (subprocess.Popen([sys.executable, str(path), str(directory / "kv"), mode], env=env,
                                         stdout=subprocess.PIPE, text=True), directory / "kv")
    results = {}
    try:
        for ending, (process, directory) in runs.items():
            tokens = json.loads(process.stdout.readline())
            signum = ENDINGS[ending][1]
            if signum is not None:
                assert process.stdout.readline() == "ready\n"
                process.send_signal(signum)
            process.wait(timeout=120)
            results[ending] = (process.returncode, tokens, directory)
    finally:
        for process, _ in runs.values():
            if process.poll() is None:
                process.kill()
            process.stdout.close()
    return results


@pytest.fixture(scope="module")
def expected(embedded_model, embedded_tokenizer) -> list[int]:
    llm = LLM.from_engine(LLMEngine(EngineConfig(enable_prefix_caching=False, **SETTINGS), model=embedded_model,
                                    tokenizer=embedded_tokenizer))
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(**PARAMS), use_tqdm=False)
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize("ending, status", [("return at module level", 0), ("return from main()", 0),
                                            ("SIGTERM while idle", 128 + signal.SIGTERM),
                                            ("SIGINT while idle", -signal.SIGINT)])
def test_a_new_process_finds_the_blocks_an_ended_script_wrote(embedded_model, embedded_tokenizer, ended, expected,
                                                              ending, status):
    returncode, first_tokens, directory = ended[ending]
    assert returncode == status and first_tokens == expected
    llm = LLM.from_engine(LLMEngine(EngineConfig(kv_offload_dir=str(directory), **SETTINGS), model=embedded_model,
                                    tokenizer=embedded_tokenizer))
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(**PARAMS), use_tqdm=False)
    metrics = llm.get_metrics()
    assert metrics["kv_offload_hit_tokens"] == metrics["prefix_cache_hits"] == 6 * 16
    assert out.num_cached_tokens == 6 * 16 and list(out.outputs[0].token_ids) == expected
    llm.shutdown()
