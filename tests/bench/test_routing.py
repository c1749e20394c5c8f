"""`pagedserve bench routing`: the table it prints, and one small run end to
end on a local Ray instance of its own (the embedded model; Ray Serve LLM's router and pagedserve's,
as test_ray_app runs Ray Serve's default)."""

from __future__ import annotations

import pytest

from pagedserve.bench.routing import format_table, run_routing_bench


def test_the_table_gives_each_router_its_mean_spread_and_ratio_to_the_default():
    rows = [{"router": "default", "hit_rate": 0.4, "requests_per_replica": [30, 34], "workload": "w"},
            {"router": "prefix-aware", "hit_rate": 0.9, "requests_per_replica": [32, 32], "workload": "w"},
            {"router": "default", "hit_rate": 0.6, "requests_per_replica": [31, 33], "workload": "w"},
            {"router": "prefix-aware", "hit_rate": 0.9, "requests_per_replica": [32, 32], "workload": "w"}]
    table = format_table(rows)
    assert "| default | 50.0% | 40.0% / 60.0% | 1.00x | 30:34; 31:33 |" in table
    assert "| prefix-aware | 90.0% | 90.0% / 90.0% | 1.80x | 32:32; 32:32 |" in table
    assert "2 run(s) per router" in table


@pytest.mark.timeout(600)
def test_a_small_run_end_to_end():
    rows = run_routing_bench(routers=("prefix-cache-affinity", "prefix-aware"), num_prompts=2, prompt_len=64,
                             requests_per_prompt=4, concurrency=2)
    assert [r["router"] for r in rows] == ["prefix-cache-affinity", "prefix-aware"]
    for r in rows:
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["seconds"] > 0
        assert len(r["requests_per_replica"]) == 2 and sum(r["requests_per_replica"]) >= 8
    # Each prompt's first request misses; what can hit is 6 x 64 of 8 x 80 prompt tokens.
    assert rows[1]["hit_rate"] <= 6 * 64 / (8 * 80)
    assert rows[1]["hit_rate"] > 0
