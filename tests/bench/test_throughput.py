"""The throughput bench's machinery on a tiny model: every system produces exactly the workload's
tokens and the table reports ratios to pagedserve. (No timing is asserted.)"""

import json
import os

import pytest

from pagedserve.bench.throughput import (SystemResult, markdown_table, plot, run_external, run_hf_cb,
                                         run_hf_static, run_pagedserve)
from pagedserve.bench.workload import parallel_sampling, sharegpt_like
from pagedserve.models.loader import load_model


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint, embedded_tokenizer):
    path, hf_model = tiny_checkpoint("llama")
    return load_model(str(path)), embedded_tokenizer, hf_model


def small(workload):
    return workload(num_requests=3, seed=0, prompt_len=(4, 20), output_len=(2, 6), vocab=range(3, 120))


def test_every_system_runs_the_same_tokens(tiny, tmp_path):
    model, tokenizer, hf_model = tiny
    workload = small(sharegpt_like)
    results = [run_pagedserve(workload, 2, model, tokenizer, num_kv_blocks=64, max_model_len=256),
               run_hf_static(workload, 1, hf_model, batch_size=2),
               run_hf_cb(workload, 1, hf_model),
               run_external("vllm", None, workload, 1, "", {})]
    assert len(results[0].seconds) == 2
    assert all(r.output_tokens == workload.num_output_tokens for r in results[:3])
    assert "--vllm-python" in results[3].skipped and results[3].system == "vllm"
    table = markdown_table(workload, results)
    assert "| pagedserve |" in table and "1.00x" in table and "hf-static (batch 2)" in table
    plot(results, "tiny", str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 5000


def test_parallel_sampling_counts_every_sample(tiny):
    model, tokenizer, _ = tiny
    workload = small(parallel_sampling)
    result = run_pagedserve(workload, 1, model, tokenizer, num_kv_blocks=64, max_model_len=256)
    assert result.output_tokens == workload.num_output_tokens == 4 * sum(r.output_len for r in workload.requests)


def test_ratios_use_the_median():
    r = SystemResult("x", seconds=[1.0, 4.0, 2.0], prompt_tokens=10, output_tokens=20)
    assert r.output_tps() == 10.0 and r.output_tps(min) == 20.0 and r.total_tps() == 15.0


def test_a_failing_system_becomes_a_row_and_the_others_still_run(tiny, monkeypatch):
    from pagedserve.bench import throughput

    model, tokenizer, hf_model = tiny
    workload = small(sharegpt_like)

    def stall(*args, **kwargs):
        raise RuntimeError("transformers' continuous batching stalled")

    monkeypatch.setattr(throughput, "run_hf_cb", stall)
    monkeypatch.setattr(throughput, "load_hf_reference", lambda dtype, device, model: hf_model)
    monkeypatch.setattr(throughput, "run_pagedserve", lambda w, reps, *a, **k: run_pagedserve(
        w, reps, model, tokenizer, num_kv_blocks=64, max_model_len=256))
    results = throughput.run_throughput_bench(workload, ["hf-cb", "pagedserve"], reps=1, log=lambda _: None)
    assert [r.system for r in results] == ["hf-cb", "pagedserve"]
    assert "stalled" in results[0].skipped and not results[1].skipped
    with pytest.raises(ValueError, match="unknown system"):
        throughput.run_throughput_bench(workload, ["tgi"], reps=1)


def test_vllm_runs_in_the_dtype_pagedserve_runs_in(tmp_path):
    """The vLLM driver is handed the bench's dtype (it was float32 whatever the bench ran in). A
    stand-in for vLLM's Python keeps the spec it was given and reports a run."""
    from pagedserve.bench.throughput import run_throughput_bench

    fake_python = tmp_path / "python"
    fake_python.write_text(f'#!/bin/sh\ncp "$2" {tmp_path}/spec.json\n'
                           'echo \'{"seconds": [1.0], "output_tokens": 5, "note": "stand-in"}\' > "$3"\n')
    fake_python.chmod(0o755)
    workload = small(sharegpt_like)
    results = run_throughput_bench(workload, ["vllm"], reps=1, vllm_python=str(fake_python), dtype="bfloat16",
                                   log=lambda *_: None)
    assert [r.skipped for r in results] == [None, None]  # default threads, and every core
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert spec["dtype"] == "bfloat16" and spec["model"] == ""  # no directory given: the driver is told none

    # vllm-all-cores: only the run on every core; vLLM reads the bench's --model when no HF copy is named.
    results = run_throughput_bench(workload, ["vllm-all-cores"], reps=1, vllm_python=str(fake_python),
                                   model="/models/llama", log=lambda *_: None)
    assert [r.system for r in results] == [f"vllm ({os.cpu_count()} threads)"] and not results[0].skipped
    assert json.loads((tmp_path / "spec.json").read_text())["model"] == "/models/llama"


def test_the_table_reports_startup_and_greedy_agreement():
    workload = small(sharegpt_like)
    ours = SystemResult("pagedserve", [1.0], 10, 20, startup_s=3.5,
                        token_ids=[list(range(r.output_len)) for r in workload.requests])
    theirs_ids = [list(ids) for ids in ours.token_ids]
    theirs_ids[0][1] = -1  # the first request differs from its second token on
    theirs = SystemResult("vllm", [2.0], 10, 20, startup_s=95.0, token_ids=theirs_ids)
    n0 = workload.requests[0].output_len
    expected = f"2/3 ({(1 / n0 + 2) / 3:.0%})"
    row = next(line for line in markdown_table(workload, [ours, theirs]).splitlines() if line.startswith("| vllm"))
    assert "| 95.0 |" in row and f"| {expected} |" in row
    assert "| 3.5 |" in markdown_table(workload, [ours])


def test_pagedserve_records_its_outputs_and_startup(tiny):
    model, tokenizer, _ = tiny
    workload = small(sharegpt_like)
    result = run_pagedserve(workload, 1, model, tokenizer, num_kv_blocks=64, max_model_len=256)
    assert [len(ids) for ids in result.token_ids] == [r.output_len for r in workload.requests]
    assert result.startup_s > 0
