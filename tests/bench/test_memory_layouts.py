"""`bench memory --part layouts`: models mixing full and sliding layers hold what their layers read."""

from pagedserve.bench.memory_layouts import ideal_bytes, real_layouts, run_layouts_bench


def test_gemma3_at_32k_holds_about_five_times_the_requests_of_a_uniform_pool():
    gemma = next(layout for layout in real_layouts() if layout.name.startswith("Gemma-3"))
    (row,) = run_layouts_bench(16 << 30, (32768,), layouts=[gemma])
    assert row["groups"] == 31  # 52 sliding and 10 full layers: groups of 2
    assert row["resident"] >= 4.5 * row["uniform_resident"] > 0
    # within 5% of the ideal: full layers keep every token, sliding ones their window and a block
    assert abs(row["bytes_per_request"] / row["ideal_bytes_per_request"] - 1) < 0.05
    assert row["max_group_waste"] < 0.04


def test_a_model_of_one_kind_matches_the_uniform_pool():
    mistral = next(layout for layout in real_layouts() if layout.name.startswith("Mistral"))
    (row,) = run_layouts_bench(8 << 30, (2048,), layouts=[mistral])  # the window covers the context
    assert row["resident"] == row["uniform_resident"] > 0
    assert row["ideal_bytes_per_request"] == ideal_bytes(mistral, 2048 + 256, 16)
