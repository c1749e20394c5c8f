"""The startup bench's machinery: a cold start and warm starts, each a fresh process that reaches
its first token. (No timing is asserted.)"""

import shutil

import pytest

from pagedserve.bench.startup import format_table, run_startup_bench


@pytest.mark.slow
def test_cold_then_warm_starts_each_reach_a_first_token(tiny_checkpoint, embedded_tokenizer, tmp_path, monkeypatch):
    # The C kernels off: a cold start would compile them (test_native.py covers building), which
    # is most of this test's time and none of what it checks.
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNEL", "0")
    path = tmp_path / "tiny"
    shutil.copytree(tiny_checkpoint("llama")[0], path)
    embedded_tokenizer.save_pretrained(path)  # LLM() loads the checkpoint's tokenizer
    rows = run_startup_bench(model=str(path), reps=1)
    assert [r["start"] for r in rows] == ["cold", "warm"]
    for r in rows:
        assert min(r["import"], r["engine"], r["first_token"]) > 0
        assert r["total"] == r["import"] + r["engine"] + r["first_token"]
    assert format_table(rows).count("\n") == 3
