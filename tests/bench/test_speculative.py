"""The speculative-decoding bench's machinery on a tiny model: the rows compare each method with
speculation off on the same prompts, count the outputs that match, and the report shows them. (No
timing is asserted.)"""

import json

import pytest

from pagedserve.bench.speculative import (NGRAM, SUFFIX, compare, cost_curve, markdown_table, plot,
                                          small_batch_row_cost, weight_bound_until)
from pagedserve.bench.workload import COPY_TEXTS, Workload, WorkloadRequest, copy_edit
from pagedserve.models.loader import load_model


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint, embedded_tokenizer):
    path, _ = tiny_checkpoint("llama")
    return load_model(str(path)), embedded_tokenizer


def repetitive(num_requests=3, output_len=10) -> Workload:
    """Prompts that repeat a phrase, so the n-gram proposer finds matches to draft from."""
    return Workload("repetitive", [WorkloadRequest([3 + i, 40, 41, 42, 43] * 6, output_len) for i in range(num_requests)])


ENGINE = {"num_kv_blocks": 64, "max_model_len": 256, "enable_prefix_caching": False}


def test_batch_one_rows_match_the_baseline_and_report_acceptance(tiny, tmp_path):
    model, tokenizer = tiny
    workload = repetitive()
    rows = compare("batch 1, repetitive", workload, {"off": None, "ngram": NGRAM, "suffix": SUFFIX}, model,
                   tokenizer, reps=2, batch=1, engine_kwargs=ENGINE, log=lambda *_: None)
    assert [r.method for r in rows] == ["off", "ngram", "suffix"]
    off, ngram, suffix = rows
    assert all(len(r.speeds) == 2 and r.unit == "decode tok/s" for r in rows)
    assert ngram.identical == suffix.identical == (3, 3)
    assert len(ngram.ratios) == 2 and off.ratios == [1.0, 1.0]
    assert off.acceptance is None and off.tokens_per_step == pytest.approx(1.0)
    # The repeated phrase gives the n-gram proposer drafts, so some steps verify them.
    assert ngram.acceptance is not None and 0.0 <= ngram.acceptance <= 1.0
    assert ngram.tokens_per_step >= 1.0
    report = {"rows": [dict(vars(r), speed=r.speed, ratio=r.ratio) for r in rows], "all_identical": True}
    table = markdown_table(report)
    assert "| batch 1, repetitive | ngram |" in table and "| 3/3 |" in table and "decode tok/s" in table
    assert "identical with and without speculation: yes" in table
    json.dumps(report)  # the --json report is plain data
    plot(report, str(tmp_path / "spec.png"))
    assert (tmp_path / "spec.png").stat().st_size > 5000


def test_batch_rows_time_the_whole_workload(tiny):
    model, tokenizer = tiny
    rows = compare("batch 4", repetitive(6), {"off": None, "ngram": NGRAM}, model, tokenizer, reps=1, batch=4,
                   engine_kwargs=ENGINE, log=lambda *_: None)
    assert [r.unit for r in rows] == ["output tok/s"] * 2
    assert rows[1].identical == (6, 6)


def test_a_method_the_engine_refuses_is_reported_not_faked(tiny):
    model, tokenizer = tiny
    missing = {"method": "draft_model", "model": "/nonexistent/draft.gguf", "num_speculative_tokens": 2}
    rows = compare("batch 1", repetitive(1, 4), {"off": None, "draft": missing}, model, tokenizer, reps=1, batch=1,
                   engine_kwargs=ENGINE, log=lambda *_: None)
    assert rows[1].skipped.startswith("not available") and not rows[1].speeds
    assert rows[0].skipped and not rows[0].speeds  # a baseline alone is not timed
    table = markdown_table({"rows": [dict(vars(r), speed=r.speed if r.speeds else None, ratio=r.ratio)
                                     for r in rows], "all_identical": True})
    assert "| batch 1 | draft | - |" in table


def test_a_mismatch_is_reported():
    row = {"part": "p", "method": "ngram", "unit": "decode tok/s", "speeds": [1.0], "ratios": [1.0], "speed": 1.0,
           "ratio": 1.0, "acceptance": 0.5, "tokens_per_step": 1.5, "identical": (1, 2), "skipped": None}
    table = markdown_table({"rows": [row], "all_identical": False})
    assert "| 1/2 |" in table and "NO" in table


def test_cost_curve_is_relative_to_one_row(tiny):
    model, tokenizer = tiny
    curve = cost_curve(model, tokenizer, rows=(1, 2, 4), steps=2, prompt_len=8, vocab=range(3, 120), log=lambda *_: None)
    assert [p["rows"] for p in curve] == [1, 2, 4]
    assert curve[0]["relative"] == 1.0 and curve[0]["marginal"] is None
    for prev, p in zip(curve, curve[1:]):
        assert p["marginal"] == pytest.approx((p["step_s"] - prev["step_s"]) / (p["rows"] - prev["rows"]) / curve[0]["step_s"])
    table = markdown_table({"rows": [], "cost_curve": curve})
    assert "| 4 |" in table and "DRAFT_ROW_COST" in table


def test_weight_bound_and_row_cost_read_the_curve():
    curve = [{"rows": r, "relative": rel, "marginal": m} for r, rel, m in
             [(1, 1.0, None), (2, 1.1, 0.1), (4, 1.3, 0.1), (8, 2.5, 0.3), (16, 5.0, 0.31)]]
    assert weight_bound_until(curve) == 4
    assert small_batch_row_cost(curve) == pytest.approx((0.1 + 0.1 + 0.3) / 3)


def test_copy_edit_prompts_hold_their_texts_and_end_freely(embedded_tokenizer):
    a, b = copy_edit(embedded_tokenizer, 10, seed=3), copy_edit(embedded_tokenizer, 10, seed=3)
    assert a == b and a != copy_edit(embedded_tokenizer, 10, seed=4)
    assert all(not r.ignore_eos and r.output_len == 256 for r in a.requests)
    prompts = [embedded_tokenizer.decode(r.prompt_token_ids) for r in a.requests]
    assert all(p.rstrip().endswith("assistant") for p in prompts)  # the chat template's generation prompt
    # Every text appears (the code ones verbatim; prose may carry the typos asked to be corrected).
    for text in COPY_TEXTS:
        assert any(text.split()[0] in p and text.split()[-1] in p for p in prompts)
