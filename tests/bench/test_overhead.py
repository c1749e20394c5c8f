"""The overhead bench on tiny scenarios: every part of a step is measured, the dry-run model makes
greedy decoding pick its fixed token, nothing leaks, the table has a row per scenario (n/a where
the pool is too small), and a 1M-block pool is real in the KV manager but costs no KV tensor bytes.
(No speed is asserted.)"""

import pytest
import torch

from pagedserve.bench.overhead import (
    DEFAULT_TOKEN, PARTS, DryRunModel, blocks_needed, build_dry_engine, check_targets, fill_prefix_cache,
    format_table, kv_tensor_bytes, run_overhead_bench, run_scenario,
)
from pagedserve.models.loader import load_config


@pytest.fixture(scope="module")
def model_config():
    return load_config()


def test_a_scenario_measures_every_part_and_leaks_nothing(model_config, embedded_tokenizer):
    engine = build_dry_engine(64, embedded_tokenizer, model_config)
    tokens = []
    commit = engine.core._commit

    def spy(plan, result):  # what the sampler picked, step by step
        tokens.extend(result.sampled.token_ids)
        return commit(plan, result)

    engine.core._commit = spy
    row = run_scenario(engine, requests=3, context=40, steps=4)
    assert row.skipped is None and set(row.parts_ms) == set(PARTS)
    for part in ("schedule", "prepare", "sample", "commit", "transport", "output", "stats"):
        assert row.parts_ms[part] > 0, part
    assert row.parts_ms["forward"] >= 0
    # Each step's parts lie within its core time, and that within its total, so each median lies
    # within the next. (A sum of medians need not: on a loaded machine different steps are slow.)
    assert row.parts_ms["prepare"] < row.core_ms and row.parts_ms["sample"] < row.core_ms
    assert row.core_ms < row.total_ms
    # Prefill, warm-up and timed steps: every token sampled is the dry run's fixed one.
    assert len(tokens) == 3 * (1 + 3 + 4) and set(tokens) == {DEFAULT_TOKEN}
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks == 64  # every block free again
    assert not engine.has_unfinished_requests() and not engine.scheduler.running


def test_dry_run_logits_are_fixed_and_never_eos(model_config):
    model = DryRunModel(model_config, max_rows=2)
    hidden = model(torch.zeros(20, dtype=torch.int64), None, [], None)
    assert hidden.shape == (20, model_config.hidden_size) and not hidden.any()
    logits = model.compute_logits(hidden[:5])
    assert logits.shape == (5, model_config.vocab_size)
    assert logits.argmax(-1).tolist() == [DEFAULT_TOKEN] * 5
    with pytest.raises(ValueError, match="EOS"):
        DryRunModel(model_config, token_id=model_config.eos_token_ids[0])


def test_the_table_has_a_row_per_scenario(model_config, embedded_tokenizer):
    # 8 requests of 40 tokens need 8 * 3 blocks at the end: more than a 20-block pool holds.
    assert blocks_needed(8, 40, 3) == 24
    rows = run_overhead_bench(requests=(1, 8), contexts=(40,), pools=(20, 64), steps=3, pool_states=("fresh",),
                              tokenizer=embedded_tokenizer, model_config=model_config, log=lambda line: None)
    assert [(r.requests, r.pool_blocks, r.skipped is None) for r in rows] == [(1, 20, True), (8, 20, False),
                                                                               (1, 64, True), (8, 64, True)]
    table = format_table(rows)
    assert "| fresh | 20 | 8 | 40 | n/a: needs 24 blocks, more than the pool |" in table
    assert sum(line.startswith("| fresh |") for line in table.splitlines()) == 4
    targets = check_targets(rows)
    assert len(targets) == 3 and targets[0][1] is None  # nothing ran at 256 requests
    assert all(t in table for t, _, _ in targets)


def test_a_million_block_pool_is_real_and_costs_no_kv_bytes(model_config, embedded_tokenizer):
    engine = build_dry_engine(1_000_000, embedded_tokenizer, model_config)
    assert engine.kv.pool.num_blocks == engine.kv.num_free_blocks == 1_000_000
    assert len(engine.runner.kv_caches) == model_config.num_layers
    assert all(cache.k.shape[0] == cache.v.shape[0] == 1_000_000 for cache in engine.runner.kv_caches)
    assert kv_tensor_bytes(engine) < 1024  # only the per-layer scales (the real head_dim: ~690 GiB)
    row = run_scenario(engine, requests=2, context=40, steps=2)
    assert row.total_ms > 0 and engine.kv.pool.num_free == 1_000_000


def test_a_cached_pool_holds_a_prefix_in_every_free_block(model_config, embedded_tokenizer):
    engine = build_dry_engine(64, embedded_tokenizer, model_config)
    assert fill_prefix_cache(engine) == 64
    pool = engine.kv.pool
    assert pool.num_free == pool.num_cached_free == 64 and len(pool.cached) == 64
    engine = build_dry_engine(64, embedded_tokenizer, model_config)
    row = run_scenario(engine, requests=2, context=40, steps=2, cached_pool=True)
    assert row.cached_pool and row.total_ms > 0
    # The requests took (and un-cached) 2 x 3 blocks from the LRU head, made 2 x 2 full blocks of their own
    # findable, and gave everything back.
    assert engine.kv.pool.num_free == 64 and len(engine.kv.pool.cached) == 64 - 6 + 4


def test_a_watched_scenario_builds_views_and_stops_recording(model_config, embedded_tokenizer):
    engine = build_dry_engine(64, embedded_tokenizer, model_config)
    row = run_scenario(engine, requests=2, context=40, steps=3, watched=True)
    assert row.watched and row.parts_ms["view"] > 0
    assert engine.kv.pool.watch is None  # the viewer left: nothing is recorded any more
    unwatched = run_scenario(build_dry_engine(64, embedded_tokenizer, model_config), requests=2, context=40, steps=3)
    assert not unwatched.watched and unwatched.parts_ms["view"] >= 0
    assert "| watched | 64 | 2 | 40 |" in format_table([row, unwatched])


def test_the_cli_writes_the_table_plot_and_json(model_config, embedded_tokenizer, tmp_path, monkeypatch, capsys):
    import json

    from pagedserve.entrypoints import cli
    from pagedserve.models import loader

    monkeypatch.setattr(loader, "load_config", lambda model=None: model_config)
    monkeypatch.setattr(loader, "load_tokenizer", lambda model=None: embedded_tokenizer)
    threads = torch.get_num_threads()
    cli.main(["bench", "overhead", "--requests", "1", "2", "--contexts", "20", "--pools", "50", "--steps", "2",
              "--pool-states", "fresh", "cached", "--out-dir", str(tmp_path), "--json", str(tmp_path / "o.json")])
    assert torch.get_num_threads() == threads  # the bench's 1 thread is undone
    assert "| cached | 50 | 2 | 20 |" in capsys.readouterr().out
    assert (tmp_path / "bench_overhead.md").read_text().count("\n| ") == 1 + 4  # the header and the rows
    assert (tmp_path / "bench_overhead.png").stat().st_size > 0
    report = json.loads((tmp_path / "o.json").read_text())
    assert report["threads"] == 1 and len(report["rows"]) == 4 and len(report["targets"]) == 3
