"""Blocks between the pool and the KV tier, in the tier's layout.

The pool is layer-major (each layer's K and V is one tensor of blocks: what the attention kernels
index). The tier's unit is one block across every layer, contiguous, so that a block is one file
and one read: [layers, K|V, block's bytes in one layer]. The change of layout happens here, for a
batch of blocks at once: 2 x layers strided copies per batch, however many blocks it holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pagedserve.attention.kv_cache import KVCache


def _rows(cache: Tensor) -> Tensor:
    """A layer's K or V as [num_blocks, the block's bytes] (uint8): the same memory."""
    return cache.view(torch.uint8).view(cache.shape[0], -1)


def block_bytes(kv_caches: Sequence[KVCache]) -> int:
    """Bytes of one block in the tier's layout: its K and V in every layer."""
    return sum(_rows(t).shape[1] for cache in kv_caches for t in (cache.k, cache.v))


def gather_blocks(kv_caches: Sequence[KVCache], block_ids: Sequence[int]) -> Tensor:
    """The blocks' K/V as [len(block_ids), block_bytes] uint8 on the CPU, one row per block, each
    row [layer 0 K, layer 0 V, layer 1 K, ...]."""
    device = kv_caches[0].k.device
    ids = torch.tensor(block_ids, dtype=torch.long, device=device)
    parts = [_rows(t) for cache in kv_caches for t in (cache.k, cache.v)]
    out = torch.empty(len(block_ids), sum(p.shape[1] for p in parts), dtype=torch.uint8)
    start = 0
    for part in parts:
        width = part.shape[1]
        out[:, start : start + width].copy_(part.index_select(0, ids))
        start += width
    return out


def scatter_blocks(kv_caches: Sequence[KVCache], block_ids: Sequence[int], payloads: Sequence[Tensor]) -> None:
    """Write each payload (a row as `gather_blocks` makes it) into its block, in every layer."""
    device = kv_caches[0].k.device
    ids = torch.tensor(block_ids, dtype=torch.long, device=device)
    data = torch.stack(list(payloads)).to(device)
    start = 0
    for cache in kv_caches:
        for t in (cache.k, cache.v):
            rows = _rows(t)
            width = rows.shape[1]
            rows.index_copy_(0, ids, data[:, start : start + width])
            start += width
