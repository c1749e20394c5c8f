"""The Triton backend (attention/triton_paged.py) under Triton's interpreter (TRITON_INTERPRET=1,
set in conftest.py), against the oracle: decodes and prompts in one flat batch, over shuffled
block tables; head sizes 64, 80 and 128; cache blocks of 8, 16 and 32; GQA groups 1, 3 and 8;
contexts of one token, whole blocks and part blocks; a chunk behind a prefix-cache hit; windows;
sinks (split decode's included). Small shapes: the interpreter runs programs one after another."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention import get_backend, torch_ref, triton_paged
from pagedserve.config import EngineConfig


def mixed_step(block_size, kv_heads, group, dim, dtype=torch.float32, seed=0, backend="triton"):
    """Decodes at contexts 1, 2 blocks, 2 blocks + 3; a fresh 5-token prompt; a 7-token chunk
    behind 2 cached blocks (a prefix-cache hit)."""
    reqs = [(0, 1), (2 * block_size - 1, 1), (2 * block_size + 2, 1), (0, 5), (2 * block_size, 7)]
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // block_size) for c, n in reqs]
    perm = torch.randperm(sum(needed) + 3, generator=gen).tolist()
    tables = [perm[sum(needed[:i]):sum(needed[:i + 1])] for i in range(len(reqs))]
    shape = (len(perm), block_size, kv_heads, dim)
    k_cache, v_cache = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    num_tokens = sum(n for _, n in reqs)
    q = torch.randn(num_tokens, kv_heads * group, dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, kv_heads, dim, generator=gen).to(dtype)
    md = get_backend(backend).build_metadata(tables, [c for c, _ in reqs], [n for _, n in reqs], block_size)
    return q, k, v, k_cache, v_cache, md


@pytest.mark.parametrize("block_size, kv_heads, group, dim", [
    (16, 3, 3, 64), (8, 2, 1, 80), (32, 1, 8, 128), (8, 1, 3, 64), (32, 2, 1, 80), (16, 1, 8, 128),
])
@pytest.mark.parametrize("window", [None, 6])
def test_mixed_step_matches_the_oracle(block_size, kv_heads, group, dim, window):
    q, k, v, k_cache, v_cache, md = mixed_step(block_size, kv_heads, group, dim)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    out = triton_paged.paged_attention(q, k, v, k_cache, v_cache, md, dim**-0.5, window)
    expected = torch_ref.paged_attention(q, k, v, ref_k, ref_v, md, dim**-0.5, window)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # the KV write kernel
    assert (out - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 1e-2), (torch.bfloat16, 4e-2)])
@pytest.mark.parametrize("block_size", [8, 16])  # broadcast products / tl.dot in 16 bits
def test_half_precision_cache(dtype, tolerance, block_size):
    q, k, v, k_cache, v_cache, md = mixed_step(block_size, 2, 3, 64, dtype=dtype)
    out = triton_paged.paged_attention(q, k, v, k_cache, v_cache, md, 0.125)
    expected = torch_ref.paged_attention(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), md, 0.125)
    assert out.dtype == dtype
    assert (out.float() - expected).abs().max().item() < tolerance


def sinks_for(heads: int) -> torch.Tensor:
    """Sink logits of both signs, one far above every score and one far below."""
    sinks = torch.linspace(-4, 4, heads)
    sinks[0], sinks[-1] = -30.0, 30.0
    return sinks


@pytest.mark.parametrize("block_size, kv_heads, group, dim", [
    (16, 3, 3, 64), (8, 2, 1, 80), (32, 1, 8, 128), (16, 2, 2, 256),
])
@pytest.mark.parametrize("window", [None, 6])
def test_sinks_match_the_oracle(block_size, kv_heads, group, dim, window):
    q, k, v, k_cache, v_cache, md = mixed_step(block_size, kv_heads, group, dim, seed=1)
    q *= 3  # scores that reach past some sinks and stay below others
    sinks = sinks_for(kv_heads * group)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    out = triton_paged.paged_attention(q, k, v, k_cache, v_cache, md, dim**-0.5, window, sinks=sinks)
    expected = torch_ref.paged_attention(q, k, v, ref_k, ref_v, md, dim**-0.5, window, sinks=sinks)
    assert (out - expected).abs().max().item() < 1e-4
    plain = torch_ref.paged_attention(q, k, v, ref_k.clone(), ref_v.clone(), md, dim**-0.5, window)
    assert (plain - expected).abs().max().item() > 0.1  # the sinks took mass
    assert expected[:, -1].abs().max().item() < 1e-3  # the sink far above: (nearly) nothing of V


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 1e-2), (torch.bfloat16, 4e-2)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_half_precision_with_sinks(dtype, tolerance, block_size):
    q, k, v, k_cache, v_cache, md = mixed_step(block_size, 2, 3, 64, dtype=dtype)
    sinks = sinks_for(6)
    out = triton_paged.paged_attention(q, k, v, k_cache, v_cache, md, 0.125, 6, sinks=sinks)
    expected = torch_ref.paged_attention(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), md, 0.125,
                                         6, sinks=sinks)
    assert out.dtype == dtype
    assert (out.float() - expected).abs().max().item() < tolerance


def test_sinks_must_be_one_per_query_head():
    q, k, v, k_cache, v_cache, md = mixed_step(16, 2, 3, 64)
    with pytest.raises(ValueError, match=r"one logit per query head \(6\), got shape \(2,\)"):
        triton_paged.paged_attention(q, k, v, k_cache, v_cache, md, 0.125, sinks=torch.zeros(2))


def test_padded_slots_are_not_written():
    q, k, v, k_cache, v_cache, md = mixed_step(16, 1, 1, 64)
    before = k_cache.clone()
    md.slot_mapping[:] = -1
    triton_paged._write_kv[(q.shape[0],)](k, v, k_cache, v_cache, md.slot_mapping, torch.ones(2), ROW=64, ROW_PAD=64,
                                          FP8=False)
    assert torch.equal(k_cache, before)


def test_without_a_gpu_or_the_interpreter_the_choice_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA GPUs, or on the CPU under Triton's interpreter"):
        get_backend("triton", torch.device("cpu"), torch.float32)  # the backend checks what it can run
    assert EngineConfig(device="cpu").attention_backend == "torch"  # auto: torch on CPU


@pytest.mark.parametrize("sinks", [None, sinks_for(6)])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("max_parts", [64, 2])
def test_split_decode_matches_the_oracle(monkeypatch, window, max_parts, sinks):
    # Parts of 32 tokens (2 blocks): the mixed step's longest decode (3 blocks) spans 2 parts, the
    # shortest 1 (its other part sees no key); with the window, leading parts see none either (part
    # 0, which holds the sinks, among them). The 8-block table of `longer` makes 4 parts, or 2 of
    # 4 blocks when at most 2 are allowed.
    monkeypatch.setattr(triton_paged, "PARTITION_TOKENS", 32)
    monkeypatch.setattr(triton_paged, "MAX_PARTS", max_parts)
    monkeypatch.setattr(triton_paged, "SPLIT_BELOW_PROGRAMS", 1000)
    merges = []

    class CountingCombine:  # proves the split path ran: records each merge's number of parts
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                merges.append(kwargs["NUM_PARTS"])
                return combine[grid](*args, **kwargs)
            return launch

    combine = triton_paged._combine
    monkeypatch.setattr(triton_paged, "_combine", CountingCombine())
    q, k, v, k_cache, v_cache, md = mixed_step(16, 2, 3, 64)
    longer = get_backend("triton").build_metadata([list(range(40))[:8], list(range(40))[8:10]], [120, 17], [1, 1], 16)
    for metadata in (md, longer):
        qs, ks, vs = q[:metadata.num_tokens], k[:metadata.num_tokens], v[:metadata.num_tokens]
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        out = triton_paged.paged_attention(qs, ks, vs, k_cache, v_cache, metadata, 0.125, window, sinks=sinks)
        expected = torch_ref.paged_attention(qs, ks, vs, ref_k, ref_v, metadata, 0.125, window, sinks=sinks)
        assert (out - expected).abs().max().item() < 1e-4
    assert merges == [2, 4 if max_parts == 64 else 2]
