"""Paged attention in plain PyTorch: the reference every faster backend is tested against.

K/V live in per-layer tensors [num_blocks, block_size, num_kv_heads, head_dim]; a request's
context is read through its block table, so where its blocks sit in the pool never changes the
result. An fp8 cache holds K/V divided by its layer's scales (`kv_quant`); reads multiply back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.attention.kv_cache import gather_blocks, store_kv, unit_scales
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.kv.sizes import cdiv


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
