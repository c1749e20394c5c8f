"""The C kernels' tests again, each run in a process of its own whose every kernel load gets another
build (ops/native.py's build variants): under AddressSanitizer, where a read or write out of bounds
or a use after free ends the run with ASan's report; and for x86-64-v3 (AVX2 with FMA, no AVX-512),
the build a CPU without AVX-512 gets, whatever CPU runs the tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.ops import native

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ["tests/ops/test_cpu_attention.py", "tests/ops/test_cpu_linear.py", "tests/ops/test_fused_cpu.py",
                "tests/ops/test_lora_cpu.py", "tests/models/test_quantized.py", "tests/worker/test_cpu_graphs.py"]
# Under ASan: every kernel (decode and prefill over each cache type, block sizes, windows; matmuls of
# every tile edge; the fused ops; the LoRA deltas; each quantized format; a replayed forward), without
# the tests whose bounds hold only for the default build's order of float sums: instrumented, gcc
# leaves the RMSNorm sum scalar (a bfloat16 output then lands 2 steps from torch's where the test
# allows 1).
SANITIZED = " or ".join([
    "test_long_contexts_match_the_oracle", "test_fp8_cache", "test_bfloat16_cache_matches",
    "test_queries_may_be_a_view", "test_only_the_decode_rows", "test_prefill_matches_the_oracle", "test_prefill_reads_any_block_size",
    "test_prefill_over", "test_prefill_writes_only", "test_the_checked_build",
    "test_matches_float64_for_any_shape", "test_model_shapes",
    "test_silu", "test_gelu", "test_a_scaled_row", "test_rotary", "test_row_", "test_matches_a_per_row", "test_rows_of_a_strided", "test_a_row_gets",
    "test_dequantized_weights", "test_linear_matches_dequantize", "test_an_embedding_row_id",
    "test_replays_equal"])
# For x86-64-v3: the exactness checks of every kernel; not the tests of loading and falling back.
EXACTNESS = "not load and not compiler and not disabled and not dynamo"


def run_tests(env: dict[str, str], selection: str, files: list[str] = KERNEL_TESTS) -> str:
    """pytest over `files`' tests that `selection` picks, in a process with `env`; its output. Fails
    unless every selected test passes."""
    env = {**env, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files,
                             "-k", selection], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    passed = re.search(r"(\d+) passed", output)
    assert passed and int(passed.group(1)) > 50, output[-2000:]  # the selection ran, not a handful of skips
    return output


@pytest.mark.slow
def test_the_kernel_tests_pass_under_address_sanitizer(tmp_path):
    try:
        env = native.sanitizer_env()
    except native.BuildError as e:
        pytest.skip(f"no AddressSanitizer here: {e}")
    # ASan reports into files: pytest captures the test's stderr, and an aborting process loses it.
    env["ASAN_OPTIONS"] += f":log_path={tmp_path / 'asan'}"
    probe = subprocess.run(
        [sys.executable, "-c", "from pagedserve.ops import cpu_attention, native; "
         "assert cpu_attention.load() is not None; print(native.build_flags('paged_attention'))"],
        cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0 and "-fsanitize=address" in probe.stdout, probe.stderr[-3000:]  # ASan builds load
    try:
        run_tests(env, SANITIZED)
    finally:
        reports = "\n".join(p.read_text() for p in tmp_path.glob("asan*"))
        assert not reports, reports[:6000]


@pytest.mark.slow
def test_the_kernel_tests_pass_on_the_avx2_build():
    if not {"avx2", "fma"} <= set(native.cpu_features().split()):
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    march = "x86-64-v3"
    for name in native.SOURCES:  # the build is AVX2's on any CPU: no AVX-512 path compiled in
        defines = native.target_defines(name, native.build_flags(name, march=march))
        assert {"__AVX2__", "__FMA__"} <= defines and "__AVX512F__" not in defines
    output = run_tests({**os.environ, native.MARCH_ENV: march}, EXACTNESS, KERNEL_TESTS[:4])
    assert "skipped" not in output  # every dtype has its kernel on AVX2: nothing may skip for want of one
