import json

from pagedserve.bench.memory import ContiguousAllocator, PagedAllocator, TraceRequest, make_trace, run_memory_bench, simulate, write_outputs


def test_trace_is_seeded_and_within_bounds():
    a = make_trace(50, seed=3, min_len=16, max_len=256, max_tokens=128, rate=1.0)
    assert a == make_trace(50, seed=3, min_len=16, max_len=256, max_tokens=128, rate=1.0)
    assert a != make_trace(50, seed=4, min_len=16, max_len=256, max_tokens=128, rate=1.0)
    assert all(16 <= r.prompt_len <= 256 and 16 <= r.output_len <= r.max_tokens == 128 for r in a)
    assert [r.arrival_step for r in a] == sorted(r.arrival_step for r in a)


def test_contiguous_allocator_places_first_fit_and_merges_on_free():
    alloc = ContiguousAllocator(100, lambda r: 40)
    req = TraceRequest(0, 1, 1, 1)
    assert alloc.admit(0, req, 1) and alloc.admit(1, req, 1)
    assert not alloc.admit(2, req, 1)  # 20 slots left: external fragmentation in miniature
    alloc.free(0)
    alloc.free(1)
    assert alloc.free_ranges == [(0, 100)]
    assert alloc.reserved_slots() == 0


def test_paged_policy_preempts_under_pressure_and_frees_everything():
    trace = make_trace(60, seed=1, min_len=16, max_len=128, max_tokens=128, rate=5.0)
    alloc = PagedAllocator(budget_slots=1024, block_size=16)
    result = simulate("paged", trace, alloc, max_num_seqs=64)
    assert result.preemptions > 0
    assert alloc.manager.num_free_blocks == 1024 // 16
    assert max(result.reserved) <= 1024
    assert all(f <= r for f, r in zip(result.filled, result.reserved))


def test_paged_wastes_less_and_holds_more_requests_than_contiguous(tmp_path):
    setup, results = run_memory_bench(num_requests=200, kv_budget_tokens=16384, max_model_len=1024,
                                      max_len=512, max_tokens=512, arrival_rate=2.0, block_sizes=(1, 16))
    s = {r.name: r.summary(setup["kv_budget_tokens"]) for r in results}
    contiguous, paged1, paged16 = s["contiguous, max_model_len"], s["paged, block 1"], s["paged, block 16"]
    assert paged1["mean_waste"] == 0.0
    assert paged16["mean_waste"] < 0.05 < 0.5 < contiguous["mean_waste"]
    assert paged16["mean_resident"] > 2 * contiguous["mean_resident"]
    assert paged16["steps"] < contiguous["steps"]

    table = write_outputs(setup, results, str(tmp_path), str(tmp_path / "m.json"))
    assert "| paged, block 16 |" in table
    assert (tmp_path / "bench_memory.png").stat().st_size > 10_000
    assert "| paged, block 16 |" in (tmp_path / "bench_memory.md").read_text()
    figures = json.loads((tmp_path / "m.json").read_text())
    assert [r["policy"] for r in figures["results"]] == [r.name for r in results]
