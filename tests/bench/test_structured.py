"""The structured-output bench's machinery: the free run computes exactly the constrained run's
tokens, the constrained outputs parse, and the table reports the ratio. (No timing is asserted.)"""

import pytest

from pagedserve.bench.structured import format_table, run_structured_bench


@pytest.mark.slow
def test_both_runs_compute_the_same_tokens(embedded_model, embedded_tokenizer):
    report = run_structured_bench(num_requests=3, max_tokens=160, model=embedded_model, tokenizer=embedded_tokenizer)
    assert report["valid_json"] == 3 and report["finished_by_length"] == 0
    assert report["json"]["steps"] > 0 and report["free"]["steps"] > 0
    assert report["ratio"] == report["json"]["output_tps"] / report["free"]["output_tps"]
    assert "JSON-schema throughput" in format_table(report)
