"""`pagedserve bench routing`: the table it prints, and one small run end to
end on a local Ray instance of its own (the embedded model, Ray Serve LLM's router; test_ray_app
runs Ray Serve's default and pagedserve's)."""

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


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_a_small_run_end_to_end():
    # Ray Serve LLM's router alone: test_ray_app runs the default and pagedserve's routers on the
    # same machinery, and each router here costs a deployment of two replicas (about 20 s).
    (row,) = run_routing_bench(routers=("prefix-cache-affinity",), num_prompts=2, prompt_len=64,
                               requests_per_prompt=4, concurrency=2)
    assert row["router"] == "prefix-cache-affinity" and row["seconds"] > 0
    assert len(row["requests_per_replica"]) == 2 and sum(row["requests_per_replica"]) >= 8
    # Each prompt's first request misses; what can hit is 6 x 64 of 8 x 80 prompt tokens.
    assert 0 < row["hit_rate"] <= 6 * 64 / (8 * 80)
