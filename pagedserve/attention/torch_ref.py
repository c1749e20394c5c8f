"""The oracle: paged attention written the plain way, to test every backend against.

It shares no code with the backends (the test suite checks its imports): it takes the step from
`AttentionMetadata`'s block tables and lengths, and fp8 rounding from `kv_quant`, and does
everything else itself, one request at a time and by explicit indexing:
- a request's new token at context position t goes to block block_table[t // block_size], offset
  t % block_size (the slot mapping the backends use is not read);
- its context is read back block by block through its block table, as the step's dtype (an fp8
  cache times its layer's scale);
- attention is transformers' eager attention: scores scaled after q @ k^T, keys a query may not
  see (later positions, outside the sliding window) at -inf, softmax in float32, then @ V;
- with sinks (gpt-oss), each query head's sink logit is one more column of its scores: the
  softmax runs over scores and sink together, then the sink's column is dropped (it takes
  probability mass and adds no value), as transformers' gpt-oss eager attention does.
Slow, runs wherever torch does, and (without sinks) equal bit for bit to the torch backend's
prefill arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.attention.kv_quant import dequantize, is_fp8, quantize
from pagedserve.attention.metadata import AttentionMetadata


def paged_attention(
    q: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    k_cache: Tensor,
    v_cache: Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    kv_scales: Tensor | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Store this step's K/V in their slots, then attend for every request over its whole context.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim]. A token at context position p sees positions
    p - sliding_window < j <= p (all j <= p without a window). kv_scales: the layer's K and V
    scales, read by an fp8 cache (default 1.0). sinks: [num_heads] float32, each query head's sink
    logit (None: no sinks).
    """
    k_scale, v_scale = (1.0, 1.0) if kv_scales is None else (kv_scales[0], kv_scales[1])
    tables = md.block_tables.tolist()
    qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
    # Request i's new tokens are rows qsl[i]:qsl[i+1] of the batch, the last of its seq_lens[i]
    # context positions. Every write comes first: they are part of the request's own context.
    for i, table in enumerate(tables if k is not None else ()):  # k None: a KV-shared layer stores nothing
        first_pos = seq_lens[i] - (qsl[i + 1] - qsl[i])
        for row in range(qsl[i], qsl[i + 1]):
            _write(k_cache, table, first_pos + row - qsl[i], k[row], k_scale)
            _write(v_cache, table, first_pos + row - qsl[i], v[row], v_scale)
    out = torch.empty_like(q)
    for i, table in enumerate(tables):
        keys = _read_context(k_cache, table, seq_lens[i], q.dtype, k_scale)
        values = _read_context(v_cache, table, seq_lens[i], q.dtype, v_scale)
        first_pos = seq_lens[i] - (qsl[i + 1] - qsl[i])
        out[qsl[i]:qsl[i + 1]] = _attend(q[qsl[i]:qsl[i + 1]], keys, values, first_pos, scale, sliding_window,
                                         sinks)
    return out


def _write(cache: Tensor, table: list[int], pos: int, x: Tensor, scale: Tensor | float) -> None:
    """Put the K or V row x [kv_heads, dim] of context position pos in its block's slot."""
    block_size = cache.shape[1]
    cache[table[pos // block_size], pos % block_size] = quantize(x, scale) if is_fp8(cache) else x


def _read_context(cache: Tensor, table: list[int], seq_len: int, dtype: torch.dtype, scale: Tensor | float) -> Tensor:
    """The first seq_len positions of a request's context, [seq_len, kv_heads, dim] as `dtype`."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = [dequantize(cache[b], dtype, scale) for b in table[:num_blocks]]
    return torch.cat(blocks)[:seq_len]


def _attend(q: Tensor, keys: Tensor, values: Tensor, first_pos: int, scale: float, window: int | None,
            sinks: Tensor | None) -> Tensor:
    """One request's attention: q [n, heads, dim] at context positions first_pos .. first_pos+n-1
    over keys, values [seq_len, kv_heads, dim]. Returns [n, heads, dim].

    Query head h reads KV head h // group, as transformers' repeat_kv arranges it. The group's
    query heads are stacked as the KV head's rows, [kv_heads, group * n, dim], rather than K and V
    repeated per query head: the same products in the same order as the torch backend's, so its
    results for prompts are bit for bit these.
    """
    n, num_heads, dim = q.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    q_rows = q.reshape(n, num_kv_heads, group, dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, dim)
    scores = torch.matmul(q_rows, keys.permute(1, 2, 0)) * scale  # [kv_heads, group * n, seq_len]

    query_pos = torch.arange(first_pos, first_pos + n, device=q.device)[:, None]
    key_pos = torch.arange(seq_len, device=q.device)[None, :]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    scores = scores.view(num_kv_heads, group, n, seq_len).masked_fill(~allowed, float("-inf"))

    if sinks is None:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sink_column = sinks.float().view(num_kv_heads, group, 1, 1).expand(num_kv_heads, group, n, 1)
        with_sinks = F.softmax(torch.cat([scores.float(), sink_column], dim=-1), dim=-1)
        probs = with_sinks[..., :seq_len].to(q.dtype)
    out = torch.matmul(probs.reshape(num_kv_heads, group * n, seq_len), values.transpose(0, 1))
    return out.view(num_kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, num_heads, dim)
