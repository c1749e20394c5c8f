"""The KV cache layout (attention/kv_cache.py): allocation and its budget, slot writes and block
gathers (fp8 included), copy-on-write block copies."""

from __future__ import annotations

import torch

from pagedserve.attention.kv_cache import allocate_kv_cache, copy_blocks, gather_blocks, num_blocks_for_bytes, store_kv
from pagedserve.attention.kv_quant import FP8_DTYPE, dequantize, quantize


def test_allocate_and_budget():
    caches = allocate_kv_cache(3, 10, 16, 2, 8, torch.float32, "cpu")
    assert len(caches) == 3
    for k, v, scales in caches:
        assert k.shape == v.shape == (10, 16, 2, 8) and k.data_ptr() != v.data_ptr()
        assert not k.any() and not v.any()
        assert scales.tolist() == [1.0, 1.0]
    per_block = 2 * 3 * 16 * 2 * 8 * 4
    assert num_blocks_for_bytes(10 * per_block, 3, 16, 2, 8, torch.float32) == 10
    assert num_blocks_for_bytes(10 * per_block - 1, 3, 16, 2, 8, torch.float32) == 9
    assert num_blocks_for_bytes(10 * per_block, 3, 16, 2, 8, torch.bfloat16) == 20
    assert num_blocks_for_bytes(10 * per_block, 3, 16, 2, 8, torch.float8_e4m3fn) == 40


def test_store_then_gather_through_slots():
    [(k_cache, v_cache, _)] = allocate_kv_cache(1, 6, 4, 2, 8, FP8_DTYPE)
    scales = torch.tensor([0.5, 0.25])
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    store_kv(k_cache, v_cache, k, v, torch.tensor([5, 6, 22]), scales)  # block 1 offsets 1 and 2, block 5 offset 2
    keys = gather_blocks(k_cache, torch.tensor([1, 5]), torch.float32, scales[0])
    assert keys.shape == (2, 4, 2, 8)
    assert torch.equal(keys[0, 1], dequantize(quantize(k[0], scales[0]), torch.float32, scales[0]))
    assert torch.equal(keys[1, 2], dequantize(quantize(k[2], scales[0]), torch.float32, scales[0]))
    values = gather_blocks(v_cache, torch.tensor([[1]]), torch.float32, scales[1])
    assert torch.equal(values[0, 0, 2], dequantize(quantize(v[1], scales[1]), torch.float32, scales[1]))
    assert not keys[0, 0].any()  # never written


def test_copy_blocks_copies_every_layer():
    caches = allocate_kv_cache(2, 4, 2, 1, 4, torch.float32)
    for cache in caches:
        cache.k.normal_()
        cache.v.normal_()
    before = [(c.k.clone(), c.v.clone()) for c in caches]
    copy_blocks(caches, [(0, 3), (1, 2)])
    for cache, (k, v) in zip(caches, before):
        assert torch.equal(cache.k[3], k[0]) and torch.equal(cache.k[2], k[1])
        assert torch.equal(cache.v[3], v[0]) and torch.equal(cache.v[2], v[1])
        assert torch.equal(cache.k[:2], k[:2]) and torch.equal(cache.v[:2], v[:2])  # sources untouched
    copy_blocks(caches, [])  # nothing to copy: nothing happens
