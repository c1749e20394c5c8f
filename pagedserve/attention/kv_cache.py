"""The KV cache's layout, shared by every attention backend and the model runner.

Each layer has a K and a V tensor of [num_blocks, block_size, num_kv_heads, head_dim] and two
float32 scales. A token at logical position t of a request lives in block
block_table[t // block_size], at offset t % block_size; flattened, that row is slot
block * block_size + offset. An fp8 cache holds K/V divided by the layer's scales (`kv_quant`)
and is read times them.

torch has no CPU index_copy_ for fp8 (2.13), so writes, gathers and copies index a byte view of
an fp8 cache (`kv_quant.as_bytes`): the same memory, indexable on every device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from pagedserve import hugepages
from pagedserve.attention.kv_quant import as_bytes, dequantize, is_fp8, quantize
from pagedserve.kv.sizes import kv_bytes_per_token
from pagedserve.ops import fused_cpu


class KVCache(NamedTuple):
    """One layer's cache."""

    k: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v: Tensor
    scales: Tensor  # [2] float32: K's and V's scale, read only by an fp8 cache


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[KVCache]:
    """One KVCache per layer, K and V each [num_blocks, block_size, num_kv_heads, head_dim] of
    `dtype` (the cache's element type: the model's, or kv_quant.FP8_DTYPE), scales 1.0.

    Zero-filled: a slot nobody wrote is masked out, but 0 * NaN would still leak garbage into the
    probability-weighted sum of V.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def zeros() -> Tensor:  # on CPU in 2 MiB pages where the OS allows (hugepages.py says why)
        return hugepages.zeros(shape, dtype) if torch.device(device).type == "cpu" else \
            torch.zeros(shape, dtype=dtype, device=device)

    return [KVCache(zeros(), zeros(), torch.ones(2, dtype=torch.float32, device=device)) for _ in range(num_layers)]


def num_blocks_for_bytes(
    budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """How many blocks allocate_kv_cache can make within budget_bytes (K and V, all layers)."""
    per_block = block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype.itemsize)
    return budget_bytes // per_block


def unit_scales(kv_scales: Tensor | None, device: torch.device) -> Tensor:
    """The layer's scales, or 1.0 for K and V when none are given."""
    return kv_scales if kv_scales is not None else torch.ones(2, dtype=torch.float32, device=device)


def store_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor, kv_scales: Tensor) -> None:
    """Write each new token's K/V row into its slot (an fp8 cache: divided by the scale)."""
    for cache, x, scale in ((k_cache, k, kv_scales[0]), (v_cache, v, kv_scales[1])):
        if is_fp8(cache):
            x = quantize(x, scale)
        slots = cache.view(-1, *cache.shape[2:])
        rows_whole = x[0:1].is_contiguous() and slot_mapping.is_contiguous()
        if fused_cpu.available(x) and x.dtype == cache.dtype and rows_whole:
            fused_cpu.scatter_rows_(slots, slot_mapping, x)  # one C call (ops/csrc/fused_ops.c)
        else:
            as_bytes(slots).index_copy_(0, slot_mapping, as_bytes(x))


def gather_blocks(cache: Tensor, block_ids: Tensor, dtype: torch.dtype, scale: Tensor) -> Tensor:
    """cache[block_ids] (any shape of ids) as `dtype` (an fp8 cache: times the scale)."""
    rows = as_bytes(cache).index_select(0, block_ids.flatten())
    return dequantize(rows.view(cache.dtype).view(*block_ids.shape, *cache.shape[1:]), dtype, scale)


def copy_blocks(kv_caches: Sequence[KVCache], copies: Sequence[tuple[int, int]]) -> None:
    """Copy-on-write: give each (source, destination) pair's destination block its source's K/V,
    in every layer, byte for byte."""
    if not copies or not kv_caches:
        return
    device = kv_caches[0].k.device
    src = torch.tensor([s for s, _ in copies], device=device)
    dst = torch.tensor([d for _, d in copies], device=device)
    for cache in kv_caches:
        for blocks in (cache.k, cache.v):
            blocks = as_bytes(blocks)
            blocks[dst] = blocks[src]
