"""A tensor-parallel engine that is dropped without `shutdown()` still releases its group: once it is
collected, its workers are gone and the process can start another tensor-parallel engine (a notebook
or a script that builds one engine after another)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.tp, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import gc
    import multiprocessing
    import sys

    import torch.distributed as dist

    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams


    def generate(llm):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        return llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids


    if __name__ == "__main__":  # the workers are spawned: they import this file
        settings = dict(tensor_parallel_size=2, num_kv_blocks=32, block_size=4)
        llm = LLM(sys.argv[1], **settings)
        first = generate(llm)
        replay = llm.fast_paths()["decode_replay"]
        del llm
        gc.collect()
        print("in a group after collection:", dist.is_initialized())
        print("workers left:", len(multiprocessing.active_children()))
        llm = LLM(sys.argv[1], **settings)
        print("same tokens from the second engine:", generate(llm) == first)
        print("replay skipped for:", replay)
''')


def test_a_collected_tensor_parallel_engine_leaves_its_group(odd_checkpoint, tmp_path):
    script = tmp_path / "two_engines.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(odd_checkpoint[0])], cwd=ROOT, capture_output=True,
                            text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = result.stdout
    assert result.returncode == 0, (out + result.stderr)[-4000:]
    assert "in a group after collection: False" in out
    assert "workers left: 0" in out
    assert "same tokens from the second engine: True" in out
    assert "replay skipped for: tensor parallelism" in out  # the fast path a TP engine skips, and why
