"""The serving load generator against a real server on loopback (the embedded model behind the
OpenAI-compatible app): every request completes with exactly its output length, the latencies
are ordered as they must be, and the latency-vs-rate table and plot render. (No timing target.)"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints" / "openai"))
from server_harness import MODEL, serve_engine  # noqa: E402

from pagedserve.bench.serving import format_comparison, format_report, format_table, plot, run_serving_bench  # noqa: E402
from pagedserve.bench.workload import sharegpt_like  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.entrypoints import cli  # noqa: E402


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


def test_two_named_urls_give_one_table_and_a_comparison(url, tmp_path, capsys):
    cli.main(["bench", "serving", "--url", f"first={url}", f"second={url}/", "--model-name", MODEL,
              "--num-requests", "3", "--max-output-len", "17", "--request-rate", "inf", "40",
              "--warmup-requests", "2", "--out-dir", str(tmp_path), "--json", str(tmp_path / "r.json")])
    table = (tmp_path / "bench_serving.md").read_text()
    assert "against first, second" in table
    rows = table.splitlines()
    assert sum(r.startswith("| first | ") for r in rows) == 2 and sum(r.startswith("| second | ") for r in rows) == 2
    assert "| inf | second | " in table and "| 40 | second | " in table  # first / second, rate by rate
    reports = json.loads((tmp_path / "r.json").read_text())
    assert [(r["system"], r["request_rate"]) for r in reports] == [
        ("first", float("inf")), ("first", 40.0), ("second", float("inf")), ("second", 40.0)]
    assert all(r["completed"] == 3 for r in reports)
    # each rate draws its own prompts, so that none is served from the prefix cache of an earlier run
    assert reports[0]["workload"] == reports[2]["workload"] != reports[1]["workload"] == reports[3]["workload"]
    assert "3 requests per rate, new prompts at each rate" in table


def test_the_comparison_divides_the_baseline_by_each_other_system():
    def report(system, rate, ttft, tpot, tps):
        p = {"p50": ttft, "p99": 2 * ttft}
        return {"system": system, "request_rate": rate, "ttft_s": p, "tpot_s": {"p50": tpot, "p99": 2 * tpot},
                "output_throughput": tps}

    text = format_comparison([report("a", 1.0, 0.1, 0.02, 100), report("b", 1.0, 0.2, 0.01, 50)], "a")
    assert "| 1 | b | 100 / 200 (0.50x) | 200 / 400 (0.50x) | 20 / 10 (2.00x) | 40 / 20 (2.00x) | 100 / 50 (2.00x) |" in text
