"""The model runner's KV pool: an fp8 cache on the embedded model (memory, accuracy, calibrated
scales), the GPU memory budget arithmetic, and the CUDA-graph decode path run eagerly with padding."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.model_runner import kv_budget_from_gpu_memory
from pagedserve.sampling_params import SamplingParams
from tests.engine.test_llm_engine import assert_all_free, generate_ids, make_llm, prompts, reference  # noqa: F401

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


@pytest.mark.parametrize("calibrate", [False, True])
def test_fp8_cache_quarters_kv_memory_and_stays_close(embedded_model, embedded_tokenizer, prompts, reference, calibrate):
    budget = 64 << 20
    full = make_llm(embedded_model, embedded_tokenizer, num_kv_blocks=None, kv_cache_memory_bytes=budget)
    fp8 = make_llm(embedded_model, embedded_tokenizer, num_kv_blocks=None, kv_cache_memory_bytes=budget,
                   kv_cache_dtype="fp8", calculate_kv_scales=calibrate)
    caches = fp8.llm_engine.runner.kv_caches
    assert caches[0].k.dtype == caches[0].v.dtype == torch.float8_e4m3fn
    assert fp8.llm_engine.kv.pool.num_blocks == 4 * full.llm_engine.kv.pool.num_blocks  # 1 byte per element, not 4

    # fp8 keeps 3 mantissa bits: top-5 log-probabilities move by up to 0.3 (measured), so greedy
    # picks can change where the top two are close. The first token matched transformers' for all 8
    # prompts with scales 1.0 and for 7 calibrated; a changed pick must be a near-tie in the exact model.
    first = [ids[0] for ids in generate_ids(fp8, prompts, max_tokens=1)]
    assert sum(a == b[0] for a, b in zip(first, reference)) >= 6
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
