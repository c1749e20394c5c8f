"""The serving load generator against a real server on loopback (the embedded model behind the
OpenAI-compatible app): every request completes with exactly its output length, the latencies
are ordered as they must be, and the latency-vs-rate table and plot render. (No timing target.)"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints" / "openai"))
from server_harness import MODEL, serve_engine  # noqa: E402

from pagedserve.bench.serving import format_report, format_table, plot, run_serving_bench  # noqa: E402
from pagedserve.bench.workload import sharegpt_like  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402


@pytest.fixture(scope="module")
def url(embedded_model, embedded_tokenizer):
    engine = LLMEngine(EngineConfig(num_kv_blocks=256, max_model_len=1024), model=embedded_model,
                       tokenizer=embedded_tokenizer)
    with serve_engine(engine) as server:
        yield server.url


def test_load_generator_measures_every_request(url, tmp_path):
    workload = sharegpt_like(num_requests=5, seed=1, prompt_len=(4, 40), output_len=(2, 8), vocab=range(100, 4000))
    reports = [asyncio.run(run_serving_bench(url, workload, rate, MODEL, progress=False)) for rate in (float("inf"), 50.0)]
    for report in reports:
        assert report["completed"] == 5 and report["failed"] == 0, report["errors"]
        assert report["output_throughput"] * report["duration_s"] == pytest.approx(workload.num_output_tokens)
        assert 0 < report["ttft_s"]["p50"] <= report["e2e_s"]["p50"] <= report["duration_s"]
        assert report["ttft_s"]["p50"] <= report["ttft_s"]["p99"]
        assert "| TTFT |" in format_report(report)
    assert "| inf | 5 of 5 |" in format_table(reports) and "| 50 | 5 of 5 |" in format_table(reports)
    plot(reports, str(tmp_path / "serving.png"))
    assert (tmp_path / "serving.png").stat().st_size > 5000


def test_a_wrong_model_name_is_counted_as_failures(url):
    workload = sharegpt_like(num_requests=2, seed=1, prompt_len=(4, 8), output_len=(2, 3), vocab=range(100, 4000))
    report = asyncio.run(run_serving_bench(url, workload, float("inf"), "no-such-model", progress=False))
    assert report["completed"] == 0 and report["failed"] == 2 and report["errors"]
