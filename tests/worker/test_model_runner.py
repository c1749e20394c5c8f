"""The model runner: an fp8 KV cache on the embedded model (memory, accuracy, calibrated scales,
copy-on-write), the GPU memory budget arithmetic and the profiling pass that feeds it, and the
CUDA device it selects."""

from __future__ import annotations

import sys

import pytest
import torch

from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.model_runner import kv_budget_from_gpu_memory
from tests.engine.test_llm_engine import assert_all_free, generate_ids, make_llm, prompts  # noqa: F401

GiB = 2**30


def test_gpu_budget_is_what_the_utilization_leaves():
    # 80 GiB GPU, 10 GiB in use (weights, CUDA context, another process), 2 GiB of activations.
    assert kv_budget_from_gpu_memory(80 * GiB, 70 * GiB, 2 * GiB, 0.9) == int(72 * GiB) - 10 * GiB - 2 * GiB
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache.*gpu_memory_utilization"):
        kv_budget_from_gpu_memory(80 * GiB, 10 * GiB, 2 * GiB, 0.9)


def top_logprobs(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, temperature=0.0, logprobs=5), use_tqdm=False)
    return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("calibrate", [False, True])
def test_fp8_cache_quarters_kv_memory_and_stays_close(embedded_model, embedded_tokenizer, prompts, calibrate):
    budget = 64 << 20
    full = make_llm(embedded_model, embedded_tokenizer, num_kv_blocks=None, kv_cache_memory_bytes=budget)
    fp8 = make_llm(embedded_model, embedded_tokenizer, num_kv_blocks=None, kv_cache_memory_bytes=budget,
                   kv_cache_dtype="fp8", calculate_kv_scales=calibrate)
    caches = fp8.llm_engine.runner.kv_caches
    assert caches[0].k.dtype == caches[0].v.dtype == torch.float8_e4m3fn
    assert fp8.llm_engine.kv.pool.num_blocks == 4 * full.llm_engine.kv.pool.num_blocks  # 1 byte per element, not 4

    # fp8 keeps 3 mantissa bits: top-5 log-probabilities move by up to 0.41 (scales 1.0) and 0.45
    # (calibrated), as measured, so greedy picks can change where the top two are close. The first
    # token matched float32's (which test_llm_engine holds equal to transformers') for all 8 prompts
    # with scales 1.0 and for 7 calibrated; a changed pick must be a near-tie in the exact model.
    first = [ids[0] for ids in generate_ids(fp8, prompts, max_tokens=1)]
    exact_first = [ids[0] for ids in generate_ids(full, prompts, max_tokens=1)]
    assert sum(a == b for a, b in zip(first, exact_first)) >= 6
    for pick, exact, approx in zip(first, top_logprobs(full, prompts), top_logprobs(fp8, prompts)):
        common = exact.keys() & approx.keys()
        assert len(common) >= 3 and max(abs(exact[t] - approx[t]) for t in common) < 0.5
        assert pick in exact and max(exact.values()) - exact[pick] < 0.5

    scales = torch.stack([c.scales for c in caches])
    if calibrate:  # set once, by the first step: K and V differ in size, and layers differ
        assert (scales < 1).all() and scales[:, 0].unique().numel() > 1 and (scales[:, 0] != scales[:, 1]).all()
        generate_ids(fp8, prompts[:2])
        assert torch.equal(scales, torch.stack([c.scales for c in caches]))
    else:
        assert (scales == 1).all()
    assert_all_free(fp8)


def test_profiling_pass_runs_the_largest_step_and_frees_its_cache(tiny_checkpoint, monkeypatch):
    """measure_kv_budget's flow on the CPU, with torch.cuda's memory counters replaced by a fake
    GPU: 40 GiB total, 4 GiB in use; the forward's temporaries peak 1 GiB above the start. The
    arithmetic is the function tested above; what this checks is the pass itself."""
    from pagedserve.config import EngineConfig
    from pagedserve.worker.model_runner import ModelRunner
    from pagedserve.models.loader import load_model

    path, _ = tiny_checkpoint("llama")
    model, model_config = load_model(str(path))
    fake = {"allocated": 3 * GiB}
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: fake["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: fake["allocated"] + GiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (36 * GiB, 40 * GiB))
    steps = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, pos, caches, md: steps.append(
        (len(ids), len(caches[0].k), md.num_reqs)) or forward(ids, pos, caches, md))

    config = EngineConfig(device="cpu", max_num_batched_tokens=100, max_num_seqs=8, gpu_memory_utilization=0.5)
    runner = ModelRunner(model, model_config, config)
    budget = runner.measure_kv_budget(max_model_len=256)
    assert steps == [(100, 7, 1)]  # one prompt of max_num_batched_tokens, on ceil(100 / 16) blocks
    assert runner.kv_caches == []  # the throwaway cache is gone before the pool is sized
    assert budget == kv_budget_from_gpu_memory(40 * GiB, 36 * GiB, GiB, 0.5) == 20 * GiB - 4 * GiB - GiB
    # A shorter context: the same 100 tokens, as prompts of 40, 40 and 20 (3 + 3 + 2 blocks).
    assert runner.measure_kv_budget(max_model_len=40) and steps[-1] == (100, 8, 3)


def test_copy_on_write_copies_fp8_blocks_byte_for_byte(embedded_model):
    from pagedserve.config import EngineConfig
    from pagedserve.worker.model_runner import ModelRunner

    runner = ModelRunner(*embedded_model, EngineConfig(device="cpu", kv_cache_dtype="fp8"))
    runner.allocate_kv_cache(8)
    for cache in runner.kv_caches:
        cache.k.view(torch.uint8).random_(0, 256)
        cache.v.view(torch.uint8).random_(0, 256)
    runner.copy_blocks([(1, 5), (2, 6)])
    for cache in runner.kv_caches:
        for blocks in (cache.k.view(torch.uint8), cache.v.view(torch.uint8)):
            assert torch.equal(blocks[5], blocks[1]) and torch.equal(blocks[6], blocks[2])
            assert not torch.equal(blocks[5], blocks[2])


@pytest.mark.parametrize("device, selected", [("cuda", None), ("cuda:1", "cuda:1")])
def test_runner_selects_an_indexed_cuda_device_only(embedded_model, monkeypatch, device, selected):
    """Triton and graph capture run on the current device: an explicit index must become it; a bare
    "cuda" (what device="auto" gives) keeps the current one (set_device refuses it)."""
    from pagedserve.config import EngineConfig
    from pagedserve.worker.model_runner import ModelRunner

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(str(d)))
    ModelRunner(*embedded_model, EngineConfig(device=device, attention_backend="torch"))
    assert calls == ([selected] if selected else [])


def test_warm_up_step_is_prompts_of_at_most_512_tokens_over_the_first_blocks(tiny_checkpoint):
    from pagedserve.config import EngineConfig
    from pagedserve.worker.model_runner import ModelRunner
    from pagedserve.models.loader import load_model

    path, _ = tiny_checkpoint("llama")
    model, model_config = load_model(str(path))
    runner = ModelRunner(model, model_config, EngineConfig(device="cpu"))
    runner.allocate_kv_cache(80)
    inputs = runner.warm_up_inputs(1100, max_model_len=4096)
    assert inputs.num_new == [512, 512, 76] and inputs.num_computed == [0, 0, 0]
    assert inputs.input_ids == [0] * 1100 and inputs.logits_rows == [511, 1023, 1099] and inputs.block_copies == []
    assert inputs.block_tables.tolist() == [[list(range(0, 32)), list(range(32, 64)),  # one KV cache group
                                             list(range(64, 69)) + [0] * 27]]
    # A shorter context bounds the prompts (this model's is 256); a budget under one prompt is one prompt.
    assert runner.warm_up_inputs(250, max_model_len=100).num_new == [100, 100, 50]
    assert runner.run(runner.warm_up_inputs(300, max_model_len=256)).shape == (2, model_config.vocab_size)
    assert runner.warm_up_inputs(20, max_model_len=4096).block_tables.tolist() == [[[0, 1]]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_warm_up_faults_in_the_whole_pool_which_allocation_leaves_untouched(tiny_checkpoint):
    """Otherwise a server's steps stall each time its requests first reach a page of the pool."""
    from pagedserve.config import EngineConfig
    from pagedserve.worker.model_runner import ModelRunner
    from pagedserve.models.loader import load_model
    from tests.test_hugepages import resident_kib

    path, _ = tiny_checkpoint("llama")
    model, model_config = load_model(str(path))
    runner = ModelRunner(model, model_config, EngineConfig(device="cpu"))
    runner.allocate_kv_cache(4096)  # several MiB per tensor: each its own mapping (hugepages.zeros)
    tensors = [t for cache in runner.kv_caches for t in (cache.k, cache.v)]
    kib = tensors[0].numel() * tensors[0].element_size() >> 10
    assert kib >= 4096 and all(resident_kib(t.data_ptr()) < kib // 2 for t in tensors)
    runner.warm_up(64, max_model_len=256)
    assert all(resident_kib(t.data_ptr()) >= kib for t in tensors)


def test_warm_up_leaves_the_fp8_scales_to_the_first_real_step(embedded_model, embedded_tokenizer):
    llm = make_llm(embedded_model, embedded_tokenizer, kv_cache_dtype="fp8", calculate_kv_scales=True,
                   max_num_batched_tokens=64)
    llm.llm_engine.core.warm_up()
    assert llm.llm_engine.runner.calibrate_kv_scales
