"""The serving load generator against a real server on loopback (the embedded model behind the
OpenAI-compatible app): every request completes with exactly its output length, the latencies
are ordered as they must be, and the latency-vs-rate table and plot render. (No timing target.)"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints" / "openai"))
from server_harness import MODEL, serve_engine  # noqa: E402

from pagedserve.bench import serving  # noqa: E402
from pagedserve.bench.serving import (  # noqa: E402
    format_comparison, format_report, format_table, median_reports, plot, run_serving_bench, wait_until_idle)
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


@pytest.mark.slow  # a server, on the embedded model
def test_load_generator_measures_every_request(url, tmp_path):
    workload = sharegpt_like(num_requests=5, seed=1, prompt_len=(4, 40), output_len=(2, 8), vocab=range(100, 4000))
    reports = [asyncio.run(run_serving_bench(url, workload, rate, MODEL, progress=False)) for rate in (float("inf"), 50.0)]
    for report in reports:
        assert report["completed"] == 5 and report["failed"] == 0, report["errors"]
        assert report["output_throughput"] * report["duration_s"] == pytest.approx(workload.num_output_tokens)
        assert 0 < report["ttft_s"]["p50"] <= report["e2e_s"]["p50"] <= report["duration_s"]
        assert report["ttft_s"]["p50"] <= report["ttft_s"]["p99"]
        assert "| TTFT |" in format_report(report)
        # One record per request, in the workload's order, sent in that order.
        records = report["requests"]
        assert [r["prompt_tokens"] for r in records] == [len(r.prompt_token_ids) for r in workload.requests]
        assert [r["output_tokens"] for r in records] == [r.output_len for r in workload.requests]
        # Records are rounded to 0.1 ms; rounding is monotone, so compare with the report rounded alike.
        assert all(r["ok"] and 0 < r["ttft_s"] <= r["e2e_s"] <= round(report["duration_s"], 4) for r in records)
        sent = [r["sent_s"] for r in records]
        assert sent == sorted(sent) and (sent[-1] > sent[0] if report["request_rate"] != float("inf") else True)
        assert max(r["ttft_s"] for r in records) >= round(report["ttft_s"]["p99"], 4)
        assert "requests" not in median_reports([report])[0]
    assert "| inf | 5 of 5 |" in format_table(reports) and "| 50 | 5 of 5 |" in format_table(reports)
    plot(reports, str(tmp_path / "serving.png"))
    assert (tmp_path / "serving.png").stat().st_size > 5000


@pytest.mark.slow  # a server, on the embedded model
def test_a_wrong_model_name_is_counted_as_failures(url):
    workload = sharegpt_like(num_requests=2, seed=1, prompt_len=(4, 8), output_len=(2, 3), vocab=range(100, 4000))
    report = asyncio.run(run_serving_bench(url, workload, float("inf"), "no-such-model", progress=False))
    assert report["completed"] == 0 and report["failed"] == 2 and report["errors"]


@pytest.fixture
def idle_waits(monkeypatch) -> list[None]:
    """The bench's waits for quiet CPUs, counted instead of waited: on a shared machine each would
    run to its 30 s deadline, and these tests are about the tables."""
    waits = []
    monkeypatch.setattr(serving, "wait_until_idle", lambda: waits.append(None))
    return waits


@pytest.mark.slow  # a server, on the embedded model
def test_two_named_urls_give_one_table_and_a_comparison(url, tmp_path, capsys, idle_waits):
    cli.main(["bench", "serving", "--url", f"first={url}", f"second={url}/", "--model-name", MODEL,
              "--num-requests", "3", "--max-output-len", "17", "--request-rate", "inf", "40",
              "--warmup-requests", "2", "--out-dir", str(tmp_path), "--json", str(tmp_path / "r.json")])
    table = (tmp_path / "bench_serving.md").read_text()
    assert "against first, second" in table
    rows = table.splitlines()
    assert sum(r.startswith("| first | ") for r in rows) == 2 and sum(r.startswith("| second | ") for r in rows) == 2
    assert "| inf | second | " in table and "| 40 | second | " in table  # first / second, rate by rate
    reports = json.loads((tmp_path / "r.json").read_text())
    # the systems take turns at each rate
    assert [(r["system"], r["request_rate"]) for r in reports] == [
        ("first", float("inf")), ("second", float("inf")), ("first", 40.0), ("second", 40.0)]
    assert all(r["completed"] == 3 for r in reports)
    # each rate draws its own prompts, so that none is served from the prefix cache of an earlier run
    assert reports[0]["workload"] == reports[1]["workload"] != reports[2]["workload"] == reports[3]["workload"]
    assert "3 requests per rate, new prompts at each rate" in table
    assert len(idle_waits) == len(reports)  # the CPUs go quiet before each run


@pytest.mark.slow  # a server, on the embedded model
def test_rounds_take_turns_on_new_prompts_and_report_medians(url, tmp_path, idle_waits):
    cli.main(["bench", "serving", "--url", f"first={url}", f"second={url}", "--model-name", MODEL,
              "--num-requests", "3", "--max-output-len", "9", "--request-rate", "inf", "--rounds", "3",
              "--warmup-requests", "0", "--out-dir", str(tmp_path), "--json", str(tmp_path / "r.json")])
    runs = json.loads((tmp_path / "r.json").read_text())
    # who goes first rotates from round to round
    assert [(r["system"], r["round"]) for r in runs] == [
        ("first", 0), ("second", 0), ("second", 1), ("first", 1), ("first", 2), ("second", 2)]
    # one draw of prompts per round, the same for both systems within it
    assert len({r["workload"] for r in runs}) == 3
    assert all(a["workload"] == b["workload"] for a, b in zip(runs[::2], runs[1::2]))
    table = (tmp_path / "bench_serving.md").read_text()
    assert "3 requests per rate, new prompts at each rate, medians of 3 rounds" in table
    assert "| first | inf | 9 of 9 |" in table
    median = sorted(r["ttft_s"]["p99"] for r in runs if r["system"] == "first")[1]
    first_row = next(row for row in table.splitlines() if row.startswith("| first | inf |"))
    assert f"/ {median * 1e3:.0f} |" in first_row  # the TTFT p50 / p99 cell
    assert "rounds, of 3, in which first was at least as good" in table
    assert len(idle_waits) == len(runs)


def test_medians_and_round_counts():
    def run(system, round_, ttft, tps):
        p = {"p50": ttft, "p99": 2 * ttft}
        return {"system": system, "request_rate": 1.0, "round": round_, "workload": f"w{round_}", "completed": 4,
                "failed": 0, "errors": [], "duration_s": 1.0, "request_throughput": 1.0, "output_throughput": tps,
                "total_token_throughput": tps, "ttft_s": p, "tpot_s": p, "itl_s": p, "e2e_s": p}

    runs = [run("a", 0, 0.1, 10), run("b", 0, 0.2, 20), run("a", 1, 0.5, 30), run("b", 1, 0.3, 20),
            run("a", 2, 0.3, 40), run("b", 2, 0.4, 20)]
    a, b = median_reports(runs)
    assert (a["system"], a["rounds"], a["completed"]) == ("a", 3, 12)
    assert a["ttft_s"] == {"p50": 0.3, "p99": 0.6} and b["ttft_s"]["p50"] == 0.3
    assert a["output_throughput"] == 30 and b["output_throughput"] == 20
    text = format_comparison([a, b], "a", runs)
    # a's TTFT was no higher than b's in rounds 0 and 2; its throughput no lower in rounds 1 and 2
    assert "| 1 | b | 300 / 300 (1.00x; 2/3) | 600 / 600 (1.00x; 2/3) |" in text
    assert "30 / 20 (1.50x; 2/3) |" in text


def test_the_comparison_divides_the_baseline_by_each_other_system():
    def report(system, rate, ttft, tpot, tps):
        p = {"p50": ttft, "p99": 2 * ttft}
        return {"system": system, "request_rate": rate, "ttft_s": p, "tpot_s": {"p50": tpot, "p99": 2 * tpot},
                "output_throughput": tps}

    text = format_comparison([report("a", 1.0, 0.1, 0.02, 100), report("b", 1.0, 0.2, 0.01, 50)], "a")
    assert "| 1 | b | 100 / 200 (0.50x) | 200 / 400 (0.50x) | 20 / 10 (2.00x) | 40 / 20 (2.00x) | 100 / 50 (2.00x) |" in text


class FakeMachine:
    """CPUs whose busy share at time t is `load(t)`, read as /proc/stat-like tick counters; the
    clock moves only when the waiter sleeps, so no bound depends on how loaded the real machine is."""

    TICKS_PER_S = 100 * 2  # two CPUs

    def __init__(self, load) -> None:
        self.load, self.now, self.busy, self.total = load, 0.0, 0.0, 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        steps = max(1, round(seconds / 0.01))
        for i in range(steps):
            self.busy += self.load(self.now + (i + 0.5) * seconds / steps) * seconds / steps * self.TICKS_PER_S
        self.total += seconds * self.TICKS_PER_S
        self.now += seconds

    def cpu_times(self) -> tuple[int, int]:
        return round(self.busy), round(self.total)

    def wait(self, **kwargs) -> float:
        return wait_until_idle(read_cpu_times=self.cpu_times, clock=self.clock, sleep=self.sleep, **kwargs)


def test_waiting_for_idle_cpus_waits_while_busy_and_gives_up_at_the_deadline():
    waited = FakeMachine(lambda t: 1.0).wait(threshold=0.3, window_s=0.2, timeout_s=1.0)
    assert 1.0 <= waited <= 1.2 + 1e-9  # the deadline, and no more than the window it ends in


@pytest.mark.parametrize("quiet_from", [0.0, 0.3, 2.1, 7.5])
def test_waiting_for_idle_cpus_ends_with_the_first_quiet_window(quiet_from):
    machine = FakeMachine(lambda t: 1.0 if t < quiet_from else 0.1)  # 10% busy counts as quiet at 0.3
    waited = machine.wait(threshold=0.3, window_s=0.2, timeout_s=30.0)
    # The first window that is at most 30% busy: it may start up to 0.06 s before quiet_from.
    assert max(0.2, quiet_from) - 0.06 <= waited <= quiet_from + 0.4 + 1e-9


def test_a_load_at_the_threshold_is_busy():
    waited = FakeMachine(lambda t: 0.3).wait(threshold=0.3, window_s=0.5, timeout_s=3.0)
    assert waited >= 3.0


def test_without_cpu_counters_the_wait_is_a_few_seconds():
    def no_proc_stat():
        raise OSError("no /proc/stat")

    machine = FakeMachine(lambda t: 1.0)
    assert wait_until_idle(timeout_s=30.0, read_cpu_times=no_proc_stat, clock=machine.clock, sleep=machine.sleep) == 5.0
    assert wait_until_idle(timeout_s=1.0, read_cpu_times=no_proc_stat, clock=machine.clock, sleep=machine.sleep) == 1.0


@pytest.mark.timing
def test_the_machine_counters_see_every_core_busy_while_spinners_run():
    """The real /proc/stat and clock: with a spinner on every core the wait runs to its deadline. (Only
    a lower bound: a busier machine waits as long.)"""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        assert wait_until_idle(threshold=0.3, window_s=0.2, timeout_s=1.0) >= 1.0
    finally:
        for p in spinners:
            p.kill()
            p.wait()
