"""Blocks leave the pool and come back in the tier's layout: one row per block, its K then V of
layer 0, then layer 1, ..., byte for byte, in every cache dtype."""

import pytest
import torch

from pagedserve.attention.kv_cache import allocate_kv_cache
from pagedserve.offload.transfer import block_bytes, gather_blocks, scatter_blocks

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 3, 6, 4, 2, 8


def filled(dtype):
    caches = allocate_kv_cache(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM, dtype)
    g = torch.Generator().manual_seed(0)
    for cache in caches:
        for t in (cache.k, cache.v):
            t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    return caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_gather_lays_each_block_out_layer_by_layer_and_scatter_puts_it_back(dtype):
    caches = filled(dtype)
    per_tensor = BLOCK_SIZE * HEADS * DIM * dtype.itemsize
    assert block_bytes(caches) == 2 * LAYERS * per_tensor
    rows = gather_blocks(caches, [4, 1])
    assert rows.shape == (2, block_bytes(caches)) and rows.dtype == torch.uint8
    # The reference: each block's tensors' bytes, concatenated in order, taken apart by hand.
    for row, block in zip(rows, [4, 1]):
        expected = b"".join(bytes(t[block].contiguous().view(torch.uint8).flatten().tolist())
                            for cache in caches for t in (cache.k, cache.v))
        assert bytes(row.tolist()) == expected
    target = allocate_kv_cache(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM, dtype)
    scatter_blocks(target, [0, 5], list(rows))
    for src, dst in zip(caches, target):
        for a, b in ((src.k, dst.k), (src.v, dst.v)):
            assert torch.equal(a[4].view(torch.uint8), b[0].view(torch.uint8))
            assert torch.equal(a[1].view(torch.uint8), b[5].view(torch.uint8))
            assert not b[1:5].view(torch.uint8).any()  # nothing else written
