"""The KV offload bench's machinery on a tiny model at tiny sizes: every part runs, its rows have
the figures the report shows, greedy outputs match the baseline's, each tier's directory is removed
afterwards, and the command line parses. (No timing is asserted; before the tier is wired into the
engine, its settings change nothing and the tier figures are zeros.)"""

import json

import pytest

from pagedserve.bench.offload import (OFF, markdown_table, multiturn_pool, percentiles, plot, run_offload_bench,
                                      safe_vocab)
from pagedserve.bench.workload import multi_turn_chat
from pagedserve.models.loader import load_model

TINY = dict(sessions=3, turns=2, system_prompt_len=16, user_len=8, answer_len=4, concurrency=2,
            noreuse_requests=3, noreuse_prompt_len=(16, 40), noreuse_output_len=3,
            restart_prefix_len=48, restart_question_len=4, restart_output_len=2, restart_reps=1, reps=1,
            swap_requests=6, swap_prompt_len=8, swap_output_len=16, swap_max_num_seqs=4, swap_blocks=4)
ROW_KEYS = {"system", "seconds", "seconds_median", "identical", "tier_bytes", "settings", "prefix_cache_queries",
            "prefix_cache_hits", "prefix_hit_rate", "preemptions", "kv_offload_hit_tokens",
            "kv_offload_stored_blocks", "kv_offload_loaded_blocks"}


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint, embedded_tokenizer):
    path, _ = tiny_checkpoint("llama")
    return load_model(str(path)), embedded_tokenizer


@pytest.fixture(scope="module")
def report(tiny, tmp_path_factory):
    model, tokenizer = tiny
    root = tmp_path_factory.mktemp("tiers")
    result = run_offload_bench(**TINY, offload_root=str(root), model=model, tokenizer=tokenizer, log=lambda *_: None)
    return result, root


def test_every_part_runs_with_identical_outputs_and_leaves_no_tier_behind(report):
    result, root = report
    assert result["parts"] == ["multiturn", "noreuse", "restart", "swap"]
    assert result["all_identical"] is True
    assert result["tier_active"] is True  # the tier's settings reached the engines
    assert list(root.iterdir()) == []  # each tier's temporary directory was removed
    json.dumps(result)  # the --json report is plain data


def test_multiturn_rows(report):
    mt = report[0]["multiturn"]
    rows = mt["rows"]
    assert [r["system"] for r in rows] == [OFF, "write_through", "evicted"]
    for r in rows:
        assert ROW_KEYS | {"ttft_p50_s", "ttft_p90_s", "ttft_all_p50_s", "ttft_all_p90_s", "ttft_ratio"} <= set(r)
        assert r["identical"] == (6, 6)  # 3 sessions x 2 turns
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] and 0 < r["ttft_all_p50_s"] <= r["ttft_all_p90_s"]
        assert 0.0 <= r["prefix_hit_rate"] <= 1.0 and r["prefix_cache_queries"] > 0
    assert rows[0]["settings"].get("kv_offload_dir") is None
    assert rows[1]["settings"]["kv_offload_dir"] == "<temporary directory>"
    assert rows[2]["settings"]["kv_offload_policy"] == "evicted"
    assert rows[0]["ttft_ratio"] == 1.0
    assert rows[0]["kv_offload_stored_blocks"] == rows[0]["kv_offload_hit_tokens"] == 0
    assert all(r["kv_offload_stored_blocks"] > 0 for r in rows[1:])
    # The pool holds a quarter of the sessions' final contexts, and at least two sessions at once.
    assert mt["pool"]["max_model_len"] == 16 + 2 * 8 + 2 * 4
    assert mt["pool"]["num_kv_blocks"] * 16 >= 2 * mt["pool"]["max_model_len"]


def test_noreuse_swap_and_restart_rows(report):
    result = report[0]
    noreuse, swap, restart = result["noreuse"]["rows"], result["swap"]["rows"], result["restart"]
    assert [r["system"] for r in noreuse] == [OFF, "evicted", "write_through"]
    assert [r["system"] for r in swap] == ["recompute (no tier)", "swap", "swap + write-through"]
    for r in noreuse + swap:
        assert ROW_KEYS | {"total_tps", "output_tps", "seconds_ratio"} <= set(r)
        assert r["total_tps"] > 0 and r["seconds_ratio"] > 0
    assert [r["identical"] for r in noreuse] == [(3, 3)] * 3
    assert [r["identical"] for r in swap] == [(6, 6)] * 3
    assert swap[0]["preemptions"] > 0  # the pool is small enough to preempt
    assert swap[1]["settings"]["preemption_mode"] == "swap" and "preemption_mode" not in swap[0]["settings"]
    assert restart["identical"] is True and restart["prompt_tokens"] == 52
    assert restart["base_ttft_s"] > 0 and restart["tier_ttft_s"] > 0 and restart["ttft_ratio"] > 0
    assert restart["num_cached_tokens"] == restart["kv_offload_hit_tokens"] == 48  # the system prompt's 3 blocks
    # evicted: the pool holds every prompt, so nothing is written while they run; write_through writes them all
    assert [r["kv_offload_stored_blocks"] > 0 for r in noreuse] == [False, False, True]


def test_the_report_shows_every_part(report, tmp_path):
    result = report[0]
    table = markdown_table(result)
    for heading in ("### Multi-turn chat", "### No reuse", "### Restart", "### Preemption: recompute vs swap"):
        assert heading in table
    assert "| write_through |" in table and "| evicted |" in table and "| 6/6 |" in table
    assert "new engine in the same process" in table and "page cache" in table
    assert "target >= 2x" in table and "target <= 1.05x" in table and "target >= 3x" in table
    assert "identical with and without the tier: yes" in table
    assert "the tier did nothing" not in table
    result = json.loads(json.dumps(result))
    for row in result["multiturn"]["rows"] + result["noreuse"]["rows"] + result["swap"]["rows"] + [result["restart"]]:
        row["kv_offload_stored_blocks"] = row["kv_offload_loaded_blocks"] = 0
    assert "the tier did nothing" in markdown_table(result | {"tier_active": False})
    plot(result, str(tmp_path / "offload.png"))
    assert (tmp_path / "offload.png").stat().st_size > 5000


def test_a_mismatch_fails_the_report(report):
    result = json.loads(json.dumps(report[0]))
    result["swap"]["rows"][1]["identical"] = [5, 6]
    result["all_identical"] = False
    table = markdown_table(result)
    assert "| 5/6 |" in table and "NO" in table


def test_parts_alone_with_repetitions_and_bad_names(tiny):
    model, tokenizer = tiny
    result = run_offload_bench(("noreuse", "restart"), **(TINY | {"reps": 2, "restart_reps": 2}), model=model,
                               tokenizer=tokenizer, log=lambda *_: None)
    assert "multiturn" not in result and "swap" not in result and result["all_identical"]
    assert [len(r["seconds"]) for r in result["noreuse"]["rows"]] == [2, 2, 2]
    assert len(result["restart"]["ratios"]) == 2 and result["restart"]["reps"] == 2
    with pytest.raises(ValueError, match="unknown parts"):
        run_offload_bench(("multiturn", "bogus"), model=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="kv_offload_policy"):
        run_offload_bench(("multiturn",), policies=("lru",), model=model, tokenizer=tokenizer)


def test_the_multiturn_pool_is_a_share_of_the_contexts():
    w = multi_turn_chat(num_sessions=8, num_turns=4, system_prompt_len=512, user_len=64, answer_len=32)
    pool = multiturn_pool(w, concurrency=2, pool_ratio=4.0)
    assert pool["max_model_len"] == 512 + 4 * 64 + 4 * 32
    assert pool["context_tokens"] == 8 * pool["max_model_len"]
    assert pool["num_kv_blocks"] * 16 >= 2 * pool["max_model_len"]
    assert 3.5 <= pool["context_over_pool"] <= 4.0 and not pool["raised_for_concurrency"]
    # A ratio that would leave too little for a group of sessions gives way to the group.
    raised = multiturn_pool(w, concurrency=4, pool_ratio=8.0)
    assert raised["num_kv_blocks"] == 4 * 56 and raised["raised_for_concurrency"]
    assert "less than asked" in markdown_table({"multiturn": {"workload": "w", "concurrency": 4, "pool": raised,
                                                              "reps": 1, "rows": []}, "all_identical": True})


def test_percentiles_and_vocab():
    assert percentiles([]) == {"p50": 0.0, "p90": 0.0}
    assert percentiles([2.0]) == {"p50": 2.0, "p90": 2.0}
    assert percentiles([float(i) for i in range(1, 11)])["p50"] == pytest.approx(5.5)

    class Config:
        vocab_size = 49152

    assert safe_vocab(Config) == range(100, 49000)
    Config.vocab_size = 128
    assert safe_vocab(Config) == range(3, 128)


def test_the_command_line_parses():
    from pagedserve.entrypoints.cli import build_parser, cmd_bench_offload

    args = build_parser().parse_args(["bench", "offload", "--parts", "multiturn,restart", "--sessions", "4",
                                      "--turns", "3", "--reps", "2", "--shared-system-prompt", "--policies",
                                      "write_through", "--out-dir", "out", "--json", "o.json", "--plot", "o.png"])
    assert args.func is cmd_bench_offload
    assert (args.parts, args.sessions, args.turns, args.reps) == ("multiturn,restart", 4, 3, 2)
    assert args.shared_system_prompt and args.policies == "write_through" and args.restart_reps == 3
    defaults = build_parser().parse_args(["bench", "offload"])
    assert defaults.parts == "multiturn,noreuse,restart,swap" and defaults.restart_prefix_len == 2000
    assert (defaults.sessions, defaults.turns, defaults.reps, defaults.policies) == (8, 4, 2, "write_through,evicted")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "offload", "--sessions", "0"])
