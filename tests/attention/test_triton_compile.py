"""The Triton kernels compile for NVIDIA GPUs (scripts/triton_compile.py), checked here without one:
the interpreter tests run their arithmetic, this runs the GPU compiler (through ptxas) on every
launch a step makes. Subprocesses, because conftest.py sets TRITON_INTERPRET=1 for this process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_python(args: list[str], cache_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache_dir), TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper_and_ampere_without_spilling(tmp_path):
    result = run_python(["scripts/triton_compile.py", "--quick", "--arch", "90", "80"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    # 2 shapes x 8 launches (KV write, decode, split decode, combine, prefill; the three attention
    # kernels again with sinks) x 3 dtypes on sm_90, x 2 on sm_80 (no fp8 e4m3 there).
    assert lines[-1] == "80 compiled, 0 failed, 0 spilled"
    assert sum(line.startswith("ok    sm_90") and "_decode" in line for line in lines) == 24
    assert sum(line.startswith("ok    sm_90") and "HAS_SINKS=True" in line for line in lines) == 18


@pytest.mark.slow
def test_an_fp8_cache_does_not_compile_before_sm_89_as_fp8_supported_says(tmp_path):
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, "scripts")
        from triton_compile import compile_launch, record_step
        from pagedserve.attention.kv_quant import FP8_DTYPE
        for arch in (89, 80):
            for launch in record_step(16, 3, 3, 64, torch.bfloat16, FP8_DTYPE, split=False):
                try:
                    compile_launch(launch, arch)
                    print(arch, launch.kernel.__name__, "compiled")
                except Exception as exc:
                    print(arch, launch.kernel.__name__, "failed", "fp8e4nv not supported" in str(exc))
    """)
    result = run_python(["-c", code], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:-1] == [
        "89 _write_kv compiled", "89 _decode compiled", "89 _prefill compiled",
        "80 _write_kv failed True", "80 _decode failed True", "80 _prefill failed True",
    ]


def test_the_script_refuses_to_run_under_the_interpreter(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "scripts/triton_compile.py"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "run without TRITON_INTERPRET=1" in result.stderr
