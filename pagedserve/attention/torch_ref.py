"""Paged attention in plain PyTorch: the reference every faster backend is tested against.

K/V live in per-layer tensors [num_blocks, block_size, num_kv_heads, head_dim]; a request's
context is read through its block table, so where its blocks sit in the pool never changes the
result. An fp8 cache holds K/V divided by its layer's scales (`kv_quant`); reads multiply back.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.attention.kv_quant import as_bytes, dequantize, is_fp8, quantize
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.kv.sizes import cdiv, kv_bytes_per_token


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
    return [
        KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                torch.ones(2, dtype=torch.float32, device=device))
        for _ in range(num_layers)
    ]


def num_blocks_for_bytes(
    budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """How many blocks allocate_kv_cache can make within budget_bytes (K and V, all layers)."""
    per_block = block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype.itemsize)
    return budget_bytes // per_block


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    kv_scales: Tensor | None = None,
) -> Tensor:
    """Store this step's K/V in their slots, then attend for every request over its whole context.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim]. A token at context position p sees positions
    p - sliding_window < j <= p (all j <= p without a window). kv_scales: the layer's
    KVCache.scales, used by an fp8 cache (default 1.0).
    """
    kv_scales = unit_scales(kv_scales, q.device)
    store_kv(k_cache, v_cache, k, v, md.slot_mapping, kv_scales)
    out = torch.empty_like(q)

    if md.num_decodes:
        # Hot path: one gather for all single-token requests, padded to the longest of them.
        tables = md.decode_block_tables
        keys = gather_blocks(k_cache, tables, q.dtype, kv_scales[0]).flatten(1, 2)  # [decodes, keys, kv_heads, dim]
        values = gather_blocks(v_cache, tables, q.dtype, kv_scales[1]).flatten(1, 2)
        query_pos = (md.decode_seq_lens - 1)[:, None, None]  # [decodes, 1 query, 1]
        mask = visible(query_pos, keys.shape[1], sliding_window)
        dq = q.index_select(0, md.decode_token_indices).unsqueeze(1)
        out.index_copy_(0, md.decode_token_indices, attend(dq, keys, values, mask, scale).squeeze(1))

    qsl, block_size = md.query_start_loc_cpu, md.block_size
    for i in md.prefill_req_indices:
        start, end, seq_len = qsl[i], qsl[i + 1], md.seq_lens_cpu[i]
        table = md.block_tables[i, : cdiv(seq_len, block_size)]
        keys = gather_blocks(k_cache, table, q.dtype, kv_scales[0]).flatten(0, 1)[:seq_len]
        values = gather_blocks(v_cache, table, q.dtype, kv_scales[1]).flatten(0, 1)[:seq_len]
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device).unsqueeze(1)
        mask = visible(query_pos, seq_len, sliding_window)
        out[start:end] = attend(q[None, start:end], keys[None], values[None], mask[None], scale)[0]
    return out


def unit_scales(kv_scales: Tensor | None, device: torch.device) -> Tensor:
    return kv_scales if kv_scales is not None else torch.ones(2, dtype=torch.float32, device=device)


def store_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor, kv_scales: Tensor) -> None:
    """Write each new token's K/V row into its slot (an fp8 cache: divided by the scale)."""
    for cache, x, scale in ((k_cache, k, kv_scales[0]), (v_cache, v, kv_scales[1])):
        if is_fp8(cache):
            x = quantize(x, scale)
        as_bytes(cache).view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, as_bytes(x))


def gather_blocks(cache: Tensor, block_ids: Tensor, dtype: torch.dtype, scale: Tensor) -> Tensor:
    """cache[block_ids] (any shape of ids) as `dtype` (an fp8 cache: times the scale)."""
    rows = as_bytes(cache).index_select(0, block_ids.flatten())
    return dequantize(rows.view(cache.dtype).view(*block_ids.shape, *cache.shape[1:]), dtype, scale)


def visible(query_pos: Tensor, num_keys: int, sliding_window: int | None) -> Tensor:
    """[..., num_queries, num_keys] bool: which key positions each query position may see."""
    key_pos = torch.arange(num_keys, device=query_pos.device)
    mask = key_pos <= query_pos  # causal; also hides padding past each request's end
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Softmax attention with grouped KV heads, in transformers' eager order of operations
    (scale after q @ k^T, softmax in float32).

    q: [batch, queries, heads, dim]; k, v: [batch, keys, kv_heads, dim]; mask: [batch, queries, keys].
    Query head h reads KV head h // group. The group's heads are folded into the query rows, so
    one matmul per KV head serves them all without copying K and V for each query head.
    """
    batch, num_q, num_heads, dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    q = q.view(batch, num_q, num_kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, -1, dim)
    k = k.permute(0, 2, 1, 3)  # [batch, kv_heads, keys, dim]
    v = v.permute(0, 2, 1, 3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [batch, kv_heads, group * queries, keys]
    scores = scores.view(batch, num_kv_heads, group, num_q, -1).masked_fill(~mask[:, None, None], float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs.flatten(2, 3), v)  # [batch, kv_heads, group * queries, dim]
    return out.view(batch, num_kv_heads, group, num_q, dim).permute(0, 3, 1, 2, 4).reshape(batch, num_q, num_heads, dim)
